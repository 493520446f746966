/*
 * remote.c - the part of each round that crosses nodes, for the engine;
 * see remote.h.
 *
 * Per round, this daemon sends every peer daemon the buckets its local
 * ranks owe that peer's ranks and receives the buckets owed to its own.
 * Both sides walk the round's buckets in the plan's order (source rank,
 * owner, device type, dtype) and each bucket's moves in order, and each
 * move's elements in row-major order of its box, so one byte stream per
 * pair of nodes needs no framing: the plan says what every byte is.
 *
 * Nothing is copied that need not be: a send gathers straight from the
 * trainer's registered storage, an iovec per contiguous run of the move's
 * source view, and a receive scatters straight into the owner's tensor in
 * the pool, an iovec per contiguous run of its destination.  Two kinds of
 * move go through a staging buffer instead:
 *   - a view too fragmented to be worth an iovec per run (runs shorter than
 *     REMOTE_MIN_RUN bytes on average) is packed before the exchange, or
 *     unpacked after it, by the engine's copying threads;
 *   - a replica of an affine piece arriving from another node is compared
 *     with the other replicas (different_data), so it lands in staging and
 *     the whole key's moves to its owner, local ones included, run after
 *     the exchange in the same order as on one node.
 * Staging holds at most the round's traffic, which the planner bounds by
 * max(max_bytes, the largest key).
 *
 * The round's local moves (both ranks on this node) are copied by the
 * engine's threads while the exchange runs on the engine's own thread
 * (engine.c); xfer_exchange() serves every peer at once from that one
 * thread.
 *
 * Rounds overlap on the wire: while a round is exchanged, each peer's
 * byte stream goes on into the next round's, as far as that round's moves
 * go straight (from a trainer's storage, into an owner's tensor; its
 * tensors are made present before, engine.c), up to its first move that
 * goes through staging, which waits for its round.  Those bytes are
 * optional (stream.h): the round ends when its own bytes are moved, and
 * the next round starts where its stream stopped.  Tensors of different
 * rounds are different keys, so a byte moved ahead never lands where the
 * current round writes, and staging still holds one round at most.  The exchange reports every byte it moves, so that a slow peer is
 * never mistaken for a lost one; a peer that moves nothing for the export's
 * timeout, or whose connection ends, fails the export naming that node.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/xfer/remote.h"
#include "daemon/xfer/stream.h"
#include "shardport.h"

/* Runs shorter than this (on average over a move) are packed: an iovec
 * costs about as much as copying a few hundred bytes, and writev takes at
 * most IOV_MAX of them per call. */
#define REMOTE_MIN_RUN 512u

/* A growing list of regions, with the move each one belongs to (to name
 * the rank and key when a source cannot be read). */
struct iovvec {
  struct iovec *v;
  const struct plan_move **mv;
  size_t n, cap;
};

struct remote {
  const struct plan *plan;
  uint32_t self;
  uint32_t nnodes;
  struct remote_peer_setup *peers; /* [nnodes] */
  const struct xfer_storage *const *src;
  uint8_t *const *dst;
  const uint64_t *key_offset;
  uint64_t export_id;
  uint32_t timeout_ms;
  struct remote_ops ops;
  uint64_t bytes_total;
  /* The current round. */
  struct iovvec *send, *recv; /* [nnodes] */
  struct xfer_peer *xp;       /* [nnodes] */
  uint64_t *seen_sent, *seen_recv;
  struct plan_move *pack, *early, *late;
  uint64_t *pack_off, *late_off;
  size_t npack, nearly, nlate, cap_pack, cap_early, cap_late;
  /* Staging offset of each staged move, in the order classify() and
   * build_iovs() both walk the round's buckets. */
  uint64_t *order_off;
  size_t norder, cap_order;
  uint8_t *staging;
  size_t staging_cap;
  uint8_t *deferred; /* [nkeys]: a replica key whose moves run late */
  _Atomic uint64_t *bytes_moved;
  /* Per peer: the regions of the round's own bytes in send and recv (the
   * rest are the next round's), those bytes, and how many of them were
   * moved ahead, during the previous round. */
  size_t *own_send, *own_recv;
  uint64_t *own_send_bytes, *own_recv_bytes;
  uint64_t *ahead_sent, *ahead_recv;
  /* Per peer, while the next round's regions are listed: whether a move
   * through staging was met, after which its stream waits. */
  bool *stop_send, *stop_recv;
};

