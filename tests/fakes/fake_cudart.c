/*
 * fake_cudart.c - the fake CUDA runtime: configuration, devices, errors,
 * versions and the driver entry points.  Memory lives in fake_memory.c,
 * streams and events in fake_stream.c.  docs/fakes.md is the contract.
 *
 * Environment (read once, at the first call):
 *   SHARDPORT_FAKE_GPUS      physical devices on this "machine" (default 2);
 *                            0 behaves like a machine without the driver:
 *                            every device call answers error 35.
 *   SHARDPORT_FAKE_NODE      which machine (default 0): device UUIDs derive
 *                            from it, and IPC handles do not cross it.
 *   CUDA_VISIBLE_DEVICES     as with the real runtime: indices or UUIDs.
 *   SHARDPORT_FAKE_MEM_MB    device memory per device and process (0: no
 *                            limit, the default).
 *   SHARDPORT_FAKE_DELAY_US  sleep before each stream operation runs, so
 *                            that missing synchronisation shows.
 *   SHARDPORT_FAKE_POISON    0 leaves new device memory zeroed instead of
 *                            filled with 0xa5 (real memory is not zeroed).
 *   SHARDPORT_FAKE_P2P       0 makes peer access unsupported.
 *   SHARDPORT_FAKE_FAULT     PHYS:N: the Nth copy or memset on physical
 *                            device PHYS is an illegal address (sticky).
 *   SHARDPORT_FAKE_COMPUTE_MODE  PHYS:MODE,...: a physical device's compute
 *                            mode (default, exclusive_process, prohibited).
 *   SHARDPORT_FAKE_CTX_MB    device memory a primary context takes (0).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "fake.h"

static struct fake_config config;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static _Thread_local int current_device;
static _Thread_local cudaError_t last_error;

long fake_env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0')
    return dflt;
  char *end;
  long v = strtol(s, &end, 10);
  return *end != '\0' || v < 0 ? -1 : v;
}

static void physical_uuid(int phys, unsigned char out[16]) {
  /* splitmix64 of (node, index): stable across processes and runs, and
   * different between machines, like real UUIDs. */
  uint64_t x = ((uint64_t)config.node << 32) ^ (uint64_t)phys ^ 0x5350464bULL;
  for (int half = 0; half < 2; half++) {
    x += 0x9e3779b97f4a7c15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    memcpy(out + 8 * half, &z, 8);
  }
}

static unsigned physical_bus(int phys) { return (0x18u + 0x10u * (unsigned)phys) & 0xffu; }

/* One CUDA_VISIBLE_DEVICES entry: an index, or a UUID ("GPU-..." or a
 * prefix of one).  -1 when it names no device. */
static int visible_entry(const char *tok, size_t len, int nphys) {
  if (len == 0)
    return -1;
  if (len > 4 && strncmp(tok, "GPU-", 4) == 0) {
    for (int p = 0; p < nphys; p++) {
      unsigned char u[16];
      char s[48];
      physical_uuid(p, u);
      snprintf(s, sizeof(s),
               "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
               "%02x%02x%02x%02x%02x%02x",
               u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9],
               u[10], u[11], u[12], u[13], u[14], u[15]);
      if (len <= strlen(s) && strncmp(s, tok, len) == 0)
        return p;
    }
    return -1;
  }
  int v = 0;
  for (size_t i = 0; i < len; i++) {
    if (tok[i] < '0' || tok[i] > '9' || v > 1000)
      return -1;
    v = v * 10 + (tok[i] - '0');
  }
  return v < nphys ? v : -1;
}

/* As the real runtime does, the list stops at the first entry that names
 * no device (or one already listed); an empty list hides every device. */
static void parse_visible(int nphys) {
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  config.ngpus = 0;
  if (vis == NULL) {
    for (int p = 0; p < nphys; p++)
      config.physical[config.ngpus++] = p;
    return;
  }
  const char *s = vis;
  while (*s != '\0' && config.ngpus < FAKE_MAX_GPUS) {
    size_t len = strcspn(s, ",");
    int p = visible_entry(s, len, nphys);
    for (int i = 0; i < config.ngpus && p >= 0; i++)
      if (config.physical[i] == p)
        p = -1;
    if (p < 0)
      break;
    config.physical[config.ngpus++] = p;
    s += len;
    if (*s == ',')
      s++;
  }
}

