/*
 * world.c - the test process's side of the GPU export suite; see world.h.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/rank.h"
#include "tests/integration/gpu_fake/world.h"
#include "tests/integration/rankpipe.h"

struct sp_test_daemon world_node0, world_node1;

static const char *socket_of(const struct scenario *sc, uint32_t rank) {
  return scenario_node_of(sc, rank) == 0 ? world_node0.socket
                                         : world_node1.socket;
}

void world_start(struct world *w, const struct scenario *sc) {
  memset(w, 0, sizeof *w);
  for (uint32_t i = 0; i < sc->world; i++) {
    int in[2], out[2];
    ck_assert_int_eq(pipe2(in, O_CLOEXEC), 0);
    ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      close(in[1]);
      close(out[0]);
      for (uint32_t j = 0; j < i; j++) {
        close(w->in[j]);
        close(w->out[j]);
      }
      rank_main(sc, socket_of(sc, i), i, in[0], out[1]);
    }
    close(in[0]);
    close(out[1]);
    w->pid[i] = pid;
    w->in[i] = in[1];
    w->out[i] = out[0];
  }
  char type;
  sp_ticket ticket;
  ck_assert_int_eq(rankpipe_read(w->out[0], &type, 1, WAIT_MS), 0);
  if (type == 'R') {
    struct report rep;
    rankpipe_read(w->out[0], &rep, sizeof rep, WAIT_MS);
    ck_abort_msg("rank 0 failed before the job existed: %s", rep.failure);
  }
  ck_assert_msg(type == 'T', "rank 0 sent '%c' before a ticket", type);
  ck_assert_int_eq(rankpipe_read(w->out[0], &ticket, sizeof ticket, WAIT_MS),
                   0);
  for (uint32_t i = 1; i < sc->world; i++)
    ck_assert_int_eq(write(w->in[i], &ticket, sizeof ticket),
                     (ssize_t)sizeof ticket);
}

static void read_report(struct world *w, const struct scenario *sc,
                        uint32_t i) {
  char type;
  int rc = rankpipe_read(w->out[i], &type, 1, WAIT_MS);
  ck_assert_msg(rc == 0, "rank %u sent no report: %s", i, sp_strerror(rc));
  ck_assert_int_eq(type, 'R');
  ck_assert_int_eq(
      rankpipe_read(w->out[i], &w->rep[i], sizeof w->rep[i], WAIT_MS), 0);
  w->owned[i] = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  ck_assert_int_eq(rankpipe_read(w->out[i], &type, 1, WAIT_MS), 0);
  ck_assert_int_eq(type, 'O');
  ck_assert_int_eq(rankpipe_read(w->out[i], w->owned[i], sc->nkeys, WAIT_MS),
                   0);
  w->reported[i] = true;
}

/* Waits until world_node0's job moves data, then kills world_node1 outright. */
static void kill_second_node(void) {
  sp_client *c;
  ck_assert_int_eq(sp_connect(world_node0.socket, &c), 0);
  bool moving = false;
  for (int i = 0; i < 2000 && !moving; i++) {
    sp_status_info *st;
    ck_assert_int_eq(sp_status(c, &st), 0);
    for (size_t j = 0; j < st->njobs; j++)
      moving = moving || (strcmp(st->jobs[j].phase, "moving") == 0 &&
                          st->jobs[j].round >= 1);
    sp_status_free(st);
    if (!moving)
      usleep(5000);
  }
  sp_close(c);
  ck_assert_msg(moving, "the export never moved data");
  kill(world_node1.pid, SIGKILL);
  sp_test_wait(world_node1.pid, WAIT_MS);
  sp_test_rmdir(world_node1.dir);
  world_node1.pid = 0;
}

/* Reads every rank's report and reaps it. */
void world_finish(const struct scenario *sc, struct world *w) {
  for (uint32_t i = 0; i < sc->world; i++) {
    if (!(sc->fault == KILL_MOVING && i == sc->victim))
      read_report(w, sc, i);
    close(w->in[i]);
    close(w->out[i]);
    int st = sp_test_wait(w->pid[i], WAIT_MS);
    if (st == SP_ETIMEOUT) {
      kill(w->pid[i], SIGKILL);
      sp_test_wait(w->pid[i], WAIT_MS);
    }
  }
}

void world_run(const struct scenario *sc, struct world *w) {
  world_start(w, sc);
  if (sc->fault == KILL_NODE)
    kill_second_node();
  world_finish(sc, w);
}

void world_free(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++)
    free(w->owned[i]);
}

