/*
 * fake.h - what the parts of the fake CUDA runtime share, and the one hook
 * the fake NCCL uses into it.  Not a public interface: docs/fakes.md says
 * what the fakes model.
 */
#ifndef SP_TESTS_FAKE_H
#define SP_TESTS_FAKE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#define FAKE_EXPORT __attribute__((visibility("default")))

#define FAKE_MAX_GPUS 16

/* Everything below but the NCCL hook stays inside the library. */
#pragma GCC visibility push(hidden)

/* The configuration read once from the environment (fake_cudart.c). */
struct fake_config {
  cudaError_t init_error; /* what every device call answers when not 0 */
  int ngpus;              /* visible devices */
  int physical[FAKE_MAX_GPUS]; /* visible ordinal -> physical index */
  uint32_t node;          /* SHARDPORT_FAKE_NODE: which "machine" this is */
  size_t mem_limit;       /* per device and process; 0: unlimited */
  unsigned delay_us;      /* SHARDPORT_FAKE_DELAY_US before each stream op */
  bool poison;            /* fill new device memory with FAKE_POISON_BYTE */
  bool p2p;               /* SHARDPORT_FAKE_P2P: peer access possible */
  int fault_phys;         /* SHARDPORT_FAKE_FAULT: the device, -1 none */
  long fault_nth;         /* and which of its copies faults (1-based) */
  /* SHARDPORT_FAKE_COMPUTE_MODE, per physical device. */
  enum cudaComputeMode compute_mode[FAKE_MAX_GPUS];
  size_t ctx_bytes;       /* SHARDPORT_FAKE_CTX_MB: what a context takes */
  /* SHARDPORT_FAKE_PAGEABLE=fail: an async copy between device memory and
   * pageable host memory ends the process (fake_stream.c). */
  bool pageable_fails;
};

#define FAKE_POISON_BYTE 0xa5

/* Initialises on first use; returns the configuration, and in *err the
 * error device calls must answer (cudaSuccess when there are devices). */
const struct fake_config *fake_config(cudaError_t *err);

/* The first thing every device call does: return the initialisation error
 * when there is one (it is sticky, as with the real runtime). */
#define FAKE_READY()                                                           \
  do {                                                                         \
    cudaError_t ready_;                                                        \
    fake_config(&ready_);                                                      \
    if (ready_ != cudaSuccess)                                                 \
      return fake_error(ready_);                                               \
  } while (0)

/* Sticky errors (fake_cudart.c).  A fault on a device (an illegal address)
 * ends its context: from then on every call that works on that device
 * answers the same error, as the CUDA headers document for
 * cudaErrorIllegalAddress.  fake_fault records it on a physical device;
 * fake_sticky answers it, cudaSuccess for a healthy device or -1. */
void fake_fault(int phys, cudaError_t err);
cudaError_t fake_sticky(int phys);

/* Makes the current device's primary context current on the thread,
 * initialising it as the runtime does on first use (fake_cudart.c), and
 * answers what a call working on it must: cudaErrorDevicesUnavailable
 * where the compute mode forbids the context, the sticky error that ended
 * it, or cudaSuccess. */
cudaError_t fake_context_current(void);
/* Whether any context is current on the calling thread (the driver's
 * calls that need one answer CUDA_ERROR_INVALID_CONTEXT otherwise). */
bool fake_thread_has_context(void);
/* Device memory the process's context on physical device phys takes. */
size_t fake_context_bytes(int phys);

/* FAKE_READY, then the current device's context, made current and alive:
 * the first thing every call that works on a device does. */
#define FAKE_LIVE()                                                            \
  do {                                                                         \
    FAKE_READY();                                                              \
    cudaError_t live_ = fake_context_current();                                \
    if (live_ != cudaSuccess)                                                  \
      return fake_error(live_);                                                \
  } while (0)

/* The calling thread's current device (a visible ordinal): the device of
 * the context current on it, else the one cudaSetDevice last chose. */
int fake_current_device(void);

/* Records err as the thread's last error (when not cudaSuccess), returns it. */
cudaError_t fake_error(cudaError_t err);

/* The physical index of a visible ordinal, -1 if out of range; and back. */
int fake_physical(int ordinal);
int fake_ordinal(int physical);

/* Device memory ranges (fake_memory.c). */
enum fake_access { FAKE_READ = 1, FAKE_WRITE = 2 };

/* cudaSuccess when [ptr, ptr + len) lies in one device allocation (or
 * mapping) that allows the access from physical device phys (a cuMem
 * mapping allows what cuMemSetAccess granted that device; -1: the host's
 * view, what any device was granted).  With must_be_device false, memory
 * outside every allocation counts as host memory and passes. */