static int grow_moves(struct plan_move **a, uint64_t **off, size_t *cap,
                      size_t need) {
  if (need <= *cap)
    return 0;
  size_t ncap = *cap > 0 ? *cap : 64;
  while (ncap < need)
    ncap *= 2;
  struct plan_move *p = realloc(*a, ncap * sizeof *p);
  if (p == NULL)
    return SP_ENOMEM;
  *a = p;
  if (off != NULL) {
    uint64_t *o = realloc(*off, ncap * sizeof *o);
    if (o == NULL)
      return SP_ENOMEM;
    *off = o;
  }
  *cap = ncap;
  return 0;
}

static int iov_push(struct iovvec *v, void *base, size_t len,
                    const struct plan_move *m) {
  if (v->n == v->cap) {
    size_t ncap = v->cap > 0 ? 2 * v->cap : 64;
    struct iovec *p = realloc(v->v, ncap * sizeof *p);
    if (p == NULL)
      return SP_ENOMEM;
    v->v = p;
    const struct plan_move **q = realloc(v->mv, ncap * sizeof *q);
    if (q == NULL)
      return SP_ENOMEM;
    v->mv = q;
    v->cap = ncap;
  }
  v->v[v->n] = (struct iovec){base, len};
  v->mv[v->n] = m;
  v->n++;
  return 0;
}

static uint32_t node_of(const struct remote *r, uint32_t rank) {
  return (uint32_t)r->plan->node[rank];
}

/* ---- runs ---- */

/* A box's layout reduced to what its runs need: the dims that are not
 * merged into the innermost contiguous run, and that run's bytes. */
struct runs {
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
  uint64_t run;   /* bytes */
  uint64_t count; /* runs */
};

static void runs_of(uint32_t ndim, const int64_t *shape, const int64_t *stride,
                    size_t esz, struct runs *out) {
  int64_t inner = 1;
  int d = (int)ndim - 1;
  /* Dims of one element do not break contiguity, whatever their stride. */
  while (d >= 0 && (shape[d] == 1 || stride[d] == inner)) {
    inner *= shape[d];
    d--;
  }
  out->ndim = 0;
  out->count = 1;
  for (int k = 0; k <= d; k++) {
    if (shape[k] == 1)
      continue;
    out->shape[out->ndim] = shape[k];
    out->stride[out->ndim] = stride[k];
    out->ndim++;
    out->count *= (uint64_t)shape[k];
  }
  out->run = (uint64_t)inner * esz;
}

/* Worth an iovec per run: long runs, or a single one. */
static bool runs_direct(const struct runs *rs) {
  return rs->count <= 1 || rs->run >= REMOTE_MIN_RUN;
}

/* An iovec per run, in row-major order of the box. */
static int push_runs(struct iovvec *v, uint8_t *base, const struct runs *rs,
                     size_t esz, const struct plan_move *m) {
  int64_t idx[SP_MAX_DIMS] = {0};
  if (rs->run == 0)
    return 0;
  for (;;) {
    int64_t at = 0;
    for (uint32_t d = 0; d < rs->ndim; d++)
      at += idx[d] * rs->stride[d];
    int rc = iov_push(v, base + (size_t)at * esz, (size_t)rs->run, m);
    if (rc != 0)
      return rc;
    uint32_t d = rs->ndim;
    while (d > 0 && ++idx[d - 1] == rs->shape[d - 1])
      idx[--d] = 0;
    if (d == 0)
      return 0;
  }
}

/* ---- setup ---- */

