/*
 * test_gpu_comm.c - NCCL between nodes on the fakes: several gpunode
 * processes, each a "node" (SHARDPORT_FAKE_NODE) with two fake GPUs and
 * one communicator per GPU, run the CUDA backend's rounds (local copies
 * plus one NCCL group of sends and receives per round) and check what
 * their ranks own byte for byte; then the faults: a node that dies
 * mid-round, one whose launch errors, one that hangs, one that never joins
 * - every survivor fails with an error within its timeout, none hangs.
 *
 * This process makes the NCCL unique id (the fake's ncclGetUniqueId) and
 * starts the nodes with posix_spawn (no fork after CUDA initialisation).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cuda/api.h"
#include "tests/unit/fakes/child.h"

#define MAX_NODES 4

static struct cuda_api api;
static char id_hex[2 * sizeof(ncclUniqueId) + 1];
/* "GPUNODE_ID2=" and a second id: a second job of the same ranks. */
static char id2_env[sizeof "GPUNODE_ID2=" + 2 * sizeof(ncclUniqueId)];

static void setup(void) {
  char why[512];
  ck_assert_msg(cuda_api_load(&api, why, sizeof why) == 0, "%s", why);
  ncclUniqueId id;
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  hex_encode(&id, sizeof id, id_hex);
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  strcpy(id2_env, "GPUNODE_ID2=");
  hex_encode(&id, sizeof id, id2_env + strlen(id2_env));
}

static void teardown(void) { cuda_api_unload(&api); }

struct node_run {
  int status;
  char out[8192];
};

/* Adds the space-separated assignments of list (or nothing for NULL) to
 * env, copied into buf, up to max entries in all. */
static size_t add_env(char **env, size_t n, size_t max, const char *list,
                      char *buf, size_t buflen) {
  if (list == NULL)
    return n;
  snprintf(buf, buflen, "%s", list);
  for (char *save = NULL, *t = strtok_r(buf, " ", &save); t != NULL && n < max;
       t = strtok_r(NULL, " ", &save))
    env[n++] = t;
  return n;
}

/* Runs nodes gpunode processes to the end; fault_env (or NULL) is added
 * to node fault_node's environment, every_env (or NULL) to every node's,
 * each a space-separated list of assignments. */
static void run_nodes_with(int nodes, const char *exports,
                           const char *timeout_ms, int fault_node,
                           const char *fault_env, const char *every_env,
                           struct node_run *runs, int started) {
  struct child ch[MAX_NODES];
  char n[8], node_arg[MAX_NODES][12], node_env[MAX_NODES][32], tmo[64];
  char every_buf[MAX_NODES][1024], fault_buf[1024];
  snprintf(n, sizeof n, "%d", nodes);
  snprintf(tmo, sizeof tmo, "GPUNODE_TIMEOUT_MS=%s", timeout_ms);
  for (int i = 0; i < started; i++) {
    snprintf(node_arg[i], sizeof node_arg[i], "%d", i);
    snprintf(node_env[i], sizeof node_env[i], "SHARDPORT_FAKE_NODE=%d", i);
    char *argv[] = {getenv("GPUNODE"), id_hex, n, node_arg[i],
                    (char *)exports, NULL};
    char *env[16] = {node_env[i], tmo, "SHARDPORT_FAKE_GPUS=2"};
    size_t k = add_env(env, 3, 15, every_env, every_buf[i], sizeof every_buf[i]);
    if (i == fault_node)
      add_env(env, k, 15, fault_env, fault_buf, sizeof fault_buf);
    ck_assert_int_eq(child_start(&ch[i], argv, env, -1), 0);
  }
  for (int i = 0; i < started; i++) {
    runs[i].out[0] = '\0';
    runs[i].status = child_finish(&ch[i], 60000, runs[i].out,
                                  sizeof runs[i].out);
  }
}

static void run_nodes(int nodes, const char *exports, const char *timeout_ms,
                      int fault_node, const char *fault_env,
                      struct node_run *runs, int started) {
  run_nodes_with(nodes, exports, timeout_ms, fault_node, fault_env, NULL, runs,
                 started);
}

/* Lines of s that begin with what. */
static int count_lines(const char *s, const char *what) {
  int n = 0;
  size_t len = strlen(what);
  for (const char *p = s; p != NULL && *p; p = strchr(p, '\n'), p = p ? p + 1 : p)
    n += strncmp(p, what, len) == 0;
  return n;
}

