/*
 * rank.c - the CUDA backend end to end on the fake CUDA runtime
 * and fake NCCL (docs/fakes.md): a real shardportd serving the CUDA
 * backend on four fake GPUs, and one forked trainer process per rank that
 * holds its shards in fake device memory.
 *
 * Each rank allocates its storage with cudaMalloc (or as a cuMem
 * allocation exported as a POSIX descriptor), writes a deterministic
 * original into it (every element a hash of its key and flat index),
 * registers it the way its mode says (a device pointer the library turns
 * into an IPC handle itself, PyTorch's _share_cuda_() handle bytes, a raw
 * cudaIpcMemHandle_t, or the cuMem descriptor), exports, reads every owned
 * tensor back through the fake runtime and checks it byte for byte, checks
 * its registered memory is unchanged, releases, and reports to the test
 * process through a pipe.
 *
 * The test process never touches CUDA (it forks the ranks; DESIGN section
 * 8.7: no fork() after CUDA initialisation), so it can fork freely.
 *
 * tests/gpu/run.sh runs the "export" and "faults" cases of this suite on
 * real GPUs too, with SP_TEST_GPUS saying how many there are (scenarios
 * then put their ranks on at most that many; default 4, the fakes').
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/model.h"
#include "tests/integration/tlayout.h"

#define MAXR 8
#define SID 7
#define WAIT_MS 30000
/* Bytes of the allocation before the storage: the handle names the base,
 * the storage sits at an offset in it. */
#define PREFIX 512

/* ---- scenarios ---- */

/* AFFINE_ALL: every rank holds the whole key as one affine piece naming
 * every rank as a holder (replicas the owner compares).  AFFINE_MAP: the
 * pieces .layout gives each rank (tests/integration/tlayout.h), its shard
 * registered as one dim. */
enum kind {
  SHARD0 = 1,
  REPLICATED,
  PLAIN,
  EXPERT,
  AFFINE_COLS,
  AFFINE_ALL,
  AFFINE_MAP
};

struct tkey {
  const char *name;
  enum kind kind;
  const char *dtype;
  uint32_t es;
  uint32_t ndim;
  int64_t shape[2];
  int64_t parts[MAXR];
  uint32_t expert;
  int tie; /* > 0: shares key tie - 1's holding */
  int bad; /* > 0: rank bad - 1's copy differs at element BAD_ELEMENT */
  const struct tlayout *layout; /* AFFINE_MAP, 2 dims */
};

#define BAD_ELEMENT 13

/* How a rank hands its storage to the library. */
enum mode {
  MODE_PTR,   /* SP_STORAGE_CUDA: a device pointer */
  MODE_TORCH, /* SP_STORAGE_CUDA_IPC: [2]['c'][cudaIpcMemHandle_t] */
  MODE_RAW,   /* SP_STORAGE_CUDA_IPC: the 64 handle bytes */
  MODE_FD,    /* SP_STORAGE_CUDA_FD: a cuMem POSIX descriptor */
};

/* KILL_MOVING: rank victim kills itself once data moves; KILL_NODE: the
 * test kills the second daemon then. */
enum fault { NO_FAULT, KILL_MOVING, KILL_NODE };

struct scenario {
  uint32_t world;
  /* Daemons (fake nodes) the ranks are spread over, in rank order; 0 or 1:
   * one. */
  uint32_t nodes;
  size_t nkeys;
  const struct tkey *keys;
  enum mode modes[MAXR];
  int gpus; /* rank r sits on GPU r % gpus */
  uint32_t max_keys;
  uint32_t exports; /* 0 means 1 */
  enum fault fault;
  uint32_t victim;
  /* The first export is expected to fail (a fault injected in a daemon):
   * its result goes to the report's first_rc and the rank goes on with
   * the next exports of the same job. */
  bool fail_first;
  /* When set, each rank waits after joining and registering until this
   * file exists before it asks for its first export. */
  const char *gate;
};

struct report {
  int export_rc;
  char message[SP_ERRMSG_MAX + 1];
  int first_rc; /* fail_first: the first export's */
  char first_message[SP_ERRMSG_MAX + 1];
  char failure[512];
  uint32_t owned_count;
  uint32_t device_tensors; /* owned tensors that came from a segment */
  /* Per export (the first 4): the inode of the fake device allocation the
   * rank's segment is (each cudaMalloc of the fake is a new memfd), or 0. */
  uint64_t seg_inode[4];
};

static int64_t ncols(const struct tkey *k) {
  return k->ndim == 2 ? k->shape[1] : 1;
}

static bool holds(const struct tkey *k, uint32_t rank) {
  return k->kind != EXPERT || k->expert == rank;
}

/* ---- one rank ---- */

struct holding {
  bool held;
  int64_t shape[2];
  uint64_t byte_off;
  uint64_t nbytes;
};

struct rank {
  const struct scenario *sc;
  uint32_t rank;
  int out_fd;
  struct cuda_api api;
  int device;
  char device_name[64];
  cudaStream_t stream;
  struct holding *h;
  uint8_t *image; /* the storage's bytes as written */
  uint64_t len;
  uint8_t *alloc;   /* device: the allocation (cudaMalloc or cuMem) */
  uint64_t alloc_size;
  uint8_t *storage; /* device: alloc + PREFIX */
  CUmemGenericAllocationHandle mem; /* MODE_FD */
  int mem_fd;
  struct report rep;
  uint8_t *owned;
};

__attribute__((format(printf, 2, 3))) static void failf(struct rank *r,
                                                        const char *fmt,
                                                        ...) {
  if (r->rep.failure[0])
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->rep.failure, sizeof r->rep.failure, fmt, ap);
  va_end(ap);
}

static void holding_shape(const struct tkey *k, uint32_t rank, int64_t *shape) {
  shape[0] = k->shape[0];
  shape[1] = k->shape[1];
  if (k->kind == AFFINE_MAP) {
    shape[0] = k->layout->numel[rank];
    shape[1] = 1;
  } else if (k->kind == SHARD0)
    shape[0] = k->parts[rank];
  else if (k->kind == AFFINE_COLS)
    shape[1] = k->parts[rank];
}

static uint64_t source_index(const struct tkey *k, uint32_t rank, int64_t row,
                             int64_t col) {
  if (k->kind == SHARD0)
    return (uint64_t)((model_rows_before(k->parts, rank) + row) * ncols(k) + col);
  if (k->kind == AFFINE_COLS)
    return (uint64_t)(row * k->shape[1] + model_rows_before(k->parts, rank) + col);
  return (uint64_t)(row * ncols(k) + col);
}

/* Synchronous copies through the fake runtime's stream. */
static int dcopy(struct rank *r, void *dst, const void *src, size_t n,
                 enum cudaMemcpyKind kind) {
  if (n == 0)
    return 0;
  if (r->api.cudaMemcpyAsync(dst, src, n, kind, r->stream) != cudaSuccess ||
      r->api.cudaStreamSynchronize(r->stream) != cudaSuccess)
    return -1;
  return 0;
}

/* A cuMem allocation of at least size bytes on the rank's GPU, mapped
 * read-write here and exported as a POSIX descriptor. */
static int alloc_cumem(struct rank *r, uint64_t size) {
  const struct cuda_api *a = &r->api;
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = r->device},
  };
  size_t gran = 0;
  if (a->cuMemGetAllocationGranularity(&gran, &prop,
                                       CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
      CUDA_SUCCESS)
    return -1;
  r->alloc_size = (size + gran - 1) / gran * gran;
  CUdeviceptr p = 0;
  CUmemAccessDesc rw = {
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = r->device},
      .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (a->cuMemCreate(&r->mem, r->alloc_size, &prop, 0) != CUDA_SUCCESS ||
      a->cuMemAddressReserve(&p, r->alloc_size, gran, 0, 0) != CUDA_SUCCESS ||
      a->cuMemMap(p, r->alloc_size, 0, r->mem, 0) != CUDA_SUCCESS ||
      a->cuMemSetAccess(p, r->alloc_size, &rw, 1) != CUDA_SUCCESS ||
      a->cuMemExportToShareableHandle(&r->mem_fd, r->mem,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                      0) != CUDA_SUCCESS)
    return -1;
  r->alloc = (uint8_t *)(uintptr_t)p;
  return 0;
}

