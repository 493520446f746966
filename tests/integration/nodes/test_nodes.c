/*
 * test_nodes.c - jobs across nodes: two and three private daemons on
 * loopback, each listening for the others on a port the kernel picks, and
 * trainer processes (tests/integration/trainer.h) spread over them, two
 * ranks per daemon.
 *
 * What is asserted: every layout of the single-node suite exports across
 * nodes exactly (each rank checks every byte it owns against the original)
 * and with the same owners as on one daemon, and so do tensor parallel
 * splits replicated over data parallel ranks on the other node (strided
 * sources among them); every daemon of a job plans the same digest and
 * shows its nodes and the bytes between them; a wrong secret or job id is
 * refused; refusals reach every rank of every node with one message; and
 * the faults: a daemon killed mid-round, a daemon
 * stopped (SIGSTOP: it reads nothing), a rank lost on another node, fail
 * every surviving rank with the error naming the lost node or rank within
 * the export's timeout, free the survivors' pool, and leave the daemons
 * ready for the next job; a slow peer is not a lost one; a rank that left
 * before the others asked (its registration refused, by leave, or with its
 * node) fails their export at once on both nodes, with why, and one that
 * joined again fails nothing.
 *
 *   test-nodes [TCASE]   (all test cases by default)
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/trainer.h"

#define MAXD 3

static struct sp_test_daemon daemons[MAXD];
static int ndaemons;

/* With logs: daemon i's stderr goes to logs[i], in log_dir; at debug level
 * when debug_logs is set. */
static char log_dir[256], logs[MAXD][300];
static bool debug_logs;
/* A configuration file for every daemon (in log_dir), or none. */
static char daemon_conf[300];

static void start_daemons(int n, const char *round_delay_ms) {
  const char *args[8] = {"--peer-listen", "127.0.0.1:0"};
  int nargs = 2;
  if (debug_logs) {
    args[nargs++] = "--log-level";
    args[nargs++] = "debug";
  }
  if (daemon_conf[0] != '\0') {
    args[nargs++] = "--config";
    args[nargs++] = daemon_conf;
  }
  args[nargs] = NULL;
  if (round_delay_ms != NULL)
    setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", round_delay_ms, 1);
  for (int i = 0; i < n; i++) {
    int saved = -1;
    if (log_dir[0] != '\0') {
      snprintf(logs[i], sizeof logs[i], "%s/%d.log", log_dir, i);
      int log = open(logs[i], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      ck_assert_int_ge(log, 0);
      saved = dup(2);
      dup2(log, 2);
      close(log);
    }
    int rc = sp_test_daemon_start(&daemons[i], args);
    if (saved >= 0) {
      dup2(saved, 2);
      close(saved);
    }
    ck_assert_int_eq(rc, 0);
  }
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
  ndaemons = n;
}

static void start2(void) { start_daemons(2, NULL); }
static void start3(void) { start_daemons(3, NULL); }
/* The engines pause after every round, so a test can act mid-export. */
static void start2_slow(void) { start_daemons(2, "150"); }

static void start2_logged(void) {
  ck_assert_int_eq(sp_test_mkdtemp(log_dir, sizeof log_dir), 0);
  start_daemons(2, NULL);
}

/* Logged at debug level, each pair of nodes over streams connections,
 * rounds paused by round_delay_ms (NULL: none). */
static void start2_streams(uint32_t streams, const char *round_delay_ms) {
  ck_assert_int_eq(sp_test_mkdtemp(log_dir, sizeof log_dir), 0);
  snprintf(daemon_conf, sizeof daemon_conf, "%s/d.conf", log_dir);
  FILE *f = fopen(daemon_conf, "we");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "peer_streams = %u\n", streams);
  ck_assert_int_eq(fclose(f), 0);
  debug_logs = true;
  start_daemons(2, round_delay_ms);
}

static void start2_three_streams(void) { start2_streams(3, NULL); }
static void start2_three_streams_slow(void) { start2_streams(3, "150"); }
static void start2_debug_slow(void) { start2_streams(1, "150"); }
static void start2_debug(void) { start2_streams(1, NULL); }

static void stop_all(void) {
  for (int i = 0; i < ndaemons; i++)
    if (daemons[i].pid > 0)
      ck_assert_int_eq(sp_test_daemon_stop(&daemons[i]), 0);
    else
      sp_test_daemon_stop(&daemons[i]); /* killed: its directory goes */
  if (log_dir[0] != '\0')
    sp_test_rmdir(log_dir);
  log_dir[0] = '\0';
  daemon_conf[0] = '\0';
  debug_logs = false;
}

/* How many lines of daemon i's log hold words; *line gets the last. */
static int log_count(int i, const char *words, char *line, size_t len) {
  FILE *f = fopen(logs[i], "re");
  ck_assert_ptr_nonnull(f);
  char buf[4096];
  int n = 0;
  while (fgets(buf, sizeof buf, f) != NULL)
    if (strstr(buf, words) != NULL) {
      snprintf(line, len, "%s", buf);
      n++;
    }
  fclose(f);
  return n;
}

/* Ranks in blocks over the first n daemons: rank 0 (the job's creator) on
 * the first, which roots the job. */
static const char *const *spread(uint32_t world, int n) {
  static const char *sockets[TRAINER_MAXR];
  for (uint32_t r = 0; r < world; r++)
    sockets[r] = daemons[(uint64_t)r * (uint64_t)n / world].socket;
  return sockets;
}

static void run_on(const struct scenario *sc, struct world *w, int n) {
  trainer_start(w, sc, spread(sc->world, n));
  trainer_finish(w, sc);
}

static void kill_daemon(int i, int sig) {
  ck_assert_int_eq(kill(daemons[i].pid, sig), 0);
  if (sig == SIGKILL) {
    waitpid(daemons[i].pid, NULL, 0);
    daemons[i].pid = -1;
  }
}

