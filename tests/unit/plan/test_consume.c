/*
 * test_consume.c - the consumer planner (daemon/plan/consume.h): trainers
 * sharded one way delivered into consumers sharded another way, every
 * delivered byte compared with the unsharded original (tcons.h's oracle),
 * rounds and buckets, and every refusal.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/plan/consume.h"
#include "shardport.h"
#include "tests/unit/plan/tcons.h"
#include "tests/unit/plan/tgen.h"
#include "tests/unit/plan/tjob.h"

static struct consume_plan *build(struct tjob *job, struct tcons *cons,
                                  uint64_t seed) {
  struct consume_plan *plan;
  char msg[512];
  /* A seed also lists the trainers from another rank on, as the daemon of
   * that rank would. */
  int rc = consume_plan_build(
      tcons_input(cons, tjob_input(job, (uint32_t)(seed % 7), seed), seed),
      &plan, msg, sizeof msg);
  ck_assert_msg(rc == 0, "%d: %s", rc, msg);
  return plan;
}

static int refuse(struct tjob *job, struct tcons *cons, uint64_t seed,
                  char *msg, size_t msglen) {
  struct consume_plan *plan = NULL;
  int rc = consume_plan_build(
      tcons_input(cons, tjob_input(job, (uint32_t)(seed % 7), seed), seed),
      &plan, msg, msglen);
  ck_assert_ptr_null(plan);
  return rc;
}

/* The plan's structure: every bucket's moves packed back to back, every
 * side's runs cover what it sends or receives, rounds within the limits. */
static void check_structure(const struct consume_plan *plan) {
  uint64_t *received = calloc(plan->nconsumers, sizeof *received);
  size_t keys = 0;

  for (size_t r = 0; r < plan->nrounds; r++) {
    const struct consume_round *round = &plan->rounds[r];
    uint64_t bytes = 0;
    size_t sends = 0, recvs = 0, lsend = 0, lrecv = 0;
    ck_assert_uint_le(round->nkeys, plan->max_keys);
    ck_assert_uint_eq(round->first, keys);
    keys += round->nkeys;
    for (size_t b = 0; b < round->nbuckets; b++) {
      const struct consume_bucket *bk = &round->buckets[b];
      uint64_t offset = 0;
      ck_assert_uint_ne(plan->rank_node[bk->src], plan->consumer_node[bk->dst]);
      for (size_t m = bk->first; m < bk->first + bk->nmoves; m++) {
        ck_assert_uint_eq(round->moves[m].bucket_offset, offset);
        ck_assert_uint_eq(round->moves[m].src, bk->src);
        ck_assert_uint_eq(round->moves[m].dst, bk->dst);
        offset += round->moves[m].nbytes;
        received[bk->dst] += round->moves[m].nbytes;
      }
      ck_assert_uint_eq(offset, bk->nbytes);
      bytes += bk->nbytes;
    }
    for (size_t i = 0; i < round->nlocal; i++) {
      ck_assert_uint_eq(plan->rank_node[round->local[i].src],
                        plan->consumer_node[round->local[i].dst]);
      bytes += round->local[i].nbytes;
      received[round->local[round->local_order[i]].dst] +=
          round->local[round->local_order[i]].nbytes;
    }
    ck_assert_uint_eq(bytes, round->nbytes);
    if (round->nkeys > 1)
      ck_assert_uint_le(round->nbytes, plan->max_bytes);
    for (uint32_t w = 0; w < plan->world; w++) {
      const struct consume_side *s = &round->ranks[w];
      for (size_t b = s->bucket_first; b < s->bucket_first + s->nbuckets; b++)
        ck_assert_uint_eq(round->buckets[b].src, w);
      for (size_t i = s->local_first; i < s->local_first + s->nlocal; i++)
        ck_assert_uint_eq(round->local[i].src, w);
      sends += s->nbuckets;
      lsend += s->nlocal;
    }
    for (uint32_t c = 0; c < plan->nconsumers; c++) {
      const struct consume_side *s = &round->consumers[c];
      for (size_t i = s->bucket_first; i < s->bucket_first + s->nbuckets; i++)
        ck_assert_uint_eq(round->buckets[round->recv_order[i]].dst, c);
      for (size_t i = s->local_first; i < s->local_first + s->nlocal; i++)
        ck_assert_uint_eq(round->local[round->local_order[i]].dst, c);
      recvs += s->nbuckets;
      lrecv += s->nlocal;
    }
    ck_assert_uint_eq(sends, round->nbuckets);
    ck_assert_uint_eq(recvs, round->nbuckets);
    ck_assert_uint_eq(lsend, round->nlocal);
    ck_assert_uint_eq(lrecv, round->nlocal);
  }
  ck_assert_uint_eq(keys, plan->ntransfer);
  for (uint32_t c = 0; c < plan->nconsumers; c++)
    ck_assert_uint_eq(received[c], plan->received[c]);
  free(received);
}

/* Builds, pushes values and compares every byte, for two sets of values
 * on one plan: a push repeats with fresh weights. */
static struct consume_plan *push_and_compare(struct tjob *job,
                                             struct tcons *cons) {
  struct consume_plan *plan = build(job, cons, 0);
  char msg[256];

  check_structure(plan);
  for (uint64_t values = 1; values <= 2; values++) {
    struct tdata *data = tdata_new(tjob_input(job, 0, 0), values);
    tcons_push(cons, data, plan);
    ck_assert_msg(tcons_compare(cons, data, msg, sizeof msg) == 0, "%s", msg);
    tdata_free(data);
  }
  return plan;
}

