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

/* Where key_moves hands each move it makes, in generation order. */
struct sink {
  void (*take)(struct sink *sink, const struct consume_move *m);
  size_t at; /* moves taken so far */
};

/* Wanted key i's moves, each to sink (when not NULL); their number. */
static size_t key_moves(const struct consume_plan *plan,
                        const struct sources *src,
                        const struct consume_wants *wants, size_t i,
                        struct sink *sink) {
  size_t n = 0;

  for (size_t b = wants->first[i]; b < wants->first[i + 1]; b++)
    for (size_t s = src->first[i]; s < src->first[i + 1]; s++) {
      struct consume_move m;
      if (!intersect(&src->box[s], &wants->box[b], &m))
        continue;
      m.key = (uint32_t)i;
      m.device_type = plan->keys[i].device_type;
      m.bucket_offset = 0;
      if (sink != NULL) {
        sink->take(sink, &m);
        sink->at++;
      }
      n++;
    }
  return n;
}

/* Adds each move's bytes to its key's traffic and its consumer's total. */
struct bytes_sink {
  struct sink sink;
  struct consume_plan *plan;
  bool overflow;
};

static void take_bytes(struct sink *sink, const struct consume_move *m) {
  struct bytes_sink *bs = (struct bytes_sink *)sink;
  struct consume_key *key = &bs->plan->keys[m->key];
  uint64_t *received = &bs->plan->received[m->dst];

  bs->overflow =
      bs->overflow ||
      __builtin_add_overflow(key->traffic, m->nbytes, &key->traffic) ||
      __builtin_add_overflow(*received, m->nbytes, received);
}