int remote_new(const struct remote_setup *s, struct remote **out) {
  struct remote *r = calloc(1, sizeof *r);
  if (r == NULL)
    return SP_ENOMEM;
  r->plan = s->plan;
  r->self = s->self;
  r->nnodes = s->nnodes;
  r->src = s->src;
  r->dst = s->dst;
  r->key_offset = s->key_offset;
  r->export_id = s->export_id;
  r->timeout_ms = s->timeout_ms;
  r->ops = s->ops;
  r->peers = calloc(s->nnodes, sizeof *r->peers);
  r->send = calloc(s->nnodes, sizeof *r->send);
  r->recv = calloc(s->nnodes, sizeof *r->recv);
  r->xp = calloc(s->nnodes, sizeof *r->xp);
  r->seen_sent = calloc(s->nnodes, sizeof *r->seen_sent);
  r->seen_recv = calloc(s->nnodes, sizeof *r->seen_recv);
  r->deferred = calloc(s->plan->nkeys > 0 ? s->plan->nkeys : 1, 1);
  r->own_send = calloc(s->nnodes, sizeof *r->own_send);
  r->own_recv = calloc(s->nnodes, sizeof *r->own_recv);
  r->own_send_bytes = calloc(s->nnodes, sizeof *r->own_send_bytes);
  r->own_recv_bytes = calloc(s->nnodes, sizeof *r->own_recv_bytes);
  r->ahead_sent = calloc(s->nnodes, sizeof *r->ahead_sent);
  r->ahead_recv = calloc(s->nnodes, sizeof *r->ahead_recv);
  r->stop_send = calloc(s->nnodes, sizeof *r->stop_send);
  r->stop_recv = calloc(s->nnodes, sizeof *r->stop_recv);
  if (r->peers == NULL || r->send == NULL || r->recv == NULL || r->xp == NULL ||
      r->seen_sent == NULL || r->seen_recv == NULL || r->deferred == NULL ||
      r->own_send == NULL || r->own_recv == NULL ||
      r->own_send_bytes == NULL || r->own_recv_bytes == NULL ||
      r->ahead_sent == NULL || r->ahead_recv == NULL ||
      r->stop_send == NULL || r->stop_recv == NULL) {
    remote_free(r);
    return SP_ENOMEM;
  }
  memcpy(r->peers, s->peers, s->nnodes * sizeof *r->peers);
  /* What this node moves: the copies into its owners, and every byte it
   * sends or receives. */
  const struct plan *plan = s->plan;
  for (size_t k = 0; k < plan->nrounds; k++) {
    const struct plan_round *rd = &plan->rounds[k];
    for (size_t i = 0; i < rd->nlocal; i++)
      if (node_of(r, rd->local[i].dst) == r->self)
        r->bytes_total += rd->local[i].nbytes;
    for (size_t b = 0; b < rd->nbuckets; b++) {
      const struct plan_bucket *bk = &rd->buckets[b];
      if ((node_of(r, bk->src) == r->self) != (node_of(r, bk->dst) == r->self))
        r->bytes_total += bk->nbytes;
    }
  }
  *out = r;
  return 0;
}

void remote_free(struct remote *r) {
  if (r == NULL)
    return;
  for (uint32_t n = 0; r->send != NULL && n < r->nnodes; n++) {
    free(r->send[n].v);
    free(r->send[n].mv);
  }
  for (uint32_t n = 0; r->recv != NULL && n < r->nnodes; n++) {
    free(r->recv[n].v);
    free(r->recv[n].mv);
  }
  free(r->send);
  free(r->recv);
  free(r->xp);
  free(r->seen_sent);
  free(r->seen_recv);
  free(r->peers);
  free(r->pack);
  free(r->pack_off);
  free(r->early);
  free(r->late);
  free(r->late_off);
  free(r->order_off);
  free(r->staging);
  free(r->deferred);
  free(r->own_send);
  free(r->own_recv);
  free(r->own_send_bytes);
  free(r->own_recv_bytes);
  free(r->ahead_sent);
  free(r->ahead_recv);
  free(r->stop_send);
  free(r->stop_recv);
  free(r);
}

uint64_t remote_bytes_total(const struct remote *r) { return r->bytes_total; }

/* ---- one round ---- */

static size_t esize_of(const struct remote *r, const struct plan_move *m) {
  return sp_dtype_size(r->plan->keys[m->key].dtype);
}

static int push_order(struct remote *r, uint64_t off) {
  if (r->norder == r->cap_order) {
    size_t ncap = r->cap_order > 0 ? 2 * r->cap_order : 64;
    uint64_t *p = realloc(r->order_off, ncap * sizeof *p);
    if (p == NULL)
      return SP_ENOMEM;
    r->order_off = p;
    r->cap_order = ncap;
  }
  r->order_off[r->norder++] = off;
  return 0;
}

/* Decides, for each move this node sends or receives, whether it goes
 * straight or through staging, and lists the staged ones. */
