/*
 * save_bench.c - save throughput (docs/checkpoints.md) against a plain
 * sequential write of the same bytes to the same file system.
 *
 * WORLD trainer ranks (forked, each its own connection) hold dim-0 shards
 * of a model of KEYS float32 keys in memfds, and save it into a directory
 * under $TMPDIR (or the directory given) with sp_save, served by one
 * daemon, then by two (--peer-listen 127.0.0.1:0, half the ranks on each).
 * The time is from the first rank's sp_save call to the last rank's
 * return: export, every file written, fsynced and renamed, the index.
 *
 * The limit measured in the same run, with the same byte count, into the
 * same directory: one thread writing the model's bytes (already in memory)
 * sequentially into one new file with write() in 16 MiB calls, then
 * fsync.  The ratio is the save's bytes per second over the limit's; the
 * goal (issue 16) is 0.8 or more.  Printed, never asserted: these machines
 * are shared.
 *
 *   save_bench [DIR [MIB [RUNS]]]   (default $TMPDIR, 512 MiB, 3 runs; the
 *                                    median by time shown)
 *
 * $SHARDPORTD names the daemon (meson sets it).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"

#define WORLD 4
#define KEYS 8
#define COLS 1024 /* float32: 4 KiB a row */
#define MAX_RUNS 9
#define MIB (1024.0 * 1024.0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The limit: the model's bytes written sequentially into one file, then
 * fsync; seconds. */
static double sequential_write(const char *dir, uint64_t bytes) {
  const size_t chunk = 16u << 20;
  char *buf = malloc(chunk);
  if (!buf)
    return -1;
  memset(buf, 0x5a, chunk);
  char path[512];
  snprintf(path, sizeof path, "%s/sequential.bin", dir);
  double t0 = now_s();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  uint64_t left = bytes;
  while (fd >= 0 && left > 0) {
    size_t n = left < chunk ? (size_t)left : chunk;
    ssize_t w = write(fd, buf, n);
    if (w <= 0)
      break;
    left -= (uint64_t)w;
  }
  if (fd < 0 || left > 0 || fsync(fd) != 0) {
    fprintf(stderr, "save_bench: writing %s: %s\n", path, strerror(errno));
    exit(1);
  }
  close(fd);
  double t = now_s() - t0;
  unlink(path);
  free(buf);
  return t;
}

/* One rank: its rows of every key in one memfd, registered, saved; writes
 * its sp_save call's start and end to out. */
static void rank_main(uint32_t rank, const char *sock, const sp_ticket *t,
                      uint64_t rows, const char *dir, int out) {
  uint64_t first = rows * rank / WORLD, mine = rows * (rank + 1) / WORLD - first;
  size_t row_bytes = COLS * 4, len = (size_t)(KEYS * mine * row_bytes);
  int fd = memfd_create("bench", MFD_CLOEXEC);
  char *mem = NULL;
  if (fd < 0 || ftruncate(fd, (off_t)(len ? len : 1)) != 0 ||
      (mem = mmap(NULL, len ? len : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                  0)) == MAP_FAILED)
    _exit(2);
  for (size_t i = 0; i < len; i++)
    mem[i] = (char)(i * 7 + rank);
  sp_client *c;
  if (sp_connect(sock, &c) != 0 || sp_job_join(c, t, rank, WORLD, "cpu") != 0)
    _exit(3);
  sp_storage_desc s = {.id = 1, .fd = fd, .length = len ? len : 1, .addr = mem};
  sp_tensor_desc td[KEYS];
  char names[KEYS][16];
  for (int k = 0; k < KEYS; k++) {
    snprintf(names[k], sizeof names[k], "layer.%d.weight", k);
    td[k] = (sp_tensor_desc){.key = names[k], .storage = 1,
                             .dtype = "float32", .ndim = 2,
                             .shape = {(int64_t)mine, COLS},
                             .stride = {COLS, 1},
                             .offset = (int64_t)(k * mine * COLS),
                             .placement = SP_PLACEMENT_SHARD0,
                             .global_ndim = 2,
                             .global_shape = {(int64_t)rows, COLS}};
  }
  if (sp_register_storages(c, &s, 1) != 0 ||
      sp_register_tensors(c, td, KEYS) != 0)
    _exit(4);
  sp_set_timeout(c, 0);
  sp_save_opts o = {.max_shard_bytes = 256u << 20, .overwrite = 1,
                    .export_opts = {.timeout_ms = 600000}};
  double times[2];
  times[0] = now_s();
  int rc = sp_save(c, dir, &o, NULL);
  times[1] = now_s();
  if (rc != 0) {
    fprintf(stderr, "rank %u: %s: %s\n", rank, sp_strerror(rc),
            sp_last_message(c));
    _exit(5);
  }
  if (write(out, times, sizeof times) != sizeof times)
    _exit(6);
  sp_job_leave(c);
  sp_close(c);
  _exit(0);
}

