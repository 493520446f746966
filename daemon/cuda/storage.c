/*
 * storage.c - CUDA storages opened from what trainers register; see
 * gpu_storage_open in gpu.h.
 *
 * A legacy IPC handle names the base of a cudaMalloc allocation, and may be
 * opened only once per process and device (a second open of the same handle
 * under another device fails; DESIGN section 8.5), so every allocation is
 * opened once and its mapping shared by all the storages in it, whatever
 * rank or job registered them, with a count of its users.  A cuMem
 * descriptor (expandable segments) has no identity of its own: it is an
 * open of the driver's control device, so the descriptors of any two
 * allocations have one st_dev and st_ino (docs/fakes.md), and nothing
 * tells from the descriptor which allocation it names.  Every storage
 * registered by descriptor is therefore imported, mapped at a new address
 * range of its own and given read-only access: the daemon only ever reads a trainer's
 * memory, and for these allocations the hardware enforces it (where the
 * driver refuses a read-only mapping, it is mapped read-write like an IPC
 * mapping).  IPC mappings cannot be made read-only; there the engine's
 * sources are const and only ever copied from.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/fail.h"
#include "daemon/cuda/internal.h"
#include "shardport.h"

struct gpu_import {
  struct gpu_import *next;
  enum gpu_storage_kind kind;
  int device;
  uint8_t handle[GPU_IPC_HANDLE_BYTES]; /* IPC */
  CUmemGenericAllocationHandle mem;     /* FD: the imported allocation */
  uint8_t *base;
  uint64_t size; /* bytes usable from base */
  size_t refs;
};

/* The opened IPC allocation of handle on device, if any.  Only IPC
 * handles are looked up: a cuMem descriptor names no allocation the daemon
 * could compare. */
static struct gpu_import *find_ipc(struct gpu *gpu, int device,
                                   const uint8_t *handle) {
  for (struct gpu_import *im = gpu->imports; im != NULL; im = im->next)
    if (im->kind == GPU_STORAGE_IPC && im->device == device &&
        memcmp(im->handle, handle, GPU_IPC_HANDLE_BYTES) == 0)
      return im;
  return NULL;
}

/* Opens an IPC handle on device and learns the allocation's extent. */
static int open_ipc(struct gpu *gpu, struct gpu_import *im, char *msg,
                    size_t msglen) {
  const struct cuda_api *a = &gpu->api;
  cudaIpcMemHandle_t h;
  memcpy(h.reserved, im->handle, sizeof h.reserved);
  void *ptr = NULL;
  cudaError_t err =
      a->cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    a->cudaGetLastError();
    return sp__failf(msg, msglen, SP_EBADFD,
                     "cudaIpcOpenMemHandle failed with CUDA error %d (%s): the "
                     "handle is not an allocation of a live process on this "
                     "node's %s",
                     (int)err, a->cudaGetErrorString(err),
                     gpu_device_name(gpu, im->device));
  }
  struct cudaPointerAttributes attr;
  CUdeviceptr base = 0;
  size_t size = 0;
  int rc = 0;
  err = a->cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess)
    rc = gpu_cuda_fail(gpu, err, "cudaPointerGetAttributes", msg, msglen);
  else if (attr.type != cudaMemoryTypeDevice || attr.device != im->device)
    rc = sp__failf(msg, msglen, SP_EINVAL,
                   "the handle's memory is not on %s, the device it was "
                   "registered for",
                   gpu_device_name(gpu, im->device));
  else if (a->cuMemGetAddressRange(&base, &size, (CUdeviceptr)ptr) !=
           CUDA_SUCCESS)
    rc = sp__failf(msg, msglen, SP_EBACKEND,
                   "cuMemGetAddressRange of an opened IPC handle failed");
  if (rc != 0) {
    a->cudaIpcCloseMemHandle(ptr);
    return rc;
  }
  /* The handle names the allocation's base, which is where it opens. */
  im->base = ptr;
  im->size = size - ((uint64_t)(uintptr_t)ptr - (uint64_t)base);
  return 0;
}

/* The read-only access descriptors of a cuMem mapping on device: access
 * is per device (cuMemSetAccess), and a copy reads through the GPU whose
 * stream runs it, which is the owner's GPU (copy.c), so every GPU that can
 * reach device directly is granted as well as device itself.  A GPU
 * without peer access to it gets none: its copies would be an illegal
 * address (docs/gpu.md, Storages).  Returns how many. */
static size_t readers(struct gpu *gpu, int device, CUmemAccessDesc *out) {
  size_t n = 0;
  for (int d = 0; d < gpu->ndevices; d++) {
    int can = d == device;
    if (!can && gpu->api.cudaDeviceCanAccessPeer(&can, d, device) != cudaSuccess) {
      gpu->api.cudaGetLastError();
      can = 0;
    }
    if (can)
      out[n++] = (CUmemAccessDesc){
          .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d},
          .flags = CU_MEM_ACCESS_FLAGS_PROT_READ,
      };
  }
  return n;
}

