/*
 * rounds.c - the keys that move, cut into rounds, and each round's moves
 * split into local copies and (peer, device type, dtype) buckets.
 *
 * Rounds walk the moving keys in name order: a round closes before a key
 * that would make it hold more than max_keys keys or more than max_bytes of
 * traffic.  A key whose traffic alone exceeds max_bytes is never split; it
 * travels alone in a round of its own, so staging stays bounded by the
 * larger of the budget and the largest key, and an engine never has to
 * assemble one tensor across rounds.
 *
 * Within a round, moves are generated key by key in name order, each key's
 * by source rank and piece, then sorted stably by counting sorts of their
 * indices: local moves (source and owner on one node) by owner, remote ones
 * by (source, owner, device type, dtype).  Both sides of a bucket are the
 * same run of moves, so a send and its receive always agree on length and
 * layout.  Counting sorts keep a round at O(moves + world x codes).
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

#define CODES ((uint32_t)SP_DEVICE_TYPE_COUNT * (uint32_t)SP_DTYPE_COUNT)

static uint32_t move_code(const struct plan *plan, const struct plan_move *m) {
  const struct plan_key *key = &plan->keys[m->key];
  return key->device_type * (uint32_t)SP_DTYPE_COUNT + (uint32_t)key->dtype;
}

static bool move_local(const struct plan *plan, const struct plan_move *m) {
  return plan->node[m->src] == plan->node[m->dst];
}

/* Stable counting sort of the indices in[0..n) by field[in[i]], whose
 * values are below range, into out; count has range + 1 entries.  Indices
 * move, not moves: a move is 56 bytes, an index 4. */
static void sort_indices(const uint32_t *in, size_t n, const uint32_t *field,
                         size_t *count, size_t range, uint32_t *out) {
  memset(count, 0, (range + 1) * sizeof *count);
  for (size_t i = 0; i < n; i++)
    count[field[in[i]] + 1]++;
  for (size_t v = 0; v < range; v++)
    count[v + 1] += count[v];
  for (size_t i = 0; i < n; i++)
    out[count[field[in[i]]]++] = in[i];
}

static bool same_bucket(const struct plan *plan, const struct plan_move *a,
                        const struct plan_move *b) {
  return a->src == b->src && a->dst == b->dst &&
         move_code(plan, a) == move_code(plan, b);
}

