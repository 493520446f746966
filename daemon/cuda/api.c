/*
 * api.c - loads the CUDA runtime and NCCL at run time (see api.h).
 *
 * The order matters for the reason shown to the operator: the runtime is
 * loaded and asked for devices before anything else, so a node without a
 * driver says "no NVIDIA driver" rather than something about NCCL; the
 * driver functions are fetched only once a driver has answered.
 */
#include "daemon/cuda/api.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/fail.h"
#include "shardport.h"

#ifndef SP_CUDA_LIBDIR
#define SP_CUDA_LIBDIR "/usr/local/cuda/lib64"
#endif

static const char *const cudart_candidates[] = {
    "libcudart.so.13",
    "libcudart.so.12",
    "libcudart.so",
    SP_CUDA_LIBDIR "/libcudart.so.13",
    SP_CUDA_LIBDIR "/libcudart.so.12",
    SP_CUDA_LIBDIR "/libcudart.so",
};

static const char *const nccl_candidates[] = {
    "libnccl.so.2",
    SP_CUDA_LIBDIR "/libnccl.so.2",
};

/* The file the dynamic linker actually mapped, for status and logs. */
static void loaded_path(void *handle, const char *asked, char *out,
                        size_t outlen) {
  struct link_map *map = NULL;
  const char *name = asked;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != NULL &&
      map->l_name != NULL && map->l_name[0] != '\0')
    name = map->l_name;
  snprintf(out, outlen, "%s", name);
}

/* Opens the library named by the environment variable, or else the first
 * candidate that loads.  RTLD_NODELETE: see cuda_api_unload() in api.h. */
static void *open_library(const char *env, const char *what,
                          const char *const *candidates, size_t ncandidates,
                          char *path, size_t pathlen, char *why,
                          size_t whylen) {
  const int flags = RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE;
  const char *override = getenv(env);
  if (override != NULL && override[0] != '\0') {
    void *handle = dlopen(override, flags);
    if (handle == NULL) {
      sp__failf(why, whylen, SP_EBACKEND, "%s=%s cannot be loaded: %s", env,
                override, dlerror());
      return NULL;
    }
    loaded_path(handle, override, path, pathlen);
    return handle;
  }
  char last[256] = "";
  for (size_t i = 0; i < ncandidates; i++) {
    void *handle = dlopen(candidates[i], flags);
    if (handle != NULL) {
      loaded_path(handle, candidates[i], path, pathlen);
      return handle;
    }
    snprintf(last, sizeof(last), "%s", dlerror());
  }
  sp__failf(why, whylen, SP_EBACKEND,
            "no %s library found (tried %s ... %s, or set %s): %s", what,
            candidates[0], candidates[ncandidates - 1], env, last);
  return NULL;
}

/* Resolves every name of one list; the first missing one is the reason. */
static int resolve(void *handle, const char *path, const char *name,
                   void **slot, char *why, size_t whylen) {
  dlerror();
  *slot = dlsym(handle, name);
  if (*slot == NULL)
    return sp__failf(why, whylen, SP_EBACKEND, "%s lacks %s%s", path, name,
                     strcmp(name, "cudaGetDriverEntryPointByVersion") == 0
                         ? " (the CUDA backend needs CUDA 12.5 or newer)"
                         : "");
  return 0;
}

static int load_runtime(struct cuda_api *api, char *why, size_t whylen) {
  api->cudart_handle = open_library(
      "SHARDPORT_CUDART_LIB", "CUDA runtime", cudart_candidates,
      sizeof(cudart_candidates) / sizeof(cudart_candidates[0]),
      api->cudart_path, sizeof(api->cudart_path), why, whylen);
  if (api->cudart_handle == NULL)
    return SP_EBACKEND;
  void *sym;
#define CUDA_API_RESOLVE(name)                                                 \
  if (resolve(api->cudart_handle, api->cudart_path, #name, &sym, why,         \
              whylen) != 0)                                                    \
    return SP_EBACKEND;                                                        \
  api->name = (__typeof__(api->name))sym;
  CUDA_API_RUNTIME(CUDA_API_RESOLVE)
#undef CUDA_API_RESOLVE
  return 0;
}

/* cudaGetDeviceCount is the first call that needs the driver: error 35
 * (cudaErrorInsufficientDriver) is what the runtime answers on a machine
 * without the NVIDIA driver, error 100 when the driver sees no device. */