void world_assert_exported(struct world *w, const struct scenario *sc) {
  uint32_t device_tensors = 0;
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].failure[0] == '\0', "rank %u: %s", i,
                  w->rep[i].failure);
    ck_assert_msg(w->rep[i].export_rc == 0, "rank %u: export: %s: %s", i,
                  sp_strerror(w->rep[i].export_rc), w->rep[i].message);
    device_tensors += w->rep[i].device_tensors;
  }
  for (size_t k = 0; k < sc->nkeys; k++) {
    int owners = 0;
    for (uint32_t i = 0; i < sc->world; i++)
      owners += w->owned[i][k];
    ck_assert_msg(owners == 1, "\"%s\" has %d owners", sc->keys[k].name,
                  owners);
  }
  /* Something was assembled in device segments, not only published as
   * identity. */
  ck_assert_uint_gt(device_tensors, 0);
}

/* Device allocations the daemon has mapped now: its own segments and the
 * trainers' allocations it opened (the fake backs each with a memfd). */
int world_device_mappings(void) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)world_node0.pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  int n = 0;
  while (fgets(line, sizeof line, f))
    n += strstr(line, "memfd:spfake-mem") != NULL;
  fclose(f);
  return n;
}

/* A status request, which has the daemon collect the segments whose
 * holders are gone first (pool.h): the departures the helpers below wait
 * for may be ones only a look tells (a rank process's /proc directory). */
static void ask_status(void) {
  sp_client *c;
  sp_status_info *st;
  if (sp_connect(world_node0.socket, &c) < 0)
    return;
  if (sp_status(c, &st) == 0)
    sp_status_free(st);
  sp_close(c);
}

void world_assert_mappings_closed(void) {
  for (int i = 0; i < 100 && world_device_mappings() != 0; i++) {
    usleep(20000);
    ask_status();
  }
  ck_assert_int_eq(world_device_mappings(), 0);
}

void world_export_cleanly(const struct scenario *sc) {
  struct world w;

  world_run(sc, &w);
  world_assert_exported(&w, sc);
  world_free(&w, sc);
  world_assert_mappings_closed();
}

/* Every daemon of these tests runs with SHARDPORT_FAKE_PAGEABLE=fail: the
 * fake ends it on an async copy between device memory and pageable host
 * memory, which is synchronous on a GPU (docs/fakes.md).  The ranks, test
 * code that may copy so, do not. */
static int daemon_start(struct sp_test_daemon *d, const char *const *args) {
  setenv("SHARDPORT_FAKE_PAGEABLE", "fail", 1);
  int rc = sp_test_daemon_start(d, args);
  unsetenv("SHARDPORT_FAKE_PAGEABLE");
  return rc;
}

void world_daemon_start(void) {
  const char *args[] = {"--backend", "cuda", NULL};
  ck_assert_int_eq(daemon_start(&world_node0, args), 0);
}

void world_daemon_start_slow(void) {
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "50", 1);
  world_daemon_start();
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
}

void world_faulty_gpu_start(void) {
  setenv("SHARDPORT_FAKE_FAULT", "1:1", 1);
  world_daemon_start();
  unsetenv("SHARDPORT_FAKE_FAULT");
}

void world_slow_gpus_start(void) {
  setenv("SHARDPORT_FAKE_DELAY_US", "5000", 1);
  world_daemon_start();
  unsetenv("SHARDPORT_FAKE_DELAY_US");
}

void world_daemon_stop(void) {
  if (world_node0.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&world_node0), 0);
}

/* Two daemons as two nodes of the fake (SHARDPORT_FAKE_NODE 0 and 1), both
 * listening for peers on loopback. */
void world_nodes_start(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  setenv("SHARDPORT_FAKE_NODE", "0", 1);
  ck_assert_int_eq(daemon_start(&world_node0, args), 0);
  setenv("SHARDPORT_FAKE_NODE", "1", 1);
  ck_assert_int_eq(daemon_start(&world_node1, args), 0);
  unsetenv("SHARDPORT_FAKE_NODE");
}

void world_nodes_start_slow(void) {
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "50", 1);
  world_nodes_start();
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
}

/* Two nodes as above; node 1's NCCL fails the first round group that
 * communicator rank 2 launches (its second launch, after the warm-up),
 * once in that daemon: communicators made after the abort run clean. */
void world_nodes_start_launch_error(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  setenv("SHARDPORT_FAKE_NODE", "0", 1);
  ck_assert_int_eq(daemon_start(&world_node0, args), 0);
  setenv("SHARDPORT_FAKE_NODE", "1", 1);
  setenv("SHARDPORT_FAKE_NCCL_FAIL", "2:2:error:once", 1);
  ck_assert_int_eq(daemon_start(&world_node1, args), 0);
  unsetenv("SHARDPORT_FAKE_NCCL_FAIL");
  unsetenv("SHARDPORT_FAKE_NODE");
}

