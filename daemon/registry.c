/*
 * registry.c - one rank's registered storages and tensors; see daemon.h.
 *
 * Storages are kept in the planner's form (struct sp_storage) beside what
 * only the daemon needs (the sid, the read-only mapping), and tensors in the
 * planner's form (struct plan_key_in), so gathering a job's metadata for
 * plan_build copies nothing.
 *
 * Two rules protect the trainer and the daemon:
 *   - a trainer's memory is never written: every host storage is mapped
 *     PROT_READ, so even a bug in the engine cannot corrupt a trainer; a
 *     CUDA storage (a rank on the CUDA backend) is opened through the
 *     backend (daemon/cuda/storage.c: cuMem allocations read-only, IPC
 *     allocations only ever copied from);
 *   - a frame is registered whole or not at all: everything is checked and
 *     mapped first, and committed only when nothing can fail any more, so a
 *     refusal leaves the registry exactly as it was.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "proto/fail.h"
#include "daemon/daemon.h"
#include "shardport.h"

void registry_init(struct registry *reg, uint32_t device_type) {
  memset(reg, 0, sizeof *reg);
  reg->device_type = device_type;
  idxset_init(&reg->by_sid);
  idxset_init(&reg->by_base);
  idxset_init(&reg->by_name);
}

static void unmap(const struct registry *reg, struct reg_storage *s) {
  if (s->map != NULL)
    munmap(s->map, s->map_len);
  s->map = NULL;
  if (s->gpu.import != NULL)
    gpu_storage_close(reg->gpu, &s->gpu);
}

void registry_free(struct registry *reg) {
  for (size_t i = 0; i < reg->nstorages; i++)
    unmap(reg, &reg->info[i]);
  for (size_t i = 0; i < reg->nkeys; i++) {
    free((char *)reg->keys[i].name);
    free((void *)reg->keys[i].pieces);
  }
  free(reg->storages);
  free(reg->info);
  free(reg->keys);
  idxset_free(&reg->by_sid);
  idxset_free(&reg->by_base);
  idxset_free(&reg->by_name);
  memset(reg, 0, sizeof *reg);
}

/* Room for more items in an array of *cap, doubling. */
static int grow(void **array, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t ncap = *cap > 0 ? *cap : 64;
  while (ncap < need)
    ncap *= 2;
  void *p = realloc(*array, ncap * size);
  if (p == NULL)
    return SP_ENOMEM;
  *array = p;
  *cap = ncap;
  return 0;
}

struct sid_probe {
  const struct registry *reg;
  uint32_t sid;
};

static bool match_sid(const void *ctx, uint32_t idx) {
  const struct sid_probe *p = ctx;
  return p->reg->info[idx].sid == p->sid;
}

struct base_probe {
  const struct registry *reg;
  uint64_t base;
};

static bool match_base(const void *ctx, uint32_t idx) {
  const struct base_probe *p = ctx;
  return p->reg->storages[idx].base == p->base;
}

uint32_t registry_find_sid(const struct registry *reg, uint32_t sid) {
  struct sid_probe p = {reg, sid};
  return idxset_find(&reg->by_sid, idxset_hash_u64(sid), match_sid, &p);
}

/* Maps bytes [offset, offset + length) of fd read-only.  The mapping
 * starts at the page below offset; data points at offset itself. */
static int map_storage(int fd, const struct req_storage *rs, uint32_t index,
                       struct reg_storage *out, char *msg, size_t msglen) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return sp_failf(msg, msglen, SP_EBADFD, "storages[%u] (sid %u): fstat: %s",
                    index, rs->sid, strerror(errno));
  if (!S_ISREG(st.st_mode))
    return sp_failf(msg, msglen, SP_EBADFD,
                    "storages[%u] (sid %u): the descriptor is not a memfd or "
                    "shm file",
                    index, rs->sid);
  if ((uint64_t)st.st_size < rs->offset + rs->length)
    return sp_failf(msg, msglen, SP_EBADFD,
                    "storages[%u] (sid %u): the file has %lld bytes, fewer "
                    "than offset + length = %llu",
                    index, rs->sid, (long long)st.st_size,
                    (unsigned long long)(rs->offset + rs->length));
  memset(out, 0, sizeof *out);
  out->sid = rs->sid;
  if (rs->length == 0)
    return 0;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t start = rs->offset - rs->offset % page;
  uint64_t len = rs->offset - start + rs->length;
  if (len > SIZE_MAX)
    return sp_failf(msg, msglen, SP_EBADFD, "storages[%u] (sid %u): too large",
                    index, rs->sid);
  void *p = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, fd, (off_t)start);
  if (p == MAP_FAILED)
    return sp_failf(msg, msglen, errno == ENOMEM ? SP_ENOMEM : SP_EBADFD,
                    "storages[%u] (sid %u): cannot map it read-only: %s", index,
                    rs->sid, strerror(errno));
  out->map = p;
  out->map_len = (size_t)len;
  out->data = (const uint8_t *)p + (rs->offset - start);
  return 0;
}