static int build_storage(struct rank *r) {
  const struct scenario *sc = r->sc;
  r->h = calloc(sc->nkeys, sizeof *r->h);
  r->owned = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  if (!r->h || !r->owned)
    return -1;
  uint64_t len = 0;
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    struct holding *h = &r->h[i];
    if (!holds(k, r->rank))
      continue;
    h->held = true;
    if (k->tie > 0) {
      *h = r->h[k->tie - 1];
      continue;
    }
    holding_shape(k, r->rank, h->shape);
    int64_t n =
        k->ndim == 0 ? 1 : h->shape[0] * (k->ndim == 2 ? h->shape[1] : 1);
    h->nbytes = (uint64_t)n * k->es;
    h->byte_off = (len + 63) / 64 * 64;
    len = h->byte_off + h->nbytes;
  }
  r->len = len + 64;
  r->image = malloc(r->len);
  if (!r->image)
    return -1;
  memset(r->image, 0x5a, r->len);
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    const struct holding *h = &r->h[i];
    if (!h->held || k->tie > 0)
      continue;
    if (k->kind == AFFINE_MAP) {
      tlayout_fill(k->layout, r->rank, k->name, k->es,
                   r->image + h->byte_off);
      continue;
    }
    int64_t rows = k->ndim == 0 ? 1 : h->shape[0];
    int64_t cols = k->ndim == 2 ? h->shape[1] : 1;
    for (int64_t y = 0; y < rows; y++)
      for (int64_t x = 0; x < cols; x++)
        model_element(k->name, source_index(k, r->rank, y, x), k->es,
                      r->image + h->byte_off +
                          (uint64_t)(y * cols + x) * k->es);
    if (k->bad > 0 && (uint32_t)(k->bad - 1) == r->rank &&
        (uint64_t)(rows * cols) > BAD_ELEMENT)
      r->image[h->byte_off + BAD_ELEMENT * k->es] ^= 0x40;
  }
  if (sc->modes[r->rank] == MODE_FD) {
    if (alloc_cumem(r, PREFIX + r->len) < 0)
      return -1;
  } else {
    void *p = NULL;
    r->alloc_size = PREFIX + r->len;
    if (r->api.cudaMalloc(&p, r->alloc_size) != cudaSuccess)
      return -1;
    r->alloc = p;
  }
  r->storage = r->alloc + PREFIX;
  return dcopy(r, r->storage, r->image, r->len, cudaMemcpyHostToDevice);
}

static sp_placement placement_of(enum kind kind) {
  switch (kind) {
  case SHARD0:
    return SP_PLACEMENT_SHARD0;
  case REPLICATED:
    return SP_PLACEMENT_REPLICATED;
  case PLAIN:
    return SP_PLACEMENT_PLAIN;
  case EXPERT:
    return SP_PLACEMENT_EXPERT;
  case AFFINE_COLS:
  case AFFINE_ALL:
  case AFFINE_MAP:
    return SP_PLACEMENT_AFFINE;
  }
  return 0;
}

static int register_all(struct rank *r, sp_client *c) {
  const struct scenario *sc = r->sc;
  enum mode mode = sc->modes[r->rank];
  sp_storage_desc st = {.id = SID, .length = r->len, .addr = r->storage,
                        .fd = -1};
  uint8_t handle[2 + 64];
  if (mode == MODE_PTR) {
    st.kind = SP_STORAGE_CUDA;
  } else if (mode == MODE_FD) {
    st.kind = SP_STORAGE_CUDA_FD;
    st.fd = r->mem_fd;
    st.offset = PREFIX;
    st.device = r->device_name;
  } else {
    cudaIpcMemHandle_t ipc;
    if (r->api.cudaIpcGetMemHandle(&ipc, r->alloc) != cudaSuccess)
      return SP_EBACKEND;
    st.kind = SP_STORAGE_CUDA_IPC;
    st.offset = PREFIX;
    if (mode == MODE_TORCH) {
      handle[0] = 2;
      handle[1] = 'c';
      memcpy(handle + 2, ipc.reserved, 64);
      st.handle_len = 66;
    } else {
      memcpy(handle, ipc.reserved, 64);
      st.handle_len = 64;
    }
    st.handle = handle;
    /* The library asks the runtime for the GPU when none is named. */
  }
  int rc = sp_register_storages(c, &st, 1);
  if (rc < 0)
    return rc;
  sp_tensor_desc *t = calloc(sc->nkeys + 1, sizeof *t);
  sp_piece *pieces = calloc(sc->nkeys + 1, sizeof *pieces);
  uint32_t *holders = calloc(sc->nkeys + 1, sizeof *holders);
  if (!t || !pieces || !holders)
    return SP_ENOMEM;
  size_t n = 0;
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    const struct holding *h = &r->h[i];
    if (!h->held)
      continue;
    sp_tensor_desc *d = &t[n++];
    *d = (sp_tensor_desc){.key = k->name, .storage = SID, .dtype = k->dtype,
                          .ndim = k->ndim,
                          .offset = (int64_t)(h->byte_off / k->es),
                          .placement = placement_of(k->kind),
                          .global_ndim = k->ndim};
    for (uint32_t dd = 0; dd < k->ndim; dd++) {
      d->shape[dd] = h->shape[dd];
      d->global_shape[dd] = k->shape[dd];
    }
    if (k->ndim == 2) {
      d->stride[0] = h->shape[1];
      d->stride[1] = 1;
    } else if (k->ndim == 1) {
      d->stride[0] = 1;
    }
    if (k->kind == AFFINE_COLS) {
      int64_t w = k->parts[r->rank];
      holders[i] = r->rank;
      pieces[i] = (sp_piece){.ndim = 2, .shape = {k->shape[0], w},
                             .src_stride = {w, 1},
                             .dst_offset = model_rows_before(k->parts, r->rank),
                             .dst_stride = {k->shape[1], 1}, .nholders = 1,
                             .holders = &holders[i]};
      d->npieces = 1;
      d->pieces = &pieces[i];
    } else if (k->kind == AFFINE_ALL) {
      static const uint32_t every_rank[MAXR] = {0, 1, 2, 3, 4, 5, 6, 7};
      pieces[i] = (sp_piece){.ndim = k->ndim, .nholders = sc->world,
                             .holders = every_rank};
      for (uint32_t dd = 0; dd < k->ndim; dd++) {
        pieces[i].shape[dd] = k->shape[dd];
        pieces[i].src_stride[dd] = pieces[i].dst_stride[dd] =
            dd + 1 == k->ndim ? 1 : k->shape[1];
      }
      d->npieces = 1;
      d->pieces = &pieces[i];
    } else if (k->kind == AFFINE_MAP) {
      /* The shard is one run of elements; the pieces say what it holds. */
      d->ndim = 1;
      d->shape[1] = d->stride[1] = 0;
      d->stride[0] = 1;
      d->npieces = k->layout->npieces[r->rank];
      d->pieces = k->layout->pieces[r->rank];
    }
  }
  rc = sp_register_tensors(c, t, n);
  free(pieces);
  free(holders);
  free(t);
  return rc;
}

static const struct tkey *find(const struct scenario *sc, const char *name,
                               size_t *index) {
  for (size_t i = 0; i < sc->nkeys; i++)
    if (strcmp(sc->keys[i].name, name) == 0) {
      *index = i;
      return &sc->keys[i];
    }
  return NULL;
}

/* Reads every owned tensor back from device memory and compares it with
 * the original; identity tensors must point into the rank's own storage,
 * the others into a segment on the rank's GPU. */