cudaError_t fake_check_range(const void *ptr, size_t len, int access,
                             bool must_be_device, int phys);

/* Which region (allocation, import or mapping) ptr lies in, as an id
 * unique in the process, 0 outside every one; and whether that region is
 * still there.  A stream worker checks, between fake_memory_use_begin and
 * _end, that the memory an operation was queued on is still mapped. */
uint64_t fake_region_of(const void *ptr);
bool fake_region_alive(const void *ptr, uint64_t id);
void fake_memory_use_begin(void);
void fake_memory_use_end(void);

/* Whether [ptr, ptr + len) lies in one page-locked host allocation
 * (cudaMallocHost, cudaHostAlloc) not yet freed. */
bool fake_host_pinned(const void *ptr, size_t len);

/* Waits for every stream of the process to drain (fake_stream.c); what
 * cudaFree and the unmap calls do before memory goes away. */
void fake_sync_all_streams(void);

/* The driver functions that cudaGetDriverEntryPointByVersion hands out,
 * with the prototypes of cuda.h (checked where the table is built). */
CUresult fake_cuDeviceGet(CUdevice *device, int ordinal);
CUresult fake_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult fake_cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize,
                                   CUdeviceptr dptr);
CUresult fake_cuMemGetAllocationGranularity(size_t *granularity,
                                            const CUmemAllocationProp *prop,
                                            CUmemAllocationGranularity_flags option);
CUresult fake_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop,
                          unsigned long long flags);
CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult fake_cuMemExportToShareableHandle(void *shareableHandle,
                                           CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType handleType,
                                           unsigned long long flags);
CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                             void *osHandle,
                                             CUmemAllocationHandleType shHandleType);
CUresult fake_cuMemAddressReserve(CUdeviceptr *ptr, size_t size,
                                  size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags);
CUresult fake_cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult fake_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle,
                       unsigned long long flags);
CUresult fake_cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult fake_cuMemSetAccess(CUdeviceptr ptr, size_t size,
                             const CUmemAccessDesc *desc, size_t count);
CUresult fake_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle,
                                          void *addr);
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult fake_cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult fake_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags,
                                         int *active);
CUresult fake_cuCtxPushCurrent(CUcontext ctx);
CUresult fake_cuCtxPopCurrent(CUcontext *pctx);

#pragma GCC visibility pop

/* The hook for fake NCCL: runs fn(arg) on the stream's worker, in stream
 * order, after the work enqueued before it.  fn may block; the work after it
 * waits.  Returns cudaSuccess or the error cudaMemcpyAsync would. */
FAKE_EXPORT cudaError_t spfake_stream_enqueue(cudaStream_t stream,
                                              void (*fn)(void *), void *arg);

/* Reads a non-negative integer environment variable: dflt when unset, -1
 * when not a number.  Shared with the fake NCCL. */
FAKE_EXPORT long fake_env_long(const char *name, long dflt);

/* The hooks through which the fake NCCL's own device memory and kernels
 * are seen by the runtime (fake_memory.c), as NCCL's are on a real GPU.
 * spfake_device_identity gives the machine and physical index of a
 * visible ordinal ((node << 32) | physical), what NCCL tells a duplicate
 * GPU by.  spfake_device_charge takes bytes of a device's memory for
 * NCCL's connection buffers (cudaErrorMemoryAllocation beyond the limit),
 * spfake_device_uncharge gives them back; cudaMemGetInfo counts them.
 * spfake_kernels counts NCCL operations in flight on a device (delta +1
 * when one is handed to its stream, -1 when it finished or failed):
 * cudaFree of that device's memory while one is, which can deadlock on a
 * GPU, ends the process with a message (docs/fakes.md). */
FAKE_EXPORT bool spfake_device_identity(int ordinal, uint64_t *id);
FAKE_EXPORT cudaError_t spfake_device_charge(int ordinal, size_t bytes);
FAKE_EXPORT void spfake_device_uncharge(int ordinal, size_t bytes);
FAKE_EXPORT void spfake_kernels(int ordinal, int delta);

/* How many copy calls (cudaMemcpyAsync, cudaMemcpy2DAsync,
 * cudaMemcpy3DAsync, cudaMemcpyPeerAsync) the process has made: what a
 * test bounds the calls of a strided copy by.  On a GPU each is a launch of
 * a copy engine, which costs microseconds whatever it moves. */
FAKE_EXPORT unsigned long spfake_copy_calls(void);

/* The hook NCCL's pointer checks use: cudaSuccess when [ptr, ptr + len) is
 * device memory of one allocation that allows reading (and writing). */
FAKE_EXPORT cudaError_t spfake_check_device_range(const void *ptr, size_t len,
                                                  bool write);


#endif
