/*
 * consume_moves.c - the moves from the trainers' sending boxes into the
 * consumers' boxes, cut into rounds and bucketed.
 *
 * A move is the intersection of one sending box and one destination box
 * of the same key: both are boxes of the whole tensor, so the intersection
 * is a box again, read through the sender's view and written through the
 * consumer's, each offset by where the intersection starts in its box.
 * The sending boxes of a key are disjoint and cover it (consume_sources.c),
 * so every wanted element is carried once.
 *
 * Rounds walk the keys with traffic in name order with the export's rules
 * (rounds.c): a round closes before a key that would make it hold more than
 * max_keys keys or more than max_bytes of traffic, and a larger key travels
 * alone.  Within a round, moves are generated key by key in name order,
 * each key's by destination box (consumer, then the consumer's pieces in
 * its order) and then sending rank, and sorted stably by counting sorts,
 * so a round costs O(moves + world + consumers).  Moves to a consumer on
 * the sender's node are local copies, listed by (sender, consumer) for the
 * senders and by (consumer, sender) for the consumers; the others are
 * bucketed by (sender, consumer, device type, dtype), and both sides read
 * one bucket's moves in the same order, so a send and its receive agree on
 * length and layout.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/consume_internal.h"

/* Every wanted key's sending boxes: key i's are box[first[i] ..
 * first[i+1]). */
struct sources {
  size_t *first;
  struct consume_box *box;
};

