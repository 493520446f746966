/*
 * test_fake_nccl.c - the fake NCCL across real processes: set-up blocks
 * until every rank has joined and times out when one never does; grouped
 * sends and receives deliver exact bytes between 2 and 3 processes, and
 * between ranks that share a process; a count mismatch, an abort, a dead
 * peer and injected faults end in errors within bounded time, not hangs.
 *
 * Each rank is a fakepeer process; this process only makes the unique id
 * and reads what the ranks report.
 */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cuda/api.h"
#include "child.h"

#define MAX_PEERS 4

static struct cuda_api api;
static char id_hex[2 * sizeof(ncclUniqueId) + 1];

static void setup(void) {
  char why[512];
  ck_assert_msg(cuda_api_load(&api, why, sizeof(why)) == 0, "%s", why);
  ncclUniqueId id;
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  hex_encode(&id, sizeof(id), id_hex);
}

static void teardown(void) { cuda_api_unload(&api); }

/* One process of a scenario. */
struct rank_proc {
  const char *ranks;  /* the ranks it holds, "0" or "0,1" */
  const char *arg;    /* the scenario's argument, or NULL */
  char *env[4];       /* extra environment, NULL-terminated */
};

/* Starts every process of a scenario, waits for all, and checks that each
 * ended with the status wanted (0 unless given); outputs go to outs. */
static void run_scenario(const char *scenario, int nranks, struct rank_proc *procs,
                         int nprocs, const int *want_status,
                         char outs[][4096]) {
  struct child ch[MAX_PEERS];
  char n[16], node[MAX_PEERS][32];
  snprintf(n, sizeof(n), "%d", nranks);
  for (int i = 0; i < nprocs; i++) {
    const char *args[] = {"nccl", scenario, id_hex, n, procs[i].ranks,
                          procs[i].arg, NULL};
    /* Each process is a machine of its own, its ranks on GPUs 0, 1, ...:
     * NCCL refuses one GPU as two ranks. */
    char *env[6] = {0};
    size_t k = 0;
    for (; k < 4 && procs[i].env[k] != NULL; k++)
      env[k] = procs[i].env[k];
    snprintf(node[i], sizeof node[i], "SHARDPORT_FAKE_NODE=%d", i);
    env[k] = node[i];
    ck_assert_int_eq(peer_start(&ch[i], args, env, -1), 0);
  }
  int status[MAX_PEERS];
  for (int i = 0; i < nprocs; i++)
    status[i] = child_finish(&ch[i], 25000, outs[i], 4096);
  for (int i = 0; i < nprocs; i++)
    ck_assert_msg(status[i] == (want_status ? want_status[i] : 0),
                  "%s: process of ranks %s ended with %d: %s", scenario,
                  procs[i].ranks, status[i], outs[i]);
}

START_TEST(setup_blocks_until_the_last_rank_joins) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0", .arg = "0"},
                           {.ranks = "1", .arg = "400"}};
  run_scenario("join", 2, p, 2, NULL, outs);
  long long joining1, ready0;
  const char *j = strstr(outs[1], "joining "), *r = strstr(outs[0], "ready ");
  ck_assert_ptr_nonnull(j);
  ck_assert_ptr_nonnull(r);
  sscanf(j, "joining %lld", &joining1);
  sscanf(r, "ready %lld", &ready0);
  /* Causality, not speed: rank 0's set-up cannot return before rank 1 even
   * started to join (both clocks are the machine's CLOCK_MONOTONIC). */
  ck_assert_msg(ready0 >= joining1, "rank 0 was ready at %lld, rank 1 joined at %lld",
                ready0, joining1);
}
END_TEST

START_TEST(setup_times_out_when_a_rank_never_joins) {
  char outs[1][4096];
  struct rank_proc blocking = {.ranks = "0", .arg = "1",
                               .env = {"SHARDPORT_FAKE_NCCL_TIMEOUT_MS=600"}};
  run_scenario("alone", 2, &blocking, 1, NULL, outs);
  /* The higher rank waits in connect rather than accept; non-blocking. */
  struct rank_proc nonblocking = {.ranks = "1", .arg = "0",
                                  .env = {"SHARDPORT_FAKE_NCCL_TIMEOUT_MS=600"}};
  run_scenario("alone", 2, &nonblocking, 1, NULL, outs);
}
END_TEST

START_TEST(two_processes_exchange_exact_buckets) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0"}, {.ranks = "1"}};
  run_scenario("exchange", 2, p, 2, NULL, outs);
}
END_TEST

START_TEST(three_processes_exchange_exact_buckets) {
  char outs[3][4096];
  struct rank_proc p[3] = {{.ranks = "0"}, {.ranks = "1"}, {.ranks = "2"}};
  run_scenario("exchange", 3, p, 3, NULL, outs);
}
END_TEST

