/*
 * test_fake_cudart.c - the fake CUDA runtime against the documented
 * contracts it models: stable device identity, per-thread current device,
 * allocation bases, IPC memory handles opened by another process, stream
 * and event order, interprocess events, and the cuMem POSIX-fd path.
 *
 * The test process loads the fakes through daemon/cuda/api.c as shardportd
 * does; "another process" is the fakepeer helper, started with posix_spawn
 * (fork+exec), never a bare fork of a process that has CUDA initialised.
 */
#include <check.h>
#include <dlfcn.h>
#include <stdio.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "child.h"

static struct cuda_api api;

static void setup(void) {
  char why[512];
  ck_assert_msg(cuda_api_load(&api, why, sizeof(why)) == 0, "%s", why);
  ck_assert_int_eq(api.cudaSetDevice(0), cudaSuccess);
}

static void teardown(void) { cuda_api_unload(&api); }

#define CUDA_OK(call) ck_assert_int_eq((int)(call), (int)cudaSuccess)

/* The index of the first byte of p that differs from want(i), or n. */
static size_t first_difference(const unsigned char *p, size_t n,
                               unsigned char (*want)(size_t i)) {
  size_t i = 0;
  while (i < n && p[i] == want(i))
    i++;
  return i;
}

static void read_device(void *host, const void *dev, size_t len) {
  cudaStream_t s;
  CUDA_OK(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(api.cudaMemcpyAsync(host, dev, len, cudaMemcpyDeviceToHost, s));
  CUDA_OK(api.cudaStreamSynchronize(s));
  CUDA_OK(api.cudaStreamDestroy(s));
}

/* The "dev N UUID PCI" lines of a fakepeer probe, from out. */
static int probe_lines(const char *out, char uuids[][48], char pcis[][32]) {
  int n = 0;
  for (const char *l = strstr(out, "dev "); l != NULL && n < 4;
       l = strstr(l + 1, "\ndev ")) {
    int i;
    if (sscanf(l[0] == '\n' ? l + 1 : l, "dev %d %47s %31s", &i, uuids[n], pcis[n]) == 3)
      n++;
  }
  return n;
}

START_TEST(device_identity_is_stable_and_follows_the_machine) {
  struct cuda_device_info devs[2];
  char why[256], out[4096], uuids[4][48], pcis[4][32];
  ck_assert_int_eq(cuda_api_probe(&api, devs, 2, why, sizeof(why)), 2);

  /* Another process on the same machine sees the same identities. */
  ck_assert_int_eq(peer_run((const char *[]){"probe", NULL}, NULL, -1, 10000, out,
                            sizeof(out)), 0);
  ck_assert_int_eq(probe_lines(out, uuids, pcis), 2);
  ck_assert_str_eq(uuids[0], devs[0].uuid_str);
  ck_assert_str_eq(uuids[1], devs[1].uuid_str);
  ck_assert_str_eq(pcis[1], devs[1].pci_bus_id);

  /* Another machine has other UUIDs, though the same bus ids. */
  ck_assert_int_eq(peer_run((const char *[]){"probe", NULL},
                            (char *[]){"SHARDPORT_FAKE_NODE=1", NULL}, -1, 10000,
                            out, sizeof(out)), 0);
  ck_assert_int_eq(probe_lines(out, uuids, pcis), 2);
  ck_assert_str_ne(uuids[0], devs[0].uuid_str);
  ck_assert_str_ne(uuids[1], devs[1].uuid_str);
  ck_assert_str_eq(pcis[0], devs[0].pci_bus_id);

  /* CUDA_VISIBLE_DEVICES renumbers: index 0 there is GPU 1 here, by index
   * or by UUID; the UUID is what stays the same. */
  ck_assert_int_eq(peer_run((const char *[]){"probe", NULL},
                            (char *[]){"CUDA_VISIBLE_DEVICES=1", NULL}, -1, 10000,
                            out, sizeof(out)), 0);
  ck_assert_int_eq(probe_lines(out, uuids, pcis), 1);
  ck_assert_str_eq(uuids[0], devs[1].uuid_str);
  char vis[96];
  snprintf(vis, sizeof(vis), "CUDA_VISIBLE_DEVICES=%.12s,0", devs[1].uuid_str);
  ck_assert_int_eq(peer_run((const char *[]){"probe", NULL}, (char *[]){vis, NULL},
                            -1, 10000, out, sizeof(out)), 0);
  ck_assert_int_eq(probe_lines(out, uuids, pcis), 2);
  ck_assert_str_eq(uuids[0], devs[1].uuid_str);
  ck_assert_str_eq(uuids[1], devs[0].uuid_str);
  /* The list stops at the first entry naming no device. */
  ck_assert_int_eq(peer_run((const char *[]){"probe", NULL},
                            (char *[]){"CUDA_VISIBLE_DEVICES=0,7,1", NULL}, -1,
                            10000, out, sizeof(out)), 0);
  ck_assert_int_eq(probe_lines(out, uuids, pcis), 1);
}
END_TEST

static void *other_thread(void *arg) {
  int *seen = arg;
  api.cudaGetDevice(&seen[0]);
  api.cudaSetDevice(1);
  api.cudaGetDevice(&seen[1]);
  return NULL;
}

START_TEST(the_current_device_belongs_to_the_thread) {
  int seen[2] = {-1, -1}, mine;
  pthread_t t;
  pthread_create(&t, NULL, other_thread, seen);
  pthread_join(t, NULL);
  ck_assert_int_eq(seen[0], 0);
  ck_assert_int_eq(seen[1], 1);
  CUDA_OK(api.cudaGetDevice(&mine));
  ck_assert_int_eq(mine, 0);
  ck_assert_int_eq(api.cudaSetDevice(2), cudaErrorInvalidDevice);
  ck_assert_int_eq(api.cudaGetLastError(), cudaErrorInvalidDevice);
  ck_assert_int_eq(api.cudaGetLastError(), cudaSuccess);
}
END_TEST

START_TEST(a_pointer_inside_an_allocation_names_its_base) {
  const size_t len = 1 << 20;
  char *base;
  CUDA_OK(api.cudaSetDevice(1));
  CUDA_OK(api.cudaMalloc((void **)&base, len));
  CUDA_OK(api.cudaSetDevice(0));
  cudaIpcMemHandle_t h0, h1, h2;
  CUDA_OK(api.cudaIpcGetMemHandle(&h0, base));
  CUDA_OK(api.cudaIpcGetMemHandle(&h1, base + 4096));
  CUDA_OK(api.cudaIpcGetMemHandle(&h2, base + len - 1));
  ck_assert_mem_eq(&h0, &h1, sizeof(h0));
  ck_assert_mem_eq(&h0, &h2, sizeof(h0));

  struct cudaPointerAttributes attr;
  CUDA_OK(api.cudaPointerGetAttributes(&attr, base + 12345));
  ck_assert_int_eq(attr.type, cudaMemoryTypeDevice);
  ck_assert_int_eq(attr.device, 1);
  CUdeviceptr b;
  size_t size;
  ck_assert_int_eq(api.cuMemGetAddressRange(&b, &size, (CUdeviceptr)(base + 12345)),
                   CUDA_SUCCESS);
  ck_assert_ptr_eq((void *)b, base);
  ck_assert_uint_eq(size, len);

  /* Host memory: no allocation, no handle. */
  int host;
  CUDA_OK(api.cudaPointerGetAttributes(&attr, &host));
  ck_assert_int_eq(attr.type, cudaMemoryTypeUnregistered);
  ck_assert_int_eq(api.cuMemGetAddressRange(&b, &size, (CUdeviceptr)&host),
                   CUDA_ERROR_NOT_FOUND);
  ck_assert_int_eq(api.cudaIpcGetMemHandle(&h1, &host), cudaErrorInvalidValue);
  /* The byte after the end is not inside. */
  ck_assert_int_eq(api.cudaIpcGetMemHandle(&h1, base + len), cudaErrorInvalidValue);

  /* A process cannot open its own handle: "invalid device context". */
  void *p;
  ck_assert_int_eq(api.cudaIpcOpenMemHandle(&p, h0, cudaIpcMemLazyEnablePeerAccess),
                   cudaErrorDeviceUninitialized);
  ck_assert_int_eq(api.cudaFree(base + 1), cudaErrorInvalidValue);
  CUDA_OK(api.cudaFree(base));
  ck_assert_int_eq(api.cudaFree(base), cudaErrorInvalidValue);
}
END_TEST

enum { SHARED_LEN = 256 * 1024, SHARED_OFF = 4096, SHARED_SPAN = 8192 };

static unsigned char child_wrote(size_t i) {
  return i >= SHARED_OFF && i < SHARED_OFF + SHARED_SPAN ? 0xc3 : 0xa5;
}

static unsigned char byte_4d(size_t i) {
  (void)i;
  return 0x4d;
}

START_TEST(another_process_reads_and_writes_through_a_handle) {
  const size_t len = SHARED_LEN, off = SHARED_OFF, span = SHARED_SPAN;
  unsigned char *host = malloc(len);
  char *d;
  CUDA_OK(api.cudaMalloc((void **)&d, len));
  memset(host, 0x5a, span);
  cudaStream_t s;
  CUDA_OK(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(api.cudaMemcpyAsync(d + off, host, span, cudaMemcpyHostToDevice, s));
  CUDA_OK(api.cudaStreamSynchronize(s));
  CUDA_OK(api.cudaStreamDestroy(s));

  /* The handle of the interior pointer, plus the offset: as a trainer
   * registers a storage that does not start its allocation. */
  cudaIpcMemHandle_t h;
  CUDA_OK(api.cudaIpcGetMemHandle(&h, d + off));
  char hex[2 * sizeof(h) + 1], offs[32], spans[32], out[4096];
  hex_encode(&h, sizeof(h), hex);
  snprintf(offs, sizeof(offs), "%zu", off);
  snprintf(spans, sizeof(spans), "%zu", span);
  int rc = peer_run((const char *[]){"mem-open", hex, offs, spans, "0x5a", "0xc3", NULL},
                    NULL, -1, 10000, out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);

  /* The child's bytes where it wrote; the never-written rest still holds
   * the fake's poison, since device memory is not zeroed. */
  read_device(host, d, len);
  size_t bad = first_difference(host, len, child_wrote);
  ck_assert_msg(bad == len, "byte %zu is 0x%02x", bad, host[bad]);
  CUDA_OK(api.cudaFree(d));
  free(host);
}
END_TEST

START_TEST(a_freed_allocation_does_not_open) {
  void *d;
  cudaIpcMemHandle_t h;
  CUDA_OK(api.cudaMalloc(&d, 4096));
  CUDA_OK(api.cudaIpcGetMemHandle(&h, d));
  CUDA_OK(api.cudaFree(d));
  char hex[2 * sizeof(h) + 1], code[16], out[4096];
  hex_encode(&h, sizeof(h), hex);
  snprintf(code, sizeof(code), "%d", (int)cudaErrorMapBufferObjectFailed);
  int rc = peer_run((const char *[]){"mem-open-fails", hex, code, NULL}, NULL, -1,
                    10000, out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
  /* Nor does it open on another machine. */
  CUDA_OK(api.cudaMalloc(&d, 4096));
  CUDA_OK(api.cudaIpcGetMemHandle(&h, d));
  hex_encode(&h, sizeof(h), hex);
  snprintf(code, sizeof(code), "%d", (int)cudaErrorInvalidResourceHandle);
  rc = peer_run((const char *[]){"mem-open-fails", hex, code, NULL},
                (char *[]){"SHARDPORT_FAKE_NODE=3", NULL}, -1, 10000, out,
                sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
  CUDA_OK(api.cudaFree(d));
}
END_TEST

START_TEST(streams_run_in_order_and_events_order_streams) {
  char out[4096];
  int rc = peer_run((const char *[]){"streams", NULL},
                    (char *[]){"SHARDPORT_FAKE_DELAY_US=100000", NULL}, -1, 20000,
                    out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

START_TEST(an_interprocess_event_orders_work_in_another_process) {
  struct child producer;
  char mem[160], ev[160], line[256], out[4096];
  ck_assert_int_eq(peer_start(&producer, (const char *[]){"event-produce", NULL},
                              (char *[]){"SHARDPORT_FAKE_DELAY_US=300000", NULL}, -1),
                   0);
  ck_assert_int_eq(child_line(&producer, line, sizeof(line), 10000), 0);
  ck_assert_int_eq(sscanf(line, "mem %159s", mem), 1);
  ck_assert_int_eq(child_line(&producer, line, sizeof(line), 10000), 0);
  ck_assert_int_eq(sscanf(line, "event %159s", ev), 1);
  /* The producer's memset waits 300 ms on its stream; without the event
   * the consumer would read the poison bytes. */
  int rc = peer_run((const char *[]){"event-consume", mem, ev, "65536", "0x77", NULL},
                    NULL, -1, 10000, out, sizeof(out));
  child_kill(&producer, SIGTERM);
  child_finish(&producer, 5000, NULL, 0);
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

START_TEST(cumem_memory_travels_as_a_posix_fd) {
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
  size_t gran;
  ck_assert_int_eq(api.cuMemGetAllocationGranularity(&gran, &prop,
                                                      CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   CUDA_SUCCESS);
  ck_assert_uint_eq(gran, 2u << 20);
  CUmemGenericAllocationHandle h;
  ck_assert_int_eq(api.cuMemCreate(&h, gran + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  const size_t size = 2 * gran;
  ck_assert_int_eq(api.cuMemCreate(&h, size, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr va;
  ck_assert_int_eq(api.cuMemAddressReserve(&va, size, 0, 0, 0), CUDA_SUCCESS);
  ck_assert_uint_eq(va % gran, 0);
  ck_assert_int_eq(api.cuMemMap(va, size, 0, h, 0), CUDA_SUCCESS);
  ck_assert_int_eq(api.cuMemMap(va, size, 0, h, 0), CUDA_ERROR_INVALID_VALUE);

  /* That a new mapping is not yet accessible is cuda_faults_are_sticky's:
   * the illegal access would end this process's context. */
  cudaStream_t s;
  CUDA_OK(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  ck_assert_int_eq(api.cuMemSetAccess(va, size, &acc, 1), CUDA_SUCCESS);
  CUDA_OK(api.cudaMemsetAsync((void *)va, 0x3c, size, s));
  CUDA_OK(api.cudaStreamSynchronize(s));
  CUdeviceptr b;
  size_t len;
  ck_assert_int_eq(api.cuMemGetAddressRange(&b, &len, va + 100), CUDA_SUCCESS);
  ck_assert_uint_eq(b, va);
  ck_assert_uint_eq(len, size);

  int fd = -1;
  ck_assert_int_eq(api.cuMemExportToShareableHandle(&fd, h,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                   CUDA_SUCCESS);
  ck_assert_int_ge(fd, 0);
  char sizes[32], out[4096];
  snprintf(sizes, sizeof(sizes), "%zu", size);
  int rc = peer_run((const char *[]){"vmm-import", sizes, "0x3c", "0x4d", NULL}, NULL,
                    fd, 10000, out, sizeof(out));
  close(fd);
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
  unsigned char *host = malloc(size);
  read_device(host, (void *)va, size);
  size_t bad = first_difference(host, size, byte_4d);
  ck_assert_msg(bad == size, "byte %zu is 0x%02x", bad, host[bad]);
  free(host);

  /* Unmapping takes whole mappings; the reservation goes only when empty. */
  ck_assert_int_eq(api.cuMemUnmap(va, gran), CUDA_ERROR_INVALID_VALUE);
  ck_assert_int_eq(api.cuMemAddressFree(va, size), CUDA_ERROR_INVALID_VALUE);
  ck_assert_int_eq(api.cuMemUnmap(va, size), CUDA_SUCCESS);
  ck_assert_int_eq(api.cuMemGetAddressRange(&b, &len, va), CUDA_ERROR_NOT_FOUND);
  ck_assert_int_eq(api.cuMemRelease(h), CUDA_SUCCESS);
  ck_assert_int_eq(api.cuMemAddressFree(va, size), CUDA_SUCCESS);
  CUDA_OK(api.cudaStreamDestroy(s));
}
END_TEST

/* A real cuMem descriptor is an open of the driver's control device: two
 * allocations' descriptors have one st_dev and st_ino, so nothing may tell
 * allocations apart by fstat.  Each still imports its own bytes. */
START_TEST(cumem_fds_have_no_identity_of_their_own) {
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
  const size_t size = 2u << 20;
  const int fill[2] = {0x11, 0x22};
  CUmemGenericAllocationHandle h[2];
  CUdeviceptr va[2];
  int fd[2];
  struct stat st[2];
  CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  cudaStream_t s;
  CUDA_OK(api.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(api.cuMemCreate(&h[i], size, &prop, 0), CUDA_SUCCESS);
    ck_assert_int_eq(api.cuMemAddressReserve(&va[i], size, 0, 0, 0), CUDA_SUCCESS);
    ck_assert_int_eq(api.cuMemMap(va[i], size, 0, h[i], 0), CUDA_SUCCESS);
    ck_assert_int_eq(api.cuMemSetAccess(va[i], size, &acc, 1), CUDA_SUCCESS);
    CUDA_OK(api.cudaMemsetAsync((void *)va[i], fill[i], size, s));
    ck_assert_int_eq(api.cuMemExportToShareableHandle(
                         &fd[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                     CUDA_SUCCESS);
    ck_assert_int_eq(fstat(fd[i], &st[i]), 0);
  }
  CUDA_OK(api.cudaStreamSynchronize(s));
  ck_assert_uint_eq(st[0].st_dev, st[1].st_dev);
  ck_assert_uint_eq(st[0].st_ino, st[1].st_ino);
  char sizes[32], expect[8], out[4096];
  snprintf(sizes, sizeof(sizes), "%zu", size);
  for (int i = 0; i < 2; i++) {
    snprintf(expect, sizeof(expect), "0x%02x", fill[i]);
    int rc = peer_run((const char *[]){"vmm-import", sizes, expect, expect, NULL},
                      NULL, fd[i], 10000, out, sizeof(out));
    ck_assert_msg(rc == 0, "allocation %d: status %d: %s", i, rc, out);
    close(fd[i]);
    ck_assert_int_eq(api.cuMemUnmap(va[i], size), CUDA_SUCCESS);
    ck_assert_int_eq(api.cuMemRelease(h[i]), CUDA_SUCCESS);
    ck_assert_int_eq(api.cuMemAddressFree(va[i], size), CUDA_SUCCESS);
  }
  CUDA_OK(api.cudaStreamDestroy(s));
}
END_TEST

/* Access to a cuMem mapping is per device, and touching it from a device
 * without access is an illegal address that ends that device's context
 * (every later call on it fails alike) and no other device's.  In a peer
 * process, whose context may die. */
START_TEST(cumem_access_is_per_device_and_faults_are_sticky) {
  char out[4096];
  int rc = peer_run((const char *[]){"vmm-fault", NULL}, NULL, -1, 10000, out,
                    sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

START_TEST(the_memory_limit_is_per_device) {
  char out[4096];
  int rc = peer_run((const char *[]){"malloc-limit", NULL},
                    (char *[]){"SHARDPORT_FAKE_MEM_MB=4", NULL}, -1, 10000, out,
                    sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

START_TEST(contexts_are_made_where_the_runtime_makes_them) {
  char out[4096];
  int rc = peer_run((const char *[]){"contexts", NULL},
                    (char *[]){"SHARDPORT_FAKE_CTX_MB=64", NULL}, -1, 10000,
                    out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

/* Exclusive-process mode: one process of the machine at a time has a
 * context on the device, and the device is free again once it ended. */
START_TEST(an_exclusive_process_device_takes_one_process) {
  char *env[] = {"SHARDPORT_FAKE_COMPUTE_MODE=1:exclusive_process", NULL};
  char out[4096], line[256];
  struct child holder;
  ck_assert_int_eq(peer_start(&holder, (const char *[]){"ctx-hold", "1", NULL},
                              env, -1), 0);
  ck_assert_int_eq(child_line(&holder, line, sizeof(line), 10000), 0);
  ck_assert_str_eq(line, "held");
  int rc = peer_run((const char *[]){"ctx-refused", "1", NULL}, env, -1, 10000,
                    out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
  child_kill(&holder, SIGKILL);
  child_finish(&holder, 10000, NULL, 0);
  ck_assert_int_eq(peer_start(&holder, (const char *[]){"ctx-hold", "1", NULL},
                              env, -1), 0);
  ck_assert_int_eq(child_line(&holder, line, sizeof(line), 10000), 0);
  ck_assert_str_eq(line, "held");
  child_kill(&holder, SIGKILL);
  child_finish(&holder, 10000, NULL, 0);
  /* Prohibited: no context at all. */
  rc = peer_run((const char *[]){"ctx-hold", "0", NULL},
                (char *[]){"SHARDPORT_FAKE_COMPUTE_MODE=0:prohibited", NULL},
                -1, 10000, out, sizeof(out));
  ck_assert_msg(rc == 1 && strstr(out, "CUDA error 46") != NULL,
                "status %d: %s", rc, out);
}
END_TEST

START_TEST(an_unmap_does_not_wait_for_queued_copies) {
  char out[4096];
  int rc = peer_run((const char *[]){"unmap-late", NULL},
                    (char *[]){"SHARDPORT_FAKE_DELAY_US=200000", NULL}, -1,
                    10000, out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
}
END_TEST

/* Used bytes of device 0 as cudaMemGetInfo reports them. */
static size_t used_on_device0(void) {
  __typeof__(cudaMemGetInfo) *get_info = dlsym(api.cudart_handle, "cudaMemGetInfo");
  ck_assert_ptr_nonnull(get_info);
  size_t free_b, total;
  CUDA_OK(api.cudaSetDevice(0));
  CUDA_OK(get_info(&free_b, &total));
  return total - free_b;
}

START_TEST(freed_memory_stays_taken_while_another_process_has_it_open) {
  const size_t len = 4u << 20;
  size_t before = used_on_device0();
  void *d;
  cudaIpcMemHandle_t h;
  CUDA_OK(api.cudaMalloc(&d, len));
  ck_assert_uint_eq(used_on_device0(), before + len);
  CUDA_OK(api.cudaIpcGetMemHandle(&h, d));
  char hex[2 * sizeof(h) + 1], line[256];
  hex_encode(&h, sizeof(h), hex);
  struct child holder;
  ck_assert_int_eq(peer_start(&holder, (const char *[]){"mem-hold", hex, NULL},
                              NULL, -1), 0);
  ck_assert_int_eq(child_line(&holder, line, sizeof(line), 10000), 0);
  ck_assert_str_eq(line, "open");
  /* Freed here, still open there: still taken. */
  CUDA_OK(api.cudaFree(d));
  ck_assert_uint_eq(used_on_device0(), before + len);
  /* The importer's end lets it go. */
  child_kill(&holder, SIGKILL);
  child_finish(&holder, 10000, NULL, 0);
  ck_assert_uint_eq(used_on_device0(), before);
  /* An importer that closed it already holds nothing. */
  CUDA_OK(api.cudaMalloc(&d, len));
  CUDA_OK(api.cudaIpcGetMemHandle(&h, d));
  hex_encode(&h, sizeof(h), hex);
  char out[4096];
  int rc = peer_run((const char *[]){"mem-open", hex, "0", "16", "0xa5", "0x01",
                                     NULL},
                    NULL, -1, 10000, out, sizeof(out));
  ck_assert_msg(rc == 0, "status %d: %s", rc, out);
  CUDA_OK(api.cudaFree(d));
  ck_assert_uint_eq(used_on_device0(), before);
}
END_TEST

/* Every error the fake runtime answers has its name, as the real
 * cudaGetErrorString gives one for every code. */
START_TEST(every_error_the_fake_answers_is_named) {
  const cudaError_t codes[] = {
      cudaErrorInvalidValue,          cudaErrorMemoryAllocation,
      cudaErrorInvalidPitchValue,     cudaErrorInvalidMemcpyDirection,
      cudaErrorInsufficientDriver,    cudaErrorNoDevice,
      cudaErrorInvalidDevice,         cudaErrorDeviceUninitialized,
      cudaErrorMapBufferObjectFailed, cudaErrorPeerAccessUnsupported,
      cudaErrorInvalidResourceHandle, cudaErrorNotReady,
      cudaErrorPeerAccessAlreadyEnabled, cudaErrorNotSupported,
      cudaErrorIllegalAddress,        cudaErrorDevicesUnavailable,
  };
  const char *unknown = api.cudaGetErrorString((cudaError_t)99999);
  for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
    ck_assert_msg(strcmp(api.cudaGetErrorString(codes[i]), unknown) != 0,
                  "error %d has no name", (int)codes[i]);
}
END_TEST

START_TEST(driver_entry_points_follow_the_documented_contract) {
  void *fn = (void *)1;
  enum cudaDriverEntryPointQueryResult st;
  CUDA_OK(api.cudaGetDriverEntryPointByVersion("cuNoSuchThing", &fn, 12000,
                                               cudaEnableDefault, &st));
  ck_assert_ptr_null(fn);
  ck_assert_int_eq(st, cudaDriverEntryPointSymbolNotFound);
  CUDA_OK(api.cudaGetDriverEntryPointByVersion("cuMemCreate", &fn, 10000,
                                               cudaEnableDefault, &st));
  ck_assert_ptr_null(fn);
  ck_assert_int_eq(st, cudaDriverEntryPointVersionNotSufficent);
  ck_assert_int_eq(api.cudaGetDriverEntryPointByVersion("cuMemCreate", &fn, 99000,
                                                        cudaEnableDefault, &st),
                   cudaErrorInvalidValue);
  int can;
  CUDA_OK(api.cudaDeviceCanAccessPeer(&can, 0, 1));
  ck_assert_int_eq(can, 1);
  CUDA_OK(api.cudaDeviceCanAccessPeer(&can, 0, 0));
  ck_assert_int_eq(can, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("fake-cudart");
  TCase *tc = tcase_create("contracts");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, device_identity_is_stable_and_follows_the_machine);
  tcase_add_test(tc, the_current_device_belongs_to_the_thread);
  tcase_add_test(tc, a_pointer_inside_an_allocation_names_its_base);
  tcase_add_test(tc, another_process_reads_and_writes_through_a_handle);
  tcase_add_test(tc, a_freed_allocation_does_not_open);
  tcase_add_test(tc, streams_run_in_order_and_events_order_streams);
  tcase_add_test(tc, an_interprocess_event_orders_work_in_another_process);
  tcase_add_test(tc, cumem_memory_travels_as_a_posix_fd);
  tcase_add_test(tc, cumem_fds_have_no_identity_of_their_own);
  tcase_add_test(tc, cumem_access_is_per_device_and_faults_are_sticky);
  tcase_add_test(tc, the_memory_limit_is_per_device);
  tcase_add_test(tc, driver_entry_points_follow_the_documented_contract);
  tcase_add_test(tc, contexts_are_made_where_the_runtime_makes_them);
  tcase_add_test(tc, an_exclusive_process_device_takes_one_process);
  tcase_add_test(tc, an_unmap_does_not_wait_for_queued_copies);
  tcase_add_test(tc, freed_memory_stays_taken_while_another_process_has_it_open);
  tcase_add_test(tc, every_error_the_fake_answers_is_named);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