static int count_devices(struct cuda_api *api, char *why, size_t whylen) {
  api->runtime_version = 0;
  api->driver_version = 0;
  api->cudaRuntimeGetVersion(&api->runtime_version);
  api->cudaDriverGetVersion(&api->driver_version);
  int count = 0;
  cudaError_t err = api->cudaGetDeviceCount(&count);
  const char *what = err == cudaErrorInsufficientDriver
                         ? "no usable NVIDIA driver"
                     : err == cudaErrorNoDevice ? "no CUDA device is visible"
                                                : "the CUDA runtime failed";
  if (err != cudaSuccess)
    return sp__failf(why, whylen, SP_EBACKEND,
                     "%s: cudaGetDeviceCount failed with error %d (%s); CUDA "
                     "runtime %d.%d from %s, driver supports CUDA %d.%d",
                     what, (int)err, api->cudaGetErrorString(err),
                     api->runtime_version / 1000,
                     api->runtime_version % 1000 / 10, api->cudart_path,
                     api->driver_version / 1000,
                     api->driver_version % 1000 / 10);
  if (count <= 0)
    return sp__failf(
        why, whylen, SP_EBACKEND,
        "no CUDA device is visible (cudaGetDeviceCount returned %d)", count);
  api->device_count = count;
  return 0;
}

static int load_driver(struct cuda_api *api, char *why, size_t whylen) {
  void *sym;
  enum cudaDriverEntryPointQueryResult status;
#define CUDA_API_ENTRY(name)                                                   \
  sym = NULL;                                                                  \
  status = cudaDriverEntryPointSymbolNotFound;                                 \
  if (api->cudaGetDriverEntryPointByVersion(#name, &sym, CUDA_API_DRIVER_ABI,  \
                                            cudaEnableDefault,                 \
                                            &status) != cudaSuccess ||         \
      sym == NULL || status != cudaDriverEntryPointSuccess)                    \
    return sp__failf(                                                          \
        why, whylen, SP_EBACKEND,                                              \
        "the NVIDIA driver (CUDA %d.%d) does not provide %s for the "          \
        "CUDA %d.%d ABI (entry point status %d)",                              \
        api->driver_version / 1000, api->driver_version % 1000 / 10, #name,    \
        CUDA_API_DRIVER_ABI / 1000, CUDA_API_DRIVER_ABI % 1000 / 10,           \
        (int)status);                                                          \
  api->name = (__typeof__(api->name))sym;
  CUDA_API_DRIVER(CUDA_API_ENTRY)
#undef CUDA_API_ENTRY
  return 0;
}

static int load_nccl(struct cuda_api *api, char *why, size_t whylen) {
  api->nccl_handle =
      open_library("SHARDPORT_NCCL_LIB", "NCCL", nccl_candidates,
                   sizeof(nccl_candidates) / sizeof(nccl_candidates[0]),
                   api->nccl_path, sizeof(api->nccl_path), why, whylen);
  if (api->nccl_handle == NULL)
    return SP_EBACKEND;
  void *sym;
#define CUDA_API_RESOLVE(name)                                                 \
  if (resolve(api->nccl_handle, api->nccl_path, #name, &sym, why, whylen) !=  \
      0)                                                                       \
    return SP_EBACKEND;                                                        \
  api->name = (__typeof__(api->name))sym;
  CUDA_API_NCCL(CUDA_API_RESOLVE)
#undef CUDA_API_RESOLVE
  ncclResult_t res = api->ncclGetVersion(&api->nccl_version);
  if (res != ncclSuccess)
    return sp__failf(why, whylen, SP_EBACKEND,
                     "ncclGetVersion from %s failed with error %d (%s)",
                     api->nccl_path, (int)res, api->ncclGetErrorString(res));
  return 0;
}

int cuda_api_load(struct cuda_api *api, char *why, size_t whylen) {
  memset(api, 0, sizeof(*api));
  if (why != NULL && whylen > 0)
    why[0] = '\0';
  int rc = load_runtime(api, why, whylen);
  if (rc == 0)
    rc = count_devices(api, why, whylen);
  if (rc == 0)
    rc = load_driver(api, why, whylen);
  if (rc == 0)
    rc = load_nccl(api, why, whylen);
  if (rc != 0)
    cuda_api_unload(api);
  return rc;
}

int cuda_api_load_nccl(struct cuda_api *api, char *why, size_t whylen) {
  memset(api, 0, sizeof(*api));
  int rc = load_nccl(api, why, whylen);
  if (rc != 0)
    cuda_api_unload(api);
  return rc;
}

void cuda_api_unload(struct cuda_api *api) {
  if (api->nccl_handle != NULL)
    dlclose(api->nccl_handle);
  if (api->cudart_handle != NULL)
    dlclose(api->cudart_handle);
  memset(api, 0, sizeof(*api));
}

static void format_uuid(const unsigned char u[16], char *out, size_t outlen) {
  snprintf(out, outlen,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10],
           u[11], u[12], u[13], u[14], u[15]);
}