/* Two ranks in one process, created in one group and driven by one thread
 * in one group per round, as shardportd drives its local GPUs. */
START_TEST(ranks_sharing_a_process_exchange_in_one_group) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0,2"}, {.ranks = "1"}};
  run_scenario("exchange", 3, p, 2, NULL, outs);
}
END_TEST

START_TEST(nonblocking_communicators_report_progress) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0"}, {.ranks = "1"}};
  run_scenario("nonblocking", 2, p, 2, NULL, outs);
  /* And created in one group, two of them in one process. */
  ncclUniqueId id;
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  hex_encode(&id, sizeof(id), id_hex);
  struct rank_proc q[2] = {{.ranks = "0,1"}, {.ranks = "2"}};
  run_scenario("nonblocking", 3, q, 2, NULL, outs);
}
END_TEST

START_TEST(a_count_mismatch_is_an_error_not_a_hang) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0"}, {.ranks = "1"}};
  run_scenario("mismatch", 2, p, 2, NULL, outs);
}
END_TEST

START_TEST(an_abort_does_not_tell_the_waiting_peer) {
  char outs[2][4096];
  struct rank_proc p[2] = {{.ranks = "0", .arg = "abort"},
                           {.ranks = "1", .arg = "abort"}};
  run_scenario("peer-fails", 2, p, 2, NULL, outs);
}
END_TEST

START_TEST(a_dead_peer_fails_the_waiting_peer) {
  char outs[2][4096];
  struct rank_proc p[2] = {
      {.ranks = "0", .arg = "exit"},
      {.ranks = "1", .arg = "exit", .env = {"SHARDPORT_FAKE_NCCL_FAIL=1:1:exit"}}};
  const int want[2] = {0, 3};
  run_scenario("peer-fails", 2, p, 2, want, outs);
}
END_TEST

START_TEST(an_injected_error_fails_that_launch) {
  char outs[2][4096];
  struct rank_proc p[2] = {
      {.ranks = "0", .env = {"SHARDPORT_FAKE_NCCL_FAIL=0:3:error"}},
      {.ranks = "1", .env = {"SHARDPORT_FAKE_NCCL_FAIL=0:3:error"}}};
  run_scenario("inject", 2, p, 2, NULL, outs);
}
END_TEST

START_TEST(a_hung_rank_is_left_to_the_watchdog) {
  char outs[2][4096];
  struct rank_proc p[2] = {
      {.ranks = "0"},
      {.ranks = "1", .env = {"SHARDPORT_FAKE_NCCL_FAIL=1:1:hang"}}};
  run_scenario("hang", 2, p, 2, NULL, outs);
}
END_TEST

