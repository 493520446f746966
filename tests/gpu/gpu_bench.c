/*
 * gpu_bench.c - on a real GPU: an export's throughput against the GPU's own
 * device-to-device copy bandwidth, measured in the same run (tests/gpu/
 * run.sh prints both and their ratio).
 *
 *   gpu-bench SOCKET [MIB [REPS]]
 *
 * Two trainer ranks share GPU 0 (or sit on GPUs 0 and 1 when there are
 * two), each holding half the rows of 16 tensors of MIB/16 MiB (default
 * 1024 MiB in all) in one cudaMalloc allocation; every export assembles
 * every tensor whole on its owner, so it moves MIB MiB.  Rank 0 first
 * times cudaMemcpyAsync of MIB MiB between two allocations on its GPU.
 * Each rank times its sp_export calls; the slower rank's time is the
 * export's.  The bandwidths count bytes moved once (a copy reads and writes
 * each byte; both figures count it once).
 *
 * Ranks are forked before anything touches CUDA (DESIGN section 8.7).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "shardport.h"

#define KEYS 16

struct result {
  int rc;
  char what[600];
  double export_s; /* best export */
  double d2d_s;    /* best copy (rank 0) */
};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int d2d(struct cuda_api *a, size_t bytes, int reps, double *best) {
  void *x, *y;
  cudaStream_t s;
  if (a->cudaMalloc(&x, bytes) != cudaSuccess ||
      a->cudaMalloc(&y, bytes) != cudaSuccess ||
      a->cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return -1;
  *best = 1e30;
  for (int i = 0; i <= reps; i++) {
    double t0 = now();
    if (a->cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s) !=
            cudaSuccess ||
        a->cudaStreamSynchronize(s) != cudaSuccess)
      return -1;
    double t = now() - t0;
    if (i > 0 && t < *best) /* the first warms up */
      *best = t;
  }
  a->cudaFree(x);
  a->cudaFree(y);
  a->cudaStreamDestroy(s);
  return 0;
}

