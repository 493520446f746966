/*
 * none.c - the CUDA backend's interface (gpu.h) in a build without it: the
 * backend cannot be opened, so nothing else here is ever reached with a
 * struct gpu; each function still answers as its contract says.
 */
#include <stdio.h>
#include <string.h>

#include "daemon/cuda/gpu.h"
#include "shardport.h"

int gpu_open(struct gpu **out, char *why, size_t whylen) {
  (void)out;
  snprintf(why, whylen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

void gpu_close(struct gpu *gpu) { (void)gpu; }

void gpu_describe(const struct gpu *gpu, char *out, size_t outlen) {
  (void)gpu;
  snprintf(out, outlen, "no CUDA backend");
}

int gpu_device_count(const struct gpu *gpu) {
  (void)gpu;
  return 0;
}

int gpu_failure(const struct gpu *gpu, int from, char *why, size_t whylen) {
  (void)gpu;
  (void)from;
  (void)why;
  (void)whylen;
  return -1;
}

int gpu_find_device(const struct gpu *gpu, const char *name, size_t len) {
  (void)gpu;
  (void)name;
  (void)len;
  return -1;
}

const char *gpu_device_name(const struct gpu *gpu, int device) {
  (void)gpu;
  (void)device;
  return "cuda:none";
}

const uint8_t *gpu_device_uuid(const struct gpu *gpu, int device) {
  static const uint8_t zero[16];
  (void)gpu;
  (void)device;
  return zero;
}

int gpu_storage_open(struct gpu *gpu, int device, enum gpu_storage_kind kind,
                     const uint8_t handle[GPU_IPC_HANDLE_BYTES], int fd,
                     uint64_t offset, uint64_t length, struct gpu_mapping *out,
                     char *msg, size_t msglen) {
  (void)gpu, (void)device, (void)kind, (void)handle, (void)fd, (void)offset,
      (void)length;
  memset(out, 0, sizeof *out);
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

void gpu_storage_close(struct gpu *gpu, struct gpu_mapping *m) {
  (void)gpu;
  memset(m, 0, sizeof *m);
}

size_t gpu_storage_open_count(const struct gpu *gpu) {
  (void)gpu;
  return 0;
}

int gpu_segment_new(struct gpu *gpu, int device, uint64_t size,
                    struct gpu_segment **out, char *msg, size_t msglen) {
  (void)gpu, (void)device, (void)size, (void)out;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

void gpu_segment_free(struct gpu *gpu, struct gpu_segment *seg) {
  (void)gpu;
  (void)seg;
}

const struct gpu_segment_info *gpu_segment_info(const struct gpu_segment *seg) {
  (void)seg;
  return NULL;
}

int gpu_engine_run(struct engine *e) {
  (void)e;
  return SP_EBACKEND;
}

int gpu_comms_create(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                     uint32_t world, const struct gpu_comm_rank *ranks,
                     size_t nranks, const struct plan *plan,
                     uint32_t timeout_ms, struct gpu_comms **out, char *msg,
                     size_t msglen) {
  (void)gpu, (void)id, (void)world, (void)ranks, (void)nranks, (void)plan,
      (void)timeout_ms, (void)out;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

int gpu_comms_begin(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                    uint32_t world, struct gpu_comms **out, char *msg,
                    size_t msglen) {
  (void)gpu, (void)id, (void)world, (void)out;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

int gpu_comms_add(struct gpu_comms *comms, const struct gpu_comm_rank *ranks,
                  size_t nranks, char *msg, size_t msglen) {
  (void)comms, (void)ranks, (void)nranks;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

int gpu_comms_poll(struct gpu_comms *comms, char *msg, size_t msglen) {
  (void)comms;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

int gpu_comms_warm(struct gpu_comms *comms, const struct plan *plan,
                   uint32_t timeout_ms, char *msg, size_t msglen) {
  (void)comms, (void)plan, (void)timeout_ms;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

int gpu_comms_fit(struct gpu_comms *comms, const struct plan *plan,
                  char *msg, size_t msglen) {
  (void)comms, (void)plan;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

bool gpu_comms_holds(const struct gpu_comms *comms, uint32_t rank) {
  (void)comms, (void)rank;
  return false;
}

bool gpu_comms_match(const struct gpu_comms *comms,
                     const struct gpu_comm_rank *ranks, size_t nranks) {
  (void)comms, (void)ranks, (void)nranks;
  return false;
}

int gpu_comms_unique_id(struct gpu *gpu, uint8_t id[GPU_NCCL_ID_BYTES],
                        struct gpu_nccl_root **root, char *msg,
                        size_t msglen) {
  (void)gpu, (void)id;
  *root = NULL;
  snprintf(msg, msglen, "this build has no CUDA backend");
  return SP_EBACKEND;
}

void gpu_nccl_root_end(struct gpu_nccl_root *root) { (void)root; }

void gpu_comms_abort(struct gpu_comms *comms) { (void)comms; }

bool gpu_comms_wait_ended(struct gpu *gpu, uint32_t timeout_ms) {
  (void)gpu, (void)timeout_ms;
  return true;
}

bool gpu_comms_failed(const struct gpu_comms *comms) {
  (void)comms;
  return true;
}

void gpu_comms_free(struct gpu_comms *comms) { (void)comms; }