/* SHARDPORT_FAKE_COMPUTE_MODE: "PHYS:MODE" entries, comma-separated; an
 * entry that does not parse is ignored, as a typo must not change any
 * other device. */
static void parse_compute_modes(void) {
  const char *s = getenv("SHARDPORT_FAKE_COMPUTE_MODE");
  static const struct {
    const char *name;
    enum cudaComputeMode mode;
  } modes[] = {
      {"default", cudaComputeModeDefault},
      {"exclusive_process", cudaComputeModeExclusiveProcess},
      {"prohibited", cudaComputeModeProhibited},
  };
  while (s != NULL && *s != '\0') {
    size_t len = strcspn(s, ",");
    int phys, used = 0;
    if (sscanf(s, "%d:%n", &phys, &used) == 1 && used > 0 && phys >= 0 &&
        phys < FAKE_MAX_GPUS)
      for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
        if (len - (size_t)used == strlen(modes[i].name) &&
            strncmp(s + used, modes[i].name, len - (size_t)used) == 0)
          config.compute_mode[phys] = modes[i].mode;
    s += len;
    if (*s == ',')
      s++;
  }
}

static void config_init(void) {
  long gpus = fake_env_long("SHARDPORT_FAKE_GPUS", 2);
  long node = fake_env_long("SHARDPORT_FAKE_NODE", 0);
  long mem = fake_env_long("SHARDPORT_FAKE_MEM_MB", 0);
  long delay = fake_env_long("SHARDPORT_FAKE_DELAY_US", 0);
  config.node = node < 0 ? 0 : (uint32_t)node;
  config.mem_limit = mem <= 0 ? 0 : (size_t)mem << 20;
  config.delay_us = delay <= 0 ? 0 : (unsigned)delay;
  config.poison = fake_env_long("SHARDPORT_FAKE_POISON", 1) != 0;
  config.p2p = fake_env_long("SHARDPORT_FAKE_P2P", 1) != 0;
  long ctx_mb = fake_env_long("SHARDPORT_FAKE_CTX_MB", 0);
  config.ctx_bytes = ctx_mb <= 0 ? 0 : (size_t)ctx_mb << 20;
  const char *pageable = getenv("SHARDPORT_FAKE_PAGEABLE");
  config.pageable_fails = pageable != NULL && strcmp(pageable, "fail") == 0;
  parse_compute_modes();
  config.fault_phys = -1;
  const char *fault = getenv("SHARDPORT_FAKE_FAULT");
  int phys;
  long nth;
  char end;
  if (fault != NULL && sscanf(fault, "%d:%ld%c", &phys, &nth, &end) == 2 &&
      phys >= 0 && phys < FAKE_MAX_GPUS && nth > 0) {
    config.fault_phys = phys;
    config.fault_nth = nth;
  }
  if (gpus <= 0) {
    /* What libcudart answers on a machine without the NVIDIA driver. */
    config.init_error = cudaErrorInsufficientDriver;
    return;
  }
  parse_visible(gpus > FAKE_MAX_GPUS ? FAKE_MAX_GPUS : (int)gpus);
  config.init_error = config.ngpus == 0 ? cudaErrorNoDevice : cudaSuccess;
}

const struct fake_config *fake_config(cudaError_t *err) {
  pthread_once(&config_once, config_init);
  if (err != NULL)
    *err = config.init_error;
  return &config;
}

/* ---- primary contexts ----
 *
 * One primary context per device and process, as the driver keeps them
 * (cuda.h, cuDevicePrimaryCtxRetain): active from its first retain until
 * its last release.  The runtime retains it once, for good, when a thread
 * first works on the device: cudaSetDevice does so at once since CUDA 12
 * ("will also immediately initialize the runtime state on the primary
 * context", cuda_runtime_api.h), the calls that work on a device
 * (FAKE_LIVE) when no context is current.  Each thread has a stack of
 * current contexts (cuCtxPushCurrent / cuCtxPopCurrent); cudaSetDevice
 * replaces its top.  The runtime's current device is the device of the
 * context current on the thread, else the one cudaSetDevice last chose.
 *
 * A context in exclusive-process mode may exist in one process of the
 * machine at a time: the process that has it holds an abstract Unix
 * socket named after the machine and device, which the kernel lets go when
 * the process ends, as the driver frees a dead process's contexts. */