/* Opens a CUDA storage of a CUDA rank on the GPU it names (its rank's
 * when it names none). */
static int open_cuda_storage(const struct registry *reg,
                             const struct req_storage *rs,
                             const struct sp_frame *frame, uint32_t index,
                             struct reg_storage *out, char *msg,
                             size_t msglen) {
  memset(out, 0, sizeof *out);
  out->sid = rs->sid;
  if (reg->gpu == NULL)
    return sp_failf(msg, msglen, SP_EINVAL,
                    "storages[%u] (sid %u): a CUDA storage, but this rank "
                    "joined with a \"cpu\" device",
                    index, rs->sid);
  int device = reg->device;
  if (rs->device[0] != '\0' &&
      (device = gpu_find_device(reg->gpu, rs->device, strlen(rs->device))) < 0)
    return sp_failf(msg, msglen, SP_EINVAL,
                    "storages[%u] (sid %u): device \"%s\" is not a GPU of "
                    "this node",
                    index, rs->sid, rs->device);
  out->gpu.device = device;
  if (rs->length == 0)
    return 0;
  char why[SP_ERRMSG_MAX / 2];
  int rc = gpu_storage_open(
      reg->gpu, device,
      rs->kind == REQ_STORAGE_CUDA_IPC ? GPU_STORAGE_IPC : GPU_STORAGE_FD,
      rs->handle, rs->kind == REQ_STORAGE_CUDA_FD ? frame->fds[rs->fd] : -1,
      rs->offset, rs->length, &out->gpu, why, sizeof why);
  if (rc != 0)
    return sp_failf(msg, msglen, rc, "storages[%u] (sid %u): %s", index,
                    rs->sid, why);
  return 0;
}

/* Maps or opens one storage as its kind says. */
static int open_storage(const struct registry *reg,
                        const struct req_storage *rs,
                        const struct sp_frame *frame, uint32_t index,
                        struct reg_storage *out, char *msg, size_t msglen) {
  if (rs->kind != REQ_STORAGE_MEMFD)
    return open_cuda_storage(reg, rs, frame, index, out, msg, msglen);
  if (reg->gpu != NULL)
    return sp_failf(msg, msglen, SP_EINVAL,
                    "storages[%u] (sid %u): a memfd storage, but this rank "
                    "joined with a CUDA device; register its CUDA storages",
                    index, rs->sid);
  return map_storage(frame->fds[rs->fd], rs, index, out, msg, msglen);
}

static int sid_cmp(const void *a, const void *b) {
  uint32_t x = (*(const struct req_storage *const *)a)->sid;
  uint32_t y = (*(const struct req_storage *const *)b)->sid;
  return x < y ? -1 : x > y;
}

static int base_cmp(const void *a, const void *b) {
  uint64_t x = (*(const struct req_storage *const *)a)->base;
  uint64_t y = (*(const struct req_storage *const *)b)->base;
  return x < y ? -1 : x > y;
}

/* Refuses a sid registered twice, and two storages with bytes at one base
 * address: the planner takes equal (device, base) for the same memory when
 * it looks for tied weights, so a trainer that sent one base for two
 * different regions would get one tensor's bytes under another's name. */
static int check_unique(const struct registry *reg, const struct req_storage *s,
                        size_t n, char *msg, size_t msglen) {
  const struct req_storage **by = malloc((n > 0 ? n : 1) * sizeof *by);
  int rc = 0;
  if (by == NULL)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++)
    by[i] = &s[i];
  qsort(by, n, sizeof *by, sid_cmp);
  for (size_t i = 0; i < n && rc == 0; i++) {
    if ((i > 0 && by[i]->sid == by[i - 1]->sid) ||
        registry_find_sid(reg, by[i]->sid) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EINVAL,
                    "storage sid %u is registered twice", by[i]->sid);
  }
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (s[i].length > 0)
      by[m++] = &s[i];
  qsort(by, m, sizeof *by, base_cmp);
  for (size_t i = 0; i < m && rc == 0; i++) {
    struct base_probe p = {reg, by[i]->base};
    if ((i > 0 && by[i]->base == by[i - 1]->base) ||
        idxset_find(&reg->by_base, idxset_hash_u64(by[i]->base), match_base,
                    &p) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EINVAL,
                    "storage sid %u: another storage of this rank has base "
                    "address 0x%llx; register each storage once",
                    by[i]->sid, (unsigned long long)by[i]->base);
  }
  free(by);
  return rc;
}

