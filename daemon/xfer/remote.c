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
 * A pair of nodes may move its bytes over several connections (streams):
 * each round's byte stream of the pair, and each part of it moved ahead,
 * is dealt over them in stripes of REMOTE_STRIPE_BYTES counted from that
 * round's first byte, so both sides cut the same bytes the same way and
 * each stream keeps its own order.  Each stream past the first is served
 * by a thread of its own, so that the kernel's copies of a pair's bytes
 * run on several CPUs; a stream that fails halts the others at once.
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
#include "daemon/xfer/thread.h"
#include "proto/monotonic.h"
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
  /* Streams: the most any peer has, and each peer's (at least 1).  The
   * lists of stream s to peer n are at index s * nnodes + n of every
   * per-list array below (nlists of them). */
  uint32_t nstreams;
  uint32_t *peer_streams; /* [nnodes] */
  size_t nlists;
  /* The current round. */
  struct iovvec *send, *recv; /* [nlists] */
  struct xfer_peer *xp;       /* [nlists] */
  /* Per peer, while a part of a round is listed: its bytes so far in each
   * direction, which say the stripe (and stream) of the next. */
  uint64_t *at_send, *at_recv;
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
  /* Per list: the regions of the round's own bytes in send and recv (the
   * rest are the next round's), those bytes, and how many of them were
   * moved ahead, during the previous round. */
  size_t *own_send, *own_recv;
  uint64_t *own_send_bytes, *own_recv_bytes;
  uint64_t *ahead_sent, *ahead_recv;
  /* The exchange under way: the streams' halt flag, and when the first
   * byte of the next round's left (0: none yet). */
  atomic_bool halt;
  _Atomic uint64_t ahead_began_ns;
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

/* Where a peer's bytes go, in one direction: the lists of its streams. */
struct sink {
  struct iovvec *lists; /* r->send or r->recv */
  uint64_t *at;         /* the bytes listed so far in this part */
  uint32_t peer, nnodes, nstreams;
};

/* A region of the pair's byte stream, dealt over its streams in stripes. */
static int stripe_push(const struct sink *k, uint8_t *base, size_t len,
                       const struct plan_move *m) {
  while (len > 0) {
    uint64_t stripe = *k->at / REMOTE_STRIPE_BYTES;
    size_t room = REMOTE_STRIPE_BYTES - (size_t)(*k->at % REMOTE_STRIPE_BYTES);
    size_t take = k->nstreams == 1 || len < room ? len : room;
    size_t list = (size_t)(stripe % k->nstreams) * k->nnodes + k->peer;
    int rc = iov_push(&k->lists[list], base, take, m);
    if (rc != 0)
      return rc;
    base += take;
    len -= take;
    *k->at += take;
  }
  return 0;
}