static void verify(struct rank *r, const sp_owned_set *set) {
  const struct scenario *sc = r->sc;
  for (size_t i = 0; i < set->ntensors; i++) {
    const sp_owned_tensor *t = &set->tensors[i];
    size_t idx;
    const struct tkey *k = find(sc, t->key, &idx);
    if (!k) {
      failf(r, "received unknown key \"%s\"", t->key);
      return;
    }
    if (r->owned[idx]) {
      failf(r, "received \"%s\" twice", t->key);
      return;
    }
    r->owned[idx] = 1;
    r->rep.owned_count++;
    if (strcmp(t->dtype, k->dtype) != 0 || t->ndim != k->ndim)
      failf(r, "\"%s\": dtype %s ndim %u", t->key, t->dtype, t->ndim);
    for (uint32_t d = 0; d < k->ndim; d++)
      if (t->shape[d] != k->shape[d])
        failf(r, "\"%s\": dim %u is %lld", t->key, d, (long long)t->shape[d]);
    if (!t->device || strcmp(t->device, r->device_name) != 0 ||
        t->device_index != r->device)
      failf(r, "\"%s\" is on %s (index %d), not on %s (index %d)", t->key,
            t->device ? t->device : "(null)", t->device_index,
            r->device_name, r->device);
    bool whole =
        k->kind == REPLICATED || k->kind == PLAIN || k->kind == EXPERT;
    const uint8_t *p = t->data;
    bool inside = p >= r->storage && p < r->storage + r->len;
    if (whole && (!t->identity || !inside))
      failf(r, "\"%s\" is not published as the rank's own storage", t->key);
    if (t->identity && !inside)
      failf(r, "\"%s\": identity outside the rank's storage", t->key);
    if (!t->identity)
      r->rep.device_tensors++;
    int64_t rows = k->ndim == 0 ? 1 : k->shape[0];
    int64_t cols = ncols(k);
    int64_t s0 = k->ndim >= 1 ? t->stride[0] : 0;
    int64_t s1 = k->ndim == 2 ? t->stride[1] : 0;
    if (rows * cols == 0)
      continue;
    size_t span = (size_t)(((rows - 1) * s0 + (cols - 1) * s1 + 1) * k->es);
    uint8_t *host = malloc(span);
    if (!host || dcopy(r, host, p, span, cudaMemcpyDeviceToHost) < 0) {
      failf(r, "\"%s\": cannot read it back from the device", t->key);
      free(host);
      continue;
    }
    const struct tkey *orig = k->tie > 0 ? &sc->keys[k->tie - 1] : k;
    uint8_t want[8];
    for (int64_t y = 0; y < rows; y++)
      for (int64_t x = 0; x < cols; x++) {
        model_element(orig->name, (uint64_t)(y * cols + x), orig->es, want);
        if (memcmp(host + (y * s0 + x * s1) * (int64_t)k->es, want, k->es) !=
            0) {
          failf(r, "\"%s\": element (%lld, %lld) differs from the original",
                t->key, (long long)y, (long long)x);
          y = rows;
          break;
        }
      }
    free(host);
  }
  for (size_t i = 0; i < set->ntensors; i++) {
    size_t idx, leader;
    const struct tkey *k = find(sc, set->tensors[i].key, &idx);
    if (!k || k->tie == 0)
      continue;
    for (size_t j = 0; j < set->ntensors; j++)
      if (find(sc, set->tensors[j].key, &leader) &&
          leader == (size_t)k->tie - 1 &&
          set->tensors[j].data != set->tensors[i].data)
        failf(r, "tied \"%s\" and \"%s\" have two buffers",
              set->tensors[i].key, set->tensors[j].key);
  }
}

/* The inode of the memfd mapped at p in this process: which fake device
 * allocation an opened segment is. */
static uint64_t inode_at(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f)
    return 0;
  char line[512];
  uint64_t inode = 0;
  while (inode == 0 && fgets(line, sizeof line, f)) {
    unsigned long lo, hi, ino;
    if (sscanf(line, "%lx-%lx %*s %*s %*s %lu", &lo, &hi, &ino) == 3 &&
        (uintptr_t)p >= lo && (uintptr_t)p < hi &&
        strstr(line, "memfd:spfake-mem") != NULL)
      inode = ino;
  }
  fclose(f);
  return inode;
}

static void check_storage_unchanged(struct rank *r) {
  uint8_t *now = malloc(r->len);
  if (!now || dcopy(r, now, r->storage, r->len, cudaMemcpyDeviceToHost) < 0)
    failf(r, "cannot read the storage back");
  else if (memcmp(now, r->image, r->len) != 0)
    failf(r, "the registered device memory changed during the export");
  free(now);
}