static sp_status_info *status_of(int i) {
  sp_client *c;
  sp_status_info *st;
  ck_assert_int_eq(sp_connect(daemons[i].socket, &c), 0);
  ck_assert_int_eq(sp_status(c, &st), 0);
  sp_close(c);
  return st;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The daemon holds no job and no pool memory (a job ends once its ranks
 * have gone, which the daemon learns on its next wake-up). */
static void assert_idle(int i) {
  for (int tries = 0; tries < 200; tries++) {
    sp_status_info *st = status_of(i);
    bool idle = st->njobs == 0 && st->pool_used == 0;
    sp_status_free(st);
    if (idle)
      return;
    sleep_ms(25);
  }
  sp_status_info *st = status_of(i);
  ck_assert_msg(0, "daemon %d still holds %zu job(s) and %llu pool bytes", i,
                st->njobs, (unsigned long long)st->pool_used);
  sp_status_free(st);
}

/* ---- layouts ---- */

/* The single-node suite's mixed model for four ranks, plus what only
 * crosses nodes differently: replicas of one piece on two nodes, and a
 * view too fragmented to send run by run (packed into staging). */
static struct tkey mixed_keys[] = {
    TRAINER_MIXED_KEYS,
    /* ranks r and r + 2 hold the same rows: replicas on two nodes */
    K(.name = "pairs", .kind = AFFINE_PAIRS, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {6, 5}, .parts = {2, 4}),
    /* rows of 3 elements 5 apart: a sender packs them */
    K(.name = "padded", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {9, 3}, .parts = {2, 3, 1, 3}, .pad = 2),
    /* large enough that rows go straight from storage to pool */
    K(.name = "big", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {96, 512}, .parts = {30, 10, 40, 16}),
};

static const char *const mixed_group[] = TRAINER_MIXED_GROUP;

#define NMIXED (sizeof mixed_keys / sizeof mixed_keys[0])

/* Two daemons export the model exactly as one daemon does: every rank's
 * bytes are the original's, and every key has the same owner. */
START_TEST(two_nodes_export_as_one_does) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group};
  struct world one, two;
  run_on(&sc, &one, 1);
  trainer_assert_exported(&one, &sc);
  run_on(&sc, &two, 2);
  trainer_assert_exported(&two, &sc);
  for (size_t k = 0; k < NMIXED; k++)
    ck_assert_msg(trainer_owner_of(&one, &sc, mixed_keys[k].name) ==
                      trainer_owner_of(&two, &sc, mixed_keys[k].name),
                  "\"%s\": owner %u on one daemon, %u on two",
                  mixed_keys[k].name,
                  trainer_owner_of(&one, &sc, mixed_keys[k].name),
                  trainer_owner_of(&two, &sc, mixed_keys[k].name));
  ck_assert_uint_eq(trainer_owner_of(&two, &sc, "tied.a"),
                    trainer_owner_of(&two, &sc, "tied.b"));
  ck_assert_uint_eq(trainer_owner_of(&two, &sc, "grp.x"),
                    trainer_owner_of(&two, &sc, "grp.y"));
  ck_assert_uint_eq(trainer_owner_of(&two, &sc, "expert.0"), 2);
  trainer_free(&one, &sc);
  trainer_free(&two, &sc);
  assert_idle(0);
  assert_idle(1);
}
END_TEST

/* The same model for six ranks on three daemons. */
static struct tkey six_keys[] = {
    K(.name = "emb", .kind = SHARD0, .dtype = "bfloat16", .es = 2, .ndim = 2,
      .shape = {13, 6}, .parts = {3, 0, 5, 2, 0, 3}),
    K(.name = "empty", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {0, 5}),
    K(.name = "w.i16", .kind = SHARD0, .dtype = "int16", .es = 2, .ndim = 1,
      .shape = {9}, .parts = {0, 0, 0, 0, 9, 0}),
    K(.name = "norm", .kind = REPLICATED, .dtype = "float32", .es = 4,
      .ndim = 1, .shape = {6}),
    K(.name = "bias", .kind = PLAIN, .dtype = "bfloat16", .es = 2, .ndim = 1,
      .shape = {5}),
    K(.name = "expert.5", .kind = EXPERT, .dtype = "bfloat16", .es = 2,
      .ndim = 2, .shape = {4, 6}, .expert = 5),
    K(.name = "cols", .kind = AFFINE_COLS, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 12}, .parts = {3, 2, 4, 1, 0, 2}),
    K(.name = "pairs", .kind = AFFINE_PAIRS, .dtype = "int16", .es = 2,
      .ndim = 2, .shape = {7, 4}, .parts = {2, 4, 1}),
    K(.name = "padded", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {12, 3}, .parts = {2, 3, 1, 3, 0, 3}, .pad = 1),
    K(.name = "big", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {60, 512}, .parts = {10, 10, 0, 20, 5, 15}),
    K(.name = "tied.a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {6, 4}, .parts = {1, 1, 1, 1, 1, 1}),
    K(.name = "tied.b", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {6, 4}, .parts = {1, 1, 1, 1, 1, 1}, .tie = 10 + 1),
};

START_TEST(three_nodes_export) {
  struct scenario sc = {.world = 6,
                        .nkeys = sizeof six_keys / sizeof six_keys[0],
                        .keys = six_keys};
  struct world w;
  run_on(&sc, &w, 3);
  trainer_assert_exported(&w, &sc);
  ck_assert_uint_eq(trainer_owner_of(&w, &sc, "expert.5"), 5);
  trainer_free(&w, &sc);
  for (int i = 0; i < 3; i++)
    assert_idle(i);
}
END_TEST

/* The job's root holds no rank: the job is created on the first daemon and
 * its four ranks join on the other two.  The root still decides joins and
 * agreement; the data moves between the other two. */
START_TEST(root_without_ranks) {
  sp_client *creator;
  sp_ticket ticket;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &creator), 0);
  ck_assert_int_eq(sp_job_create(creator, 4, &ticket), 0);
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group, .ticket = &ticket,
                        .exports = 2};
  const char *sockets[4] = {daemons[1].socket, daemons[1].socket,
                            daemons[2].socket, daemons[2].socket};
  struct world w;
  trainer_start(&w, &sc, sockets);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
  sp_close(creator);
  for (int i = 0; i < 3; i++)
    assert_idle(i);
}
END_TEST

START_TEST(more_than_4096_keys_across_nodes) {
  enum { N = 5000 };
  struct tkey *keys = calloc(N, sizeof *keys);
  char(*names)[16] = calloc(N, sizeof *names);
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "k.%05d", i);
    bool bf = i % 3 == 0;
    keys[i] = K(.name = names[i], .kind = SHARD0,
                .dtype = bf ? "bfloat16" : "float32", .es = bf ? 2 : 4,
                .ndim = 2, .shape = {5, 2},
                .parts = {i % 4, 1, 3 - i % 4, 1});
  }
  struct scenario sc = {.world = 4, .nkeys = N, .keys = keys};
  struct world w;
  run_on(&sc, &w, 2);
  trainer_assert_exported(&w, &sc);
  /* Default max_keys is 4096: at least two rounds. */
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].max_rounds, 2);
  trainer_free(&w, &sc);
  free(keys);
  free(names);
}
END_TEST

/* The job's daemons agree: one digest, both nodes connected, and the bytes
 * one sent are the bytes the other received.  Exported three times, over
 * the same data links. */
