/*
 * scale_sim.c - a job of many nodes and ranks on one machine, with the
 * real daemons' root and member code (docs/benchmarks.md, "Scale").
 *
 * One real shardportd per node, each listening for the others on
 * loopback (--peer-listen 127.0.0.1:0) and serving its metrics
 * (--metrics-listen), and the job's ranks as threads of this process, each
 * with its own connection to its node's daemon (simranks.h: one row of
 * every dim-0 key per rank, checked byte for byte against the unsharded
 * original after every export).  The job exports several times with
 * nothing changed between exports: the first export, then the repeated
 * ones.  For each export it prints what the daemons themselves counted,
 * read from their /metrics before and after it (scrape.h):
 *   - control bytes sent and received by the root, and the most any member
 *     sent (node-protocol frames on the job's control links);
 *   - those bytes per shard entry (keys x ranks) and per member;
 *   - planning time (the planning histogram's sum) on the root and the
 *     longest on a member;
 *   - the export's time on the root (its duration histogram's sum);
 *   - from the last rank's request to the first round: the latest
 *     sp_export call to the earliest progress frame of the moving phase,
 *     on this process's clock;
 *   - resident memory (VmRSS, and its peak VmHWM, from /proc) of the root
 *     and of the largest member.
 * Figures are printed, never asserted; the exit status says whether every
 * export of every rank published and every key had exactly one owner
 * holding its original bytes.
 *
 * The machine is shared: a size the daemons' code cannot hold (every
 * member keeps every rank's registrations) would take every process's
 * memory with it.  So a guard kills the daemons once the machine's
 * available memory falls under --min-free-mib (default 2048), and the
 * exports fail and say so.
 *
 *   scale-sim [--nodes N] [--per-node R] [--keys K] [--cols C]
 *             [--exports E] [--timeout-ms T] [--min-free-mib M]
 *
 * $SHARDPORTD names the daemon (meson sets it).
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "tests/integration/harness.h"
#include "tests/scale/scrape.h"
#include "tests/scale/simranks.h"

#define MIB_KB 1024.0
#define SCRAPE_TIMEOUT_MS 30000
/* Tries to start a daemon: its metrics port, picked free, may be taken by
 * another process before the daemon binds it. */
#define START_TRIES 3

#define GUARD_PERIOD_US 100000

struct options {
  uint32_t nodes, per_node, nkeys, cols, exports, timeout_ms, min_free_mib;
};

struct node {
  struct sp_test_daemon d;
  uint16_t metrics_port;
  bool started;
  struct scrape before, after;
};

/* The daemons' settings for a job of a thousand ranks on one machine:
 * every node's links come from one host (127.0.0.1), so the cap on links
 * in their handshake is raised beyond the nodes' count; the root holds
 * every rank's registrations; small tensors need no huge pages. */
static int write_config(const char *dir, const struct options *o, char *path,
                        size_t size) {
  snprintf(path, size, "%s/scale.conf", dir);
  char text[1024];
  snprintf(text, sizeof text,
           "log_level = warn\n"
           "peer_handshakes = 4096\n"
           "peer_timeout = 60s\n"
           "export_timeout = %us\n"
           "max_user_registrations = 268435456\n"
           "max_user_registration_bytes = 256G\n"
           "compare_replicas = no\n"
           "pool_huge_pages = no\n"
           "engine_threads = 1\n",
           (o->timeout_ms + 999) / 1000);
  return sp_test_write_file(path, text);
}

static int start_node(struct node *n, const char *conf) {
  for (int t = 0; t < START_TRIES; t++) {
    n->metrics_port = scrape_free_port();
    char where[32];
    snprintf(where, sizeof where, "127.0.0.1:%u", (unsigned)n->metrics_port);
    const char *const args[] = {"--peer-listen", "127.0.0.1:0",
                                "--metrics-listen", where,
                                "--config", conf, NULL};
    if (n->metrics_port != 0 && sp_test_daemon_start(&n->d, args) == 0) {
      n->started = true;
      return 0;
    }
  }
  return -1;
}

/* MemAvailable of /proc/meminfo in MiB, or -1. */
static long available_mib(void) {
  FILE *f = fopen("/proc/meminfo", "re");
  if (f == NULL)
    return -1;
  char line[128];
  long kb = -1;
  while (kb < 0 && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "MemAvailable: %ld kB", &kb) != 1)
      kb = -1;
  fclose(f);
  return kb < 0 ? -1 : kb / 1024;
}

struct guard {
  pthread_t thread;
  const struct node *nodes;
  uint32_t count;
  long min_free_mib;
  atomic_bool stop, fired;
};

