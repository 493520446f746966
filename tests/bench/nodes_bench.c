/*
 * nodes_bench.c - export throughput across two daemons on one machine.
 *
 * Two fresh shardportd daemons, each listening for the other on a loopback
 * port (--peer-listen 127.0.0.1:0), serve shardport-demo with 4 ranks, two
 * on each (the same model and checks as export_bench, every owned tensor
 * verified), and, for comparison in the same run, one daemon serves the
 * same 4 ranks.  While the two-daemon demo runs, the first daemon's
 * status is sampled (every 2 ms) for the bytes its job sent to and
 * received from the other node; the exchange itself lasts from the first
 * sample that saw a byte move to the first that saw them all, which is
 * the exchange's own rate, beside the whole export's.  The same samples
 * time the export's phases on that daemon (the first sample that saw each
 * of planning, allocating, moving and publishing), so that the export's
 * time reads as where it went.  The two-daemon export runs with each pair
 * of nodes over 1, 2 and 4 connections (peer_streams).
 *
 * The limits measured in the same run, with the same byte counts:
 *   - raw loopback TCP: a plain socket pair on 127.0.0.1 moving the
 *     export's cross-node bytes, each direction's count in its own
 *     direction at once (full duplex, one thread per direction and side,
 *     as the daemons move them), and all of it one way on one stream;
 *   - single-thread memcpy of the model's bytes (buffers already touched).
 * The ratios: the export's cross-node bytes over its time against raw TCP
 * (how much of the link the export uses), and the model's bytes over its
 * time against memcpy.  Printed, never asserted: these machines are
 * shared.
 *
 *   nodes_bench [RUNS]    (default 3 runs of each, the median by time
 *                          shown)
 *
 * $SHARDPORTD and $SHARDPORT_DEMO name the programs (meson sets them).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/bench/bench_limits.h"
#include "tests/integration/harness.h"

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_RUNS 9

/* ---- the demo ---- */

struct figures {
  unsigned ranks, nodes;
  size_t keys;
  unsigned long long bytes, pool_bytes, identity_bytes, max_rank_bytes;
  double seconds;
  int verified;
};

static int run_demo(const char *demo, const char *const *sockets,
                    int nsockets, struct figures *f) {
  int out[2];
  if (pipe(out) != 0)
    return -1;
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    const char *argv[16] = {demo, "--ranks", "4", "--machine"};
    int n = 4;
    for (int i = 0; i < nsockets; i++) {
      argv[n++] = "--socket";
      argv[n++] = sockets[i];
    }
    argv[n] = NULL;
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execv(demo, (char *const *)argv);
    _exit(127);
  }
  close(out[1]);
  char buf[1024];
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
    fprintf(stderr, "nodes_bench: shardport-demo failed: %s\n", buf);
    return -1;
  }
  return sscanf(buf,
                "ranks=%u keys=%zu bytes=%llu pool_bytes=%llu "
                "identity_bytes=%llu max_rank_bytes=%llu seconds=%lf "
                "verified=%d nodes=%u",
                &f->ranks, &f->keys, &f->bytes, &f->pool_bytes,
                &f->identity_bytes, &f->max_rank_bytes, &f->seconds,
                &f->verified, &f->nodes) == 9
             ? 0
             : -1;
}

/* The most bytes the first daemon's job sent to and received from the
 * other node, sampled while the demo runs. */
enum { PH_PLANNING, PH_ALLOCATING, PH_MOVING, PH_PUBLISHING, PH_DONE,
       NPHASES };
static const char *const phase_names[NPHASES] = {
    "planning", "allocating", "moving", "publishing", "published"};

struct sampler {
  const char *socket;
  atomic_bool stop;
  uint64_t sent, received;
  /* When the first byte was seen, and when the most bytes were first. */
  double first_s, full_s;
  /* When each phase was first seen (0: never), and the last sample that
   * saw the job. */
  double phase_s[NPHASES];
  double last_s;
};

static void note_phase(struct sampler *s, const char *phase, double t) {
  for (int p = 0; p < NPHASES; p++)
    if (phase != NULL && strcmp(phase, phase_names[p]) == 0 &&
        s->phase_s[p] == 0)
      s->phase_s[p] = t;
}