/* Checks n more storages against the limit and the ones registered, and
 * makes room for them, so that registering them cannot fail halfway. */
static int reserve_storages(struct registry *reg, const struct req_storage *s,
                            size_t n, char *msg, size_t msglen) {
  if (n > REQ_MAX_PER_RANK - reg->nstorages)
    return sp_failf(msg, msglen, SP_ELIMIT,
                    "a rank may register at most %u storages",
                    REQ_MAX_PER_RANK);
  int rc = check_unique(reg, s, n, msg, msglen);
  if (rc != 0)
    return rc;
  size_t need = reg->nstorages + n;
  if (grow((void **)&reg->storages, &reg->storage_cap_s, need,
           sizeof *reg->storages) != 0 ||
      grow((void **)&reg->info, &reg->storage_cap_i, need, sizeof *reg->info) !=
          0 ||
      idxset_reserve(&reg->by_sid, n) != 0 ||
      idxset_reserve(&reg->by_base, n) != 0)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  return 0;
}

int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen) {
  int rc = reserve_storages(reg, s, n, msg, msglen);
  if (rc != 0)
    return rc;
  /* Map into the spare room at the end; only the count commits them. */
  struct reg_storage *fresh = reg->info + reg->nstorages;
  size_t mapped = 0;
  for (; mapped < n; mapped++) {
    rc = open_storage(reg, &s[mapped], frame, (uint32_t)mapped,
                      &fresh[mapped], msg, msglen);
    if (rc != 0)
      break;
  }
  if (rc != 0) {
    for (size_t i = 0; i < mapped; i++)
      unmap(reg, &fresh[i]);
    return rc;
  }
  for (size_t i = 0; i < n; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    struct sp_storage *st = &reg->storages[idx];
    memset(st, 0, sizeof *st);
    st->device.type = SP_DEVICE_CPU;
    if (s[i].kind != REQ_STORAGE_MEMFD) {
      /* The planner tells storages apart by (device, base): the GPU's
       * UUID is what identifies it across processes. */
      int device = reg->info[idx].gpu.device;
      st->device.type = SP_DEVICE_CUDA;
      st->device.index = device;
      memcpy(st->device.uuid, gpu_device_uuid(reg->gpu, device),
             sizeof st->device.uuid);
    }
    st->base = s[i].base;
    st->nbytes = s[i].length;
    idxset_insert(&reg->by_sid, idxset_hash_u64(s[i].sid), idx);
    if (s[i].length > 0)
      idxset_insert(&reg->by_base, idxset_hash_u64(s[i].base), idx);
  }
  reg->nstorages += n;
  return 0;
}

struct name_probe {
  const struct registry *reg;
  const char *name;
  size_t len;
};

static bool match_name(const void *ctx, uint32_t idx) {
  const struct name_probe *p = ctx;
  const char *name = p->reg->keys[idx].name;
  return strncmp(name, p->name, p->len) == 0 && name[p->len] == '\0';
}

static int tensor_key_cmp(const void *a, const void *b) {
  const struct req_tensor *x = *(const struct req_tensor *const *)a;
  const struct req_tensor *y = *(const struct req_tensor *const *)b;
  size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
  int c = memcmp(x->key, y->key, n);
  if (c != 0)
    return c;
  return x->key_len < y->key_len ? -1 : x->key_len > y->key_len;
}

/* Keys unique within the frame and against what is registered. */
static int check_keys(const struct registry *reg, const struct req_tensor *t,
                      size_t n, char *msg, size_t msglen) {
  const struct req_tensor **by = malloc((n > 0 ? n : 1) * sizeof *by);
  int rc = 0;
  if (by == NULL)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++)
    by[i] = &t[i];
  qsort(by, n, sizeof *by, tensor_key_cmp);
  for (size_t i = 0; i < n && rc == 0; i++) {
    struct name_probe p = {reg, by[i]->key, by[i]->key_len};
    if ((i > 0 && tensor_key_cmp(&by[i], &by[i - 1]) == 0) ||
        idxset_find(&reg->by_name,
                    idxset_hash_bytes(by[i]->key, by[i]->key_len), match_name,
                    &p) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EDUPKEY,
                    "key '%.*s' is registered twice by this rank",
                    (int)by[i]->key_len, by[i]->key);
  }
  free(by);
  return rc;
}

