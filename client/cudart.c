/*
 * cudart.c - the CUDA runtime for libshardport, loaded at run time; see
 * client/cudart.h.
 *
 * The runtime is looked for once per process: SHARDPORT_CUDART_LIB when
 * set (the only place then), else a runtime this process already loaded
 * (RTLD_NOLOAD: PyTorch's own, so that the trainer's allocations and the
 * library's calls share one runtime), else the usual sonames.  Driver
 * functions come through cudaGetDriverEntryPointByVersion, so libcuda is
 * never named here.  Nothing is ever unloaded (RTLD_NODELETE): the runtime
 * does not support it.
 *
 * The library works on the trainer's threads, whatever their current
 * device, and must not leave a context on a GPU the trainer never used:
 * since CUDA 12, cudaSetDevice makes the device's primary context (about
 * half a GiB of its memory), so setting a device and "restoring" the
 * thread's previous one (device 0 on a thread that never chose one) makes
 * a context there.  Each call that works on a GPU instead retains that
 * GPU's primary context, which the trainer's own tensors there made
 * already, pushes it for its calls and pops and releases it after
 * (with_device): the driver's calls, cuMemGetAddressRange among them, then
 * have the context they need, and the thread's current device is left as
 * it was (docs/gpu.md).
 */
#include "client/cudart.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "build_config.h"

__attribute__((format(printf, 3, 4))) static int say(sp_client *c, int code,
                                                     const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->message, sizeof c->message, fmt, ap);
  va_end(ap);
  return code;
}

#if SP_HAVE_CUDA

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#define RT(X)                                                                  \
  X(cudaGetErrorString)                                                        \
  X(cudaGetLastError)                                                          \
  X(cudaGetDeviceCount)                                                        \
  X(cudaGetDevice)                                                             \
  X(cudaSetDevice)                                                             \
  X(cudaPointerGetAttributes)                                                  \
  X(cudaIpcGetMemHandle)                                                       \
  X(cudaIpcOpenMemHandle)                                                      \
  X(cudaIpcCloseMemHandle)                                                     \
  X(cudaIpcOpenEventHandle)                                                    \
  X(cudaEventSynchronize)                                                      \
  X(cudaEventDestroy)                                                          \
  X(cudaEventCreateWithFlags)                                                  \
  X(cudaEventRecord)                                                           \
  X(cudaStreamCreateWithFlags)                                                 \
  X(cudaStreamDestroy)                                                         \
  X(cudaMemcpyAsync)                                                           \
  X(cudaMallocHost)                                                            \
  X(cudaFreeHost)                                                              \
  X(cudaGetDriverEntryPointByVersion)

#define DRV(X)                                                                 \
  X(cuDeviceGet)                                                               \
  X(cuDeviceGetUuid)                                                           \
  X(cuMemGetAddressRange)                                                      \
  X(cuDevicePrimaryCtxRetain)                                                  \
  X(cuDevicePrimaryCtxRelease)                                                 \
  X(cuCtxPushCurrent)                                                          \
  X(cuCtxPopCurrent)

static struct {
#define MEMBER(name) __typeof__(name) *name;
  RT(MEMBER)
  DRV(MEMBER)
#undef MEMBER
  int loaded;
  char why[256];
} rt;

static pthread_once_t rt_once = PTHREAD_ONCE_INIT;

static const char *const candidates[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so",
};

static void *open_runtime(void) {
  const int flags = RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE;
  const char *env = getenv("SHARDPORT_CUDART_LIB");
  if (env != NULL && env[0] != '\0') {
    void *h = dlopen(env, flags);
    if (h == NULL)
      snprintf(rt.why, sizeof rt.why, "SHARDPORT_CUDART_LIB=%s cannot be "
               "loaded: %s", env, dlerror());
    return h;
  }
  size_t n = sizeof candidates / sizeof candidates[0];
  for (size_t i = 0; i < n; i++) {
    void *h = dlopen(candidates[i], flags | RTLD_NOLOAD);
    if (h != NULL)
      return h;
  }
  for (size_t i = 0; i < n; i++) {
    void *h = dlopen(candidates[i], flags);
    if (h != NULL)
      return h;
  }
  snprintf(rt.why, sizeof rt.why, "no CUDA runtime found (tried %s ... %s; "
           "set SHARDPORT_CUDART_LIB): %s", candidates[0], candidates[n - 1],
           dlerror());
  return NULL;
}