static int fill_keys(const struct consume_trainers *tr,
                     const struct consume_wants *wants,
                     const struct sources *src, struct consume_plan *plan,
                     char *msg, size_t msglen) {
  struct bytes_sink bs = {{take_bytes, 0}, plan, false};

  plan->keys = calloc(wants->nkeys > 0 ? wants->nkeys : 1, sizeof *plan->keys);
  if (plan->keys == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  plan->nkeys = wants->nkeys;
  for (size_t i = 0; i < wants->nkeys; i++) {
    const struct plan_key *k = &tr->keys.keys[wants->key[i]];
    struct consume_key *key = &plan->keys[i];
    *key = (struct consume_key){.name = k->name,
                                .dtype = k->dtype,
                                .device_type = k->device_type,
                                .ndim = k->ndim,
                                .round = PLAN_NONE};
    memcpy(key->shape, k->shape, sizeof key->shape);
    key_moves(plan, src, wants, i, &bs.sink);
    if (bs.overflow)
      return sp__failf(msg, msglen, SP_EOVERFLOW,
                       "key '%s': the bytes its consumers want overflow",
                       key->name);
  }
  return 0;
}

/* What a move is sorted by, packed small: the sorts permute these and the
 * moves are then made once more, straight into their places. */
struct move_tag {
  uint32_t src;
  uint32_t dst;
  uint32_t code;
  bool local;
};

enum move_field { BY_SRC, BY_DST, BY_CODE };

#define CODES ((uint32_t)SP_DEVICE_TYPE_COUNT * (uint32_t)SP_DTYPE_COUNT)

static uint32_t move_code(const struct consume_move *m) {
  return m->device_type * (uint32_t)SP_DTYPE_COUNT + (uint32_t)m->from.dtype;
}

static uint32_t field_of(const struct move_tag *t, enum move_field f) {
  switch (f) {
  case BY_SRC:
    return t->src;
  case BY_DST:
    return t->dst;
  default:
    return t->code;
  }
}

/* Stable counting sort of the moves tags[in[0..n)] by field, as indices
 * into out; count has range + 1 entries. */
static void sort_tags(const struct move_tag *tags, const size_t *in, size_t n,
                      enum move_field f, size_t *count, uint32_t range,
                      size_t *out) {
  memset(count, 0, ((size_t)range + 1) * sizeof *count);
  for (size_t i = 0; i < n; i++)
    count[field_of(&tags[in[i]], f) + 1]++;
  for (uint32_t v = 0; v < range; v++)
    count[v + 1] += count[v];
  for (size_t i = 0; i < n; i++)
    out[count[field_of(&tags[in[i]], f)]++] = in[i];
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
  round->recv_order = malloc((nb > 0 ? nb : 1) * sizeof *round->recv_order);
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
 * order with consumer first (one stable pass by consumer); and each side's
 * runs. */
static void index_sides(const struct consume_plan *plan,
                        struct consume_round *round, size_t *count) {
  memset(count, 0, ((size_t)plan->nconsumers + 1) * sizeof *count);
  for (size_t b = 0; b < round->nbuckets; b++)
    count[round->buckets[b].dst + 1]++;
  for (uint32_t c = 0; c < plan->nconsumers; c++) {
    count[c + 1] += count[c];
    round->consumers[c].bucket_first = count[c];
    round->consumers[c].nbuckets = count[c + 1] - count[c];
  }
  for (size_t b = 0; b < round->nbuckets; b++)
    round->recv_order[count[round->buckets[b].dst]++] = (uint32_t)b;
  for (size_t b = 0; b < round->nbuckets; b++) {
    struct consume_side *s = &round->ranks[round->buckets[b].src];
    if (s->nbuckets++ == 0)
      s->bucket_first = b;
  }
  for (size_t i = 0; i < round->nlocal; i++) {
    struct consume_side *s = &round->ranks[round->local[i].src];
    struct consume_side *c =
        &round->consumers[round->local[round->local_order[i]].dst];
    if (s->nlocal++ == 0)
      s->local_first = i;
    if (c->nlocal++ == 0)
      c->local_first = i;
  }
}

/* Buffers every round reuses: the tags, two index arrays for the sorts,
 * and the counting sorts' counters. */
struct scratch {
  struct move_tag *tags;
  size_t *idx;
  size_t *tmp;
  size_t cap;
  size_t *count;
};

static int scratch_fit(struct scratch *sc, size_t n) {
  if (n <= sc->cap)
    return 0;
  free(sc->tags);
  free(sc->idx);
  free(sc->tmp);
  sc->tags = malloc(n * sizeof *sc->tags);
  sc->idx = malloc(n * sizeof *sc->idx);
  sc->tmp = malloc(n * sizeof *sc->tmp);
  sc->cap = sc->tags != NULL && sc->idx != NULL && sc->tmp != NULL ? n : 0;
  return sc->cap == n ? 0 : SP_ENOMEM;
}

/* The first pass: each move's tag, in generation order. */
struct tag_sink {
  struct sink sink;
  const struct consume_plan *plan;
  struct move_tag *tags;
};

static void take_tag(struct sink *sink, const struct consume_move *m) {
  struct tag_sink *ts = (struct tag_sink *)sink;
  ts->tags[sink->at] = (struct move_tag){
      .src = m->src,
      .dst = m->dst,
      .code = move_code(m),
      .local = ts->plan->rank_node[m->src] == ts->plan->consumer_node[m->dst]};
}

/* The second pass: each move to its place, place[g] for generation index
 * g, in round->local or round->moves. */
struct place_sink {
  struct sink sink;
  const struct move_tag *tags;
  const size_t *place;
  struct consume_round *round;
};

static void take_place(struct sink *sink, const struct consume_move *m) {
  struct place_sink *ps = (struct place_sink *)sink;
  struct consume_move *to =
      ps->tags[sink->at].local ? ps->round->local : ps->round->moves;
  to[ps->place[sink->at]] = *m;
}

/* Sorts the generation indices of the local (or remote) tags by fields
 * f[0..nf), least significant first, and records each one's place. */
static size_t sort_places(struct scratch *sc, size_t total, bool local,
                          const enum move_field *f, const uint32_t *range,
                          size_t nf, size_t *place) {
  size_t n = 0;
  size_t *from = sc->idx, *to = sc->tmp;

  for (size_t g = 0; g < total; g++)
    if (sc->tags[g].local == local)
      sc->idx[n++] = g;
  for (size_t i = 0; i < nf; i++) {
    size_t *swap;
    sort_tags(sc->tags, from, n, f[i], sc->count, range[i], to);
    swap = from;
    from = to;
    to = swap;
  }
  for (size_t i = 0; i < n; i++)
    place[from[i]] = i;
  return n;
}

static int build_round(const struct sources *src,
                       const struct consume_wants *wants,
                       struct consume_plan *plan, struct consume_round *round,
                       struct scratch *sc, size_t **place) {
  /* Each pass is stable: the last leaves its field as the primary order,
   * the passes before it next, generation order last. */
  static const enum move_field remote_by[3] = {BY_CODE, BY_DST, BY_SRC};
  static const enum move_field local_by[2] = {BY_DST, BY_SRC};
  const uint32_t remote_range[3] = {CODES, plan->nconsumers, plan->world};
  const uint32_t local_range[2] = {plan->nconsumers, plan->world};
  struct tag_sink ts = {{take_tag, 0}, plan, NULL};
  struct place_sink ps = {{take_place, 0}, NULL, NULL, round};
  size_t total = 0;

  for (size_t i = 0; i < round->nkeys; i++)
    total +=
        key_moves(plan, src, wants, plan->transfer[round->first + i], NULL);
  if (scratch_fit(sc, total) != 0)
    return SP_ENOMEM;
  free(*place);
  *place = malloc((total > 0 ? total : 1) * sizeof **place);
  if (*place == NULL)
    return SP_ENOMEM;
  ts.tags = sc->tags;
  for (size_t i = 0; i < round->nkeys; i++) {
    uint32_t k = plan->transfer[round->first + i];
    plan->keys[k].round = (uint32_t)(round - plan->rounds);
    key_moves(plan, src, wants, k, &ts.sink);
  }
  round->nmoves =
      sort_places(sc, total, false, remote_by, remote_range, 3, *place);
  round->nlocal =
      sort_places(sc, total, true, local_by, local_range, 2, *place);
  round->local =
      malloc((round->nlocal > 0 ? round->nlocal : 1) * sizeof *round->local);
  round->local_order = malloc((round->nlocal > 0 ? round->nlocal : 1) *
                              sizeof *round->local_order);
  round->moves =
      malloc((round->nmoves > 0 ? round->nmoves : 1) * sizeof *round->moves);
  round->ranks = calloc(plan->world, sizeof *round->ranks);
  round->consumers = calloc(plan->nconsumers, sizeof *round->consumers);
  if (round->local == NULL || round->local_order == NULL ||
      round->moves == NULL || round->ranks == NULL || round->consumers == NULL)
    return SP_ENOMEM;
  ps.tags = sc->tags;
  ps.place = *place;
  for (size_t i = 0; i < round->nkeys; i++)
    key_moves(plan, src, wants, plan->transfer[round->first + i], &ps.sink);
  /* The local moves by (consumer, sender): they are in (sender, consumer)
   * order, so one stable pass by consumer over their tags does it. */
  for (size_t i = 0; i < round->nlocal; i++) {
    sc->tags[i] = (struct move_tag){.src = round->local[i].src,
                                    .dst = round->local[i].dst};
    sc->idx[i] = i;
  }
  sort_tags(sc->tags, sc->idx, round->nlocal, BY_DST, sc->count,
            plan->nconsumers, round->local_order);
  if (make_buckets(round) != 0)
    return SP_ENOMEM;
  index_sides(plan, round, sc->count);
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
    if (plan_round_is_full(keys, bytes, traffic, plan->max_keys,
                           plan->max_bytes)) {
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
  size_t *place = NULL;
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
  sc.count =
      malloc(((size_t)(range > CODES ? range : CODES) + 1) * sizeof *sc.count);
  if (plan->rounds == NULL || sc.count == NULL) {
    plan->nrounds = 0;
    free(sc.count);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  cut_rounds(plan, plan->rounds);
  for (size_t r = 0; r < plan->nrounds && rc == 0; r++)
    rc = build_round(src, wants, plan, &plan->rounds[r], &sc, &place);
  free(place);
  free(sc.tags);
  free(sc.idx);
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
