/*
 * test_gpu_storage.c - the CUDA backend's devices and storages on the
 * fake runtime (docs/fakes.md), driven through daemon/cuda/ directly:
 * what a registered storage's mapping and a GPU's compute mode ask of it.
 *
 * Each test runs in its own forked process (Check's default) that loads
 * the fakes itself after setting the environment it needs: the fakes read
 * it once, and no process forks after CUDA is initialised.  "Another
 * process" is the fakes' fakepeer helper (FAKEPEER), started with
 * posix_spawn.
 */
#include <check.h>
#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/cuda/internal.h"
#include "shardport.h"
#include "tests/unit/fakes/child.h"

#define CUDA_OK(call) ck_assert_int_eq((int)(call), (int)cudaSuccess)
#define DRV_OK(call) ck_assert_int_eq((int)(call), (int)CUDA_SUCCESS)

static struct gpu *open_gpu(void) {
  struct gpu *gpu = NULL;
  char why[SP_ERRMSG_MAX + 1];
  int rc = gpu_open(&gpu, why, sizeof why);
  ck_assert_msg(rc == 0, "gpu_open: %s", why);
  return gpu;
}

/* A cuMem allocation of this process on device 0, exported as a POSIX fd,
 * as a trainer's expandable segment is. */
static int cumem_fd(struct gpu *gpu, size_t size,
                    CUmemGenericAllocationHandle *h) {
  const struct cuda_api *a = &gpu->api;
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
  DRV_OK(a->cuMemCreate(h, size, &prop, 0));
  int fd = -1;
  DRV_OK(a->cuMemExportToShareableHandle(
      &fd, *h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return fd;
}

/* Queues a copy of the whole mapping into a segment (slow: the test runs
 * with SHARDPORT_FAKE_DELAY_US) on stream, which nobody waits for;
 * closes the storage at once; and checks that the copy ran on memory still
 * mapped: the close waited for it. */
static void copy_on_then_close(struct gpu *gpu, cudaStream_t stream,
                               struct gpu_mapping *m, size_t len) {
  struct gpu_segment *seg;
  char why[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_segment_new(gpu, 0, len, &seg, why, sizeof why), 0);
  struct xfer_box box = {.ndim = 1, .elem_size = 1, .shape = {(int64_t)len},
                         .src_stride = {1}, .dst_stride = {1}};
  ck_assert_int_eq(gpu_box_copy(gpu, stream, gpu_segment_info(seg)->ptr,
                                m->data, &box, why, sizeof why),
                   0);
  gpu_storage_close(gpu, m);
  CUDA_OK(gpu->api.cudaStreamSynchronize(stream));
  ck_assert_int_eq(gpu_failure(gpu, 0, why, sizeof why), -1);
  gpu_segment_free(gpu, seg);
}

/* The same on a stream of the engine's, given back busy, as a run of the
 * engine that gave up waiting gives its streams back. */
static void copy_then_close(struct gpu *gpu, struct gpu_mapping *m,
                            size_t len) {
  cudaStream_t stream;
  char why[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_stream_take(gpu, 0, &stream, why, sizeof why), 0);
  gpu_stream_give(gpu, 0, stream);
  copy_on_then_close(gpu, stream, m, len);
}

START_TEST(a_cumem_storage_is_unmapped_only_after_its_queued_copies) {
  setenv("SHARDPORT_FAKE_DELAY_US", "200000", 1);
  struct gpu *gpu = open_gpu();
  const size_t size = 2u << 20;
  CUmemGenericAllocationHandle h;
  int fd = cumem_fd(gpu, size, &h);
  struct gpu_mapping m;
  char why[SP_ERRMSG_MAX + 1];
  int rc = gpu_storage_open(gpu, 0, GPU_STORAGE_FD, NULL, fd, 0, 4096, &m, why,
                            sizeof why);
  ck_assert_msg(rc == 0, "%s", why);
  close(fd);
  copy_then_close(gpu, &m, 4096);
  DRV_OK(gpu->api.cuMemRelease(h));
  gpu_close(gpu);
}
END_TEST

START_TEST(an_ipc_storage_is_closed_only_after_its_queued_copies) {
  setenv("SHARDPORT_FAKE_DELAY_US", "200000", 1);
  struct gpu *gpu = open_gpu();
  /* Another process's allocation, as a trainer's is. */
  struct child producer;
  char line[512];
  ck_assert_int_eq(peer_start(&producer, (const char *[]){"event-produce", NULL},
                              NULL, -1), 0);
  ck_assert_int_eq(child_line(&producer, line, sizeof line, 10000), 0);
  uint8_t handle[GPU_IPC_HANDLE_BYTES];
  ck_assert_int_eq(strncmp(line, "mem ", 4), 0);
  ck_assert_int_eq(hex_decode(line + 4, handle, sizeof handle), 0);
  struct gpu_mapping m;
  char why[SP_ERRMSG_MAX + 1];
  int rc = gpu_storage_open(gpu, 0, GPU_STORAGE_IPC, handle, -1, 0, 4096, &m,
                            why, sizeof why);
  ck_assert_msg(rc == 0, "%s", why);
  copy_then_close(gpu, &m, 4096);
  child_kill(&producer, SIGKILL);
  child_finish(&producer, 10000, NULL, 0);
  gpu_close(gpu);
}
END_TEST

START_TEST(a_storage_is_unmapped_only_after_a_communicator_s_packs) {
  /* A communicator's stream packs a send bucket from a trainer's storage
   * (comm.c, copy_bucket): closing the storage waits for it too. */
  setenv("SHARDPORT_FAKE_DELAY_US", "200000", 1);
  struct gpu *gpu = open_gpu();
  char why[SP_ERRMSG_MAX + 1];
  uint8_t id[GPU_NCCL_ID_BYTES];
  struct gpu_nccl_root *root;
  ck_assert_int_eq(gpu_comms_unique_id(gpu, id, &root, why, sizeof why), 0);
  struct gpu_comms *c;
  ck_assert_int_eq(gpu_comms_begin(gpu, id, 1, &c, why, sizeof why), 0);
  const struct gpu_comm_rank rank = {.rank = 0, .device = 0};
  ck_assert_int_eq(gpu_comms_add(c, &rank, 1, why, sizeof why), 0);
  int rc;
  while ((rc = gpu_comms_poll(c, why, sizeof why)) == 1)
    gpu_backoff(&(unsigned){0});
  ck_assert_msg(rc == 0, "%s", why);
  CUmemGenericAllocationHandle h;
  int fd = cumem_fd(gpu, 2u << 20, &h);
  struct gpu_mapping m;
  rc = gpu_storage_open(gpu, 0, GPU_STORAGE_FD, NULL, fd, 0, 4096, &m, why,
                        sizeof why);
  ck_assert_msg(rc == 0, "%s", why);
  close(fd);
  copy_on_then_close(gpu, gpu_comms_stream(c, 0), &m, 4096);
  DRV_OK(gpu->api.cuMemRelease(h));
  gpu_comms_free(c);
  gpu_nccl_root_end(root);
  gpu_close(gpu);
}
END_TEST

/* The threads of this process. */
static int thread_count(void) {
  DIR *d = opendir("/proc/self/task");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* Whether a Unix socket of this machine is bound to the fake NCCL's root
 * address of id ("@spfake-nccl-root-<token>" in /proc/net/unix). */
static bool root_listens(const uint8_t id[GPU_NCCL_ID_BYTES]) {
  char name[64];
  snprintf(name, sizeof name, "@spfake-nccl-root-%.32s",
           (const char *)id + 8);
  FILE *f = fopen("/proc/net/unix", "r");
  ck_assert_ptr_nonnull(f);
  char line[512];
  bool found = false;
  while (!found && fgets(line, sizeof line, f) != NULL)
    found = strstr(line, name) != NULL;
  fclose(f);
  return found;
}

START_TEST(an_unused_id_leaves_no_bootstrap_root_behind) {
  /* A generation whose ranks never check in: its id's root (a thread and
   * a listening socket that real NCCL keeps until they do) is not in this
   * process, and is gone once the generation is given up. */
  struct gpu *gpu = open_gpu();
  char why[SP_ERRMSG_MAX + 1];
  int threads = thread_count();
  uint8_t id[GPU_NCCL_ID_BYTES];
  struct gpu_nccl_root *root;
  ck_assert_int_eq(gpu_comms_unique_id(gpu, id, &root, why, sizeof why), 0);
  ck_assert(root_listens(id));
  ck_assert_int_eq(thread_count(), threads);
  gpu_nccl_root_end(root);
  ck_assert(!root_listens(id));
  gpu_close(gpu);
}
END_TEST

/* Whether this process has a context on device (the driver's own
 * answer). */
static int context_active(struct gpu *gpu, int device) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult st;
  CUDA_OK(gpu->api.cudaGetDriverEntryPointByVersion(
      "cuDevicePrimaryCtxGetState", &fn, CUDA_API_DRIVER_ABI,
      cudaEnableDefault, &st));
  ck_assert_ptr_nonnull(fn);
  unsigned flags;
  int active = -1;
  DRV_OK(((__typeof__(cuDevicePrimaryCtxGetState) *)fn)(device, &flags,
                                                        &active));
  return active;
}

START_TEST(a_gpu_in_exclusive_process_mode_is_skipped_with_its_reason) {
  setenv("SHARDPORT_FAKE_COMPUTE_MODE", "1:exclusive_process", 1);
  struct gpu *gpu = open_gpu();
  char text[1024], why[SP_ERRMSG_MAX + 1];
  gpu_describe(gpu, text, sizeof text);
  ck_assert_msg(strstr(text, "skipped: it is in exclusive-process compute mode") !=
                    NULL,
                "%s", text);
  /* No context of the daemon's is on it: a trainer can have the GPU. */
  ck_assert_int_eq(context_active(gpu, 1), 0);
  ck_assert_int_eq(context_active(gpu, 0), 1);
  char out[4096];
  struct child holder;
  ck_assert_int_eq(peer_start(&holder, (const char *[]){"ctx-hold", "1", NULL},
                              NULL, -1), 0);
  ck_assert_int_eq(child_line(&holder, out, sizeof out, 10000), 0);
  ck_assert_str_eq(out, "held");
  child_kill(&holder, SIGKILL);
  child_finish(&holder, 10000, NULL, 0);
  /* Nothing is served on it, and the refusal says why. */
  struct gpu_segment *seg;
  ck_assert_int_eq(gpu_segment_new(gpu, 1, 4096, &seg, why, sizeof why),
                   SP_EBACKEND);
  ck_assert_msg(strstr(why, "exclusive-process") != NULL, "%s", why);
  ck_assert_int_eq(context_active(gpu, 1), 0);
  gpu_close(gpu);
}
END_TEST

START_TEST(a_node_whose_gpus_are_all_prohibited_has_no_cuda_backend) {
  setenv("SHARDPORT_FAKE_COMPUTE_MODE", "0:prohibited,1:prohibited", 1);
  struct gpu *gpu = NULL;
  char why[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_open(&gpu, why, sizeof why), SP_EBACKEND);
  ck_assert_msg(strstr(why, "prohibited compute mode") != NULL, "%s", why);
}
END_TEST

/* The fake runtime's count of copy calls (spfake_copy_calls), from the
 * library the backend loaded. */
static unsigned long copy_calls(void) {
  void *lib = dlopen(getenv("SHARDPORT_CUDART_LIB"), RTLD_NOW | RTLD_NOLOAD);
  ck_assert_ptr_nonnull(lib);
  unsigned long (*calls)(void) =
      (unsigned long (*)(void))dlsym(lib, "spfake_copy_calls");
  ck_assert_ptr_nonnull(calls);
  unsigned long n = calls();
  dlclose(lib);
  return n;
}

START_TEST(a_strided_innermost_dimension_is_one_copy_per_3d_block) {
  /* Every other float of a [3, 64, 30] slice (x[:, :, :30:2] of a tensor
   * padded by a row between its outermost slices, so that no two
   * dimensions merge into one) into a dense [3, 64, 15]: one
   * cudaMemcpy3DAsync per outermost index, each of exactly as many rows
   * as a slice holds on the destination, where single-element 2-D columns
   * took one call per row (192). */
  struct gpu *gpu = open_gpu();
  enum { A = 3, B = 64, C = 32, CH = C / 2 - 1 };
  float *src, *dst;
  CUDA_OK(gpu->api.cudaSetDevice(0));
  enum { SLICE = (B + 1) * C };
  CUDA_OK(gpu->api.cudaMalloc((void **)&src, sizeof(float) * A * SLICE));
  CUDA_OK(gpu->api.cudaMalloc((void **)&dst, sizeof(float) * A * B * CH));
  for (int i = 0; i < A * SLICE; i++)
    src[i] = (float)i;
  cudaStream_t stream;
  char why[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_stream_take(gpu, 0, &stream, why, sizeof why), 0);
  struct xfer_box box = {.ndim = 3, .elem_size = sizeof(float),
                         .shape = {A, B, CH},
                         .src_stride = {SLICE, C, 2},
                         .dst_stride = {B * CH, CH, 1}};
  unsigned long before = copy_calls();
  ck_assert_int_eq(gpu_box_copy(gpu, stream, (uint8_t *)dst,
                                (const uint8_t *)src, &box, why, sizeof why),
                   0);
  ck_assert_uint_eq(copy_calls() - before, A);
  CUDA_OK(gpu->api.cudaStreamSynchronize(stream));
  for (int a = 0; a < A; a++)
    for (int b = 0; b < B; b++)
      for (int c = 0; c < CH; c++)
        ck_assert_float_eq(dst[(a * B + b) * CH + c],
                           src[a * SLICE + b * C + 2 * c]);
  gpu_stream_give(gpu, 0, stream);
  CUDA_OK(gpu->api.cudaFree(src));
  CUDA_OK(gpu->api.cudaFree(dst));
  gpu_close(gpu);
}
END_TEST

int main(void) {
  Suite *s = suite_create("gpu-storage");
  TCase *tc = tcase_create("storages");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, a_cumem_storage_is_unmapped_only_after_its_queued_copies);
  tcase_add_test(tc, an_ipc_storage_is_closed_only_after_its_queued_copies);
  tcase_add_test(tc, a_storage_is_unmapped_only_after_a_communicator_s_packs);
  tcase_add_test(tc, a_gpu_in_exclusive_process_mode_is_skipped_with_its_reason);
  tcase_add_test(tc, a_node_whose_gpus_are_all_prohibited_has_no_cuda_backend);
  tcase_add_test(tc, a_strided_innermost_dimension_is_one_copy_per_3d_block);
  tcase_add_test(tc, an_unused_id_leaves_no_bootstrap_root_behind);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
