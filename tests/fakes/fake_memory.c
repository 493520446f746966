/*
 * fake_memory.c - device memory of the fake CUDA runtime: cudaMalloc'd
 * allocations, legacy IPC memory handles, and the driver's cuMem calls
 * (reserve, create, map, access, POSIX fd export and import).
 *
 * "Device memory" is host memory backed by memfds, so other processes can
 * map the same bytes: a legacy IPC handle names the exporting process, its
 * memfd's descriptor number and inode, and the importer opens
 * /proc/<pid>/fd/<n> and checks the inode.  As with real CUDA, the memory
 * lives while the exporter holds it, a handle of a freed allocation does not
 * open, and an importer's mapping keeps the bytes alive after the exporter
 * frees them.
 *
 * Every allocation, import and mapping is a region in one sorted table, so
 * that any pointer inside one yields its base, size and device.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake.h"

/* What cuMemGetAllocationGranularity reports, both minimum and recommended:
 * the 2 MiB of real devices, so that alignment mistakes show. */
#define VMM_GRANULARITY ((size_t)2 << 20)

enum region_kind { REGION_MALLOC, REGION_IPC, REGION_VMM };

struct vmm_alloc {
  struct vmm_alloc *next;
  int fd;
  size_t size;
  int phys;
  bool exportable; /* requested CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  bool counted;    /* created here, so counted against the memory limit */
  int refs;        /* the handle, plus one per mapping */
};

struct region {
  uint64_t id;      /* unique in the process: an address may be reused */
  uintptr_t base;
  size_t size;
  size_t map_len;
  int phys;
  enum region_kind kind;
  int access;       /* FAKE_READ | FAKE_WRITE; REGION_VMM: of any device */
  int dev_access[FAKE_MAX_GPUS]; /* REGION_VMM: per physical device */
  int fd;           /* REGION_MALLOC: the memfd, kept for IPC export */
  uint64_t ino;     /* REGION_MALLOC and REGION_IPC: the memfd's inode */
  pid_t exporter;   /* REGION_IPC */
  int refs;         /* REGION_IPC: opens not yet closed */
  int ctx_device;   /* REGION_IPC: current device of the first open */
  struct vmm_alloc *alloc; /* REGION_VMM */
};

/* An allocation its process freed while another process still had it
 * open: its memory stays taken, and counted, until the last importer
 * closed it or ended (IPC memory handles, below). */
struct held {
  struct held *next;
  int fd; /* the memfd, only to ask whether an importer still maps it */
  size_t size;
  int phys;
};

struct reservation {
  struct reservation *next;
  uintptr_t base;
  size_t size;
};

static struct {
  pthread_mutex_t lock;
  struct region **v; /* sorted by base, never overlapping */
  size_t n, cap;
  struct vmm_alloc *allocs;
  struct reservation *reservations;
  struct held *held;
  size_t used[FAKE_MAX_GPUS]; /* bytes per physical device, held ones too */
  uint64_t last_id;
  /* NCCL operations in flight per physical device (spfake_kernels). */
  _Atomic int kernels[FAKE_MAX_GPUS];
} mem = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Held shared by a stream worker while an operation touches device memory,
 * exclusive by the calls that take memory away without waiting for the
 * streams (cuMemUnmap, cudaIpcCloseMemHandle): an operation runs either
 * wholly before the memory goes, or finds it gone (fake_region_alive). */
static pthread_rwlock_t unmap_lock = PTHREAD_RWLOCK_INITIALIZER;

void fake_memory_use_begin(void) { pthread_rwlock_rdlock(&unmap_lock); }

void fake_memory_use_end(void) { pthread_rwlock_unlock(&unmap_lock); }

/* The legacy IPC memory handle's bytes (CUDA_IPC_HANDLE_SIZE of them). */
struct ipc_mem_wire {
  char magic[8];
  uint32_t node;
  int32_t pid;
  int32_t fd;
  int32_t phys;
  uint64_t ino;
  uint64_t size;
};
_Static_assert(sizeof(struct ipc_mem_wire) <= sizeof(cudaIpcMemHandle_t),
               "the fake handle must fit a cudaIpcMemHandle_t");
static const char ipc_mem_magic[8] = "SPFKMEM1";

static size_t page_round(size_t n) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return (n + page - 1) / page * page;
}

/* Index of the first region whose base is above p. */
static size_t upper_bound(uintptr_t p) {
  size_t lo = 0, hi = mem.n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (mem.v[mid]->base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static struct region *region_find(uintptr_t p) {
  size_t i = upper_bound(p);
  if (i == 0)
    return NULL;
  struct region *r = mem.v[i - 1];
  return p - r->base < r->size ? r : NULL;
}

static bool region_insert(struct region *r) {
  if (mem.n == mem.cap) {
    size_t cap = mem.cap ? mem.cap * 2 : 64;
    struct region **v = realloc(mem.v, cap * sizeof(*v));
    if (v == NULL)
      return false;
    mem.v = v;
    mem.cap = cap;
  }
  size_t i = upper_bound(r->base);
  memmove(mem.v + i + 1, mem.v + i, (mem.n - i) * sizeof(*mem.v));
  mem.v[i] = r;
  mem.n++;
  r->id = ++mem.last_id;
  return true;
}

uint64_t fake_region_of(const void *ptr) {
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)ptr);
  uint64_t id = r != NULL ? r->id : 0;
  pthread_mutex_unlock(&mem.lock);
  return id;
}

