/*
 * export_bench.c - export throughput, the daemon's memory and its status
 * latency on one node.
 *
 * For 2 and 4 ranks, a fresh shardportd serves shardport-demo (the main
 * job: the same synthetic model, every owned tensor verified) exporting
 * five times in a row (--exports 5, the weight-sync pattern), and the
 * bench reads the demo's figures (--machine).  Throughput is the bytes
 * assembled in the pool (the model less the tensors already whole where
 * they are, which are published in place and not copied) over an export's
 * time (from the last rank's request to the last
 * rank holding its tensors), for the first export (fresh pool segments)
 * and the fifth (segments kept from the fourth: the warm pool), each
 * reported as a fraction of single-thread memcpy bandwidth measured in the
 * same run over the same byte count, and the first also against memcpy
 * into pages never touched, as a fresh pool is.  Status latency: a client
 * asks for status back to back (every 2 ms) from before the demo starts
 * until half a second after it ends (its exports, releases and leaving,
 * whose segments' freeing follows); the worst answer is shown beside the
 * median and the worst answers of the idle daemon, measured first (on a
 * loaded machine the idle worst is the scheduler's share).  Memory:
 * while the export runs, the daemon's /proc status (VmRSS, RssAnon,
 * RssShmem) and its pool use (sp_status) are sampled; VmHWM is read after.
 * The same status samples time each export's phases (the first sample
 * that saw planning, allocating, moving and publishing for it), printed
 * for the first and the fifth export of the median run: where their time
 * went.
 * The pool (memfd segments the daemon maps) and the trainers' storages (which
 * it maps read-only and reads) are shared memory, so they count in RSS as
 * RssShmem; private staging shows in RssAnon.  The figures are compared
 * with the bytes the ranks own in the pool (identity tensors take none).
 * Printed, never asserted: these machines are shared.
 *
 *   export_bench [RUNS]    (default 3 runs per rank count, the median shown)
 *
 * $SHARDPORTD and $SHARDPORT_DEMO name the programs (meson sets them).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_RUNS 9
/* Exports in a row per run: the last is the repeated export. */
#define EXPORTS "5"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Single-thread memcpy bandwidth over bytes, in bytes per second, between
 * two buffers of that size.  warm: both buffers touched before (the limit:
 * the best of three); fresh: into pages never touched, so that the page
 * faults and zeroing a fresh pool costs are in it too; fresh_huge: the
 * same into memory that asked for transparent huge pages (anonymous
 * memory: what huge pages would spare the pool's first touch where the
 * kernel grants them to shared memory too; 0 when the mapping failed). */
static void memcpy_bps(uint64_t bytes, double *warm, double *fresh,
                       double *fresh_huge) {
  *warm = *fresh = *fresh_huge = 0;
  char *src = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *dst = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *huge = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (src == MAP_FAILED || dst == MAP_FAILED)
    goto out;
  memset(src, 1, bytes);
  if (huge != MAP_FAILED) {
    madvise(huge, bytes, MADV_HUGEPAGE);
    double th = now_s();
    memcpy(huge, src, bytes);
    __asm__ volatile("" : : "r"(huge) : "memory");
    *fresh_huge = (double)bytes / (now_s() - th);
  }
  double t0 = now_s();
  memcpy(dst, src, bytes);
  __asm__ volatile("" : : "r"(dst) : "memory");
  *fresh = (double)bytes / (now_s() - t0);
  for (int rep = 0; rep < 3; rep++) {
    t0 = now_s();
    memcpy(dst, src, bytes);
    /* Keeps the copy from being optimised away. */
    __asm__ volatile("" : : "r"(dst) : "memory");
    double bps = (double)bytes / (now_s() - t0);
    if (bps > *warm)
      *warm = bps;
  }
out:
  if (src != MAP_FAILED)
    munmap(src, bytes);
  if (dst != MAP_FAILED)
    munmap(dst, bytes);
  if (huge != MAP_FAILED)
    munmap(huge, bytes);
}

/* A sysfs setting's line, or "unknown". */
static void read_setting(const char *path, char *buf, size_t len) {
  snprintf(buf, len, "unknown");
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  if (fgets(buf, (int)len, f) != NULL)
    buf[strcspn(buf, "\n")] = '\0';
  fclose(f);
}

