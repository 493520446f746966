/*
 * segment.c - device pool segments; see gpu_segment_new in gpu.h.
 *
 * Each segment is its own cudaMalloc allocation, so that its IPC handle
 * (which names an allocation's base) opens exactly this segment in the
 * owner's process and nothing of another rank's.  Its event is created
 * interprocess (which requires timing to be off) and exported once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cuda/internal.h"
#include "shardport.h"

struct gpu_segment {
  struct gpu_segment_info info;
  cudaEvent_t done;
};

const struct gpu_segment_info *gpu_segment_info(const struct gpu_segment *seg) {
  return &seg->info;
}

cudaEvent_t gpu_segment_event(const struct gpu_segment *seg) {
  return seg->done;
}

int gpu_segment_new(struct gpu *gpu, int device, uint64_t size,
                    struct gpu_segment **out, char *msg, size_t msglen) {
  const struct cuda_api *a = &gpu->api;
  if (size == 0)
    size = 1;
  int rc = gpu_set_device(gpu, device, msg, msglen);
  if (rc != 0)
    return rc;
  struct gpu_segment *seg = calloc(1, sizeof *seg);
  if (seg == NULL) {
    snprintf(msg, msglen, "out of memory");
    return SP_ENOMEM;
  }
  seg->info.device = device;
  seg->info.size = size;
  void *ptr = NULL;
  cudaError_t err = a->cudaMalloc(&ptr, size);
  if (err != cudaSuccess) {
    a->cudaGetLastError();
    free(seg);
    if (err == cudaErrorMemoryAllocation) {
      snprintf(msg, msglen, "%s has no %llu bytes of device memory left",
               gpu_device_name(gpu, device), (unsigned long long)size);
      return SP_EPOOL;
    }
    return gpu_cuda_fail(gpu, err, "cudaMalloc", msg, msglen);
  }
  seg->info.ptr = ptr;
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  const char *what = "cudaIpcGetMemHandle";
  err = a->cudaIpcGetMemHandle(&mh, ptr);
  if (err == cudaSuccess) {
    what = "cudaEventCreateWithFlags";
    err = a->cudaEventCreateWithFlags(
        &seg->done, cudaEventInterprocess | cudaEventDisableTiming);
  }
  if (err == cudaSuccess) {
    what = "cudaIpcGetEventHandle";
    err = a->cudaIpcGetEventHandle(&eh, seg->done);
  }
  if (err != cudaSuccess) {
    rc = gpu_cuda_fail(gpu, err, what, msg, msglen);
    a->cudaGetLastError();
    if (seg->done != NULL)
      a->cudaEventDestroy(seg->done);
    a->cudaFree(ptr);
    free(seg);
    return rc;
  }
  memcpy(seg->info.handle, mh.reserved, GPU_IPC_HANDLE_BYTES);
  memcpy(seg->info.event, eh.reserved, GPU_IPC_HANDLE_BYTES);
  *out = seg;
  return 0;
}

void gpu_segment_free(struct gpu *gpu, struct gpu_segment *seg) {
  if (seg == NULL)
    return;
  const struct cuda_api *a = &gpu->api;
  a->cudaSetDevice(seg->info.device);
  a->cudaEventDestroy(seg->done);
  /* Not under another job's NCCL kernels on this GPU (ncclwork.c). */
  gpu_device_free(gpu, seg->info.device, seg->info.ptr);
  free(seg);
}