static int write_msg(int fd, char type, const void *buf, size_t len) {
  if (write(fd, &type, 1) != 1)
    return -1;
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_full(int fd, void *buf, size_t len, int timeout_ms) {
  uint8_t *p = buf;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (len > 0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int left = timeout_ms - (int)((t1.tv_sec - t0.tv_sec) * 1000 +
                                  (t1.tv_nsec - t0.tv_nsec) / 1000000);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (left <= 0 || poll(&pfd, 1, left) != 1)
      return SP_ETIMEOUT;
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return SP_ECLOSED;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static void on_progress(const sp_progress *p, void *arg) {
  struct rank *r = arg;
  if (r->sc->fault == KILL_MOVING && r->rank == r->sc->victim &&
      strcmp(p->phase, "moving") == 0 && p->round >= 1)
    raise(SIGKILL);
}

/* Loads the fake runtime and takes the rank's GPU. */
static int cuda_start(struct rank *r) {
  char why[512];
  if (cuda_api_load(&r->api, why, sizeof why) != 0) {
    failf(r, "loading CUDA: %s", why);
    return -1;
  }
  struct cuda_device_info devs[16];
  int n = cuda_api_probe(&r->api, devs, 16, why, sizeof why);
  if (n <= 0) {
    failf(r, "probing: %d GPUs (%s)", n, why);
    return -1;
  }
  int gpus = r->sc->gpus < n ? r->sc->gpus : n;
  r->device = (int)(r->rank % (uint32_t)gpus);
  snprintf(r->device_name, sizeof r->device_name, "cuda:%s",
           devs[r->device].uuid_str);
  if (r->api.cudaSetDevice(r->device) != cudaSuccess ||
      r->api.cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking) !=
          cudaSuccess) {
    failf(r, "cannot take GPU %d", r->device);
    return -1;
  }
  return 0;
}

static uint32_t node_of(const struct scenario *sc, uint32_t rank) {
  return sc->nodes > 1 ? rank * sc->nodes / sc->world : 0;
}

static void rank_main(const struct scenario *sc, const char *socket,
                      uint32_t rank, int in_fd, int out_fd) {
  struct rank r = {.sc = sc, .rank = rank, .out_fd = out_fd, .mem_fd = -1};
  sp_client *c = NULL;
  int rc;
  r.rep.export_rc = 1;
  /* A rank's GPUs are its node's: IPC handles do not cross fake nodes. */
  char node[16];
  snprintf(node, sizeof node, "%u", node_of(sc, rank));
  setenv("SHARDPORT_FAKE_NODE", node, 1);
  if (cuda_start(&r) < 0)
    goto report;
  if (build_storage(&r) < 0) {
    failf(&r, "building the device storage failed");
    goto report;
  }
  if ((rc = sp_connect(socket, &c)) < 0) {
    failf(&r, "connect: %s", sp_strerror(rc));
    goto report;
  }
  sp_ticket ticket;
  if (rank == 0) {
    if ((rc = sp_job_create(c, sc->world, &ticket)) < 0) {
      failf(&r, "job_create: %s", sp_strerror(rc));
      goto report;
    }
    write_msg(out_fd, 'T', &ticket, sizeof ticket);
  } else if (read_full(in_fd, &ticket, sizeof ticket, WAIT_MS) < 0) {
    failf(&r, "no ticket");
    goto report;
  }
  if ((rc = sp_job_join(c, &ticket, rank, sc->world, r.device_name)) < 0) {
    failf(&r, "join: %s: %s", sp_strerror(rc), sp_last_message(c));
    goto report;
  }
  if ((rc = register_all(&r, c)) < 0) {
    failf(&r, "register: %s: %s", sp_strerror(rc), sp_last_message(c));
    goto report;
  }
  if (sc->gate != NULL) {
    int waited = 0;
    while (access(sc->gate, F_OK) != 0 && waited < WAIT_MS) {
      usleep(10000);
      waited += 10;
    }
    if (access(sc->gate, F_OK) != 0) {
      failf(&r, "the gate %s never opened", sc->gate);
      goto report;
    }
  }
  sp_export_opts eo = {.max_keys = sc->max_keys, .timeout_ms = 20000,
                       .progress = on_progress, .progress_arg = &r};
  for (uint32_t e = 0; e < (sc->exports ? sc->exports : 1); e++) {
    sp_owned_set *set = NULL;
    memset(r.owned, 0, sc->nkeys);
    r.rep.owned_count = r.rep.device_tensors = 0;
    r.rep.export_rc = sp_export(c, &eo, &set);
    snprintf(r.rep.message, sizeof r.rep.message, "%s", sp_last_message(c));
    if (sc->fail_first && e == 0) {
      r.rep.first_rc = r.rep.export_rc;
      snprintf(r.rep.first_message, sizeof r.rep.first_message, "%s",
               r.rep.message);
      if (r.rep.export_rc < 0)
        continue;
      failf(&r, "the first export, which a fault fails, succeeded");
      goto report;
    }
    if (r.rep.export_rc < 0)
      goto report;
    verify(&r, set);
    for (size_t i = 0; i < set->ntensors && e < 4; i++)
      if (!set->tensors[i].identity && set->tensors[i].data != NULL) {
        r.rep.seg_inode[e] = inode_at(set->tensors[i].data);
        break;
      }
    if ((rc = sp_release(c, set)) < 0)
      failf(&r, "release: %s", sp_strerror(rc));
    check_storage_unchanged(&r);
  }
  if ((rc = sp_job_leave(c)) < 0)
    failf(&r, "leave: %s", sp_strerror(rc));
report:
  write_msg(out_fd, 'R', &r.rep, sizeof r.rep);
  write_msg(out_fd, 'O', r.owned, r.owned ? sc->nkeys : 0);
  sp_close(c);
  _exit(0);
}

/* ---- the test process ---- */

struct world {
  pid_t pid[MAXR];
  int in[MAXR];
  int out[MAXR];
  struct report rep[MAXR];
  uint8_t *owned[MAXR];
  bool reported[MAXR];
};

static struct sp_test_daemon daemon_, daemon2_;

static const char *socket_of(const struct scenario *sc, uint32_t rank) {
  return node_of(sc, rank) == 0 ? daemon_.socket : daemon2_.socket;
}

static void world_start(struct world *w, const struct scenario *sc) {
  memset(w, 0, sizeof *w);
  for (uint32_t i = 0; i < sc->world; i++) {
    int in[2], out[2];
    ck_assert_int_eq(pipe2(in, O_CLOEXEC), 0);
    ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      close(in[1]);
      close(out[0]);
      for (uint32_t j = 0; j < i; j++) {
        close(w->in[j]);
        close(w->out[j]);
      }
      rank_main(sc, socket_of(sc, i), i, in[0], out[1]);
    }
    close(in[0]);
    close(out[1]);
    w->pid[i] = pid;
    w->in[i] = in[1];
    w->out[i] = out[0];
  }
  char type;
  sp_ticket ticket;
  ck_assert_int_eq(read_full(w->out[0], &type, 1, WAIT_MS), 0);
  if (type == 'R') {
    struct report rep;
    read_full(w->out[0], &rep, sizeof rep, WAIT_MS);
    ck_abort_msg("rank 0 failed before the job existed: %s", rep.failure);
  }
  ck_assert_msg(type == 'T', "rank 0 sent '%c' before a ticket", type);
  ck_assert_int_eq(read_full(w->out[0], &ticket, sizeof ticket, WAIT_MS), 0);
  for (uint32_t i = 1; i < sc->world; i++)
    ck_assert_int_eq(write(w->in[i], &ticket, sizeof ticket),
                     (ssize_t)sizeof ticket);
}

static void read_report(struct world *w, const struct scenario *sc,
                        uint32_t i) {
  char type;
  int rc = read_full(w->out[i], &type, 1, WAIT_MS);
  ck_assert_msg(rc == 0, "rank %u sent no report: %s", i, sp_strerror(rc));
  ck_assert_int_eq(type, 'R');
  ck_assert_int_eq(read_full(w->out[i], &w->rep[i], sizeof w->rep[i], WAIT_MS),
                   0);
  w->owned[i] = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  ck_assert_int_eq(read_full(w->out[i], &type, 1, WAIT_MS), 0);
  ck_assert_int_eq(type, 'O');
  ck_assert_int_eq(read_full(w->out[i], w->owned[i], sc->nkeys, WAIT_MS), 0);
  w->reported[i] = true;
}

/* Waits until daemon_'s job moves data, then kills daemon2_ outright. */
static void kill_second_node(void) {
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  bool moving = false;
  for (int i = 0; i < 2000 && !moving; i++) {
    sp_status_info *st;
    ck_assert_int_eq(sp_status(c, &st), 0);
    for (size_t j = 0; j < st->njobs; j++)
      moving = moving || (strcmp(st->jobs[j].phase, "moving") == 0 &&
                          st->jobs[j].round >= 1);
    sp_status_free(st);
    if (!moving)
      usleep(5000);
  }
  sp_close(c);
  ck_assert_msg(moving, "the export never moved data");
  kill(daemon2_.pid, SIGKILL);
  sp_test_wait(daemon2_.pid, WAIT_MS);
  sp_test_rmdir(daemon2_.dir);
  daemon2_.pid = 0;
}

/* Reads every rank's report and reaps it. */
static void run_finish(const struct scenario *sc, struct world *w) {
  for (uint32_t i = 0; i < sc->world; i++) {
    if (!(sc->fault == KILL_MOVING && i == sc->victim))
      read_report(w, sc, i);
    close(w->in[i]);
    close(w->out[i]);
    int st = sp_test_wait(w->pid[i], WAIT_MS);
    if (st == SP_ETIMEOUT) {
      kill(w->pid[i], SIGKILL);
      sp_test_wait(w->pid[i], WAIT_MS);
    }
  }
}

static void run(const struct scenario *sc, struct world *w) {
  world_start(w, sc);
  if (sc->fault == KILL_NODE)
    kill_second_node();
  run_finish(sc, w);
}

static void world_free(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++)
    free(w->owned[i]);
}

static void assert_exported(struct world *w, const struct scenario *sc) {
  uint32_t device_tensors = 0;
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].failure[0] == '\0', "rank %u: %s", i,
                  w->rep[i].failure);
    ck_assert_msg(w->rep[i].export_rc == 0, "rank %u: export: %s: %s", i,
                  sp_strerror(w->rep[i].export_rc), w->rep[i].message);
    device_tensors += w->rep[i].device_tensors;
  }
  for (size_t k = 0; k < sc->nkeys; k++) {
    int owners = 0;
    for (uint32_t i = 0; i < sc->world; i++)
      owners += w->owned[i][k];
    ck_assert_msg(owners == 1, "\"%s\" has %d owners", sc->keys[k].name,
                  owners);
  }
  /* Something was assembled in device segments, not only published as
   * identity. */
  ck_assert_uint_gt(device_tensors, 0);
}

/* Device allocations the daemon has mapped now: its own segments and the
 * trainers' allocations it opened (the fake backs each with a memfd). */
static int daemon_device_mappings(void) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)daemon_.pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  int n = 0;
  while (fgets(line, sizeof line, f))
    n += strstr(line, "memfd:spfake-mem") != NULL;
  fclose(f);
  return n;
}

