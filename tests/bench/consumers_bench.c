/*
 * consumers_bench.c - push throughput into consumers through the daemons:
 * the bytes delivered into the consumers' buffers over a push's time.
 *
 * shardport-demo --consumers 2 (client/demo/consumers.h: 4 trainer ranks
 * holding the model FSDP-style, two tensor-parallel consumers taking fused
 * QKV pieces, row and column shards, whole norms and half of the experts
 * each, every delivered byte checked) pushes 5 times, the weights changing
 * in between; the first push plans, the fifth reuses the plan and finds
 * every page warm, as a push every few training steps does.  Cases:
 *   - one daemon: the trainers and the consumers on it;
 *   - the same bytes the way they go without consumers (--via-export): the
 *     ranks export whole tensors and every owner copies the consumers'
 *     slices out of them;
 *   - two daemons on loopback: the trainers on the first, the consumers on
 *     the second (a node no trainer is on), so every delivered byte
 *     crosses between them.
 * The limits, measured in the same run over the same byte count:
 * single-thread memcpy (buffers already touched) for one node, and raw
 * loopback TCP for two: all of it one way on one stream, and the same
 * total half each way at once (full duplex, one thread per direction and
 * side, as two daemons move bytes).  Printed, never asserted: these
 * machines are shared.
 *
 *   consumers_bench [RUNS]    (default 3 runs of each case, the median by
 *                              the last push's time shown)
 *
 * $SHARDPORTD and $SHARDPORT_DEMO name the programs (meson sets them).
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/bench/bench_limits.h"
#include "tests/integration/harness.h"

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_RUNS 9
#define PUSHES "5"

struct figures {
  unsigned ranks, consumers, pushes, nodes;
  size_t keys;
  unsigned long long bytes, delivered;
  double first_s, last_s;
  int plan_reused, via_export, verified;
};

/* Runs the demo with extra arguments; 0 and its figures, or -1 with its
 * output on stderr. */
static int run_demo(const char *demo, const char *const *extra,
                    struct figures *f) {
  int out[2];
  if (pipe(out) != 0)
    return -1;
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    /* A case that cannot run fails within half a minute, not the
     * daemon's default timeout. */
    const char *argv[24] = {demo,     "--ranks",      "4",     "--consumers",
                            "2",      "--pushes",     PUSHES,  "--machine",
                            "--timeout-ms", "30000"};
    int n = 10;
    for (int i = 0; extra[i] != NULL && n < 23; i++)
      argv[n++] = extra[i];
    argv[n] = NULL;
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execv(demo, (char *const *)argv);
    _exit(127);
  }
  close(out[1]);
  char buf[2048];
  size_t have = 0;
  ssize_t n;
  while ((n = read(out[0], buf + have, sizeof buf - 1 - have)) > 0)
    have += (size_t)n;
  buf[have] = '\0';
  close(out[0]);
  int status;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
    ;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "consumers_bench: shardport-demo failed: %s\n", buf);
    return -1;
  }
  return sscanf(buf,
                "ranks=%u consumers=%u keys=%zu bytes=%llu "
                "delivered_bytes=%llu pushes=%u seconds=%lf "
                "seconds_last=%lf plan_reused=%d via_export=%d verified=%d "
                "nodes=%u",
                &f->ranks, &f->consumers, &f->keys, &f->bytes, &f->delivered,
                &f->pushes, &f->first_s, &f->last_s, &f->plan_reused,
                &f->via_export, &f->verified, &f->nodes) == 12
             ? 0
             : -1;
}

enum { ONE_NODE, VIA_EXPORT, TWO_NODES, NCASES };
static const char *const case_names[NCASES] = {
    "push, 1 daemon", "export whole, then copy the slices, 1 daemon",
    "push, 2 daemons (consumers on the second)"};

