/*
 * test_consume_run.c - a push's local moves run by the movers
 * (daemon/xfer/consume_run.h): trainers sharded one way copied straight
 * into consumers sharded another way on one node, every delivered byte
 * compared with the unsharded original by the consumer planner's oracle
 * (tests/unit/plan/tcons.h), on one thread and several, with large moves
 * cut into slices; moves sent from other nodes left alone; a trainer's or
 * a consumer's file truncated under the run failing it with the rank, the
 * consumer and the key named.  Across nodes, the buckets packed by their
 * senders and unpacked by their consumers (daemon/xfer/consume_pack.h)
 * complete every consumer's bytes, on nodes with trainers and without.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/plan/consume.h"
#include "daemon/xfer/consume_pack.h"
#include "daemon/xfer/consume_run.h"
#include "shardport.h"
#include "tests/unit/plan/tcons.h"
#include "tests/unit/plan/tjob.h"

/* The storages of a run over tdata and tcons buffers. */
struct sides {
  uint32_t world, nconsumers;
  struct xfer_storage **src;
  uint8_t ***dst;
};

static struct sides sides_new(struct tcons *cons, const struct tdata *data,
                              uint32_t world) {
  struct sides s = {.world = world, .nconsumers = tcons_count(cons)};
  s.src = calloc(world, sizeof *s.src);
  s.dst = calloc(s.nconsumers, sizeof *s.dst);
  ck_assert(s.src != NULL && s.dst != NULL);
  for (uint32_t r = 0; r < world; r++) {
    size_t n = tdata_storage_count(data, r);
    s.src[r] = calloc(n > 0 ? n : 1, sizeof *s.src[r]);
    ck_assert_ptr_nonnull(s.src[r]);
    for (size_t i = 0; i < n; i++)
      s.src[r][i] = (struct xfer_storage){
          .sid = (uint32_t)i + 1, .data = tdata_bytes(data, r, (uint32_t)i)};
  }
  for (uint32_t c = 0; c < s.nconsumers; c++) {
    size_t n = tcons_storage_count(cons, c);
    s.dst[c] = calloc(n > 0 ? n : 1, sizeof *s.dst[c]);
    ck_assert_ptr_nonnull(s.dst[c]);
    for (size_t i = 0; i < n; i++)
      s.dst[c][i] = tcons_bytes(cons, c, (uint32_t)i);
  }
  return s;
}

static void sides_free(struct sides *s) {
  for (uint32_t r = 0; r < s->world; r++)
    free(s->src[r]);
  for (uint32_t c = 0; c < s->nconsumers; c++)
    free(s->dst[c]);
  free(s->src);
  free(s->dst);
}

static struct consume_plan *build(struct tjob *job, struct tcons *cons) {
  struct consume_plan *plan;
  char msg[512];
  int rc = consume_plan_build(tcons_input(cons, tjob_input(job, 0, 0), 0),
                              &plan, msg, sizeof msg);
  ck_assert_msg(rc == 0, "%d: %s", rc, msg);
  return plan;
}

static void on_one_node(struct tjob *job, uint32_t world, struct tcons *cons) {
  for (uint32_t r = 0; r < world; r++)
    tjob_node(job, r, 7);
  for (uint32_t c = 0; c < tcons_count(cons); c++)
    tcons_node(cons, c, 7);
}

/* Runs the plan's local moves with the given threads and chunk, for two
 * sets of values (a push repeats with fresh weights on one plan), and
 * compares every consumer byte with the oracle and the byte counts with
 * the plan's. */
static void run_and_compare(struct tjob *job, uint32_t world,
                            struct tcons *cons, uint32_t threads,
                            uint64_t chunk) {
  struct consume_plan *plan = build(job, cons);
  char msg[256];

  for (uint64_t values = 1; values <= 2; values++) {
    struct tdata *data = tdata_new(tjob_input(job, 0, 0), values);
    struct sides s = sides_new(cons, data, world);
    _Atomic uint64_t *received = calloc(plan->nconsumers, sizeof *received);
    struct consume_run run = {.plan = plan,
                              .node = 7,
                              .src = (const struct xfer_storage *const *)s.src,
                              .dst = (uint8_t *const *const *)s.dst,
                              .threads = threads,
                              .chunk = chunk,
                              .received = received};
    uint64_t total = 0;
    tcons_clear(cons);
    ck_assert_int_eq(consume_run_local(&run), 0);
    ck_assert_msg(tcons_compare(cons, data, msg, sizeof msg) == 0, "%s", msg);
    for (uint32_t c = 0; c < plan->nconsumers; c++) {
      ck_assert_uint_eq(received[c], plan->received[c]);
      total += plan->received[c];
    }
    ck_assert_uint_eq(run.bytes_moved, total);
    free(received);
    sides_free(&s);
    tdata_free(data);
  }
  consume_plan_free(plan);
}