/* What the demo printed with --machine. */
struct demo_figures {
  unsigned ranks;
  size_t keys;
  unsigned long long bytes, pool_bytes, identity_bytes, max_rank_bytes;
  double seconds; /* the first export */
  int verified;
  unsigned nodes, exports;
  double seconds_last; /* the last export */
};

static int parse_figures(const char *line, struct demo_figures *f) {
  return sscanf(line,
                "ranks=%u keys=%zu bytes=%llu pool_bytes=%llu "
                "identity_bytes=%llu max_rank_bytes=%llu seconds=%lf "
                "verified=%d nodes=%u exports=%u seconds_last=%lf",
                &f->ranks, &f->keys, &f->bytes, &f->pool_bytes,
                &f->identity_bytes, &f->max_rank_bytes, &f->seconds,
                &f->verified, &f->nodes, &f->exports, &f->seconds_last) == 11
             ? 0
             : -1;
}

enum { PH_PLANNING, PH_ALLOCATING, PH_MOVING, PH_PUBLISHING, NPHASES };
static const char *const phase_names[NPHASES] = {"planning", "allocating",
                                                 "moving", "publishing"};
#define NEXPORTS 5

/* When the samples first saw each phase of each export (0: never), and
 * last saw the export under way. */
struct phases {
  double first_s[NEXPORTS][NPHASES];
  double last_s[NEXPORTS];
};

/* Samples the daemon while the demo runs. */
struct sampler {
  struct phases ph;
  pid_t daemon;
  const char *socket;
  atomic_bool stop;
  long rss_kb, anon_kb, shmem_kb; /* peaks */
  uint64_t pool_used;             /* peak */
  double idle_status_s, idle_worst_s; /* median and worst, before */
  double worst_status_s;          /* while and after it runs */
  uint64_t loop_busy_us;          /* the daemon's longest loop iteration */
};

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* One status call's latency in seconds (0 when it failed), its pool use
 * in *pool_used and the daemon's longest loop iteration since the previous
 * status in *busy_us. */
static double timed_status(sp_client *c, uint64_t *pool_used,
                           uint64_t *busy_us, struct phases *ph) {
  sp_status_info *st = NULL;
  double t0 = now_s();
  if (c == NULL || sp_status(c, &st) != 0)
    return 0;
  double t = now_s() - t0;
  *pool_used = st->pool_used;
  *busy_us = st->loop_max_busy_us;
  for (size_t j = 0; ph != NULL && j < st->njobs; j++) {
    const sp_job_status *js = &st->jobs[j];
    if (js->export_id < 1 || js->export_id > NEXPORTS)
      continue;
    uint64_t e = js->export_id - 1;
    for (int p = 0; p < NPHASES; p++)
      if (strcmp(js->phase, phase_names[p]) == 0) {
        if (ph->first_s[e][p] == 0)
          ph->first_s[e][p] = t0;
        ph->last_s[e] = t0;
      }
  }
  sp_status_free(st);
  return t;
}

#define IDLE_SAMPLES 101

