/*
 * affine_bench.c - how long the checks of one affine key take, and how much
 * memory, against a record of one byte per element of the key.
 *
 * Each case is one key of uint8 elements whose pieces the ranks hold in a
 * usual way (rows, columns, blocks, interleaved columns, one column beside
 * the others interleaved) or in the worst
 * one (runs of one element whose pattern never repeats), checked by
 * affine_validate in a child process of its own (peak memory: getrusage's
 * maxrss after the checks minus before).  The limit measured in the same
 * run is what the checks once needed at the least: writing one byte per
 * element of the full tensor, timed on 256 MiB and scaled to the key.
 * Printed, never asserted: these machines are shared.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/plan/affine.h"

#define MAX_PIECES 64

static const uint32_t holders[MAX_PIECES] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
    32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
    48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

/* A key of rows x cols elements (cols 0: a 1-D key of rows elements), one
 * piece per rank. */
struct key {
  const char *name;
  uint32_t ndim;
  int64_t shape[2];
  uint32_t nranks;
  struct affine_piece pieces[MAX_PIECES];
  struct affine_shard shards[MAX_PIECES];
};

static void add(struct key *k, uint32_t r, struct affine_piece p,
                uint64_t numel) {
  p.nholders = 1;
  p.holders = &holders[r];
  k->pieces[r] = p;
  k->shards[r] = (struct affine_shard){numel, 1, &k->pieces[r]};
  if (r + 1 > k->nranks)
    k->nranks = r + 1;
}

/* A (rows, cols) piece at (r0, c0) of a (R, C) key, columns step apart. */
static struct affine_piece box(int64_t rows, int64_t cols, int64_t r0,
                               int64_t c0, int64_t C, int64_t step) {
  struct affine_piece p = {.ndim = 2,
                           .shape = {rows, cols},
                           .src_stride = {cols, 1},
                           .dst_offset = r0 * C + c0,
                           .dst_stride = {C, step}};
  return p;
}

static void rows_key(struct key *k) {
  const int64_t n = (int64_t)1 << 40;
  *k = (struct key){
      .name = "2^40 elements, 64 row blocks", .ndim = 1, .shape = {n}};
  for (uint32_t r = 0; r < 64; r++) {
    struct affine_piece p = {.ndim = 1,
                             .shape = {n / 64},
                             .src_stride = {1},
                             .dst_offset = (int64_t)r * (n / 64),
                             .dst_stride = {1}};
    add(k, r, p, (uint64_t)(n / 64));
  }
}

static void columns_key(struct key *k) {
  const int64_t R = (int64_t)1 << 20, C = 4096;
  *k = (struct key){
      .name = "(2^20, 4096), 8 column blocks", .ndim = 2, .shape = {R, C}};
  for (uint32_t r = 0; r < 8; r++)
    add(k, r, box(R, C / 8, 0, r * (C / 8), C, 1), (uint64_t)(R * C / 8));
}

static void blocks_key(struct key *k) {
  const int64_t R = (int64_t)1 << 16, C = (int64_t)1 << 16;
  *k = (struct key){
      .name = "(2^16, 2^16), 8 x 8 blocks", .ndim = 2, .shape = {R, C}};
  for (uint32_t r = 0; r < 64; r++)
    add(k, r, box(R / 8, C / 8, (r / 8) * (R / 8), (r % 8) * (C / 8), C, 1),
        (uint64_t)(R * C / 64));
}

static void interleaved_key(struct key *k) {
  const int64_t R = (int64_t)1 << 16, C = 4096;
  *k = (struct key){
      .name = "(2^16, 4096), columns dealt over 8", .ndim = 2, .shape = {R, C}};
  for (uint32_t r = 0; r < 8; r++)
    add(k, r, box(R, C / 8, 0, r, C, 8), (uint64_t)(R * C / 8));
}

/* Column 0 of 4 rows of 2^bits beside the other columns dealt over two
 * pieces: runs a row apart beside runs two apart, which the sweep once
 * judged one by one. */