START_TEST(digests_agree_and_status_shows_nodes) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group, .exports = 3, .hold = true};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_held(&w, &sc);
  sp_status_info *a = status_of(0), *b = status_of(1);
  ck_assert_ptr_nonnull(a->peer_address);
  ck_assert_ptr_nonnull(b->peer_address);
  ck_assert_uint_eq(a->njobs, 1);
  ck_assert_uint_eq(b->njobs, 1);
  const sp_job_status *ja = &a->jobs[0], *jb = &b->jobs[0];
  ck_assert_str_eq(ja->job_id, jb->job_id);
  ck_assert_str_eq(ja->phase, "published");
  ck_assert_ptr_nonnull(ja->plan_digest);
  ck_assert_uint_eq(strlen(ja->plan_digest), 16);
  ck_assert_str_eq(ja->plan_digest, jb->plan_digest);
  ck_assert_uint_eq(ja->node, 0);
  ck_assert_uint_eq(jb->node, 1);
  ck_assert_uint_eq(ja->nnodes, 2);
  ck_assert_uint_eq(jb->nnodes, 2);
  for (int n = 0; n < 2; n++) {
    ck_assert(ja->nodes[n].connected);
    ck_assert(jb->nodes[n].connected);
    ck_assert_uint_eq(ja->nodes[n].node, (uint32_t)n);
  }
  ck_assert(ja->nodes[0].self && !ja->nodes[1].self);
  ck_assert(jb->nodes[1].self && !jb->nodes[0].self);
  ck_assert_str_eq(ja->nodes[0].address, a->peer_address);
  ck_assert_str_eq(ja->nodes[1].address, b->peer_address);
  /* A's bytes to B are B's bytes from A, and some moved both ways. */
  ck_assert_uint_gt(ja->nodes[1].bytes_sent, 0);
  ck_assert_uint_gt(ja->nodes[1].bytes_received, 0);
  ck_assert_uint_eq(ja->nodes[1].bytes_sent, jb->nodes[0].bytes_received);
  ck_assert_uint_eq(ja->nodes[1].bytes_received, jb->nodes[0].bytes_sent);
  sp_status_free(a);
  sp_status_free(b);
  trainer_release(&w, &sc);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
}
END_TEST

/* ---- refusals ---- */

static struct tkey refusal_keys[] = {TRAINER_REFUSAL_KEYS};

static void short_a_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank == 3)
    trainer_desc(t, *n, "a")->shape[0] = 1;
}

static void expert_on_2_too(const struct scenario *sc, uint32_t rank,
                            sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank != 2)
    return;
  t[*n] = *trainer_desc(t, *n, "b");
  t[*n].key = "e";
  t[*n].placement = SP_PLACEMENT_EXPERT;
  ++*n;
}

static const struct {
  tweak_fn *tweak;
  int code;
} refusals[] = {
    {trainer_drop_b_on_3, SP_EKEYSET},
    {short_a_on_3, SP_ETILING},
    {expert_on_2_too, SP_EEXPERT},
};

static void assert_refused(struct world *w, const struct scenario *sc,
                           int code) {
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].export_rc == code, "rank %u: %s (%s), expected "
                  "%s: %s", i, sp_err_name(w->rep[i].export_rc),
                  w->rep[i].failure, sp_err_name(code), w->rep[i].message);
    ck_assert_str_ne(w->rep[i].message, "");
    ck_assert_str_eq(w->rep[i].message, w->rep[0].message);
    for (size_t k = 0; k < sc->nkeys; k++)
      ck_assert_uint_eq(w->owned[i][k], 0);
  }
}

static void next_job_is_served(int n) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group};
  struct world w;
  run_on(&sc, &w, n);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}

START_TEST(refusal_reaches_every_node_alike) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .tweak = refusals[_i].tweak};
  struct world w;
  run_on(&sc, &w, 2);
  assert_refused(&w, &sc, refusals[_i].code);
  trainer_free(&w, &sc);
  next_job_is_served(2);
}
END_TEST

/* Tensor parallel splits replicated over data parallel ranks
 * (tlayout_family): the replicas that reach an owner on another node, with
 * strided sources among them, are packed where they are held and compared
 * on the owner's node only.  Exact on one daemon and on two. */
START_TEST(tensor_parallel_replicas_across_nodes) {
  static struct tlayout_key family[TLAYOUT_FAMILY];
  struct tkey keys[TLAYOUT_FAMILY];
  tlayout_family(family);
  for (size_t i = 0; i < TLAYOUT_FAMILY; i++)
    keys[i] = K(.name = family[i].name, .kind = AFFINE_MAP,
                .dtype = family[i].dtype, .es = family[i].es, .ndim = 2,
                .shape = {family[i].layout.shape[0],
                          family[i].layout.shape[1]},
                .layout = &family[i].layout);
  struct scenario sc = {.world = 4, .nkeys = TLAYOUT_FAMILY, .keys = keys,
                        .exports = 2};
  struct world one, two;
  run_on(&sc, &one, 1);
  trainer_assert_exported(&one, &sc);
  run_on(&sc, &two, 2);
  trainer_assert_exported(&two, &sc);
  trainer_free(&one, &sc);
  trainer_free(&two, &sc);
  assert_idle(0);
  assert_idle(1);
}
END_TEST

/* Replicas of one piece on two nodes disagree: the owner's daemon finds
 * it, and every rank on both nodes hears the same message. */
START_TEST(replicas_across_nodes_that_differ) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group, .corrupt = 3 + 1};
  struct world w;
  run_on(&sc, &w, 2);
  assert_refused(&w, &sc, SP_EDIFFERENT);
  ck_assert_ptr_nonnull(strstr(w.rep[0].message, "'pairs'"));
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
  next_job_is_served(2);
}
END_TEST

/* Copies of a replicated key that differ between the nodes (both ranks of
 * node 1 alike): each node's own copies agree, the root finds the nodes'
 * digests differ, and every rank of both nodes hears one different_data.
 * Copies that differ within node 1: that node finds it, and the root
 * passes it on. */
START_TEST(replicated_copies_across_nodes_that_differ) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group, .corrupt_key = "norm",
                        .corrupt_ranks = 1u << 2 | 1u << 3};
  struct world w;
  run_on(&sc, &w, 2);
  assert_refused(&w, &sc, SP_EDIFFERENT);
  ck_assert_msg(strstr(w.rep[0].message, "key 'norm' (replicated): rank 2's "
                                         "copy differs from rank 0's"),
                "%s", w.rep[0].message);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert(!w.moving[i]);
  trainer_free(&w, &sc);
  sc.corrupt_key = "bias";
  sc.corrupt_ranks = 1u << 3;
  run_on(&sc, &w, 2);
  assert_refused(&w, &sc, SP_EDIFFERENT);
  ck_assert_msg(strstr(w.rep[0].message, "key 'bias' (plain): rank 3's copy "
                                         "differs from rank 2's"),
                "%s", w.rep[0].message);
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
  next_job_is_served(2);
}
END_TEST

/* A daemon that planned differently (the test seam perturbs the digest it
 * reports): nothing moves, and every rank on both nodes hears one
 * plan_digest_mismatch naming both digests. */