/* An iovec per run, in row-major order of the box. */
static int push_runs(const struct sink *k, uint8_t *base,
                     const struct runs *rs, size_t esz,
                     const struct plan_move *m) {
  int64_t idx[SP_MAX_DIMS] = {0};
  if (rs->run == 0)
    return 0;
  for (;;) {
    int64_t at = 0;
    for (uint32_t d = 0; d < rs->ndim; d++)
      at += idx[d] * rs->stride[d];
    int rc = stripe_push(k, base + (size_t)at * esz, (size_t)rs->run, m);
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
  r->nstreams = 1;
  for (uint32_t n = 0; n < s->nnodes; n++)
    if (s->peers[n].nsocks > r->nstreams)
      r->nstreams = s->peers[n].nsocks;
  size_t nl = (size_t)s->nnodes * r->nstreams;
  r->nlists = nl;
  r->peers = calloc(s->nnodes, sizeof *r->peers);
  r->peer_streams = calloc(s->nnodes, sizeof *r->peer_streams);
  r->at_send = calloc(s->nnodes, sizeof *r->at_send);
  r->at_recv = calloc(s->nnodes, sizeof *r->at_recv);
  r->send = calloc(nl, sizeof *r->send);
  r->recv = calloc(nl, sizeof *r->recv);
  r->xp = calloc(nl, sizeof *r->xp);
  r->deferred = calloc(s->plan->nkeys > 0 ? s->plan->nkeys : 1, 1);
  r->own_send = calloc(nl, sizeof *r->own_send);
  r->own_recv = calloc(nl, sizeof *r->own_recv);
  r->own_send_bytes = calloc(nl, sizeof *r->own_send_bytes);
  r->own_recv_bytes = calloc(nl, sizeof *r->own_recv_bytes);
  r->ahead_sent = calloc(nl, sizeof *r->ahead_sent);
  r->ahead_recv = calloc(nl, sizeof *r->ahead_recv);
  r->stop_send = calloc(s->nnodes, sizeof *r->stop_send);
  r->stop_recv = calloc(s->nnodes, sizeof *r->stop_recv);
  if (r->peers == NULL || r->peer_streams == NULL || r->at_send == NULL ||
      r->at_recv == NULL || r->send == NULL || r->recv == NULL ||
      r->xp == NULL || r->deferred == NULL ||
      r->own_send == NULL || r->own_recv == NULL ||
      r->own_send_bytes == NULL || r->own_recv_bytes == NULL ||
      r->ahead_sent == NULL || r->ahead_recv == NULL ||
      r->stop_send == NULL || r->stop_recv == NULL) {
    remote_free(r);
    return SP_ENOMEM;
  }
  memcpy(r->peers, s->peers, s->nnodes * sizeof *r->peers);
  for (uint32_t n = 0; n < s->nnodes; n++)
    r->peer_streams[n] = s->peers[n].nsocks > 0 ? s->peers[n].nsocks : 1;
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
  for (size_t l = 0; r->send != NULL && l < r->nlists; l++) {
    free(r->send[l].v);
    free(r->send[l].mv);
  }
  for (size_t l = 0; r->recv != NULL && l < r->nlists; l++) {
    free(r->recv[l].v);
    free(r->recv[l].mv);
  }
  free(r->send);
  free(r->recv);
  free(r->xp);
  free(r->peers);
  free(r->peer_streams);
  free(r->at_send);
  free(r->at_recv);
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

uint64_t remote_ahead_began_ns(const struct remote *r) {
  return atomic_load(&r->ahead_began_ns);
}

/* ---- one round ---- */

static size_t esize_of(const struct remote *r, const struct plan_move *m) {
  return sp__dtype_size(r->plan->keys[m->key].dtype);
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
    *base =
        (uint8_t *)r->src[m->src][m->storage].data + (size_t)sv.offset * esz;
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
  for (uint32_t n = 0; n < r->nnodes; n++) {
    r->at_send[n] = r->at_recv[n] = 0;
    if (ahead)
      r->stop_send[n] = r->stop_recv[n] = false;
  }
  for (size_t b = 0; b < rd->nbuckets; b++) {
    const struct plan_bucket *bk = &rd->buckets[b];
    uint32_t sn = node_of(r, bk->src), dn = node_of(r, bk->dst);
    bool out = sn == r->self;
    bool in = dn == r->self;
    if (out == in)
      continue;
    uint32_t peer = out ? dn : sn;
    struct sink k = {.lists = out ? r->send : r->recv,
                     .at = out ? &r->at_send[peer] : &r->at_recv[peer],
                     .peer = peer,
                     .nnodes = r->nnodes,
                     .nstreams = r->peer_streams[peer]};
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
      int rc = direct ? push_runs(&k, base, &rs, esize_of(r, m), m)
                      : stripe_push(&k, r->staging + r->order_off[staged++],
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
  for (size_t l = 0; l < r->nlists; l++)
    r->send[l].n = r->recv[l].n = 0;
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
  for (size_t l = 0; rc == 0 && l < r->nlists; l++) {
    r->own_send[l] = r->send[l].n;
    r->own_recv[l] = r->recv[l].n;
    r->own_send_bytes[l] = iovs_bytes(&r->send[l], 0, r->send[l].n);
    r->own_recv_bytes[l] = iovs_bytes(&r->recv[l], 0, r->recv[l].n);
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

/* One stream of every peer, exchanged on one thread. */
struct stream_run {
  struct remote *r;
  uint32_t stream;
  const atomic_bool *cancel;
  size_t failed; /* the peer, as xfer_exchange sets it */
  int rc;
  pthread_t thread;
};

static void on_progress(void *arg, size_t peer, bool sending,
                        uint64_t bytes) {
  const struct stream_run *sr = arg;
  struct remote *r = sr->r;
  atomic_fetch_add_explicit(r->bytes_moved, bytes, memory_order_relaxed);
  const struct remote_peer_setup *ps = &r->peers[peer];
  for (int c = 0; c < REMOTE_PEER_COUNTERS; c++)
    add_bytes(sending ? ps->sent[c] : ps->received[c], bytes);
  size_t l = (size_t)sr->stream * r->nnodes + peer;
  /* Past the round's own bytes: the next round's first have left. */
  if (sending && r->xp[l].sent > r->own_send_bytes[l] - r->ahead_sent[l] &&
      atomic_load_explicit(&r->ahead_began_ns, memory_order_relaxed) == 0) {
    uint64_t none = 0;
    atomic_compare_exchange_strong(&r->ahead_began_ns, &none,
                                   monotonic_ns());
  }
}

static void run_stream(struct stream_run *sr) {
  struct remote *r = sr->r;
  struct xfer_watch watch = {.cancel = sr->cancel,
                             .halt = &r->halt,
                             .idle_timeout_ms = r->timeout_ms,
                             .progress = on_progress,
                             .arg = sr};
  sr->failed = 0;
  sr->rc = xfer_exchange(r->xp + (size_t)sr->stream * r->nnodes, r->nnodes,
                         &watch, &sr->failed);
}

static void *stream_main(void *arg) {
  run_stream(arg);
  return NULL;
}

/* Runs every stream, the first on this thread; the first failure found
 * (by stream) is the result, else a cancel, else 0. */
static int exchange_streams(struct remote *r, const atomic_bool *cancel,
                            size_t *failed_list) {
  struct stream_run runs[REMOTE_STREAMS_MAX];
  uint32_t spawned = 1;
  atomic_store(&r->halt, false);
  for (uint32_t s = 0; s < r->nstreams; s++)
    runs[s] = (struct stream_run){.r = r, .stream = s, .cancel = cancel};
  for (; spawned < r->nstreams; spawned++)
    if (xfer_spawn(&runs[spawned].thread, stream_main, &runs[spawned]) != 0)
      break;
  if (spawned < r->nstreams) {
    atomic_store(&r->halt, true);
    runs[0].rc = SP_ENOMEM;
  } else {
    run_stream(&runs[0]);
  }
  for (uint32_t s = 1; s < spawned; s++)
    pthread_join(runs[s].thread, NULL);
  int rc = 0;
  for (uint32_t s = 0; s < spawned; s++) {
    if (runs[s].rc == 0 || (runs[s].rc == 1 && rc != 0))
      continue;
    if (rc == 0 || rc == 1) {
      rc = runs[s].rc;
      *failed_list = (size_t)s * r->nnodes + runs[s].failed;
    }
  }
  return rc;
}

int remote_exchange(struct remote *r, const atomic_bool *cancel,
                    _Atomic uint64_t *bytes_moved, uint32_t *lost_node,
                    char *msg, size_t msglen) {
  r->bytes_moved = bytes_moved;
  atomic_store(&r->ahead_began_ns, 0);
  for (size_t l = 0; l < r->nlists; l++) {
    uint32_t n = (uint32_t)(l % r->nnodes), s = (uint32_t)(l / r->nnodes);
    struct xfer_peer *p = &r->xp[l];
    *p = (struct xfer_peer){
        .sock = s < r->peers[n].nsocks ? r->peers[n].socks[s] : -1,
        .send = {.iov = r->send[l].v,
                 .n = r->send[l].n,
                 .optional = r->send[l].n - r->own_send[l]},
        .recv = {.iov = r->recv[l].v,
                 .n = r->recv[l].n,
                 .optional = r->recv[l].n - r->own_recv[l]},
    };
    /* What the previous round moved of this one's. */
    xfer_iovs_skip(&p->send, r->ahead_sent[l]);
    xfer_iovs_skip(&p->recv, r->ahead_recv[l]);
    if ((r->own_send[l] > 0 || r->own_recv[l] > 0) && p->sock < 0) {
      r->ops.node_lost(r->ops.arg, n, r->peers[n].addr, r->export_id, 0, msg,
                       msglen);
      *lost_node = n;
      return SP_ENODELOST;
    }
  }
  size_t failed_list = 0;
  int rc = exchange_streams(r, cancel, &failed_list);
  if (rc == 0) {
    /* Beyond this round's own bytes, the next round's moved ahead. */
    for (size_t l = 0; l < r->nlists; l++) {
      r->ahead_sent[l] =
          r->xp[l].sent - (r->own_send_bytes[l] - r->ahead_sent[l]);
      r->ahead_recv[l] =
          r->xp[l].received - (r->own_recv_bytes[l] - r->ahead_recv[l]);
    }
    return 0;
  }
  uint32_t failed = (uint32_t)(failed_list % r->nnodes);
  if (rc == 1)
    return rc;
  if (rc == SP_ENOMEM) {
    snprintf(msg, msglen, "out of memory exchanging export %" PRIu64,
             r->export_id);
    return rc;
  }
  if (rc == SP_EBADFD) {
    const struct iovvec *v = &r->send[failed_list];
    const struct plan_move *m = v->mv[r->xp[failed_list].send.next];
    snprintf(msg, msglen,
             "rank %u's storage sid %u could not be read for key '%s' (was "
             "its file truncated after it was registered?)",
             m->src, r->src[m->src][m->storage].sid,
             r->plan->keys[m->key].name);
    return rc;
  }
  *lost_node = failed;
  r->ops.node_lost(r->ops.arg, failed, r->peers[failed].addr,
                   r->export_id, rc, msg, msglen);
  return SP_ENODELOST;
}