static void start(void) {
  const char *args[] = {"--backend", "cuda", NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
}

static void start_slow(void) {
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "50", 1);
  start();
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* Two daemons as two nodes of the fake (SHARDPORT_FAKE_NODE 0 and 1), both
 * listening for peers on loopback. */
static void start_nodes(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  setenv("SHARDPORT_FAKE_NODE", "0", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  setenv("SHARDPORT_FAKE_NODE", "1", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemon2_, args), 0);
  unsetenv("SHARDPORT_FAKE_NODE");
}

static void start_nodes_slow(void) {
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "50", 1);
  start_nodes();
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
}

/* Two nodes as above; node 1's NCCL fails the first round group that
 * communicator rank 2 launches (its second launch, after the warm-up),
 * once in that daemon: communicators made after the abort run clean. */
static void start_nodes_launch_error(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  setenv("SHARDPORT_FAKE_NODE", "0", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  setenv("SHARDPORT_FAKE_NODE", "1", 1);
  setenv("SHARDPORT_FAKE_NCCL_FAIL", "2:2:error:once", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemon2_, args), 0);
  unsetenv("SHARDPORT_FAKE_NCCL_FAIL");
  unsetenv("SHARDPORT_FAKE_NODE");
}

static void stop_nodes(void) {
  int st0 = daemon_.pid > 0 ? sp_test_daemon_stop(&daemon_) : 0;
  int st1 = daemon2_.pid > 0 ? sp_test_daemon_stop(&daemon2_) : 0;
  ck_assert_int_eq(st0, 0);
  ck_assert_int_eq(st1, 0);
}

/* Two nodes as start_nodes, each daemon's stderr (its log) also kept in a
 * file of its own, read by the test. */
static char log_path_[2][64];

static void start_nodes_logged(void) {
  const char *args[] = {"--backend", "cuda", "--peer-listen", "127.0.0.1:0",
                        NULL};
  struct sp_test_daemon *d[2] = {&daemon_, &daemon2_};
  int saved = dup(2);
  ck_assert_int_ge(saved, 0);
  for (int n = 0; n < 2; n++) {
    snprintf(log_path_[n], sizeof log_path_[n], "/tmp/sp-gpu-log%d-XXXXXX", n);
    int fd = mkstemp(log_path_[n]);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    setenv("SHARDPORT_FAKE_NODE", n == 0 ? "0" : "1", 1);
    int rc = sp_test_daemon_start(d[n], args);
    dup2(saved, 2);
    ck_assert_int_eq(rc, 0);
  }
  close(saved);
  unsetenv("SHARDPORT_FAKE_NODE");
}

static void stop_nodes_logged(void) {
  for (int n = 0; n < 2; n++)
    unlink(log_path_[n]);
  stop_nodes();
}

/* How many lines of a daemon's log hold what. */
static int log_count(int node, const char *what) {
  FILE *f = fopen(log_path_[node], "r");
  if (f == NULL)
    return -1;
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof line, f))
    n += strstr(line, what) != NULL;
  fclose(f);
  return n;
}

#define K(...) ((struct tkey){__VA_ARGS__})

static const struct tkey mixed_keys[] = {
    K(.name = "emb", .kind = SHARD0, .dtype = "bfloat16", .es = 2, .ndim = 2,
      .shape = {10, 6}, .parts = {3, 0, 5, 2}),
    K(.name = "empty", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {0, 5}, .parts = {0, 0, 0, 0}),
    K(.name = "w.f32", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {7, 3}, .parts = {1, 2, 3, 1}),
    K(.name = "w.i16", .kind = SHARD0, .dtype = "int16", .es = 2, .ndim = 1,
      .shape = {9}, .parts = {0, 0, 9, 0}),
    K(.name = "w.fp8", .kind = SHARD0, .dtype = "float8_e4m3fn", .es = 1,
      .ndim = 2, .shape = {5, 7}, .parts = {2, 1, 1, 1}),
    K(.name = "w.f64", .kind = SHARD0, .dtype = "float64", .es = 8, .ndim = 1,
      .shape = {11}, .parts = {4, 4, 2, 1}),
    K(.name = "norm", .kind = REPLICATED, .dtype = "float32", .es = 4,
      .ndim = 1, .shape = {6}),
    K(.name = "bias", .kind = PLAIN, .dtype = "bfloat16", .es = 2, .ndim = 1,
      .shape = {5}),
    K(.name = "expert.0", .kind = EXPERT, .dtype = "bfloat16", .es = 2,
      .ndim = 2, .shape = {4, 6}, .expert = 2),
    K(.name = "cols", .kind = AFFINE_COLS, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 10}, .parts = {3, 2, 4, 1}),
    K(.name = "tied.a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}),
    K(.name = "tied.b", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}, .tie = 10 + 1),
    K(.name = "scalar", .kind = PLAIN, .dtype = "float32", .es = 4, .ndim = 0),
};

#define NMIXED (sizeof mixed_keys / sizeof mixed_keys[0])

/* ---- backend selection ---- */

/* The GPUs this run has: SP_TEST_GPUS on hardware, 4 on the fakes. */
static int test_gpus(void) {
  const char *v = getenv("SP_TEST_GPUS");
  return v != NULL && atoi(v) > 0 ? atoi(v) : 4;
}

START_TEST(status_says_cuda_and_why) {
  char want[32];
  snprintf(want, sizeof want, "%d GPU%s", test_gpus(),
           test_gpus() == 1 ? "" : "s");
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  sp_status_info *st;
  ck_assert_int_eq(sp_status(c, &st), 0);
  ck_assert_str_eq(st->backend_active, "cuda");
  ck_assert_msg(strstr(st->backend_reason, want) != NULL, "reason: %s",
                st->backend_reason);
  ck_assert_msg(strstr(st->backends_built, "cuda") != NULL, "built: %s",
                st->backends_built);
  sp_status_free(st);
  sp_close(c);
}
END_TEST

/* Runs shardportd with args and the fake runtime showing ngpus GPUs: its
 * exit status, stderr in out. */
static int run_check(const char *ngpus, const char *backend, char *out,
                     size_t n) {
  char dir[256];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  char log[300], sock[300];
  snprintf(log, sizeof log, "%s/log", dir);
  snprintf(sock, sizeof sock, "%s/s.sock", dir);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    setenv("SHARDPORT_FAKE_GPUS", ngpus, 1);
    execl(sp_test_daemon_path(), "shardportd", "-n", "--config", "/dev/null",
          "--socket", sock, "--backend", backend, (char *)NULL);
    _exit(127);
  }
  int st = sp_test_wait(pid, WAIT_MS);
  FILE *f = fopen(log, "r");
  size_t got = f ? fread(out, 1, n - 1, f) : 0;
  out[got] = '\0';
  if (f)
    fclose(f);
  sp_test_rmdir(dir);
  return st;
}

START_TEST(no_gpu_means_host_or_a_clear_refusal) {
  char out[2048];
  /* auto on a machine without a driver: the host backend, and the reason
   * names the driver. */
  ck_assert_int_eq(run_check("0", "auto", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "backend host") && strstr(out, "error 35"), "%s",
                out);
  /* cuda insists: exit 1 with the reason. */
  ck_assert_int_eq(run_check("0", "cuda", out, sizeof out), 1);
  ck_assert_msg(strstr(out, "backend cuda is not available") &&
                    strstr(out, "NVIDIA driver"),
                "%s", out);
  /* auto with GPUs picks them. */
  ck_assert_int_eq(run_check("2", "auto", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "backend cuda") && strstr(out, "2 GPUs"), "%s",
                out);
}
END_TEST

/* ---- exports ---- */

START_TEST(device_pointers_one_gpu_each) {
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .gpus = 4,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
  /* Every segment freed and every opened allocation closed once the ranks
   * released and left. */
  for (int i = 0; i < 100 && daemon_device_mappings() != 0; i++)
    usleep(20000);
  ck_assert_int_eq(daemon_device_mappings(), 0);
}
END_TEST