static void rank_main(const char *socket, int rank, size_t bytes, int reps,
                      int in_fd, int out_fd) {
  struct result res = {.rc = -1, .d2d_s = 0};
  struct cuda_api api;
  sp_client *c = NULL;
  struct cuda_device_info devs[8];
  char why[512];
  if (cuda_api_load(&api, why, sizeof why) != 0 ||
      cuda_api_probe(&api, devs, 8, why, sizeof why) <= 0) {
    snprintf(res.what, sizeof res.what, "CUDA: %s", why);
    goto out;
  }
  int ngpus = api.device_count < 2 ? api.device_count : 2;
  int dev = rank % ngpus;
  char device[64];
  snprintf(device, sizeof device, "cuda:%s", devs[dev].uuid_str);
  api.cudaSetDevice(dev);
  if (rank == 0 && d2d(&api, bytes, reps, &res.d2d_s) != 0) {
    snprintf(res.what, sizeof res.what, "device-to-device copy failed");
    goto out;
  }
  /* Half of every key's rows: rank 0 the first, rank 1 the second. */
  size_t per_key = bytes / KEYS, half = per_key / 2;
  int64_t cols = 1024, rows = (int64_t)(per_key / 4 / (size_t)cols);
  void *mem;
  if (api.cudaMalloc(&mem, half * KEYS) != cudaSuccess ||
      api.cudaMemsetAsync(mem, rank + 1, half * KEYS, NULL) != cudaSuccess ||
      api.cudaStreamSynchronize(NULL) != cudaSuccess) {
    snprintf(res.what, sizeof res.what, "cannot allocate %zu bytes",
             half * KEYS);
    goto out;
  }
  sp_ticket ticket;
  if (sp_connect(socket, &c) < 0)
    goto out;
  if (rank == 0) {
    if (sp_job_create(c, 2, &ticket) < 0)
      goto out;
    if (write(out_fd, &ticket, sizeof ticket) != (ssize_t)sizeof ticket)
      goto out;
  } else if (read(in_fd, &ticket, sizeof ticket) != (ssize_t)sizeof ticket) {
    goto out;
  }
  sp_storage_desc st = {.id = 1, .kind = SP_STORAGE_CUDA,
                        .length = half * KEYS, .addr = mem, .fd = -1};
  sp_tensor_desc t[KEYS];
  char names[KEYS][16];
  for (int k = 0; k < KEYS; k++) {
    snprintf(names[k], sizeof names[k], "w.%02d", k);
    int64_t mine = rank == 0 ? rows / 2 : rows - rows / 2;
    t[k] = (sp_tensor_desc){
        .key = names[k], .storage = 1, .dtype = "float32", .ndim = 2,
        .shape = {mine, cols}, .stride = {cols, 1},
        .offset = (int64_t)((size_t)k * half / 4),
        .placement = SP_PLACEMENT_SHARD0, .global_ndim = 2,
        .global_shape = {rows, cols}};
  }
  if (sp_job_join(c, &ticket, (uint32_t)rank, 2, device) < 0 ||
      sp_register_storages(c, &st, 1) < 0 ||
      sp_register_tensors(c, t, KEYS) < 0) {
    snprintf(res.what, sizeof res.what, "registration: %s",
             sp_last_message(c));
    goto out;
  }
  res.export_s = 1e30;
  for (int i = 0; i <= reps; i++) {
    sp_owned_set *set;
    double t0 = now();
    int rc = sp_export(c, NULL, &set);
    double dt = now() - t0;
    if (rc < 0) {
      snprintf(res.what, sizeof res.what, "export: %s: %s", sp_strerror(rc),
               sp_last_message(c));
      goto out;
    }
    sp_release(c, set);
    if (i > 0 && dt < res.export_s)
      res.export_s = dt;
  }
  res.rc = 0;
out:
  if (write(out_fd, &res, sizeof res) != (ssize_t)sizeof res)
    _exit(3);
  sp_close(c);
  _exit(res.rc == 0 ? 0 : 1);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s SOCKET [MIB [REPS]]\n", argv[0]);
    return 64;
  }
  size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
  int reps = argc > 3 ? atoi(argv[3]) : 5;
  size_t bytes = mib << 20;
  int to0[2], from0[2], from1[2];
  if (pipe(to0) || pipe(from0) || pipe(from1))
    return 1;
  pid_t p0 = fork();
  if (p0 == 0)
    rank_main(argv[1], 0, bytes, reps, -1, from0[1]);
  /* Rank 1 reads the ticket rank 0 writes first. */
  struct result r0, r1;
  sp_ticket ticket;
  if (read(from0[0], &ticket, sizeof ticket) != (ssize_t)sizeof ticket) {
    fprintf(stderr, "gpu-bench: rank 0 failed before its job existed (is "
            "shardportd serving the cuda backend at %s?)\n", argv[1]);
    return 1;
  }
  if (write(to0[1], &ticket, sizeof ticket) != (ssize_t)sizeof ticket)
    return 1;
  pid_t p1 = fork();
  if (p1 == 0)
    rank_main(argv[1], 1, bytes, reps, to0[0], from1[1]);
  int ok = read(from0[0], &r0, sizeof r0) == (ssize_t)sizeof r0 &&
           read(from1[0], &r1, sizeof r1) == (ssize_t)sizeof r1;
  waitpid(p0, NULL, 0);
  waitpid(p1, NULL, 0);
  if (!ok || r0.rc != 0 || r1.rc != 0) {
    fprintf(stderr, "gpu-bench: %s %s\n", ok ? r0.what : "a rank died",
            ok ? r1.what : "");
    return 1;
  }
  double export_s = r0.export_s > r1.export_s ? r0.export_s : r1.export_s;
  double gbe = (double)bytes / export_s / 1e9, gbd = (double)bytes / r0.d2d_s / 1e9;
  printf("bench: export %.1f GB/s, device-to-device copy %.1f GB/s, ratio "
         "%.2f (%zu MiB, best of %d)\n",
         gbe, gbd, gbe / gbd, mib, reps);
  return 0;
}
