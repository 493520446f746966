/*
 * rank.c - one trainer rank of the GPU export suite; see rank.h.
 *
 * The test process never touches CUDA (it forks the ranks; DESIGN section
 * 8.7: no fork() after CUDA initialisation), so it can fork freely; only
 * rank processes load the runtime.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/rank.h"
#include "tests/integration/model.h"
#include "tests/integration/rankpipe.h"

#define SID 7
/* Bytes of the allocation before the storage: the handle names the base,
 * the storage sits at an offset in it. */
#define PREFIX 512

static int64_t ncols(const struct tkey *k) {
  return k->ndim == 2 ? k->shape[1] : 1;
}

static bool holds(const struct tkey *k, uint32_t rank) {
  return k->kind != EXPERT || k->expert == rank;
}

__attribute__((format(printf, 2, 3))) static void failf(struct rank *r,
                                                        const char *fmt, ...) {
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
    return (uint64_t)((model_rows_before(k->parts, rank) + row) * ncols(k) +
                      col);
  if (k->kind == AFFINE_COLS)
    return (uint64_t)(row * k->shape[1] + model_rows_before(k->parts, rank) +
                      col);
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
  if (a->cuMemGetAllocationGranularity(
          &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
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
      tlayout_fill(k->layout, r->rank, k->name, k->es, r->image + h->byte_off);
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
  sp_storage_desc st = {
      .id = SID, .length = r->len, .addr = r->storage, .fd = -1};
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
    *d = (sp_tensor_desc){.key = k->name,
                          .storage = SID,
                          .dtype = k->dtype,
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
      pieces[i] = (sp_piece){.ndim = 2,
                             .shape = {k->shape[0], w},
                             .src_stride = {w, 1},
                             .dst_offset = model_rows_before(k->parts, r->rank),
                             .dst_stride = {k->shape[1], 1},
                             .nholders = 1,
                             .holders = &holders[i]};
      d->npieces = 1;
      d->pieces = &pieces[i];
    } else if (k->kind == AFFINE_ALL) {
      static const uint32_t every_rank[MAXR] = {0, 1, 2, 3, 4, 5, 6, 7};
      pieces[i] = (sp_piece){
          .ndim = k->ndim, .nholders = sc->world, .holders = every_rank};
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
            t->device ? t->device : "(null)", t->device_index, r->device_name,
            r->device);
    bool whole = k->kind == REPLICATED || k->kind == PLAIN || k->kind == EXPERT;
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
        failf(r, "tied \"%s\" and \"%s\" have two buffers", set->tensors[i].key,
              set->tensors[j].key);
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

static void on_progress(const sp_progress *p, void *arg) {
  struct rank *r = arg;
  if (r->sc->fault == KILL_MOVING && r->rank == r->sc->victim &&
      strcmp(p->phase, "moving") == 0 && p->round >= 1)
    raise(SIGKILL);
}

/* Loads the fake runtime and takes the rank's GPU. */
int rank_cuda_start(struct rank *r) {
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

/* The CUDA contexts this process has: a GPU's flag set when it has one
 * (the driver's own answer). */
static uint32_t contexts(struct rank *r) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult st;
  if (r->api.cudaGetDriverEntryPointByVersion(
          "cuDevicePrimaryCtxGetState", &fn, CUDA_API_DRIVER_ABI,
          cudaEnableDefault, &st) != cudaSuccess ||
      fn == NULL)
    return UINT32_MAX;
  uint32_t have = 0;
  for (int d = 0; d < r->api.device_count && d < 32; d++) {
    unsigned flags;
    int active = 0;
    if (((__typeof__(cuDevicePrimaryCtxGetState) *)fn)(d, &flags, &active) !=
            CUDA_SUCCESS ||
        active)
      have |= 1u << d;
  }
  return have;
}

/* close_holding: once every rank of the daemon left (each closed its
 * connection), the daemon still counts the device bytes this rank owns
 * and holds open. */
static void check_held(struct rank *r, const char *socket,
                       const sp_owned_set *set) {
  bool holds_segment = false;
  for (size_t i = 0; i < set->ntensors; i++)
    holds_segment = holds_segment ||
                    (!set->tensors[i].identity && set->tensors[i].data != NULL);
  sp_client *c;
  if (sp_connect(socket, &c) < 0) {
    failf(r, "cannot connect for status");
    return;
  }
  bool left = false;
  for (int waited = 0; !left && waited < WAIT_MS; waited += 10) {
    sp_job_list *jobs;
    if (sp_jobs(c, &jobs) < 0)
      break;
    left = true;
    for (size_t j = 0; j < jobs->njobs; j++)
      left = left && jobs->jobs[j].joined == 0;
    sp_job_list_free(jobs);
    if (!left)
      usleep(10000);
  }
  sp_status_info *st;
  if (!left)
    failf(r, "the ranks' departures never reached the daemon");
  else if (sp_status(c, &st) < 0)
    failf(r, "status failed");
  else {
    if (holds_segment && st->pool_used == 0)
      failf(r, "the daemon counts no pool memory in use while this rank "
               "holds its segment open");
    sp_status_free(st);
  }
  sp_close(c);
}

/* Shuts down this process's connection to the daemon at socket under the
 * library, as a connection that breaks: the daemon sees the rank gone
 * while the library still has the rank's export open. */
static void break_connection(struct rank *r, const char *socket) {
  DIR *dir = opendir("/proc/self/fd");
  int broken = 0;
  for (struct dirent *de; dir != NULL && (de = readdir(dir)) != NULL;) {
    int fd = atoi(de->d_name);
    struct sockaddr_un peer;
    socklen_t len = sizeof peer;
    if (de->d_name[0] != '.' &&
        getpeername(fd, (struct sockaddr *)&peer, &len) == 0 &&
        peer.sun_family == AF_UNIX && strcmp(peer.sun_path, socket) == 0 &&
        shutdown(fd, SHUT_RDWR) == 0)
      broken++;
  }
  if (dir != NULL)
    closedir(dir);
  if (broken != 1)
    failf(r, "found %d connections to the daemon to break", broken);
}

/* What a rank does with the daemon: join, register, export, check,
 * release, leave. */
struct session {
  struct rank *r;
  const char *socket;
  int in_fd;
  sp_client *c;
};

static void *run_session(void *arg) {
  struct session *s = arg;
  struct rank *r = s->r;
  const struct scenario *sc = r->sc;
  int rc;
  if ((rc = sp_connect(s->socket, &s->c)) < 0) {
    failf(r, "connect: %s", sp_strerror(rc));
    return NULL;
  }
  sp_client *c = s->c;
  sp_ticket ticket;
  if (r->rank == 0) {
    if ((rc = sp_job_create(c, sc->world, &ticket)) < 0) {
      failf(r, "job_create: %s", sp_strerror(rc));
      return NULL;
    }
    rankpipe_write(r->out_fd, 'T', &ticket, sizeof ticket);
  } else if (rankpipe_read(s->in_fd, &ticket, sizeof ticket, WAIT_MS) < 0) {
    failf(r, "no ticket");
    return NULL;
  }
  if ((rc = sp_job_join(c, &ticket, r->rank, sc->world, r->device_name)) < 0) {
    failf(r, "join: %s: %s", sp_strerror(rc), sp_last_message(c));
    return NULL;
  }
  if ((rc = register_all(r, c)) < 0) {
    failf(r, "register: %s: %s", sp_strerror(rc), sp_last_message(c));
    return NULL;
  }
  if (sc->gate != NULL) {
    int waited = 0;
    while (access(sc->gate, F_OK) != 0 && waited < WAIT_MS) {
      usleep(10000);
      waited += 10;
    }
    if (access(sc->gate, F_OK) != 0) {
      failf(r, "the gate %s never opened", sc->gate);
      return NULL;
    }
  }
  sp_export_opts eo = {.max_keys = sc->max_keys,
                       .timeout_ms = sc->timeout_ms ? sc->timeout_ms : 20000,
                       .progress = on_progress,
                       .progress_arg = r};
  for (uint32_t e = 0; e < (sc->exports ? sc->exports : 1); e++) {
    sp_owned_set *set = NULL;
    memset(r->owned, 0, sc->nkeys);
    r->rep.owned_count = r->rep.device_tensors = 0;
    r->rep.export_rc = sp_export(c, &eo, &set);
    snprintf(r->rep.message, sizeof r->rep.message, "%s", sp_last_message(c));
    if (sc->fail_first && e == 0) {
      r->rep.first_rc = r->rep.export_rc;
      snprintf(r->rep.first_message, sizeof r->rep.first_message, "%s",
               r->rep.message);
      if (r->rep.export_rc < 0)
        continue;
      failf(r, "the first export, which a fault fails, succeeded");
      return NULL;
    }
    if (r->rep.export_rc < 0)
      return NULL;
    /* The rank's own reads work on its GPU, as a trainer's thread sets its
     * device before it uses CUDA itself. */
    if (sc->library_thread && r->api.cudaSetDevice(r->device) != cudaSuccess) {
      failf(r, "cannot take GPU %d on the session's thread", r->device);
      return NULL;
    }
    verify(r, set);
    if (sc->close_holding) {
      break_connection(r, s->socket);
      check_held(r, s->socket, set);
      sp_release(c, set);
      return NULL;
    }
    for (size_t i = 0; i < set->ntensors && e < 4; i++)
      if (!set->tensors[i].identity && set->tensors[i].data != NULL) {
        r->rep.seg_inode[e] = inode_at(set->tensors[i].data);
        break;
      }
    if ((rc = sp_release(c, set)) < 0)
      failf(r, "release: %s", sp_strerror(rc));
    check_storage_unchanged(r);
  }
  if ((rc = sp_job_leave(c)) < 0)
    failf(r, "leave: %s", sp_strerror(rc));
  return NULL;
}

void rank_main(const struct scenario *sc, const char *socket, uint32_t rank,
               int in_fd, int out_fd) {
  struct rank r = {.sc = sc, .rank = rank, .out_fd = out_fd, .mem_fd = -1};
  struct session s = {.r = &r, .socket = socket, .in_fd = in_fd};
  r.rep.export_rc = 1;
  /* A rank's GPUs are its node's: IPC handles do not cross fake nodes. */
  char node[16];
  snprintf(node, sizeof node, "%u", scenario_node_of(sc, rank));
  setenv("SHARDPORT_FAKE_NODE", node, 1);
  if (rank_cuda_start(&r) < 0)
    goto report;
  if (build_storage(&r) < 0) {
    failf(&r, "building the device storage failed");
    goto report;
  }
  if (!sc->library_thread) {
    run_session(&s);
  } else {
    pthread_t t;
    if (pthread_create(&t, NULL, run_session, &s) != 0) {
      failf(&r, "cannot start the session's thread");
      goto report;
    }
    pthread_join(t, NULL);
    uint32_t have = contexts(&r);
    if (have != 1u << r.device)
      failf(&r, "the process has CUDA contexts on GPUs 0x%x, not only on its "
                "own GPU %d",
            have, r.device);
  }
report:
  rankpipe_write(out_fd, 'R', &r.rep, sizeof r.rep);
  rankpipe_write(out_fd, 'O', r.owned, r.owned ? sc->nkeys : 0);
  sp_close(s.c);
  _exit(0);
}
