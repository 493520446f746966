/*
 * gpu.c - the CUDA backend's devices: loading, probing, peer access and
 * the copy streams the engine's runs take; see gpu.h.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "daemon/cuda/internal.h"
#include "proto/fail.h"
#include "shardport.h"

/* The errors driver_types.h (CUDA 13.0) documents as leaving "the process
 * in an inconsistent state" where "any further CUDA work will return the
 * same error". */
static bool is_sticky(cudaError_t err) {
  switch ((int)err) {
  case 226: /* cudaErrorContained */
  case 700: /* cudaErrorIllegalAddress */
  case 702: /* cudaErrorLaunchTimeout */
  case 710: /* cudaErrorAssert */
  case 714: /* cudaErrorHardwareStackError */
  case 715: /* cudaErrorIllegalInstruction */
  case 716: /* cudaErrorMisalignedAddress */
  case 717: /* cudaErrorInvalidAddressSpace */
  case 718: /* cudaErrorInvalidPc */
  case 719: /* cudaErrorLaunchFailure */
  case 721: /* cudaErrorTensorMemoryLeak */
  case 810: /* cudaErrorMpsClientTerminated */
  case 911: /* cudaErrorExternalDevice */
    return true;
  default:
    return false;
  }
}

static int failure_sentence(const struct gpu *gpu, int device, int err,
                            char *why, size_t whylen) {
  return sp__failf(why, whylen, SP_EBACKEND,
                  "%s failed with CUDA error %d (%s), which ends its CUDA "
                  "context: shardportd takes no CUDA work on it until it "
                  "restarts",
                  gpu->devices[device].name, err,
                  gpu->api.cudaGetErrorString((cudaError_t)err));
}

int gpu_cuda_fail(const struct gpu *gpu, cudaError_t err, const char *what,
                  char *msg, size_t msglen) {
  int device = -1;
  if (!is_sticky(err) || gpu->api.cudaGetDevice(&device) != cudaSuccess ||
      device < 0 || device >= gpu->ndevices)
    return cuda_api_cuda_error(&gpu->api, err, what, msg, msglen);
  int healthy = 0;
  atomic_compare_exchange_strong(&gpu->faults[device], &healthy, (int)err);
  char why[SP_ERRMSG_MAX / 2];
  failure_sentence(gpu, device, (int)err, why, sizeof why);
  return sp__failf(msg, msglen, SP_EBACKEND, "%s: %s", what, why);
}

int gpu_failure(const struct gpu *gpu, int from, char *why, size_t whylen) {
  for (int d = from < 0 ? 0 : from; d < gpu->ndevices; d++) {
    int err = atomic_load(&gpu->faults[d]);
    if (err != 0) {
      failure_sentence(gpu, d, err, why, whylen);
      return d;
    }
  }
  return -1;
}

bool gpu_device_usable(const struct gpu *gpu, int device) {
  return gpu->devices[device].skipped[0] == '\0' &&
         atomic_load(&gpu->faults[device]) == 0;
}

int gpu_set_device(const struct gpu *gpu, int device, char *msg,
                   size_t msglen) {
  if (device >= 0 && device < gpu->ndevices &&
      gpu->devices[device].skipped[0] != '\0')
    return sp__failf(msg, msglen, SP_EBACKEND, "%s is not served: %s",
                     gpu->devices[device].name, gpu->devices[device].skipped);
  int fault = device >= 0 && device < gpu->ndevices
                  ? atomic_load(&gpu->faults[device])
                  : 0;
  if (fault != 0)
    return failure_sentence(gpu, device, fault, msg, msglen);
  cudaError_t err = gpu->api.cudaSetDevice(device);
  if (err == cudaSuccess)
    return 0;
  char what[64];
  snprintf(what, sizeof what, "cudaSetDevice(%d)", device);
  return gpu_cuda_fail(gpu, err, what, msg, msglen);
}

/* Lets every GPU read every other one directly where the hardware allows;
 * elsewhere the runtime stages peer copies through the host, which is
 * slower but correct, so a refusal is not an error. */
static void enable_peers(struct gpu *gpu) {
  for (int a = 0; a < gpu->ndevices; a++) {
    if (!gpu_device_usable(gpu, a) || gpu->api.cudaSetDevice(a) != cudaSuccess)
      continue;
    for (int b = 0; b < gpu->ndevices; b++) {
      int can = 0;
      if (a == b || !gpu_device_usable(gpu, b) ||
          gpu->api.cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)
        continue;
      cudaError_t err = gpu->api.cudaDeviceEnablePeerAccess(b, 0);
      if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled)
        gpu->api.cudaGetLastError();
    }
  }
}

struct gpu_stream {
  struct gpu_stream *next;
  int device;
  cudaStream_t stream;
};