void world_nodes_stop(void) {
  int st0 = world_node0.pid > 0 ? sp_test_daemon_stop(&world_node0) : 0;
  int st1 = world_node1.pid > 0 ? sp_test_daemon_stop(&world_node1) : 0;
  ck_assert_int_eq(st0, 0);
  ck_assert_int_eq(st1, 0);
}

/* Two nodes as world_nodes_start, each daemon's stderr (its log) also kept in a
 * file of its own, read by the test. */
static char log_path_[2][64];

void world_nodes_start_logged(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  struct sp_test_daemon *d[2] = {&world_node0, &world_node1};
  int saved = dup(2);
  ck_assert_int_ge(saved, 0);
  for (int n = 0; n < 2; n++) {
    snprintf(log_path_[n], sizeof log_path_[n], "/tmp/sp-gpu-log%d-XXXXXX", n);
    int fd = mkstemp(log_path_[n]);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    setenv("SHARDPORT_FAKE_NODE", n == 0 ? "0" : "1", 1);
    int rc = daemon_start(d[n], args);
    dup2(saved, 2);
    ck_assert_int_eq(rc, 0);
  }
  close(saved);
  unsetenv("SHARDPORT_FAKE_NODE");
}

void world_nodes_stop_logged(void) {
  for (int n = 0; n < 2; n++)
    unlink(log_path_[n]);
  world_nodes_stop();
}

/* How many lines of a daemon's log hold what. */
int world_log_count(int node, const char *what) {
  FILE *f = fopen(log_path_[node], "r");
  if (f == NULL)
    return -1;
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof line, f))
    n += strstr(line, what) != NULL;
  fclose(f);
  return n;
}

static char small_pool_conf_[300];

/* A daemon whose GPUs lend the pool 64 KiB each. */
void world_small_pool_start(void) {
  char dir[256];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(small_pool_conf_, sizeof small_pool_conf_, "%s/conf", dir);
  FILE *f = fopen(small_pool_conf_, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "gpu_pool_capacity = 65536\n");
  ck_assert_int_eq(fclose(f), 0);
  const char *args[] = {"--backend", "cuda", "--config", small_pool_conf_,
                        NULL};
  ck_assert_int_eq(daemon_start(&world_node0, args), 0);
}

void world_small_pool_stop(void) {
  world_daemon_stop();
  unlink(small_pool_conf_);
  char *slash = strrchr(small_pool_conf_, '/');
  if (slash != NULL) {
    *slash = '\0';
    rmdir(small_pool_conf_);
  }
}

const struct tkey world_mixed_keys[] = {
    K(.name = "emb", .kind = SHARD0, .dtype = "bfloat16", .es = 2, .ndim = 2,
      .shape = {10, 6}, .parts = {3, 0, 5, 2}),
    K(.name = "empty", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {0, 5}, .parts = {0, 0, 0, 0}),
    K(.name = "w.f32", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {7, 3}, .parts = {1, 2, 3, 1}),
    K(.name = "w.i16", .kind = SHARD0, .dtype = "int16", .es = 2, .ndim = 1,
      .shape = {9}, .parts = {0, 0, 9, 0}),
    K(.name = "w.fp8", .kind = SHARD0, .dtype = "float8_e4m3fn", .es = 1,
      .ndim = 2, .shape = {5, 7}, .parts = {2, 1, 1, 1}),
    K(.name = "w.f64", .kind = SHARD0, .dtype = "float64", .es = 8, .ndim = 1,
      .shape = {11}, .parts = {4, 4, 2, 1}),
    K(.name = "norm", .kind = REPLICATED, .dtype = "float32", .es = 4,
      .ndim = 1, .shape = {6}),
    K(.name = "bias", .kind = PLAIN, .dtype = "bfloat16", .es = 2, .ndim = 1,
      .shape = {5}),
    K(.name = "expert.0", .kind = EXPERT, .dtype = "bfloat16", .es = 2,
      .ndim = 2, .shape = {4, 6}, .expert = 2),
    K(.name = "cols", .kind = AFFINE_COLS, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 10}, .parts = {3, 2, 4, 1}),
    K(.name = "tied.a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}),
    K(.name = "tied.b", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}, .tie = 10 + 1),
    K(.name = "scalar", .kind = PLAIN, .dtype = "float32", .es = 4, .ndim = 0),
};

const size_t world_nmixed =
    sizeof world_mixed_keys / sizeof world_mixed_keys[0];

/* The GPUs this run has: SP_TEST_GPUS on hardware, 4 on the fakes. */
int world_test_gpus(void) {
  const char *v = getenv("SP_TEST_GPUS");
  return v != NULL && atoi(v) > 0 ? atoi(v) : 4;
}