bool fake_region_alive(const void *ptr, uint64_t id) {
  if (id == 0)
    return true;
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)ptr);
  bool alive = r != NULL && r->id == id;
  pthread_mutex_unlock(&mem.lock);
  return alive;
}

static void region_remove(struct region *r) {
  for (size_t i = 0; i < mem.n; i++)
    if (mem.v[i] == r) {
      memmove(mem.v + i, mem.v + i + 1, (mem.n - i - 1) * sizeof(*mem.v));
      mem.n--;
      return;
    }
}

cudaError_t fake_check_range(const void *ptr, size_t len, int access,
                             bool must_be_device, int phys) {
  if (len == 0)
    return cudaSuccess;
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)ptr);
  cudaError_t err = cudaSuccess;
  if (r == NULL)
    err = must_be_device ? cudaErrorInvalidValue : cudaSuccess;
  else if (len > r->size - ((uintptr_t)ptr - r->base))
    err = cudaErrorInvalidValue;
  else if (((r->kind == REGION_VMM && phys >= 0 ? r->dev_access[phys]
                                                  : r->access) &
            access) != access)
    err = cudaErrorIllegalAddress;
  pthread_mutex_unlock(&mem.lock);
  return err;
}

cudaError_t spfake_check_device_range(const void *ptr, size_t len,
                                      bool write) {
  return fake_check_range(ptr, len, write ? FAKE_READ | FAKE_WRITE : FAKE_READ,
                          true, fake_physical(fake_current_device()));
}

/* A memfd of size bytes, filled with the poison byte unless disabled. */
static int memfd_new(const char *name, size_t size) {
  const struct fake_config *cfg = fake_config(NULL);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0)
    return -1;
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return -1;
  }
  if (cfg->poison) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      return -1;
    }
    memset(p, FAKE_POISON_BYTE, size);
    munmap(p, size);
  }
  return fd;
}

/* Whether another process still maps memfd fd.  An importer holds an
 * open-file-description read lock on its own open of the memfd
 * (cudaIpcOpenMemHandle), which its mapping keeps alive after the
 * descriptor is closed and which the kernel drops when the mapping goes,
 * whether by cudaIpcCloseMemHandle or because the process ended. */
static bool imported_elsewhere(int fd) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
  return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

/* Lets go of held allocations no importer has open any more.  Lock held. */
static void held_sweep(void) {
  for (struct held **pp = &mem.held; *pp != NULL;) {
    struct held *h = *pp;
    if (imported_elsewhere(h->fd)) {
      pp = &h->next;
      continue;
    }
    *pp = h->next;
    mem.used[h->phys] -= h->size;
    close(h->fd);
    free(h);
  }
}

/* Device memory in use on phys: allocations, held ones, and the context.
 * Lock held. */
static size_t device_used(int phys) {
  held_sweep();
  return mem.used[phys] + fake_context_bytes(phys);
}

/* What cudaMemGetInfo calls total: SHARDPORT_FAKE_MEM_MB, else the 80 GiB
 * of an H100. */
static size_t device_total(void) {
  size_t limit = fake_config(NULL)->mem_limit;
  return limit != 0 ? limit : (size_t)80 << 30;
}

/* Reserves size bytes of the per-device budget; false when over it. */
static bool budget_take(int phys, size_t size) {
  size_t used = device_used(phys);
  if (fake_config(NULL)->mem_limit != 0 &&
      (used > device_total() || size > device_total() - used))
    return false;
  mem.used[phys] += size;
  return true;
}

/* Free and total memory of the current device as the process sees it: what
 * its allocations, the allocations it freed while another process still
 * had them open, and its context take (docs/fakes.md). */
cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  FAKE_LIVE();
  if (free == NULL || total == NULL)
    return fake_error(cudaErrorInvalidValue);
  int phys = fake_physical(fake_current_device());
  pthread_mutex_lock(&mem.lock);
  size_t used = device_used(phys);
  pthread_mutex_unlock(&mem.lock);
  *total = device_total();
  *free = used < *total ? *total - used : 0;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **devPtr, size_t size) {
  FAKE_LIVE();
  if (devPtr == NULL)
    return fake_error(cudaErrorInvalidValue);
  if (size == 0) {
    *devPtr = NULL;
    return cudaSuccess;
  }
  int phys = fake_physical(fake_current_device());
  pthread_mutex_lock(&mem.lock);
  bool ok = budget_take(phys, size);
  pthread_mutex_unlock(&mem.lock);
  if (!ok)
    return fake_error(cudaErrorMemoryAllocation);
  struct region *r = calloc(1, sizeof(*r));
  int fd = memfd_new("spfake-mem", size);
  void *p = MAP_FAILED;
  struct stat st;
  if (r != NULL && fd >= 0 && fstat(fd, &st) == 0)
    p = mmap(NULL, page_round(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p != MAP_FAILED) {
    *r = (struct region){.base = (uintptr_t)p, .size = size,
                         .map_len = page_round(size), .phys = phys,
                         .kind = REGION_MALLOC, .access = FAKE_READ | FAKE_WRITE,
                         .fd = fd, .ino = (uint64_t)st.st_ino};
    pthread_mutex_lock(&mem.lock);
    ok = region_insert(r);
    pthread_mutex_unlock(&mem.lock);
    if (ok) {
      *devPtr = p;
      return cudaSuccess;
    }
    munmap(p, page_round(size));
  }
  if (fd >= 0)
    close(fd);
  free(r);
  pthread_mutex_lock(&mem.lock);
  mem.used[phys] -= size;
  pthread_mutex_unlock(&mem.lock);
  return fake_error(cudaErrorMemoryAllocation);
}

/* Like the real cudaFree ("may perform implicit synchronization", in the
 * header), waits for the process's streams first, so that no queued copy
 * touches memory that is gone.  Freeing while NCCL operations are in
 * flight on the device is what NCCL warns can deadlock (cudaFree
 * synchronises the device while NCCL kernels wait for their peers): the
 * fake ends the process, loudly, rather than sometimes hang, before it
 * waits. */
cudaError_t cudaFree(void *devPtr) {
  FAKE_READY();
  if (devPtr == NULL)
    return cudaSuccess;
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)devPtr);
  bool valid = r != NULL && r->base == (uintptr_t)devPtr &&
               r->kind == REGION_MALLOC;
  int phys = valid ? r->phys : -1;
  pthread_mutex_unlock(&mem.lock);
  if (!valid)
    return fake_error(cudaErrorInvalidValue);
  if (atomic_load(&mem.kernels[phys]) > 0) {
    fprintf(stderr,
            "fake CUDA: cudaFree(%p) on physical device %d while %d NCCL "
            "operation(s) are in flight there, which can deadlock on a GPU "
            "(docs/fakes.md)\n",
            devPtr, phys, atomic_load(&mem.kernels[phys]));
    abort();
  }
  fake_sync_all_streams();
  pthread_mutex_lock(&mem.lock);
  /* Another thread may have freed it meanwhile. */
  r = region_find((uintptr_t)devPtr);
  if (r == NULL || r->base != (uintptr_t)devPtr || r->kind != REGION_MALLOC) {
    pthread_mutex_unlock(&mem.lock);
    return fake_error(cudaErrorInvalidValue);
  }
  region_remove(r);
  /* Freeing memory another process has open leaves it taken until that
   * process closes it (docs/fakes.md, IPC memory handles). */
  struct held *h = imported_elsewhere(r->fd) ? calloc(1, sizeof(*h)) : NULL;
  if (h != NULL) {
    *h = (struct held){.next = mem.held, .fd = r->fd, .size = r->size,
                       .phys = r->phys};
    mem.held = h;
  } else {
    mem.used[r->phys] -= r->size;
    close(r->fd);
  }
  pthread_mutex_unlock(&mem.lock);
  munmap(devPtr, r->map_len);
  free(r);
  return cudaSuccess;
}

/* Page-locked host memory (CUDA Runtime API, "cudaMallocHost",
 * "cudaHostAlloc" and "cudaFreeHost"): ordinary host memory here, which
 * copies reach as they reach any host memory, but remembered, so that an
 * async copy can tell it from pageable memory (fake_host_pinned); what is
 * modelled besides is that it must come back through cudaFreeHost, and that
 * a failed allocation says so. */
struct pinned {
  struct pinned *next;
  uintptr_t base;
  size_t size;
};

static struct {
  pthread_mutex_t lock;
  struct pinned *all;
} pinned = {.lock = PTHREAD_MUTEX_INITIALIZER};

bool fake_host_pinned(const void *ptr, size_t len) {
  uintptr_t p = (uintptr_t)ptr;
  bool found = false;
  pthread_mutex_lock(&pinned.lock);
  for (const struct pinned *b = pinned.all; b != NULL && !found; b = b->next)
    found = p >= b->base && p - b->base <= b->size &&
            len <= b->size - (p - b->base);
  pthread_mutex_unlock(&pinned.lock);
  return found;
}

cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags) {
  FAKE_READY();
  if (pHost == NULL ||
      (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped |
                           cudaHostAllocWriteCombined)) != 0)
    return fake_error(cudaErrorInvalidValue);
  struct pinned *b = malloc(sizeof *b);
  void *p = malloc(size > 0 ? size : 1);
  if (b == NULL || p == NULL) {
    free(b);
    free(p);
    return fake_error(cudaErrorMemoryAllocation);
  }
  *b = (struct pinned){.base = (uintptr_t)p, .size = size};
  pthread_mutex_lock(&pinned.lock);
  b->next = pinned.all;
  pinned.all = b;
  pthread_mutex_unlock(&pinned.lock);
  *pHost = p;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void *ptr) {
  FAKE_READY();
  if (ptr == NULL)
    return cudaSuccess;
  struct pinned *b = NULL;
  pthread_mutex_lock(&pinned.lock);
  for (struct pinned **pp = &pinned.all; *pp != NULL; pp = &(*pp)->next)
    if ((*pp)->base == (uintptr_t)ptr) {
      b = *pp;
      *pp = b->next;
      break;
    }
  pthread_mutex_unlock(&pinned.lock);
  if (b == NULL)
    return fake_error(cudaErrorInvalidValue);
  /* As cudaFree, it waits for the device's work first. */
  fake_sync_all_streams();
  free(ptr);
  free(b);
  return cudaSuccess;
}

bool spfake_device_identity(int ordinal, uint64_t *id) {
  cudaError_t err;
  const struct fake_config *cfg = fake_config(&err);
  int phys = fake_physical(ordinal);
  if (err != cudaSuccess || phys < 0)
    return false;
  *id = (uint64_t)cfg->node << 32 | (uint64_t)phys;
  return true;
}

cudaError_t spfake_device_charge(int ordinal, size_t bytes) {
  int phys = fake_physical(ordinal);
  if (phys < 0)
    return cudaErrorInvalidDevice;
  pthread_mutex_lock(&mem.lock);
  bool ok = budget_take(phys, bytes);
  pthread_mutex_unlock(&mem.lock);
  return ok ? cudaSuccess : cudaErrorMemoryAllocation;
}

void spfake_device_uncharge(int ordinal, size_t bytes) {
  int phys = fake_physical(ordinal);
  if (phys < 0)
    return;
  pthread_mutex_lock(&mem.lock);
  mem.used[phys] -= bytes;
  pthread_mutex_unlock(&mem.lock);
}

void spfake_kernels(int ordinal, int delta) {
  int phys = fake_physical(ordinal);
  if (phys >= 0)
    atomic_fetch_add(&mem.kernels[phys], delta);
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes,
                                     const void *ptr) {
  FAKE_READY();
  if (attributes == NULL)
    return fake_error(cudaErrorInvalidValue);
  memset(attributes, 0, sizeof(*attributes));
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)ptr);
  if (r == NULL) {
    /* Since CUDA 11 a host pointer is a success of type Unregistered. */
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -1;
  } else {
    int ordinal = fake_ordinal(r->phys);
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = ordinal >= 0 ? ordinal : r->ctx_device;
    attributes->devicePointer = (void *)ptr;
  }
  pthread_mutex_unlock(&mem.lock);
  return cudaSuccess;
}

/* The handle of the allocation that contains devPtr: the base's handle for
 * any pointer inside it, as with real CUDA; the caller sends the offset. */
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *devPtr) {
  FAKE_LIVE();
  const struct fake_config *cfg = fake_config(NULL);
  if (handle == NULL)
    return fake_error(cudaErrorInvalidValue);
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)devPtr);
  if (r == NULL || r->kind != REGION_MALLOC) {
    pthread_mutex_unlock(&mem.lock);
    return fake_error(cudaErrorInvalidValue);
  }
  struct ipc_mem_wire w = {.node = cfg->node, .pid = (int32_t)getpid(),
                           .fd = r->fd, .phys = r->phys, .ino = r->ino,
                           .size = r->size};
  memcpy(w.magic, ipc_mem_magic, sizeof(w.magic));
  pthread_mutex_unlock(&mem.lock);
  memset(handle, 0, sizeof(*handle));
  memcpy(handle->reserved, &w, sizeof(w));
  return cudaSuccess;
}

static struct region *ipc_find(pid_t pid, uint64_t ino) {
  for (size_t i = 0; i < mem.n; i++)
    if (mem.v[i]->kind == REGION_IPC && mem.v[i]->exporter == pid &&
        mem.v[i]->ino == ino)
      return mem.v[i];
  return NULL;
}

/* A handle this process has open already: the same pointer and one more
 * reference under the same device, refused under another.  Lock held;
 * false when the handle is not open here. */
static bool ipc_reopen(const struct ipc_mem_wire *w, int dev, void **devPtr,
                       cudaError_t *err) {
  struct region *r = ipc_find(w->pid, w->ino);
  if (r == NULL)
    return false;
  *err = r->ctx_device == dev ? cudaSuccess : cudaErrorInvalidValue;
  if (*err == cudaSuccess) {
    r->refs++;
    *devPtr = (void *)r->base;
  }
  return true;
}

/* Maps the exporter's memfd.  A process cannot open its own handles
 * (cudaErrorDeviceUninitialized, "invalid device context", as the real
 * driver answers); a second open of the same handle under the same device
 * returns the same pointer and counts a reference, as documented; an open
 * under another device is refused (docs/fakes.md explains the choice). */