static void column_beside_dealt(struct key *k, int bits, const char *name) {
  const int64_t C = (int64_t)1 << bits;
  *k = (struct key){.name = name, .ndim = 2, .shape = {4, C}};
  add(k, 0, box(4, 1, 0, 0, C, 1), 4);
  add(k, 1, box(4, C / 2, 0, 1, C, 2), (uint64_t)(4 * (C / 2)));
  add(k, 2, box(4, C / 2 - 1, 0, 2, C, 2), (uint64_t)(4 * (C / 2 - 1)));
}

static void column_beside_dealt_23(struct key *k) {
  column_beside_dealt(k, 23, "(4, 2^23), column 0 beside the rest dealt over 2");
}

static void column_beside_dealt_27(struct key *k) {
  column_beside_dealt(k, 27, "(4, 2^27), column 0 beside the rest dealt over 2");
}

static void column_beside_dealt_31(struct key *k) {
  column_beside_dealt(k, 31, "(4, 2^31), column 0 beside the rest dealt over 2");
}

/* Element e in the piece of the lowest zero bit of e: no pattern repeats,
 * every element is a run the sweep visits. */
static void dyadic_key(struct key *k) {
  const int64_t n = (int64_t)1 << 26;
  *k = (struct key){.name = "2^26 elements, periods 2 to 2^26 (worst)",
                    .ndim = 1,
                    .shape = {n}};
  for (uint32_t z = 0; z < 26; z++) {
    struct affine_piece p = {.ndim = 1,
                             .shape = {n >> (z + 1)},
                             .src_stride = {1},
                             .dst_offset = ((int64_t)1 << z) - 1,
                             .dst_stride = {(int64_t)2 << z}};
    add(k, z, p, (uint64_t)(n >> (z + 1)));
  }
  struct affine_piece last = {.ndim = 1,
                              .shape = {1},
                              .src_stride = {1},
                              .dst_offset = n - 1,
                              .dst_stride = {1}};
  add(k, 26, last, 1);
}

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

/* Bytes per second of writing one byte per element into fresh memory, as
 * a record of the elements would be written. */
static double record_rate(void) {
  const size_t n = (size_t)256 << 20;
  uint8_t *b = malloc(n);
  double t0 = now_s(), t;
  if (b == NULL)
    return 0;
  memset(b, 1, n);
  t = now_s() - t0;
  __asm__ volatile("" : : "r"(b) : "memory");
  free(b);
  return (double)n / t;
}

static void run_case(void (*make)(struct key *), double rate) {
  static struct key k;
  struct affine_map map;
  uint64_t numel = 1;
  char msg[256];
  long before;
  double t0, t;
  int rc;

  make(&k);
  for (uint32_t d = 0; d < k.ndim; d++)
    numel *= (uint64_t)k.shape[d];
  map = (struct affine_map){k.name, k.ndim, k.shape, k.nranks, k.shards, NULL};
  before = maxrss_kib();
  t0 = now_s();
  rc = affine_validate(&map, msg, sizeof msg);
  t = now_s() - t0;
  printf("| %s | %u | %.3g | %.3g s | %.3g s | %.2g | +%ld KiB | %.3g GiB |\n",
         k.name, k.nranks, (double)numel, t, (double)numel / rate,
         t / ((double)numel / rate), maxrss_kib() - before,
         (double)numel / (1 << 30));
  if (rc != 0)
    printf("  refused: %s\n", msg);
}

int main(void) {
  void (*cases[])(struct key *) = {
      rows_key,        columns_key,            blocks_key,
      interleaved_key, column_beside_dealt_23, column_beside_dealt_27,
      column_beside_dealt_31, dyadic_key};
  double rate = record_rate();

  printf("one byte per element written at %.2f GiB/s\n\n", rate / (1 << 30));
  printf("| key | pieces | elements | checks | a record's writes | ratio | "
         "peak memory | a record's memory |\n");
  printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  fflush(stdout);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pid_t pid = fork();
    int status;
    if (pid == 0) {
      run_case(cases[i], rate);
      fflush(stdout);
      _exit(0);
    }
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
      fprintf(stderr, "affine_bench: case %zu failed\n", i);
      return 1;
    }
  }
  return 0;
}