static int gather_sources(const struct consume_trainers *tr,
                          const struct consume_wants *wants,
                          struct sources *src, char *msg, size_t msglen) {
  size_t total = 0;

  src->first = malloc((wants->nkeys + 1) * sizeof *src->first);
  if (src->first == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  src->first[0] = 0;
  for (size_t i = 0; i < wants->nkeys; i++) {
    size_t n;
    int rc = consume_sources_of_key(tr, wants->key[i], NULL, &n, msg, msglen);
    if (rc != 0)
      return rc;
    total += n;
    src->first[i + 1] = total;
  }
  src->box = malloc((total > 0 ? total : 1) * sizeof *src->box);
  if (src->box == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < wants->nkeys; i++) {
    size_t n;
    consume_sources_of_key(tr, wants->key[i], src->box + src->first[i], &n,
                           NULL, 0);
  }
  return 0;
}

static int64_t at_offset(const struct sp_view *v, const int64_t *from,
                         const int64_t *to) {
  int64_t offset = v->offset;
  for (uint32_t d = 0; d < v->ndim; d++)
    offset += (to[d] - from[d]) * v->stride[d];
  return offset;
}

/* The intersection of a sending box and a destination box, or false. */
static bool intersect(const struct consume_box *s, const struct consume_box *t,
                      struct consume_move *m) {
  uint32_t ndim = t->view.ndim;
  int64_t lo[SP_MAX_DIMS], hi[SP_MAX_DIMS];
  uint64_t numel = 1;

  for (uint32_t d = 0; d < ndim; d++) {
    int64_t s_end = s->start[d] + s->view.shape[d];
    int64_t t_end = t->start[d] + t->view.shape[d];
    lo[d] = s->start[d] > t->start[d] ? s->start[d] : t->start[d];
    hi[d] = s_end < t_end ? s_end : t_end;
    if (hi[d] <= lo[d])
      return false;
    numel *= (uint64_t)(hi[d] - lo[d]);
  }
  m->from = (struct sp_view){.dtype = s->view.dtype,
                             .ndim = ndim,
                             .offset = at_offset(&s->view, s->start, lo)};
  m->to = (struct sp_view){.dtype = t->view.dtype,
                           .ndim = ndim,
                           .offset = at_offset(&t->view, t->start, lo)};
  for (uint32_t d = 0; d < ndim; d++) {
    m->from.shape[d] = m->to.shape[d] = hi[d] - lo[d];
    m->from.stride[d] = s->view.stride[d];
    m->to.stride[d] = t->view.stride[d];
  }
  m->src = s->side;
  m->dst = t->side;
  m->src_storage = s->storage;
  m->dst_storage = t->storage;
  m->nbytes = numel * sp__dtype_size(t->view.dtype);
  return true;
}

/* Wanted key i's moves into out (when not NULL); their number. */
static size_t key_moves(const struct consume_plan *plan,
                        const struct sources *src,
                        const struct consume_wants *wants, size_t i,
                        struct consume_move *out) {
  size_t n = 0;

  for (size_t b = wants->first[i]; b < wants->first[i + 1]; b++)
    for (size_t s = src->first[i]; s < src->first[i + 1]; s++) {
      struct consume_move m;
      if (!intersect(&src->box[s], &wants->box[b], &m))
        continue;
      m.key = (uint32_t)i;
      m.device_type = plan->keys[i].device_type;
      m.bucket_offset = 0;
      if (out != NULL)
        out[n] = m;
      n++;
    }
  return n;
}

static int fill_keys(const struct consume_trainers *tr,
                     const struct consume_wants *wants, const struct sources *src,
                     struct consume_plan *plan, char *msg, size_t msglen) {
  struct consume_move *scratch = NULL;
  size_t cap = 0;
  int rc = 0;

  plan->keys = calloc(wants->nkeys > 0 ? wants->nkeys : 1, sizeof *plan->keys);
  if (plan->keys == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  plan->nkeys = wants->nkeys;
  for (size_t i = 0; i < wants->nkeys && rc == 0; i++) {
    const struct plan_key *k = &tr->keys.keys[wants->key[i]];
    struct consume_key *key = &plan->keys[i];
    size_t n;
    *key = (struct consume_key){.name = k->name,
                                .dtype = k->dtype,
                                .device_type = k->device_type,
                                .ndim = k->ndim,
                                .round = PLAN_NONE};
    memcpy(key->shape, k->shape, sizeof key->shape);
    n = key_moves(plan, src, wants, i, NULL);
    if (n > cap) {
      free(scratch);
      cap = n;
      scratch = malloc(cap * sizeof *scratch);
      if (scratch == NULL) {
        rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
        break;
      }
    }
    key_moves(plan, src, wants, i, scratch);
    for (size_t m = 0; m < n && rc == 0; m++)
      if (__builtin_add_overflow(key->traffic, scratch[m].nbytes,
                                 &key->traffic) ||
          __builtin_add_overflow(plan->received[scratch[m].dst],
                                 scratch[m].nbytes,
                                 &plan->received[scratch[m].dst]))
        rc = sp__failf(msg, msglen, SP_EOVERFLOW,
                       "key '%s': the bytes its consumers want overflow",
                       key->name);
  }
  free(scratch);
  return rc;
}

enum move_field { BY_SRC, BY_DST, BY_CODE };

#define CODES ((uint32_t)SP_DEVICE_TYPE_COUNT * (uint32_t)SP_DTYPE_COUNT)

static uint32_t move_code(const struct consume_move *m) {
  return m->device_type * (uint32_t)SP_DTYPE_COUNT + (uint32_t)m->from.dtype;
}

static uint32_t field_of(const struct consume_move *m, enum move_field f) {
  switch (f) {
  case BY_SRC:
    return m->src;
  case BY_DST:
    return m->dst;
  default:
    return move_code(m);
  }
}

/* Stable counting sort of in[0..n) by field into out; count has range + 1
 * entries. */
static void sort_moves(const struct consume_move *in, size_t n,
                       enum move_field f, size_t *count, uint32_t range,
                       struct consume_move *out) {
  memset(count, 0, ((size_t)range + 1) * sizeof *count);
  for (size_t i = 0; i < n; i++)
    count[field_of(&in[i], f) + 1]++;
  for (uint32_t v = 0; v < range; v++)
    count[v + 1] += count[v];
  for (size_t i = 0; i < n; i++)
    out[count[field_of(&in[i], f)]++] = in[i];
}

static bool same_bucket(const struct consume_move *a,
                        const struct consume_move *b) {
  return a->src == b->src && a->dst == b->dst && move_code(a) == move_code(b);
}

static int make_buckets(struct consume_round *round) {
  size_t nb = 0;
  uint64_t offset = 0;

  for (size_t i = 0; i < round->nmoves; i++)
    nb += i == 0 || !same_bucket(&round->moves[i - 1], &round->moves[i]);
  round->buckets = calloc(nb > 0 ? nb : 1, sizeof *round->buckets);
  round->recv_order =
      malloc((nb > 0 ? nb : 1) * sizeof *round->recv_order);
  if (round->buckets == NULL || round->recv_order == NULL)
    return SP_ENOMEM;
  round->nbuckets = nb;
  nb = 0;
  for (size_t i = 0; i < round->nmoves; i++) {
    struct consume_move *m = &round->moves[i];
    struct consume_bucket *b;
    if (i == 0 || !same_bucket(&round->moves[i - 1], m)) {
      round->buckets[nb++] =
          (struct consume_bucket){.src = m->src,
                                  .dst = m->dst,
                                  .device_type = m->device_type,
                                  .dtype = m->from.dtype,
                                  .first = i};
      offset = 0;
    }
    b = &round->buckets[nb - 1];
    m->bucket_offset = offset;
    offset += m->nbytes;
    b->nbytes = offset;
    b->nmoves++;
  }
  return 0;
}

/* recv_order: the buckets by (consumer, sender, code), which is their own
 * order with consumer first, and each side's runs. */
static void index_sides(const struct consume_plan *plan,
                        struct consume_round *round) {
  size_t at = 0;

  for (uint32_t c = 0; c < plan->nconsumers; c++) {
    round->consumers[c].bucket_first = at;
    for (size_t b = 0; b < round->nbuckets; b++)
      if (round->buckets[b].dst == c)
        round->recv_order[at++] = (uint32_t)b;
    round->consumers[c].nbuckets = at - round->consumers[c].bucket_first;
  }
  for (size_t b = 0; b < round->nbuckets; b++) {
    struct consume_side *s = &round->ranks[round->buckets[b].src];
    if (s->nbuckets++ == 0)
      s->bucket_first = b;
  }
  for (size_t i = 0; i < round->nlocal; i++) {
    struct consume_side *s = &round->ranks[round->local[i].src];
    struct consume_side *c = &round->consumers[round->local_dst[i].dst];
    if (s->nlocal++ == 0)
      s->local_first = i;
    if (c->nlocal++ == 0)
      c->local_first = i;
  }
}

/* Buffers every round reuses: the moves as generated, a sorting buffer and
 * the counting sorts' counters. */
struct scratch {
  struct consume_move *all;
  struct consume_move *tmp;
  size_t cap;
  size_t *count;
};

static int scratch_fit(struct scratch *sc, size_t n) {
  if (n <= sc->cap)
    return 0;
  free(sc->all);
  free(sc->tmp);
  sc->all = malloc(n * sizeof *sc->all);
  sc->tmp = malloc(n * sizeof *sc->tmp);
  sc->cap = sc->all != NULL && sc->tmp != NULL ? n : 0;
  return sc->cap == n ? 0 : SP_ENOMEM;
}

static int build_round(const struct sources *src,
                       const struct consume_wants *wants,
                       struct consume_plan *plan, struct consume_round *round,
                       struct scratch *sc) {
  size_t total = 0, at = 0, nlocal = 0, nremote = 0;

  for (size_t i = 0; i < round->nkeys; i++)
    total += key_moves(plan, src, wants, plan->transfer[round->first + i], NULL);
  if (scratch_fit(sc, total) != 0)
    return SP_ENOMEM;
  for (size_t i = 0; i < round->nkeys; i++) {
    uint32_t k = plan->transfer[round->first + i];
    plan->keys[k].round = (uint32_t)(round - plan->rounds);
    at += key_moves(plan, src, wants, k, sc->all + at);
  }
  /* Local moves to the front of all, in generation order; remote ones to
   * tmp. */
  for (size_t i = 0; i < total; i++) {
    if (plan->rank_node[sc->all[i].src] == plan->consumer_node[sc->all[i].dst])
      sc->all[nlocal++] = sc->all[i];
    else
      sc->tmp[nremote++] = sc->all[i];
  }
  round->nlocal = nlocal;
  round->nmoves = nremote;
  round->local = malloc((nlocal > 0 ? nlocal : 1) * sizeof *round->local);
  round->local_dst =
      malloc((nlocal > 0 ? nlocal : 1) * sizeof *round->local_dst);
  round->moves = malloc((nremote > 0 ? nremote : 1) * sizeof *round->moves);
  round->ranks = calloc(plan->world, sizeof *round->ranks);
  round->consumers = calloc(plan->nconsumers, sizeof *round->consumers);
  if (round->local == NULL || round->local_dst == NULL ||
      round->moves == NULL || round->ranks == NULL ||
      round->consumers == NULL)
    return SP_ENOMEM;
  /* Each pass is stable: the last leaves its field as the primary order,
   * the passes before it next, generation order last. */
  sort_moves(sc->tmp, nremote, BY_CODE, sc->count, CODES, round->moves);
  sort_moves(round->moves, nremote, BY_DST, sc->count, plan->nconsumers,
             sc->tmp);
  sort_moves(sc->tmp, nremote, BY_SRC, sc->count, plan->world, round->moves);
  sort_moves(sc->all, nlocal, BY_DST, sc->count, plan->nconsumers, sc->tmp);
  sort_moves(sc->tmp, nlocal, BY_SRC, sc->count, plan->world, round->local);
  sort_moves(sc->all, nlocal, BY_SRC, sc->count, plan->world, sc->tmp);
  sort_moves(sc->tmp, nlocal, BY_DST, sc->count, plan->nconsumers,
             round->local_dst);
  if (make_buckets(round) != 0)
    return SP_ENOMEM;
  index_sides(plan, round);
  return 0;
}

/* Cuts plan->transfer into rounds: the first pass counts them, the second
 * (rounds not NULL) fills them in. */
static size_t cut_rounds(struct consume_plan *plan,
                         struct consume_round *rounds) {
  size_t n = 0, keys = 0;
  uint64_t bytes = 0;

  for (size_t i = 0; i < plan->ntransfer; i++) {
    uint64_t traffic = plan->keys[plan->transfer[i]].traffic;
    uint64_t sum;
    if (keys > 0 && (keys == plan->max_keys ||
                     __builtin_add_overflow(bytes, traffic, &sum) ||
                     sum > plan->max_bytes)) {
      n++;
      keys = 0;
      bytes = 0;
    }
    if (keys == 0 && rounds != NULL)
      rounds[n].first = i;
    keys++;
    bytes += traffic;
    if (rounds != NULL) {
      rounds[n].nkeys = keys;
      rounds[n].nbytes = bytes;
    }
  }
  return n + (keys > 0);
}

static int make_rounds(const struct sources *src,
                       const struct consume_wants *wants,
                       struct consume_plan *plan, char *msg, size_t msglen) {
  uint32_t range =
      plan->world > plan->nconsumers ? plan->world : plan->nconsumers;
  struct scratch sc = {0};
  int rc = 0;

  for (size_t k = 0; k < plan->nkeys; k++)
    plan->ntransfer += plan->keys[k].traffic > 0;
  plan->transfer = malloc((plan->ntransfer > 0 ? plan->ntransfer : 1) *
                          sizeof *plan->transfer);
  if (plan->transfer == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  plan->ntransfer = 0;
  for (size_t k = 0; k < plan->nkeys; k++)
    if (plan->keys[k].traffic > 0)
      plan->transfer[plan->ntransfer++] = (uint32_t)k;
  plan->nrounds = cut_rounds(plan, NULL);
  plan->rounds =
      calloc(plan->nrounds > 0 ? plan->nrounds : 1, sizeof *plan->rounds);
  sc.count = malloc(((size_t)(range > CODES ? range : CODES) + 1) *
                    sizeof *sc.count);
  if (plan->rounds == NULL || sc.count == NULL) {
    plan->nrounds = 0;
    free(sc.count);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  cut_rounds(plan, plan->rounds);
  for (size_t r = 0; r < plan->nrounds && rc == 0; r++)
    rc = build_round(src, wants, plan, &plan->rounds[r], &sc);
  free(sc.all);
  free(sc.tmp);
  free(sc.count);
  if (rc != 0)
    return sp__failf(msg, msglen, rc, "out of memory building round moves");
  return 0;
}

int consume_moves_build(const struct consume_trainers *tr,
                        const struct consume_wants *wants,
                        struct consume_plan *plan, char *msg, size_t msglen) {
  struct sources src = {0};
  int rc = gather_sources(tr, wants, &src, msg, msglen);

  if (rc == 0)
    rc = plan_check_stop(tr->ix.stop, msg, msglen);
  if (rc == 0)
    rc = fill_keys(tr, wants, &src, plan, msg, msglen);
  if (rc == 0)
    rc = plan_check_stop(tr->ix.stop, msg, msglen);
  if (rc == 0)
    rc = make_rounds(&src, wants, plan, msg, msglen);
  free(src.first);
  free(src.box);
  return rc;
}