START_TEST(different_plans_fail_everywhere) {
  static const char *const args[] = {"--peer-listen", "127.0.0.1:0", NULL};
  sp_test_daemon_stop(&daemons[1]);
  setenv("SHARDPORTD_TEST_DIGEST_XOR", "0x5a5a", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemons[1], args), 0);
  unsetenv("SHARDPORTD_TEST_DIGEST_XOR");
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .group = mixed_group};
  struct world w;
  run_on(&sc, &w, 2);
  assert_refused(&w, &sc, SP_EDIGEST);
  ck_assert_ptr_nonnull(strstr(w.rep[0].message, "node 0 "));
  ck_assert_ptr_nonnull(strstr(w.rep[0].message, "node 1 "));
  /* No rank ever saw data move. */
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert(!w.moving[i]);
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
}
END_TEST

/* ---- who may join ---- */

/* Finds the bytes of field name's bin16 value in a ticket (a msgpack map
 * with str keys): the key, then bin8 of 16 bytes. */
static uint8_t *ticket_field(sp_ticket *t, const char *name) {
  size_t len = strlen(name);
  for (size_t i = 0; i + 1 + len + 2 + 16 <= t->len; i++)
    if (t->bytes[i] == (0xa0 | len) &&
        memcmp(&t->bytes[i + 1], name, len) == 0 &&
        t->bytes[i + 1 + len] == 0xc4 && t->bytes[i + 2 + len] == 16)
      return &t->bytes[i + 3 + len];
  return NULL;
}

static void assert_join_refused(const sp_ticket *t) {
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemons[1].socket, &c), 0);
  int rc = sp_job_join(c, t, 1, 2, "cpu");
  ck_assert_msg(rc == SP_ETICKET, "join: %s: %s", sp_err_name(rc),
                sp_last_message(c));
  ck_assert_ptr_nonnull(strstr(sp_last_message(c), "refused"));
  sp_close(c);
}

START_TEST(wrong_secret_or_job_is_refused) {
  sp_client *root;
  sp_ticket good, t;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &root), 0);
  ck_assert_int_eq(sp_job_create(root, 2, &good), 0);
  ck_assert_int_eq(sp_job_join(root, &good, 0, 2, "cpu"), 0);
  /* The secret wrong by one byte, then the job id. */
  t = good;
  ticket_field(&t, "secret")[5] ^= 1;
  assert_join_refused(&t);
  t = good;
  ticket_field(&t, "job")[0] ^= 1;
  assert_join_refused(&t);
  /* Nothing of either is left on the refused daemon. */
  assert_idle(1);
  /* The real ticket still joins, and the job exports. */
  sp_client *other;
  ck_assert_int_eq(sp_connect(daemons[1].socket, &other), 0);
  ck_assert_int_eq(sp_job_join(other, &good, 1, 2, "cpu"), 0);
  sp_close(other);
  sp_close(root);
}
END_TEST

/* ---- faults ---- */

/* Enough rounds (four keys each) that a fault lands mid-export. */
static struct tkey slow_keys[48];
static char slow_names[48][8];

static struct scenario slow_scenario(uint32_t timeout_ms) {
  for (int i = 0; i < 48; i++) {
    snprintf(slow_names[i], sizeof slow_names[i], "m.%02d", i);
    slow_keys[i] = K(.name = slow_names[i], .kind = SHARD0,
                     .dtype = "float32", .es = 4, .ndim = 2,
                     .shape = {4, 64}, .parts = {1, 1, 1, 1});
  }
  return (struct scenario){.world = 4, .nkeys = 48, .keys = slow_keys,
                           .max_keys = 4, .timeout_ms = timeout_ms};
}

/* Every rank of the survivors failed with node_lost naming the node. */
static void assert_node_lost(struct world *w, uint32_t first, uint32_t last,
                             uint32_t node) {
  char name[32];
  snprintf(name, sizeof name, "node %u (", node);
  for (uint32_t i = first; i <= last; i++) {
    ck_assert_msg(w->rep[i].export_rc == SP_ENODELOST, "rank %u: %s: %s (%s)",
                  i, sp_err_name(w->rep[i].export_rc), w->rep[i].message,
                  w->rep[i].failure);
    ck_assert_msg(strstr(w->rep[i].message, name) != NULL,
                  "rank %u's message does not name %s: %s", i, name,
                  w->rep[i].message);
  }
  ck_assert_str_eq(w->rep[first].message, w->rep[last].message);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A daemon replaced by a fresh one, for the next job. */
static void restart_daemon(int i) {
  static const char *const args[] = {"--peer-listen", "127.0.0.1:0", NULL};
  sp_test_daemon_stop(&daemons[i]);
  ck_assert_int_eq(sp_test_daemon_start(&daemons[i], args), 0);
}

/* The daemon of ranks 2 and 3 is killed while data moves: ranks 0 and 1
 * fail with node_lost naming node 1; the root frees the export's memory
 * and serves the next job. */
START_TEST(daemon_killed_mid_round) {
  struct scenario sc = slow_scenario(10000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 0);
  kill_daemon(1, SIGKILL);
  double t0 = now_s();
  trainer_read_report(&w, &sc, 0);
  trainer_read_report(&w, &sc, 1);
  ck_assert_double_lt(now_s() - t0, 5.0);
  trainer_finish(&w, &sc);
  assert_node_lost(&w, 0, 1, 1);
  trainer_free(&w, &sc);
  assert_idle(0);
  restart_daemon(1);
  next_job_is_served(2);
}
END_TEST

/* The root itself is killed: the other node's ranks name node 0. */
START_TEST(root_killed_mid_round) {
  struct scenario sc = slow_scenario(10000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 2);
  kill_daemon(0, SIGKILL);
  trainer_read_report(&w, &sc, 2);
  trainer_read_report(&w, &sc, 3);
  trainer_finish(&w, &sc);
  assert_node_lost(&w, 2, 3, 0);
  trainer_free(&w, &sc);
  assert_idle(1);
  restart_daemon(0);
  next_job_is_served(2);
}
END_TEST

/* The job's one id, as the daemon at index i lists it. */
static void only_job(int i, char hex[33]) {
  sp_client *c;
  sp_job_list *list;
  ck_assert_int_eq(sp_connect(daemons[i].socket, &c), 0);
  ck_assert_int_eq(sp_jobs(c, &list), 0);
  ck_assert_uint_eq(list->njobs, 1);
  snprintf(hex, 33, "%s", list->jobs[0].job_id);
  sp_job_list_free(list);
  sp_close(c);
}

/* The root's operator aborts the job mid-round: every rank, on both nodes,
 * fails with aborted and the one message naming who (the other node's ranks
 * do not see it as the root's loss), and both daemons let the job go. */
START_TEST(root_abort_fails_every_node) {
  struct scenario sc = slow_scenario(10000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 2);
  char hex[33];
  only_job(0, hex);
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &c), 0);
  ck_assert_int_eq(sp_job_abort(c, hex, NULL, 0), 0);
  sp_close(c);
  trainer_finish(&w, &sc);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_EABORTED, "rank %u: %s: %s (%s)",
                  i, sp_err_name(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
    ck_assert_msg(strstr(w.rep[i].message, "aborted by uid") != NULL,
                  "rank %u: %s", i, w.rep[i].message);
    ck_assert_str_eq(w.rep[i].message, w.rep[0].message);
  }
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
  next_job_is_served(2);
}
END_TEST