static int classify(struct remote *r, const struct plan_round *rd,
                    uint64_t *staging) {
  *staging = 0;
  for (size_t b = 0; b < rd->nbuckets; b++) {
    const struct plan_bucket *bk = &rd->buckets[b];
    bool out = node_of(r, bk->src) == r->self;
    bool in = node_of(r, bk->dst) == r->self;
    if (out == in)
      continue;
    for (size_t i = bk->first; i < bk->first + bk->nmoves; i++) {
      const struct plan_move *m = &rd->moves[i];
      struct sp_view sv;
      struct plan_region dr;
      struct runs rs;
      plan_moves_regions(r->plan, m, &sv, &dr);
      if (out) {
        runs_of(sv.ndim, sv.shape, sv.stride, esize_of(r, m), &rs);
        if (runs_direct(&rs))
          continue;
        if (grow_moves(&r->pack, &r->pack_off, &r->cap_pack, r->npack + 1))
          return SP_ENOMEM;
        r->pack[r->npack] = *m;
        r->pack_off[r->npack++] = *staging;
      } else {
        runs_of(dr.ndim, dr.shape, dr.stride, esize_of(r, m), &rs);
        bool replica = (m->flags & PLAN_MOVE_REPLICA) != 0;
        if (runs_direct(&rs) && !replica)
          continue;
        if (replica)
          r->deferred[m->key] = 1;
        if (grow_moves(&r->late, &r->late_off, &r->cap_late, r->nlate + 1))
          return SP_ENOMEM;
        r->late[r->nlate] = *m;
        r->late_off[r->nlate++] = *staging;
      }
      if (push_order(r, *staging) != 0)
        return SP_ENOMEM;
      *staging += m->nbytes;
    }
  }
  return 0;
}

/* The order of a node's local moves (rounds.c): owner, then key, source
 * rank and piece; late moves keep it so that replicas compare as on one
 * node. */
static int move_order(const void *a, const void *b) {
  const struct plan_move *x = a, *y = b;
  if (x->dst != y->dst)
    return x->dst < y->dst ? -1 : 1;
  if (x->key != y->key)
    return x->key < y->key ? -1 : 1;
  if (x->src != y->src)
    return x->src < y->src ? -1 : 1;
  return x->piece < y->piece ? -1 : x->piece > y->piece;
}

/* Sorts late moves and their staging offsets together. */
static int sort_late(struct remote *r) {
  struct pair {
    struct plan_move m;
    uint64_t off;
  } *p = malloc((r->nlate > 0 ? r->nlate : 1) * sizeof *p);
  if (p == NULL)
    return SP_ENOMEM;
  for (size_t i = 0; i < r->nlate; i++)
    p[i] = (struct pair){r->late[i], r->late_off[i]};
  qsort(p, r->nlate, sizeof *p, move_order);
  for (size_t i = 0; i < r->nlate; i++) {
    r->late[i] = p[i].m;
    r->late_off[i] = p[i].off;
  }
  free(p);
  return 0;
}

/* This node's local moves: early, or late for a deferred replica key. */
static int split_local(struct remote *r, const struct plan_round *rd) {
  for (size_t i = 0; i < rd->nlocal; i++) {
    const struct plan_move *m = &rd->local[i];
    if (node_of(r, m->dst) != r->self)
      continue;
    if (r->deferred[m->key]) {
      if (grow_moves(&r->late, &r->late_off, &r->cap_late, r->nlate + 1))
        return SP_ENOMEM;
      r->late[r->nlate] = *m;
      r->late_off[r->nlate++] = UINT64_MAX;
    } else {
      if (grow_moves(&r->early, NULL, &r->cap_early, r->nearly + 1))
        return SP_ENOMEM;
      r->early[r->nearly++] = *m;
    }
  }
  return 0;
}

/* Where a move this node sends (out) leaves from, or one it receives
 * lands, and its runs there; whether it goes straight, an iovec per run,
 * rather than through staging. */
static bool move_direct(const struct remote *r, const struct plan_move *m,
                        bool out, struct runs *rs, uint8_t **base) {
  size_t esz = esize_of(r, m);
  struct sp_view sv;
  struct plan_region dr;
  plan_moves_regions(r->plan, m, &sv, &dr);
  if (out) {
    runs_of(sv.ndim, sv.shape, sv.stride, esz, rs);
    *base = (uint8_t *)r->src[m->src][m->from->storage].data +
            (size_t)sv.offset * esz;
    return runs_direct(rs);
  }
  runs_of(dr.ndim, dr.shape, dr.stride, esz, rs);
  *base = r->dst[m->dst] + r->key_offset[m->key] + (size_t)dr.offset * esz;
  return runs_direct(rs) && !(m->flags & PLAN_MOVE_REPLICA);
}