static int probe_one(const struct cuda_api *api, int ordinal,
                     struct cuda_device_info *dev, char *why, size_t whylen) {
  char what[64];
  memset(dev, 0, sizeof(*dev));
  dev->ordinal = ordinal;
  cudaError_t err =
      api->cudaDeviceGetPCIBusId(dev->pci_bus_id, sizeof(dev->pci_bus_id),
                                 ordinal);
  if (err != cudaSuccess) {
    snprintf(what, sizeof(what), "cudaDeviceGetPCIBusId(%d)", ordinal);
    return cuda_api_cuda_error(api, err, what, why, whylen);
  }
  err = api->cudaDeviceGetAttribute(&dev->cc_major,
                                    cudaDevAttrComputeCapabilityMajor, ordinal);
  if (err == cudaSuccess)
    err = api->cudaDeviceGetAttribute(
        &dev->cc_minor, cudaDevAttrComputeCapabilityMinor, ordinal);
  /* Asking makes no context, so a device the daemon must leave alone
   * (gpu.c) is left alone from the start. */
  if (err == cudaSuccess)
    err = api->cudaDeviceGetAttribute(&dev->compute_mode,
                                      cudaDevAttrComputeMode, ordinal);
  if (err != cudaSuccess) {
    snprintf(what, sizeof(what), "cudaDeviceGetAttribute(%d)", ordinal);
    return cuda_api_cuda_error(api, err, what, why, whylen);
  }
  /* The runtime's ordinals and the driver's agree: both apply the process's
   * CUDA_VISIBLE_DEVICES. */
  CUdevice cudev;
  CUuuid uuid;
  CUresult res = api->cuDeviceGet(&cudev, ordinal);
  if (res == CUDA_SUCCESS)
    res = api->cuDeviceGetUuid(&uuid, cudev);
  if (res != CUDA_SUCCESS) {
    snprintf(what, sizeof(what), "cuDeviceGetUuid(%d)", ordinal);
    return cuda_api_driver_error(res, what, why, whylen);
  }
  memcpy(dev->uuid, uuid.bytes, sizeof(dev->uuid));
  format_uuid(dev->uuid, dev->uuid_str, sizeof(dev->uuid_str));
  return 0;
}

int cuda_api_probe(const struct cuda_api *api, struct cuda_device_info *devs,
                   int maxdevs, char *why, size_t whylen) {
  int count = 0;
  cudaError_t err = api->cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    return cuda_api_cuda_error(api, err, "cudaGetDeviceCount", why, whylen);
  for (int i = 0; i < count && i < maxdevs; i++) {
    int rc = probe_one(api, i, &devs[i], why, whylen);
    if (rc != 0)
      return rc;
  }
  return count;
}

int cuda_api_cuda_error(const struct cuda_api *api, cudaError_t err,
                        const char *what, char *why, size_t whylen) {
  return sp__failf(
      why, whylen, SP_EBACKEND, "%s: CUDA error %d (%s)", what, (int)err,
      api->cudaGetErrorString != NULL ? api->cudaGetErrorString(err)
                                      : "no CUDA runtime loaded");
}

int cuda_api_driver_error(CUresult err, const char *what, char *why,
                          size_t whylen) {
  return sp__failf(why, whylen, SP_EBACKEND, "%s: CUDA driver error %d", what,
                   (int)err);
}

int cuda_api_nccl_error(const struct cuda_api *api, ncclResult_t err,
                        const char *what, char *why, size_t whylen) {
  return sp__failf(
      why, whylen, SP_EBACKEND, "%s: NCCL error %d (%s)", what, (int)err,
      api->ncclGetErrorString != NULL ? api->ncclGetErrorString(err)
                                      : "NCCL is not loaded");
}