struct fake_context {
  int phys;
};

#define FAKE_CTX_DEPTH 16

static struct {
  pthread_mutex_t lock;
  struct fake_context ctx[FAKE_MAX_GPUS];
  int refs[FAKE_MAX_GPUS];     /* retains, the runtime's among them */
  bool runtime[FAKE_MAX_GPUS]; /* the runtime holds its retain */
  int claim[FAKE_MAX_GPUS];    /* exclusive-process: the socket held, or -1 */
} ctxs = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int ctx_stack[FAKE_CTX_DEPTH]; /* physical devices */
static _Thread_local int ctx_depth;

/* Claims phys for this process in exclusive-process mode: false when
 * another process has a context on it.  Lock held. */
static bool claim_exclusive(int phys) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return false;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path + 1, sizeof(sa.sun_path) - 1,
                   "spfake-ctx-%u-%d", config.node, phys);
  if (bind(fd, (struct sockaddr *)&sa,
           (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n)) != 0) {
    close(fd);
    return false;
  }
  ctxs.claim[phys] = fd;
  return true;
}

/* One more retain of phys's primary context, which the first makes
 * active; cudaSuccess or cudaErrorDevicesUnavailable (the compute mode
 * forbids it).  Lock held. */
static cudaError_t ctx_retain_locked(int phys) {
  if (ctxs.refs[phys] == 0) {
    enum cudaComputeMode mode = config.compute_mode[phys];
    if (mode == cudaComputeModeProhibited)
      return cudaErrorDevicesUnavailable;
    ctxs.claim[phys] = -1;
    if (mode == cudaComputeModeExclusiveProcess && !claim_exclusive(phys))
      return cudaErrorDevicesUnavailable;
    ctxs.ctx[phys].phys = phys;
  }
  ctxs.refs[phys]++;
  return cudaSuccess;
}

static void ctx_release_locked(int phys) {
  if (ctxs.refs[phys] > 0 && --ctxs.refs[phys] == 0 && ctxs.claim[phys] >= 0) {
    close(ctxs.claim[phys]);
    ctxs.claim[phys] = -1;
  }
}

/* The runtime's own retain of phys, taken once. */
static cudaError_t ctx_runtime_init(int phys) {
  pthread_mutex_lock(&ctxs.lock);
  cudaError_t err = cudaSuccess;
  if (!ctxs.runtime[phys]) {
    err = ctx_retain_locked(phys);
    ctxs.runtime[phys] = err == cudaSuccess;
  }
  pthread_mutex_unlock(&ctxs.lock);
  return err;
}

int fake_current_device(void) {
  if (ctx_depth > 0) {
    int ordinal = fake_ordinal(ctx_stack[ctx_depth - 1]);
    if (ordinal >= 0)
      return ordinal;
  }
  return current_device;
}

cudaError_t fake_context_current(void) {
  int phys = fake_physical(fake_current_device());
  cudaError_t err = ctx_runtime_init(phys);
  if (err != cudaSuccess)
    return err;
  if (ctx_depth == 0)
    ctx_stack[ctx_depth++] = phys;
  return fake_sticky(phys);
}

bool fake_thread_has_context(void) { return ctx_depth > 0; }

size_t fake_context_bytes(int phys) {
  pthread_mutex_lock(&ctxs.lock);
  size_t n = ctxs.refs[phys] > 0 ? config.ctx_bytes : 0;
  pthread_mutex_unlock(&ctxs.lock);
  return n;
}

/* Per physical device: the error that ended its context, 0 while healthy.
 * Atomic, since stream workers and callers on any thread read it. */
static _Atomic int sticky[FAKE_MAX_GPUS];

void fake_fault(int phys, cudaError_t err) {
  int healthy = cudaSuccess;
  if (phys >= 0 && phys < FAKE_MAX_GPUS)
    atomic_compare_exchange_strong(&sticky[phys], &healthy, (int)err);
}

