/*
 * flood_bench.c - a second client's `status` while many clients send their
 * largest registration at once.
 *
 * FLOOD_CLIENTS ranks, each of its own job, send one storage_add of
 * FLOOD_STORAGES storages (about 6 MiB) at the same moment, as an attacker
 * with that many connections could.  A second client asks for `status`
 * back to back meanwhile; its worst answer is compared with its worst
 * answer while the daemon was idle, measured in the same run, and with
 * issue 11's goal of 50 ms.  Beside it: the daemon's longest loop
 * iteration (status loop_max_busy_us), and the loop thread's time on a
 * CPU and waiting for one (/proc/PID/task/PID/schedstat), which tell the
 * loop's own work from its waiting behind other threads.  Figures are
 * printed, never asserted (docs/benchmarks.md).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "build_config.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/loadprobe.h"

#define FLOOD_CLIENTS 32
#define FLOOD_STORAGES 100000u
#define FLOOD_LENGTH 64u
#define FLOOD_ROUNDS 3
#define GOAL_NS (50 * UINT64_C(1000000))
#define IDLE_NS (500 * UINT64_C(1000000))
/* A frame of FLOOD_STORAGES storages needs more than the default
 * max_items (13 items a storage). */
#define FLOOD_CONF "max_items = 1048576\n"

static struct sp_test_daemon daemon_;

static void die(const char *what, int rc) {
  fprintf(stderr, "flood_bench: %s: %s\n", what, sp_err_name(rc));
  if (daemon_.pid > 0)
    sp_test_daemon_stop(&daemon_);
  exit(1);
}

/* A client asking for status back to back, keeping its worst answer since
 * the last take. */
struct status_probe {
  pthread_t thread;
  sp_client *c;
  atomic_bool stop;
  _Atomic uint64_t max_ns;
  /* The longest loop iteration its answers reported: each answer's
   * loop_max_busy_us covers the time since the previous status. */
  _Atomic uint64_t busy_us;
  atomic_int failed;
};

static void raise_to(_Atomic uint64_t *max, uint64_t v) {
  uint64_t was = atomic_load(max);
  while (v > was && !atomic_compare_exchange_weak(max, &was, v))
    ;
}

static void *status_loop(void *arg) {
  struct status_probe *p = arg;
  while (!atomic_load(&p->stop)) {
    sp_status_info *st = NULL;
    uint64_t t0 = sp_now_ns();
    int rc = sp_status(p->c, &st);
    uint64_t took = sp_now_ns() - t0;
    if (rc != 0) {
      atomic_store(&p->failed, rc);
      break;
    }
    raise_to(&p->busy_us, st->loop_max_busy_us);
    sp_status_free(st);
    raise_to(&p->max_ns, took);
  }
  return NULL;
}

static uint64_t take_max(struct status_probe *p) {
  return atomic_exchange(&p->max_ns, 0);
}

static uint64_t take_busy_us(struct status_probe *p) {
  return atomic_exchange(&p->busy_us, 0);
}

/* The loop thread's nanoseconds on a CPU and waiting for one. */
struct sched_times {
  uint64_t run_ns, wait_ns;
};

