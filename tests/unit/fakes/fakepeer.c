/*
 * fakepeer.c - the other process of the fakes' suites.  It loads the fakes
 * the way shardportd does (daemon/cuda/api.c, paths from the environment),
 * performs one scripted role given on the command line, prints what it saw,
 * and ends with a line "ok" and status 0, or "FAIL <why>" and status 1.
 *
 *   probe                                  load, list devices (status 2 and
 *                                          "fail <why>" if load fails)
 *   mem-open HANDLE OFF LEN EXPECT WRITE   open an IPC handle (twice), check
 *                                          and overwrite bytes, close
 *   mem-open-fails HANDLE CODE             opening HANDLE answers CODE
 *   event-produce                          allocate, memset 0x77 on a stream,
 *                                          record an IPC event, print both
 *                                          handles, wait to be killed
 *   event-consume MEM EVENT LEN BYTE       wait for EVENT on a stream, then
 *                                          read MEM: all BYTE
 *   vmm-import SIZE EXPECT WRITE           import the cuMem fd passed as 3
 *   vmm-fault                              cuMem access per device; a fault
 *                                          is sticky on its device only
 *   streams                                stream and event order, in-process
 *   malloc-limit                           SHARDPORT_FAKE_MEM_MB=4 is honoured
 *   contexts                               primary contexts: which calls make
 *                                          one, retain/push/pop, their memory
 *                                          (SHARDPORT_FAKE_CTX_MB=64)
 *   ctx-hold DEV                           a context on DEV, held until killed
 *   ctx-refused DEV                        DEV refuses a context (another
 *                                          process has it exclusive)
 *   unmap-late                             a copy still queued when its
 *                                          mapping is unmapped faults
 *                                          (SHARDPORT_FAKE_DELAY_US=200000)
 *   mem-hold HANDLE                        open an IPC handle, hold it until
 *                                          killed
 *   nccl SCENARIO ID NRANKS RANKS [ARG]    one process of an NCCL scenario;
 *                                          RANKS is a comma list of the ranks
 *                                          this process holds
 * Numbers are decimal, handles and ids hex.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "child.h"

static struct cuda_api api;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  exit(1);
}

#define CUDA(call)                                                             \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess)                                                     \
      fail("%s: CUDA error %d", #call, (int)e_);                               \
  } while (0)

#define DRV(call)                                                              \
  do {                                                                         \
    CUresult e_ = (call);                                                      \
    if (e_ != CUDA_SUCCESS)                                                    \
      fail("%s: driver error %d", #call, (int)e_);                             \
  } while (0)

#define NCCL(call)                                                             \
  do {                                                                         \
    ncclResult_t e_ = (call);                                                  \
    if (e_ != ncclSuccess)                                                     \
      fail("%s: NCCL error %d", #call, (int)e_);                               \
  } while (0)

static void ok(void) __attribute__((noreturn));
static void ok(void) {
  printf("ok\n");
  fflush(stdout);
  exit(0);
}

static long long mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void load(void) {
  char why[512];
  if (cuda_api_load(&api, why, sizeof(why)) != 0)
    fail("load: %s", why);
}

static long num(const char *s) { return strtol(s, NULL, 0); }

/* Reads len bytes of device memory through a stream. */
static void read_device(void *host, const void *dev, size_t len) {
  cudaStream_t s;
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(api.cudaMemcpyAsync(host, dev, len, cudaMemcpyDeviceToHost, s));
  CUDA(api.cudaStreamSynchronize(s));
  CUDA(api.cudaStreamDestroy(s));
}

static void expect_bytes(const unsigned char *p, size_t len, int byte,
                         const char *what) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != (unsigned char)byte)
      fail("%s: byte %zu is 0x%02x, not 0x%02x", what, i, p[i], byte);
}

static int cmd_probe(void) {
  char why[512];
  if (cuda_api_load(&api, why, sizeof(why)) != 0) {
    printf("fail %s\n", why);
    return 2;
  }
  struct cuda_device_info devs[16];
  int n = cuda_api_probe(&api, devs, 16, why, sizeof(why));
  if (n < 0)
    fail("probe: %s", why);
  printf("count %d rt %d drv %d nccl %d\n", n, api.runtime_version,
         api.driver_version, api.nccl_version);
  for (int i = 0; i < n && i < 16; i++)
    printf("dev %d %s %s\n", i, devs[i].uuid_str, devs[i].pci_bus_id);
  cuda_api_unload(&api);
  ok();
}