/* A round's iovecs, walking the buckets as classify() did.  ahead: the
 * next round's, after the current round's, each peer's stream only up to
 * its first move through staging. */
static int build_iovs(struct remote *r, const struct plan_round *rd,
                      bool ahead) {
  size_t staged = 0;
  for (uint32_t n = 0; ahead && n < r->nnodes; n++)
    r->stop_send[n] = r->stop_recv[n] = false;
  for (size_t b = 0; b < rd->nbuckets; b++) {
    const struct plan_bucket *bk = &rd->buckets[b];
    uint32_t sn = node_of(r, bk->src), dn = node_of(r, bk->dst);
    bool out = sn == r->self;
    bool in = dn == r->self;
    if (out == in)
      continue;
    struct iovvec *v = out ? &r->send[dn] : &r->recv[sn];
    bool *stop = out ? &r->stop_send[dn] : &r->stop_recv[sn];
    for (size_t i = bk->first; i < bk->first + bk->nmoves && !(ahead && *stop);
         i++) {
      const struct plan_move *m = &rd->moves[i];
      struct runs rs;
      uint8_t *base;
      bool direct = move_direct(r, m, out, &rs, &base);
      if (!direct && ahead) {
        *stop = true;
        continue;
      }
      int rc = direct ? push_runs(v, base, &rs, esize_of(r, m), m)
                      : iov_push(v, r->staging + r->order_off[staged++],
                                 (size_t)m->nbytes, m);
      if (rc != 0)
        return rc;
    }
  }
  return 0;
}

static uint64_t iovs_bytes(const struct iovvec *v, size_t from, size_t to) {
  uint64_t n = 0;
  for (size_t i = from; i < to; i++)
    n += v->v[i].iov_len;
  return n;
}

int remote_round(struct remote *r, size_t round, struct remote_round *out,
                 char *msg, size_t msglen) {
  const struct plan_round *rd = &r->plan->rounds[round];
  for (size_t i = 0; i < rd->nkeys; i++)
    r->deferred[r->plan->transfer[rd->first + i]] = 0;
  r->npack = r->nearly = r->nlate = r->norder = 0;
  for (uint32_t n = 0; n < r->nnodes; n++)
    r->send[n].n = r->recv[n].n = 0;
  uint64_t staging;
  int rc = classify(r, rd, &staging);
  if (rc == 0 && staging > r->staging_cap) {
    /* The round's traffic at most: the planner's bound on staging. */
    free(r->staging);
    r->staging = malloc((size_t)staging);
    r->staging_cap = r->staging != NULL ? (size_t)staging : 0;
    if (r->staging == NULL)
      rc = SP_ENOMEM;
  }
  if (rc == 0)
    rc = split_local(r, rd);
  if (rc == 0)
    rc = sort_late(r);
  if (rc == 0)
    rc = build_iovs(r, rd, false);
  for (uint32_t n = 0; rc == 0 && n < r->nnodes; n++) {
    r->own_send[n] = r->send[n].n;
    r->own_recv[n] = r->recv[n].n;
    r->own_send_bytes[n] = iovs_bytes(&r->send[n], 0, r->send[n].n);
    r->own_recv_bytes[n] = iovs_bytes(&r->recv[n], 0, r->recv[n].n);
  }
  if (rc == 0 && round + 1 < r->plan->nrounds)
    rc = build_iovs(r, &r->plan->rounds[round + 1], true);
  if (rc != 0) {
    snprintf(msg, msglen,
             "out of memory preparing round %zu of export %" PRIu64 " (%" PRIu64
             " bytes of staging)",
             round + 1, r->export_id, staging);
    return rc;
  }
  *out = (struct remote_round){.pack = r->pack,
                               .npack = r->npack,
                               .early = r->early,
                               .nearly = r->nearly,
                               .late = r->late,
                               .nlate = r->nlate};
  return 0;
}

/* Rewrites a region as the row-major, contiguous layout of the box. */
static void contiguous(uint32_t ndim, const int64_t *shape, int64_t *stride,
                       int64_t *offset) {
  int64_t s = 1;
  for (uint32_t d = ndim; d-- > 0;) {
    stride[d] = s;
    s *= shape[d];
  }
  *offset = 0;
}

const uint8_t *remote_source(const struct remote *r, const struct plan_move *m,
                             struct sp_view *sv) {
  if (m < r->late || m >= r->late + r->nlate || node_of(r, m->src) == r->self)
    return NULL;
  contiguous(sv->ndim, sv->shape, sv->stride, &sv->offset);
  return r->staging + r->late_off[m - r->late];
}