static struct sched_times loop_thread_times(void) {
  char path[64];
  struct sched_times t = {0, 0};
  snprintf(path, sizeof path, "/proc/%d/task/%d/schedstat", (int)daemon_.pid,
           (int)daemon_.pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return t;
  if (fscanf(f, "%" SCNu64 " %" SCNu64, &t.run_ns, &t.wait_ns) != 2)
    t.run_ns = t.wait_ns = 0;
  fclose(f);
  return t;
}

struct round {
  uint64_t took_ns, status_max_ns, busy_us;
  struct sched_times loop;
};

/* Every client sends its frame, then every reply is read. */
static struct round flood(sp_client *creator, struct status_probe *p,
                          uint64_t *next_id) {
  int socks[FLOOD_CLIENTS], fds[FLOOD_CLIENTS];
  struct sp_msgbuf mbs[FLOOD_CLIENTS];
  for (int k = 0; k < FLOOD_CLIENTS; k++) {
    socks[k] = sp_test_raw_rank(daemon_.socket, creator, (*next_id)++);
    fds[k] = sp_test_memfd("flood", (size_t)FLOOD_STORAGES * FLOOD_LENGTH);
    if (socks[k] < 0 || fds[k] < 0)
      die("rank", socks[k] < 0 ? socks[k] : SP_EIO);
    sp_pack_many_storages(&mbs[k], *next_id + (uint64_t)k, 1, FLOOD_STORAGES,
                          FLOOD_LENGTH);
  }
  struct round r;
  take_max(p);
  take_busy_us(p);
  struct sched_times before = loop_thread_times();
  uint64_t t0 = sp_now_ns();
  for (int k = 0; k < FLOOD_CLIENTS; k++)
    if (sp_test_send_msgbuf(socks[k], &mbs[k], &fds[k], 1) != 0)
      die("send", SP_EIO);
  for (int k = 0; k < FLOOD_CLIENTS; k++) {
    struct sp_test_reply rep;
    int rc = sp_test_recv(socks[k], &rep, 300000);
    if (rc == 0) {
      rc = rep.code;
      sp_test_reply_free(&rep);
    }
    if (rc != 0)
      die("storage_add", rc);
  }
  r.took_ns = sp_now_ns() - t0;
  struct sched_times after = loop_thread_times();
  r.status_max_ns = take_max(p);
  r.busy_us = take_busy_us(p);
  r.loop.run_ns = after.run_ns - before.run_ns;
  r.loop.wait_ns = after.wait_ns - before.wait_ns;
  *next_id += FLOOD_CLIENTS;
  for (int k = 0; k < FLOOD_CLIENTS; k++) {
    close(socks[k]);
    close(fds[k]);
  }
  return r;
}

int main(void) {
  char dir[256], path[300];
  if (sp_test_mkdtemp(dir, sizeof dir) != 0)
    die("mkdtemp", SP_EIO);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  if (sp_test_write_file(path, FLOOD_CONF) != 0)
    die("config", SP_EIO);
  const char *args[] = {"--config", path, NULL};
  if (sp_test_daemon_start(&daemon_, args) != 0) {
    fprintf(stderr, "flood_bench: the daemon did not start\n");
    return 1;
  }
  sp_test_rmdir(dir);
  sp_client *creator = NULL;
  int rc = sp_connect(daemon_.socket, &creator);
  if (rc != 0)
    die("connect", rc);
  struct status_probe p = {.max_ns = 0};
  if ((rc = sp_connect(daemon_.socket, &p.c)) != 0)
    die("connect", rc);
  if (pthread_create(&p.thread, NULL, status_loop, &p) != 0)
    die("thread", SP_ENOMEM);
  usleep(IDLE_NS / 1000);
  uint64_t idle_ns = take_max(&p);
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  double load[3] = {0, 0, 0};
  FILE *la = fopen("/proc/loadavg", "r");
  if (la != NULL) {
    if (fscanf(la, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3)
      load[0] = load[1] = load[2] = 0;
    fclose(la);
  }
  printf("%d clients each send one storage_add of %u storages at once; a "
         "second client asks for status meanwhile (%ld CPUs, load %.2f %.2f "
         "%.2f)\n",
         FLOOD_CLIENTS, FLOOD_STORAGES, ncpu, load[0], load[1], load[2]);
  printf("idle: status at most %.3f ms\n", idle_ns / 1e6);
  uint64_t next_id = 1, worst = 0;
  for (int i = 0; i < FLOOD_ROUNDS; i++) {
    struct round r = flood(creator, &p, &next_id);
    printf("round %d: served in %.0f ms; status at most %.1f ms (x%.1f idle, "
           "%.2f of the 50 ms goal); loop busy %.1f ms at most; loop thread "
           "on a CPU %.0f ms, waiting for one %.0f ms\n",
           i + 1, r.took_ns / 1e6, r.status_max_ns / 1e6,
           idle_ns > 0 ? (double)r.status_max_ns / (double)idle_ns : 0.0,
           (double)r.status_max_ns / (double)GOAL_NS, r.busy_us / 1e3,
           r.loop.run_ns / 1e6, r.loop.wait_ns / 1e6);
    if (r.status_max_ns > worst)
      worst = r.status_max_ns;
  }
  atomic_store(&p.stop, true);
  pthread_join(p.thread, NULL);
  if ((rc = atomic_load(&p.failed)) != 0)
    die("status prober", rc);
  printf("worst status while flooded: %.1f ms, x%.1f idle, %.2f of the 50 ms "
         "goal\n",
         worst / 1e6, idle_ns > 0 ? (double)worst / (double)idle_ns : 0.0,
         (double)worst / (double)GOAL_NS);
  sp_close(p.c);
  sp_close(creator);
  return sp_test_daemon_stop(&daemon_) == 0 ? 0 : 1;
}