cudaError_t cudaIpcOpenMemHandle(void **devPtr, cudaIpcMemHandle_t handle,
                                 unsigned int flags) {
  FAKE_LIVE();
  const struct fake_config *cfg = fake_config(NULL);
  if (devPtr == NULL || (flags & ~(unsigned)cudaIpcMemLazyEnablePeerAccess) != 0)
    return fake_error(cudaErrorInvalidValue);
  struct ipc_mem_wire w;
  memcpy(&w, handle.reserved, sizeof(w));
  if (memcmp(w.magic, ipc_mem_magic, sizeof(w.magic)) != 0 ||
      w.node != cfg->node || w.size == 0)
    return fake_error(cudaErrorInvalidResourceHandle);
  if (w.pid == (int32_t)getpid())
    return fake_error(cudaErrorDeviceUninitialized);
  int dev = fake_current_device();
  cudaError_t err;
  pthread_mutex_lock(&mem.lock);
  bool open_here = ipc_reopen(&w, dev, devPtr, &err);
  pthread_mutex_unlock(&mem.lock);
  if (open_here)
    return fake_error(err);

  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)w.pid, (int)w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0)
    return fake_error(cudaErrorMapBufferObjectFailed);
  size_t len = page_round((size_t)w.size);
  void *p = MAP_FAILED;
  /* The read lock tells the exporter that this process has the memory
   * open, for as long as the mapping lasts (imported_elsewhere). */
  struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET};
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_ino == w.ino &&
      (uint64_t)st.st_size >= w.size && fcntl(fd, F_OFD_SETLK, &fl) == 0)
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  struct region *r = calloc(1, sizeof(*r));
  if (p == MAP_FAILED || r == NULL) {
    if (p != MAP_FAILED)
      munmap(p, len);
    free(r);
    return fake_error(cudaErrorMapBufferObjectFailed);
  }
  *r = (struct region){.base = (uintptr_t)p, .size = (size_t)w.size,
                       .map_len = len, .phys = w.phys, .kind = REGION_IPC,
                       .access = FAKE_READ | FAKE_WRITE, .fd = -1,
                       .ino = w.ino, .exporter = w.pid, .refs = 1,
                       .ctx_device = dev};
  /* Another thread may have opened the same handle meanwhile. */
  pthread_mutex_lock(&mem.lock);
  open_here = ipc_reopen(&w, dev, devPtr, &err);
  bool inserted = !open_here && region_insert(r);
  pthread_mutex_unlock(&mem.lock);
  if (inserted) {
    *devPtr = p;
    return cudaSuccess;
  }
  munmap(p, len);
  free(r);
  return fake_error(open_here ? err : cudaErrorMapBufferObjectFailed);
}

/* Does not wait for the streams: nothing in the header says it does
 * (unlike cudaFree), so a copy still queued on the mapping when it goes
 * is caught when it runs (fake_stream.c). */
cudaError_t cudaIpcCloseMemHandle(void *devPtr) {
  FAKE_READY();
  pthread_rwlock_wrlock(&unmap_lock);
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)devPtr);
  cudaError_t err = cudaSuccess;
  if (r == NULL || r->base != (uintptr_t)devPtr || r->kind != REGION_IPC)
    err = cudaErrorInvalidValue;
  else if (--r->refs > 0)
    r = NULL;
  else
    region_remove(r);
  pthread_mutex_unlock(&mem.lock);
  if (err == cudaSuccess && r != NULL) {
    munmap(devPtr, r->map_len);
    free(r);
  }
  pthread_rwlock_unlock(&unmap_lock);
  return fake_error(err);
}

/* Like every driver call that works in a context, it needs one current on
 * the thread (CUDA_ERROR_INVALID_CONTEXT in its documented returns). */
CUresult fake_cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize,
                                   CUdeviceptr dptr) {
  if (!fake_thread_has_context())
    return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)dptr);
  if (r != NULL) {
    if (pbase != NULL)
      *pbase = (CUdeviceptr)r->base;
    if (psize != NULL)
      *psize = r->size;
  }
  pthread_mutex_unlock(&mem.lock);
  return r != NULL ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* The allocation properties the fake supports: pinned device memory,
 * optionally exportable as a POSIX fd. */