START_TEST(two_nodes_two_exports) {
  struct node_run runs[2];
  run_nodes(2, "2", "10000", -1, NULL, runs, 2);
  size_t keys = 0;
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(runs[i].status == 0, "node %d: %d: %s", i, runs[i].status,
                  runs[i].out);
    ck_assert_msg(strstr(runs[i].out, "ready") && strstr(runs[i].out, "ok 2 "),
                  "node %d: %s", i, runs[i].out);
    unsigned x, k;
    const char *ok = strstr(runs[i].out, "ok 1 ");
    ck_assert_ptr_nonnull(ok);
    ck_assert_int_eq(sscanf(ok, "ok %u %u", &x, &k), 2);
    keys += k;
  }
  /* Every key that moves has its owner on one of the two nodes, and was
   * checked there (7 keys; a key whose owner already holds it whole is not
   * moved). */
  ck_assert_uint_ge(keys, 5);
}
END_TEST

START_TEST(three_nodes) {
  struct node_run runs[3];
  run_nodes(3, "1", "10000", -1, NULL, runs, 3);
  for (int i = 0; i < 3; i++)
    ck_assert_msg(runs[i].status == 0 && strstr(runs[i].out, "ok 1 "),
                  "node %d: %d: %s", i, runs[i].status, runs[i].out);
}
END_TEST

/* Every node but the faulty one ends with an error from the backend (exit
 * 2), within its timeout, and none reports a wrong byte. */
static void assert_survivors_fail(struct node_run *runs, int nodes, int faulty,
                                  const char *why) {
  for (int i = 0; i < nodes; i++) {
    if (i == faulty)
      continue;
    ck_assert_msg(runs[i].status == 2 && count_lines(runs[i].out, "error ") == 1,
                  "%s: node %d ended with %d: %s", why, i, runs[i].status,
                  runs[i].out);
    ck_assert_msg(count_lines(runs[i].out, "fail ") == 0, "%s: node %d: %s",
                  why, i, runs[i].out);
  }
}

START_TEST(node_dies_mid_round) {
  /* Rank 2 (node 1) exits at its third launch: the warm-up, round 1,
   * then round 2 - mid-export. */
  struct node_run runs[2];
  run_nodes(2, "1", "8000", 1, "SHARDPORT_FAKE_NCCL_FAIL=2:3:exit", runs, 2);
  ck_assert_msg(runs[1].status == 3, "the faulty node ended with %d: %s",
                runs[1].status, runs[1].out);
  assert_survivors_fail(runs, 2, 1, "exit");
  ck_assert_msg(strstr(runs[0].out, "NCCL"), "%s", runs[0].out);
}
END_TEST

START_TEST(launch_error_aborts_everywhere) {
  struct node_run runs[3];
  run_nodes(3, "1", "8000", 0, "SHARDPORT_FAKE_NCCL_FAIL=1:2:error", runs, 3);
  /* The failing node fails too and aborts its communicators, which tells
   * the others nothing (there is no mesh here): they fail by their own
   * round timeout. */
  assert_survivors_fail(runs, 3, -1, "error");
}
END_TEST

START_TEST(hung_launch_times_out) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  struct node_run runs[2];
  run_nodes(2, "1", "1500", 1, "SHARDPORT_FAKE_NCCL_FAIL=3:2:hang", runs, 2);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  assert_survivors_fail(runs, 2, -1, "hang");
  /* Whichever node's watchdog fires first times out and aborts; the other
   * is not told by NCCL and times out as well. */
  ck_assert_msg(strstr(runs[0].out, "no progress") ||
                    strstr(runs[1].out, "no progress"),
                "%s / %s", runs[0].out, runs[1].out);
  /* Bounded by the timeout (and its wind-down), not by the 60 s the test
   * would wait. */
  ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 30);
}
END_TEST

#define MISMATCH_ROUND_1 "SHARDPORT_FAKE_NCCL_FAIL=0:2:mismatch,1:2:mismatch"

START_TEST(mismatched_round_is_an_error_by_default) {
  /* Node 0's round-1 sends (ranks 0 and 1, launch 2 after the warm-up)
   * announce one element more than their receivers posted: the fake's
   * default mode reports it at once. */
  struct node_run runs[2];
  run_nodes(2, "1", "8000", 0, MISMATCH_ROUND_1, runs, 2);
  assert_survivors_fail(runs, 2, -1, "mismatch");
  ck_assert_msg(strstr(runs[0].out, "invalid usage") ||
                    strstr(runs[1].out, "invalid usage"),
                "%s / %s", runs[0].out, runs[1].out);
}
END_TEST