cudaError_t fake_sticky(int phys) {
  return phys >= 0 && phys < FAKE_MAX_GPUS ? (cudaError_t)atomic_load(&sticky[phys])
                                           : cudaSuccess;
}

cudaError_t fake_error(cudaError_t err) {
  if (err != cudaSuccess)
    last_error = err;
  return err;
}

int fake_physical(int ordinal) {
  fake_config(NULL);
  return ordinal >= 0 && ordinal < config.ngpus ? config.physical[ordinal] : -1;
}

int fake_ordinal(int physical) {
  fake_config(NULL);
  for (int i = 0; i < config.ngpus; i++)
    if (config.physical[i] == physical)
      return i;
  return -1;
}

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
  if (runtimeVersion == NULL)
    return fake_error(cudaErrorInvalidValue);
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

/* Without a driver the real call succeeds and reports version 0. */
cudaError_t cudaDriverGetVersion(int *driverVersion) {
  if (driverVersion == NULL)
    return fake_error(cudaErrorInvalidValue);
  cudaError_t err;
  fake_config(&err);
  *driverVersion = err == cudaErrorInsufficientDriver ? 0 : CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t err;
  fake_config(&err);
  if (err != cudaSuccess)
    return err;
  err = last_error;
  last_error = cudaSuccess;
  return err;
}

const char *cudaGetErrorString(cudaError_t error) {
  switch (error) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInvalidPitchValue: return "invalid pitch argument";
  case cudaErrorInsufficientDriver:
    return "CUDA driver version is insufficient for CUDA runtime version";
  case cudaErrorNoDevice: return "no CUDA-capable device is detected";
  case cudaErrorInvalidDevice: return "invalid device ordinal";
  case cudaErrorDeviceUninitialized: return "invalid device context";
  case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
  case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
  case cudaErrorInvalidResourceHandle: return "invalid resource handle";
  case cudaErrorNotReady: return "device not ready";
  case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
  case cudaErrorNotSupported: return "operation not supported";
  case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
  case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
  case cudaErrorDevicesUnavailable: return "CUDA-capable device(s) is/are busy or unavailable";
  default: return "unrecognized error code";
  }
}

cudaError_t cudaGetDeviceCount(int *count) {
  FAKE_READY();
  if (count == NULL)
    return fake_error(cudaErrorInvalidValue);
  *count = config.ngpus;
  return cudaSuccess;
}

/* Binds device's primary context to the thread, initialising it as CUDA 12
 * does (see primary contexts above): refused where the compute mode
 * forbids a context. */
cudaError_t cudaSetDevice(int device) {
  FAKE_READY();
  if (device < 0 || device >= config.ngpus)
    return fake_error(cudaErrorInvalidDevice);
  int phys = fake_physical(device);
  cudaError_t err = ctx_runtime_init(phys);
  if (err != cudaSuccess)
    return fake_error(err);
  current_device = device;
  if (ctx_depth == 0)
    ctx_depth = 1;
  ctx_stack[ctx_depth - 1] = phys;
  return cudaSuccess;
}

/* Creates no context. */
cudaError_t cudaGetDevice(int *device) {
  FAKE_READY();
  if (device == NULL)
    return fake_error(cudaErrorInvalidValue);
  *device = fake_current_device();
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *pciBusId, int len, int device) {
  FAKE_READY();
  int phys = fake_physical(device);
  if (phys < 0)
    return fake_error(cudaErrorInvalidDevice);
  char id[16];
  int n = snprintf(id, sizeof(id), "0000:%02x:00.0", physical_bus(phys));
  if (pciBusId == NULL || len <= n)
    return fake_error(cudaErrorInvalidValue);
  memcpy(pciBusId, id, (size_t)n + 1);
  return cudaSuccess;
}