/* Every scenario on one thread with whole moves, and on three threads
 * with moves cut into slices of a few rows. */
static void run_both_ways(struct tjob *job, uint32_t world,
                          struct tcons *cons) {
  on_one_node(job, world, cons);
  run_and_compare(job, world, cons, 1, 0);
  run_and_compare(job, world, cons, 3, 16);
}

START_TEST(rows_into_uneven_columns) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {10, 7}, rows[4] = {3, 0, 4, 3};

  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_shard(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 2);
  tcons_shard(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 5);
  run_both_ways(job, 4, cons);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(columns_of_trainers_into_uneven_rows) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(3);
  const int64_t shape[2] = {5, 6};
  struct affine_piece p[2];
  uint32_t holders[2] = {0, 1};
  const struct affine_piece *pieces[2] = {&p[0], &p[1]};
  const uint64_t numel[2] = {5 * 4, 5 * 2};
  const size_t npieces[2] = {1, 1};

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
  run_both_ways(job, 2, cons);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(replicated_plain_scalar_and_expert_keys) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t rshape[2] = {9, 3}, pshape[1] = {2}, eshape[2] = {3, 3};
  const int64_t *scalar = rshape; /* 0-d: no dim is read */

  tjob_whole(job, "rep", PLAN_REPLICATED, SP_DTYPE_FLOAT32, 2, rshape);
  tjob_whole(job, "plain", PLAN_PLAIN, SP_DTYPE_UINT8, 1, pshape);
  tjob_whole(job, "scalar", PLAN_REPLICATED, SP_DTYPE_FLOAT64, 0, scalar);
  tjob_expert(job, 2, "expert", SP_DTYPE_BFLOAT16, 2, eshape);
  tcons_whole(cons, 0, "rep", SP_DTYPE_FLOAT32, 2, rshape);
  tcons_whole(cons, 0, "plain", SP_DTYPE_UINT8, 1, pshape);
  tcons_whole(cons, 0, "scalar", SP_DTYPE_FLOAT64, 0, scalar);
  tcons_shard(cons, 1, "expert", SP_DTYPE_BFLOAT16, 2, eshape, 1, 3);
  tcons_shard(cons, 1, "rep", SP_DTYPE_FLOAT32, 2, rshape, 0, 9);
  run_both_ways(job, 4, cons);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* q, k and v, FSDP rows over 4 trainers, into 2 tensor-parallel consumers
 * each holding one fused buffer of its heads: [q rows | k rows | v rows]. */
START_TEST(fused_qkv_through_pieces) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t qshape[2] = {8, 4}, kvshape[2] = {4, 4};
  const int64_t qrows[4] = {2, 2, 2, 2}, kvrows[4] = {1, 2, 0, 1};

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
  run_both_ways(job, 4, cons);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(a_subset_of_keys) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[1] = {6}, rows[2] = {3, 3};

  tjob_shard0(job, "a", SP_DTYPE_INT32, 1, shape, rows);
  tjob_shard0(job, "b", SP_DTYPE_INT32, 1, shape, rows);
  tjob_shard0(job, "unwanted", SP_DTYPE_INT32, 1, shape, rows);
  tcons_whole(cons, 0, "a", SP_DTYPE_INT32, 1, shape);
  tcons_shard(cons, 1, "b", SP_DTYPE_INT32, 1, shape, 0, 6);
  run_both_ways(job, 2, cons);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