/* One save by WORLD ranks over ndaemons daemons; its seconds. */
static double one_save(uint32_t ndaemons, const char *dir, uint64_t rows) {
  static const char *const peers[] = {"--log-level", "warn", "--peer-listen",
                                      "127.0.0.1:0", NULL};
  static const char *const plain[] = {"--log-level", "warn", NULL};
  struct sp_test_daemon d[2];
  for (uint32_t i = 0; i < ndaemons; i++)
    if (sp_test_daemon_start(&d[i], ndaemons > 1 ? peers : plain) != 0) {
      fprintf(stderr, "save_bench: the daemon did not start\n");
      exit(1);
    }
  sp_client *c;
  sp_ticket t;
  if (sp_connect(d[0].socket, &c) != 0 || sp_job_create(c, WORLD, &t) != 0) {
    fprintf(stderr, "save_bench: no job\n");
    exit(1);
  }
  int p[2];
  if (pipe(p) != 0)
    exit(1);
  pid_t pid[WORLD];
  for (uint32_t r = 0; r < WORLD; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      close(p[0]);
      rank_main(r, d[r * ndaemons / WORLD].socket, &t, rows, dir, p[1]);
    }
  }
  close(p[1]);
  double start = 1e300, end = 0;
  bool ok = true;
  for (uint32_t r = 0; r < WORLD; r++) {
    double times[2];
    if (read(p[0], times, sizeof times) != sizeof times) {
      ok = false;
      break;
    }
    start = times[0] < start ? times[0] : start;
    end = times[1] > end ? times[1] : end;
  }
  close(p[0]);
  for (uint32_t r = 0; r < WORLD; r++) {
    int st;
    waitpid(pid[r], &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  sp_close(c);
  for (uint32_t i = 0; i < ndaemons; i++)
    sp_test_daemon_stop(&d[i]);
  if (!ok) {
    fprintf(stderr, "save_bench: a rank failed\n");
    exit(1);
  }
  return end - start;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

int main(int argc, char **argv) {
  char tmp[256];
  const char *base = argc > 1 && argv[1][0] ? argv[1] : NULL;
  if (!base) {
    if (sp_test_mkdtemp(tmp, sizeof tmp) != 0)
      return 1;
    base = tmp;
  }
  uint64_t mib = argc > 2 ? strtoull(argv[2], NULL, 10) : 512;
  int runs = argc > 3 ? atoi(argv[3]) : 3;
  if (runs < 1 || runs > MAX_RUNS || mib < 1)
    return 2;
  uint64_t rows = (mib << 20) / (KEYS * COLS * 4);
  uint64_t bytes = rows * KEYS * COLS * 4;
  char dir[512];
  snprintf(dir, sizeof dir, "%s/checkpoint", base);
  printf("save of %.0f MiB (%d keys) by %d ranks into %s\n", bytes / MIB,
         KEYS, WORLD, dir);
  printf("%-8s %10s %12s %14s %7s\n", "daemons", "save s", "save MiB/s",
         "sequential MiB/s", "ratio");
  for (uint32_t ndaemons = 1; ndaemons <= 2; ndaemons++) {
    double save[MAX_RUNS], seq[MAX_RUNS];
    for (int i = 0; i < runs; i++) {
      save[i] = one_save(ndaemons, dir, rows);
      seq[i] = sequential_write(base, bytes);
    }
    double s = median(save, runs), q = median(seq, runs);
    printf("%-8u %10.3f %12.0f %14.0f %7.2f\n", ndaemons, s, bytes / MIB / s,
           bytes / MIB / q, q / s);
    fflush(stdout);
  }
  sp_test_rmdir(dir);
  if (base == tmp)
    sp_test_rmdir(tmp);
  return 0;
}