static void *sample(void *arg) {
  struct sampler *s = arg;
  sp_client *c = NULL;
  sp_connect(s->socket, &c);
  while (!atomic_load(&s->stop)) {
    sp_status_info *st = NULL;
    double t = bench_now_s();
    if (c && sp_status(c, &st) == 0) {
      uint64_t before = s->sent + s->received;
      for (size_t j = 0; j < st->njobs; j++) {
        note_phase(s, st->jobs[j].phase, t);
        s->last_s = t;
        for (size_t n = 0; n < st->jobs[j].nnodes; n++) {
          const sp_node_status *nd = &st->jobs[j].nodes[n];
          if (nd->bytes_sent > s->sent)
            s->sent = nd->bytes_sent;
          if (nd->bytes_received > s->received)
            s->received = nd->bytes_received;
        }
      }
      sp_status_free(st);
      uint64_t after = s->sent + s->received;
      if (before == 0 && after > 0)
        s->first_s = t;
      if (after > before)
        s->full_s = t;
    }
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  sp_close(c);
  return NULL;
}

struct run {
  struct figures f;
  uint64_t sent, received;
  double exchange_s;
  /* Seconds in planning, allocating, moving, publishing (0: unseen). */
  double phase_len[PH_DONE];
};

/* A configuration file setting peer_streams, in dir. */
static int streams_conf(const char *dir, int streams, char *path,
                        size_t len) {
  snprintf(path, len, "%s/streams-%d.conf", dir, streams);
  FILE *f = fopen(path, "we");
  if (f == NULL)
    return -1;
  fprintf(f, "peer_streams = %d\n", streams);
  return fclose(f);
}

static int one_run(const char *demo, int ndaemons, const char *conf,
                   struct run *r) {
  static const char *const plain[] = {"--log-level", "warn", NULL};
  const char *const peers[] = {"--log-level", "warn",   "--peer-listen",
                               "127.0.0.1:0", "--config", conf, NULL};
  struct sp_test_daemon d[2];
  const char *sockets[2];
  int started = 0, rc = -1;
  for (; started < ndaemons; started++) {
    if (sp_test_daemon_start(&d[started], ndaemons > 1 ? peers : plain) != 0)
      goto out;
    sockets[started] = d[started].socket;
  }
  struct sampler s = {.socket = d[0].socket};
  pthread_t th;
  if (pthread_create(&th, NULL, sample, &s) != 0)
    goto out;
  rc = run_demo(demo, sockets, ndaemons, &r->f);
  atomic_store(&s.stop, true);
  pthread_join(th, NULL);
  r->sent = s.sent;
  r->received = s.received;
  r->exchange_s = s.full_s - s.first_s;
  /* A phase lasts until the first sample that saw a later one (a short
   * one may fall between two samples), the last until the job was gone. */
  for (int p = 0; p < PH_DONE; p++) {
    double end = s.last_s;
    for (int q = NPHASES - 1; q > p; q--)
      if (s.phase_s[q] > 0)
        end = s.phase_s[q];
    r->phase_len[p] = s.phase_s[p] > 0 ? end - s.phase_s[p] : 0;
  }
out:
  for (int i = 0; i < started; i++)
    sp_test_daemon_stop(&d[i]);
  return rc;
}

static int cmp_time(const void *a, const void *b) {
  double x = ((const struct run *)a)->f.seconds,
         y = ((const struct run *)b)->f.seconds;
  return (x > y) - (x < y);
}

static void print_phases(const struct run *r) {
  for (int p = 0; p < PH_DONE; p++)
    if (r->phase_len[p] > 0)
      printf(" %s %.0f ms,", phase_names[p], r->phase_len[p] * 1e3);
    else
      printf(" %s -,", phase_names[p]);
}

int main(int argc, char **argv) {
  const char *demo = getenv("SHARDPORT_DEMO");
  if (!demo || !getenv("SHARDPORTD")) {
    fprintf(stderr, "nodes_bench: set SHARDPORTD and SHARDPORT_DEMO\n");
    return 1;
  }
  int runs = argc > 1 ? atoi(argv[1]) : 3;
  if (runs < 1 || runs > MAX_RUNS)
    runs = 3;
  static const int stream_counts[] = {1, 2, 4};
  enum { NCOUNTS = sizeof stream_counts / sizeof stream_counts[0] };
  char dir[256], confs[NCOUNTS][300];
  if (sp_test_mkdtemp(dir, sizeof dir) != 0)
    return 1;
  for (int c = 0; c < NCOUNTS; c++)
    if (streams_conf(dir, stream_counts[c], confs[c], sizeof confs[c]) != 0)
      return 1;
  struct run one[MAX_RUNS], two[NCOUNTS][MAX_RUNS];
  for (int k = 0; k < runs; k++) {
    if (one_run(demo, 1, NULL, &one[k]) != 0) {
      fprintf(stderr, "nodes_bench: a run failed\n");
      return 1;
    }
    for (int c = 0; c < NCOUNTS; c++)
      if (one_run(demo, 2, confs[c], &two[c][k]) != 0) {
        fprintf(stderr, "nodes_bench: a run failed\n");
        return 1;
      }
  }
  sp_test_rmdir(dir);
  qsort(one, (size_t)runs, sizeof one[0], cmp_time);
  const struct run *o = &one[runs / 2];
  double mbps = bench_memcpy_bps(o->f.bytes);
  printf("export across two daemons on loopback: shardport-demo, 4 ranks "
         "(two per daemon), %d runs of each (median by time)\n\n", runs);
  printf("| daemons | streams | model | export | model / time | memcpy, 1 "
         "thread | ratio | between nodes (A to B + B to A) | between nodes "
         "/ time | raw TCP, same bytes both ways at once | ratio | raw TCP, "
         "one stream | ratio | the exchange itself | its rate | ratio to raw "
         "TCP, both ways |\n");
  printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
         "---:|---:|---:|\n");
  printf("| 1 | - | %.1f MiB | %.3f s | %.2f GiB/s | %.2f GiB/s | %.2f | - | "
         "- | - | - | - | - | - | - | - |\n",
         (double)o->f.bytes / MIB, o->f.seconds,
         (double)o->f.bytes / o->f.seconds / GIB, mbps / GIB,
         mbps > 0 ? (double)o->f.bytes / o->f.seconds / mbps : 0.0);
  for (int c = 0; c < NCOUNTS; c++) {
    qsort(two[c], (size_t)runs, sizeof two[c][0], cmp_time);
    const struct run *t = &two[c][runs / 2];
    uint64_t cross = t->sent + t->received;
    /* The limits, measured again beside each row: the machine's load
     * moves between rows. */
    double duplex = bench_tcp_seconds(t->sent, t->received);
    double oneway = bench_tcp_seconds(cross, 0);
    double export_bps = (double)t->f.bytes / t->f.seconds;
    double cross_bps = (double)cross / t->f.seconds;
    double raw_bps = duplex > 0 ? (double)cross / duplex : 0.0;
    double exchange_bps =
        t->exchange_s > 0 ? (double)cross / t->exchange_s : 0;
    printf("| 2 | %d | %.1f MiB | %.3f s | %.2f GiB/s | %.2f GiB/s | %.2f | "
           "%.1f MiB (%.1f + %.1f) | %.2f GiB/s | %.2f GiB/s | %.2f | "
           "%.2f GiB/s | %.2f | %.3f s | %.2f GiB/s | %.2f |\n",
           stream_counts[c], (double)t->f.bytes / MIB, t->f.seconds,
           export_bps / GIB, mbps / GIB, mbps > 0 ? export_bps / mbps : 0.0,
           (double)cross / MIB, (double)t->sent / MIB,
           (double)t->received / MIB, cross_bps / GIB, raw_bps / GIB,
           raw_bps > 0 ? cross_bps / raw_bps : 0.0,
           oneway > 0 ? (double)cross / oneway / GIB : 0.0,
           oneway > 0 ? cross_bps / ((double)cross / oneway) : 0.0,
           t->exchange_s, exchange_bps / GIB,
           raw_bps > 0 ? exchange_bps / raw_bps : 0.0);
  }
  /* Where each export's time went, on the first daemon. */
  printf("\nphases on the first daemon (the first status sample that saw "
         "each, every 2 ms):\n\n");
  printf("- 1 daemon:");
  print_phases(o);
  printf("\n");
  for (int c = 0; c < NCOUNTS; c++) {
    printf("- 2 daemons, %d stream(s):", stream_counts[c]);
    print_phases(&two[c][runs / 2]);
    printf(" the exchange %.0f ms\n", two[c][runs / 2].exchange_s * 1e3);
  }
  printf("\n");
  return 0;
}
