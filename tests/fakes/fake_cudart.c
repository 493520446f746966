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
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int fake_current_device(void) { return current_device; }

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

cudaError_t cudaSetDevice(int device) {
  FAKE_READY();
  if (device < 0 || device >= config.ngpus)
    return fake_error(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  FAKE_READY();
  if (device == NULL)
    return fake_error(cudaErrorInvalidValue);
  *device = current_device;
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
  FAKE_READY();
  int dev = current_device;
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
  X(cuMemSetAccess, 10020)

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