/* The root daemon stops (SIGTERM) while a rank of the job waits on the
 * other node: that rank's connection ends with the root's daemon_restarted
 * and message, as the root's own ranks' do, not with the root's loss. */
START_TEST(root_stop_ends_every_node) {
  sp_client *r0, *r1;
  sp_ticket t;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &r0), 0);
  ck_assert_int_eq(sp_job_create(r0, 2, &t), 0);
  ck_assert_int_eq(sp_job_join(r0, &t, 0, 2, "cpu"), 0);
  ck_assert_int_eq(sp_connect(daemons[1].socket, &r1), 0);
  ck_assert_int_eq(sp_job_join(r1, &t, 1, 2, "cpu"), 0);
  ck_assert_int_eq(kill(daemons[0].pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait(daemons[0].pid, SP_TEST_TIMEOUT_MS), 0);
  daemons[0].pid = -1;
  ck_assert_int_eq(sp_ping(r0, NULL), SP_EDAEMONRESTARTED);
  /* The other node hears it at once; the ping may come first. */
  int rc = 0;
  for (int tries = 0; tries < 200 && rc == 0; tries++) {
    rc = sp_ping(r1, NULL);
    if (rc == 0)
      sleep_ms(25);
  }
  ck_assert_msg(rc == SP_EDAEMONRESTARTED, "%s: %s", sp_err_name(rc),
                sp_last_message(r1));
  ck_assert_ptr_nonnull(strstr(sp_last_message(r1), "stopped (SIGTERM)"));
  sp_close(r0);
  sp_close(r1);
  assert_idle(1);
}
END_TEST

/* A daemon that stops reading (SIGSTOP) fails the export on the other
 * node within the export's timeout (2 s here), naming it; once it runs
 * again it is the one that was lost. */
START_TEST(daemon_stopped_mid_round) {
  struct scenario sc = slow_scenario(2000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 0);
  kill_daemon(1, SIGSTOP);
  double t0 = now_s();
  trainer_read_report(&w, &sc, 0);
  trainer_read_report(&w, &sc, 1);
  double waited = now_s() - t0;
  kill_daemon(1, SIGCONT);
  trainer_finish(&w, &sc);
  assert_node_lost(&w, 0, 1, 1);
  /* The timeout, plus a tick and a round's pause, not much more. */
  ck_assert_double_lt(waited, 8.0);
  trainer_free(&w, &sc);
  assert_idle(0);
  assert_idle(1);
  next_job_is_served(2);
}
END_TEST

/* A slow peer is not a lost one: rounds pause 150 ms each (about 2 s in
 * all, past the 1.2 s timeout) and a daemon stops for half the timeout,
 * and the export still completes, because bytes keep moving. */
START_TEST(slow_peer_is_not_lost) {
  struct scenario sc = slow_scenario(1200);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 2);
  kill_daemon(1, SIGSTOP);
  sleep_ms(600);
  kill_daemon(1, SIGCONT);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].max_rounds, 10);
  trainer_free(&w, &sc);
}
END_TEST

/* Rank 3, on the second node, dies while the others wait for it: every
 * other rank, on both nodes, hears rank_lost naming it. */
START_TEST(rank_lost_on_another_node) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .fault = KILL_WAITING,
                        .victim = 3};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  for (uint32_t i = 0; i < sc.world; i++)
    trainer_expect_progress(&w, i);
  ck_assert_int_eq(kill(w.pid[3], SIGKILL), 0);
  for (uint32_t i = 0; i < 3; i++)
    trainer_read_report(&w, &sc, i);
  trainer_finish(&w, &sc);
  for (uint32_t i = 0; i < 3; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST, "rank %u: %s: %s", i,
                  sp_err_name(w.rep[i].export_rc), w.rep[i].message);
    ck_assert_ptr_nonnull(strstr(w.rep[i].message, "rank 3"));
    ck_assert_str_eq(w.rep[i].message, w.rep[0].message);
  }
  trainer_free(&w, &sc);
  next_job_is_served(2);
}
END_TEST

/* Rank 3, on the second node, dies while the others wait: each daemon
 * logs the failed export once, at warn (the root used to log it twice, at
 * info and at warn). */
START_TEST(gather_failure_logged_once) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .fault = KILL_WAITING,
                        .victim = 3};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  for (uint32_t i = 0; i < sc.world; i++)
    trainer_expect_progress(&w, i);
  ck_assert_int_eq(kill(w.pid[3], SIGKILL), 0);
  for (uint32_t i = 0; i < 3; i++)
    trainer_read_report(&w, &sc, i);
  trainer_finish(&w, &sc);
  for (uint32_t i = 0; i < 3; i++)
    ck_assert_int_eq(w.rep[i].export_rc, SP_ERANKLOST);
  trainer_free(&w, &sc);
  for (int d = 0; d < 2; d++) {
    char line[4096] = "";
    int n = log_count(d, "export failed before it started", line, sizeof line);
    ck_assert_msg(n == 1, "daemon %d logged the failure %d times", d, n);
    ck_assert_msg(strstr(line, "shardportd: warn: ") != NULL, "daemon %d: %s",
                  d, line);
  }
}
END_TEST

/* ---- ranks that left before the others asked ---- */

/* Every rank but the victim failed its last export with rank_lost, one
 * message on both nodes, holding each of `says`. */
static void assert_lost_everywhere(const struct world *w,
                                   const struct scenario *sc,
                                   const char *const *says) {
  uint32_t first = sc->victim == 0 ? 1 : 0;
  for (uint32_t i = 0; i < sc->world; i++) {
    if (i == sc->victim)
      continue;
    ck_assert_msg(w->rep[i].export_rc == SP_ERANKLOST, "rank %u: %s: %s (%s)",
                  i, sp_err_name(w->rep[i].export_rc), w->rep[i].message,
                  w->rep[i].failure);
    for (const char *const *p = says; *p != NULL; p++)
      ck_assert_msg(strstr(w->rep[i].message, *p) != NULL,
                    "rank %u: \"%s\" does not say \"%s\"", i,
                    w->rep[i].message, *p);
    ck_assert_str_eq(w->rep[i].message, w->rep[first].message);
  }
}

/* The victim (on node victim_node) is gone and its daemon has seen it go
 * and told the root; then the others, at the gate, ask.  Their export's
 * timeout (30 s) is longer than the test waits for them
 * (TRAINER_WAIT_MS): only an answer at once passes. */
static void others_ask_after_the_victim_left(struct world *w,
                                             const struct scenario *sc,
                                             int victim_node) {
  trainer_read_report(w, sc, sc->victim);
  trainer_wait_gate(w, sc, sc->victim);
  trainer_wait_joined(daemons[victim_node].socket, 1);
  /* Its daemon sends the root `left` on its next wake-up. */
  sleep_ms(200);
  trainer_open_gate(w, sc, sc->victim);
  trainer_finish(w, sc);
}