START_TEST(every_registration_kind_across_shared_gpus) {
  /* Ranks 0 and 2 share GPU 0, ranks 1 and 3 GPU 1: copies within a GPU
   * and peer copies between them; three exports of one job (the plan is
   * reused, and so are each owner's segments). */
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .gpus = 2, .exports = 3, .max_keys = 3,
                        .modes = {MODE_TORCH, MODE_RAW, MODE_FD, MODE_PTR}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
  for (int i = 0; i < 100 && daemon_device_mappings() != 0; i++)
    usleep(20000);
  ck_assert_int_eq(daemon_device_mappings(), 0);
}
END_TEST

START_TEST(large_strided_tensors) {
  /* Big enough that copies are many 2-D slabs, uneven shards. */
  static const struct tkey keys[] = {
      K(.name = "big.rows", .kind = SHARD0, .dtype = "float32", .es = 4,
        .ndim = 2, .shape = {1000, 257}, .parts = {300, 1, 499, 200}),
      K(.name = "big.cols", .kind = AFFINE_COLS, .dtype = "bfloat16", .es = 2,
        .ndim = 2, .shape = {333, 1024}, .parts = {1, 511, 256, 256}),
  };
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = keys, .gpus = 3,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(segments_reused_by_their_owner) {
  /* Two exports of one job: each owner's second export is assembled in the
   * segment its first one was (the same device allocation, so the same IPC
   * handle and no new cudaMalloc); once the ranks left, every segment is
   * freed. */
  struct scenario sc = {.world = 4, .nkeys = NMIXED, .keys = mixed_keys,
                        .gpus = 2, .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_RAW, MODE_FD}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  int owners = 0;
  for (uint32_t i = 0; i < sc.world; i++) {
    if (w.rep[i].device_tensors == 0)
      continue;
    owners++;
    ck_assert_msg(w.rep[i].seg_inode[0] != 0 && w.rep[i].seg_inode[1] != 0,
                  "rank %u: segment not found in its maps", i);
    ck_assert_msg(w.rep[i].seg_inode[0] == w.rep[i].seg_inode[1],
                  "rank %u: export 2 got a new segment (%llu, then %llu)", i,
                  (unsigned long long)w.rep[i].seg_inode[0],
                  (unsigned long long)w.rep[i].seg_inode[1]);
    /* Never another rank's segment. */
    for (uint32_t j = 0; j < i; j++)
      ck_assert_msg(w.rep[j].seg_inode[0] == 0 ||
                        w.rep[j].seg_inode[0] != w.rep[i].seg_inode[1],
                    "ranks %u and %u share a segment", j, i);
  }
  ck_assert_int_gt(owners, 1);
  world_free(&w, &sc);
  for (int i = 0; i < 100 && daemon_device_mappings() != 0; i++)
    usleep(20000);
  ck_assert_int_eq(daemon_device_mappings(), 0);
}
END_TEST

static char small_pool_conf[300];

/* A daemon whose GPUs lend the pool 64 KiB each. */
static void start_small_pool(void) {
  char dir[256];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(small_pool_conf, sizeof small_pool_conf, "%s/conf", dir);
  FILE *f = fopen(small_pool_conf, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "gpu_pool_capacity = 65536\n");
  ck_assert_int_eq(fclose(f), 0);
  const char *args[] = {"--backend", "cuda", "--config", small_pool_conf,
                        NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
}

static void stop_small_pool(void) {
  stop();
  unlink(small_pool_conf);
  char *slash = strrchr(small_pool_conf, '/');
  if (slash != NULL) {
    *slash = '\0';
    rmdir(small_pool_conf);
  }
}

START_TEST(device_pool_capacity_refused_on_every_rank) {
  /* Rank 0's segment needs 1000 x 257 floats: more than the 64 KiB its
   * GPU lends the pool.  Every rank's export fails with pool_exhausted. */
  static const struct tkey keys[] = {
      K(.name = "big.rows", .kind = SHARD0, .dtype = "float32", .es = 4,
        .ndim = 2, .shape = {1000, 257}, .parts = {300, 700}),
  };
  struct scenario sc = {.world = 2, .nkeys = 1, .keys = keys, .gpus = 2,
                        .modes = {MODE_PTR, MODE_TORCH}};
  struct world w;
  run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_EPOOL, "rank %u: %s: %s", i,
                  sp_strerror(w.rep[i].export_rc), w.rep[i].message);
    ck_assert_msg(strstr(w.rep[i].message, "gpu_pool_capacity") != NULL,
                  "rank %u: %s", i, w.rep[i].message);
  }
  world_free(&w, &sc);
  /* What fits still exports on the same daemon. */
  static const struct tkey small[] = {
      K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
        .shape = {64, 16}, .parts = {20, 44}),
  };
  struct scenario ok = {.world = 2, .nkeys = 1, .keys = small, .gpus = 2,
                        .exports = 2, .modes = {MODE_PTR, MODE_RAW}};
  run(&ok, &w);
  assert_exported(&w, &ok);
  world_free(&w, &ok);
  for (int i = 0; i < 100 && daemon_device_mappings() != 0; i++)
    usleep(20000);
  ck_assert_int_eq(daemon_device_mappings(), 0);
}
END_TEST

/* A new job on the same daemon exports after a failed one. */
static void next_job_is_served(void) {
  static const struct tkey two[] = {
      K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
        .shape = {6, 3}, .parts = {2, 4}),
      K(.name = "b", .kind = REPLICATED, .dtype = "int16", .es = 2, .ndim = 1,
        .shape = {7}),
  };
  struct scenario sc = {.world = 2, .nkeys = 2, .keys = two, .gpus = 2,
                        .modes = {MODE_PTR, MODE_TORCH}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}

START_TEST(rank_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nkeys = N, .keys = keys, .gpus = 4,
                        .max_keys = 4, .fault = KILL_MOVING, .victim = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_RAW, MODE_PTR}};
  struct world w;
  run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    if (i == sc.victim)
      continue;
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST,
                  "rank %u: %s: %s (%s)", i, sp_strerror(w.rep[i].export_rc),
                  w.rep[i].message, w.rep[i].failure);
    ck_assert_msg(strstr(w.rep[i].message, "rank 2") != NULL, "rank %u: %s",
                  i, w.rep[i].message);
  }
  world_free(&w, &sc);
  next_job_is_served();
}
END_TEST

/* ---- refusals, from one rank ---- */

struct solo {
  struct rank r;
  sp_client *c;
};

/* A forked child that joins a job of one rank on GPU 0 with a 4 KiB
 * allocation, runs fn and exits with fn's status. */
static int solo_run(int (*fn)(struct solo *s)) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    static const struct scenario one = {.world = 1, .gpus = 1};
    struct solo s = {.r = {.sc = &one, .mem_fd = -1}};
    if (cuda_start(&s.r) < 0 || sp_connect(daemon_.socket, &s.c) < 0)
      _exit(100);
    void *p = NULL;
    if (s.r.api.cudaMalloc(&p, 4096) != cudaSuccess)
      _exit(101);
    s.r.alloc = p;
    _exit(fn(&s));
  }
  return sp_test_wait(pid, WAIT_MS);
}

static int join_as(struct solo *s, const char *device) {
  sp_ticket t;
  int rc = sp_job_create(s->c, 1, &t);
  return rc < 0 ? rc : sp_job_join(s->c, &t, 0, 1, device);
}

/* Each case: 0 when the refusal came with the code expected. */
#define EXPECT(call, code)                                                     \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ != (code)) {                                                       \
      fprintf(stderr, "%s: %s (%s), expected %s\n", #call, sp_strerror(rc_),  \
              sp_last_message(s->c), sp_strerror(code));                       \
      return 1;                                                                \
    }                                                                          \
  } while (0)