static int cmd_mem_open(char **argv) {
  cudaIpcMemHandle_t h;
  if (hex_decode(argv[0], &h, sizeof(h)) != 0)
    fail("bad handle");
  size_t off = (size_t)num(argv[1]), len = (size_t)num(argv[2]);
  int expect = (int)num(argv[3]), write = (int)num(argv[4]);
  load();
  void *p, *again;
  CUDA(api.cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  CUDA(api.cudaIpcOpenMemHandle(&again, h, cudaIpcMemLazyEnablePeerAccess));
  if (again != p)
    fail("the second open gave %p, the first %p", again, p);
  char *inside = (char *)p + off;
  struct cudaPointerAttributes attr;
  CUDA(api.cudaPointerGetAttributes(&attr, inside));
  if (attr.type != cudaMemoryTypeDevice)
    fail("the opened memory is of type %d", (int)attr.type);
  CUdeviceptr base;
  size_t size;
  DRV(api.cuMemGetAddressRange(&base, &size, (CUdeviceptr)inside));
  if ((void *)base != p || size < off + len)
    fail("address range %p+%zu for %p+%zu", (void *)base, size, p, off);
  unsigned char *buf = malloc(len);
  read_device(buf, inside, len);
  expect_bytes(buf, len, expect, "the exporter's bytes");
  free(buf);
  cudaStream_t s;
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(api.cudaMemsetAsync(inside, write, len, s));
  CUDA(api.cudaStreamSynchronize(s));
  CUDA(api.cudaStreamDestroy(s));
  CUDA(api.cudaIpcCloseMemHandle(p));
  CUDA(api.cudaIpcCloseMemHandle(p));
  if (api.cudaIpcCloseMemHandle(p) != cudaErrorInvalidValue)
    fail("a third close of a handle opened twice succeeded");
  ok();
}

static int cmd_mem_open_fails(char **argv) {
  cudaIpcMemHandle_t h;
  if (hex_decode(argv[0], &h, sizeof(h)) != 0)
    fail("bad handle");
  load();
  void *p;
  cudaError_t err = api.cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  printf("error %d\n", (int)err);
  if ((int)err != (int)num(argv[1]))
    fail("opening answered %d, not %ld", (int)err, num(argv[1]));
  ok();
}

static int cmd_event_produce(void) {
  load();
  const size_t len = 65536;
  void *d;
  cudaStream_t s;
  cudaEvent_t ev;
  CUDA(api.cudaMalloc(&d, len));
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(api.cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  CUDA(api.cudaMemsetAsync(d, 0x77, len, s));
  CUDA(api.cudaEventRecord(ev, s));
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  CUDA(api.cudaIpcGetMemHandle(&mh, d));
  CUDA(api.cudaIpcGetEventHandle(&eh, ev));
  char hex[2 * sizeof(mh) + 1];
  hex_encode(&mh, sizeof(mh), hex);
  printf("mem %s\n", hex);
  hex_encode(&eh, sizeof(eh), hex);
  printf("event %s\n", hex);
  fflush(stdout);
  sleep(20); /* the test kills this process when the consumer is done */
  fail("not stopped");
}

static int cmd_event_consume(char **argv) {
  cudaIpcMemHandle_t mh;
  cudaIpcEventHandle_t eh;
  if (hex_decode(argv[0], &mh, sizeof(mh)) != 0 ||
      hex_decode(argv[1], &eh, sizeof(eh)) != 0)
    fail("bad handles");
  size_t len = (size_t)num(argv[2]);
  load();
  void *d;
  cudaEvent_t ev;
  cudaStream_t s;
  CUDA(api.cudaIpcOpenMemHandle(&d, mh, cudaIpcMemLazyEnablePeerAccess));
  CUDA(api.cudaIpcOpenEventHandle(&ev, eh));
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("query %d\n", (int)api.cudaEventQuery(ev));
  unsigned char *buf = malloc(len);
  CUDA(api.cudaStreamWaitEvent(s, ev, 0));
  CUDA(api.cudaMemcpyAsync(buf, d, len, cudaMemcpyDeviceToHost, s));
  CUDA(api.cudaStreamSynchronize(s));
  expect_bytes(buf, len, (int)num(argv[3]), "bytes after the producer's event");
  free(buf);
  CUDA(api.cudaEventSynchronize(ev));
  CUDA(api.cudaEventQuery(ev));
  CUDA(api.cudaEventDestroy(ev));
  CUDA(api.cudaStreamDestroy(s));
  CUDA(api.cudaIpcCloseMemHandle(d));
  ok();
}

static int cmd_vmm_import(char **argv) {
  size_t size = (size_t)num(argv[0]);
  int expect = (int)num(argv[1]), write = (int)num(argv[2]);
  load();
  CUmemGenericAllocationHandle h;
  DRV(api.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)3,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(3); /* the handle holds the memory now */
  CUdeviceptr va;
  DRV(api.cuMemAddressReserve(&va, size, 0, 0, 0));
  DRV(api.cuMemMap(va, size, 0, h, 0));
  CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  DRV(api.cuMemSetAccess(va, size, &acc, 1));
  unsigned char *buf = malloc(size);
  read_device(buf, (void *)va, size);
  expect_bytes(buf, size, expect, "the exporter's cuMem bytes");
  free(buf);
  cudaStream_t s;
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(api.cudaMemsetAsync((void *)va, write, size, s));
  CUDA(api.cudaStreamSynchronize(s));
  CUDA(api.cudaStreamDestroy(s));
  DRV(api.cuMemUnmap(va, size));
  DRV(api.cuMemRelease(h));
  DRV(api.cuMemAddressFree(va, size));
  ok();
}

#define EXPECT_ERR(call, want)                                                 \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != (want))                                                          \
      fail("%s: CUDA error %d, expected %d", #call, (int)e_, (int)(want));     \
  } while (0)

static int cmd_vmm_fault(void) {
  load();
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
  const size_t size = 2u << 20;
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  DRV(api.cuMemCreate(&h, size, &prop, 0));
  DRV(api.cuMemAddressReserve(&va, size, 0, 0, 0));
  DRV(api.cuMemMap(va, size, 0, h, 0));
  void *buf0, *buf1;
  cudaStream_t s0, s1;
  CUDA(api.cudaSetDevice(0));
  CUDA(api.cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CUDA(api.cudaMalloc(&buf0, 4096));
  CUDA(api.cudaSetDevice(1));
  CUDA(api.cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA(api.cudaMalloc(&buf1, 4096));
  /* Only device 0 is granted; device 1, which reads the mapping in a copy
   * on its stream, is not. */
  CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  DRV(api.cuMemSetAccess(va, size, &acc, 1));
  CUDA(api.cudaSetDevice(0));
  CUDA(api.cudaMemsetAsync((void *)va, 0x5a, size, s0));
  CUDA(api.cudaMemcpyAsync(buf0, (void *)va, 4096, cudaMemcpyDefault, s0));
  CUDA(api.cudaStreamSynchronize(s0));
  CUDA(api.cudaSetDevice(1));
  EXPECT_ERR(api.cudaMemcpyAsync(buf1, (void *)va, 4096, cudaMemcpyDefault, s1),
             cudaErrorIllegalAddress);
  /* Sticky: every later call on device 1 answers the same error, even once
   * the last error was read. */
  EXPECT_ERR(api.cudaGetLastError(), cudaErrorIllegalAddress);
  void *more;
  EXPECT_ERR(api.cudaMalloc(&more, 4096), cudaErrorIllegalAddress);
  EXPECT_ERR(api.cudaStreamSynchronize(s1), cudaErrorIllegalAddress);
  EXPECT_ERR(api.cudaMemcpyAsync(buf1, buf1, 16, cudaMemcpyDefault, s1),
             cudaErrorIllegalAddress);
  if (strcmp(api.cudaGetErrorString(cudaErrorIllegalAddress),
             "an illegal memory access was encountered") != 0)
    fail("cudaErrorIllegalAddress is \"%s\"",
         api.cudaGetErrorString(cudaErrorIllegalAddress));
  /* A stream of device 1 refuses work whatever device is current. */
  CUDA(api.cudaSetDevice(0));
  EXPECT_ERR(api.cudaMemcpyAsync(buf0, buf0, 16, cudaMemcpyDefault, s1),
             cudaErrorIllegalAddress);
  /* Device 0's context is untouched. */
  CUDA(api.cudaMemcpyAsync(buf0, (void *)va, 4096, cudaMemcpyDefault, s0));
  CUDA(api.cudaStreamSynchronize(s0));
  CUDA(api.cudaMalloc(&more, 4096));
  ok();
}

/* A driver function fetched by name, as the backend fetches its own. */
static void *driver(const char *name) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult st;
  if (api.cudaGetDriverEntryPointByVersion(name, &fn, CUDA_API_DRIVER_ABI,
                                           cudaEnableDefault, &st) !=
          cudaSuccess ||
      fn == NULL)
    fail("no driver entry point %s", name);
  return fn;
}

static int ctx_active(int dev) {
  __typeof__(cuDevicePrimaryCtxGetState) *get_state =
      driver("cuDevicePrimaryCtxGetState");
  unsigned flags;
  int active = -1;
  DRV(get_state(dev, &flags, &active));
  return active;
}

/* Device memory in use on the current device, as cudaMemGetInfo says. */
static size_t used_memory(void) {
  __typeof__(cudaMemGetInfo) *get_info = dlsym(api.cudart_handle, "cudaMemGetInfo");
  if (get_info == NULL)
    fail("no cudaMemGetInfo");
  size_t free_b, total;
  CUDA(get_info(&free_b, &total));
  return total - free_b;
}

/* Run with SHARDPORT_FAKE_CTX_MB=64, in a process that has not touched a
 * device yet. */
static int cmd_contexts(void) {
  load();
  if (ctx_active(0) != 0 || ctx_active(1) != 0)
    fail("a context exists before any device call");
  /* Asking which device is current makes no context. */
  int dev = -1;
  CUDA(api.cudaGetDevice(&dev));
  if (dev != 0 || ctx_active(0) != 0)
    fail("cudaGetDevice made a context (device %d)", dev);
  /* A driver call that needs a context has none. */
  CUdeviceptr base;
  size_t size;
  if (api.cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)&dev) !=
      CUDA_ERROR_INVALID_CONTEXT)
    fail("cuMemGetAddressRange without a context did not answer "
         "CUDA_ERROR_INVALID_CONTEXT");
  /* cudaSetDevice makes the device's primary context (CUDA 12), and only
   * that one; it takes its memory. */
  CUDA(api.cudaSetDevice(1));
  if (ctx_active(1) != 1 || ctx_active(0) != 0)
    fail("after cudaSetDevice(1): contexts %d %d", ctx_active(0),
         ctx_active(1));
  size_t used = used_memory();
  if (used != (size_t)64 << 20)
    fail("device 1 uses %zu bytes with only its context", used);
  if (api.cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)&dev) !=
      CUDA_ERROR_NOT_FOUND)
    fail("cuMemGetAddressRange with a context did not look the address up");
  /* Retain and push make device 0 current without the runtime's own
   * context; pop and release leave device 1 current and device 0 without
   * a context. */
  __typeof__(cuDevicePrimaryCtxRetain) *retain = driver("cuDevicePrimaryCtxRetain");
  __typeof__(cuDevicePrimaryCtxRelease) *release = driver("cuDevicePrimaryCtxRelease");
  __typeof__(cuCtxPushCurrent) *push = driver("cuCtxPushCurrent");
  __typeof__(cuCtxPopCurrent) *pop = driver("cuCtxPopCurrent");
  CUcontext ctx, popped;
  DRV(retain(&ctx, 0));
  if (ctx_active(0) != 1)
    fail("a retained context is not active");
  DRV(push(ctx));
  CUDA(api.cudaGetDevice(&dev));
  if (dev != 0)
    fail("with device 0's context pushed, the current device is %d", dev);
  DRV(pop(&popped));
  if (popped != ctx)
    fail("pop gave another context");
  CUDA(api.cudaGetDevice(&dev));
  if (dev != 1)
    fail("after the pop, the current device is %d", dev);
  DRV(release(0));
  if (ctx_active(0) != 0)
    fail("the last release left device 0's context active");
  ok();
}