START_TEST(rounds_of_the_byte_budget) {
  /* Six keys of 48 bytes under a 100-byte budget: several rounds, each
   * run after the one before. */
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[2] = {4, 3}, rows[2] = {1, 3};

  for (int k = 0; k < 6; k++) {
    const char *name = tjob_name(job, "key%d", k);
    tjob_shard0(job, name, SP_DTYPE_FLOAT32, 2, shape, rows);
    tcons_shard(cons, 0, name, SP_DTYPE_FLOAT32, 2, shape, 1, 3);
  }
  tjob_limits(job, 4096, 100);
  on_one_node(job, 2, cons);
  struct consume_plan *plan = build(job, cons);
  ck_assert_uint_gt(plan->nrounds, 1);
  consume_plan_free(plan);
  run_and_compare(job, 2, cons, 2, 16);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* Ranks 0 and 1 and consumer 0 on node 7, ranks 2 and 3 and consumer 1 on
 * node 8: node 7's run copies exactly the moves its ranks send to its
 * consumer and touches nothing of node 8 (whose buffers it is not even
 * given), and the buckets between nodes are not its. */
START_TEST(only_this_nodes_local_moves) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {8, 2}, rows[4] = {2, 2, 2, 2};

  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_whole(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape);
  tcons_whole(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape);
  for (uint32_t r = 0; r < 4; r++)
    tjob_node(job, r, r < 2 ? 7 : 8);
  tcons_node(cons, 0, 7);
  tcons_node(cons, 1, 8);
  struct consume_plan *plan = build(job, cons);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 3);
  struct sides s = sides_new(cons, data, 4);
  free(s.dst[1]);
  s.dst[1] = NULL;
  free(s.src[2]);
  free(s.src[3]);
  s.src[2] = s.src[3] = NULL;
  struct consume_run run = {.plan = plan,
                            .node = 7,
                            .src = (const struct xfer_storage *const *)s.src,
                            .dst = (uint8_t *const *const *)s.dst,
                            .threads = 2};
  const uint8_t *got = tcons_bytes(cons, 0, 0);
  const uint8_t *rank0 = tdata_bytes(data, 0, 0);
  const uint8_t *rank1 = tdata_bytes(data, 1, 0);

  tcons_clear(cons);
  ck_assert_int_eq(consume_run_local(&run), 0);
  /* Rows 0..3 came from ranks 0 and 1; rows 4..7 are node 8's to send. */
  ck_assert_uint_eq(run.bytes_moved, 4 * 2 * 4);
  ck_assert_mem_eq(got, rank0, 2 * 2 * 4);
  ck_assert_mem_eq(got + 2 * 2 * 4, rank1, 2 * 2 * 4);
  for (size_t i = 4 * 2 * 4; i < 8 * 2 * 4; i++)
    ck_assert_uint_eq(got[i], TCONS_UNTOUCHED);
  for (size_t i = 0; i < 8 * 2 * 4; i++)
    ck_assert_uint_eq(tcons_bytes(cons, 1, 0)[i], TCONS_UNTOUCHED);
  sides_free(&s);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* A page-sized memfd mapping holding bytes, then truncated to nothing: a
 * read or write of it faults with SIGBUS. */
static uint8_t *truncated_mapping(const uint8_t *bytes, size_t n, int prot) {
  long page = sysconf(_SC_PAGESIZE);
  int fd = memfd_create("consume-run-test", MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, page), 0);
  ck_assert_int_eq(pwrite(fd, bytes, n, 0), (ssize_t)n);
  uint8_t *map = mmap(NULL, (size_t)page, prot, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(map, MAP_FAILED);
  ck_assert_int_eq(ftruncate(fd, 0), 0);
  close(fd);
  return map;
}

/* Every node's local run, then every bucket packed from its sender's
 * storages and unpacked into its consumer's buffers, for two sets of
 * values; every consumer byte compared with the oracle. */
static void push_across_nodes(struct tjob *job, uint32_t world,
                              struct tcons *cons, const uint64_t *nodes,
                              size_t nnodes) {
  struct consume_plan *plan = build(job, cons);
  char msg[512];
  size_t buckets = 0;

  for (uint64_t values = 1; values <= 2; values++) {
    struct tdata *data = tdata_new(tjob_input(job, 0, 0), values);
    struct sides s = sides_new(cons, data, world);
    tcons_clear(cons);
    for (size_t n = 0; n < nnodes; n++) {
      struct consume_run run = {.plan = plan,
                                .node = nodes[n],
                                .src =
                                    (const struct xfer_storage *const *)s.src,
                                .dst = (uint8_t *const *const *)s.dst,
                                .threads = 2};
      ck_assert_int_eq(consume_run_local(&run), 0);
    }
    for (size_t r = 0; r < plan->nrounds; r++)
      for (size_t b = 0; b < plan->rounds[r].nbuckets; b++) {
        const struct consume_bucket *bk = &plan->rounds[r].buckets[b];
        uint8_t *staging = malloc(bk->nbytes);
        ck_assert_ptr_nonnull(staging);
        ck_assert_int_eq(
            consume_pack(plan, r, b, s.src[bk->src], staging, msg, sizeof msg),
            0);
        ck_assert_int_eq(consume_unpack(plan, r, b, staging, s.dst[bk->dst],
                                        msg, sizeof msg),
                         0);
        free(staging);
        buckets++;
      }
    ck_assert_msg(tcons_compare(cons, data, msg, sizeof msg) == 0, "%s", msg);
    sides_free(&s);
    tdata_free(data);
  }
  ck_assert_uint_gt(buckets, 0);
  consume_plan_free(plan);
}