static int unknown_gpu(struct solo *s) {
  EXPECT(join_as(s, "cuda:GPU-00000000-0000-0000-0000-000000000000"),
         SP_EINVAL);
  return 0;
}

static int bad_storages(struct solo *s) {
  EXPECT(join_as(s, s->r.device_name), 0);
  cudaIpcMemHandle_t ipc;
  if (s->r.api.cudaIpcGetMemHandle(&ipc, s->r.alloc) != cudaSuccess)
    return 2;
  uint8_t bytes[66];
  sp_storage_desc st = {.id = 1, .kind = SP_STORAGE_CUDA_IPC, .fd = -1,
                        .length = 1024, .addr = s->r.alloc,
                        .device = s->r.device_name, .handle = bytes,
                        .handle_len = 64};
  /* Garbage is no handle of this node. */
  memset(bytes, 0x33, sizeof bytes);
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EBADFD);
  /* PyTorch's expandable-segment handle is no IPC handle. */
  bytes[0] = 2;
  bytes[1] = 'e';
  st.handle_len = 66;
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* A version of PyTorch's format that does not exist. */
  bytes[0] = 9;
  bytes[1] = 'c';
  memcpy(bytes + 2, ipc.reserved, 64);
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* Past the end of the allocation. */
  memcpy(bytes, ipc.reserved, 64);
  st.handle_len = 64;
  st.offset = 4000;
  st.length = 200;
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EBADFD);
  /* On a GPU the daemon does not have. */
  st.offset = 0;
  st.device = "cuda:GPU-00000000-0000-0000-0000-000000000000";
  EXPECT(sp_register_storages(s->c, &st, 1), SP_EINVAL);
  /* A memfd storage on a CUDA rank. */
  sp_storage_desc host = {.id = 2, .fd = 0, .length = 0, .addr = NULL};
  EXPECT(sp_register_storages(s->c, &host, 1), SP_EINVAL);
  /* And the good one still registers, with a view checked against it. */
  st.device = NULL;
  EXPECT(sp_register_storages(s->c, &st, 1), 0);
  sp_tensor_desc t = {.key = "x", .storage = 1, .dtype = "float32",
                      .ndim = 1, .shape = {300}, .stride = {1},
                      .placement = SP_PLACEMENT_PLAIN, .global_ndim = 1,
                      .global_shape = {300}};
  EXPECT(sp_register_tensors(s->c, &t, 1), SP_EOUTOFBOUNDS);
  return 0;
}

static int cpu_and_gpu_ranks_do_not_mix(struct solo *s) {
  sp_ticket t;
  EXPECT(sp_job_create(s->c, 2, &t), 0);
  EXPECT(sp_job_join(s->c, &t, 0, 2, s->r.device_name), 0);
  sp_client *other;
  if (sp_connect(daemon_.socket, &other) < 0)
    return 3;
  int rc = sp_job_join(other, &t, 1, 2, "cpu");
  sp_close(other);
  return rc == SP_EDEVICEMISMATCH ? 0 : 4;
}

START_TEST(refusals) {
  ck_assert_int_eq(solo_run(unknown_gpu), 0);
  ck_assert_int_eq(solo_run(bad_storages), 0);
  ck_assert_int_eq(solo_run(cpu_and_gpu_ranks_do_not_mix), 0);
  for (int i = 0; i < 100 && daemon_device_mappings() != 0; i++)
    usleep(20000);
  ck_assert_int_eq(daemon_device_mappings(), 0);
}
END_TEST

/* ---- across nodes: NCCL between the daemons ---- */

START_TEST(two_nodes_mixed_model) {
  /* Ranks 0, 1 on node 0, ranks 2, 3 on node 1, each on its node's GPU 0
   * or 1; moves between the nodes go through the job's communicators, made
   * by the first export and kept for the second. */
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = NMIXED,
                        .keys = mixed_keys, .gpus = 2, .exports = 2,
                        .max_keys = 4,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_communicators_made_at_join) {
  /* The ranks join and register, then wait at a gate: before any export,
   * each daemon's communicators (one per local rank, started as the rank
   * joined) finish their set-up, which the fake NCCL completes only once
   * all 4 ranks of both nodes joined; the first export then warms those
   * and moves the data through them. */
  char gate[64];
  snprintf(gate, sizeof gate, "/tmp/sp-gpu-gate-%d", (int)getpid());
  unlink(gate);
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = NMIXED,
                        .keys = mixed_keys, .gpus = 2, .exports = 2,
                        .max_keys = 4,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW},
                        .gate = gate};
  struct world w;
  world_start(&w, &sc);
  bool ready = false;
  for (int i = 0; i < 1000 && !ready; i++) {
    ready = log_count(0, "communicators ready") == 1 &&
            log_count(1, "communicators ready") == 1;
    if (!ready)
      usleep(10000);
  }
  int joined = log_count(0, " joined (") + log_count(1, " joined (");
  int started = log_count(0, " started") + log_count(1, " started");
  int fd = open(gate, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ck_assert_int_ge(fd, 0);
  close(fd);
  run_finish(&sc, &w);
  unlink(gate);
  ck_assert_msg(ready, "the daemons did not log \"communicators ready\" "
                       "before the first export");
  /* All 4 ranks had joined (each logged by its own node's daemon); no
   * export had started. */
  ck_assert_int_eq(joined, 4);
  ck_assert_int_eq(started, 0);
  assert_exported(&w, &sc);
  /* The first export warmed the communicators made at the join and made
   * none of its own. */
  for (int n = 0; n < 2; n++) {
    ck_assert_int_eq(log_count(n, "made as the ranks joined, warmed"), 1);
    ck_assert_int_eq(log_count(n, "NCCL communicator(s) of 4 ranks made"), 0);
  }
  world_free(&w, &sc);
}
END_TEST

/* Replicated affine keys held by every rank, and a dim-0 shard beside. */
static const struct tkey replica_keys[] = {
    K(.name = "rep.a", .kind = AFFINE_ALL, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 10}),
    K(.name = "rep.b", .kind = AFFINE_ALL, .dtype = "bfloat16", .es = 2,
      .ndim = 1, .shape = {17}),
    K(.name = "rows", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 3}, .parts = {2, 3, 1, 2}),
};
#define NREPLICA (sizeof replica_keys / sizeof replica_keys[0])

/* The same keys with rank bad's copy of "rep.a" differing at element
 * [1, 3] (BAD_ELEMENT). */
static struct tkey bad_replica_keys[NREPLICA];

static void make_bad_replicas(uint32_t bad) {
  memcpy(bad_replica_keys, replica_keys, sizeof replica_keys);
  bad_replica_keys[0].bad = (int)bad + 1;
}

/* Every rank's export fails with different_data naming the key, the
 * element and both ranks. */
static void assert_different(struct world *w, const struct scenario *sc,
                             const char *ranks) {
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].export_rc == SP_EDIFFERENT, "rank %u: %s: %s", i,
                  sp_strerror(w->rep[i].export_rc), w->rep[i].message);
    ck_assert_msg(strstr(w->rep[i].message, "key 'rep.a'") != NULL &&
                      strstr(w->rep[i].message, "element [1, 3]") != NULL &&
                      strstr(w->rep[i].message, ranks) != NULL,
                  "rank %u: %s", i, w->rep[i].message);
  }
}

