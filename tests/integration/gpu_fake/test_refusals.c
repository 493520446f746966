/*
 * test_refusals.c - what one rank's bad joins and storages get, each from
 * a forked rank process of its own (rank.h).
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/rank.h"
#include "tests/integration/gpu_fake/world.h"

struct solo {
  struct rank r;
  sp_client *c;
};

/* A forked child that joins a job of one rank on GPU 0 with a 4 KiB
 * allocation, runs fn and exits with fn's status. */
static int solo_run(int (*fn)(struct solo *s)) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    static const struct scenario one = {.world = 1, .gpus = 1};
    struct solo s = {.r = {.sc = &one, .mem_fd = -1}};
    if (rank_cuda_start(&s.r) < 0 || sp_connect(world_node0.socket, &s.c) < 0)
      _exit(100);
    void *p = NULL;
    if (s.r.api.cudaMalloc(&p, 4096) != cudaSuccess)
      _exit(101);
    s.r.alloc = p;
    _exit(fn(&s));
  }
  return sp_test_wait(pid, WAIT_MS);
}

static int join_as(struct solo *s, const char *device) {
  sp_ticket t;
  int rc = sp_job_create(s->c, 1, &t);
  return rc < 0 ? rc : sp_job_join(s->c, &t, 0, 1, device);
}

/* Each case: 0 when the refusal came with the code expected. */
#define EXPECT(call, code)                                                     \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ != (code)) {                                                       \
      fprintf(stderr, "%s: %s (%s), expected %s\n", #call, sp_strerror(rc_),   \
              sp_last_message(s->c), sp_strerror(code));                       \
      return 1;                                                                \
    }                                                                          \
  } while (0)

static int unknown_gpu(struct solo *s) {
  EXPECT(join_as(s, "cuda:GPU-00000000-0000-0000-0000-000000000000"),
         SP_EINVAL);
  return 0;
}

static int bad_storages(struct solo *s) {
  EXPECT(join_as(s, s->r.device_name), 0);
  cudaIpcMemHandle_t ipc;
  if (s->r.api.cudaIpcGetMemHandle(&ipc, s->r.alloc) != cudaSuccess)
    return 2;
  uint8_t bytes[66];
  sp_storage_desc st = {.id = 1,
                        .kind = SP_STORAGE_CUDA_IPC,
                        .fd = -1,
                        .length = 1024,
                        .addr = s->r.alloc,
                        .device = s->r.device_name,
                        .handle = bytes,
                        .handle_len = 64};
  /* Garbage is no handle of this node. */
  memset(bytes, 0x33, sizeof bytes);
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EBADFD);
  /* PyTorch's expandable-segment handle is no IPC handle. */
  bytes[0] = 2;
  bytes[1] = 'e';
  st.handle_len = 66;
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* A version of PyTorch's format that does not exist. */
  bytes[0] = 9;
  bytes[1] = 'c';
  memcpy(bytes + 2, ipc.reserved, 64);
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* Past the end of the allocation. */
  memcpy(bytes, ipc.reserved, 64);
  st.handle_len = 64;
  st.offset = 4000;
  st.length = 200;
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EBADFD);
  /* On a GPU the daemon does not have. */
  st.offset = 0;
  st.device = "cuda:GPU-00000000-0000-0000-0000-000000000000";
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* A memfd storage on a CUDA rank. */
  sp_storage_desc host = {.id = 2, .fd = 0, .length = 0, .addr = NULL};
  EXPECT(sp_register_storages(s->c, &host, 1), SP_EINVAL);
  /* And the good one still registers, with a view checked against it. */
  st.device = NULL;
  EXPECT(sp_register_storages(s->c, &st, 1), 0);
  sp_tensor_desc t = {.key = "x",
                      .storage = 1,
                      .dtype = "float32",
                      .ndim = 1,
                      .shape = {300},
                      .stride = {1},
                      .placement = SP_PLACEMENT_PLAIN,
                      .global_ndim = 1,
                      .global_shape = {300}};
  EXPECT(sp_register_tensors(s->c, &t, 1), SP_EOUTOFBOUNDS);
  return 0;
}

static int cpu_and_gpu_ranks_do_not_mix(struct solo *s) {
  sp_ticket t;
  EXPECT(sp_job_create(s->c, 2, &t), 0);
  EXPECT(sp_job_join(s->c, &t, 0, 2, s->r.device_name), 0);
  sp_client *other;
  if (sp_connect(world_node0.socket, &other) < 0)
    return 3;
  int rc = sp_job_join(other, &t, 1, 2, "cpu");
  sp_close(other);
  return rc == SP_EDEVICEMISMATCH ? 0 : 4;
}

/* A job whose ticket lets it span nodes (the daemon listens for peers)
 * gets one NCCL rank per GPU: a second rank on the same GPU is refused at
 * its join, naming why (docs/gpu.md). */
static int one_gpu_two_ranks_across_nodes(struct solo *s) {
  sp_ticket t;
  EXPECT(sp_job_create(s->c, 2, &t), 0);
  EXPECT(sp_job_join(s->c, &t, 0, 2, s->r.device_name), 0);
  sp_client *other;
  if (sp_connect(world_node0.socket, &other) < 0)
    return 3;
  int rc = sp_job_join(other, &t, 1, 2, s->r.device_name);
  int ok = rc == SP_EINVAL &&
           strstr(sp_last_message(other), "needs a GPU of its own") != NULL;
  if (!ok)
    fprintf(stderr, "second rank on one GPU: %s (%s)\n", sp_strerror(rc),
            sp_last_message(other));
  sp_close(other);
  return ok ? 0 : 4;
}

START_TEST(one_gpu_is_one_nccl_rank) {
  ck_assert_int_eq(solo_run(one_gpu_two_ranks_across_nodes), 0);
}
END_TEST

START_TEST(refusals) {
  ck_assert_int_eq(solo_run(unknown_gpu), 0);
  ck_assert_int_eq(solo_run(bad_storages), 0);
  ck_assert_int_eq(solo_run(cpu_and_gpu_ranks_do_not_mix), 0);
  world_assert_mappings_closed();
}
END_TEST

void test_refusals_add(const struct gpu_cases *c) {
  tcase_add_test(c->export, refusals);
  tcase_add_test(c->nodes, one_gpu_is_one_nccl_rank);
}