START_TEST(arguments_are_checked_when_issued) {
  ncclComm_t comm = NULL;
  ncclUniqueId id;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  memset(&id, 0, sizeof(id));
  ck_assert_int_eq(api.ncclCommInitRankConfig(&comm, 2, id, 0, &config),
                   ncclInvalidArgument);
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  ck_assert_int_eq(api.ncclCommInitRankConfig(&comm, 2, id, 2, &config),
                   ncclInvalidArgument);
  /* A one-rank communicator: self sends and receives. */
  ck_assert_int_eq(api.ncclCommInitRankConfig(&comm, 1, id, 0, &config), ncclSuccess);
  void *d;
  int host[4] = {1, 2, 3, 4}, back[4];
  ck_assert_int_eq(api.cudaMalloc(&d, 64), cudaSuccess);
  ck_assert_int_eq(api.ncclSend(host, 4, ncclInt32, 0, comm, NULL), ncclInvalidArgument);
  ck_assert_int_eq(api.ncclSend(d, 4, ncclInt32, 1, comm, NULL), ncclInvalidArgument);
  ck_assert_int_eq(api.ncclSend(d, 17, ncclInt32, 0, comm, NULL), ncclInvalidArgument);
  ck_assert_int_eq(api.ncclAllReduce(d, d, 1, ncclFloat16, ncclSum, comm, NULL),
                   ncclInvalidArgument);
  /* An error inside a group fails the whole group. */
  ck_assert_int_eq(api.ncclGroupStart(), ncclSuccess);
  ck_assert_int_eq(api.ncclSend(d, 4, ncclInt32, 5, comm, NULL), ncclInvalidArgument);
  ck_assert_int_eq(api.ncclGroupEnd(), ncclInvalidArgument);
  ck_assert_int_eq(api.ncclGroupEnd(), ncclInvalidUsage);

  cudaStream_t s;
  ck_assert_int_eq(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ck_assert_int_eq(api.cudaMemcpyAsync(d, host, sizeof(host), cudaMemcpyHostToDevice, s),
                   cudaSuccess);
  ck_assert_int_eq(api.ncclGroupStart(), ncclSuccess);
  ck_assert_int_eq(api.ncclSend(d, 4, ncclInt32, 0, comm, s), ncclSuccess);
  ck_assert_int_eq(api.ncclRecv((char *)d + 32, 4, ncclInt32, 0, comm, s), ncclSuccess);
  ck_assert_int_eq(api.ncclGroupEnd(), ncclSuccess);
  ck_assert_int_eq(api.ncclAllReduce((char *)d + 32, (char *)d + 32, 4, ncclInt32,
                                     ncclMax, comm, s),
                   ncclSuccess);
  ck_assert_int_eq(api.cudaMemcpyAsync(back, (char *)d + 32, sizeof(back),
                                       cudaMemcpyDeviceToHost, s),
                   cudaSuccess);
  ck_assert_int_eq(api.cudaStreamSynchronize(s), cudaSuccess);
  ck_assert_mem_eq(back, host, sizeof(host));
  ck_assert_int_eq(api.ncclCommFinalize(comm), ncclSuccess);
  ck_assert_int_eq(api.ncclCommDestroy(comm), ncclSuccess);
  ck_assert_int_eq(api.cudaStreamDestroy(s), cudaSuccess);
  ck_assert_int_eq(api.cudaFree(d), cudaSuccess);
}
END_TEST

/* A one-rank communicator of a fresh id on the current device. */
static ncclComm_t one_rank_comm(void) {
  ncclUniqueId id;
  ncclComm_t comm = NULL;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  ck_assert_int_eq(api.ncclCommInitRankConfig(&comm, 1, id, 0, &config),
                   ncclSuccess);
  return comm;
}

START_TEST(one_gpu_is_refused_as_two_ranks) {
  ncclUniqueId id;
  ncclComm_t comm[2] = {NULL, NULL};
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  ck_assert_int_eq(api.cudaSetDevice(0), cudaSuccess);
  ck_assert_int_eq(api.ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 2; r++)
    api.ncclCommInitRankConfig(&comm[r], 2, id, r, &config);
  ck_assert_int_eq(api.ncclGroupEnd(), ncclInvalidUsage);
  for (int r = 0; r < 2; r++)
    api.ncclCommAbort(comm[r]);
}
END_TEST

struct issuer {
  ncclComm_t comm;
  void *buf;
};

/* Issues a self send and receive in one group; the fake holds the device
 * SHARDPORT_FAKE_NCCL_ISSUE_US at the first call. */
static void *issue_group(void *arg) {
  struct issuer *is = arg;
  api.cudaSetDevice(0);
  api.ncclGroupStart();
  api.ncclSend(is->buf, 4, ncclUint8, 0, is->comm, NULL);
  api.ncclRecv((char *)is->buf + 4, 4, ncclUint8, 0, is->comm, NULL);
  api.ncclGroupEnd();
  return NULL;
}

/* Two threads issuing to communicators of one device at once end the
 * process (SIGABRT): NCCL is not thread-safe there. */
START_TEST(two_threads_issuing_to_one_device_fail_loudly) {
  setenv("SHARDPORT_FAKE_NCCL_ISSUE_US", "300000", 1);
  ck_assert_int_eq(api.cudaSetDevice(0), cudaSuccess);
  struct issuer a = {.comm = one_rank_comm()}, b = {.comm = one_rank_comm()};
  ck_assert_int_eq(api.cudaMalloc(&a.buf, 8), cudaSuccess);
  ck_assert_int_eq(api.cudaMalloc(&b.buf, 8), cudaSuccess);
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, issue_group, &a), 0);
  usleep(100000);
  issue_group(&b);
  pthread_join(t, NULL);
}
END_TEST

/* cudaFree of a device's memory while an NCCL operation is in flight there
 * ends the process (SIGABRT): a receive nobody sends to stays in flight. */