/* Rank 3's registration is refused on the second node and it gives up
 * before the others ask: every other rank, on both nodes, hears rank_lost
 * at once with why, from the daemon that refused it. */
START_TEST(refused_rank_gone_on_another_node) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys,
                        .tweak = trainer_victim_out_of_bounds, .victim = 3,
                        .gate = true, .timeout_ms = 30000};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  others_ask_after_the_victim_left(&w, &sc, 1);
  static const char *const says[] = {
      "rank 3 disconnected from job ",
      "; rank 3's registration was refused: view_out_of_bounds: tensor_add: ",
      NULL};
  assert_lost_everywhere(&w, &sc, says);
  trainer_free(&w, &sc);
  next_job_is_served(2);
}
END_TEST

/* After the first export, rank 2 (second node) leaves: the others' second
 * export fails at once on both nodes, naming it. */
START_TEST(rank_left_between_exports_on_another_node) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .exports = 2,
                        .fault = LEAVE_AFTER_FIRST, .victim = 2, .gate = true,
                        .timeout_ms = 30000};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  others_ask_after_the_victim_left(&w, &sc, 1);
  ck_assert_int_eq(w.rep[2].export_rc, 0);
  static const char *const says[] = {"rank 2 left job ", NULL};
  assert_lost_everywhere(&w, &sc, says);
  trainer_free(&w, &sc);
  next_job_is_served(2);
}
END_TEST

/* Between exports the second daemon dies, and its ranks with it: the
 * first node's ranks' next export fails at once, naming a rank of the lost
 * node and the node. */
START_TEST(node_gone_between_exports) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .exports = 2, .gate = true,
                        .timeout_ms = 30000};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_gate(&w, &sc, UINT32_MAX);
  kill_daemon(1, SIGKILL);
  /* The root has seen the node go: the job lists one node. */
  size_t nodes = 2;
  for (int tries = 0; tries < 2000 && nodes != 1; tries++) {
    sp_status_info *st = status_of(0);
    ck_assert_uint_eq(st->njobs, 1);
    nodes = st->jobs[0].nnodes;
    sp_status_free(st);
    if (nodes != 1)
      sleep_ms(10);
  }
  ck_assert_uint_eq(nodes, 1);
  trainer_open_gate(&w, &sc, UINT32_MAX);
  trainer_finish(&w, &sc);
  for (uint32_t i = 0; i < 2; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST, "rank %u: %s: %s (%s)",
                  i, sp_err_name(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
    ck_assert_ptr_nonnull(strstr(w.rep[i].message, "rank 2 disconnected"));
    ck_assert_ptr_nonnull(strstr(w.rep[i].message, "; node 1 ("));
  }
  ck_assert_str_eq(w.rep[0].message, w.rep[1].message);
  trainer_free(&w, &sc);
  assert_idle(0);
}
END_TEST

/* A rank that left and joined again on its node is part of the next
 * export: nobody fails for its earlier departure. */
START_TEST(rank_back_between_exports_on_another_node) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .exports = 2,
                        .fault = REJOIN_AFTER_FIRST, .victim = 3,
                        .gate = true};
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_gate(&w, &sc, UINT32_MAX);
  trainer_open_gate(&w, &sc, UINT32_MAX);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}
END_TEST

/* Rank 3 leaves the second node after the first export and comes back on
 * the first; then rank 2, on the second node, dies after asking, while the
 * root is stopped: the root announces the export with rank 2 on the second
 * node, which finds it gone when it starts.  The export fails at once
 * naming rank 2: the second node forgot rank 3's departure when the root
 * placed rank 3 elsewhere, and names no rank that is back. */
/* Waits until daemon i counts `asked` of its ranks waiting for the next
 * export (each one's ask is then on its way to the root). */
static void wait_asked(int i, uint32_t asked) {
  uint32_t now = UINT32_MAX;
  for (int tries = 0; tries < TRAINER_WAIT_MS / 10 && now != asked; tries++) {
    sp_status_info *st = status_of(i);
    ck_assert_uint_eq(st->njobs, 1);
    now = st->jobs[0].asked;
    sp_status_free(st);
    if (now != asked)
      sleep_ms(10);
  }
  ck_assert_msg(now == asked, "daemon %d counts %u ranks asking, not %u", i,
                now, asked);
}

START_TEST(rank_gone_after_another_came_back_elsewhere) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .exports = 2,
                        .fault = REJOIN_ELSEWHERE_AFTER_FIRST, .victim = 3,
                        .rejoin_socket = daemons[0].socket, .gate = true,
                        .timeout_ms = 30000};
  const char *const sockets[] = {daemons[0].socket, daemons[1].socket,
                                 daemons[1].socket, daemons[1].socket};
  struct world w;
  trainer_start(&w, &sc, sockets);
  /* Rank 3 is back, on the first node, with every rank at the gate. */
  trainer_wait_gate(&w, &sc, UINT32_MAX);
  trainer_wait_joined(daemons[0].socket, 2);
  trainer_wait_joined(daemons[1].socket, 2);
  trainer_open_gate(&w, &sc, 2);
  wait_asked(0, 2);
  wait_asked(1, 1);
  kill_daemon(0, SIGSTOP);
  ck_assert_int_eq(write(w.in[2], "g", 1), 1);
  /* Its daemon sends the root rank 2's ask, then sees it go. */
  wait_asked(1, 2);
  ck_assert_int_eq(kill(w.pid[2], SIGKILL), 0);
  sp_test_wait(w.pid[2], TRAINER_WAIT_MS);
  w.pid[2] = -1;
  trainer_wait_joined(daemons[1].socket, 1);
  kill_daemon(0, SIGCONT);
  trainer_finish(&w, &sc);
  static const uint32_t others[] = {0, 1, 3};
  for (size_t i = 0; i < 3; i++) {
    const struct report *rep = &w.rep[others[i]];
    ck_assert_msg(rep->export_rc == SP_ERANKLOST, "rank %u: %s: %s (%s)",
                  others[i], sp_err_name(rep->export_rc), rep->message,
                  rep->failure);
    ck_assert_msg(strstr(rep->message, "rank 2 disconnected from job ") !=
                      NULL,
                  "rank %u: \"%s\" does not name rank 2", others[i],
                  rep->message);
    ck_assert_str_eq(rep->message, w.rep[0].message);
  }
  trainer_free(&w, &sc);
  next_job_is_served(2);
}
END_TEST

/* ---- streams and overlapping rounds ---- */

/* 24 keys of 512 rows of 4 KiB (2 MiB each), four to a round: six rounds.
 * The planner deals them to ranks 0, 1, 2, 3 in turn (equal sizes, by
 * name).  Spread evenly, half of every key crosses nodes, 1 MiB a key, in
 * stripes over every stream; local-heavy, a key's rows lie on its owner's
 * node but for one row from each rank of the other node, so that each
 * round's local copies (4 MiB a node) outlast its exchange (16 KiB each
 * way) by far. */
