/*
 * plan_bench.c - how long planning takes and how much memory it needs.
 *
 * Each case builds the gathered metadata of a job of shard0 tensors (rows
 * dealt unevenly over the ranks, bfloat16 and float32 mixed, 8 ranks per
 * node, every rank's shards in one storage) and times plan_build() on it.
 * A case runs in a child process of its own, so that its peak resident
 * memory (the peak resident set while planning, minus what it held
 * before: VmHWM reset through /proc/self/clear_refs) is its own.  Printed,
 * never asserted: these machines are shared.
 *
 * The input is built as a daemon builds it: every rank's registrations in
 * full form (struct plan_key_in, as the registries hold them) read into the
 * compact input (layout.h) one rank after another, which is timed and
 * weighed apart: the bytes per shard entry are the allocator's bytes the
 * compact input takes (mallinfo2) over the entries, beside the full
 * form's.  The full forms are then freed, and planning reads the compact
 * input alone.
 *
 * The anchor (the issue's): PyTorch's checkpoint planner takes over 200 s
 * to validate 1,024 tensors over 1,024 ranks, its check being quadratic in
 * the ranks.  shardport indexes each rank's keys by hashing and compares
 * every rank with the key's first holder, so planning is
 * O(entries + keys log keys).  The limit measured in the same run is one
 * pass over the gathered metadata, key by key across the ranks as the
 * planner reads it: planning is reported as a multiple of that pass.
 */
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/plan/plan.h"

struct bench_case {
  uint32_t keys;
  uint32_t world;
  uint32_t threads;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A line of /proc/self/status ("VmRSS", "VmHWM"), in KiB. */
static long status_kib(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  size_t len = strlen(field);

  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, field, len) == 0 && line[len] == ':')
      kib = strtol(line + len + 1, NULL, 10);
  if (f != NULL)
    fclose(f);
  return kib;
}

/* The peak resident set starts again from here (proc(5), clear_refs 5):
 * the full forms built and freed before planning are not the planner's. */
static void reset_peak(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (f != NULL) {
    fputs("5", f);
    fclose(f);
  }
}

/* One read of every entry, key by key across the ranks. */
static double scan_s(const struct plan_input *in, uint32_t nkeys,
                     uint64_t *sink) {
  double t0 = now_s();
  for (uint32_t k = 0; k < nkeys; k++)
    for (size_t r = 0; r < in->nranks; r++)
      *sink += (uint64_t)in->ranks[r].entries[k].rows +
               (uint64_t)in->ranks[r].entries[k].offset;
  return now_s() - t0;
}

static size_t heap_bytes(void) {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n, size);
  if (p == NULL) {
    fprintf(stderr, "plan_bench: out of memory\n");
    exit(1);
  }
  return p;
}

