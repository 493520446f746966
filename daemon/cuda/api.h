/*
 * api.h - the CUDA runtime, the driver functions shardport needs, and NCCL,
 * reached through one table of functions loaded at run time.
 *
 * shardportd must start and serve on a machine without the NVIDIA driver or
 * the CUDA libraries, so nothing is linked against libcudart, libnccl or
 * libcuda.  cuda_api_load() dlopen()s the CUDA runtime and NCCL, resolves
 * exactly the functions listed below, and fetches the driver functions
 * through cudaGetDriverEntryPointByVersion, so libcuda is only ever loaded by
 * the runtime itself.  The same seam is how the tests load the fake runtime
 * and the fake NCCL of tests/fakes/ (see docs/fakes.md).
 *
 * Where the libraries come from:
 *   SHARDPORT_CUDART_LIB  a path (or soname) for the CUDA runtime; when unset
 *                         libcudart.so.13, libcudart.so.12, libcudart.so,
 *                         then the same names under the toolkit's lib64.
 *   SHARDPORT_NCCL_LIB    likewise for NCCL; when unset libnccl.so.2, then
 *                         the toolkit's lib64/libnccl.so.2.
 * A variable that is set is the only place looked at: a wrong override is
 * reported, never silently replaced by another library.
 *
 * Every member has the type that the toolkit's own headers declare for that
 * function (taken with __typeof__), so a call through the table is checked
 * by the compiler exactly like a call to the linked function.  Call them as
 * api->cudaMalloc(&p, n).  Names the headers turn into versioned symbols
 * (cuMemGetAddressRange is cuMemGetAddressRange_v2) are spelled the plain
 * way; the header's macro renames the member and every use alike.
 *
 * Threads: load, probe and unload from one thread, before and after the
 * table is used; the functions in the table are as thread-safe as the
 * libraries behind them.
 */
#ifndef SP_DAEMON_CUDA_API_H
#define SP_DAEMON_CUDA_API_H

#include <stddef.h>

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "daemon/cuda/layer.h"

/* The names in the table are the legacy-default-stream entry points; the
 * per-thread-default-stream build would make the header rename them to
 * *_ptsz symbols that the table does not resolve. */
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#error "daemon/cuda/api.h expects the legacy default stream entry points"
#endif

/* The CUDA runtime functions shardport calls, resolved with dlsym.  Device
 * identity uses cudaDeviceGetPCIBusId and the driver's cuDeviceGetUuid, not
 * cudaGetDeviceProperties: that struct changed layout between CUDA 12
 * (cudaGetDeviceProperties_v2) and CUDA 13 and would tie the table to one
 * runtime major version. */
#define CUDA_API_RUNTIME(X)                                                    \
  X(cudaRuntimeGetVersion)                                                     \
  X(cudaDriverGetVersion)                                                      \
  X(cudaGetDriverEntryPointByVersion)                                          \
  X(cudaGetErrorString)                                                        \
  X(cudaGetLastError)                                                          \
  X(cudaGetDeviceCount)                                                        \
  X(cudaSetDevice)                                                             \
  X(cudaGetDevice)                                                             \
  X(cudaDeviceGetAttribute)                                                    \
  X(cudaDeviceGetPCIBusId)                                                     \
  X(cudaDeviceCanAccessPeer)                                                   \
  X(cudaDeviceEnablePeerAccess)                                                \
  X(cudaMalloc)                                                                \
  X(cudaFree)                                                                  \
  X(cudaMallocHost)                                                            \
  X(cudaHostAlloc)                                                             \
  X(cudaFreeHost)                                                              \
  X(cudaMemGetInfo)                                                            \
  X(cudaPointerGetAttributes)                                                  \
  X(cudaMemcpyAsync)                                                           \
  X(cudaMemcpy2DAsync)                                                         \
  X(cudaMemcpy3DAsync)                                                         \
  X(cudaMemcpyPeerAsync)                                                       \
  X(cudaMemsetAsync)                                                           \
  X(cudaStreamCreateWithFlags)                                                 \
  X(cudaStreamSynchronize)                                                     \
  X(cudaStreamQuery)                                                           \
  X(cudaStreamDestroy)                                                         \
  X(cudaStreamWaitEvent)                                                       \
  X(cudaEventCreateWithFlags)                                                  \
  X(cudaEventRecord)                                                           \
  X(cudaEventQuery)                                                            \
  X(cudaEventSynchronize)                                                      \
  X(cudaEventDestroy)                                                          \
  X(cudaIpcGetMemHandle)                                                       \
  X(cudaIpcOpenMemHandle)                                                      \
  X(cudaIpcCloseMemHandle)                                                     \
  X(cudaIpcGetEventHandle)                                                     \
  X(cudaIpcOpenEventHandle)

/* The driver functions, fetched through cudaGetDriverEntryPointByVersion
 * with CUDA_API_DRIVER_ABI: address ranges, device identity, and the cuMem
 * calls behind POSIX-fd storages (expandable segments). */