/* Checks one tensor against its storage and fills in its planner form;
 * nothing is allocated. */
static int check_tensor(const struct registry *reg, const struct req_tensor *t,
                        size_t i, struct plan_key_in *out, char *msg,
                        size_t msglen) {
  int klen = (int)(t->key_len < 64 ? t->key_len : 64);
  uint32_t idx = registry_find_sid(reg, t->sid);
  if (idx == IDXSET_NONE)
    return sp_failf(msg, msglen, SP_ENOSTORAGE,
                    "tensors[%zu] ('%.*s'): storage sid %u is not registered",
                    i, klen, t->key, t->sid);
  char why[192];
  int rc = sp_view_check(&t->view, reg->storages[idx].nbytes, why, sizeof why);
  if (rc != 0)
    return sp_failf(msg, msglen, rc,
                    "tensors[%zu] ('%.*s') in storage sid %u of %llu bytes: %s",
                    i, klen, t->key, t->sid,
                    (unsigned long long)reg->storages[idx].nbytes, why);
  memset(out, 0, sizeof *out);
  out->placement = t->placement;
  out->device_type = reg->device_type;
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof out->shape);
  out->storage = idx;
  out->view = t->view;
  sp_view_nbytes(&t->view, &out->nbytes);
  out->npieces = t->npieces;
  return 0;
}

int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen) {
  if (n > REQ_MAX_PER_RANK - reg->nkeys)
    return sp_failf(msg, msglen, SP_ELIMIT,
                    "a rank may register at most %u tensors", REQ_MAX_PER_RANK);
  int rc = check_keys(reg, t, n, msg, msglen);
  if (rc != 0)
    return rc;
  size_t need = reg->nkeys + n;
  if (grow((void **)&reg->keys, &reg->key_cap, need, sizeof *reg->keys) != 0 ||
      idxset_reserve(&reg->by_name, n) != 0)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  struct plan_key_in *fresh = reg->keys + reg->nkeys;
  for (size_t i = 0; i < n; i++)
    if ((rc = check_tensor(reg, &t[i], i, &fresh[i], msg, msglen)) != 0)
      return rc;
  size_t named = 0;
  for (; named < n; named++) {
    char *name = malloc(t[named].key_len + 1);
    if (name == NULL)
      break;
    memcpy(name, t[named].key, t[named].key_len);
    name[t[named].key_len] = '\0';
    fresh[named].name = name;
  }
  if (named < n) {
    for (size_t i = 0; i < named; i++)
      free((char *)fresh[i].name);
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  /* Committed: the pieces move from the request into the registry. */
  for (size_t i = 0; i < n; i++) {
    fresh[i].pieces = t[i].pieces;
    t[i].pieces = NULL;
    idxset_insert(&reg->by_name, idxset_hash_bytes(t[i].key, t[i].key_len),
                  (uint32_t)(reg->nkeys + i));
  }
  reg->nkeys = need;
  return 0;
}

void registry_rank_in(const struct registry *reg, uint32_t rank,
                      struct plan_rank_in *out) {
  memset(out, 0, sizeof *out);
  out->rank = rank;
  out->nstorages = reg->nstorages;
  out->storages = reg->storages;
  out->nkeys = reg->nkeys;
  out->keys = reg->keys;
}

int registry_add_remote_storages(struct registry *reg,
                                 const struct req_storage *s,
                                 const struct sp_device *device, size_t n,
                                 char *msg, size_t msglen) {
  int rc = reserve_storages(reg, s, n, msg, msglen);
  if (rc != 0)
    return rc;
  /* The rank's memory is on its own node: nothing here maps it. */
  for (size_t i = 0; i < n; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    memset(&reg->info[idx], 0, sizeof reg->info[idx]);
    reg->info[idx].sid = s[i].sid;
    struct sp_storage *st = &reg->storages[idx];
    memset(st, 0, sizeof *st);
    st->device = device[i];
    st->base = s[i].base;
    st->nbytes = s[i].length;
    idxset_insert(&reg->by_sid, idxset_hash_u64(s[i].sid), idx);
    if (s[i].length > 0)
      idxset_insert(&reg->by_base, idxset_hash_u64(s[i].base), idx);
  }
  reg->nstorages += n;
  return 0;
}