static void load(void) {
  void *h = open_runtime();
  if (h == NULL)
    return;
  void *sym;
#define RESOLVE(name)                                                          \
  if ((sym = dlsym(h, #name)) == NULL) {                                       \
    snprintf(rt.why, sizeof rt.why, "the CUDA runtime lacks %s (CUDA 12.5 "    \
             "or newer is needed)", #name);                                    \
    return;                                                                    \
  }                                                                            \
  rt.name = (__typeof__(rt.name))sym;
  RT(RESOLVE)
#undef RESOLVE
  enum cudaDriverEntryPointQueryResult status;
#define ENTRY(name)                                                            \
  sym = NULL;                                                                  \
  if (rt.cudaGetDriverEntryPointByVersion(#name, &sym, 12000,                  \
                                          cudaEnableDefault, &status) !=       \
          cudaSuccess ||                                                       \
      sym == NULL || status != cudaDriverEntryPointSuccess) {                  \
    rt.cudaGetLastError();                                                     \
    snprintf(rt.why, sizeof rt.why, "the CUDA driver does not provide %s "     \
             "(is there an NVIDIA driver?)", #name);                           \
    return;                                                                    \
  }                                                                            \
  rt.name = (__typeof__(rt.name))sym;
  DRV(ENTRY)
#undef ENTRY
  rt.loaded = 1;
}

static int ready(sp_client *c) {
  pthread_once(&rt_once, load);
  if (!rt.loaded)
    return say(c, SP_EBACKEND, "%s", rt.why);
  return 0;
}

static int cuda_fail(sp_client *c, cudaError_t err, const char *what) {
  rt.cudaGetLastError();
  return say(c, SP_EBACKEND, "%s: CUDA error %d (%s)", what, (int)err,
             rt.cudaGetErrorString(err));
}

/* Makes GPU ordinal's primary context current on the calling thread
 * (see the top of this file); end_device undoes it. */
static CUresult enter_device(int ordinal) {
  CUdevice dev;
  CUcontext ctx;
  CUresult res = rt.cuDeviceGet(&dev, ordinal);
  if (res == CUDA_SUCCESS)
    res = rt.cuDevicePrimaryCtxRetain(&ctx, dev);
  if (res != CUDA_SUCCESS)
    return res;
  res = rt.cuCtxPushCurrent(ctx);
  if (res != CUDA_SUCCESS)
    rt.cuDevicePrimaryCtxRelease(dev);
  return res;
}

/* enter_device, or SP_EBACKEND with the reason in c. */
static int with_device(sp_client *c, int ordinal) {
  CUresult res = enter_device(ordinal);
  if (res != CUDA_SUCCESS)
    return say(c, SP_EBACKEND, "making GPU %d's primary context current: "
               "CUDA driver error %d", ordinal, (int)res);
  return 0;
}

static void end_device(int ordinal) {
  CUcontext ctx;
  CUdevice dev;
  rt.cuCtxPopCurrent(&ctx);
  if (rt.cuDeviceGet(&dev, ordinal) == CUDA_SUCCESS)
    rt.cuDevicePrimaryCtxRelease(dev);
}

static int uuid_name(sp_client *c, int ordinal,
                     char device[CLIENT_CUDA_DEVICE_MAX]) {
  CUdevice dev;
  CUuuid u;
  CUresult res = rt.cuDeviceGet(&dev, ordinal);
  if (res == CUDA_SUCCESS)
    res = rt.cuDeviceGetUuid(&u, dev);
  if (res != CUDA_SUCCESS)
    return say(c, SP_EBACKEND, "cuDeviceGetUuid(%d): CUDA driver error %d",
               ordinal, (int)res);
  const unsigned char *b = (const unsigned char *)u.bytes;
  snprintf(device, CLIENT_CUDA_DEVICE_MAX,
           "cuda:GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10],
           b[11], b[12], b[13], b[14], b[15]);
  return 0;
}

/* The GPU of device memory at addr, or SP_EINVAL for other memory. */
static int device_ordinal(sp_client *c, const void *addr, int *ordinal) {
  struct cudaPointerAttributes attr;
  cudaError_t err = rt.cudaPointerGetAttributes(&attr, addr);
  if (err != cudaSuccess)
    return cuda_fail(c, err, "cudaPointerGetAttributes");
  if (attr.type != cudaMemoryTypeDevice)
    return say(c, SP_EINVAL, "address %p is not device memory", addr);
  *ordinal = attr.device;
  return 0;
}

int client_cuda_device_of(sp_client *c, const void *addr,
                          char device[CLIENT_CUDA_DEVICE_MAX]) {
  int ordinal = 0, rc = ready(c);
  if (rc == 0)
    rc = device_ordinal(c, addr, &ordinal);
  if (rc == 0)
    rc = uuid_name(c, ordinal, device);
  return rc;
}

/* The allocation behind addr on GPU ordinal, its context current. */
static int describe_on(sp_client *c, const void *addr,
                       uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                       uint64_t *offset) {
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult res =
      rt.cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)addr);
  if (res != CUDA_SUCCESS)
    return say(c, SP_EINVAL, "cuMemGetAddressRange(%p): CUDA driver error "
               "%d", addr, (int)res);
  /* The handle names the allocation's base; the daemon opens it there and
   * adds the offset (DESIGN section 8.5). */
  cudaIpcMemHandle_t h;
  cudaError_t err = rt.cudaIpcGetMemHandle(&h, (void *)(uintptr_t)base);
  if (err != cudaSuccess) {
    rt.cudaGetLastError();
    return say(c, SP_EINVAL, "cudaIpcGetMemHandle of the allocation at %p "
               "failed with CUDA error %d (%s); memory of a cuMem "
               "allocation (PyTorch's expandable segments) has no IPC "
               "handle: register it as SP_STORAGE_CUDA_FD", (void *)base,
               (int)err, rt.cudaGetErrorString(err));
  }
  memcpy(handle, h.reserved, CLIENT_CUDA_HANDLE_BYTES);
  *offset = (uint64_t)((uintptr_t)addr - (uintptr_t)base);
  return 0;
}

int client_cuda_describe(sp_client *c, const void *addr,
                         uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                         uint64_t *offset,
                         char device[CLIENT_CUDA_DEVICE_MAX]) {
  int ordinal = 0, rc = ready(c);
  if (rc == 0)
    rc = device_ordinal(c, addr, &ordinal);
  if (rc == 0)
    rc = uuid_name(c, ordinal, device);
  if (rc == 0)
    rc = with_device(c, ordinal);
  if (rc < 0)
    return rc;
  rc = describe_on(c, addr, handle, offset);
  end_device(ordinal);
  return rc;
}

int client_cuda_name(sp_client *c, int ordinal,
                     char device[CLIENT_CUDA_DEVICE_MAX]) {
  int rc = ready(c);
  if (rc < 0)
    return rc;
  int count = 0;
  cudaError_t err = rt.cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return cuda_fail(c, err, "cudaGetDeviceCount");
  if (ordinal < 0 || ordinal >= count)
    return say(c, SP_EINVAL, "this process sees %d GPUs; %d is none of "
               "them", count, ordinal);
  return uuid_name(c, ordinal, device);
}

int client_cuda_ordinal(sp_client *c, const char *device, int *ordinal) {
  int rc = ready(c);
  if (rc < 0)
    return rc;
  int count = 0;
  cudaError_t err = rt.cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return cuda_fail(c, err, "cudaGetDeviceCount");
  for (int d = 0; d < count; d++) {
    char name[CLIENT_CUDA_DEVICE_MAX];
    rc = uuid_name(c, d, name);
    if (rc < 0)
      return rc;
    if (strcasecmp(name, device) == 0) {
      *ordinal = d;
      return 0;
    }
  }
  return say(c, SP_EINVAL, "this process sees no GPU %s (check its "
             "CUDA_VISIBLE_DEVICES)", device);
}

/* Opens the export's segment and waits for its event, the segment's GPU's
 * context current. */
static int open_on(sp_client *c, const uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                   const uint8_t event[CLIENT_CUDA_HANDLE_BYTES],
                   uint64_t size, void **ptr) {
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  memcpy(mh.reserved, handle, CLIENT_CUDA_HANDLE_BYTES);
  memcpy(eh.reserved, event, CLIENT_CUDA_HANDLE_BYTES);
  void *p = NULL;
  int rc = 0;
  cudaError_t err =
      rt.cudaIpcOpenMemHandle(&p, mh, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    rc = cuda_fail(c, err, "cudaIpcOpenMemHandle of the export's segment");
  } else {
    CUdeviceptr base = 0;
    size_t have = 0;
    if (rt.cuMemGetAddressRange(&base, &have, (CUdeviceptr)(uintptr_t)p) !=
            CUDA_SUCCESS ||
        (uintptr_t)base != (uintptr_t)p || have < size)
      rc = say(c, SP_EBADMSG, "bad export reply: the segment's allocation "
               "is smaller than the %llu bytes announced",
               (unsigned long long)size);
  }
  /* The daemon recorded the event once the tensors were assembled: wait
   * for it, so that no tensor is handed out before it is whole. */
  cudaEvent_t ev = NULL;
  if (rc == 0) {
    err = rt.cudaIpcOpenEventHandle(&ev, eh);
    if (err == cudaSuccess)
      err = rt.cudaEventSynchronize(ev);
    if (err != cudaSuccess)
      rc = cuda_fail(c, err, "waiting on the export's completion event");
    if (ev != NULL)
      rt.cudaEventDestroy(ev);
  }
  if (rc < 0 && p != NULL)
    rt.cudaIpcCloseMemHandle(p);
  if (rc == 0)
    *ptr = p;
  return rc;
}

int client_cuda_open(sp_client *c, int ordinal,
                     const uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                     const uint8_t event[CLIENT_CUDA_HANDLE_BYTES],
                     uint64_t size, void **ptr) {
  int rc = ready(c);
  if (rc == 0)
    rc = with_device(c, ordinal);
  if (rc < 0)
    return rc;
  rc = open_on(c, handle, event, size, ptr);
  end_device(ordinal);
  return rc;
}

/* The close runs in the context of the segment's GPU, which the pointer
 * names. */
void client_cuda_close(void *ptr) {
  struct cudaPointerAttributes attr;
  if (!rt.loaded || ptr == NULL ||
      rt.cudaPointerGetAttributes(&attr, ptr) != cudaSuccess ||
      attr.type != cudaMemoryTypeDevice ||
      enter_device(attr.device) != CUDA_SUCCESS)
    return;
  rt.cudaIpcCloseMemHandle(ptr);
  end_device(attr.device);
}

/* Two pinned buffers, a stream that copies into them and an event per
 * buffer that says when its copies are done (client/save.c). */
struct client_cuda_stage {
  int ordinal;
  cudaStream_t stream;
  cudaEvent_t done[2];
  void *buf[2];
};

static int stage_make(sp_client *c, struct client_cuda_stage *s,
                      uint64_t size) {
  cudaError_t err;
  if ((err = rt.cudaStreamCreateWithFlags(&s->stream,
                                          cudaStreamNonBlocking)) !=
      cudaSuccess)
    return cuda_fail(c, err, "cudaStreamCreateWithFlags");
  for (int b = 0; b < 2; b++) {
    if ((err = rt.cudaEventCreateWithFlags(&s->done[b],
                                           cudaEventDisableTiming)) !=
        cudaSuccess)
      return cuda_fail(c, err, "cudaEventCreateWithFlags");
    if ((err = rt.cudaMallocHost(&s->buf[b], (size_t)size)) != cudaSuccess)
      return cuda_fail(c, err, "cudaMallocHost of the save's staging");
  }
  return 0;
}

int client_cuda_stage_new(sp_client *c, int ordinal, uint64_t size,
                          struct client_cuda_stage **out) {
  int rc = ready(c);
  if (rc < 0)
    return rc;
  struct client_cuda_stage *s = calloc(1, sizeof *s);
  if (!s)
    return SP_ENOMEM;
  s->ordinal = ordinal;
  *out = s;
  if ((rc = with_device(c, ordinal)) < 0)
    return rc;
  rc = stage_make(c, s, size);
  end_device(ordinal);
  return rc;
}

int client_cuda_stage_copy(sp_client *c, struct client_cuda_stage *s, int b,
                           uint64_t offset, const void *src, uint64_t len) {
  int rc = with_device(c, s->ordinal);
  if (rc < 0)
    return rc;
  cudaError_t err = rt.cudaMemcpyAsync((char *)s->buf[b] + offset, src,
                                       (size_t)len, cudaMemcpyDeviceToHost,
                                       s->stream);
  rc = err == cudaSuccess ? 0 : cuda_fail(c, err, "cudaMemcpyAsync");
  end_device(s->ordinal);
  return rc;
}

int client_cuda_stage_mark(sp_client *c, struct client_cuda_stage *s, int b) {
  int rc = with_device(c, s->ordinal);
  if (rc < 0)
    return rc;
  cudaError_t err = rt.cudaEventRecord(s->done[b], s->stream);
  rc = err == cudaSuccess ? 0 : cuda_fail(c, err, "cudaEventRecord");
  end_device(s->ordinal);
  return rc;
}

int client_cuda_stage_wait(sp_client *c, struct client_cuda_stage *s, int b,
                           void **host) {
  int rc = with_device(c, s->ordinal);
  if (rc < 0)
    return rc;
  cudaError_t err = rt.cudaEventSynchronize(s->done[b]);
  rc = err == cudaSuccess ? 0 : cuda_fail(c, err, "cudaEventSynchronize");
  end_device(s->ordinal);
  if (rc == 0)
    *host = s->buf[b];
  return rc;
}

void client_cuda_stage_free(struct client_cuda_stage *s) {
  if (!s)
    return;
  if (s->stream && enter_device(s->ordinal) == CUDA_SUCCESS) {
    for (int b = 0; b < 2; b++) {
      if (s->done[b])
        rt.cudaEventSynchronize(s->done[b]);
      if (s->done[b])
        rt.cudaEventDestroy(s->done[b]);
      if (s->buf[b])
        rt.cudaFreeHost(s->buf[b]);
    }
    rt.cudaStreamDestroy(s->stream);
    end_device(s->ordinal);
  }
  free(s);
}

#else /* !SP_HAVE_CUDA */

static int unsupported(sp_client *c) {
  return say(c, SP_EBACKEND, "this libshardport was built without CUDA "
             "support");
}

int client_cuda_describe(sp_client *c, const void *addr,
                         uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                         uint64_t *offset,
                         char device[CLIENT_CUDA_DEVICE_MAX]) {
  (void)addr, (void)handle, (void)offset, (void)device;
  return unsupported(c);
}

int client_cuda_device_of(sp_client *c, const void *addr,
                          char device[CLIENT_CUDA_DEVICE_MAX]) {
  (void)addr, (void)device;
  return unsupported(c);
}

int client_cuda_name(sp_client *c, int ordinal,
                     char device[CLIENT_CUDA_DEVICE_MAX]) {
  (void)ordinal, (void)device;
  return unsupported(c);
}

int client_cuda_ordinal(sp_client *c, const char *device, int *ordinal) {
  (void)device, (void)ordinal;
  return unsupported(c);
}

int client_cuda_open(sp_client *c, int ordinal,
                     const uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                     const uint8_t event[CLIENT_CUDA_HANDLE_BYTES],
                     uint64_t size, void **ptr) {
  (void)ordinal, (void)handle, (void)event, (void)size, (void)ptr;
  return unsupported(c);
}

void client_cuda_close(void *ptr) { (void)ptr; }

int client_cuda_stage_new(sp_client *c, int ordinal, uint64_t size,
                          struct client_cuda_stage **out) {
  (void)ordinal, (void)size, (void)out;
  return unsupported(c);
}

int client_cuda_stage_copy(sp_client *c, struct client_cuda_stage *s, int b,
                           uint64_t offset, const void *src, uint64_t len) {
  (void)s, (void)b, (void)offset, (void)src, (void)len;
  return unsupported(c);
}

int client_cuda_stage_mark(sp_client *c, struct client_cuda_stage *s, int b) {
  (void)s, (void)b;
  return unsupported(c);
}

int client_cuda_stage_wait(sp_client *c, struct client_cuda_stage *s, int b,
                           void **host) {
  (void)s, (void)b, (void)host;
  return unsupported(c);
}

void client_cuda_stage_free(struct client_cuda_stage *s) { (void)s; }

#endif