START_TEST(cuda_free_under_nccl_work_fails_loudly) {
  ck_assert_int_eq(api.cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm = one_rank_comm();
  void *buf, *other;
  ck_assert_int_eq(api.cudaMalloc(&buf, 8), cudaSuccess);
  ck_assert_int_eq(api.cudaMalloc(&other, 8), cudaSuccess);
  ck_assert_int_eq(api.ncclRecv(buf, 4, ncclUint8, 0, comm, NULL), ncclSuccess);
  api.cudaFree(other);
}
END_TEST

/* After the work is over (here: aborted), freeing is fine. */
START_TEST(cuda_free_after_nccl_work_is_fine) {
  ck_assert_int_eq(api.cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm = one_rank_comm();
  void *buf, *other;
  ck_assert_int_eq(api.cudaMalloc(&buf, 8), cudaSuccess);
  ck_assert_int_eq(api.cudaMalloc(&other, 8), cudaSuccess);
  ck_assert_int_eq(api.ncclRecv(buf, 4, ncclUint8, 0, comm, NULL), ncclSuccess);
  ck_assert_int_eq(api.ncclCommAbort(comm), ncclSuccess);
  ck_assert_int_eq(api.cudaFree(other), cudaSuccess);
  ck_assert_int_eq(api.cudaFree(buf), cudaSuccess);
}
END_TEST

/* The free memory cudaMemGetInfo reports on the current device. */
static size_t free_on(int dev) {
  size_t free = 0, total = 0;
  ck_assert_int_eq(api.cudaSetDevice(dev), cudaSuccess);
  ck_assert_int_eq(api.cudaMemGetInfo(&free, &total), cudaSuccess);
  return free;
}

/* A connection takes its buffers from the device at the first send or
 * receive to that peer, not at set-up; later rounds take nothing. */
START_TEST(connections_take_device_memory_when_first_used) {
  setenv("SHARDPORT_FAKE_NCCL_CONN_KB", "1024", 1);
  ncclUniqueId id;
  ncclComm_t comm[2];
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  void *buf[2];
  ck_assert_int_eq(api.ncclGetUniqueId(&id), ncclSuccess);
  ck_assert_int_eq(api.ncclGroupStart(), ncclSuccess);
  for (int r = 0; r < 2; r++) {
    ck_assert_int_eq(api.cudaSetDevice(r), cudaSuccess);
    ck_assert_int_eq(api.cudaMalloc(&buf[r], 64), cudaSuccess);
    api.ncclCommInitRankConfig(&comm[r], 2, id, r, &config);
  }
  ck_assert_int_eq(api.ncclGroupEnd(), ncclSuccess);
  size_t before[2] = {free_on(0), free_on(1)};
  for (int round = 0; round < 2; round++) {
    ck_assert_int_eq(api.ncclGroupStart(), ncclSuccess);
    for (int r = 0; r < 2; r++) {
      api.cudaSetDevice(r);
      api.ncclSend(buf[r], 8, ncclUint8, 1 - r, comm[r], NULL);
      api.ncclRecv((char *)buf[r] + 32, 8, ncclUint8, 1 - r, comm[r], NULL);
    }
    ck_assert_int_eq(api.ncclGroupEnd(), ncclSuccess);
    for (int r = 0; r < 2; r++) {
      api.cudaSetDevice(r);
      ck_assert_int_eq(api.cudaStreamSynchronize(NULL), cudaSuccess);
      /* A send and a receive connection, 1 MiB each. */
      ck_assert_uint_eq(before[r] - free_on(r), (size_t)2 << 20);
    }
  }
  for (int r = 0; r < 2; r++) {
    api.cudaSetDevice(r);
    ck_assert_int_eq(api.ncclCommDestroy(comm[r]), ncclSuccess);
    ck_assert_uint_eq(free_on(r), before[r]);
    api.cudaFree(buf[r]);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("fake-nccl");
  TCase *tc = tcase_create("contracts");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 40);
  tcase_add_test(tc, setup_blocks_until_the_last_rank_joins);
  tcase_add_test(tc, setup_times_out_when_a_rank_never_joins);
  tcase_add_test(tc, two_processes_exchange_exact_buckets);
  tcase_add_test(tc, three_processes_exchange_exact_buckets);
  tcase_add_test(tc, ranks_sharing_a_process_exchange_in_one_group);
  tcase_add_test(tc, nonblocking_communicators_report_progress);
  tcase_add_test(tc, a_count_mismatch_is_an_error_not_a_hang);
  tcase_add_test(tc, an_abort_does_not_tell_the_waiting_peer);
  tcase_add_test(tc, a_dead_peer_fails_the_waiting_peer);
  tcase_add_test(tc, an_injected_error_fails_that_launch);
  tcase_add_test(tc, a_hung_rank_is_left_to_the_watchdog);
  tcase_add_test(tc, arguments_are_checked_when_issued);
  tcase_add_test(tc, one_gpu_is_refused_as_two_ranks);
  tcase_add_test_raise_signal(tc, two_threads_issuing_to_one_device_fail_loudly,
                              SIGABRT);
  tcase_add_test_raise_signal(tc, cuda_free_under_nccl_work_fails_loudly,
                              SIGABRT);
  tcase_add_test(tc, cuda_free_after_nccl_work_is_fine);
  tcase_add_test(tc, connections_take_device_memory_when_first_used);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