static struct tkey wide_keys[24];
static char wide_names[24][8];

static struct scenario wide_scenario(bool local_heavy, uint32_t timeout_ms) {
  for (int i = 0; i < 24; i++) {
    snprintf(wide_names[i], sizeof wide_names[i], "w.%02d", i);
    bool on_first = i % 4 < 2;
    wide_keys[i] = K(.name = wide_names[i], .kind = SHARD0,
                     .dtype = "float32", .es = 4, .ndim = 2,
                     .shape = {512, 1024}, .parts = {128, 128, 128, 128});
    if (local_heavy)
      for (int r = 0; r < 4; r++)
        wide_keys[i].parts[r] = (r < 2) == on_first ? 255 : 1;
  }
  return (struct scenario){.world = 4, .nkeys = 24, .keys = wide_keys,
                           .max_keys = 4, .timeout_ms = timeout_ms};
}

/* Waits up to 10 s for a line of daemon i's log holding words, into
 * line. */
static void wait_log(int i, const char *words, char *line, size_t len) {
  for (int tries = 0; tries < 400; tries++) {
    if (log_count(i, words, line, len) > 0)
      return;
    sleep_ms(25);
  }
  ck_assert_msg(0, "daemon %d never logged \"%s\"", i, words);
}

static const char overlap_words[] =
    "round(s) sent the next round's first bytes before their own last local "
    "copy ended";

/* The rounds of daemon i's last export, and how many of them sent the
 * next round's first bytes before their own last local copy ended. */
static void overlapped(int i, uint32_t *rounds, uint32_t *overlaps) {
  char line[4096];
  wait_log(i, overlap_words, line, sizeof line);
  const char *at = strstr(line, ": export ");
  ck_assert_ptr_nonnull(at);
  unsigned long long id;
  ck_assert_int_eq(sscanf(at, ": export %llu: %u of %u round(s)", &id,
                          overlaps, rounds),
                   3);
}

/* Each pair of nodes moves over three connections: every byte arrives, in
 * order, over stripes dealt to all three, for two exports in a row (the
 * second on the streams the first opened). */
