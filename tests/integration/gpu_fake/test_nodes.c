/*
 * test_nodes.c - two daemons as two fake nodes, NCCL between them: a mixed
 * model, communicators made as the ranks join, a rank or a daemon killed
 * mid-round, and a new generation of communicators after a failure.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/world.h"

START_TEST(two_nodes_mixed_model) {
  /* Ranks 0, 1 on node 0, ranks 2, 3 on node 1, each on its node's GPU 0
   * or 1; moves between the nodes go through the job's communicators, made
   * by the first export and kept for the second. */
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .exports = 2,
                        .max_keys = 4,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_communicators_made_at_join) {
  /* The ranks join and register, then wait at a gate: before any export,
   * each daemon's communicators (one per local rank, started as the rank
   * joined) finish their set-up, which the fake NCCL completes only once
   * all 4 ranks of both nodes joined; the first export then warms those
   * and moves the data through them. */
  char gate[64];
  snprintf(gate, sizeof gate, "/tmp/sp-gpu-gate-%d", (int)getpid());
  unlink(gate);
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .exports = 2,
                        .max_keys = 4,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW},
                        .gate = gate};
  struct world w;
  world_start(&w, &sc);
  bool ready = false;
  for (int i = 0; i < 1000 && !ready; i++) {
    ready = world_log_count(0, "communicators ready") == 1 &&
            world_log_count(1, "communicators ready") == 1;
    if (!ready)
      usleep(10000);
  }
  int joined =
      world_log_count(0, " joined (") + world_log_count(1, " joined (");
  int started = world_log_count(0, " started") + world_log_count(1, " started");
  int fd = open(gate, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ck_assert_int_ge(fd, 0);
  close(fd);
  world_finish(&sc, &w);
  unlink(gate);
  ck_assert_msg(ready, "the daemons did not log \"communicators ready\" "
                       "before the first export");
  /* All 4 ranks had joined (each logged by its own node's daemon); no
   * export had started. */
  ck_assert_int_eq(joined, 4);
  ck_assert_int_eq(started, 0);
  world_assert_exported(&w, &sc);
  /* The first export warmed the communicators made at the join and made
   * none of its own. */
  for (int n = 0; n < 2; n++) {
    ck_assert_int_eq(world_log_count(n, "made as the ranks joined, warmed"), 1);
    ck_assert_int_eq(world_log_count(n, "NCCL communicator(s) of 4 ranks made"),
                     0);
  }
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_rank_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32", .es = 4,
                .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = N,
                        .keys = keys,
                        .gpus = 2,
                        .max_keys = 4,
                        .fault = KILL_MOVING,
                        .victim = 3,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  world_run(&sc, &w);
  /* Every survivor, on both nodes, fails; none hangs or publishes. */
  for (uint32_t i = 0; i < sc.world; i++) {
    if (i == sc.victim)
      continue;
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST ||
                      w.rep[i].export_rc == SP_ENODELOST,
                  "rank %u: %s: %s (%s)", i, sp_strerror(w.rep[i].export_rc),
                  w.rep[i].message, w.rep[i].failure);
  }
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_daemon_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32", .es = 4,
                .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = N,
                        .keys = keys,
                        .gpus = 2,
                        .max_keys = 4,
                        .fault = KILL_NODE,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  world_run(&sc, &w);
  /* Node 0's ranks learn that node 1 was lost (its communicators aborted,
   * or its control link closed); node 1's lost their daemon. */
  for (uint32_t i = 0; i < 2; i++)
    ck_assert_msg(w.rep[i].export_rc == SP_ENODELOST, "rank %u: %s: %s (%s)", i,
                  sp_strerror(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
  for (uint32_t i = 2; i < 4; i++)
    ck_assert_msg(w.rep[i].export_rc < 0, "rank %u exported", i);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_export_again_after_a_failure) {
  /* Ranks 0, 1 on node 0 and 2, 3 on node 1.  Node 1's NCCL fails a launch
   * mid-round in the first export: every local communicator there is
   * aborted and the export fails on every rank with one error.  The same
   * job, its ranks still joined, exports again: the root sends a fresh
   * NCCL id with the plan, every node replaces its aborted communicators
   * with a new generation, and both later exports (the second on the new
   * generation's communicators, kept) are verified byte for byte. */
  enum { N = 24 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32", .es = 4,
                .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = N,
                        .keys = keys,
                        .gpus = 2,
                        .max_keys = 4,
                        .exports = 3,
                        .fail_first = true,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  /* The first export fails on every rank, none hangs or publishes, with
   * the launch's error (backend) or node_lost: which a node sees first,
   * its own communicators' error or its peer's abort, depends on timing
   * (under valgrind node 1 too may hear node 0's abort first); one error
   * per node. */
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].first_rc == SP_EBACKEND ||
                      w.rep[i].first_rc == SP_ENODELOST,
                  "rank %u: the first export: %s: %s (%s)", i,
                  sp_strerror(w.rep[i].first_rc), w.rep[i].first_message,
                  w.rep[i].failure);
    uint32_t peer = i ^ 1u; /* the other rank of its node */
    ck_assert_msg(
        w.rep[i].first_rc == w.rep[peer].first_rc &&
            strcmp(w.rep[i].first_message, w.rep[peer].first_message) == 0,
        "rank %u: %s: %s, rank %u: %s: %s", i, sp_strerror(w.rep[i].first_rc),
        w.rep[i].first_message, peer, sp_strerror(w.rep[peer].first_rc),
        w.rep[peer].first_message);
  }
  ck_assert_msg(strstr(w.rep[2].first_message, "NCCL error") != NULL,
                "rank 2: %s", w.rep[2].first_message);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

void test_nodes_add(const struct gpu_cases *c) {
  tcase_add_test(c->nodes, two_nodes_mixed_model);
  tcase_add_test(c->nodes_join, two_nodes_communicators_made_at_join);
  tcase_add_test(c->nodes_faults, two_nodes_rank_killed_mid_round);
  tcase_add_test(c->nodes_faults, two_nodes_daemon_killed_mid_round);
  tcase_add_test(c->nodes_again, two_nodes_export_again_after_a_failure);
}