static void *sample(void *p) {
  struct sampler *s = p;
  sp_client *c = NULL;
  sp_connect(s->socket, &c);
  while (!atomic_load(&s->stop)) {
    long v;
    if ((v = sp_test_vm_kb(s->daemon, "VmRSS")) > s->rss_kb)
      s->rss_kb = v;
    if ((v = sp_test_vm_kb(s->daemon, "RssAnon")) > s->anon_kb)
      s->anon_kb = v;
    if ((v = sp_test_vm_kb(s->daemon, "RssShmem")) > s->shmem_kb)
      s->shmem_kb = v;
    uint64_t used = 0, busy = 0;
    double t = timed_status(c, &used, &busy, &s->ph);
    if (used > s->pool_used)
      s->pool_used = used;
    if (busy > s->loop_busy_us)
      s->loop_busy_us = busy;
    if (t > s->worst_status_s)
      s->worst_status_s = t;
    struct timespec ts = {0, 2 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  sp_close(c);
  return NULL;
}

/* Runs the demo with its output on a pipe; returns its figures line. */
static int run_demo(const char *demo, const char *socket, unsigned ranks,
                    struct demo_figures *f) {
  int out[2];
  if (pipe(out) != 0)
    return -1;
  char nranks[16];
  snprintf(nranks, sizeof nranks, "%u", ranks);
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execl(demo, demo, "--ranks", nranks, "--socket", socket, "--exports",
          EXPORTS, "--machine", (char *)NULL);
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
    fprintf(stderr, "export_bench: shardport-demo failed: %s\n", buf);
    return -1;
  }
  return parse_figures(buf, f);
}

struct run {
  struct demo_figures f;
  double hwm_mib, rss_mib, anon_mib, shmem_mib, pool_mib;
  double idle_status_s, idle_worst_s, worst_status_s;
  uint64_t loop_busy_us;
  struct phases ph;
};

/* The idle daemon's median status latency, and its worst in *worst. */
static double idle_status(const char *socket, double *worst) {
  double t[IDLE_SAMPLES];
  sp_client *c = NULL;
  sp_connect(socket, &c);
  uint64_t used, busy;
  for (int i = 0; i < IDLE_SAMPLES; i++)
    t[i] = timed_status(c, &used, &busy, NULL);
  sp_close(c);
  qsort(t, IDLE_SAMPLES, sizeof t[0], cmp_double);
  *worst = t[IDLE_SAMPLES - 1];
  return t[IDLE_SAMPLES / 2];
}

static int one_run(const char *demo, unsigned ranks, struct run *r) {
  static const char *const args[] = {"--log-level", "warn", NULL};
  struct sp_test_daemon d;
  if (sp_test_daemon_start(&d, args) != 0)
    return -1;
  long hwm0 = sp_test_vm_kb(d.pid, "VmHWM");
  long anon0 = sp_test_vm_kb(d.pid, "RssAnon");
  long shmem0 = sp_test_vm_kb(d.pid, "RssShmem");
  long rss0 = sp_test_vm_kb(d.pid, "VmRSS");
  struct sampler s = {.daemon = d.pid, .socket = d.socket};
  r->idle_status_s = idle_status(d.socket, &r->idle_worst_s);
  pthread_t th;
  int rc = pthread_create(&th, NULL, sample, &s);
  if (rc == 0) {
    rc = run_demo(demo, d.socket, ranks, &r->f);
    /* Right after: the last segments' freeing. */
    struct timespec after = {0, 500 * 1000 * 1000};
    nanosleep(&after, NULL);
    atomic_store(&s.stop, true);
    pthread_join(th, NULL);
  }
  r->worst_status_s = s.worst_status_s;
  r->loop_busy_us = s.loop_busy_us;
  r->ph = s.ph;
  long hwm = sp_test_vm_kb(d.pid, "VmHWM");
  sp_test_daemon_stop(&d);
  if (rc != 0)
    return -1;
  r->hwm_mib = (double)(hwm - hwm0) / 1024.0;
  r->rss_mib = (double)(s.rss_kb - rss0) / 1024.0;
  r->anon_mib = (double)(s.anon_kb - anon0) / 1024.0;
  r->shmem_mib = (double)(s.shmem_kb - shmem0) / 1024.0;
  r->pool_mib = (double)s.pool_used / MIB;
  return 0;
}

/* Export e's phases: each lasts until the first sample that saw a later
 * one (a short one may fall between two samples), the last until the
 * export was last seen under way. */
static void print_phases(const struct phases *ph, int e) {
  for (int p = 0; p < NPHASES; p++) {
    double end = ph->last_s[e];
    for (int q = NPHASES - 1; q > p; q--)
      if (ph->first_s[e][q] > 0)
        end = ph->first_s[e][q];
    if (ph->first_s[e][p] > 0)
      printf(" %s %.0f ms,", phase_names[p], (end - ph->first_s[e][p]) * 1e3);
    else
      printf(" %s -,", phase_names[p]);
  }
}

static int cmp_first(const void *a, const void *b) {
  double x = ((const struct run *)a)->f.seconds,
         y = ((const struct run *)b)->f.seconds;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const char *demo = getenv("SHARDPORT_DEMO");
  if (!demo || !getenv("SHARDPORTD")) {
    fprintf(stderr, "export_bench: set SHARDPORTD and SHARDPORT_DEMO\n");
    return 1;
  }
  int runs = argc > 1 ? atoi(argv[1]) : 3;
  if (runs < 1 || runs > MAX_RUNS)
    runs = 3;
  static const unsigned rank_counts[] = {2, 4};
  struct phases phase_lines[2];

  char shmem[128], anon_thp[128];
  read_setting("/sys/kernel/mm/transparent_hugepage/shmem_enabled", shmem,
               sizeof shmem);
  read_setting("/sys/kernel/mm/transparent_hugepage/enabled", anon_thp,
               sizeof anon_thp);
  printf("export on one node: shardport-demo, %d runs per rank count of "
         "%s exports in a row each (median by time; memory and status "
         "latency the largest of the runs)\n"
         "transparent huge pages: shared memory %s, anonymous %s (the pool "
         "asks for them: pool_huge_pages)\n\n",
         runs, EXPORTS, shmem, anon_thp);
  printf("| ranks | assembled | memcpy, 1 thread | memcpy into fresh pages "
         "| into fresh huge pages "
         "| first export | ratio to memcpy | ratio to fresh pages "
         "| fifth export | ratio to memcpy | owned in pool | pool peak "
         "| RSS peak above base | of it anon | status, idle median "
         "| status, idle worst | status, worst during and after "
         "| loop busy at most |\n");
  printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
         "|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < sizeof rank_counts / sizeof rank_counts[0]; i++) {
    struct run r[MAX_RUNS];
    for (int k = 0; k < runs; k++)
      if (one_run(demo, rank_counts[i], &r[k]) != 0) {
        fprintf(stderr, "export_bench: run with %u ranks failed\n",
                rank_counts[i]);
        return 1;
      }
    double hwm = 0, anon = 0, pool = 0, idle = 0, idle_worst = 0, worst = 0;
    uint64_t busy = 0;
    double first[MAX_RUNS], last[MAX_RUNS];
    for (int k = 0; k < runs; k++) {
      hwm = r[k].hwm_mib > hwm ? r[k].hwm_mib : hwm;
      anon = r[k].anon_mib > anon ? r[k].anon_mib : anon;
      pool = r[k].pool_mib > pool ? r[k].pool_mib : pool;
      idle = r[k].idle_status_s > idle ? r[k].idle_status_s : idle;
      idle_worst =
          r[k].idle_worst_s > idle_worst ? r[k].idle_worst_s : idle_worst;
      worst = r[k].worst_status_s > worst ? r[k].worst_status_s : worst;
      busy = r[k].loop_busy_us > busy ? r[k].loop_busy_us : busy;
      first[k] = r[k].f.seconds;
      last[k] = r[k].f.seconds_last;
    }
    qsort(first, (size_t)runs, sizeof first[0], cmp_double);
    qsort(last, (size_t)runs, sizeof last[0], cmp_double);
    const struct demo_figures *f = &r[0].f;
    double t_first = first[runs / 2], t_last = last[runs / 2];
    double mbps, fresh, fresh_huge;
    memcpy_bps(f->pool_bytes, &mbps, &fresh, &fresh_huge);
    double bps_first = (double)f->pool_bytes / t_first;
    double bps_last = (double)f->pool_bytes / t_last;
    double owned = (double)f->pool_bytes / MIB;
    printf("| %u | %.1f MiB | %.2f GiB/s | %.2f GiB/s | %.2f GiB/s "
           "| %.2f GiB/s "
           "| %.2f | %.2f | %.2f GiB/s | %.2f | %.1f MiB | %.1f MiB (%.2fx) "
           "| %.1f MiB (%.2fx) | %.1f MiB | %.2f ms | %.2f ms | %.2f ms "
           "| %.2f ms |\n",
           f->ranks, (double)f->pool_bytes / MIB, mbps / GIB, fresh / GIB,
           fresh_huge / GIB, bps_first / GIB, mbps > 0 ? bps_first / mbps : 0.0,
           fresh > 0 ? bps_first / fresh : 0.0, bps_last / GIB,
           mbps > 0 ? bps_last / mbps : 0.0, owned, pool,
           owned > 0 ? pool / owned : 0.0, hwm, owned > 0 ? hwm / owned : 0.0,
           anon, idle * 1e3, idle_worst * 1e3, worst * 1e3,
           (double)busy / 1e3);
    /* Where the time went, in the run of the median first export. */
    qsort(r, (size_t)runs, sizeof r[0], cmp_first);
    phase_lines[i] = r[runs / 2].ph;
    fflush(stdout);
  }
  printf("\nphases of the median run's first and fifth export (the first "
         "status sample that saw each, every 2 ms):\n\n");
  for (size_t i = 0; i < sizeof rank_counts / sizeof rank_counts[0]; i++)
    for (int e = 0; e < NEXPORTS; e += NEXPORTS - 1) {
      printf("- %u ranks, export %d:", rank_counts[i], e + 1);
      print_phases(&phase_lines[i], e);
      printf("\n");
    }
  printf("\n");
  return 0;
}
