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
 *
 * Host storages are mapped by regmap.c, which says which pages and why.
 * What a registry takes is counted (reg_usage) and offered to its quotas
 * before a frame is kept.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "proto/fail.h"
#include "daemon/daemon.h"
#include "shardport.h"

/* What a registration costs, counted against max_user_registration_bytes:
 * its entries in the registry's arrays, its slots in the lookup tables as
 * many as a table just grown holds per entry (four: idxset.c keeps a load
 * from a quarter to a half), and what it owns.  The arrays' spare room,
 * from doubling, may hold as much again (docs/operations.md, "Quotas"). */
#define STORAGE_COST                                                           \
  (sizeof(struct sp_storage) + sizeof(struct reg_storage) +                    \
   2 * 4 * sizeof(uint64_t))

static uint64_t tensor_cost(const struct req_tensor *t) {
  uint64_t holders = 0;
  for (size_t i = 0; i < t->npieces; i++)
    holders += t->pieces[i].nholders;
  return sizeof(struct plan_key_in) + 4 * sizeof(uint64_t) + t->key_len + 1 +
         t->npieces * sizeof(struct affine_piece) + holders * sizeof(uint32_t);
}

void registry_init(struct registry *reg, uint32_t device_type) {
  memset(reg, 0, sizeof *reg);
  reg->device_type = device_type;
  idxset_init(&reg->by_sid);
  idxset_init(&reg->by_base);
  idxset_init(&reg->by_name);
  idxset_init(&reg->by_file);
}

static void close_cuda(const struct registry *reg, struct reg_storage *s) {
  if (s->gpu.import != NULL)
    gpu_storage_close(reg->gpu, &s->gpu);
}