/* Ranks 0 and 1 and consumer 0 on node 10, ranks 2 and 3 on node 11,
 * consumer 1 on node 12 where no trainer is: rows into columns, a
 * replicated key, an expert, and q, k, v into one fused buffer each, with
 * strided destinations. */
START_TEST(buckets_between_nodes_complete_every_consumer) {
  struct tjob *job = tjob_new(4);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {9, 6}, rows[4] = {3, 0, 4, 2};
  const int64_t qshape[2] = {8, 4}, kvshape[2] = {4, 4};
  const int64_t qrows[4] = {2, 2, 2, 2}, kvrows[4] = {1, 2, 0, 1};
  const int64_t rshape[2] = {5, 3}, eshape[1] = {7};
  const uint64_t nodes[3] = {10, 11, 12};

  for (uint32_t r = 0; r < 4; r++)
    tjob_node(job, r, 10 + r / 2);
  tcons_node(cons, 0, 10);
  tcons_node(cons, 1, 12);
  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_shard(cons, 0, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 2);
  tcons_shard(cons, 1, "w", SP_DTYPE_FLOAT32, 2, shape, 1, 4);
  tjob_whole(job, "rep", PLAN_REPLICATED, SP_DTYPE_INT16, 2, rshape);
  tcons_whole(cons, 1, "rep", SP_DTYPE_INT16, 2, rshape);
  tjob_expert(job, 3, "expert", SP_DTYPE_UINT8, 1, eshape);
  tcons_whole(cons, 0, "expert", SP_DTYPE_UINT8, 1, eshape);
  tjob_shard0(job, "q", SP_DTYPE_FLOAT16, 2, qshape, qrows);
  tjob_shard0(job, "k", SP_DTYPE_FLOAT16, 2, kvshape, kvrows);
  tjob_shard0(job, "v", SP_DTYPE_FLOAT16, 2, kvshape, kvrows);
  for (uint32_t c = 0; c < 2; c++) {
    uint32_t fused = tcons_storage(cons, c, (4 + 2 + 2) * 4 * 2);
    const char *names[3] = {"q", "k", "v"};
    const int64_t part[3] = {4, 2, 2}, at[3] = {0, 16, 24};
    for (int i = 0; i < 3; i++) {
      struct consume_piece piece = {.start = {part[i] * c, 0},
                                    .storage = fused,
                                    .dst = {.dtype = SP_DTYPE_FLOAT16,
                                            .ndim = 2,
                                            .shape = {part[i], 4},
                                            .stride = {4, 1},
                                            .offset = at[i]}};
      tcons_pieces(cons, c, names[i], SP_DTYPE_FLOAT16, 2,
                   i == 0 ? qshape : kvshape, 1, &piece);
    }
  }
  push_across_nodes(job, 4, cons, nodes, 3);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* The bytes between nodes are each move's elements in row-major order of
 * its shape, what the other node's daemon unpacks: rank 0's contiguous
 * (3, 5) tensor packs as its own bytes for consumer 0, and columns 1..3
 * of it, for consumer 1, as those rows' runs. */
START_TEST(a_bucket_is_row_major) {
  struct tjob *job = tjob_new(1);
  struct tcons *cons = tcons_new(2);
  const int64_t shape[2] = {3, 5}, rows[1] = {3};
  char msg[256];

  tjob_shard0(job, "w", SP_DTYPE_INT16, 2, shape, rows);
  tcons_whole(cons, 0, "w", SP_DTYPE_INT16, 2, shape);
  struct consume_piece piece = {.start = {0, 1},
                                .storage = tcons_storage(cons, 1, 3 * 3 * 2),
                                .dst = {.dtype = SP_DTYPE_INT16,
                                        .ndim = 2,
                                        .shape = {3, 3},
                                        .stride = {3, 1}}};
  tcons_pieces(cons, 1, "w", SP_DTYPE_INT16, 2, shape, 1, &piece);
  tjob_node(job, 0, 1);
  tcons_node(cons, 0, 2);
  tcons_node(cons, 1, 2);
  struct consume_plan *plan = build(job, cons);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 9);
  struct sides s = sides_new(cons, data, 1);
  const uint8_t *w = tdata_bytes(data, 0, 0);
  uint8_t whole[30], columns[18];

  memcpy(whole, w, sizeof whole);
  for (int r = 0; r < 3; r++)
    memcpy(columns + 6 * r, w + (r * 5 + 1) * 2, 6);
  /* One bucket per consumer, one move each. */
  const struct consume_round *round = &plan->rounds[0];
  ck_assert_uint_eq(round->nbuckets, 2);
  for (size_t b = 0; b < 2; b++) {
    const struct consume_bucket *bk = &round->buckets[b];
    uint8_t packed[30];
    ck_assert_uint_eq(bk->nmoves, 1);
    ck_assert_uint_eq(bk->nbytes, bk->dst == 0 ? 30 : 18);
    ck_assert_int_eq(
        consume_pack(plan, 0, b, s.src[0], packed, msg, sizeof msg), 0);
    if (bk->dst == 0)
      ck_assert_mem_eq(packed, whole, sizeof whole);
    else
      ck_assert_mem_eq(packed, columns, sizeof columns);
  }
  sides_free(&s);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

/* Rank 0 on node 1 packs for consumer 0 on node 2, whose buffer or the
 * rank's storage is truncated: the bucket fails naming both sides. */
static void truncated_bucket(bool trainer, char *msg, size_t msglen) {
  struct tjob *job = tjob_new(1);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[2] = {4, 4}, rows[1] = {4};
  long page = sysconf(_SC_PAGESIZE);

  tjob_shard0(job, "layer.w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_whole(cons, 0, "layer.w", SP_DTYPE_FLOAT32, 2, shape);
  tjob_node(job, 0, 1);
  tcons_node(cons, 0, 2);
  struct consume_plan *plan = build(job, cons);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 5);
  struct sides s = sides_new(cons, data, 1);
  uint8_t staging[64], *map;
  tcons_clear(cons);
  ck_assert_uint_eq(plan->rounds[0].nbuckets, 1);
  ck_assert_uint_eq(plan->rounds[0].buckets[0].nbytes, sizeof staging);
  if (trainer) {
    map = truncated_mapping(tdata_bytes(data, 0, 0), 64, PROT_READ);
    s.src[0][0].data = map;
    ck_assert_int_eq(consume_pack(plan, 0, 0, s.src[0], staging, msg, msglen),
                     SP_EBADFD);
  } else {
    map =
        truncated_mapping(tcons_bytes(cons, 0, 0), 64, PROT_READ | PROT_WRITE);
    s.dst[0][0] = map;
    ck_assert_int_eq(consume_pack(plan, 0, 0, s.src[0], staging, msg, msglen),
                     0);
    ck_assert_int_eq(consume_unpack(plan, 0, 0, staging, s.dst[0], msg, msglen),
                     SP_EBADFD);
  }
  munmap(map, (size_t)page);
  sides_free(&s);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}

START_TEST(a_truncated_file_fails_its_bucket) {
  char msg[SP_ERRMSG_MAX + 1];
  truncated_bucket(true, msg, sizeof msg);
  ck_assert_str_eq(msg, "rank 0's storage could not be read for key 'layer.w' "
                        "or a key after it in its bucket to consumer 0 (was "
                        "its file truncated after it was registered?)");
  truncated_bucket(false, msg, sizeof msg);
  ck_assert_str_eq(msg, "consumer 0's buffers could not be written for key "
                        "'layer.w' or a key after it in its bucket from rank 0 "
                        "(was a file truncated after it was registered?)");
}
END_TEST

/* Two ranks' rows into one consumer's whole tensor on one node, with
 * rank 1's storage or the consumer's buffer truncated under the run. */
static void truncated(bool trainer, char *msg, size_t msglen) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[2] = {4, 4}, rows[2] = {2, 2};
  long page = sysconf(_SC_PAGESIZE);

  tjob_shard0(job, "layer.w", SP_DTYPE_FLOAT32, 2, shape, rows);
  tcons_whole(cons, 0, "layer.w", SP_DTYPE_FLOAT32, 2, shape);
  on_one_node(job, 2, cons);
  struct consume_plan *plan = build(job, cons);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 5);
  struct sides s = sides_new(cons, data, 2);
  uint8_t *map;
  tcons_clear(cons);
  if (trainer) {
    map = truncated_mapping(tdata_bytes(data, 1, 0), 2 * 4 * 4, PROT_READ);
    s.src[1][0].data = map;
  } else {
    map = truncated_mapping(tcons_bytes(cons, 0, 0), 4 * 4 * 4,
                            PROT_READ | PROT_WRITE);
    s.dst[0][0] = map;
  }
  struct consume_run run = {.plan = plan,
                            .node = 7,
                            .src = (const struct xfer_storage *const *)s.src,
                            .dst = (uint8_t *const *const *)s.dst,
                            .threads = 2};
  ck_assert_int_eq(consume_run_local(&run), SP_EBADFD);
  snprintf(msg, msglen, "%s", run.msg);
  munmap(map, (size_t)page);
  sides_free(&s);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}