int gpu_stream_take(struct gpu *gpu, int device, cudaStream_t *out,
                    char *msg, size_t msglen) {
  pthread_mutex_lock(&gpu->streams_lock);
  for (struct gpu_stream **p = &gpu->spare_streams; *p != NULL;
       p = &(*p)->next) {
    struct gpu_stream *gs = *p;
    if (gs->device != device ||
        gpu->api.cudaStreamQuery(gs->stream) != cudaSuccess)
      continue;
    *p = gs->next;
    pthread_mutex_unlock(&gpu->streams_lock);
    *out = gs->stream;
    free(gs);
    return 0;
  }
  pthread_mutex_unlock(&gpu->streams_lock);
  /* A busy one was given back by a run that gave up: its work is not this
   * run's to wait for. */
  gpu->api.cudaGetLastError();
  int rc = gpu_set_device(gpu, device, msg, msglen);
  if (rc != 0)
    return rc;
  cudaError_t err = gpu->api.cudaStreamCreateWithFlags(out, cudaStreamNonBlocking);
  return err == cudaSuccess
             ? 0
             : gpu_cuda_fail(gpu, err, "cudaStreamCreateWithFlags", msg, msglen);
}

void gpu_stream_give(struct gpu *gpu, int device, cudaStream_t stream) {
  struct gpu_stream *gs = malloc(sizeof *gs);
  if (gs == NULL) {
    /* Not kept: what it still runs ends before it goes. */
    gpu->api.cudaStreamSynchronize(stream);
    gpu->api.cudaStreamDestroy(stream);
    return;
  }
  *gs = (struct gpu_stream){.device = device, .stream = stream};
  pthread_mutex_lock(&gpu->streams_lock);
  gs->next = gpu->spare_streams;
  gpu->spare_streams = gs;
  pthread_mutex_unlock(&gpu->streams_lock);
}

int gpu_stream_watch(struct gpu *gpu, int device, cudaStream_t stream,
                     char *msg, size_t msglen) {
  struct gpu_stream *gs = malloc(sizeof *gs);
  if (gs == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM,
                     "out of memory keeping a communicator's stream");
  *gs = (struct gpu_stream){.device = device, .stream = stream};
  pthread_mutex_lock(&gpu->streams_lock);
  gs->next = gpu->comm_streams;
  gpu->comm_streams = gs;
  pthread_mutex_unlock(&gpu->streams_lock);
  return 0;
}

void gpu_stream_unwatch(struct gpu *gpu, cudaStream_t stream) {
  pthread_mutex_lock(&gpu->streams_lock);
  for (struct gpu_stream **p = &gpu->comm_streams; *p != NULL;
       p = &(*p)->next)
    if ((*p)->stream == stream) {
      struct gpu_stream *gs = *p;
      *p = gs->next;
      free(gs);
      break;
    }
  pthread_mutex_unlock(&gpu->streams_lock);
}

void gpu_streams_drain(struct gpu *gpu) {
  pthread_mutex_lock(&gpu->streams_lock);
  struct gpu_stream *lists[] = {gpu->spare_streams, gpu->comm_streams};
  for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++)
    for (struct gpu_stream *gs = lists[l]; gs != NULL; gs = gs->next)
      if (gpu->api.cudaStreamSynchronize(gs->stream) != cudaSuccess)
        gpu->api.cudaGetLastError();
  pthread_mutex_unlock(&gpu->streams_lock);
}

static void destroy_streams(struct gpu *gpu) {
  while (gpu->spare_streams != NULL) {
    struct gpu_stream *gs = gpu->spare_streams;
    gpu->spare_streams = gs->next;
    gpu->api.cudaSetDevice(gs->device);
    gpu->api.cudaStreamDestroy(gs->stream);
    free(gs);
  }
}

/* A GPU in exclusive-process mode takes one process's context at a time,
 * and one in prohibited mode none (driver_types.h, cudaComputeMode): a
 * context of the daemon's would keep every trainer off the first, and the
 * second has no use.  Such a GPU is skipped before any context is made on
 * it, with the reason status shows.  Returns how many GPUs are served. */
static int skip_unshared(struct gpu *gpu) {
  int served = 0;
  for (int d = 0; d < gpu->ndevices; d++) {
    struct gpu_device *dev = &gpu->devices[d];
    if (dev->info.compute_mode == cudaComputeModeExclusiveProcess)
      snprintf(dev->skipped, sizeof dev->skipped,
               "it is in exclusive-process compute mode, where a context of "
               "shardportd's would keep the trainers off it (nvidia-smi "
               "--compute-mode=DEFAULT shares it)");
    else if (dev->info.compute_mode == cudaComputeModeProhibited)
      snprintf(dev->skipped, sizeof dev->skipped,
               "it is in prohibited compute mode: no process may use it");
    else
      served++;
  }
  return served;
}

