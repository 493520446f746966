/*
 * handle.c - the IPC handle inside the bytes a trainer registers; see
 * gpu_handle_decode in gpu.h.
 *
 * PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp,
 * shareIpcHandle) writes a storage's handle as
 *     [SHAREABLE_HANDLE_VERSION][type][payload]
 * with type 'c' (a cudaMalloc block: the 64-byte cudaIpcMemHandle_t of the
 * block's segment base) or 'e' (an expandable segment: sizes and cuMem
 * handles, not an IPC handle).  _share_cuda_() returns those bytes and,
 * apart, the storage's byte offset from that base.  Older releases
 * (1.13, which Debian packages, among them) returned the 64 handle bytes
 * alone; versioned releases wrote version 2 for years and 3 from PyTorch
 * 2.13, with the 'c' payload unchanged.
 */
#include <stdio.h>
#include <string.h>

#include "daemon/cuda/gpu.h"
#include "shardport.h"

/* The newest version byte whose 'c' layout is known. */
#define TORCH_HANDLE_VERSION_MAX 3
#define TORCH_TYPE_CUDA_MALLOC 'c'
#define TORCH_TYPE_EXPANDABLE 'e'

int gpu_handle_decode(const uint8_t *bytes, size_t len,
                      uint8_t out[GPU_IPC_HANDLE_BYTES], char *why,
                      size_t whylen) {
  if (len == GPU_IPC_HANDLE_BYTES) {
    memcpy(out, bytes, GPU_IPC_HANDLE_BYTES);
    return 0;
  }
  if (len >= 2 && bytes[1] == TORCH_TYPE_EXPANDABLE) {
    snprintf(why, whylen,
             "the handle is PyTorch's for an expandable segment, which has "
             "no IPC handle: register the storage with kind \"cuda_fd\" "
             "(a cuMem descriptor) or allocate it with "
             "expandable_segments:False");
    return SP_EINVAL;
  }
  if (len == GPU_IPC_HANDLE_BYTES + 2 && bytes[1] == TORCH_TYPE_CUDA_MALLOC) {
    if (bytes[0] < 1 || bytes[0] > TORCH_HANDLE_VERSION_MAX) {
      snprintf(why, whylen,
               "PyTorch handle version %u is not known (1 to %d are)",
               bytes[0], TORCH_HANDLE_VERSION_MAX);
      return SP_EINVAL;
    }
    memcpy(out, bytes + 2, GPU_IPC_HANDLE_BYTES);
    return 0;
  }
  snprintf(why, whylen,
           "a handle of %zu bytes is neither a cudaIpcMemHandle_t (%d bytes) "
           "nor PyTorch's _share_cuda_() handle (%d bytes: version, 'c', "
           "handle)",
           len, GPU_IPC_HANDLE_BYTES, GPU_IPC_HANDLE_BYTES + 2);
  return SP_EINVAL;
}
