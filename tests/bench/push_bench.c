/*
 * push_bench.c - how fast the movers carry a push's local moves
 * (daemon/xfer/consume_run.h) on one node.
 *
 * Four trainer ranks hold a transformer block FSDP-style (shard0, rows
 * uneven): q, k and v of a grouped-query attention and two MLP weights,
 * float32, 88 MiB in all.  Two tensor-parallel consumers on the same
 * node take their heads of q, k and v as pieces of one fused buffer each
 * and column shards of the MLP weights, so most moves are strided (each
 * trainer row splits into one run per consumer).  The limit measured in the
 * same run: one thread's memcpy of the same number of bytes, move by move,
 * out of the same trainer buffers into the same consumer buffers.
 * consume_run_local() runs on 1 and on 4 threads; every figure is the second of
 * two passes, when every page is warm, as the buffers of a push that repeats
 * every step are.  The first pass is checked byte for byte against the consumer
 * oracle (tests/unit/plan/tcons.c).  Printed, never asserted: these machines
 * are shared.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/plan/consume.h"
#include "daemon/xfer/consume_run.h"
#include "shardport.h"
#include "tests/unit/plan/tcons.h"
#include "tests/unit/plan/tjob.h"

#define WORLD 4
#define HIDDEN 2048
#define KV 512
#define MLP 4096

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *(*volatile copy)(void *, const void *, size_t) = memcpy;

static void die(const char *what, const char *msg) {
  fprintf(stderr, "push_bench: %s: %s\n", what, msg);
  exit(1);
}

/* Rows cut like torch.chunk over WORLD ranks. */
static void chunk_rows(int64_t n, int64_t *rows) {
  int64_t each = (n + WORLD - 1) / WORLD, left = n;
  for (int r = 0; r < WORLD; r++) {
    rows[r] = left < each ? left : each;
    left -= rows[r];
  }
}

static void build_model(struct tjob *job, struct tcons *cons) {
  const int64_t q[2] = {HIDDEN, HIDDEN}, kv[2] = {KV, HIDDEN};
  const int64_t up[2] = {MLP, HIDDEN}, down[2] = {HIDDEN, MLP};
  int64_t rows[WORLD];

  chunk_rows(HIDDEN, rows);
  tjob_shard0(job, "attn.q", SP_DTYPE_FLOAT32, 2, q, rows);
  chunk_rows(KV, rows);
  tjob_shard0(job, "attn.k", SP_DTYPE_FLOAT32, 2, kv, rows);
  tjob_shard0(job, "attn.v", SP_DTYPE_FLOAT32, 2, kv, rows);
  chunk_rows(MLP, rows);
  tjob_shard0(job, "mlp.up", SP_DTYPE_FLOAT32, 2, up, rows);
  chunk_rows(HIDDEN, rows);
  tjob_shard0(job, "mlp.down", SP_DTYPE_FLOAT32, 2, down, rows);
  for (uint32_t r = 0; r < WORLD; r++)
    tjob_node(job, r, 0);
  for (uint32_t c = 0; c < 2; c++) {
    /* [q heads | k heads | v heads] of this consumer, one buffer. */
    const char *names[3] = {"attn.q", "attn.k", "attn.v"};
    const int64_t part[3] = {HIDDEN / 2, KV / 2, KV / 2};
    int64_t at = 0;
    uint32_t fused = tcons_storage(
        cons, c, (uint64_t)(HIDDEN / 2 + KV) * HIDDEN * sizeof(float));
    tcons_node(cons, c, 0);
    for (int i = 0; i < 3; i++) {
      struct consume_piece piece = {.start = {part[i] * c, 0},
                                    .storage = fused,
                                    .dst = {.dtype = SP_DTYPE_FLOAT32,
                                            .ndim = 2,
                                            .shape = {part[i], HIDDEN},
                                            .stride = {HIDDEN, 1},
                                            .offset = at}};
      tcons_pieces(cons, c, names[i], SP_DTYPE_FLOAT32, 2, i == 0 ? q : kv, 1,
                   &piece);
      at += part[i] * HIDDEN;
    }
    tcons_shard(cons, c, "mlp.up", SP_DTYPE_FLOAT32, 2, up, 1, HIDDEN / 2);
    tcons_shard(cons, c, "mlp.down", SP_DTYPE_FLOAT32, 2, down, 1, MLP / 2);
  }
}