static CUresult check_prop(const CUmemAllocationProp *prop) {
  if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (fake_physical(prop->location.id) < 0)
    return CUDA_ERROR_INVALID_DEVICE;
  if ((prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetAllocationGranularity(size_t *granularity,
                                            const CUmemAllocationProp *prop,
                                            CUmemAllocationGranularity_flags option) {
  (void)option;
  CUresult res = check_prop(prop);
  if (res != CUDA_SUCCESS)
    return res;
  if (granularity == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  *granularity = VMM_GRANULARITY;
  return CUDA_SUCCESS;
}

static struct vmm_alloc *alloc_find(CUmemGenericAllocationHandle handle) {
  for (struct vmm_alloc *a = mem.allocs; a != NULL; a = a->next)
    if ((CUmemGenericAllocationHandle)(uintptr_t)a == handle)
      return a;
  return NULL;
}

static struct vmm_alloc *alloc_add(int fd, size_t size, int phys,
                                   bool exportable, bool counted) {
  struct vmm_alloc *a = calloc(1, sizeof(*a));
  if (a == NULL)
    return NULL;
  *a = (struct vmm_alloc){.next = mem.allocs, .fd = fd, .size = size,
                          .phys = phys, .exportable = exportable,
                          .counted = counted, .refs = 1};
  mem.allocs = a;
  return a;
}

/* Drops one reference; the last one frees the memory.  Lock held. */
static void alloc_unref(struct vmm_alloc *a) {
  if (--a->refs > 0)
    return;
  for (struct vmm_alloc **pp = &mem.allocs; *pp != NULL; pp = &(*pp)->next)
    if (*pp == a) {
      *pp = a->next;
      break;
    }
  if (a->counted)
    mem.used[a->phys] -= a->size;
  close(a->fd);
  free(a);
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop,
                          unsigned long long flags) {
  CUresult res = check_prop(prop);
  if (res != CUDA_SUCCESS)
    return res;
  if (handle == NULL || flags != 0 || size == 0 || size % VMM_GRANULARITY != 0)
    return CUDA_ERROR_INVALID_VALUE;
  int phys = fake_physical(prop->location.id);
  /* The name carries the machine and device, so that an importer can tell
   * a fake allocation from any other fd. */
  char name[64];
  snprintf(name, sizeof(name), "spfake-vmm-%u-%d", fake_config(NULL)->node,
           phys);
  pthread_mutex_lock(&mem.lock);
  bool ok = budget_take(phys, size);
  pthread_mutex_unlock(&mem.lock);
  if (!ok)
    return CUDA_ERROR_OUT_OF_MEMORY;
  int fd = memfd_new(name, size);
  pthread_mutex_lock(&mem.lock);
  struct vmm_alloc *a =
      fd < 0 ? NULL
             : alloc_add(fd, size, phys,
                         prop->requestedHandleTypes ==
                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                         true);
  if (a == NULL) {
    mem.used[phys] -= size;
    if (fd >= 0)
      close(fd);
  }
  pthread_mutex_unlock(&mem.lock);
  if (a == NULL)
    return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  pthread_mutex_lock(&mem.lock);
  struct vmm_alloc *a = alloc_find(handle);
  if (a != NULL)
    alloc_unref(a);
  pthread_mutex_unlock(&mem.lock);
  return a != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* An exported descriptor stands for the allocation the way a real one does:
 * with no identity of its own.  The real driver's descriptor is an open of
 * its control device, so every one has the same st_dev and st_ino; the
 * fake's is an eventfd (all eventfds share the kernel's one anonymous
 * inode), and its counter, which travels with the open file description
 * through SCM_RIGHTS and dup, names the exporter's memfd: pid, descriptor
 * number and the low bits of its inode.  The counter is read back from
 * /proc/self/fdinfo, which leaves it unchanged. */
#define VMM_FD_BITS 20
#define VMM_INO_BITS 21
#define VMM_PID_BITS 22

static uint64_t vmm_token(pid_t pid, int fd, uint64_t ino) {
  return (uint64_t)pid << (VMM_FD_BITS + VMM_INO_BITS) |
         (uint64_t)fd << VMM_INO_BITS |
         (ino & (((uint64_t)1 << VMM_INO_BITS) - 1));
}

/* The token of an exported descriptor; false when fd is no eventfd. */
static bool vmm_token_read(int fd, uint64_t *token) {
  char path[64], line[128];
  snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", fd);
  FILE *f = fopen(path, "re");
  if (f == NULL)
    return false;
  bool found = false;
  while (!found && fgets(line, sizeof(line), f) != NULL) {
    unsigned long long v;
    if (sscanf(line, "eventfd-count: %llx", &v) == 1) {
      *token = v;
      found = true;
    }
  }
  fclose(f);
  return found;
}

/* The fd is a new descriptor the caller owns and closes. */
CUresult fake_cuMemExportToShareableHandle(void *shareableHandle,
                                           CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType handleType,
                                           unsigned long long flags) {
  if (shareableHandle == NULL || flags != 0 ||
      handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mem.lock);
  struct vmm_alloc *a = alloc_find(handle);
  bool ok = a != NULL && a->exportable;
  struct stat st;
  uint64_t token = 0;
  if (ok && fstat(a->fd, &st) == 0 && getpid() < (1 << VMM_PID_BITS) &&
      a->fd < (1 << VMM_FD_BITS))
    token = vmm_token(getpid(), a->fd, (uint64_t)st.st_ino);
  pthread_mutex_unlock(&mem.lock);
  if (!ok)
    return CUDA_ERROR_INVALID_VALUE;
  int fd = token != 0 ? eventfd(0, EFD_CLOEXEC) : -1;
  if (fd < 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  if (write(fd, &token, sizeof(token)) != (ssize_t)sizeof(token)) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *(int *)shareableHandle = fd;
  return CUDA_SUCCESS;
}

/* The fd stays the caller's; the handle holds its own open of the
 * exporter's memfd. */
CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                             void *osHandle,
                                             CUmemAllocationHandleType shHandleType) {
  if (handle == NULL || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return CUDA_ERROR_INVALID_VALUE;
  uint64_t token;
  if (!vmm_token_read((int)(intptr_t)osHandle, &token))
    return CUDA_ERROR_INVALID_VALUE;
  pid_t pid = (pid_t)(token >> (VMM_FD_BITS + VMM_INO_BITS));
  int src = (int)(token >> VMM_INO_BITS & ((1u << VMM_FD_BITS) - 1));
  uint64_t ino_low = token & (((uint64_t)1 << VMM_INO_BITS) - 1);
  char link[64], target[128];
  snprintf(link, sizeof(link), "/proc/%d/fd/%d", (int)pid, src);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n <= 0)
    return CUDA_ERROR_INVALID_VALUE;
  target[n] = '\0';
  unsigned node;
  int phys;
  if (sscanf(target, "/memfd:spfake-vmm-%u-%d", &node, &phys) != 2 ||
      node != fake_config(NULL)->node || phys < 0 || phys >= FAKE_MAX_GPUS)
    return CUDA_ERROR_INVALID_VALUE;
  int fd = open(link, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0)
    return CUDA_ERROR_INVALID_VALUE;
  /* The descriptor number may have been reused since the export. */
  if (fstat(fd, &st) != 0 || st.st_size <= 0 ||
      ((uint64_t)st.st_ino & (((uint64_t)1 << VMM_INO_BITS) - 1)) != ino_low) {
    close(fd);
    return CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_lock(&mem.lock);
  struct vmm_alloc *a = alloc_add(fd, (size_t)st.st_size, phys, true, false);
  pthread_mutex_unlock(&mem.lock);
  if (a == NULL) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr *ptr, size_t size,
                                  size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags) {
  (void)addr; /* a hint, which the fake does not follow */
  if (alignment == 0)
    alignment = VMM_GRANULARITY;
  if (ptr == NULL || flags != 0 || size == 0 || size % VMM_GRANULARITY != 0 ||
      (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  struct reservation *res = calloc(1, sizeof(*res));
  if (res == NULL)
    return CUDA_ERROR_OUT_OF_MEMORY;
  size_t raw_len = size + alignment;
  char *raw = mmap(NULL, raw_len, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    free(res);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  uintptr_t base = ((uintptr_t)raw + alignment - 1) & ~(uintptr_t)(alignment - 1);
  if (base > (uintptr_t)raw)
    munmap(raw, base - (uintptr_t)raw);
  size_t tail = (uintptr_t)raw + raw_len - (base + size);
  if (tail > 0)
    munmap((void *)(base + size), tail);
  res->base = base;
  res->size = size;
  pthread_mutex_lock(&mem.lock);
  res->next = mem.reservations;
  mem.reservations = res;
  pthread_mutex_unlock(&mem.lock);
  *ptr = (CUdeviceptr)base;
  return CUDA_SUCCESS;
}

static struct reservation *reservation_of(uintptr_t p, size_t size) {
  for (struct reservation *r = mem.reservations; r != NULL; r = r->next)
    if (p >= r->base && p - r->base <= r->size && size <= r->size - (p - r->base))
      return r;
  return NULL;
}

static bool is_mapping_within(const struct region *r, uintptr_t p, size_t size) {
  return r->kind == REGION_VMM && r->base >= p && r->base - p < size &&
         r->size <= size - (r->base - p);
}

static bool overlaps_mapping(uintptr_t p, size_t size) {
  for (size_t i = 0; i < mem.n; i++) {
    const struct region *r = mem.v[i];
    if (r->kind == REGION_VMM && r->base < p + size && r->base + r->size > p)
      return true;
  }
  return false;
}

/* True when [p, p + size) is exactly a run of whole mappings, the unit
 * cuMemSetAccess and cuMemUnmap take. */
static bool whole_mappings(uintptr_t p, size_t size) {
  size_t covered = 0;
  for (size_t i = 0; i < mem.n; i++)
    if (is_mapping_within(mem.v[i], p, size))
      covered += mem.v[i]->size;
  return size > 0 && covered == size;
}

/* Refused while anything is still mapped inside the range. */
CUresult fake_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  pthread_mutex_lock(&mem.lock);
  struct reservation **pp = &mem.reservations;
  while (*pp != NULL && ((*pp)->base != (uintptr_t)ptr || (*pp)->size != size))
    pp = &(*pp)->next;
  if (*pp == NULL || overlaps_mapping((uintptr_t)ptr, size)) {
    pthread_mutex_unlock(&mem.lock);
    return CUDA_ERROR_INVALID_VALUE;
  }
  struct reservation *res = *pp;
  *pp = res->next;
  pthread_mutex_unlock(&mem.lock);
  munmap((void *)res->base, res->size);
  free(res);
  return CUDA_SUCCESS;
}

/* A new mapping starts without access, as documented: cuMemSetAccess makes
 * it usable. */
CUresult fake_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle,
                       unsigned long long flags) {
  uintptr_t p = (uintptr_t)ptr;
  if (flags != 0 || offset != 0 || size == 0 || size % VMM_GRANULARITY != 0 ||
      p % VMM_GRANULARITY != 0)
    return CUDA_ERROR_INVALID_VALUE;
  struct region *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mem.lock);
  struct vmm_alloc *a = alloc_find(handle);
  CUresult res = CUDA_SUCCESS;
  if (a == NULL || size > a->size || reservation_of(p, size) == NULL ||
      overlaps_mapping(p, size))
    res = CUDA_ERROR_INVALID_VALUE;
  else if (mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) ==
           MAP_FAILED)
    res = CUDA_ERROR_OUT_OF_MEMORY;
  if (res == CUDA_SUCCESS) {
    *r = (struct region){.base = p, .size = size, .map_len = size,
                         .phys = a->phys, .kind = REGION_VMM, .access = 0,
                         .fd = -1, .alloc = a};
    if (region_insert(r)) {
      a->refs++;
      r = NULL;
    } else {
      mmap((void *)p, size, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      res = CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  pthread_mutex_unlock(&mem.lock);
  free(r);
  return res;
}

/* The range must be whole mappings.  Access is per device, as documented:
 * each descriptor sets what its device may do, and a copy a device runs
 * may touch only what that device was granted (fake_check_range).  The
 * host's view, which the fake's copies go through, gets the widest access
 * any device has. */
CUresult fake_cuMemSetAccess(CUdeviceptr ptr, size_t size,
                             const CUmemAccessDesc *desc, size_t count) {
  uintptr_t p = (uintptr_t)ptr;
  if (desc == NULL || count == 0 || size == 0)
    return CUDA_ERROR_INVALID_VALUE;
  int set[FAKE_MAX_GPUS];
  for (int d = 0; d < FAKE_MAX_GPUS; d++)
    set[d] = -1;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
      return CUDA_ERROR_INVALID_VALUE;
    int phys = fake_physical(desc[i].location.id);
    if (phys < 0)
      return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ)
      set[phys] = FAKE_READ;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      set[phys] = FAKE_READ | FAKE_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE)
      set[phys] = 0;
    else
      return CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_lock(&mem.lock);
  CUresult res = whole_mappings(p, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; res == CUDA_SUCCESS && i < mem.n; i++) {
    struct region *r = mem.v[i];
    if (!is_mapping_within(r, p, size))
      continue;
    int any = 0;
    for (int d = 0; d < FAKE_MAX_GPUS; d++) {
      if (set[d] >= 0)
        r->dev_access[d] = set[d];
      any |= r->dev_access[d];
    }
    int prot = (any & FAKE_WRITE)  ? PROT_READ | PROT_WRITE
               : (any & FAKE_READ) ? PROT_READ
                                   : PROT_NONE;
    if (mprotect((void *)r->base, r->size, prot) != 0)
      res = CUDA_ERROR_INVALID_VALUE;
    else
      r->access = any;
  }
  pthread_mutex_unlock(&mem.lock);
  return res;
}

/* Turns the range back into a bare reservation at once.  It does not
 * wait for queued work: cuda.h promises no such wait (it says only that
 * the range is a reservation again when the call returns), so a program
 * synchronises the streams that read the range first (docs/fakes.md).  A
 * copy queued on a mapping that is gone when it runs is caught then
 * (fake_stream.c). */
CUresult fake_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  uintptr_t p = (uintptr_t)ptr;
  pthread_rwlock_wrlock(&unmap_lock);
  pthread_mutex_lock(&mem.lock);
  CUresult res = whole_mappings(p, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; res == CUDA_SUCCESS && i < mem.n;) {
    struct region *r = mem.v[i];
    if (!is_mapping_within(r, p, size)) {
      i++;
      continue;
    }
    region_remove(r);
    alloc_unref(r->alloc);
    free(r);
  }
  if (res == CUDA_SUCCESS)
    mmap((void *)p, size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  pthread_mutex_unlock(&mem.lock);
  pthread_rwlock_unlock(&unmap_lock);
  return res;
}

/* The handle that maps the page at addr, one more reference to release
 * with cuMemRelease, as documented: any address inside a mapping. */
CUresult fake_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle,
                                          void *addr) {
  if (handle == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mem.lock);
  struct region *r = region_find((uintptr_t)addr);
  bool ok = r != NULL && r->kind == REGION_VMM;
  if (ok) {
    r->alloc->refs++;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)r->alloc;
  }
  pthread_mutex_unlock(&mem.lock);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
