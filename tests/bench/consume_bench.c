/*
 * consume_bench.c - how long planning a push into consumers takes and how
 * much memory it needs (consume.h).
 *
 * Each case builds trainers as tests/unit/plan's tjob does: shard0 keys of
 * 64 to 127 columns and rows that rarely divide by the world (cut like
 * torch.chunk: uneven shards, trailing ranks empty), bfloat16 and float32
 * mixed, 8 ranks per node; and consumers as tcons does, 8 per node on nodes
 * no trainer is on, each holding uneven columns of every key (consumer i
 * ends at column cols * (i + 1)^2 / n^2) as one piece in one buffer, both
 * dtypes back to back, so the alias sweep sees every destination of a
 * consumer together.  Rows into columns make every trainer's shard meet
 * every consumer's: a push has world x consumers moves per key.
 *
 * The limit measured in the same run is the export's planning of the same
 * trainers (plan_build): the push is reported as a multiple of it.  A case
 * runs in a child process of its own; peak memory is the child's maxrss
 * after the push's planning minus before the export's (the larger of the
 * two).  Printed, never asserted: these machines are shared.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/plan/consume.h"
#include "daemon/plan/plan.h"
#include "tests/unit/plan/tcons.h"
#include "tests/unit/plan/tjob.h"

struct bench_case {
  uint32_t keys;
  uint32_t world;
  uint32_t consumers;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long maxrss_kib(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

/* Consumer i's columns of every key, packed into one storage. */
static void add_consumer(struct tcons *cons, uint32_t i, uint32_t n,
                         uint32_t nkeys, char *const *names,
                         const int64_t *rows, const int64_t *cols) {
  uint64_t bytes = 0;
  uint32_t storage;

  for (int pass = 0; pass < 2; pass++) {
    uint64_t offset = 0;
    if (pass == 1)
      storage = tcons_storage(cons, i, bytes);
    for (uint32_t k = 0; k < nkeys; k++) {
      enum sp_dtype dtype = k % 3 == 0 ? SP_DTYPE_FLOAT32 : SP_DTYPE_BFLOAT16;
      uint32_t size = sp__dtype_size(dtype);
      int64_t lo = cols[k] * i * i / ((int64_t)n * n);
      int64_t hi = cols[k] * (i + 1) * (i + 1) / ((int64_t)n * n);
      const int64_t shape[2] = {rows[k], cols[k]};
      offset = (offset + size - 1) / size * size;
      if (pass == 1) {
        struct consume_piece p = {.start = {0, lo},
                                  .storage = storage,
                                  .dst = {.dtype = dtype,
                                          .ndim = 2,
                                          .shape = {rows[k], hi - lo},
                                          .stride = {hi - lo, 1},
                                          .offset = (int64_t)(offset / size)}};
        tcons_pieces(cons, i, names[k], dtype, 2, shape, 1, &p);
      }
      offset += (uint64_t)(rows[k] * (hi - lo)) * size;
    }
    bytes = offset;
  }
}

static int run_case(const struct bench_case *c) {
  struct tjob *job = tjob_new(c->world);
  struct tcons *cons = tcons_new(c->consumers);
  char **names = calloc(c->keys, sizeof *names);
  int64_t *rows = calloc(c->keys, sizeof *rows);
  int64_t *cols = calloc(c->keys, sizeof *cols);
  int64_t *chunks = calloc(c->world, sizeof *chunks);
  uint64_t state = 42;
  struct plan *plan;
  struct consume_plan *push;
  size_t moves = 0;
  char msg[512];
  double t0, t1, t2;
  long rss0;
  int rc;

  if (names == NULL || rows == NULL || cols == NULL || chunks == NULL) {
    fprintf(stderr, "consume_bench: out of memory\n");
    return 1;
  }
  for (uint32_t r = 0; r < c->world; r++)
    tjob_node(job, r, r / 8);
  for (uint32_t i = 0; i < c->consumers; i++)
    tcons_node(cons, i, 1000 + i / 8);
  for (uint32_t k = 0; k < c->keys; k++) {
    int64_t shape[2], chunk;
    names[k] =
        (char *)tjob_name(job, "model.layers.%u.mlp.w%u.weight", k / 8, k % 8);
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    rows[k] =
        (int64_t)(c->world / 2 + (state >> 33) % (2 * (uint64_t)c->world));
    cols[k] = 64 + (int64_t)((state >> 13) % 64);
    chunk = (rows[k] + c->world - 1) / c->world;
    for (uint32_t r = 0; r < c->world; r++) {
      int64_t start = chunk * r < rows[k] ? chunk * r : rows[k];
      int64_t end = start + chunk < rows[k] ? start + chunk : rows[k];
      chunks[r] = end - start;
    }
    shape[0] = rows[k];
    shape[1] = cols[k];
    tjob_shard0(job, names[k],
                k % 3 == 0 ? SP_DTYPE_FLOAT32 : SP_DTYPE_BFLOAT16, 2, shape,
                chunks);
  }
  for (uint32_t i = 0; i < c->consumers; i++)
    add_consumer(cons, i, c->consumers, c->keys, names, rows, cols);
  rss0 = maxrss_kib();
  t0 = now_s();
  rc = plan_build(tjob_input(job, 0, 0), &plan, msg, sizeof msg);
  t1 = now_s();
  if (rc != 0) {
    fprintf(stderr, "consume_bench: export refused: %s\n", msg);
    return 1;
  }
  plan_free(plan);
  rc = consume_plan_build(tcons_input(cons, tjob_input(job, 0, 0), 0), &push,
                          msg, sizeof msg);
  t2 = now_s();
  if (rc != 0) {
    fprintf(stderr, "consume_bench: push refused: %s\n", msg);
    return 1;
  }
  for (size_t i = 0; i < push->nrounds; i++)
    moves += push->rounds[i].nmoves + push->rounds[i].nlocal;
  printf("push %6u keys x %5u ranks into %2u consumers: %7.3f s (%5.1f x "
         "the export's %.3f s), peak +%7.1f MiB, %3zu rounds, %8zu moves, "
         "digest %016" PRIx64 "\n",
         c->keys, c->world, c->consumers, t2 - t1, (t2 - t1) / (t1 - t0),
         t1 - t0, (double)(maxrss_kib() - rss0) / 1024.0, push->nrounds, moves,
         push->digest);
  fflush(stdout);
  consume_plan_free(push);
  tcons_free(cons);
  tjob_free(job);
  free(names);
  free(rows);
  free(cols);
  free(chunks);
  return 0;
}

int main(int argc, char **argv) {
  static const struct bench_case cases[] = {
      {1000, 64, 8}, {1000, 256, 4}, {1000, 64, 32}};
  size_t ncases = sizeof cases / sizeof cases[0];
  int failed = 0;

  /* "consume_bench 1000 64 8" runs one case in this process. */
  if (argc == 4) {
    struct bench_case c = {(uint32_t)strtoul(argv[1], NULL, 10),
                           (uint32_t)strtoul(argv[2], NULL, 10),
                           (uint32_t)strtoul(argv[3], NULL, 10)};
    return run_case(&c);
  }
  for (size_t i = 0; i < ncases; i++) {
    int status;
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 1;
    }
    if (pid == 0)
      _exit(run_case(&cases[i]));
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0)
      failed = 1;
  }
  return failed;
}