/* One run of the plan's local moves; returns its seconds. */
static double push(const struct consume_plan *plan,
                   const struct xfer_storage *const *src,
                   uint8_t *const *const *dst, uint32_t threads) {
  struct consume_run run = {
      .plan = plan, .node = 0, .src = src, .dst = dst, .threads = threads};
  double t0 = now_s();
  if (consume_run_local(&run) != 0)
    die("push", run.msg);
  return now_s() - t0;
}

int main(void) {
  struct tjob *job = tjob_new(WORLD);
  struct tcons *cons = tcons_new(2);
  struct consume_plan *plan;
  char msg[512];

  build_model(job, cons);
  if (consume_plan_build(tcons_input(cons, tjob_input(job, 0, 0), 0), &plan,
                         msg, sizeof msg) != 0)
    die("planning", msg);
  struct tdata *data = tdata_new(tjob_input(job, 0, 0), 1);
  struct xfer_storage *storages[WORLD];
  const struct xfer_storage *src[WORLD];
  uint8_t **buffers[2];
  uint8_t *const *dst[2];
  for (uint32_t r = 0; r < WORLD; r++) {
    size_t n = tdata_storage_count(data, r);
    storages[r] = calloc(n, sizeof *storages[r]);
    if (storages[r] == NULL)
      die("setup", "out of memory");
    for (size_t i = 0; i < n; i++)
      storages[r][i] = (struct xfer_storage){
          .sid = (uint32_t)i + 1, .data = tdata_bytes(data, r, (uint32_t)i)};
    src[r] = storages[r];
  }
  for (uint32_t c = 0; c < 2; c++) {
    size_t n = tcons_storage_count(cons, c);
    buffers[c] = calloc(n, sizeof *buffers[c]);
    if (buffers[c] == NULL)
      die("setup", "out of memory");
    for (size_t i = 0; i < n; i++)
      buffers[c][i] = tcons_bytes(cons, c, (uint32_t)i);
    dst[c] = buffers[c];
  }

  tcons_clear(cons);
  push(plan, src, dst, 1);
  if (tcons_compare(cons, data, msg, sizeof msg) != 0)
    die("delivered bytes", msg);

  /* The limit: the same bytes, move by move, in one memcpy each from the
   * start of the sender's storage to the start of the consumer's (every
   * storage holds at least its moves' bytes), through a pointer the
   * compiler cannot see through, so no copy is left out. */
  uint64_t bytes = plan->received[0] + plan->received[1];
  size_t moves = 0;
  double copy_s = 0;
  for (int pass = 0; pass < 2; pass++) {
    double t0 = now_s();
    moves = 0;
    for (size_t r = 0; r < plan->nrounds; r++)
      for (size_t i = 0; i < plan->rounds[r].nlocal; i++) {
        const struct consume_move *m = &plan->rounds[r].local[i];
        copy(dst[m->dst][m->dst_storage], src[m->src][m->src_storage].data,
             m->nbytes);
        moves++;
      }
    copy_s = now_s() - t0;
  }
  double mib = (double)bytes / (1u << 20);
  printf("memcpy of %.0f MiB, 1 thread: %.3f s, %.2f GiB/s (the limit)\n", mib,
         copy_s, mib / 1024 / copy_s);
  for (uint32_t threads = 1; threads <= 4; threads *= 4) {
    double s = 0;
    for (int pass = 0; pass < 2; pass++)
      s = push(plan, src, dst, threads);
    printf("push of %.0f MiB into 2 consumers, %zu local moves, %u "
           "thread(s): %.3f s, %.2f GiB/s, %.2fx the memcpy limit\n",
           mib, moves, threads, s, mib / 1024 / s, copy_s / s);
  }
  for (uint32_t r = 0; r < WORLD; r++)
    free(storages[r]);
  for (uint32_t c = 0; c < 2; c++)
    free(buffers[c]);
  tdata_free(data);
  consume_plan_free(plan);
  tcons_free(cons);
  tjob_free(job);
  return 0;
}