START_TEST(a_trainer_file_truncated_fails_naming_rank_key_and_consumer) {
  char msg[SP_ERRMSG_MAX + 1];
  truncated(true, msg, sizeof msg);
  ck_assert_str_eq(msg, "rank 1's storage sid 1 could not be read for key "
                        "'layer.w' pushed to consumer 0 (was its file "
                        "truncated after it was registered?)");
}
END_TEST

START_TEST(a_consumer_file_truncated_fails_naming_consumer_and_key) {
  char msg[SP_ERRMSG_MAX + 1];
  truncated(false, msg, sizeof msg);
  ck_assert_str_eq(msg, "consumer 0's storage 0 could not be written for key "
                        "'layer.w' (was its file truncated after it was "
                        "registered?)");
}
END_TEST

START_TEST(a_cancelled_run_copies_nothing) {
  struct tjob *job = tjob_new(2);
  struct tcons *cons = tcons_new(1);
  const int64_t shape[1] = {8}, rows[2] = {4, 4};

  tjob_shard0(job, "w", SP_DTYPE_UINT8, 1, shape, rows);
  tcons_whole(cons, 0, "w", SP_DTYPE_UINT8, 1, shape);
  on_one_node(job, 2, cons);
  struct consume_plan *plan = build(job, cons);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 1);
  struct sides s = sides_new(cons, data, 2);
  struct consume_run run = {.plan = plan,
                            .node = 7,
                            .src = (const struct xfer_storage *const *)s.src,
                            .dst = (uint8_t *const *const *)s.dst,
                            .threads = 1};
  atomic_store(&run.cancel, true);
  tcons_clear(cons);
  ck_assert_int_eq(consume_run_local(&run), SP_EABORTED);
  ck_assert_str_eq(run.msg, "the push was cancelled");
  ck_assert_uint_eq(run.bytes_moved, 0);
  for (size_t i = 0; i < 8; i++)
    ck_assert_uint_eq(tcons_bytes(cons, 0, 0)[i], TCONS_UNTOUCHED);
  sides_free(&s);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
}
END_TEST

int main(void) {
  Suite *s = suite_create("xfer-consume");
  TCase *tc = tcase_create("local");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, rows_into_uneven_columns);
  tcase_add_test(tc, columns_of_trainers_into_uneven_rows);
  tcase_add_test(tc, replicated_plain_scalar_and_expert_keys);
  tcase_add_test(tc, fused_qkv_through_pieces);
  tcase_add_test(tc, a_subset_of_keys);
  tcase_add_test(tc, rounds_of_the_byte_budget);
  tcase_add_test(tc, only_this_nodes_local_moves);
  tcase_add_test(tc,
                 a_trainer_file_truncated_fails_naming_rank_key_and_consumer);
  tcase_add_test(tc, a_consumer_file_truncated_fails_naming_consumer_and_key);
  tcase_add_test(tc, a_cancelled_run_copies_nothing);
  tcase_add_test(tc, buckets_between_nodes_complete_every_consumer);
  tcase_add_test(tc, a_truncated_file_fails_its_bucket);
  tcase_add_test(tc, a_bucket_is_row_major);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