static void *guard_main(void *arg) {
  struct guard *g = arg;
  while (!atomic_load(&g->stop)) {
    long free_mib = available_mib();
    if (free_mib >= 0 && free_mib < g->min_free_mib) {
      fprintf(stderr, "scale-sim: %ld MiB of memory left, less than "
                      "--min-free-mib %ld: killing the daemons\n",
              free_mib, g->min_free_mib);
      for (uint32_t i = 0; i < g->count; i++)
        if (g->nodes[i].started)
          kill(g->nodes[i].d.pid, SIGKILL);
      atomic_store(&g->fired, true);
      return NULL;
    }
    usleep(GUARD_PERIOD_US);
  }
  return NULL;
}

static int scrape_all(struct node *nodes, uint32_t count, bool after) {
  for (uint32_t i = 0; i < count; i++)
    if (scrape_metrics(nodes[i].metrics_port, SCRAPE_TIMEOUT_MS,
                       after ? &nodes[i].after : &nodes[i].before) != 0) {
      fprintf(stderr, "scale-sim: node %u's metrics did not answer\n", i);
      return -1;
    }
  return 0;
}

/* Every rank published and checked its keys, and every key had one owner:
 * else the first failure is printed. */
static bool export_correct(const struct sim_job *j, uint32_t e) {
  for (uint32_t r = 0; r < j->world; r++)
    if (j->rank[r].export_rc[e] != 0) {
      fprintf(stderr, "scale-sim: export %u: rank %u: %s (%s)\n", e + 1, r,
              sp_strerror(j->rank[r].export_rc[e]), j->rank[r].failure);
      return false;
    }
  for (uint32_t k = 0; k < j->nkeys; k++)
    if (atomic_load(&j->owners[k]) != 1) {
      fprintf(stderr, "scale-sim: export %u: key k%05u had %u owners\n",
              e + 1, k, atomic_load(&j->owners[k]));
      return false;
    }
  return true;
}

static void print_header(const struct options *o, uint32_t world) {
  printf("scale simulation: %u nodes x %u ranks = %u ranks, %u dim-0 keys "
         "of [%u, %u] float32, %llu shard entries, %u exports\n\n",
         o->nodes, o->per_node, world, o->nkeys, world, o->cols,
         (unsigned long long)o->nkeys * world, o->exports);
  printf("| nodes | ranks | keys | export | root sent | root received | "
         "member sent (most) | root sent / entry / member | last request "
         "to first round | export (root) | planning (root) | planning "
         "(member, most) | root RSS / peak | member RSS / peak (most) |\n");
  printf("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
         "---:|\n");
}

static void print_row(const struct options *o, const struct sim_job *j,
                      const struct node *nodes, uint32_t e) {
  const struct node *root = &nodes[0];
  uint64_t root_sent = root->after.control_sent - root->before.control_sent;
  uint64_t root_received =
      root->after.control_received - root->before.control_received;
  uint64_t member_sent = 0;
  double member_planning = 0;
  long member_rss = 0, member_hwm = 0;
  for (uint32_t i = 1; i < o->nodes; i++) {
    const struct node *n = &nodes[i];
    uint64_t sent = n->after.control_sent - n->before.control_sent;
    double planning = n->after.planning_s - n->before.planning_s;
    long rss = sp_test_rss_kb(n->d.pid), hwm = sp_test_vm_kb(n->d.pid, "VmHWM");
    if (sent > member_sent)
      member_sent = sent;
    if (planning > member_planning)
      member_planning = planning;
    if (rss > member_rss)
      member_rss = rss;
    if (hwm > member_hwm)
      member_hwm = hwm;
  }
  double last_ask = 0, first_round = 0;
  for (uint32_t r = 0; r < j->world; r++) {
    const struct sim_rank *rk = &j->rank[r];
    if (rk->asked_s[e] > last_ask)
      last_ask = rk->asked_s[e];
    if (rk->first_round_s[e] > 0 &&
        (first_round == 0 || rk->first_round_s[e] < first_round))
      first_round = rk->first_round_s[e];
  }
  uint64_t entries = (uint64_t)o->nkeys * j->world;
  uint32_t members = o->nodes > 1 ? o->nodes - 1 : 1;
  printf("| %u | %u | %u | %s | %llu B | %llu B | %llu B | %.2f B | ",
         o->nodes, j->world, o->nkeys, e == 0 ? "first" : "repeated",
         (unsigned long long)root_sent, (unsigned long long)root_received,
         (unsigned long long)member_sent,
         (double)root_sent / (double)entries / members);
  if (first_round > 0)
    printf("%.1f ms | ", (first_round - last_ask) * 1e3);
  else
    printf("- | ");
  printf("%.3f s | %.3f s | %.3f s | %.1f / %.1f MiB | %.1f / %.1f MiB |\n",
         root->after.duration_s - root->before.duration_s,
         root->after.planning_s - root->before.planning_s, member_planning,
         sp_test_rss_kb(root->d.pid) / MIB_KB,
         sp_test_vm_kb(root->d.pid, "VmHWM") / MIB_KB, member_rss / MIB_KB,
         member_hwm / MIB_KB);
  fflush(stdout);
}