START_TEST(replicas_compared_on_the_gpus) {
  /* Equal replicas on four ranks over three GPUs export byte-exact, twice;
   * then rank 2's copy differs and every rank is refused. */
  struct scenario sc = {.world = 4, .nkeys = NREPLICA, .keys = replica_keys,
                        .gpus = 3, .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
  make_bad_replicas(2);
  sc.keys = bad_replica_keys;
  sc.exports = 1;
  run(&sc, &w);
  assert_different(&w, &sc, "rank 0 and rank 2 disagree");
  world_free(&w, &sc);
}
END_TEST

/* Tensor parallel splits replicated over data parallel ranks
 * (tlayout_family), on one node and across two: replicas with strided
 * sources cross the nodes through NCCL and are compared on their owner's
 * node. */
static struct tlayout_key family_[TLAYOUT_FAMILY];
static struct tkey family_keys_[TLAYOUT_FAMILY];

static void make_family_keys(void) {
  tlayout_family(family_);
  for (size_t i = 0; i < TLAYOUT_FAMILY; i++)
    family_keys_[i] = K(.name = family_[i].name, .kind = AFFINE_MAP,
                        .dtype = family_[i].dtype, .es = family_[i].es,
                        .ndim = 2,
                        .shape = {family_[i].layout.shape[0],
                                  family_[i].layout.shape[1]},
                        .layout = &family_[i].layout);
}

START_TEST(tensor_parallel_replicas) {
  make_family_keys();
  struct scenario sc = {.world = 4, .nkeys = TLAYOUT_FAMILY,
                        .keys = family_keys_, .gpus = 2, .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_tensor_parallel_replicas) {
  make_family_keys();
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = TLAYOUT_FAMILY,
                        .keys = family_keys_, .gpus = 2, .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_replicas_compared) {
  /* Ranks 0, 1 on node 0 and 2, 3 on node 1: replicas cross the nodes
   * through NCCL and are compared on their owner's node. */
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = NREPLICA,
                        .keys = replica_keys, .gpus = 2, .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
  make_bad_replicas(3);
  sc.keys = bad_replica_keys;
  sc.exports = 1;
  run(&sc, &w);
  assert_different(&w, &sc, "rank 0 and rank 3 disagree");
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_rank_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = N, .keys = keys,
                        .gpus = 2, .max_keys = 4, .fault = KILL_MOVING,
                        .victim = 3,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  run(&sc, &w);
  /* Every survivor, on both nodes, fails; none hangs or publishes. */
  for (uint32_t i = 0; i < sc.world; i++) {
    if (i == sc.victim)
      continue;
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST ||
                      w.rep[i].export_rc == SP_ENODELOST,
                  "rank %u: %s: %s (%s)", i, sp_strerror(w.rep[i].export_rc),
                  w.rep[i].message, w.rep[i].failure);
  }
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_daemon_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = N, .keys = keys,
                        .gpus = 2, .max_keys = 4, .fault = KILL_NODE,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  run(&sc, &w);
  /* Node 0's ranks learn that node 1 was lost (its communicators aborted,
   * or its control link closed); node 1's lost their daemon. */
  for (uint32_t i = 0; i < 2; i++)
    ck_assert_msg(w.rep[i].export_rc == SP_ENODELOST,
                  "rank %u: %s: %s (%s)", i, sp_strerror(w.rep[i].export_rc),
                  w.rep[i].message, w.rep[i].failure);
  for (uint32_t i = 2; i < 4; i++)
    ck_assert_msg(w.rep[i].export_rc < 0, "rank %u exported", i);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_export_again_after_a_failure) {
  /* Ranks 0, 1 on node 0 and 2, 3 on node 1.  Node 1's NCCL fails a launch
   * mid-round in the first export: every local communicator there is
   * aborted and the export fails on every rank with one error.  The same
   * job, its ranks still joined, exports again: the root sends a fresh
   * NCCL id with the plan, every node replaces its aborted communicators
   * with a new generation, and both later exports (the second on the new
   * generation's communicators, kept) are verified byte for byte. */
  enum { N = 24 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nodes = 2, .nkeys = N, .keys = keys,
                        .gpus = 2, .max_keys = 4, .exports = 3,
                        .fail_first = true,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  run(&sc, &w);
  /* The first export fails on every rank, none hangs or publishes, with
   * the launch's error (backend) or node_lost: which a node sees first,
   * its own communicators' error or its peer's abort, depends on timing
   * (under valgrind node 1 too may hear node 0's abort first); one error
   * per node. */
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].first_rc == SP_EBACKEND ||
                      w.rep[i].first_rc == SP_ENODELOST,
                  "rank %u: the first export: %s: %s (%s)", i,
                  sp_strerror(w.rep[i].first_rc), w.rep[i].first_message,
                  w.rep[i].failure);
    uint32_t peer = i ^ 1u; /* the other rank of its node */
    ck_assert_msg(w.rep[i].first_rc == w.rep[peer].first_rc &&
                      strcmp(w.rep[i].first_message,
                             w.rep[peer].first_message) == 0,
                  "rank %u: %s: %s, rank %u: %s: %s", i,
                  sp_strerror(w.rep[i].first_rc), w.rep[i].first_message,
                  peer, sp_strerror(w.rep[peer].first_rc),
                  w.rep[peer].first_message);
  }
  ck_assert_msg(strstr(w.rep[2].first_message, "NCCL error") != NULL,
                "rank 2: %s", w.rep[2].first_message);
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

int main(int argc, char **argv) {
  Suite *s = suite_create("gpu-fake-export");
  TCase *tc = tcase_create("export");
  tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, status_says_cuda_and_why);
  tcase_add_test(tc, device_pointers_one_gpu_each);
  tcase_add_test(tc, every_registration_kind_across_shared_gpus);
  tcase_add_test(tc, large_strided_tensors);
  tcase_add_test(tc, refusals);
  tcase_add_test(tc, replicas_compared_on_the_gpus);
  tcase_add_test(tc, tensor_parallel_replicas);
  suite_add_tcase(s, tc);
  TCase *pool = tcase_create("pool");
  tcase_add_checked_fixture(pool, start, stop);
  tcase_set_timeout(pool, 120);
  tcase_add_test(pool, segments_reused_by_their_owner);
  suite_add_tcase(s, pool);
  TCase *small = tcase_create("small-pool");
  tcase_add_checked_fixture(small, start_small_pool, stop_small_pool);
  tcase_set_timeout(small, 120);
  tcase_add_test(small, device_pool_capacity_refused_on_every_rank);
  suite_add_tcase(s, small);
  TCase *slow = tcase_create("faults");
  tcase_add_checked_fixture(slow, start_slow, stop);
  tcase_set_timeout(slow, 120);
  tcase_add_test(slow, rank_killed_mid_round);
  suite_add_tcase(s, slow);
  TCase *nodes = tcase_create("nodes");
  tcase_add_checked_fixture(nodes, start_nodes, stop_nodes);
  tcase_set_timeout(nodes, 120);
  tcase_add_test(nodes, two_nodes_mixed_model);
  tcase_add_test(nodes, two_nodes_replicas_compared);
  tcase_add_test(nodes, two_nodes_tensor_parallel_replicas);
  suite_add_tcase(s, nodes);
  TCase *joined = tcase_create("nodes-join");
  tcase_add_checked_fixture(joined, start_nodes_logged, stop_nodes_logged);
  tcase_set_timeout(joined, 120);
  tcase_add_test(joined, two_nodes_communicators_made_at_join);
  suite_add_tcase(s, joined);
  TCase *nodes_slow = tcase_create("nodes-faults");
  tcase_add_checked_fixture(nodes_slow, start_nodes_slow, stop_nodes);
  tcase_set_timeout(nodes_slow, 120);
  tcase_add_test(nodes_slow, two_nodes_rank_killed_mid_round);
  tcase_add_test(nodes_slow, two_nodes_daemon_killed_mid_round);
  suite_add_tcase(s, nodes_slow);
  TCase *again = tcase_create("nodes-again");
  tcase_add_checked_fixture(again, start_nodes_launch_error, stop_nodes);
  tcase_set_timeout(again, 120);
  tcase_add_test(again, two_nodes_export_again_after_a_failure);
  suite_add_tcase(s, again);
  TCase *sel = tcase_create("selection");
  tcase_set_timeout(sel, 60);
  tcase_add_test(sel, no_gpu_means_host_or_a_clear_refusal);
  suite_add_tcase(s, sel);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  int run = srunner_ntests_run(sr);
  srunner_free(sr);
  return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