/* Which ranks send key k's bytes, as a bit mask. */
static uint32_t senders(const struct consume_plan *plan, const char *key) {
  uint32_t mask = 0;
  for (size_t r = 0; r < plan->nrounds; r++) {
    const struct consume_round *round = &plan->rounds[r];
    for (size_t i = 0; i < round->nmoves; i++)
      if (strcmp(plan->keys[round->moves[i].key].name, key) == 0)
        mask |= 1u << round->moves[i].src;
    for (size_t i = 0; i < round->nlocal; i++)
      if (strcmp(plan->keys[round->local[i].key].name, key) == 0)
        mask |= 1u << round->local[i].src;
  }
  return mask;
}

START_TEST(rows_into_uneven_columns) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {10, 7}, rows[4] = {3, 0, 4, 3};
  struct consume_plan *plan;

  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_shard(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 2);
  tcons_shard(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 5);
  plan = push_and_compare(job, cons);
  ck_assert_uint_eq(plan->received[0], 10 * 2 * 4);
  ck_assert_uint_eq(plan->received[1], 10 * 5 * 4);
  /* Every rank with rows sends them itself; the empty shard sends none. */
  ck_assert_uint_eq(senders(plan, "w"), 0xdu);
  ck_assert_uint_eq(plan->keys[0].traffic, 10 * 7 * 4);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(columns_of_trainers_into_uneven_rows) {
  /* Column-sharded trainers, as affine pieces, into row-sharded consumers
   * of three uneven heights, one of them empty. */
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(3);
  const int64_t shape[2] = {5, 6};
  struct affine_piece p[2];
  uint32_t holders[2] = {0, 1};
  const struct affine_piece *pieces[2] = {&p[0], &p[1]};
  const uint64_t numel[2] = {5 * 4, 5 * 2};
  const size_t npieces[2] = {1, 1};
  struct consume_plan *plan;

  for (int r = 0; r < 2; r++) {
    int64_t cols = r == 0 ? 4 : 2;
    p[r] = (struct affine_piece){.ndim = 2,
                                 .shape = {5, cols},
                                 .src_stride = {cols, 1},
                                 .dst_offset = r == 0 ? 0 : 4,
                                 .dst_stride = {6, 1},
                                 .nholders = 1,
                                 .holders = &holders[r]};
  }
  tjob_affine(job, "w", SP_DTYPE_INT16, 2, shape, numel, pieces, npieces);
  tcons_shard(cons, 0, "w", SP_DTYPE_INT16, 2, shape, 0, 3);
  tcons_shard(cons, 1, "w", SP_DTYPE_INT16, 2, shape, 0, 0);
  tcons_shard(cons, 2, "w", SP_DTYPE_INT16, 2, shape, 0, 2);
  plan = push_and_compare(job, cons);
  ck_assert_uint_eq(plan->received[1], 0);
  ck_assert_uint_eq(senders(plan, "w"), 0x3u);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(replicated_plain_and_expert_keys) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t rshape[2] = {9, 3}, pshape[1] = {2}, eshape[2] = {3, 3};
  const int64_t *scalar = rshape; /* 0-d: no dim is read */
  struct consume_plan *plan;

  tjob_whole(job, "rep", PLAN_REPLICATED, SP_DTYPE_FLOAT32, 2, rshape);
  tjob_whole(job, "plain", PLAN_PLAIN, SP_DTYPE_UINT8, 1, pshape);
  tjob_whole(job, "scalar", PLAN_REPLICATED, SP_DTYPE_FLOAT64, 0, scalar);
  tjob_expert(job, 2, "expert", SP_DTYPE_BFLOAT16, 2, eshape);
  tcons_whole(cons, 0, "rep", SP_DTYPE_FLOAT32, 2, rshape);
  tcons_whole(cons, 0, "plain", SP_DTYPE_UINT8, 1, pshape);
  tcons_whole(cons, 0, "scalar", SP_DTYPE_FLOAT64, 0, scalar);
  tcons_shard(cons, 1, "expert", SP_DTYPE_BFLOAT16, 2, eshape, 1, 3);
  tcons_shard(cons, 1, "rep", SP_DTYPE_FLOAT32, 2, rshape, 0, 9);
  plan = push_and_compare(job, cons);
  /* Replicas share the sending: 9 rows over 4 ranks, 2 rows over the
   * first two, a 0-d tensor from rank 0; an expert from its holder. */
  ck_assert_uint_eq(senders(plan, "rep"), 0xfu);
  ck_assert_uint_eq(senders(plan, "plain"), 0x3u);
  ck_assert_uint_eq(senders(plan, "scalar"), 0x1u);
  ck_assert_uint_eq(senders(plan, "expert"), 0x4u);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* q, k and v of a grouped-query attention, FSDP rows over 4 trainers,
 * into 2 tensor-parallel consumers, each holding one fused buffer of its
 * heads: [q rows | k rows | v rows]. */
START_TEST(fused_qkv_through_pieces) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t qshape[2] = {8, 4}, kvshape[2] = {4, 4};
  const int64_t qrows[4] = {2, 2, 2, 2}, kvrows[4] = {1, 2, 0, 1};
  struct consume_plan *plan;

  tjob_shard0(job, "q", SP_DTYPE_FLOAT16, 2, qshape, qrows);
  tjob_shard0(job, "k", SP_DTYPE_FLOAT16, 2, kvshape, kvrows);
  tjob_shard0(job, "v", SP_DTYPE_FLOAT16, 2, kvshape, kvrows);
  for (uint32_t c = 0; c < 2; c++) {
    uint32_t fused = tcons_storage(cons, c, (4 + 2 + 2) * 4 * 2);
    const char *names[3] = {"q", "k", "v"};
    const int64_t rows[3] = {4, 2, 2}, at[3] = {0, 16, 24};
    for (int i = 0; i < 3; i++) {
      struct consume_piece piece = {.start = {rows[i] * c, 0},
                                    .storage = fused,
                                    .dst = {.dtype = SP_DTYPE_FLOAT16,
                                            .ndim = 2,
                                            .shape = {rows[i], 4},
                                            .stride = {4, 1},
                                            .offset = at[i]}};
      tcons_pieces(cons, c, names[i], SP_DTYPE_FLOAT16, 2,
                   i == 0 ? qshape : kvshape, 1, &piece);
    }
  }
  plan = push_and_compare(job, cons);
  ck_assert_uint_eq(plan->received[0], 8 * 4 * 2);
  ck_assert_uint_eq(plan->received[1], 8 * 4 * 2);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(a_subset_of_keys) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[1] = {6}, rows[2] = {3, 3};
  struct consume_plan *plan;

  tjob_shard0(job, "a", SP_DTYPE_INT32, 1, shape, rows);
  tjob_shard0(job, "b", SP_DTYPE_INT32, 1, shape, rows);
  tjob_shard0(job, "unwanted", SP_DTYPE_INT32, 1, shape, rows);
  tcons_whole(cons, 0, "a", SP_DTYPE_INT32, 1, shape);
  tcons_shard(cons, 1, "b", SP_DTYPE_INT32, 1, shape, 0, 6);
  plan = push_and_compare(job, cons);
  ck_assert_uint_eq(plan->nkeys, 2);
  ck_assert_str_eq(plan->keys[0].name, "a");
  ck_assert_str_eq(plan->keys[1].name, "b");
  ck_assert_uint_eq(senders(plan, "unwanted"), 0);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* Ranks 0 and 1 on node 10, 2 and 3 on node 11; consumer 0 on node 10,
 * consumer 1 on node 12, where no trainer is. */
START_TEST(local_copies_and_buckets_between_nodes) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {8, 2}, rows[4] = {2, 2, 2, 2};
  struct consume_plan *plan;

  for (uint32_t r = 0; r < 4; r++)
    tjob_node(job, r, 10 + r / 2);
  tcons_node(cons, 0, 10);
  tcons_node(cons, 1, 12);
  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tjob_shard0(job, "x", SP_DTYPE_INT8, 2, shape, rows);
  tcons_whole(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape);
  tcons_whole(cons, 0, "x", SP_DTYPE_INT8, 2, shape);
  tcons_whole(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape);
  plan = push_and_compare(job, cons);
  ck_assert_uint_eq(plan->nrounds, 1);
  /* Consumer 0 copies locally from ranks 0 and 1 (two keys each) and
   * receives buckets from ranks 2 and 3, one per dtype; consumer 1
   * receives one bucket from every rank. */
  ck_assert_uint_eq(plan->rounds[0].nlocal, 4);
  ck_assert_uint_eq(plan->rounds[0].consumers[0].nlocal, 4);
  ck_assert_uint_eq(plan->rounds[0].consumers[0].nbuckets, 4);
  ck_assert_uint_eq(plan->rounds[0].consumers[1].nlocal, 0);
  ck_assert_uint_eq(plan->rounds[0].consumers[1].nbuckets, 4);
  ck_assert_uint_eq(plan->rounds[0].ranks[2].nbuckets, 3);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(rounds_at_4096_keys_and_the_byte_budget) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[1] = {2}, rows[2] = {1, 1}, big[1] = {64};
  const int64_t bigrows[2] = {32, 32};
  struct consume_plan *plan;

  for (int i = 0; i < 4097; i++) {
    const char *name = tjob_name(job, "k%05d", i);
    tjob_shard0(job, name, SP_DTYPE_UINT8, 1, shape, rows);
    tcons_whole(cons, 0, name, SP_DTYPE_UINT8, 1, shape);
  }
  plan = build(job, cons, 0);
  check_structure(plan);
  ck_assert_uint_eq(plan->nrounds, 2);
  ck_assert_uint_eq(plan->rounds[0].nkeys, 4096);
  ck_assert_uint_eq(plan->rounds[1].nkeys, 1);
  ck_assert_uint_eq(plan->keys[4096].round, 1);
  consume_plan_free(plan);
  /* A budget of 6 bytes: three keys a round; a key of 64 alone. */
  tjob_shard0(job, "k02000x", SP_DTYPE_UINT8, 1, big, bigrows);
  tcons_whole(cons, 0, "k02000x", SP_DTYPE_UINT8, 1, big);
  tjob_limits(job, 0, 6);
  plan = build(job, cons, 0);
  check_structure(plan);
  /* k00000 to k02000 in 667 rounds of three, k02000x alone, the other
   * 2096 keys in 699 rounds. */
  ck_assert_uint_eq(plan->nrounds, 667 + 1 + 699);
  ck_assert_uint_eq(plan->rounds[667].nkeys, 1);
  ck_assert_str_eq(plan->keys[plan->transfer[plan->rounds[667].first]].name,
                   "k02000x");
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(the_digest_ignores_order_and_sees_layouts) {
  struct tjob *job = tjob_new(3);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {6, 4}, rows[3] = {1, 2, 3};
  struct consume_plan *a, *b, *c;
  struct consume_target *t;

  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tjob_shard0(job, "u", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_shard(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 1);
  tcons_shard(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 3);
  tcons_whole(cons, 1, "u", SP_DTYPE_FLOAT32, 2, shape);
  a = build(job, cons, 0);
  b = build(job, cons, 77);
  ck_assert_uint_eq(a->digest, b->digest);
  t = tcons_whole(cons, 0, "u", SP_DTYPE_FLOAT32, 2, shape);
  t->view.stride[0] = 1;
  t->view.stride[1] = 6;
  c = build(job, cons, 0);
  ck_assert_uint_ne(a->digest, c->digest);
  consume_plan_free(a);
  consume_plan_free(b);
  consume_plan_free(c);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(a_stopped_plan_times_out) {
  struct tjob *job = tjob_new(1);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[1] = {4}, rows[1] = {4};
  _Atomic bool stop = true;
  struct plan_input in;
  struct consume_input cin;
  struct consume_plan *plan;
  char msg[128];

  tjob_shard0(job, "w", SP_DTYPE_UINT8, 1, shape, rows);
  tcons_whole(cons, 0, "w", SP_DTYPE_UINT8, 1, shape);
  in = *tjob_input(job, 0, 0);
  in.stop = &stop;
  cin = *tcons_input(cons, &in, 0);
  ck_assert_int_eq(consume_plan_build(&cin, &plan, msg, sizeof msg),
                   SP_ETIMEOUT);
  ck_assert_ptr_null(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* A 2 x 2 grid of boxes (where the dims allow) packed into one new
 * storage with a gap of one element before each box, every box laid out
 * column-major: strided destinations. */
static void grid_pieces(struct tcons *cons, uint32_t c, const char *name,
                        enum sp_dtype dtype, uint32_t ndim,
                        const int64_t *shape) {
  struct consume_piece pieces[4];
  size_t n = 0;
  int64_t at = 1, cut0 = shape[0] / 2, cut1 = ndim > 1 ? shape[1] / 2 : 0;
  uint32_t storage;

  for (int i = 0; i < 2; i++)
    for (int j = 0; j < (ndim > 1 ? 2 : 1); j++) {
      struct consume_piece *p = &pieces[n++];
      int64_t numel = 1;
      memset(p, 0, sizeof *p);
      p->start[0] = i == 0 ? 0 : cut0;
      p->dst.shape[0] = i == 0 ? cut0 : shape[0] - cut0;
      if (ndim > 1) {
        p->start[1] = j == 0 ? 0 : cut1;
        p->dst.shape[1] = j == 0 ? cut1 : shape[1] - cut1;
      }
      for (uint32_t d = 2; d < ndim; d++)
        p->dst.shape[d] = shape[d];
      p->dst.dtype = dtype;
      p->dst.ndim = ndim;
      for (uint32_t d = 0; d < ndim; d++) {
        p->dst.stride[d] = numel;
        numel *= p->dst.shape[d] > 0 ? p->dst.shape[d] : 1;
      }
      p->dst.offset = at;
      at += numel + 1;
    }
  storage = tcons_storage(cons, c, (uint64_t)at * sp__dtype_size(dtype));
  for (size_t i = 0; i < n; i++)
    pieces[i].storage = storage;
  tcons_pieces(cons, c, name, dtype, ndim, shape, n, pieces);
}

/* Random jobs: trainers shard0 (uneven), replicated, plain, expert;
 * consumers whole, shards on a random dim, or box grids packed into one
 * buffer per consumer; random subsets, nodes and limits. */
static void random_job(uint64_t *seed, struct tjob **out_job,
                       struct tcons **out_cons) {
  uint32_t world = 1 + (uint32_t)(tjob_rand(seed) % 5);
  uint32_t ncons = 1 + (uint32_t)(tjob_rand(seed) % 4);
  uint32_t nkeys = 1 + (uint32_t)(tjob_rand(seed) % 6);
  struct tjob *job = tjob_new(world);
  struct tcons *cons = tcons_new(ncons);
  static const enum sp_dtype dtypes[4] = {SP_DTYPE_UINT8, SP_DTYPE_INT16,
                                          SP_DTYPE_FLOAT32, SP_DTYPE_FLOAT64};

  for (uint32_t r = 0; r < world; r++)
    tjob_node(job, r, tjob_rand(seed) % 3);
  for (uint32_t c = 0; c < ncons; c++)
    tcons_node(cons, c, tjob_rand(seed) % 4);
  tjob_limits(job, 1 + (uint32_t)(tjob_rand(seed) % 4),
              tjob_rand(seed) % 2 ? 0 : 1 + tjob_rand(seed) % 400);
  for (uint32_t k = 0; k < nkeys; k++) {
    const char *name = tjob_name(job, "key%u", k);
    enum sp_dtype dtype = dtypes[tjob_rand(seed) % 4];
    uint32_t ndim = 1 + (uint32_t)(tjob_rand(seed) % 3);
    int64_t shape[3], rows[8] = {0};
    int64_t left;
    uint32_t kind = (uint32_t)(tjob_rand(seed) % 4);
    uint32_t shard_dim = (uint32_t)(tjob_rand(seed) % ndim);
    for (uint32_t d = 0; d < ndim; d++)
      shape[d] = (int64_t)(tjob_rand(seed) % 7);
    left = shape[0];
    for (uint32_t r = 0; r + 1 < world; r++) {
      rows[r] =
          left > 0 ? (int64_t)(tjob_rand(seed) % (uint64_t)(left + 1)) : 0;
      left -= rows[r];
    }
    rows[world - 1] = left;
    if (kind == 0)
      tjob_shard0(job, name, dtype, ndim, shape, rows);
    else if (kind == 1)
      tjob_whole(job, name, PLAN_REPLICATED, dtype, ndim, shape);
    else if (kind == 2)
      tjob_whole(job, name, PLAN_PLAIN, dtype, ndim, shape);
    else
      tjob_expert(job, (uint32_t)(tjob_rand(seed) % world), name, dtype, ndim,
                  shape);
    if (tjob_rand(seed) % 3 == 0) {
      /* Every consumer holds a shard along shard_dim, uneven, maybe
       * empty; the last takes the rest. */
      left = shape[shard_dim];
      for (uint32_t c = 0; c < ncons; c++) {
        int64_t take = c + 1 == ncons ? left
                       : left > 0
                           ? (int64_t)(tjob_rand(seed) % (uint64_t)(left + 1))
                           : 0;
        tcons_shard(cons, c, name, dtype, ndim, shape, shard_dim, take);
        left -= take;
      }
      continue;
    }
    for (uint32_t c = 0; c < ncons; c++) {
      uint32_t part = (uint32_t)(tjob_rand(seed) % 3);
      if (part == 1)
        tcons_whole(cons, c, name, dtype, ndim, shape);
      else if (part == 2)
        grid_pieces(cons, c, name, dtype, ndim, shape);
    }
  }
  *out_job = job;
  *out_cons = cons;
}

START_TEST(random_layouts_deliver_every_byte) {
  uint64_t seed = 0x5eed0001u + (uint64_t)_i * 7919u;

  for (int round = 0; round < 25; round++) {
    struct tjob *job;
    struct tcons *cons;
    struct consume_plan *plan, *shuffled;
    random_job(&seed, &job, &cons);
    plan = push_and_compare(job, cons);
    shuffled = build(job, cons, seed | 1);
    ck_assert_uint_eq(plan->digest, shuffled->digest);
    consume_plan_free(shuffled);
    consume_plan_free(plan);
    tcons_free(cons);
    tjob_free(job);
  }
}
END_TEST

/* Changes one field of one destination of one consumer (an offset, a
 * stride, a size, a box's start, a shard's dim, a storage's length) to a
 * nearby value; false when the consumer has nothing to change. */
static bool corrupt(struct tcons *cons, uint32_t nconsumers, uint64_t *seed) {
  uint32_t c = (uint32_t)(tjob_rand(seed) % nconsumers);
  struct consume_target *t;
  struct sp_view *view;
  int64_t delta = (int64_t)(tjob_rand(seed) % 5) - 2;

  t = tcons_target_count(cons, c) > 0
          ? tcons_target(cons, c, tjob_rand(seed) % tcons_target_count(cons, c))
          : NULL;
  if (t == NULL || t->ndim == 0)
    return false;
  view = &t->view;
  if (t->part == CONSUME_PIECES) {
    struct consume_piece *p;
    if (t->npieces == 0)
      return false;
    p = (struct consume_piece *)&t->pieces[tjob_rand(seed) % t->npieces];
    if (tjob_rand(seed) % 3 == 0) {
      p->start[tjob_rand(seed) % t->ndim] += delta != 0 ? delta : 1;
      return true;
    }
    view = &p->dst;
  }
  switch (tjob_rand(seed) % 5) {
  case 0:
    view->offset += delta != 0 ? delta : 1;
    break;
  case 1:
    view->stride[tjob_rand(seed) % t->ndim] += delta != 0 ? delta : 1;
    break;
  case 2:
    view->shape[tjob_rand(seed) % t->ndim] += delta != 0 ? delta : 1;
    break;
  case 3:
    t->dim = (uint32_t)(tjob_rand(seed) % (t->ndim + 1));
    break;
  default: {
    /* Shorter than the buffer behind it, never longer. */
    struct consume_storage *st = tcons_storage_at(
        cons, c, t->part == CONSUME_PIECES ? t->pieces[0].storage : t->storage);
    st->nbytes -= st->nbytes < 2 ? st->nbytes : 1 + tjob_rand(seed) % 2;
    break;
  }
  }
  return true;
}

/* The consumers' side of the seed 003 property: a corrupted target layout
 * is refused, or it is still a layout the consumers asked for and every
 * byte lands where the oracle says, none elsewhere (ASan sees a write past
 * a buffer). */
START_TEST(corrupted_targets_are_refused_or_delivered_exactly) {
  uint64_t seed = 0xc0debadu + (uint64_t)_i * 104729u;
  int refused = 0, delivered = 0;

  for (int n = 0; n < 40; n++) {
    struct tjob *job;
    struct tcons *cons;
    struct consume_plan *plan;
    char msg[512];
    int rc;
    random_job(&seed, &job, &cons);
    plan = build(job, cons, 0);
    consume_plan_free(plan);
    if (corrupt(cons, tcons_count(cons), &seed)) {
      rc = consume_plan_build(tcons_input(cons, tjob_input(job, 0, 0), 0),
                              &plan, msg, sizeof msg);
      if (rc == 0) {
        consume_plan_free(plan);
        consume_plan_free(push_and_compare(job, cons));
        delivered++;
      } else {
        ck_assert_ptr_null(plan);
        ck_assert_uint_gt(strlen(msg), 0);
        refused++;
      }
    }
    tcons_free(cons);
    tjob_free(job);
  }
  ck_assert_int_gt(refused, 0);
  ck_assert_int_gt(delivered, 0);
}
END_TEST

/* The job every refusal spoils one thing of: keys a, b and c of shape
 * (4, 3) in rows over 2 trainers; consumers 0 and 1 hold a's columns 1
 * and 2 (their targets 0), consumer 0 holds b whole (its target 1). */
static const int64_t base_shape[2] = {4, 3};

static void base_job(struct tjob **job, struct tcons **cons) {
  const int64_t rows[2] = {2, 2};

  *job = tjob_new(2);
  *cons = tcons_new(2);
  tjob_shard0(*job, "a", SP_DTYPE_FLOAT32, 2, base_shape, rows);
  tjob_shard0(*job, "b", SP_DTYPE_FLOAT32, 2, base_shape, rows);
  tjob_shard0(*job, "c", SP_DTYPE_FLOAT32, 2, base_shape, rows);
  tcons_shard(*cons, 0, "a", SP_DTYPE_FLOAT32, 2, base_shape, 1, 1);
  tcons_shard(*cons, 1, "a", SP_DTYPE_FLOAT32, 2, base_shape, 1, 2);
  tcons_whole(*cons, 0, "b", SP_DTYPE_FLOAT32, 2, base_shape);
}

static struct consume_target *b_whole(struct tcons *cons) {
  return tcons_target(cons, 0, 1);
}

static void unknown_key(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_whole(cons, 1, "nope", SP_DTYPE_FLOAT32, 2, base_shape);
}
static void key_twice(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_whole(cons, 0, "b", SP_DTYPE_FLOAT32, 2, base_shape);
}
static void other_dtype(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_whole(cons, 1, "b", SP_DTYPE_FLOAT16, 2, base_shape);
}
static void view_of_other_dtype(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.dtype = SP_DTYPE_INT32;
}
static void other_shape(struct tjob *job, struct tcons *cons) {
  const int64_t shape[2] = {4, 4};
  (void)job;
  tcons_whole(cons, 1, "b", SP_DTYPE_FLOAT32, 2, shape);
}
static void other_ndim(struct tjob *job, struct tcons *cons) {
  const int64_t shape[1] = {12};
  (void)job;
  tcons_whole(cons, 1, "b", SP_DTYPE_FLOAT32, 1, shape);
}
static void whole_view_too_small(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.shape[0] = 3;
}
static void view_with_fewer_dims(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.ndim = 1;
}
static void other_device(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_storage_at(cons, 0, b_whole(cons)->storage)->device.type =
      SP_DEVICE_CUDA;
}
static void no_storage(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->storage = 99;
}
static void past_the_storage(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.offset = 1;
}
static void zero_stride(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.stride[0] = 0;
}
static void self_overlap(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->view.stride[0] = 2;
}
static void one_piece(struct tcons *cons, uint32_t c, const char *key,
                      int64_t start0, int64_t rows, uint32_t storage,
                      int64_t offset) {
  struct consume_piece p = {.start = {start0, 0},
                            .storage = storage,
                            .dst = {.dtype = SP_DTYPE_FLOAT32,
                                    .ndim = 2,
                                    .shape = {rows, 3},
                                    .stride = {3, 1},
                                    .offset = offset}};
  tcons_pieces(cons, c, key, SP_DTYPE_FLOAT32, 2, base_shape, 1, &p);
}
static void piece_past_the_tensor(struct tjob *job, struct tcons *cons) {
  (void)job;
  one_piece(cons, 1, "c", 3, 2, tcons_storage(cons, 1, 24), 0);
}
static void piece_before_the_tensor(struct tjob *job, struct tcons *cons) {
  (void)job;
  one_piece(cons, 1, "c", -1, 1, tcons_storage(cons, 1, 12), 0);
}
static void shards_on_two_dims(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_shard(cons, 0, "c", SP_DTYPE_FLOAT32, 2, base_shape, 1, 3);
  tcons_shard(cons, 1, "c", SP_DTYPE_FLOAT32, 2, base_shape, 0, 4);
}
static void shards_that_do_not_tile(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_target(cons, 1, 0)->view.shape[1] = 1;
}
static void shard_slice_of_other_shape(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_target(cons, 1, 0)->view.shape[0] = 3;
}
static void shard_dim_past_the_key(struct tjob *job, struct tcons *cons) {
  (void)job;
  tcons_target(cons, 1, 0)->dim = 5;
}
static void unknown_part(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->part = (enum consume_part)9;
}
static void target_without_key(struct tjob *job, struct tcons *cons) {
  (void)job;
  b_whole(cons)->key = NULL;
}
/* b's row 0 at bytes 0-11 and c's row 0 at bytes 8-19 of one buffer. */
static void targets_overlap(struct tjob *job, struct tcons *cons) {
  uint32_t s = tcons_storage(cons, 1, 24);
  (void)job;
  one_piece(cons, 1, "b", 0, 1, s, 0);
  one_piece(cons, 1, "c", 0, 1, s, 2);
}
/* Consumer 0's b at bytes 0-47 of memory 7, consumer 1's c from byte 40. */
static void consumers_alias(struct tjob *job, struct tcons *cons) {
  uint32_t s0 = tcons_storage_in(cons, 0, 7, 0, 48);
  uint32_t s1 = tcons_storage_in(cons, 1, 7, 40, 48);
  struct consume_target *t;
  (void)job;
  b_whole(cons)->storage = s0;
  t = tcons_whole(cons, 1, "c", SP_DTYPE_FLOAT32, 2, base_shape);
  t->storage = s1;
}
/* One byte of memory 9 is consumer 0's and consumer 1's 0-d target. */
static void scalars_alias(struct tjob *job, struct tcons *cons) {
  for (uint32_t c = 0; c < 2; c++) {
    struct consume_target *t =
        tcons_whole(cons, c, "s", SP_DTYPE_UINT8, 0, base_shape);
    t->storage = tcons_storage_in(cons, c, 9, 0, 1);
  }
  tjob_whole(job, "s", PLAN_PLAIN, SP_DTYPE_UINT8, 0, base_shape);
}
static void trainers_disagree(struct tjob *job, struct tcons *cons) {
  (void)cons;
  tjob_drop(job, 1, "c");
}
static void trainer_piece_on_no_box(struct tjob *job, struct tcons *cons) {
  /* Columns dealt round-robin: rank r holds the columns r, r + 2. */
  static uint32_t holders[2] = {0, 1};
  static struct affine_piece p[2];
  static const struct affine_piece *pieces[2] = {&p[0], &p[1]};
  const int64_t shape[2] = {2, 4};
  const uint64_t numel[2] = {4, 4};
  const size_t npieces[2] = {1, 1};
  for (int r = 0; r < 2; r++)
    p[r] = (struct affine_piece){.ndim = 2,
                                 .shape = {2, 2},
                                 .src_stride = {2, 1},
                                 .dst_offset = r,
                                 .dst_stride = {4, 2},
                                 .nholders = 1,
                                 .holders = &holders[r]};
  tjob_affine(job, "rr", SP_DTYPE_UINT8, 2, shape, numel, pieces, npieces);
  tcons_whole(cons, 1, "rr", SP_DTYPE_UINT8, 2, shape);
}
/* Rank 0 lists row 0 as a replica it shares with rank 1, which does not
 * list it: exports take rank 0's copy, but the holder chosen to send the
 * set {0, 1} to consumers is rank 1. */
static void replica_its_sender_lacks(struct tjob *job, struct tcons *cons) {
  static uint32_t both[2] = {0, 1}, one[1] = {1};
  static struct affine_piece p[2];
  static const struct affine_piece *pieces[2] = {&p[0], &p[1]};
  const int64_t shape[2] = {2, 2};
  const uint64_t numel[2] = {2, 2};
  const size_t npieces[2] = {1, 1};
  for (int r = 0; r < 2; r++)
    p[r] = (struct affine_piece){.ndim = 2,
                                 .shape = {1, 2},
                                 .src_stride = {2, 1},
                                 .dst_offset = 2 * r,
                                 .dst_stride = {2, 1},
                                 .nholders = r == 0 ? 2 : 1,
                                 .holders = r == 0 ? both : one};
  tjob_affine(job, "rp", SP_DTYPE_UINT8, 2, shape, numel, pieces, npieces);
  tcons_whole(cons, 1, "rp", SP_DTYPE_UINT8, 2, shape);
}

struct refusal {
  const char *name;
  void (*spoil)(struct tjob *, struct tcons *);
  int code;
  const char *says;
};

static const struct refusal refusals[] = {
    {"unknown key", unknown_key, SP_EKEYSET,
     "consumer 1 wants key 'nope', which no trainer registered"},
    {"key twice", key_twice, SP_EDUPKEY, "consumer 0 lists key 'b' twice"},
    {"dtype", other_dtype, SP_EDTYPEMISMATCH,
     "consumer 1 wants key 'b' as float16 but the trainers hold float32"},
    {"view dtype", view_of_other_dtype, SP_EDTYPEMISMATCH,
     "consumer 0's target for key 'b' is float32 but a view of it is int32"},
    {"shape", other_shape, SP_ESHAPE,
     "consumer 1 expects key 'b' with 4 in dim 1 but the trainers' has 3"},
    {"ndim", other_ndim, SP_ESHAPE,
     "consumer 1 expects key 'b' with 1 dims but the trainers' has 2"},
    {"whole view", whole_view_too_small, SP_ESHAPE,
     "consumer 0's whole of key 'b' has 3 in dim 0, the key 4"},
    {"view dims", view_with_fewer_dims, SP_ESHAPE,
     "consumer 0's view for key 'b' has 1 dims, the key 2"},
    {"device", other_device, SP_EDEVICEMISMATCH,
     "consumer 0 wants key 'b' on cuda but the trainers hold it on cpu"},
    {"storage", no_storage, SP_ENOSTORAGE,
     "consumer 0's target for key 'b' names storage 99 of 2"},
    {"bounds", past_the_storage, SP_EOUTOFBOUNDS,
     "consumer 0's target for key 'b': "},
    {"zero stride", zero_stride, SP_EZEROSTRIDE,
     "consumer 0's target for key 'b': "},
    {"self overlap", self_overlap, SP_ESELFOVERLAP,
     "consumer 0's target for key 'b': "},
    {"piece past", piece_past_the_tensor, SP_EDESTBOUNDS,
     "consumer 1's piece 0 of key 'c' starts at 3 in dim 0 and holds 2, "
     "outside the key's 4"},
    {"piece before", piece_before_the_tensor, SP_EDESTBOUNDS,
     "consumer 1's piece 0 of key 'c' starts at -1 in dim 0"},
    {"shard dims", shards_on_two_dims, SP_EPLACEMENT,
     "key 'c' is sharded along dim 1 by consumer 0 but along dim 0 by "
     "consumer 1"},
    {"tiling", shards_that_do_not_tile, SP_ETILING,
     "key 'a': the dim-1 shards of its 2 consumers hold 2 but the key has 3"},
    {"shard shape", shard_slice_of_other_shape, SP_ETILING,
     "consumer 1's shard of key 'a' has 3 in dim 0, the key 4"},
    {"shard dim", shard_dim_past_the_key, SP_EINVAL,
     "consumer 1 shards key 'a' along dim 5 of 2"},
    {"part", unknown_part, SP_EUNSUPPORTED,
     "consumer 0 gives key 'b' unknown part 9"},
    {"no key", target_without_key, SP_EINVAL,
     "consumer 0 lists a target without a key"},
    {"overlap", targets_overlap, SP_EDOUBLEWRITE,
     "consumer 1's targets for keys 'b' and 'c' share byte 8 of one buffer"},
    {"alias", consumers_alias, SP_EDOUBLEWRITE,
     "the targets of consumer 0 for key 'b' and of consumer 1 for key 'c' "
     "share byte 40 of one buffer"},
    {"scalars alias", scalars_alias, SP_EDOUBLEWRITE,
     "the targets of consumer 0 for key 's' and of consumer 1 for key 's' "
     "share byte 0 of one buffer"},
    {"trainers", trainers_disagree, SP_EKEYSET,
     "key 'c' is registered by rank 0 but not by rank 1"},
    {"no box", trainer_piece_on_no_box, SP_EUNSUPPORTED,
     "key 'rr': piece 0 of rank 0 lands on no box of the whole tensor"},
    {"replica", replica_its_sender_lacks, SP_EUNSUPPORTED,
     "key 'rp': the holders chosen to send its replicas leave out element "
     "[0, 0]"},
};

/* Each refusal has its code and sentence, the same whatever order the
 * consumers and their targets come in; the unspoilt job plans. */
START_TEST(every_refusal) {
  const struct refusal *r = &refusals[_i];
  struct tjob *job;
  struct tcons *cons;
  struct consume_plan *plan;
  char first[512], again[512];

  base_job(&job, &cons);
  plan = build(job, cons, 0);
  consume_plan_free(plan);
  r->spoil(job, cons);
  ck_assert_msg(refuse(job, cons, 0, first, sizeof first) == r->code, "%s: %s",
                r->name, first);
  ck_assert_msg(strstr(first, r->says) != NULL, "%s: '%s'", r->name, first);
  ck_assert_int_eq(refuse(job, cons, 99, again, sizeof again), r->code);
  ck_assert_str_eq(first, again);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

static int refuse_input(struct tjob *job, struct tcons *cons, size_t n,
                        uint32_t index_of_1, char *msg, size_t msglen) {
  struct consume_input in = *tcons_input(cons, tjob_input(job, 0, 0), 0);
  struct consume_in copy[2] = {in.consumers[0], in.consumers[1]};
  struct consume_plan *plan;
  int rc;

  copy[1].index = index_of_1;
  in.consumers = copy;
  in.nconsumer_in = n;
  rc = consume_plan_build(&in, &plan, msg, msglen);
  ck_assert_ptr_null(plan);
  return rc;
}

START_TEST(consumers_each_once) {
  struct tjob *job;
  struct tcons *cons;
  char msg[256];

  base_job(&job, &cons);
  ck_assert_int_eq(refuse_input(job, cons, 1, 1, msg, sizeof msg), SP_ERANK);
  ck_assert_str_eq(msg, "1 consumers joined a job of 2 consumers");
  ck_assert_int_eq(refuse_input(job, cons, 2, 2, msg, sizeof msg), SP_ERANK);
  ck_assert_str_eq(msg, "consumer 2 is outside the job's 2 consumers");
  ck_assert_int_eq(refuse_input(job, cons, 2, 0, msg, sizeof msg), SP_ERANK);
  ck_assert_str_eq(msg, "consumer 0 joined twice");
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* One memory object on two devices is two buffers: no alias. */
START_TEST(one_memory_id_on_two_devices_does_not_alias) {
  struct tjob *job;
  struct tcons *cons;
  struct consume_plan *plan;

  base_job(&job, &cons);
  consumers_alias(job, cons);
  tcons_storage_at(cons, 1, 1)->device.index = 1;
  plan = build(job, cons, 0);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* The affine layouts of the planner's property test (tgen.h) as trainers:
 * a layout whose pieces all land on boxes delivers every byte to consumers
 * holding column shards and a whole copy; one with a piece on no box is
 * refused as unsupported.  Both kinds are drawn. */
START_TEST(affine_trainer_layouts) {
  uint64_t seed = 0xaff1e;
  int delivered = 0, refused = 0;

  for (int n = 0; n < 60; n++) {
    static struct tgen_layout l;
    struct tjob *job;
    struct tcons *cons = tcons_new(3);
    const struct affine_piece *pieces[TGEN_MAX_RANKS];
    struct consume_plan *plan;
    int64_t cols;
    char msg[512];
    int rc;
    tgen_generate(&l, &seed);
    job = tjob_new(l.nranks);
    for (uint32_t r = 0; r < l.nranks; r++)
      pieces[r] = l.pieces[r];
    tjob_affine(job, "p", SP_DTYPE_INT32, l.ndim, l.shape, l.shard_numel,
                pieces, l.npieces);
    cols = l.shape[l.ndim - 1];
    tcons_shard(cons, 0, "p", SP_DTYPE_INT32, l.ndim, l.shape, l.ndim - 1,
                cols / 3);
    tcons_shard(cons, 1, "p", SP_DTYPE_INT32, l.ndim, l.shape, l.ndim - 1,
                cols - cols / 3);
    tcons_whole(cons, 2, "p", SP_DTYPE_INT32, l.ndim, l.shape);
    rc = consume_plan_build(tcons_input(cons, tjob_input(job, 0, 0), 0), &plan,
                            msg, sizeof msg);
    if (rc == 0) {
      consume_plan_free(plan);
      consume_plan_free(push_and_compare(job, cons));
      delivered++;
    } else {
      ck_assert_msg(rc == SP_EUNSUPPORTED && strstr(msg, "no box") != NULL,
                    "%d: %s", rc, msg);
      refused++;
    }
    tcons_free(cons);
    tjob_free(job);
  }
  ck_assert_int_gt(delivered, 10);
  ck_assert_int_gt(refused, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-consume");
  TCase *tc = tcase_create("consume");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, rows_into_uneven_columns);
  tcase_add_test(tc, columns_of_trainers_into_uneven_rows);
  tcase_add_test(tc, replicated_plain_and_expert_keys);
  tcase_add_test(tc, fused_qkv_through_pieces);
  tcase_add_test(tc, a_subset_of_keys);
  tcase_add_test(tc, local_copies_and_buckets_between_nodes);
  tcase_add_test(tc, rounds_at_4096_keys_and_the_byte_budget);
  tcase_add_test(tc, the_digest_ignores_order_and_sees_layouts);
  tcase_add_test(tc, a_stopped_plan_times_out);
  tcase_add_loop_test(tc, random_layouts_deliver_every_byte, 0, 8);
  tcase_add_loop_test(tc, corrupted_targets_are_refused_or_delivered_exactly, 0,
                      8);
  tcase_add_loop_test(tc, every_refusal, 0,
                      (int)(sizeof refusals / sizeof refusals[0]));
  tcase_add_test(tc, consumers_each_once);
  tcase_add_test(tc, one_memory_id_on_two_devices_does_not_alias);
  tcase_add_test(tc, affine_trainer_layouts);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