static int run_case(const struct bench_case *c) {
  uint32_t world = c->world, nkeys = c->keys;
  char **names = xcalloc(nkeys, sizeof *names);
  int64_t *rows = xcalloc(nkeys, sizeof *rows);
  int64_t *cols = xcalloc(nkeys, sizeof *cols);
  struct plan_rank_desc *ranks = xcalloc(world, sizeof *ranks);
  struct sp_storage *storages = xcalloc(world, sizeof *storages);
  struct plan_input_store *store = plan_input_store_new(world);
  struct plan_input *in;
  uint64_t state = 42, entries = (uint64_t)nkeys * world, sink = 0;
  struct plan *plan;
  char msg[512];
  double t0, t1, scan, tc0, tc1;
  long rss0, rss1;
  size_t heap0, heap1;
  size_t moves = 0, buckets = 0;
  int rc;

  for (uint32_t k = 0; k < nkeys; k++) {
    char buf[64];
    snprintf(buf, sizeof buf, "model.layers.%u.mlp.w%u.weight", k / 8, k % 8);
    names[k] = strdup(buf);
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    /* Rows that rarely divide by the world: uneven shards, some empty. */
    rows[k] = (int64_t)(world / 2 + (state >> 33) % (2 * (uint64_t)world));
    cols[k] = 64 + (int64_t)((state >> 13) % 64);
  }
  for (uint32_t r = 0; r < world; r++) {
    struct plan_key_in *keys = xcalloc(nkeys, sizeof *keys);
    uint64_t offset = 0;
    for (uint32_t k = 0; k < nkeys; k++) {
      struct plan_key_in *e = &keys[k];
      /* torch.chunk's cut: ceil-sized chunks, trailing ranks empty. */
      int64_t chunk = (rows[k] + world - 1) / world;
      int64_t start = chunk * r < rows[k] ? chunk * r : rows[k];
      int64_t end = start + chunk < rows[k] ? start + chunk : rows[k];
      e->name = names[k];
      e->placement = PLAN_SHARD0;
      e->device_type = SP_DEVICE_CUDA;
      e->ndim = 2;
      e->shape[0] = rows[k];
      e->shape[1] = cols[k];
      e->view.dtype = k % 3 == 0 ? SP_DTYPE_FLOAT32 : SP_DTYPE_BFLOAT16;
      e->view.ndim = 2;
      e->view.shape[0] = end - start;
      e->view.shape[1] = cols[k];
      e->view.stride[0] = cols[k];
      e->view.stride[1] = 1;
      e->view.offset = (int64_t)offset;
      e->nbytes = (uint64_t)(end - start) * (uint64_t)cols[k] *
                  sp__dtype_size(e->view.dtype);
      /* Each shard at an offset counted in its own element size. */
      offset += (uint64_t)(end - start) * (uint64_t)cols[k] + 8;
      offset = (offset + 1) & ~(uint64_t)1;
    }
    storages[r].device.type = SP_DEVICE_CUDA;
    storages[r].device.index = (int32_t)(r % 8);
    storages[r].device.uuid[0] = (uint8_t)r;
    storages[r].device.uuid[1] = (uint8_t)(r >> 8);
    storages[r].base = 0x7f0000000000ull;
    storages[r].nbytes = offset * 4;
    /* Listed in the order a daemon would gather them: local ranks first. */
    ranks[(r + world / 2) % world] =
        (struct plan_rank_desc){.rank = r,
                                .node = r / 8,
                                .nstorages = 1,
                                .storages = &storages[r],
                                .nkeys = nkeys,
                                .keys = keys};
  }
  heap0 = heap_bytes();
  tc0 = now_s();
  for (uint32_t i = 0; i < world && store != NULL; i++)
    if (plan_input_add_rank(store, &ranks[i], msg, sizeof msg) != 0) {
      fprintf(stderr, "plan_bench: %s\n", msg);
      return 1;
    }
  tc1 = now_s();
  heap1 = heap_bytes();
  if (store == NULL) {
    fprintf(stderr, "plan_bench: out of memory\n");
    return 1;
  }
  /* The planner reads the compact input alone: the full forms go. */
  for (uint32_t r = 0; r < world; r++)
    free((void *)ranks[r].keys);
  in = plan_input_of(store);
  in->threads = c->threads;
  scan = scan_s(in, nkeys, &sink);
  reset_peak();
  rss0 = status_kib("VmRSS");
  t0 = now_s();
  rc = plan_build(in, &plan, msg, sizeof msg);
  t1 = now_s();
  rss1 = status_kib("VmHWM");
  if (rc != 0) {
    fprintf(stderr, "plan_bench: refused: %s\n", msg);
    return 1;
  }
  for (size_t i = 0; i < plan->nrounds; i++) {
    moves += plan->rounds[i].nmoves + plan->rounds[i].nlocal;
    buckets += plan->rounds[i].nbuckets;
  }
  printf("plan %6u keys x %5u ranks, %u thread%s: %9" PRIu64
         " shard entries, %7.3f s "
         "(%5.1f x one scan of %.4f s), %9.0f entries/s, peak +%7.1f MiB "
         "(%5.1f B/entry), %3zu rounds, %8zu moves, %7zu buckets, digest "
         "%016" PRIx64 "; input %5.1f B/entry (full form %zu), read in "
         "%.3f s (%" PRIu64 ")\n",
         nkeys, world, c->threads, c->threads == 1 ? "" : "s", entries, t1 - t0,
         (t1 - t0) / scan, scan, (double)entries / (t1 - t0),
         (double)(rss1 - rss0) / 1024.0,
         (double)(rss1 - rss0) * 1024.0 / (double)entries, plan->nrounds, moves,
         buckets, plan->digest, (double)(heap1 - heap0) / (double)entries,
         sizeof(struct plan_key_in), tc1 - tc0, sink % 10);
  fflush(stdout);
  plan_free(plan);
  plan_input_store_free(store);
  for (uint32_t k = 0; k < nkeys; k++)
    free(names[k]);
  free(names);
  free(rows);
  free(cols);
  free(ranks);
  free(storages);
  return 0;
}

int main(int argc, char **argv) {
  static const struct bench_case cases[] = {
      {100000, 64, 1}, {100000, 64, 2}, {1000, 1024, 1}, {1024, 1024, 1},
      {1024, 1024, 2}, {1000, 256, 1},  {1000, 512, 1},
  };
  size_t ncases = sizeof cases / sizeof cases[0];
  int failed = 0;

  /* "plan_bench 1000 1024 [THREADS]" runs one case in this process. */
  if (argc == 3 || argc == 4) {
    struct bench_case c = {(uint32_t)strtoul(argv[1], NULL, 10),
                           (uint32_t)strtoul(argv[2], NULL, 10),
                           argc == 4 ? (uint32_t)strtoul(argv[3], NULL, 10)
                                     : 1};
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