/* Imports a cuMem descriptor and maps need bytes of it read-only. */
static int open_fd(struct gpu *gpu, struct gpu_import *im, int fd,
                   uint64_t need, char *msg, size_t msglen) {
  const struct cuda_api *a = &gpu->api;
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = im->device},
  };
  size_t gran = 0;
  CUresult res = a->cuMemGetAllocationGranularity(
      &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (res != CUDA_SUCCESS || gran == 0)
    return cuda_api_driver_error(res, "cuMemGetAllocationGranularity", msg,
                                 msglen);
  uint64_t size = (need + gran - 1) / gran * gran;
  res = a->cuMemImportFromShareableHandle(
      &im->mem, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (res != CUDA_SUCCESS)
    return sp__failf(
        msg, msglen, SP_EBADFD,
        "cuMemImportFromShareableHandle failed with CUDA driver "
        "error %d: the descriptor is not a cuMem allocation of this "
        "node",
        (int)res);
  CUdeviceptr ptr = 0;
  const char *what = "cuMemAddressReserve";
  res = a->cuMemAddressReserve(&ptr, size, gran, 0, 0);
  if (res == CUDA_SUCCESS) {
    what = "cuMemMap";
    res = a->cuMemMap(ptr, size, 0, im->mem, 0);
    if (res == CUDA_SUCCESS) {
      CUmemAccessDesc access[GPU_MAX_DEVICES];
      size_t naccess = readers(gpu, im->device, access);
      what = "cuMemSetAccess";
      res = a->cuMemSetAccess(ptr, size, access, naccess);
      if (res == CUDA_ERROR_INVALID_VALUE || res == CUDA_ERROR_NOT_SUPPORTED) {
        /* A driver that offers no read-only device mapping: read-write,
         * as an IPC mapping is; the engine still only copies from it. */
        for (size_t i = 0; i < naccess; i++)
          access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        res = a->cuMemSetAccess(ptr, size, access, naccess);
      }
      if (res != CUDA_SUCCESS)
        a->cuMemUnmap(ptr, size);
    }
    if (res != CUDA_SUCCESS)
      a->cuMemAddressFree(ptr, size);
  }
  if (res != CUDA_SUCCESS) {
    a->cuMemRelease(im->mem);
    return sp__failf(
        msg, msglen, SP_EBADFD,
        "%s of %llu bytes of the cuMem allocation failed with CUDA "
        "driver error %d (is the allocation shorter than offset + "
        "length?)",
        what, (unsigned long long)size, (int)res);
  }
  im->base = (uint8_t *)(uintptr_t)ptr;
  im->size = size;
  return 0;
}

/* Neither cuMemUnmap nor cudaIpcCloseMemHandle waits for the copies still
 * queued on the memory it takes away (docs/fakes.md): a copy that runs
 * after it reads an unmapped address and ends its GPU's context.  A run of
 * the engine reads an import only while its storage is registered, and
 * waits for its own copies before it gives its streams back, but one that
 * gave up waiting gives them back busy: every stream given back is drained
 * first. */
static void close_import(struct gpu *gpu, struct gpu_import *im) {
  const struct cuda_api *a = &gpu->api;
  gpu_streams_drain(gpu);
  a->cudaSetDevice(im->device);
  if (im->kind == GPU_STORAGE_IPC) {
    a->cudaIpcCloseMemHandle(im->base);
  } else {
    a->cuMemUnmap((CUdeviceptr)(uintptr_t)im->base, im->size);
    a->cuMemAddressFree((CUdeviceptr)(uintptr_t)im->base, im->size);
    a->cuMemRelease(im->mem);
  }
}

int gpu_storage_open(struct gpu *gpu, int device, enum gpu_storage_kind kind,
                     const uint8_t handle[GPU_IPC_HANDLE_BYTES], int fd,
                     uint64_t offset, uint64_t length, struct gpu_mapping *out,
                     char *msg, size_t msglen) {
  memset(out, 0, sizeof *out);
  uint64_t need = offset + length;
  int rc = gpu_set_device(gpu, device, msg, msglen);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&gpu->imports_lock);
  struct gpu_import *im =
      kind == GPU_STORAGE_IPC ? find_ipc(gpu, device, handle) : NULL;
  bool fresh = im == NULL;
  if (fresh) {
    im = calloc(1, sizeof *im);
    if (im == NULL) {
      rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    } else {
      im->kind = kind;
      im->device = device;
      if (kind == GPU_STORAGE_IPC)
        memcpy(im->handle, handle, GPU_IPC_HANDLE_BYTES);
      rc = kind == GPU_STORAGE_IPC ? open_ipc(gpu, im, msg, msglen)
                                   : open_fd(gpu, im, fd, need, msg, msglen);
      if (rc != 0) {
        free(im);
        im = NULL;
      }
    }
  }
  if (rc == 0 && need > im->size) {
    rc = sp__failf(msg, msglen, SP_EBADFD,
                   "offset + length = %llu bytes, but the allocation has %llu",
                   (unsigned long long)need, (unsigned long long)im->size);
    if (fresh) {
      close_import(gpu, im);
      free(im);
    }
    im = NULL;
  }
  if (rc == 0) {
    if (fresh) {
      im->next = gpu->imports;
      gpu->imports = im;
      gpu->nimports++;
    }
    im->refs++;
    out->import = im;
    out->data = im->base + offset;
    out->device = device;
  }
  pthread_mutex_unlock(&gpu->imports_lock);
  return rc;
}

void gpu_storage_close(struct gpu *gpu, struct gpu_mapping *m) {
  struct gpu_import *im = m->import;
  if (im == NULL)
    return;
  pthread_mutex_lock(&gpu->imports_lock);
  if (--im->refs == 0) {
    for (struct gpu_import **p = &gpu->imports; *p != NULL; p = &(*p)->next)
      if (*p == im) {
        *p = im->next;
        break;
      }
    gpu->nimports--;
    close_import(gpu, im);
    free(im);
  }
  pthread_mutex_unlock(&gpu->imports_lock);
  memset(m, 0, sizeof *m);
}

size_t gpu_storage_open_count(const struct gpu *gpu) { return gpu->nimports; }