int gpu_open(struct gpu **out, char *why, size_t whylen) {
  struct gpu *gpu = calloc(1, sizeof *gpu);
  if (gpu == NULL) {
    snprintf(why, whylen, "out of memory");
    return SP_ENOMEM;
  }
  int rc = cuda_api_load(&gpu->api, why, whylen);
  if (rc != 0) {
    free(gpu);
    return rc;
  }
  struct cuda_device_info info[GPU_MAX_DEVICES];
  int count = cuda_api_probe(&gpu->api, info, GPU_MAX_DEVICES, why, whylen);
  if (count > GPU_MAX_DEVICES) {
    snprintf(why, whylen,
             "%d GPUs are visible; shardportd serves at most %d (narrow "
             "CUDA_VISIBLE_DEVICES)",
             count, GPU_MAX_DEVICES);
    count = SP_EBACKEND;
  } else if (count == 0) {
    snprintf(why, whylen, "no CUDA device is visible");
    count = SP_EBACKEND;
  }
  if (count < 0) {
    cuda_api_unload(&gpu->api);
    free(gpu);
    return count;
  }
  gpu->ndevices = count;
  gpu->faults = calloc((size_t)count, sizeof *gpu->faults);
  if (gpu->faults == NULL) {
    cuda_api_unload(&gpu->api);
    free(gpu);
    return sp__failf(why, whylen, SP_ENOMEM, "out of memory");
  }
  pthread_mutex_init(&gpu->imports_lock, NULL);
  pthread_mutex_init(&gpu->streams_lock, NULL);
  gpu_nccl_init(gpu);
  for (int d = 0; d < count; d++) {
    gpu->devices[d].info = info[d];
    /* A UUID string is "GPU-" and 36 characters: the precision only tells
     * the compiler that the name fits. */
    snprintf(gpu->devices[d].name, sizeof gpu->devices[d].name, "cuda:%.*s",
             (int)(sizeof gpu->devices[d].name - sizeof "cuda:"),
             info[d].uuid_str);
  }
  if (skip_unshared(gpu) == 0) {
    rc = sp__failf(why, whylen, SP_EBACKEND,
                   "no GPU can be served: %s %s", gpu->devices[0].name,
                   gpu->devices[0].skipped);
    gpu_close(gpu);
    return rc;
  }
  enable_peers(gpu);
  for (int d = 0; d < count && rc == 0; d++) {
    if (gpu->devices[d].skipped[0] != '\0')
      continue;
    /* The GPU's context is made now, not in the first export. */
    rc = gpu_set_device(gpu, d, why, whylen);
  }
  if (rc != 0) {
    gpu_close(gpu);
    return rc;
  }
  *out = gpu;
  return 0;
}

void gpu_close(struct gpu *gpu) {
  if (gpu == NULL)
    return;
  /* A helper still ending communicators runs NCCL's code: the libraries
   * stay loaded, and the process exits around it. */
  if (!gpu_nccl_fini(gpu))
    return;
  destroy_streams(gpu);
  pthread_mutex_destroy(&gpu->streams_lock);
  pthread_mutex_destroy(&gpu->imports_lock);
  cuda_api_unload(&gpu->api);
  free(gpu->faults);
  free(gpu);
}

void gpu_describe(const struct gpu *gpu, char *out, size_t outlen) {
  size_t used = (size_t)snprintf(out, outlen, "%d GPU%s (", gpu->ndevices,
                                 gpu->ndevices == 1 ? "" : "s");
  for (int d = 0; d < gpu->ndevices && used < outlen; d++)
    used += (size_t)snprintf(out + used, outlen - used, "%s%s",
                             d > 0 ? ", " : "",
                             gpu->devices[d].info.uuid_str);
  for (int d = 0; d < gpu->ndevices && used < outlen; d++)
    if (gpu->devices[d].skipped[0] != '\0')
      used += (size_t)snprintf(out + used, outlen - used, "; %s skipped: %s",
                               gpu->devices[d].info.uuid_str,
                               gpu->devices[d].skipped);
  const struct cuda_api *a = &gpu->api;
  if (used < outlen)
    snprintf(out + used, outlen - used,
             "); CUDA runtime %d.%d, driver %d.%d, NCCL %d.%d.%d",
             a->runtime_version / 1000, a->runtime_version % 1000 / 10,
             a->driver_version / 1000, a->driver_version % 1000 / 10,
             a->nccl_version / 10000, a->nccl_version / 100 % 100,
             a->nccl_version % 100);
}

int gpu_device_count(const struct gpu *gpu) { return gpu->ndevices; }

int gpu_find_device(const struct gpu *gpu, const char *name, size_t len) {
  static const char prefix[] = "cuda:";
  if (len >= sizeof prefix - 1 && memcmp(name, prefix, sizeof prefix - 1) == 0) {
    name += sizeof prefix - 1;
    len -= sizeof prefix - 1;
  }
  for (int d = 0; d < gpu->ndevices; d++) {
    const char *uuid = gpu->devices[d].info.uuid_str;
    if (strlen(uuid) == len && strncasecmp(uuid, name, len) == 0)
      return d;
  }
  return -1;
}

const char *gpu_device_name(const struct gpu *gpu, int device) {
  return gpu->devices[device].name;
}

const uint8_t *gpu_device_uuid(const struct gpu *gpu, int device) {
  return gpu->devices[device].info.uuid;
}