uint8_t *remote_dest(const struct remote *r, const struct plan_move *m,
                     struct plan_region *dr) {
  if (m < r->pack || m >= r->pack + r->npack)
    return NULL;
  contiguous(dr->ndim, dr->shape, dr->stride, &dr->offset);
  return r->staging + r->pack_off[m - r->pack];
}

/* ---- the exchange ---- */

static void add_bytes(_Atomic uint64_t *counter, uint64_t bytes) {
  if (counter != NULL && bytes > 0)
    atomic_fetch_add_explicit(counter, bytes, memory_order_relaxed);
}

static void on_progress(void *arg, uint64_t bytes) {
  struct remote *r = arg;
  atomic_fetch_add_explicit(r->bytes_moved, bytes, memory_order_relaxed);
  /* Which peer moved them: the one whose counters changed. */
  for (uint32_t n = 0; n < r->nnodes; n++) {
    const struct xfer_peer *p = &r->xp[n];
    const struct remote_peer_setup *ps = &r->peers[n];
    uint64_t sent = p->sent - r->seen_sent[n];
    uint64_t received = p->received - r->seen_recv[n];
    r->seen_sent[n] = p->sent;
    r->seen_recv[n] = p->received;
    for (int c = 0; c < REMOTE_PEER_COUNTERS; c++) {
      add_bytes(ps->sent[c], sent);
      add_bytes(ps->received[c], received);
    }
  }
}

int remote_exchange(struct remote *r, const atomic_bool *cancel,
                    _Atomic uint64_t *bytes_moved, uint32_t *lost_node,
                    char *msg, size_t msglen) {
  r->bytes_moved = bytes_moved;
  for (uint32_t n = 0; n < r->nnodes; n++) {
    struct xfer_peer *p = &r->xp[n];
    *p = (struct xfer_peer){
        .sock = r->peers[n].sock,
        .send = {.iov = r->send[n].v,
                 .n = r->send[n].n,
                 .optional = r->send[n].n - r->own_send[n]},
        .recv = {.iov = r->recv[n].v,
                 .n = r->recv[n].n,
                 .optional = r->recv[n].n - r->own_recv[n]},
    };
    /* What the previous round moved of this one's. */
    xfer_iovs_skip(&p->send, r->ahead_sent[n]);
    xfer_iovs_skip(&p->recv, r->ahead_recv[n]);
    r->seen_sent[n] = r->seen_recv[n] = 0;
    if ((r->own_send[n] > 0 || r->own_recv[n] > 0) && p->sock < 0) {
      r->ops.node_lost(r->ops.arg, n, r->peers[n].addr, r->export_id, 0, msg,
                       msglen);
      *lost_node = n;
      return SP_ENODELOST;
    }
  }
  struct xfer_watch watch = {.cancel = cancel,
                             .idle_timeout_ms = r->timeout_ms,
                             .progress = on_progress,
                             .arg = r};
  size_t failed = 0;
  int rc = xfer_exchange(r->xp, r->nnodes, &watch, &failed);
  if (rc == 0) {
    /* Beyond this round's own bytes, the next round's moved ahead. */
    for (uint32_t n = 0; n < r->nnodes; n++) {
      r->ahead_sent[n] =
          r->xp[n].sent - (r->own_send_bytes[n] - r->ahead_sent[n]);
      r->ahead_recv[n] =
          r->xp[n].received - (r->own_recv_bytes[n] - r->ahead_recv[n]);
    }
    return 0;
  }
  if (rc == 1)
    return rc;
  if (rc == SP_ENOMEM) {
    snprintf(msg, msglen, "out of memory exchanging export %" PRIu64,
             r->export_id);
    return rc;
  }
  if (rc == SP_EBADFD) {
    const struct iovvec *v = &r->send[failed];
    const struct plan_move *m = v->mv[r->xp[failed].send.next];
    snprintf(msg, msglen,
             "rank %u's storage sid %u could not be read for key '%s' (was "
             "its file truncated after it was registered?)",
             m->src, r->src[m->src][m->from->storage].sid,
             r->plan->keys[m->key].name);
    return rc;
  }
  *lost_node = (uint32_t)failed;
  r->ops.node_lost(r->ops.arg, (uint32_t)failed, r->peers[failed].addr,
                   r->export_id, rc, msg, msglen);
  return SP_ENODELOST;
}