#define CUDA_API_DRIVER(X)                                                     \
  X(cuDeviceGet)                                                               \
  X(cuDeviceGetUuid)                                                           \
  X(cuMemGetAddressRange)                                                      \
  X(cuMemGetAllocationGranularity)                                             \
  X(cuMemCreate)                                                               \
  X(cuMemRelease)                                                              \
  X(cuMemExportToShareableHandle)                                              \
  X(cuMemImportFromShareableHandle)                                            \
  X(cuMemAddressReserve)                                                       \
  X(cuMemAddressFree)                                                          \
  X(cuMemMap)                                                                  \
  X(cuMemUnmap)                                                                \
  X(cuMemSetAccess)

/* Every driver function above has had its present ABI since CUDA 11.4 (the
 * newest typedef in cudaTypedefs.h is PFN_cuDeviceGetUuid_v11040), so asking
 * for the 12.0 ABI yields exactly the prototypes of cuda.h from any 12.x or
 * newer driver. */
#define CUDA_API_DRIVER_ABI 12000

/* The NCCL functions shardport calls. */
#define CUDA_API_NCCL(X)                                                       \
  X(ncclGetVersion)                                                            \
  X(ncclGetErrorString)                                                        \
  X(ncclGetUniqueId)                                                           \
  X(ncclCommInitRankConfig)                                                    \
  X(ncclCommGetAsyncError)                                                     \
  X(ncclCommFinalize)                                                          \
  X(ncclCommDestroy)                                                           \
  X(ncclCommAbort)                                                             \
  X(ncclGroupStart)                                                            \
  X(ncclGroupEnd)                                                              \
  X(ncclSend)                                                                  \
  X(ncclRecv)                                                                  \
  X(ncclAllReduce)

#define CUDA_API_PATH_MAX 512

struct cuda_api {
#define CUDA_API_MEMBER(name) __typeof__(name) *name;
  CUDA_API_RUNTIME(CUDA_API_MEMBER)
  CUDA_API_DRIVER(CUDA_API_MEMBER)
  CUDA_API_NCCL(CUDA_API_MEMBER)
#undef CUDA_API_MEMBER

  /* Filled by a successful cuda_api_load(). */
  int runtime_version; /* 13000 for CUDA 13.0 */
  int driver_version;  /* the CUDA version the driver supports */
  int nccl_version;    /* 22809 for NCCL 2.28.9 */
  int device_count;    /* devices visible to this process */
  char cudart_path[CUDA_API_PATH_MAX]; /* the files actually loaded */
  char nccl_path[CUDA_API_PATH_MAX];

  void *cudart_handle; /* owned: released by cuda_api_unload() */
  void *nccl_handle;
};

/* One visible device, as cuda_api_probe() reports it. */
struct cuda_device_info {
  int ordinal;               /* index in this process (CUDA_VISIBLE_DEVICES) */
  unsigned char uuid[16];    /* the driver's UUID, stable across processes */
  char uuid_str[48];         /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
  char pci_bus_id[32];       /* "0000:3b:00.0", as cudaDeviceGetPCIBusId */
  int cc_major, cc_minor;    /* compute capability */
  int compute_mode;          /* cudaDevAttrComputeMode (enum cudaComputeMode) */
};

/* Loads the CUDA runtime and NCCL into *api and checks that a driver and at
 * least one device are there.  Returns 0, or SP_EBACKEND with a sentence in
 * why (what shardport status shows as the backend reason): which library
 * could not be loaded and why, which symbol is missing, or what
 * cudaGetDeviceCount said (error 35: no NVIDIA driver; error 100 or a count
 * of 0: no device).  On failure nothing stays loaded and *api is zeroed.
 * *api must not hold a loaded table (unload it first). */
int cuda_api_load(struct cuda_api *api, char *why, size_t whylen);
/* Only NCCL's part of the table (the NCCL root helper, ncclroot.c), as
 * cuda_api_load loads it: the CUDA runtime is not touched. */
int cuda_api_load_nccl(struct cuda_api *api, char *why, size_t whylen);

/* Releases what cuda_api_load() took and zeroes *api.  The libraries are
 * opened with RTLD_NODELETE, because neither the CUDA runtime nor NCCL
 * supports being unmapped while their threads may still run; unload only
 * drops the references.  Safe on a zeroed or failed table. */
void cuda_api_unload(struct cuda_api *api);

/* Reports every visible device: fills devs[0 .. min(count, maxdevs)) and
 * returns count (which may exceed maxdevs), or SP_EBACKEND with why.  Leaves
 * the calling thread's current device as it found it. */
int cuda_api_probe(const struct cuda_api *api, struct cuda_device_info *devs,
                   int maxdevs, char *why, size_t whylen);

/* The one way to turn a failed call into a reason: each writes "<what>:
 * CUDA error <n> (<string>)" (driver: "CUDA driver error <n>"; NCCL: "NCCL
 * error <n> (<string>)") into why and returns SP_EBACKEND. */
int cuda_api_cuda_error(const struct cuda_api *api, cudaError_t err,
                        const char *what, char *why, size_t whylen);
int cuda_api_driver_error(CUresult err, const char *what, char *why,
                          size_t whylen);
int cuda_api_nccl_error(const struct cuda_api *api, ncclResult_t err,
                        const char *what, char *why, size_t whylen);

#endif