/* One run of a case on fresh daemons. */
static int one_run(const char *demo, int which, struct figures *f) {
  static const char *const plain[] = {"--log-level", "warn", NULL};
  static const char *const peers[] = {"--log-level", "warn", "--peer-listen",
                                      "127.0.0.1:0", NULL};
  int ndaemons = which == TWO_NODES ? 2 : 1;
  struct sp_test_daemon d[2];
  int started = 0, rc = -1;
  for (; started < ndaemons; started++)
    if (sp_test_daemon_start(&d[started], ndaemons > 1 ? peers : plain) != 0)
      goto out;
  const char *extra[8] = {"--socket", d[0].socket, NULL};
  if (which == VIA_EXPORT)
    extra[2] = "--via-export";
  if (which == TWO_NODES) {
    extra[2] = "--consumer-socket";
    extra[3] = d[1].socket;
  }
  rc = run_demo(demo, extra, f);
out:
  for (int i = 0; i < started; i++)
    sp_test_daemon_stop(&d[i]);
  return rc;
}

static int cmp_last(const void *a, const void *b) {
  double x = ((const struct figures *)a)->last_s,
         y = ((const struct figures *)b)->last_s;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const char *demo = getenv("SHARDPORT_DEMO");
  if (!demo || !getenv("SHARDPORTD")) {
    fprintf(stderr, "consumers_bench: set SHARDPORTD and SHARDPORT_DEMO\n");
    return 1;
  }
  int runs = argc > 1 ? atoi(argv[1]) : 3;
  if (runs < 1 || runs > MAX_RUNS)
    runs = 3;
  static struct figures figs[NCASES][MAX_RUNS];
  bool ran[NCASES];
  for (int c = 0; c < NCASES; c++) {
    ran[c] = true;
    for (int k = 0; k < runs && ran[c]; k++)
      ran[c] = one_run(demo, c, &figs[c][k]) == 0;
    if (ran[c])
      qsort(figs[c], (size_t)runs, sizeof figs[c][0], cmp_last);
  }
  printf("pushes into consumers: shardport-demo, 4 ranks into 2 "
         "consumers, %s pushes a run, %d runs of each case (the median by "
         "the last push)\n\n",
         PUSHES, runs);
  printf("| case | delivered a push | first push | its rate | last push | "
         "its rate | the limit, same bytes | ratio (last) | raw TCP, half "
         "each way at once | ratio (last) |\n");
  printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  double one_node_last = 0;
  for (int c = 0; c < NCASES; c++) {
    if (!ran[c]) {
      printf("| %s | failed (shardport-demo's error above) | | | | | | | "
             "| |\n",
             case_names[c]);
      continue;
    }
    const struct figures *f = &figs[c][runs / 2];
    double bytes = (double)f->delivered;
    double first_bps = bytes / f->first_s, last_bps = bytes / f->last_s;
    /* The limits, measured beside each row: the load moves between rows. */
    if (c == TWO_NODES) {
      double oneway = bench_tcp_seconds(f->delivered, 0);
      double duplex = bench_tcp_seconds(f->delivered / 2,
                                        f->delivered - f->delivered / 2);
      printf("| %s | %.1f MiB | %.3f s | %.2f GiB/s | %.3f s | %.2f GiB/s | "
             "raw TCP, one way: %.2f GiB/s | %.2f | %.2f GiB/s | %.2f |\n",
             case_names[c], bytes / MIB, f->first_s, first_bps / GIB,
             f->last_s, last_bps / GIB,
             oneway > 0 ? bytes / oneway / GIB : 0.0,
             oneway > 0 ? last_bps / (bytes / oneway) : 0.0,
             duplex > 0 ? bytes / duplex / GIB : 0.0,
             duplex > 0 ? last_bps / (bytes / duplex) : 0.0);
      continue;
    }
    double mbps = bench_memcpy_bps(f->delivered);
    printf("| %s | %.1f MiB | %.3f s | %.2f GiB/s | %.3f s | %.2f GiB/s | "
           "memcpy, 1 thread: %.2f GiB/s | %.2f | - | - |\n",
           case_names[c], bytes / MIB, f->first_s, first_bps / GIB,
           f->last_s, last_bps / GIB, mbps / GIB,
           mbps > 0 ? last_bps / mbps : 0.0);
    if (c == ONE_NODE)
      one_node_last = f->last_s;
  }
  if (ran[ONE_NODE] && ran[VIA_EXPORT])
    printf("\nthe last push against the export-then-copy path's last "
           "delivery, same bytes: %.2fx as fast\n",
           figs[VIA_EXPORT][runs / 2].last_s / one_node_last);
  printf("\n");
  return ran[ONE_NODE] && ran[VIA_EXPORT] ? 0 : 1;
}