START_TEST(mismatched_round_hangs_until_the_watchdog_aborts) {
  /* The same mismatch where, as on real NCCL, nothing reports it: the
   * sends and receives wait for each other forever, and only the round's
   * watchdog ends it (no progress within the timeout, then abort). */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  struct node_run runs[2];
  run_nodes_with(2, "1", "1500", 0, MISMATCH_ROUND_1,
                 "SHARDPORT_FAKE_NCCL_MISMATCH=hang", runs, 2);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  assert_survivors_fail(runs, 2, -1, "mismatch hang");
  ck_assert_msg(!strstr(runs[0].out, "invalid usage") &&
                    !strstr(runs[1].out, "invalid usage"),
                "%s / %s", runs[0].out, runs[1].out);
  ck_assert_msg(strstr(runs[0].out, "no progress") ||
                    strstr(runs[1].out, "no progress"),
                "%s / %s", runs[0].out, runs[1].out);
  ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 30);
}
END_TEST

START_TEST(two_jobs_at_once_on_the_same_gpus) {
  /* Two jobs of the same ranks, each on its own communicators and engine
   * thread, export at the same time: each thread issues its groups only
   * under the devices' NCCL locks, and no device memory is freed or
   * allocated while the other's NCCL work is in flight (the fake ends the
   * process otherwise): the second job, done first, frees its segments
   * while the first one's rounds run.  Each call that issues holds its
   * device 2 ms, so that two threads meet. */
  char every[sizeof id2_env + 64];
  snprintf(every, sizeof every, "%s SHARDPORT_FAKE_NCCL_ISSUE_US=2000",
           id2_env);
  struct node_run runs[2];
  run_nodes_with(2, "2", "10000", -1, NULL, every, runs, 2);
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(runs[i].status == 0, "node %d ended with %d: %s", i,
                  runs[i].status, runs[i].out);
    ck_assert_int_eq(count_lines(runs[i].out, "ok "), 6);
  }
}
END_TEST

START_TEST(the_warm_up_connects_what_the_rounds_use) {
  /* NCCL connects a peer, and takes device memory for it, at the first
   * send or receive to it: once warmed for the plan, two exports take no
   * more device memory (cudaMemGetInfo). */
  struct node_run runs[2];
  run_nodes_with(2, "2", "10000", -1, NULL, "GPUNODE_MEMCHECK=1", runs, 2);
  for (int i = 0; i < 2; i++)
    ck_assert_msg(runs[i].status == 0 && count_lines(runs[i].out, "ok ") == 2,
                  "node %d ended with %d: %s", i, runs[i].status, runs[i].out);
}
END_TEST

START_TEST(a_blocking_abort_does_not_hold_the_export) {
  /* Node 1's launch fails and its ncclCommAbort blocks for 90 s, longer
   * than this test waits for a node: the abort runs on a helper thread,
   * so node 1 still reports its error; node 0, which NCCL does not tell
   * (an abort tells no peer), fails by its own timeout. */
  /* Node 1 exits while its helper still blocks in the fake NCCL (the
   * backend leaves the libraries loaded, as it must); LeakSanitizer, in a
   * sanitizer build, cannot scan a thread of a dlopened library with
   * thread-local storage at that exit and crashes, so it is off there. */
  struct node_run runs[2];
  run_nodes(2, "1", "3000", 1,
            "SHARDPORT_FAKE_NCCL_FAIL=2:2:error SHARDPORT_FAKE_NCCL_ABORT_MS=90000 "
            "LSAN_OPTIONS=detect_leaks=0",
            runs, 2);
  assert_survivors_fail(runs, 2, -1, "blocking abort");
  ck_assert_msg(strstr(runs[1].out, "NCCL"), "%s", runs[1].out);
}
END_TEST

START_TEST(missing_node_fails_creation) {
  struct node_run runs[1];
  run_nodes(2, "1", "1000", -1, NULL, runs, 1);
  ck_assert_msg(runs[0].status == 2 && strstr(runs[0].out, "error ") &&
                    !strstr(runs[0].out, "ready"),
                "%d: %s", runs[0].status, runs[0].out);
}
END_TEST

int main(int argc, char **argv) {
  Suite *s = suite_create("gpu-comm");
  TCase *tc = tcase_create("nccl");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, two_nodes_two_exports);
  tcase_add_test(tc, three_nodes);
  tcase_add_test(tc, node_dies_mid_round);
  tcase_add_test(tc, launch_error_aborts_everywhere);
  tcase_add_test(tc, hung_launch_times_out);
  tcase_add_test(tc, mismatched_round_is_an_error_by_default);
  tcase_add_test(tc, mismatched_round_hangs_until_the_watchdog_aborts);
  tcase_add_test(tc, missing_node_fails_creation);
  tcase_add_test(tc, two_jobs_at_once_on_the_same_gpus);
  tcase_add_test(tc, the_warm_up_connects_what_the_rounds_use);
  tcase_add_test(tc, a_blocking_abort_does_not_hold_the_export);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  int run = srunner_ntests_run(sr);
  srunner_free(sr);
  return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