static int parse(int argc, char **argv, struct options *o) {
  static const struct option longs[] = {
      {"nodes", required_argument, NULL, 'n'},
      {"per-node", required_argument, NULL, 'r'},
      {"keys", required_argument, NULL, 'k'},
      {"cols", required_argument, NULL, 'c'},
      {"exports", required_argument, NULL, 'e'},
      {"timeout-ms", required_argument, NULL, 't'},
      {"min-free-mib", required_argument, NULL, 'm'},
      {NULL, 0, NULL, 0}};
  *o = (struct options){.nodes = 8, .per_node = 8, .nkeys = 10000,
                        .cols = 4, .exports = 2, .timeout_ms = 600000,
                        .min_free_mib = 2048};
  int opt;
  while ((opt = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    char *end;
    errno = 0;
    unsigned long v = optarg != NULL ? strtoul(optarg, &end, 10) : 0;
    if (opt == '?' || errno != 0 || *end != '\0' || v == 0 || v > 1u << 24)
      return -1;
    uint32_t *field = opt == 'n'   ? &o->nodes
                      : opt == 'r' ? &o->per_node
                      : opt == 'k' ? &o->nkeys
                      : opt == 'c' ? &o->cols
                      : opt == 'e' ? &o->exports
                      : opt == 'm' ? &o->min_free_mib
                                   : &o->timeout_ms;
    *field = (uint32_t)v;
  }
  return optind == argc && o->exports <= SIM_MAX_EXPORTS ? 0 : -1;
}

/* A thousand ranks hold a connection and a memfd each, and every daemon
 * started from here inherits the limit: as many descriptors as allowed. */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

int main(int argc, char **argv) {
  struct options o;
  if (parse(argc, argv, &o) != 0) {
    fprintf(stderr, "usage: scale-sim [--nodes N] [--per-node R] [--keys K] "
                    "[--cols C] [--exports E (at most %d)] [--timeout-ms T] "
                    "[--min-free-mib M]\n",
            SIM_MAX_EXPORTS);
    return 2;
  }
  sp_test_daemon_path();
  raise_fd_limit();
  char dir[256], conf[320];
  if (sp_test_mkdtemp(dir, sizeof dir) != 0 ||
      write_config(dir, &o, conf, sizeof conf) != 0) {
    fprintf(stderr, "scale-sim: cannot write the configuration\n");
    return 1;
  }
  struct node *nodes = calloc(o.nodes, sizeof *nodes);
  const char **sockets = calloc(o.nodes, sizeof *sockets);
  struct guard guard = {.nodes = nodes, .count = o.nodes,
                        .min_free_mib = o.min_free_mib};
  bool guarding = false;
  int rc = 1;
  if (nodes == NULL || sockets == NULL)
    goto out;
  for (uint32_t i = 0; i < o.nodes; i++) {
    if (start_node(&nodes[i], conf) != 0) {
      fprintf(stderr, "scale-sim: node %u's daemon did not start\n", i);
      goto out;
    }
    sockets[i] = nodes[i].d.socket;
  }
  if (pthread_create(&guard.thread, NULL, guard_main, &guard) != 0)
    goto out;
  guarding = true;
  struct sim_job j = {.nodes = o.nodes, .per_node = o.per_node,
                      .nkeys = o.nkeys, .cols = o.cols,
                      .exports = o.exports, .timeout_ms = o.timeout_ms,
                      .sockets = sockets};
  if (sim_start(&j) != 0) {
    fprintf(stderr, "scale-sim: out of memory\n");
    goto out;
  }
  print_header(&o, j.world);
  bool correct = true;
  for (uint32_t e = 0; e < o.exports; e++) {
    if (scrape_all(nodes, o.nodes, false) != 0)
      correct = false;
    sim_export(&j);
    if (scrape_all(nodes, o.nodes, true) != 0)
      correct = false;
    if (!export_correct(&j, e))
      correct = false;
    else if (correct)
      print_row(&o, &j, nodes, e);
  }
  sim_finish(&j);
  atomic_store(&guard.stop, true);
  pthread_join(guard.thread, NULL);
  guarding = false;
  if (atomic_load(&guard.fired))
    correct = false;
  printf("\n%s\n", correct ? "every export correct" : "an export failed");
  rc = correct ? 0 : 1;
out:
  if (guarding) {
    atomic_store(&guard.stop, true);
    pthread_join(guard.thread, NULL);
  }
  for (uint32_t i = 0; nodes != NULL && i < o.nodes; i++)
    if (nodes[i].started)
      sp_test_daemon_stop(&nodes[i].d);
  free(nodes);
  free(sockets);
  sp_test_rmdir(dir);
  return rc;
}