static int make_buckets(const struct plan *plan, struct plan_round *round) {
  size_t nb = 0;
  uint64_t offset = 0;

  for (size_t i = 0; i < round->nmoves; i++)
    nb += i == 0 || !same_bucket(plan, &round->moves[i - 1], &round->moves[i]);
  round->buckets = calloc(nb > 0 ? nb : 1, sizeof *round->buckets);
  if (round->buckets == NULL)
    return SP_ENOMEM;
  round->nbuckets = nb;
  nb = 0;
  for (size_t i = 0; i < round->nmoves; i++) {
    struct plan_move *m = &round->moves[i];
    struct plan_bucket *b;
    if (i == 0 || !same_bucket(plan, &round->moves[i - 1], m)) {
      const struct plan_key *key = &plan->keys[m->key];
      round->buckets[nb++] =
          (struct plan_bucket){.src = m->src,
                               .dst = m->dst,
                               .device_type = key->device_type,
                               .dtype = key->dtype,
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

/* Per rank: its sends are a run of buckets (sorted by source), its
 * receives a run of recv_order, its local receives a run of local moves. */
static int index_ranks(const struct plan *plan, struct plan_round *round,
                       size_t *count) {
  uint32_t world = plan->world;

  round->ranks = calloc(world, sizeof *round->ranks);
  round->recv_order = malloc((round->nbuckets > 0 ? round->nbuckets : 1) *
                             sizeof *round->recv_order);
  if (round->ranks == NULL || round->recv_order == NULL)
    return SP_ENOMEM;
  for (size_t b = 0; b < round->nbuckets; b++) {
    struct plan_rank_round *rr = &round->ranks[round->buckets[b].src];
    if (rr->nsend == 0)
      rr->send_first = b;
    rr->nsend++;
  }
  memset(count, 0, ((size_t)world + 1) * sizeof *count);
  for (size_t b = 0; b < round->nbuckets; b++)
    count[round->buckets[b].dst + 1]++;
  for (uint32_t r = 0; r < world; r++) {
    count[r + 1] += count[r];
    round->ranks[r].recv_first = count[r];
    round->ranks[r].nrecv = count[r + 1] - count[r];
  }
  for (size_t b = 0; b < round->nbuckets; b++)
    round->recv_order[count[round->buckets[b].dst]++] = (uint32_t)b;
  for (size_t i = 0; i < round->nlocal; i++) {
    struct plan_rank_round *rr = &round->ranks[round->local[i].dst];
    if (rr->nlocal == 0)
      rr->local_first = i;
    rr->nlocal++;
  }
  return 0;
}

/* Buffers every round reuses: the moves as generated, two index arrays
 * and a sort field per move, and the counting sorts' counters. */
struct scratch {
  struct plan_move *all;
  uint32_t *order, *sorted, *field;
  size_t cap;
  size_t *count;
};

static int scratch_fit(struct scratch *sc, size_t n) {
  if (n <= sc->cap)
    return 0;
  free(sc->all);
  free(sc->order);
  free(sc->sorted);
  free(sc->field);
  sc->all = malloc(n * sizeof *sc->all);
  sc->order = malloc(n * sizeof *sc->order);
  sc->sorted = malloc(n * sizeof *sc->sorted);
  sc->field = malloc(n * sizeof *sc->field);
  sc->cap = sc->all != NULL && sc->order != NULL && sc->sorted != NULL &&
                    sc->field != NULL
                ? n
                : 0;
  return sc->cap == n ? 0 : SP_ENOMEM;
}

/* Local moves by owner; remote ones by (source, owner, device type and
 * dtype), each stable, so generation order breaks ties.  Least
 * significant first: owner and code in one pass, then source. */
static void order_moves(const struct plan *plan, struct plan_round *round,
                        struct scratch *sc, size_t total) {
  size_t nlocal = 0, nremote = 0;

  for (size_t i = 0; i < total; i++) {
    const struct plan_move *m = &sc->all[i];
    if (move_local(plan, m)) {
      sc->field[i] = m->dst;
      sc->order[nlocal++] = (uint32_t)i;
    }
  }
  sort_indices(sc->order, nlocal, sc->field, sc->count, plan->world,
               sc->sorted);
  for (size_t i = 0; i < nlocal; i++)
    round->local[i] = sc->all[sc->sorted[i]];
  for (size_t i = 0; i < total; i++) {
    const struct plan_move *m = &sc->all[i];
    if (!move_local(plan, m)) {
      sc->field[i] = m->dst * CODES + move_code(plan, m);
      sc->order[nremote++] = (uint32_t)i;
    }
  }
  sort_indices(sc->order, nremote, sc->field, sc->count,
               (size_t)plan->world * CODES, sc->sorted);
  for (size_t i = 0; i < nremote; i++)
    sc->field[sc->sorted[i]] = sc->all[sc->sorted[i]].src;
  sort_indices(sc->sorted, nremote, sc->field, sc->count, plan->world,
               sc->order);
  for (size_t i = 0; i < nremote; i++)
    round->moves[i] = sc->all[sc->order[i]];
}

static int build_round(const struct plan_index *ix, struct plan *plan,
                       struct plan_round *round, struct scratch *sc) {
  size_t total = 0, at = 0;
  int rc;

  for (size_t i = 0; i < round->nkeys; i++)
    total +=
        plan_moves_of_key(ix, plan, plan->transfer[round->first + i], NULL);
  if (total >= PLAN_NONE)
    return SP_EOVERFLOW;
  rc = scratch_fit(sc, total);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < round->nkeys; i++) {
    uint32_t k = plan->transfer[round->first + i];
    plan->keys[k].round = (uint32_t)(round - plan->rounds);
    at += plan_moves_of_key(ix, plan, k, sc->all + at);
  }
  for (size_t i = 0; i < total; i++)
    round->nlocal += move_local(plan, &sc->all[i]);
  round->nmoves = total - round->nlocal;
  round->local =
      malloc((round->nlocal > 0 ? round->nlocal : 1) * sizeof *round->local);
  round->moves =
      malloc((round->nmoves > 0 ? round->nmoves : 1) * sizeof *round->moves);
  if (round->local == NULL || round->moves == NULL)
    return SP_ENOMEM;
  order_moves(plan, round, sc, total);
  rc = make_buckets(plan, round);
  if (rc == 0)
    rc = index_ranks(plan, round, sc->count);
  return rc;
}

/* Cuts plan->transfer into rounds: the first pass counts them, the second
 * (rounds not NULL) fills them in. */
static size_t cut_rounds(struct plan *plan, struct plan_round *rounds) {
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

/* One round per task, each thread with its scratch; the round's digest
 * is hashed where it was built. */
struct round_work {
  const struct plan_index *ix;
  struct plan *plan;
  struct scratch *sc; /* [workers] */
};

static int round_task(void *ctx, uint32_t worker, size_t r) {
  struct round_work *rw = ctx;
  struct plan_round *round = &rw->plan->rounds[r];
  int rc = plan_check_stop(rw->ix->stop, NULL, 0);

  if (rc == 0)
    rc = build_round(rw->ix, rw->plan, round, &rw->sc[worker]);
  if (rc == 0)
    round->digest = plan_digest_round(rw->plan, round);
  return rc;
}

int plan_rounds_build(const struct plan_index *ix, struct plan *plan, char *msg,
                      size_t msglen) {
  struct round_work rw = {ix, plan, NULL};
  uint32_t workers;
  int rc = 0;

  for (size_t k = 0; k < plan->nkeys; k++)
    plan->ntransfer += plan->keys[k].kind == PLAN_KEY_MOVE;
  plan->transfer = malloc((plan->ntransfer > 0 ? plan->ntransfer : 1) *
                          sizeof *plan->transfer);
  if (plan->transfer == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  plan->ntransfer = 0;
  for (size_t k = 0; k < plan->nkeys; k++)
    if (plan->keys[k].kind == PLAN_KEY_MOVE)
      plan->transfer[plan->ntransfer++] = (uint32_t)k;
  plan->nrounds = cut_rounds(plan, NULL);
  plan->rounds =
      calloc(plan->nrounds > 0 ? plan->nrounds : 1, sizeof *plan->rounds);
  workers = plan_workers_count(plan->threads, plan->nrounds);
  rw.sc = calloc(workers, sizeof *rw.sc);
  for (uint32_t t = 0; rw.sc != NULL && t < workers && rc == 0; t++) {
    rw.sc[t].count =
        malloc(((size_t)plan->world * CODES + 1) * sizeof *rw.sc[t].count);
    rc = rw.sc[t].count == NULL ? SP_ENOMEM : 0;
  }
  if (plan->rounds == NULL || rw.sc == NULL || rc != 0) {
    plan->nrounds = 0;
    rc = SP_ENOMEM;
  } else {
    cut_rounds(plan, plan->rounds);
    rc = plan_workers_run(plan->threads, plan->nrounds, round_task, &rw);
  }
  for (uint32_t t = 0; rw.sc != NULL && t < workers; t++) {
    free(rw.sc[t].all);
    free(rw.sc[t].order);
    free(rw.sc[t].sorted);
    free(rw.sc[t].field);
    free(rw.sc[t].count);
  }
  free(rw.sc);
  if (rc == SP_ETIMEOUT)
    return plan_check_stop(ix->stop, msg, msglen);
  if (rc != 0)
    return sp__failf(msg, msglen, rc,
                     rc == SP_ENOMEM ? "out of memory building round moves"
                                     : "a round has too many moves");
  return 0;
}