/* The attributes a daemon asks about, with the values of an H100/H200-class
 * device; anything else is refused rather than invented. */
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr,
                                   int device) {
  FAKE_READY();
  int phys = fake_physical(device);
  if (phys < 0)
    return fake_error(cudaErrorInvalidDevice);
  if (value == NULL)
    return fake_error(cudaErrorInvalidValue);
  switch (attr) {
  case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
  case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
  case cudaDevAttrMultiProcessorCount: *value = 132; break;
  case cudaDevAttrPciBusId: *value = (int)physical_bus(phys); break;
  case cudaDevAttrPciDeviceId: *value = 0; break;
  case cudaDevAttrPciDomainId: *value = 0; break;
  case cudaDevAttrUnifiedAddressing: *value = 1; break;
  case cudaDevAttrIpcEventSupport: *value = 1; break;
  case cudaDevAttrIntegrated: *value = 0; break;
  case cudaDevAttrGPUDirectRDMASupported: *value = 0; break;
  case cudaDevAttrComputeMode: *value = (int)config.compute_mode[phys]; break;
  default: return fake_error(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

/* A device is never its own peer, as with the real runtime. */
cudaError_t cudaDeviceCanAccessPeer(int *canAccessPeer, int device,
                                    int peerDevice) {
  FAKE_READY();
  if (fake_physical(device) < 0 || fake_physical(peerDevice) < 0)
    return fake_error(cudaErrorInvalidDevice);
  if (canAccessPeer == NULL)
    return fake_error(cudaErrorInvalidValue);
  *canAccessPeer = config.p2p && device != peerDevice;
  return cudaSuccess;
}

static pthread_mutex_t peer_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t peer_enabled[FAKE_MAX_GPUS]; /* bit p of [d]: d reaches p */

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  FAKE_LIVE();
  int dev = fake_current_device();
  if (fake_physical(peerDevice) < 0 || peerDevice == dev)
    return fake_error(cudaErrorInvalidDevice);
  if (flags != 0)
    return fake_error(cudaErrorInvalidValue);
  if (!config.p2p)
    return fake_error(cudaErrorPeerAccessUnsupported);
  pthread_mutex_lock(&peer_lock);
  uint32_t bit = 1u << peerDevice;
  cudaError_t err = (peer_enabled[dev] & bit) != 0
                        ? cudaErrorPeerAccessAlreadyEnabled
                        : cudaSuccess;
  peer_enabled[dev] |= bit;
  pthread_mutex_unlock(&peer_lock);
  return fake_error(err);
}

/* The driver functions and the CUDA version that introduced each one's
 * present ABI (from the PFN_*_vNNNNN typedefs of cudaTypedefs.h).  The
 * assertion keeps every fake's prototype identical to cuda.h's. */
#define FAKE_DRIVER_TABLE(X)                                                   \
  X(cuDeviceGet, 2000)                                                         \
  X(cuDeviceGetUuid, 11040)                                                    \
  X(cuMemGetAddressRange, 3020)                                                \
  X(cuMemGetAllocationGranularity, 10020)                                      \
  X(cuMemCreate, 10020)                                                        \
  X(cuMemRelease, 10020)                                                       \
  X(cuMemExportToShareableHandle, 10020)                                       \
  X(cuMemImportFromShareableHandle, 10020)                                     \
  X(cuMemAddressReserve, 10020)                                                \
  X(cuMemAddressFree, 10020)                                                   \
  X(cuMemMap, 10020)                                                           \
  X(cuMemUnmap, 10020)                                                         \
  X(cuMemSetAccess, 10020)                                                     \
  X(cuMemRetainAllocationHandle, 11000)                                        \
  X(cuDevicePrimaryCtxRetain, 7000)                                            \
  X(cuDevicePrimaryCtxRelease, 11000)                                          \
  X(cuDevicePrimaryCtxGetState, 7000)                                          \
  X(cuCtxPushCurrent, 4000)                                                    \
  X(cuCtxPopCurrent, 4000)

#define FAKE_DRIVER_CHECK(name, version)                                       \
  _Static_assert(__builtin_types_compatible_p(__typeof__(name),                \
                                              __typeof__(fake_##name)),        \
                 "fake_" #name " must have the prototype of cuda.h");
FAKE_DRIVER_TABLE(FAKE_DRIVER_CHECK)
#undef FAKE_DRIVER_CHECK

static void *driver_entry(const char *symbol, unsigned *introduced) {
#define FAKE_DRIVER_FIND(name, version)                                        \
  if (strcmp(symbol, #name) == 0) {                                            \
    *introduced = version;                                                     \
    return (void *)fake_##name;                                                \
  }
  FAKE_DRIVER_TABLE(FAKE_DRIVER_FIND)
#undef FAKE_DRIVER_FIND
  return NULL;
}

/* As documented: a later ABI than the driver's is invalid; an unknown
 * symbol or one newer than the requested ABI is a success with NULL and the
 * status saying which. */
cudaError_t cudaGetDriverEntryPointByVersion(
    const char *symbol, void **funcPtr, unsigned int cudaVersion,
    unsigned long long flags,
    enum cudaDriverEntryPointQueryResult *driverStatus) {
  FAKE_READY();
  if (symbol == NULL || funcPtr == NULL || flags > cudaEnablePerThreadDefaultStream ||
      cudaVersion > CUDART_VERSION)
    return fake_error(cudaErrorInvalidValue);
  unsigned introduced = 0;
  void *fn = driver_entry(symbol, &introduced);
  enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSuccess;
  if (fn == NULL)
    status = cudaDriverEntryPointSymbolNotFound;
  else if (introduced > cudaVersion)
    status = cudaDriverEntryPointVersionNotSufficent;
  *funcPtr = status == cudaDriverEntryPointSuccess ? fn : NULL;
  if (driverStatus != NULL)
    *driverStatus = status;
  return cudaSuccess;
}

/* The driver's device calls. */
CUresult fake_cuDeviceGet(CUdevice *device, int ordinal) {
  if (device == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (fake_physical(ordinal) < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  int phys = fake_physical(dev);
  if (uuid == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (phys < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  physical_uuid(phys, (unsigned char *)uuid->bytes);
  return CUDA_SUCCESS;
}

/* The driver's primary-context calls (see primary contexts above).  A
 * retain is refused where the compute mode forbids a context: with
 * CUDA_ERROR_UNKNOWN in prohibited mode, as cuDevicePrimaryCtxRetain's
 * documentation says, and CUDA_ERROR_DEVICE_UNAVAILABLE where another
 * process has the exclusive-process device. */
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  int phys = fake_physical(dev);
  if (pctx == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (phys < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&ctxs.lock);
  cudaError_t err = ctx_retain_locked(phys);
  pthread_mutex_unlock(&ctxs.lock);
  if (err != cudaSuccess)
    return config.compute_mode[phys] == cudaComputeModeProhibited
               ? CUDA_ERROR_UNKNOWN
               : CUDA_ERROR_DEVICE_UNAVAILABLE;
  *pctx = (CUcontext)&ctxs.ctx[phys];
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRelease(CUdevice dev) {
  int phys = fake_physical(dev);
  if (phys < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&ctxs.lock);
  bool held = ctxs.refs[phys] > 0;
  ctx_release_locked(phys);
  pthread_mutex_unlock(&ctxs.lock);
  return held ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult fake_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags,
                                         int *active) {
  int phys = fake_physical(dev);
  if (flags == NULL || active == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (phys < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&ctxs.lock);
  *active = ctxs.refs[phys] > 0;
  pthread_mutex_unlock(&ctxs.lock);
  *flags = 0;
  return CUDA_SUCCESS;
}

/* The context a handle names, -1 when it is none of the fake's. */
static int context_phys(CUcontext ctx) {
  for (int p = 0; p < FAKE_MAX_GPUS; p++)
    if (ctx == (CUcontext)&ctxs.ctx[p])
      return p;
  return -1;
}

CUresult fake_cuCtxPushCurrent(CUcontext ctx) {
  int phys = context_phys(ctx);
  pthread_mutex_lock(&ctxs.lock);
  bool live = phys >= 0 && ctxs.refs[phys] > 0;
  pthread_mutex_unlock(&ctxs.lock);
  if (!live)
    return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx_depth == FAKE_CTX_DEPTH)
    return CUDA_ERROR_OUT_OF_MEMORY;
  ctx_stack[ctx_depth++] = phys;
  return CUDA_SUCCESS;
}

CUresult fake_cuCtxPopCurrent(CUcontext *pctx) {
  if (ctx_depth == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  int phys = ctx_stack[--ctx_depth];
  if (pctx != NULL)
    *pctx = (CUcontext)&ctxs.ctx[phys];
  return CUDA_SUCCESS;
}