static int cmd_ctx_hold(char **argv) {
  load();
  CUDA(api.cudaSetDevice((int)num(argv[0])));
  printf("held\n");
  fflush(stdout);
  sleep(20); /* the test kills this process */
  fail("not stopped");
}

static int cmd_ctx_refused(char **argv) {
  load();
  int dev = (int)num(argv[0]);
  int attr = -1;
  CUDA(api.cudaDeviceGetAttribute(&attr, cudaDevAttrComputeMode, dev));
  if (attr != cudaComputeModeExclusiveProcess)
    fail("device %d's compute mode is %d", dev, attr);
  EXPECT_ERR(api.cudaSetDevice(dev), cudaErrorDevicesUnavailable);
  __typeof__(cuDevicePrimaryCtxRetain) *retain = driver("cuDevicePrimaryCtxRetain");
  CUcontext ctx;
  if (retain(&ctx, dev) != CUDA_ERROR_DEVICE_UNAVAILABLE)
    fail("cuDevicePrimaryCtxRetain(%d) was not refused", dev);
  ok();
}

/* Run with SHARDPORT_FAKE_DELAY_US=200000: the copy is still queued when
 * the mapping goes. */
static int cmd_unmap_late(void) {
  load();
  CUDA(api.cudaSetDevice(0));
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
  const size_t size = 2u << 20;
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  DRV(api.cuMemCreate(&h, size, &prop, 0));
  DRV(api.cuMemAddressReserve(&va, size, 0, 0, 0));
  DRV(api.cuMemMap(va, size, 0, h, 0));
  CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  DRV(api.cuMemSetAccess(va, size, &acc, 1));
  cudaStream_t s;
  static unsigned char host[4096];
  memset(host, 0x11, sizeof(host));
  CUDA(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA(api.cudaMemcpyAsync(host, (void *)va, sizeof(host), cudaMemcpyDefault, s));
  DRV(api.cuMemUnmap(va, size));
  /* The copy ran after the unmap: an illegal address, sticky, and it
   * copied nothing. */
  EXPECT_ERR(api.cudaStreamSynchronize(s), cudaErrorIllegalAddress);
  expect_bytes(host, sizeof(host), 0x11, "the late copy's destination");
  DRV(api.cuMemAddressFree(va, size));
  DRV(api.cuMemRelease(h));
  ok();
}

static int cmd_mem_hold(char **argv) {
  cudaIpcMemHandle_t h;
  if (hex_decode(argv[0], &h, sizeof(h)) != 0)
    fail("bad handle");
  load();
  void *p;
  CUDA(api.cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  printf("open\n");
  fflush(stdout);
  sleep(20); /* the test kills this process */
  fail("not stopped");
}

/* Run with SHARDPORT_FAKE_DELAY_US=100000: every stream operation waits
 * 100 ms before it runs, so a result read too early is visibly stale. */
static int cmd_streams(void) {
  load();
  const size_t len = 1 << 20;
  unsigned char *host = malloc(len), *back = malloc(len);
  for (size_t i = 0; i < len; i++)
    host[i] = (unsigned char)(i * 7 + 3);
  void *a, *b;
  cudaStream_t s1, s2;
  cudaEvent_t ev, never;
  CUDA(api.cudaMalloc(&a, len));
  CUDA(api.cudaMalloc(&b, len));
  CUDA(api.cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA(api.cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CUDA(api.cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA(api.cudaEventCreateWithFlags(&never, cudaEventDisableTiming));

  /* In order on one stream: H2D, memset, D2D, then the event. */
  CUDA(api.cudaMemcpyAsync(a, host, len, cudaMemcpyHostToDevice, s1));
  CUDA(api.cudaMemsetAsync(b, 0, len, s1));
  CUDA(api.cudaMemcpyAsync(b, a, len, cudaMemcpyDeviceToDevice, s1));
  CUDA(api.cudaEventRecord(ev, s1));
  if (api.cudaEventQuery(ev) != cudaErrorNotReady)
    fail("the event is complete before its stream reached it");
  if (api.cudaEventQuery(never) != cudaSuccess)
    fail("an event never recorded is not complete");
  /* A second stream waits for the event, then reads. */
  CUDA(api.cudaStreamWaitEvent(s2, ev, 0));
  CUDA(api.cudaMemcpyAsync(back, b, len, cudaMemcpyDeviceToHost, s2));
  CUDA(api.cudaStreamSynchronize(s2));
  if (memcmp(back, host, len) != 0)
    fail("the waiting stream read before the event");
  if (api.cudaEventQuery(ev) != cudaSuccess)
    fail("the event is not complete after the work behind it");

  /* A second record makes the event pending again; synchronize waits. */
  CUDA(api.cudaMemsetAsync(a, 0x11, len, s1));
  CUDA(api.cudaEventRecord(ev, s1));
  if (api.cudaEventQuery(ev) != cudaErrorNotReady)
    fail("a new record did not make the event pending");
  CUDA(api.cudaEventSynchronize(ev));
  read_device(back, a, len);
  expect_bytes(back, len, 0x11, "memset before the synchronised event");

  /* Copies are checked against their allocations. */
  if (api.cudaMemcpyAsync((char *)b + 1, a, len, cudaMemcpyDeviceToDevice, s1) !=
      cudaErrorInvalidValue)
    fail("a copy past the end of an allocation was accepted");
  if (api.cudaMemsetAsync(host, 0, 16, s1) != cudaErrorInvalidValue)
    fail("a memset of host memory was accepted");
  if (api.cudaMemcpyAsync(b, a, 16, (enum cudaMemcpyKind)9, s1) !=
      cudaErrorInvalidMemcpyDirection)
    fail("an unknown copy direction was accepted");
  if (api.cudaGetLastError() != cudaErrorInvalidMemcpyDirection ||
      api.cudaGetLastError() != cudaSuccess)
    fail("cudaGetLastError does not report and reset the last error");
  /* A 2D copy: 8 rows of 100 bytes out of a pitch of 256. */
  CUDA(api.cudaMemcpy2DAsync(b, 100, a, 256, 100, 8, cudaMemcpyDeviceToDevice, s1));
  if (api.cudaMemcpy2DAsync(b, 50, a, 256, 100, 8, cudaMemcpyDeviceToDevice, s1) !=
      cudaErrorInvalidPitchValue)
    fail("a pitch below the width was accepted");

  /* Destroying a stream with work queued lets the work finish. */
  CUDA(api.cudaMemsetAsync(a, 0x22, len, s1));
  CUDA(api.cudaStreamDestroy(s1));
  CUDA(api.cudaFree(b)); /* waits for the device, as cudaFree does */
  read_device(back, a, len);
  expect_bytes(back, len, 0x22, "work queued on a destroyed stream");
  if (api.cudaStreamSynchronize(s1) != cudaErrorInvalidResourceHandle)
    fail("a destroyed stream is still usable");

  CUDA(api.cudaEventDestroy(ev));
  CUDA(api.cudaEventDestroy(never));
  CUDA(api.cudaStreamDestroy(s2));
  CUDA(api.cudaFree(a));
  free(host);
  free(back);
  ok();
}

static int cmd_malloc_limit(void) {
  load();
  void *a, *b;
  CUDA(api.cudaMalloc(&a, 3 << 20));
  if (api.cudaMalloc(&b, 2 << 20) != cudaErrorMemoryAllocation)
    fail("5 MiB fit in a 4 MiB device");
  CUDA(api.cudaSetDevice(1));
  CUDA(api.cudaMalloc(&b, 2 << 20)); /* the limit is per device */
  CUDA(api.cudaFree(b));
  CUDA(api.cudaSetDevice(0));
  CUDA(api.cudaFree(a));
  CUDA(api.cudaMalloc(&a, 4 << 20));
  CUDA(api.cudaFree(a));
  ok();
}

/* ---- NCCL scenarios ---- */

struct lrank {
  int rank, dev;
  ncclComm_t comm;
  cudaStream_t stream;
  cudaEvent_t done;
};

static struct lrank ranks[8];
static int nlocal, nranks;
static ncclUniqueId id;

/* Every local rank's communicator, created inside one group with
 * cudaSetDevice before each init, as shardportd does. */
static ncclResult_t setup(bool blocking) {
  int ndev;
  CUDA(api.cudaGetDeviceCount(&ndev));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking;
  ncclResult_t res = ncclSuccess;
  if (nlocal > 1)
    NCCL(api.ncclGroupStart());
  for (int i = 0; i < nlocal; i++) {
    ranks[i].dev = i % ndev;
    CUDA(api.cudaSetDevice(ranks[i].dev));
    CUDA(api.cudaStreamCreateWithFlags(&ranks[i].stream, cudaStreamNonBlocking));
    CUDA(api.cudaEventCreateWithFlags(&ranks[i].done, cudaEventDisableTiming));
    res = api.ncclCommInitRankConfig(&ranks[i].comm, nranks, id, ranks[i].rank,
                                     &config);
    if (nlocal == 1)
      break;
    if (res != ncclSuccess)
      fail("grouped ncclCommInitRankConfig: %d", (int)res);
  }
  if (nlocal > 1)
    res = api.ncclGroupEnd();
  return res;
}

/* Polls every local communicator until none is in progress, for at most
 * timeout_ms; returns the first error, ncclSuccess, or ncclInProgress. */
static ncclResult_t settle(int timeout_ms) {
  long long deadline = mono_ns() + (long long)timeout_ms * 1000000;
  for (;;) {
    ncclResult_t worst = ncclSuccess;
    for (int i = 0; i < nlocal; i++) {
      ncclResult_t st;
      NCCL(api.ncclCommGetAsyncError(ranks[i].comm, &st));
      if (st != ncclSuccess && (worst == ncclSuccess || worst == ncclInProgress))
        worst = st;
    }
    if (worst != ncclInProgress || mono_ns() > deadline)
      return worst;
    usleep(2000);
  }
}

/* The watchdog: waits for every local stream to pass its last op, checking
 * the async errors meanwhile.  Work that has completed counts as done even
 * if an error (of a later round) is already there.  ncclSuccess, the first
 * error, or ncclInProgress when timeout_ms passed with work still pending. */
static ncclResult_t wait_streams(int timeout_ms) {
  for (int i = 0; i < nlocal; i++)
    CUDA(api.cudaEventRecord(ranks[i].done, ranks[i].stream));
  long long deadline = mono_ns() + (long long)timeout_ms * 1000000;
  for (;;) {
    bool all = true;
    for (int i = 0; i < nlocal; i++) {
      cudaError_t q = api.cudaEventQuery(ranks[i].done);
      if (q != cudaSuccess && q != cudaErrorNotReady)
        fail("cudaEventQuery: %d", (int)q);
      all = all && q == cudaSuccess;
    }
    if (all)
      return ncclSuccess;
    for (int i = 0; i < nlocal; i++) {
      ncclResult_t st;
      NCCL(api.ncclCommGetAsyncError(ranks[i].comm, &st));
      if (st != ncclSuccess && st != ncclInProgress)
        return st;
    }
    if (mono_ns() > deadline)
      return ncclInProgress;
    usleep(2000);
  }
}

static void end_all(bool abort) {
  for (int i = 0; i < nlocal; i++) {
    if (abort)
      NCCL(api.ncclCommAbort(ranks[i].comm));
    else
      NCCL(api.ncclCommDestroy(ranks[i].comm));
    /* After an abort the stream must move on. */
    CUDA(api.cudaStreamSynchronize(ranks[i].stream));
    CUDA(api.cudaStreamDestroy(ranks[i].stream));
    CUDA(api.cudaEventDestroy(ranks[i].done));
  }
}

/* The buckets of the exchange: per (source, destination) four of them, a
 * small one, a medium one, an empty one and one larger than a socket
 * buffer, in different dtypes. */
#define NBUCKETS 4
static const ncclDataType_t bucket_dtype[NBUCKETS] = {ncclUint8, ncclInt32,
                                                      ncclFloat32, ncclFloat64};

static size_t bucket_count(int src, int dst, int b) {
  static const size_t base[NBUCKETS] = {1, 4096, 0, 300000};
  return b == 2 ? 0 : base[b] + (size_t)((src * 7 + dst * 3 + b) % 13);
}

static size_t dtype_size(ncclDataType_t t) {
  return t == ncclUint8 ? 1 : t == ncclFloat64 ? 8 : 4;
}

static unsigned char bucket_byte(int src, int dst, int b, size_t i) {
  return (unsigned char)(src * 61 + dst * 29 + b * 11 + i * 7 + (i >> 8));
}

struct bucket {
  void *dev;
  size_t count, bytes;
};

static void fill_device(void *dev, size_t bytes, int src, int dst, int b,
                        cudaStream_t s) {
  unsigned char *h = malloc(bytes ? bytes : 1);
  for (size_t i = 0; i < bytes; i++)
    h[i] = bucket_byte(src, dst, b, i);
  CUDA(api.cudaMemcpyAsync(dev, h, bytes, cudaMemcpyHostToDevice, s));
  CUDA(api.cudaStreamSynchronize(s));
  free(h);
}

/* One all-reduce per local communicator (the warm-up), then one group in
 * which every local rank sends its buckets to every rank (itself included)
 * and receives theirs; verified byte for byte. */
static void scenario_exchange(void) {
  NCCL(setup(true));
  void *fsum[8], *isum[8];
  NCCL(api.ncclGroupStart());
  for (int i = 0; i < nlocal; i++) {
    float f = (float)(ranks[i].rank + 1);
    int64_t v = ranks[i].rank + 1;
    CUDA(api.cudaSetDevice(ranks[i].dev));
    CUDA(api.cudaMalloc(&fsum[i], sizeof(f)));
    CUDA(api.cudaMalloc(&isum[i], sizeof(v)));
    CUDA(api.cudaMemcpyAsync(fsum[i], &f, sizeof(f), cudaMemcpyHostToDevice, ranks[i].stream));
    CUDA(api.cudaMemcpyAsync(isum[i], &v, sizeof(v), cudaMemcpyHostToDevice, ranks[i].stream));
    CUDA(api.cudaStreamSynchronize(ranks[i].stream));
    NCCL(api.ncclAllReduce(fsum[i], fsum[i], 1, ncclFloat32, ncclSum, ranks[i].comm, ranks[i].stream));
    NCCL(api.ncclAllReduce(isum[i], isum[i], 1, ncclInt64, ncclSum, ranks[i].comm, ranks[i].stream));
  }
  NCCL(api.ncclGroupEnd());

  struct bucket (*send)[16][NBUCKETS] = calloc(8, sizeof(*send));
  struct bucket (*recv)[16][NBUCKETS] = calloc(8, sizeof(*recv));
  for (int i = 0; i < nlocal; i++) {
    CUDA(api.cudaSetDevice(ranks[i].dev));
    for (int p = 0; p < nranks; p++)
      for (int b = 0; b < NBUCKETS; b++) {
        struct bucket *s = &send[i][p][b], *r = &recv[i][p][b];
        s->count = bucket_count(ranks[i].rank, p, b);
        r->count = bucket_count(p, ranks[i].rank, b);
        s->bytes = s->count * dtype_size(bucket_dtype[b]);
        r->bytes = r->count * dtype_size(bucket_dtype[b]);
        CUDA(api.cudaMalloc(&s->dev, s->bytes));
        CUDA(api.cudaMalloc(&r->dev, r->bytes));
        fill_device(s->dev, s->bytes, ranks[i].rank, p, b, ranks[i].stream);
      }
  }
  NCCL(api.ncclGroupStart());
  for (int i = 0; i < nlocal; i++) {
    for (int p = 0; p < nranks; p++)
      for (int b = 0; b < NBUCKETS; b++)
        NCCL(api.ncclSend(send[i][p][b].dev, send[i][p][b].count, bucket_dtype[b],
                          p, ranks[i].comm, ranks[i].stream));
    for (int p = 0; p < nranks; p++)
      for (int b = 0; b < NBUCKETS; b++)
        NCCL(api.ncclRecv(recv[i][p][b].dev, recv[i][p][b].count, bucket_dtype[b],
                          p, ranks[i].comm, ranks[i].stream));
  }
  NCCL(api.ncclGroupEnd());
  ncclResult_t res = wait_streams(20000);
  if (res != ncclSuccess)
    fail("the exchange ended with %d", (int)res);

  for (int i = 0; i < nlocal; i++) {
    float f;
    int64_t v;
    read_device(&f, fsum[i], sizeof(f));
    read_device(&v, isum[i], sizeof(v));
    int want = nranks * (nranks + 1) / 2;
    if (f != (float)want || v != want)
      fail("rank %d: all-reduce gave %g and %lld, not %d", ranks[i].rank, f,
           (long long)v, want);
    CUDA(api.cudaFree(fsum[i]));
    CUDA(api.cudaFree(isum[i]));
    for (int p = 0; p < nranks; p++)
      for (int b = 0; b < NBUCKETS; b++) {
        struct bucket *r = &recv[i][p][b];
        unsigned char *h = malloc(r->bytes ? r->bytes : 1);
        read_device(h, r->dev, r->bytes);
        for (size_t k = 0; k < r->bytes; k++)
          if (h[k] != bucket_byte(p, ranks[i].rank, b, k))
            fail("rank %d: bucket %d from %d differs at byte %zu", ranks[i].rank,
                 b, p, k);
        free(h);
        CUDA(api.cudaFree(r->dev));
        CUDA(api.cudaFree(send[i][p][b].dev));
      }
  }
  free(send);
  free(recv);
  end_all(false);
  ok();
}

/* Joins after delay_ms; prints when it started joining and when set-up
 * returned, on the machine's monotonic clock. */
static void scenario_join(int delay_ms) {
  usleep((useconds_t)delay_ms * 1000);
  printf("joining %lld\n", mono_ns());
  NCCL(setup(true));
  printf("ready %lld\n", mono_ns());
  end_all(false);
  ok();
}

/* The other ranks never come: set-up must fail, not hang. */
static void scenario_alone(bool blocking) {
  long long t0 = mono_ns();
  ncclResult_t res = setup(blocking);
  if (!blocking) {
    if (res != ncclInProgress)
      fail("non-blocking set-up returned %d", (int)res);
    res = settle(20000);
  }
  printf("result %d after %lld ms\n", (int)res, (mono_ns() - t0) / 1000000);
  if (res != ncclSystemError)
    fail("set-up without the other rank gave %d", (int)res);
  if (blocking && ranks[0].comm != NULL)
    fail("a failed blocking set-up returned a communicator");
  if (!blocking)
    NCCL(api.ncclCommAbort(ranks[0].comm));
  ok();
}

/* Rank 0 sends 10 floats, rank 1 expects 12: both must see an error. */
static void scenario_mismatch(void) {
  NCCL(setup(true));
  void *buf;
  CUDA(api.cudaMalloc(&buf, 12 * sizeof(float)));
  if (ranks[0].rank == 0)
    NCCL(api.ncclSend(buf, 10, ncclFloat32, 1, ranks[0].comm, ranks[0].stream));
  else
    NCCL(api.ncclRecv(buf, 12, ncclFloat32, 0, ranks[0].comm, ranks[0].stream));
  ncclResult_t res = wait_streams(10000);
  printf("async %d\n", (int)res);
  if (res != ncclInvalidUsage)
    fail("a count mismatch gave %d", (int)res);
  end_all(true);
  CUDA(api.cudaFree(buf));
  ok();
}

/* Rank 0 waits for a message from rank 1, which ends instead (how is the
 * argument: "abort", or "exit" with SHARDPORT_FAKE_NCCL_FAIL=1:1:exit). */
static void scenario_peer_fails(const char *how) {
  NCCL(setup(true));
  void *buf;
  CUDA(api.cudaMalloc(&buf, 4096));
  if (ranks[0].rank == 0) {
    /* A peer that died may be seen gone already when the receive is
     * launched (a blocking communicator reports it from the call, as NCCL
     * may), or only while the stream waits.  One that aborted tells
     * nobody: the receive still waits well after the abort. */
    bool aborts = strcmp(how, "abort") == 0;
    ncclResult_t res =
        api.ncclRecv(buf, 1024, ncclFloat32, 1, ranks[0].comm, ranks[0].stream);
    if (res == ncclSuccess)
      res = wait_streams(aborts ? 3000 : 10000);
    printf("async %d\n", (int)res);
    if (res != (aborts ? ncclInProgress : ncclRemoteError))
      fail("a peer that went away gave %d", (int)res);
    end_all(true);
  } else if (strcmp(how, "abort") == 0) {
    usleep(200000);
    end_all(true);
  } else {
    api.ncclSend(buf, 1024, ncclFloat32, 0, ranks[0].comm, ranks[0].stream);
    fail("the injected exit did not happen");
  }
  CUDA(api.cudaFree(buf));
  ok();
}

/* SHARDPORT_FAKE_NCCL_FAIL=0:3:error: rank 0's third launch fails, after
 * which rank 0 aborts; rank 1, waiting in its third group, is not told
 * (ncclCommAbort tells no peer) and waits until it aborts itself.
 * Group 1 exchanges a float each way; in group 2 rank 1 tells rank 0 that
 * it has seen group 1 complete, so that rank 0's abort cannot overtake it. */
static void scenario_inject(void) {
  NCCL(setup(true));
  void *out, *in;
  CUDA(api.cudaMalloc(&out, sizeof(float)));
  CUDA(api.cudaMalloc(&in, sizeof(float)));
  int me = ranks[0].rank, peer = 1 - me;
  ncclComm_t comm = ranks[0].comm;
  cudaStream_t s = ranks[0].stream;
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclSend(out, 1, ncclFloat32, peer, comm, s));
  NCCL(api.ncclRecv(in, 1, ncclFloat32, peer, comm, s));
  NCCL(api.ncclGroupEnd());
  ncclResult_t res = wait_streams(10000);
  if (res != ncclSuccess)
    fail("group 1 ended with %d", (int)res);
  if (me == 0) {
    NCCL(api.ncclRecv(in, 1, ncclFloat32, peer, comm, s));
    if ((res = wait_streams(10000)) != ncclSuccess)
      fail("group 2 ended with %d", (int)res);
  } else {
    NCCL(api.ncclSend(out, 1, ncclFloat32, peer, comm, s));
  }
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclSend(out, 1, ncclFloat32, peer, comm, s));
  NCCL(api.ncclRecv(in, 1, ncclFloat32, peer, comm, s));
  res = api.ncclGroupEnd();
  if (me == 0) {
    printf("group %d\n", (int)res);
    if (res != ncclSystemError)
      fail("the injected error gave %d", (int)res);
  } else {
    if (res != ncclSuccess)
      fail("group 3 returned %d", (int)res);
    res = wait_streams(3000);
    printf("async %d\n", (int)res);
    if (res != ncclInProgress)
      fail("the peer's abort gave %d", (int)res);
  }
  end_all(true);
  CUDA(api.cudaFree(out));
  CUDA(api.cudaFree(in));
  ok();
}

/* SHARDPORT_FAKE_NCCL_FAIL=1:1:hang: nothing fails by itself, as with a
 * stuck GPU.  Rank 0's watchdog sees the work still pending after 500 ms
 * and aborts; the hung rank 1 is not told, and waits on. */
static void scenario_hang(void) {
  NCCL(setup(true));
  void *buf;
  CUDA(api.cudaMalloc(&buf, 64));
  int peer = 1 - ranks[0].rank;
  NCCL(api.ncclGroupStart());
  NCCL(api.ncclSend(buf, 4, ncclFloat32, peer, ranks[0].comm, ranks[0].stream));
  NCCL(api.ncclRecv((char *)buf + 32, 4, ncclFloat32, peer, ranks[0].comm, ranks[0].stream));
  NCCL(api.ncclGroupEnd());
  /* Rank 0's abort tells rank 1 nothing: its work stays pending too. */
  ncclResult_t res = wait_streams(ranks[0].rank == 0 ? 500 : 3000);
  printf("watchdog %d\n", (int)res);
  if (res != ncclInProgress)
    fail("rank %d saw %d", ranks[0].rank, (int)res);
  end_all(true);
  CUDA(api.cudaFree(buf));
  ok();
}

/* Non-blocking communicators: set-up, a launch and finalize all answer
 * ncclInProgress first, and the async errors turn to ncclSuccess.  Each
 * local rank sends to the next rank and receives from the previous one. */
static void scenario_nonblocking(void) {
  ncclResult_t res = setup(false);
  if (res != ncclInProgress)
    fail("non-blocking set-up returned %d", (int)res);
  if ((res = settle(20000)) != ncclSuccess)
    fail("non-blocking set-up ended with %d", (int)res);
  enum { LEN = 4096 };
  void *out[8], *in[8];
  NCCL(api.ncclGroupStart());
  for (int i = 0; i < nlocal; i++) {
    int r = ranks[i].rank, next = (r + 1) % nranks;
    int prev = (r + nranks - 1) % nranks;
    CUDA(api.cudaSetDevice(ranks[i].dev));
    CUDA(api.cudaMalloc(&out[i], LEN));
    CUDA(api.cudaMalloc(&in[i], LEN));
    fill_device(out[i], LEN, r, next, 0, ranks[i].stream);
    NCCL(api.ncclSend(out[i], LEN / 4, ncclInt32, next, ranks[i].comm, ranks[i].stream));
    NCCL(api.ncclRecv(in[i], LEN / 4, ncclInt32, prev, ranks[i].comm, ranks[i].stream));
  }
  res = api.ncclGroupEnd();
  if (res != ncclInProgress)
    fail("a non-blocking launch returned %d", (int)res);
  if ((res = settle(20000)) != ncclSuccess || (res = wait_streams(20000)) != ncclSuccess)
    fail("the non-blocking exchange ended with %d", (int)res);
  for (int i = 0; i < nlocal; i++) {
    int r = ranks[i].rank, prev = (r + nranks - 1) % nranks;
    unsigned char h[LEN];
    read_device(h, in[i], LEN);
    for (size_t k = 0; k < LEN; k++)
      if (h[k] != bucket_byte(prev, r, 0, k))
        fail("rank %d: byte %zu from rank %d differs", r, k, prev);
    if ((res = api.ncclCommFinalize(ranks[i].comm)) != ncclInProgress)
      fail("non-blocking finalize returned %d", (int)res);
  }
  if ((res = settle(20000)) != ncclSuccess)
    fail("finalize ended with %d", (int)res);
  for (int i = 0; i < nlocal; i++) {
    CUDA(api.cudaFree(out[i]));
    CUDA(api.cudaFree(in[i]));
  }
  end_all(false);
  ok();
}

static int cmd_nccl(int argc, char **argv) {
  if (argc < 4)
    fail("usage: nccl SCENARIO ID NRANKS RANKS [ARG]");
  const char *scenario = argv[0];
  if (hex_decode(argv[1], &id, sizeof(id)) != 0)
    fail("bad id");
  nranks = (int)num(argv[2]);
  for (char *s = argv[3]; *s != '\0' && nlocal < 8; nlocal++) {
    ranks[nlocal].rank = (int)strtol(s, &s, 10);
    if (*s == ',')
      s++;
  }
  const char *arg = argc > 4 ? argv[4] : "0";
  load();
  if (strcmp(scenario, "exchange") == 0)
    scenario_exchange();
  else if (strcmp(scenario, "join") == 0)
    scenario_join((int)num(arg));
  else if (strcmp(scenario, "alone") == 0)
    scenario_alone(num(arg) != 0);
  else if (strcmp(scenario, "mismatch") == 0)
    scenario_mismatch();
  else if (strcmp(scenario, "peer-fails") == 0)
    scenario_peer_fails(arg);
  else if (strcmp(scenario, "inject") == 0)
    scenario_inject();
  else if (strcmp(scenario, "hang") == 0)
    scenario_hang();
  else if (strcmp(scenario, "nonblocking") == 0)
    scenario_nonblocking();
  fail("unknown scenario %s", scenario);
}

int main(int argc, char **argv) {
  if (argc < 2)
    fail("usage: fakepeer COMMAND ARGS...");
  const char *cmd = argv[1];
  char **args = argv + 2;
  int nargs = argc - 2;
  struct { const char *name; int nargs; } need[] = {
      {"mem-open", 5}, {"mem-open-fails", 2}, {"event-consume", 4},
      {"vmm-import", 3}, {"ctx-hold", 1}, {"ctx-refused", 1},
      {"mem-hold", 1}};
  for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++)
    if (strcmp(cmd, need[i].name) == 0 && nargs < need[i].nargs)
      fail("%s needs %d arguments", cmd, need[i].nargs);
  if (strcmp(cmd, "probe") == 0)
    return cmd_probe();
  if (strcmp(cmd, "mem-open") == 0)
    return cmd_mem_open(args);
  if (strcmp(cmd, "mem-open-fails") == 0)
    return cmd_mem_open_fails(args);
  if (strcmp(cmd, "event-produce") == 0)
    return cmd_event_produce();
  if (strcmp(cmd, "event-consume") == 0)
    return cmd_event_consume(args);
  if (strcmp(cmd, "vmm-import") == 0)
    return cmd_vmm_import(args);
  if (strcmp(cmd, "vmm-fault") == 0)
    return cmd_vmm_fault();
  if (strcmp(cmd, "streams") == 0)
    return cmd_streams();
  if (strcmp(cmd, "malloc-limit") == 0)
    return cmd_malloc_limit();
  if (strcmp(cmd, "contexts") == 0)
    return cmd_contexts();
  if (strcmp(cmd, "ctx-hold") == 0)
    return cmd_ctx_hold(args);
  if (strcmp(cmd, "ctx-refused") == 0)
    return cmd_ctx_refused(args);
  if (strcmp(cmd, "unmap-late") == 0)
    return cmd_unmap_late();
  if (strcmp(cmd, "mem-hold") == 0)
    return cmd_mem_hold(args);
  if (strcmp(cmd, "nccl") == 0)
    return cmd_nccl(nargs, args);
  fail("unknown command %s", cmd);
}