void registry_free(struct registry *reg) {
  for (size_t i = 0; i < reg->nstorages; i++)
    close_cuda(reg, &reg->info[i]);
  for (size_t i = 0; i < reg->nmaps; i++)
    munmap(reg->maps[i].addr, reg->maps[i].len);
  free(reg->places);
  for (size_t i = 0; i < reg->nkeys; i++) {
    free((char *)reg->keys[i].name);
    free((void *)reg->keys[i].pieces);
  }
  free(reg->storages);
  free(reg->info);
  free(reg->keys);
  free(reg->maps);
  free(reg->files);
  idxset_free(&reg->by_sid);
  idxset_free(&reg->by_base);
  idxset_free(&reg->by_name);
  idxset_free(&reg->by_file);
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

/* Counts what a kept frame gave back, in the registry and for its quotas. */
static void release(struct registry *reg, const struct reg_usage *less) {
  reg->used.mappings -= less->mappings;
  reg->used.mapped_bytes -= less->mapped_bytes;
  if (reg->quota != NULL)
    reg->quota->release(reg->quota_arg, less);
}

/* Counts what a kept frame took, in the registry and for its quotas. */
static void charge(struct registry *reg, const struct reg_usage *more) {
  reg->used.mappings += more->mappings;
  reg->used.mapped_bytes += more->mapped_bytes;
  reg->used.registrations += more->registrations;
  reg->used.bytes += more->bytes;
  if (reg->quota != NULL)
    reg->quota->charge(reg->quota_arg, more);
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

/* Opens a CUDA storage of a CUDA rank on the GPU it names (its rank's
 * when it names none). */
static int open_cuda_storage(const struct registry *reg,
                             const struct req_storage *rs,
                             const struct sp_frame *frame, uint32_t index,
                             struct reg_storage *out, char *msg,
                             size_t msglen) {
  memset(out, 0, sizeof *out);
  out->sid = rs->sid;
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

/* Checks n more storages against the limit and the ones registered. */
static int check_storages(const struct registry *reg,
                          const struct req_storage *s, size_t n, char *msg,
                          size_t msglen) {
  if (n > REQ_MAX_PER_RANK - reg->nstorages)
    return sp_failf(msg, msglen, SP_ELIMIT,
                    "a rank may register at most %u storages",
                    REQ_MAX_PER_RANK);
  return check_unique(reg, s, n, msg, msglen);
}

/* Asks the quotas for more, then makes room for n more storages, so that
 * registering them cannot fail halfway. */
static int reserve_storages(struct registry *reg, size_t n,
                            const struct reg_usage *more, char *msg,
                            size_t msglen) {
  int rc;
  if (reg->quota != NULL &&
      (rc = reg->quota->admit(reg->quota_arg, reg, more, msg, msglen)) != 0)
    return rc;
  size_t need = reg->nstorages + n;
  if (grow((void **)&reg->storages, &reg->storage_cap_s, need,
           sizeof *reg->storages) != 0 ||
      grow((void **)&reg->info, &reg->storage_cap_i, need, sizeof *reg->info) !=
          0 ||
      idxset_reserve(&reg->by_sid, n) != 0 ||
      idxset_reserve(&reg->by_base, n) != 0 ||
      grow((void **)&reg->maps, &reg->map_cap, reg->nmaps + more->mappings,
           sizeof *reg->maps) != 0 ||
      grow((void **)&reg->places, &reg->place_cap,
           reg->nmaps + more->mappings, sizeof *reg->places) != 0 ||
      grow((void **)&reg->files, &reg->file_cap, reg->nfiles + more->mappings,
           sizeof *reg->files) != 0 ||
      idxset_reserve(&reg->by_file, more->mappings) != 0)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  return 0;
}

/* A rank's storages are of its device's kind: memfd storages for a "cpu"
 * rank, CUDA storages for a CUDA rank. */
static int check_kinds(const struct registry *reg, const struct req_storage *s,
                       size_t n, char *msg, size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    bool memfd = s[i].kind == REQ_STORAGE_MEMFD;
    if (memfd && reg->gpu != NULL)
      return sp_failf(msg, msglen, SP_EINVAL,
                      "storages[%zu] (sid %u): a memfd storage, but this rank "
                      "joined with a CUDA device; register its CUDA storages",
                      i, s[i].sid);
    if (!memfd && reg->gpu == NULL)
      return sp_failf(msg, msglen, SP_EINVAL,
                      "storages[%zu] (sid %u): a CUDA storage, but this rank "
                      "joined with a \"cpu\" device",
                      i, s[i].sid);
  }
  return 0;
}

/* Opens each CUDA storage of the frame into fresh (a memfd storage's
 * memory comes with its file's mapping, map_files); nothing stays open when
 * one fails. */
static int open_cuda_storages(const struct registry *reg,
                              const struct req_storage *s, size_t n,
                              const struct sp_frame *frame,
                              struct reg_storage *fresh, char *msg,
                              size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    memset(&fresh[i], 0, sizeof fresh[i]);
    fresh[i].sid = s[i].sid;
    if (s[i].kind == REQ_STORAGE_MEMFD)
      continue;
    int rc = open_cuda_storage(reg, &s[i], frame, (uint32_t)i, &fresh[i], msg,
                               msglen);
    if (rc != 0) {
      for (size_t k = 0; k < i; k++)
        close_cuda(reg, &fresh[k]);
      return rc;
    }
  }
  return 0;
}

/* Admits, maps and keeps a frame's storages, whose mappings fm plans. */
static int add_storages(struct registry *reg, const struct req_storage *s,
                        size_t n, const struct sp_frame *frame,
                        struct regmap_frame *fm, char *msg, size_t msglen) {
  struct reg_usage more, less;
  regmap_usage(fm, &more, &less);
  more.registrations = n;
  more.bytes = n * STORAGE_COST;
  int rc = reserve_storages(reg, n, &more, msg, msglen);
  if (rc != 0)
    return rc;
  /* Open into the spare room at the end; only the count commits them. */
  struct reg_storage *fresh = reg->info + reg->nstorages;
  if ((rc = open_cuda_storages(reg, s, n, frame, fresh, msg, msglen)) != 0)
    return rc;
  if ((rc = regmap_map(fm, frame, msg, msglen)) != 0) {
    for (size_t i = 0; i < n; i++)
      close_cuda(reg, &fresh[i]);
    return rc;
  }
  regmap_commit(reg, fm, s, n);
  for (size_t i = 0; i < n; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    struct sp_storage *st = &reg->storages[idx];
    memset(st, 0, sizeof *st);
    st->device.type = SP_DEVICE_CPU;
    if (s[i].kind == REQ_STORAGE_MEMFD) {
      if (s[i].length > 0) {
        uint32_t map = regmap_map_of(fm, i);
        const struct reg_map *m = &reg->maps[map];
        fresh[i].data = (const uint8_t *)m->addr + (s[i].offset - m->offset);
        fresh[i].map = map;
      }
    } else {
      /* The planner tells storages apart by (device, base): the GPU's
       * UUID is what identifies it across processes. */
      int device = fresh[i].gpu.device;
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
  charge(reg, &more);
  release(reg, &less);
  return 0;
}

int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen) {
  struct regmap_frame *fm = NULL;
  int rc = check_storages(reg, s, n, msg, msglen);
  if (rc != 0 || (rc = check_kinds(reg, s, n, msg, msglen)) != 0)
    return rc;
  /* The plan is freed whether it, or what follows it, failed. */
  if ((rc = regmap_plan(reg, s, n, frame, &fm, msg, msglen)) == 0)
    rc = add_storages(reg, s, n, frame, fm, msg, msglen);
  regmap_frame_free(fm);
  return rc;
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
  struct reg_usage more = {.registrations = n};
  for (size_t i = 0; i < n; i++)
    more.bytes += tensor_cost(&t[i]);
  if (reg->quota != NULL &&
      (rc = reg->quota->admit(reg->quota_arg, reg, &more, msg, msglen)) != 0)
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
  charge(reg, &more);
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
  struct reg_usage more = {.registrations = n, .bytes = n * STORAGE_COST};
  int rc = check_storages(reg, s, n, msg, msglen);
  if (rc != 0 || (rc = reserve_storages(reg, n, &more, msg, msglen)) != 0)
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
  charge(reg, &more);
  return 0;
}