START_TEST(three_streams_carry_every_byte) {
  struct scenario sc = wide_scenario(false, 0);
  sc.exports = 2;
  struct world w;
  run_on(&sc, &w, 2);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_msg(w.rep[i].export_rc == 0, "rank %u: %s: %s (%s)", i,
                  sp_err_name(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
  trainer_free(&w, &sc);
  /* Node 1 dials the root's node three times, once a stream, and the
   * root hears each; the second export finds them up. */
  char line[4096], words[64];
  for (int k = 1; k <= 3; k++) {
    snprintf(words, sizeof words, "up (stream %d of 3, ", k);
    ck_assert_int_eq(log_count(1, words, line, sizeof line), 1);
    ck_assert_ptr_nonnull(strstr(line, "data link to node 0"));
    ck_assert_int_eq(log_count(0, words, line, sizeof line), 1);
    ck_assert_ptr_nonnull(strstr(line, "data link from node 1"));
  }
}
END_TEST

/* A daemon killed while three streams carry its pair's bytes: the other
 * node's ranks fail with node_lost naming it, within seconds, and the
 * root serves the next job. */
START_TEST(three_streams_daemon_killed_mid_round) {
  struct scenario sc = wide_scenario(false, 10000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 0);
  kill_daemon(1, SIGKILL);
  double t0 = now_s();
  trainer_read_report(&w, &sc, 0);
  trainer_read_report(&w, &sc, 1);
  ck_assert_double_lt(now_s() - t0, 5.0);
  trainer_finish(&w, &sc);
  assert_node_lost(&w, 0, 1, 1);
  trainer_free(&w, &sc);
  assert_idle(0);
}
END_TEST

/* Inside each daemon the rounds overlap: the next round's first bytes
 * leave while the current round's local copies still run, in most of the
 * six rounds of an export (the last has no next). */
START_TEST(rounds_overlap_inside_each_daemon) {
  struct scenario sc = wide_scenario(true, 0);
  struct world w;
  run_on(&sc, &w, 2);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_msg(w.rep[i].export_rc == 0, "rank %u: %s: %s (%s)", i,
                  sp_err_name(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
  trainer_free(&w, &sc);
  for (int d = 0; d < 2; d++) {
    uint32_t rounds, overlaps;
    overlapped(d, &rounds, &overlaps);
    ck_assert_uint_eq(rounds, 6);
    ck_assert_msg(overlaps >= 1 && overlaps <= 5,
                  "daemon %d: %u of %u rounds overlapped", d, overlaps,
                  rounds);
  }
}
END_TEST

/* The rounds overlap until a fault: the node that outlives its peer,
 * killed between rounds, counts overlapping rounds before it, and its
 * ranks fail naming the lost node. */
START_TEST(rounds_overlap_until_a_fault) {
  struct scenario sc = wide_scenario(true, 10000);
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 0);
  /* Rounds pause 150 ms each: three of the six are done. */
  sleep_ms(450);
  kill_daemon(1, SIGKILL);
  trainer_read_report(&w, &sc, 0);
  trainer_read_report(&w, &sc, 1);
  trainer_finish(&w, &sc);
  assert_node_lost(&w, 0, 1, 1);
  trainer_free(&w, &sc);
  uint32_t rounds, overlaps;
  overlapped(0, &rounds, &overlaps);
  ck_assert_uint_eq(rounds, 6);
  ck_assert_msg(overlaps >= 1 && overlaps < 5,
                "%u of %u rounds overlapped before the fault", overlaps,
                rounds);
  assert_idle(0);
}
END_TEST

/* ---- one stream of several lost ---- */

/* The descriptor of daemon i's TCP socket whose own end is 127.0.0.1:port
 * (from /proc/net/tcp and the daemon's /proc/PID/fd), or -1. */
static int fd_of_port(int i, unsigned port) {
  unsigned long inode = 0;
  FILE *f = fopen("/proc/net/tcp", "re");
  ck_assert_ptr_nonnull(f);
  char line[512];
  while (inode == 0 && fgets(line, sizeof line, f) != NULL) {
    unsigned addr, lport;
    unsigned long ino;
    if (sscanf(line, " %*d: %x:%x %*s %*s %*s %*s %*s %*s %*s %lu", &addr,
               &lport, &ino) == 3 &&
        lport == port && addr == 0x0100007f)
      inode = ino;
  }
  fclose(f);
  ck_assert_msg(inode != 0, "no socket at 127.0.0.1:%u", port);
  char dir[64], want[64];
  snprintf(dir, sizeof dir, "/proc/%d/fd", (int)daemons[i].pid);
  snprintf(want, sizeof want, "socket:[%lu]", inode);
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int fd = -1;
  struct dirent *e;
  while (fd < 0 && (e = readdir(d)) != NULL) {
    char path[320], target[64];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n > 0) {
      target[n] = '\0';
      if (strcmp(target, want) == 0)
        fd = atoi(e->d_name);
    }
  }
  closedir(d);
  return fd;
}

/* Cuts one connection daemon i holds, as a broken cable would, without
 * touching the daemon otherwise: a copy of its descriptor (pidfd_getfd)
 * is shut down both ways, which shuts the socket itself. */
static void cut_socket(int i, int fd) {
  int pidfd = (int)syscall(SYS_pidfd_open, daemons[i].pid, 0);
  ck_assert_int_ge(pidfd, 0);
  int copy = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  ck_assert_msg(copy >= 0, "pidfd_getfd: %s", strerror(errno));
  ck_assert_int_eq(shutdown(copy, SHUT_RDWR), 0);
  close(copy);
  close(pidfd);
}

/* Of three streams between the nodes, the second is cut mid-export: every
 * rank of both nodes fails with node_lost within seconds (the streams
 * still up halted with it, nobody waits for the export's timeout), and
 * the job's next export, on the same daemons, dials the link again and
 * moves every byte. */
START_TEST(one_stream_of_three_lost_mid_export) {
  struct scenario sc = wide_scenario(false, 10000);
  sc.exports = 2;
  sc.on_after_failure = true;
  struct world w;
  trainer_start(&w, &sc, spread(4, 2));
  trainer_wait_moving(&w, 0);
  char line[4096];
  wait_log(1, "up (stream 2 of 3, from ", line, sizeof line);
  const char *at = strstr(line, "up (stream 2 of 3, from ");
  unsigned port;
  ck_assert_int_eq(sscanf(at, "up (stream 2 of 3, from 127.0.0.1:%u)", &port),
                   1);
  cut_socket(1, fd_of_port(1, port));
  double t0 = now_s();
  for (uint32_t i = 0; i < sc.world; i++)
    trainer_read_report(&w, &sc, i);
  ck_assert_double_lt(now_s() - t0, 8.0);
  trainer_finish(&w, &sc);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].first_rc == SP_ENODELOST, "rank %u: %s: %s", i,
                  sp_err_name(w.rep[i].first_rc), w.rep[i].first_message);
    ck_assert_msg(w.rep[i].export_rc == 0, "rank %u, next export: %s: %s (%s)",
                  i, sp_err_name(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
    ck_assert_msg(w.rep[i].failure[0] == '\0', "rank %u: %s", i,
                  w.rep[i].failure);
  }
  trainer_free(&w, &sc);
  /* Node 1 dialled the cut stream again for the next export. */
  ck_assert_int_ge(log_count(1, "up (stream 2 of 3, ", line, sizeof line), 2);
  assert_idle(0);
  assert_idle(1);
}
END_TEST

int main(int argc, char **argv) {
  Suite *s = suite_create("nodes");
  TCase *exp = tcase_create("export");
  tcase_add_checked_fixture(exp, start2, stop_all);
  tcase_set_timeout(exp, 90);
  tcase_add_test(exp, two_nodes_export_as_one_does);
  tcase_add_test(exp, more_than_4096_keys_across_nodes);
  tcase_add_test(exp, digests_agree_and_status_shows_nodes);
  tcase_add_loop_test(exp, refusal_reaches_every_node_alike, 0,
                      sizeof refusals / sizeof refusals[0]);
  tcase_add_test(exp, tensor_parallel_replicas_across_nodes);
  tcase_add_test(exp, replicas_across_nodes_that_differ);
  tcase_add_test(exp, replicated_copies_across_nodes_that_differ);
  tcase_add_test(exp, different_plans_fail_everywhere);
  suite_add_tcase(s, exp);
  TCase *three = tcase_create("three");
  tcase_add_checked_fixture(three, start3, stop_all);
  tcase_set_timeout(three, 60);
  tcase_add_test(three, three_nodes_export);
  tcase_add_test(three, root_without_ranks);
  suite_add_tcase(s, three);
  TCase *join = tcase_create("join");
  tcase_add_checked_fixture(join, start2, stop_all);
  tcase_set_timeout(join, 60);
  tcase_add_test(join, wrong_secret_or_job_is_refused);
  tcase_add_test(join, root_stop_ends_every_node);
  suite_add_tcase(s, join);
  TCase *faults = tcase_create("faults");
  tcase_add_checked_fixture(faults, start2_slow, stop_all);
  tcase_set_timeout(faults, 60);
  tcase_add_test(faults, daemon_killed_mid_round);
  tcase_add_test(faults, root_killed_mid_round);
  tcase_add_test(faults, root_abort_fails_every_node);
  tcase_add_test(faults, daemon_stopped_mid_round);
  tcase_add_test(faults, slow_peer_is_not_lost);
  tcase_add_test(faults, rank_lost_on_another_node);
  suite_add_tcase(s, faults);
  TCase *logged = tcase_create("logs");
  tcase_add_checked_fixture(logged, start2_logged, stop_all);
  tcase_set_timeout(logged, 60);
  tcase_add_test(logged, gather_failure_logged_once);
  suite_add_tcase(s, logged);
  TCase *streams = tcase_create("streams");
  tcase_add_checked_fixture(streams, start2_three_streams, stop_all);
  tcase_set_timeout(streams, 60);
  tcase_add_test(streams, three_streams_carry_every_byte);
  suite_add_tcase(s, streams);
  TCase *streams_fault = tcase_create("streams-fault");
  tcase_add_checked_fixture(streams_fault, start2_three_streams_slow,
                            stop_all);
  tcase_set_timeout(streams_fault, 60);
  tcase_add_test(streams_fault, three_streams_daemon_killed_mid_round);
  tcase_add_test(streams_fault, one_stream_of_three_lost_mid_export);
  suite_add_tcase(s, streams_fault);
  TCase *overlap = tcase_create("overlap");
  tcase_add_checked_fixture(overlap, start2_debug, stop_all);
  tcase_set_timeout(overlap, 60);
  tcase_add_test(overlap, rounds_overlap_inside_each_daemon);
  suite_add_tcase(s, overlap);
  TCase *overlap_fault = tcase_create("overlap-fault");
  tcase_add_checked_fixture(overlap_fault, start2_debug_slow, stop_all);
  tcase_set_timeout(overlap_fault, 60);
  tcase_add_test(overlap_fault, rounds_overlap_until_a_fault);
  suite_add_tcase(s, overlap_fault);
  TCase *gone = tcase_create("departures");
  tcase_add_checked_fixture(gone, start2, stop_all);
  tcase_set_timeout(gone, 60);
  tcase_add_test(gone, refused_rank_gone_on_another_node);
  tcase_add_test(gone, rank_left_between_exports_on_another_node);
  tcase_add_test(gone, rank_back_between_exports_on_another_node);
  tcase_add_test(gone, rank_gone_after_another_came_back_elsewhere);
  tcase_add_test(gone, node_gone_between_exports);
  suite_add_tcase(s, gone);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
