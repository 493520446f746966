/*
 * registry.c - one rank's registered storages and tensors; see registry.h.
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

#include "daemon/idxset.h"
#include "daemon/registry.h"
#include "daemon/regmap.h"
#include "daemon/request.h"
#include "proto/fail.h"
#include "proto/msg.h"
#include "shardport.h"

/* What a registration costs, counted against max_user_registration_bytes:
 * its entries in the registry's arrays, its slots in the lookup tables as
 * many as a table just grown holds per entry (four: idxset.c keeps a load
 * from a quarter to a half), and what it owns.  The arrays' spare room,
 * from doubling, may hold as much again (docs/operations.md, "Quotas"). */
#define STORAGE_COST                                                           \
  (sizeof(struct sp_storage) + sizeof(struct xfer_storage) +                    \
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

static void close_cuda(const struct registry *reg, struct xfer_storage *s) {
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

struct registry_drop {
  uv_work_t work;
  struct registry reg;
};

static void free_dropped(uv_work_t *work) {
  struct registry_drop *d = work->data;
  registry_free(&d->reg);
}

static void on_dropped(uv_work_t *work, int status) {
  (void)status;
  free(work->data);
}

void registry_drop(uv_loop_t *loop, struct registry *reg) {
  /* A registry is freed on a worker: a hundred thousand entries take about
   * ten milliseconds, and a host registry's mappings may be the last
   * references to a trainer's memfds, whose pages their unmapping then
   * frees (a quarter of a second or more per GiB).  A CUDA rank's storages
   * are closed here first, from the loop's thread, as they were opened:
   * the worker frees only memory. */
  for (size_t i = 0; i < reg->nstorages; i++) {
    close_cuda(reg, &reg->info[i]);
    reg->info[i].gpu.import = NULL;
  }
  struct registry_drop *d = malloc(sizeof *d);
  if (d == NULL) {
    registry_free(reg);
    return;
  }
  d->reg = *reg;
  memset(reg, 0, sizeof *reg);
  d->work.data = d;
  if (uv_queue_work(loop, &d->work, free_dropped, on_dropped) != 0) {
    registry_free(&d->reg);
    free(d);
  }
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
                             struct xfer_storage *out, char *msg,
                             size_t msglen) {
  memset(out, 0, sizeof *out);
  out->sid = rs->sid;
  int device = reg->device;
  if (rs->device[0] != '\0' &&
      (device = gpu_find_device(reg->gpu, rs->device, strlen(rs->device))) < 0)
    return sp__failf(msg, msglen, SP_EINVAL,
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
    return sp__failf(msg, msglen, rc, "storages[%u] (sid %u): %s", index,
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

/* A frame's entries on their way into a registry (registry.h): prepared
 * from the frame alone, then checked against the registry, admitted and
 * indexed in steps. */
struct reg_batch {
  bool tensors;
  const struct req_storage *s;
  struct req_tensor *t;
  size_t n;
  /* Storages: n sid hashes, then n base hashes.  Tensors: n key hashes,
   * then n sid hashes. */
  uint64_t *hash;
  enum { BATCH_CHECK, BATCH_INDEX, BATCH_DONE } stage;
  size_t done; /* entries of the stage done */
  struct reg_usage more;
  /* Storages, from the admission on until they are kept: their mappings'
   * plan, and what was opened for them (on the registry's GPU). */
  struct regmap_frame *fm;
  struct xfer_storage *fresh;
  struct gpu *opened_on; /* the GPU backend, while fresh holds opened ones */
  /* Tensors: their planner form, checked, with names owned until kept. */
  struct plan_key_in *keys;
};

static bool has_bytes(const struct req_storage *s) { return s->length > 0; }

static struct reg_batch *batch_new(bool tensors, size_t n) {
  struct reg_batch *b = calloc(1, sizeof *b);
  if (b == NULL)
    return NULL;
  b->tensors = tensors;
  b->n = n;
  b->hash = malloc((n > 0 ? 2 * n : 1) * sizeof *b->hash);
  if (b->hash == NULL) {
    free(b);
    return NULL;
  }
  return b;
}

/* Refuses a sid registered twice, and two storages with bytes at one base
 * address: the planner takes equal (device, base) for the same memory when
 * it looks for tied weights, so a trainer that sent one base for two
 * different regions would get one tensor's bytes under another's name.
 * This half checks the frame against itself and hashes each sid and base
 * for the other (check_storages); it needs nothing of the registry. */
int registry_batch_storages(const struct req_storage *s, size_t n,
                            struct reg_batch **out, char *msg,
                            size_t msglen) {
  const struct req_storage **by = malloc((n > 0 ? n : 1) * sizeof *by);
  struct reg_batch *b = batch_new(false, n);
  int rc = 0;
  *out = NULL;
  if (by == NULL || b == NULL) {
    free(by);
    registry_batch_free(b);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  b->s = s;
  b->more = (struct reg_usage){.registrations = n, .bytes = n * STORAGE_COST};
  /* Zeroed here, so that the loop does not take its page faults. */
  b->fresh = malloc((n > 0 ? n : 1) * sizeof *b->fresh);
  if (b->fresh == NULL) {
    free(by);
    registry_batch_free(b);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  memset(b->fresh, 0, (n > 0 ? n : 1) * sizeof *b->fresh);
  for (size_t i = 0; i < n; i++) {
    by[i] = &s[i];
    b->hash[i] = idxset_hash_u64(s[i].sid);
    b->hash[n + i] = idxset_hash_u64(s[i].base);
  }
  qsort(by, n, sizeof *by, sid_cmp);
  for (size_t i = 1; i < n && rc == 0; i++)
    if (by[i]->sid == by[i - 1]->sid)
      rc = sp__failf(msg, msglen, SP_EINVAL,
                     "storage sid %u is registered twice", by[i]->sid);
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (has_bytes(&s[i]))
      by[m++] = &s[i];
  qsort(by, m, sizeof *by, base_cmp);
  for (size_t i = 1; i < m && rc == 0; i++)
    if (by[i]->base == by[i - 1]->base)
      rc = sp__failf(msg, msglen, SP_EINVAL,
                     "storage sid %u: another storage of this rank has base "
                     "address 0x%llx; register each storage once",
                     by[i]->sid, (unsigned long long)by[i]->base);
  free(by);
  if (rc != 0) {
    registry_batch_free(b);
    return rc;
  }
  *out = b;
  return 0;
}

/* Checks storages [from, to) of the batch against the ones registered. */
static int check_storages(const struct registry *reg,
                          const struct reg_batch *b, size_t from, size_t to,
                          char *msg, size_t msglen) {
  const struct req_storage *s = b->s;
  for (size_t i = from; i < to; i++) {
    struct sid_probe sp = {reg, s[i].sid};
    if (idxset_find(&reg->by_sid, b->hash[i], match_sid, &sp) != IDXSET_NONE)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "storage sid %u is registered twice", s[i].sid);
    struct base_probe bp = {reg, s[i].base};
    if (has_bytes(&s[i]) &&
        idxset_find(&reg->by_base, b->hash[b->n + i], match_base, &bp) !=
            IDXSET_NONE)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "storage sid %u: another storage of this rank has base "
                       "address 0x%llx; register each storage once",
                       s[i].sid, (unsigned long long)s[i].base);
  }
  return 0;
}

/* Indexes storages [from, to) of the batch, at their places past the
 * registry's count: invisible until the count takes them in. */
static void index_storages(struct registry *reg, const struct reg_batch *b,
                           size_t from, size_t to) {
  for (size_t i = from; i < to; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    idxset_insert(&reg->by_sid, b->hash[i], idx);
    if (has_bytes(&b->s[i]))
      idxset_insert(&reg->by_base, b->hash[b->n + i], idx);
  }
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
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  return 0;
}

/* A rank's storages are of its device's kind: memfd storages for a "cpu"
 * rank, CUDA storages for a CUDA rank. */
static int check_kinds(const struct registry *reg, const struct req_storage *s,
                       size_t from, size_t to, char *msg, size_t msglen) {
  for (size_t i = from; i < to; i++) {
    bool memfd = s[i].kind == REQ_STORAGE_MEMFD;
    if (memfd && reg->gpu != NULL)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "storages[%zu] (sid %u): a memfd storage, but this rank "
                       "joined with a CUDA device; register its CUDA storages",
                       i, s[i].sid);
    if (!memfd && reg->gpu == NULL)
      return sp__failf(msg, msglen, SP_EINVAL,
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
                              struct xfer_storage *fresh, char *msg,
                              size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    /* A memfd storage's entry is zero until placed (place_storages). */
    if (s[i].kind == REQ_STORAGE_MEMFD)
      continue;
    memset(&fresh[i], 0, sizeof fresh[i]);
    fresh[i].sid = s[i].sid;
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

void registry_batch_close_opened(struct reg_batch *b) {
  if (b != NULL && b->opened_on != NULL)
    for (size_t i = 0; i < b->n; i++)
      if (b->fresh[i].gpu.import != NULL)
        gpu_storage_close(b->opened_on, &b->fresh[i].gpu);
  b->opened_on = NULL;
}

/* Admits the checked storages: their mappings planned (regmap.c), the
 * quotas, room in the registry, the mappings made and committed, and CUDA
 * storages opened into the batch.  Nothing is indexed yet, so a refusal
 * leaves the registry as it was. */
static int admit_storages(struct registry *reg, struct reg_batch *b,
                          const struct sp_frame *frame, char *msg,
                          size_t msglen) {
  const struct req_storage *s = b->s;
  size_t n = b->n;
  int rc;
  if ((rc = regmap_plan(reg, s, n, frame, &b->fm, msg, msglen)) != 0)
    return rc;
  struct reg_usage less;
  regmap_usage(b->fm, &b->more, &less);
  b->more.registrations = n;
  b->more.bytes = n * STORAGE_COST;
  if ((rc = reserve_storages(reg, n, &b->more, msg, msglen)) != 0)
    return rc;
  if ((rc = open_cuda_storages(reg, s, n, frame, b->fresh, msg, msglen)) != 0)
    return rc;
  b->opened_on = reg->gpu;
  if ((rc = regmap_map(b->fm, frame, msg, msglen)) != 0) {
    registry_batch_close_opened(b);
    return rc;
  }
  /* The mappings are the registry's from now on (unmapped with it), and
   * counted: the registry's usage is what its member gives back when it
   * goes, whether or not the batch is kept. */
  regmap_commit(reg, b->fm, s, n);
  charge(reg, &b->more);
  release(reg, &less);
  return 0;
}

/* Indexes storages [from, to) of the batch and writes their entries, at
 * their places past the registry's count: invisible until the count takes
 * them in. */
static void place_storages(struct registry *reg, const struct reg_batch *b,
                           size_t from, size_t to) {
  const struct req_storage *s = b->s;
  for (size_t i = from; i < to; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    struct xfer_storage *info = &reg->info[idx];
    struct sp_storage *st = &reg->storages[idx];
    *info = b->fresh[i];
    info->sid = s[i].sid;
    memset(st, 0, sizeof *st);
    st->device.type = SP_DEVICE_CPU;
    if (s[i].kind == REQ_STORAGE_MEMFD) {
      if (s[i].length > 0) {
        uint32_t map = regmap_map_of(b->fm, i);
        const struct reg_map *m = &reg->maps[map];
        info->data = (const uint8_t *)m->addr + (s[i].offset - m->offset);
        info->map = map;
      }
    } else {
      /* The planner tells storages apart by (device, base): the GPU's
       * UUID is what identifies it across processes. */
      int device = info->gpu.device;
      st->device.type = SP_DEVICE_CUDA;
      st->device.index = device;
      memcpy(st->device.uuid, gpu_device_uuid(reg->gpu, device),
             sizeof st->device.uuid);
    }
    st->base = s[i].base;
    st->nbytes = s[i].length;
  }
  index_storages(reg, b, from, to);
}

/* Checks storages [from, to) of the batch: the rank's limit first, then
 * against the registered and the rank's device kind. */
static int check_storage_range(const struct registry *reg,
                               struct reg_batch *b, size_t from, size_t to,
                               char *msg, size_t msglen) {
  int rc;
  if (from == 0 && b->n > REQ_MAX_PER_RANK - reg->nstorages)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "a rank may register at most %u storages",
                     REQ_MAX_PER_RANK);
  if ((rc = check_storages(reg, b, from, to, msg, msglen)) != 0)
    return rc;
  return check_kinds(reg, b->s, from, to, msg, msglen);
}

/* Keeps the placed storages: what was opened is the registry's now. */
static void keep_storages(struct registry *reg, struct reg_batch *b) {
  b->opened_on = NULL;
  reg->nstorages += b->n;
}

int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen) {
  struct reg_batch *b;
  int rc = registry_batch_storages(s, n, &b, msg, msglen);
  if (rc == 0)
    rc = registry_batch_step(reg, b, frame, SIZE_MAX, msg, msglen);
  registry_batch_free(b);
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

/* Keys unique within the frame, each key and sid hashed, each name
 * copied: all that needs nothing of the registry. */
int registry_batch_tensors(struct req_tensor *t, size_t n,
                           struct reg_batch **out, char *msg, size_t msglen) {
  const struct req_tensor **by = malloc((n > 0 ? n : 1) * sizeof *by);
  struct reg_batch *b = batch_new(true, n);
  int rc = 0;
  *out = NULL;
  if (b != NULL) {
    b->t = t;
    b->keys = calloc(n > 0 ? n : 1, sizeof *b->keys);
  }
  if (by == NULL || b == NULL || b->keys == NULL) {
    free(by);
    registry_batch_free(b);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  b->more.registrations = n;
  for (size_t i = 0; i < n; i++) {
    by[i] = &t[i];
    b->hash[i] = idxset_hash_bytes(t[i].key, t[i].key_len);
    b->hash[n + i] = idxset_hash_u64(t[i].sid);
    b->more.bytes += tensor_cost(&t[i]);
  }
  qsort(by, n, sizeof *by, tensor_key_cmp);
  for (size_t i = 1; i < n && rc == 0; i++)
    if (tensor_key_cmp(&by[i], &by[i - 1]) == 0)
      rc = sp__failf(msg, msglen, SP_EDUPKEY,
                     "key '%.*s' is registered twice by this rank",
                     (int)by[i]->key_len, by[i]->key);
  free(by);
  for (size_t i = 0; i < n && rc == 0; i++) {
    char *name = malloc(t[i].key_len + 1);
    if (name == NULL) {
      rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
      break;
    }
    memcpy(name, t[i].key, t[i].key_len);
    name[t[i].key_len] = '\0';
    b->keys[i].name = name;
  }
  if (rc != 0) {
    registry_batch_free(b);
    return rc;
  }
  *out = b;
  return 0;
}

/* Checks one tensor against its storage and fills in its planner form;
 * nothing is allocated. */
static int check_tensor(const struct registry *reg, const struct req_tensor *t,
                        size_t i, uint64_t sid_hash, struct plan_key_in *out,
                        char *msg, size_t msglen) {
  int klen = (int)(t->key_len < 64 ? t->key_len : 64);
  struct sid_probe sp = {reg, t->sid};
  uint32_t idx = idxset_find(&reg->by_sid, sid_hash, match_sid, &sp);
  if (idx == IDXSET_NONE)
    return sp__failf(msg, msglen, SP_ENOSTORAGE,
                     "tensors[%zu] ('%.*s'): storage sid %u is not registered",
                     i, klen, t->key, t->sid);
  char why[192];
  int rc = sp__view_check(&t->view, reg->storages[idx].nbytes, why, sizeof why);
  if (rc != 0)
    return sp__failf(
        msg, msglen, rc,
        "tensors[%zu] ('%.*s') in storage sid %u of %llu bytes: %s", i, klen,
        t->key, t->sid, (unsigned long long)reg->storages[idx].nbytes, why);
  memset(out, 0, sizeof *out);
  out->placement = t->placement;
  out->device_type = reg->device_type;
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof out->shape);
  out->storage = idx;
  out->view = t->view;
  sp__view_nbytes(&t->view, &out->nbytes);
  out->npieces = t->npieces;
  return 0;
}

/* Checks tensors [from, to) of the batch against the registry: a key not
 * registered yet, and a view inside its storage; fills in their planner
 * form in the batch. */
static int check_tensors(const struct registry *reg, struct reg_batch *b,
                         size_t from, size_t to, char *msg, size_t msglen) {
  const struct req_tensor *t = b->t;
  for (size_t i = from; i < to; i++) {
    struct name_probe np = {reg, t[i].key, t[i].key_len};
    if (idxset_find(&reg->by_name, b->hash[i], match_name, &np) !=
        IDXSET_NONE)
      return sp__failf(msg, msglen, SP_EDUPKEY,
                       "key '%.*s' is registered twice by this rank",
                       (int)t[i].key_len, t[i].key);
    const char *name = b->keys[i].name;
    int rc = check_tensor(reg, &t[i], i, b->hash[b->n + i], &b->keys[i], msg,
                          msglen);
    b->keys[i].name = name;
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* Admits the checked tensors: the limit, the quotas, room in the
 * registry.  Nothing is indexed yet, so a refusal leaves the registry as it
 * was. */
static int admit_tensors(struct registry *reg, struct reg_batch *b,
                         const struct sp_frame *frame, char *msg,
                         size_t msglen) {
  (void)frame;
  int rc;
  if (b->n > REQ_MAX_PER_RANK - reg->nkeys)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "a rank may register at most %u tensors",
                     REQ_MAX_PER_RANK);
  if (reg->quota != NULL &&
      (rc = reg->quota->admit(reg->quota_arg, reg, &b->more, msg, msglen)) !=
          0)
    return rc;
  if (grow((void **)&reg->keys, &reg->key_cap, reg->nkeys + b->n,
           sizeof *reg->keys) != 0 ||
      idxset_reserve(&reg->by_name, b->n) != 0)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  /* Counted from now on, as admit_storages says. */
  charge(reg, &b->more);
  return 0;
}

/* Indexes tensors [from, to) of the batch and writes their entries past
 * the registry's count, as place_storages. */
static void place_tensors(struct registry *reg, const struct reg_batch *b,
                          size_t from, size_t to) {
  for (size_t i = from; i < to; i++) {
    struct plan_key_in *key = &reg->keys[reg->nkeys + i];
    *key = b->keys[i];
    key->pieces = b->t[i].pieces;
    idxset_insert(&reg->by_name, b->hash[i], (uint32_t)(reg->nkeys + i));
  }
}

/* Keeps the placed tensors: their names and pieces are the registry's
 * from now on. */
static void keep_tensors(struct registry *reg, struct reg_batch *b) {
  for (size_t i = 0; i < b->n; i++) {
    b->keys[i].name = NULL;
    b->t[i].pieces = NULL;
  }
  reg->nkeys += b->n;
}

int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen) {
  struct reg_batch *b;
  int rc = registry_batch_tensors(t, n, &b, msg, msglen);
  if (rc == 0)
    rc = registry_batch_step(reg, b, NULL, SIZE_MAX, msg, msglen);
  registry_batch_free(b);
  return rc;
}

/* How a batch of one kind goes into a registry: its entries checked in
 * ranges, then admitted at once, then placed in ranges and kept at once
 * (reg_batch's stages).  Only admit may take the frame. */
struct batch_kind {
  int (*check)(const struct registry *reg, struct reg_batch *b, size_t from,
               size_t to, char *msg, size_t msglen);
  int (*admit)(struct registry *reg, struct reg_batch *b,
               const struct sp_frame *frame, char *msg, size_t msglen);
  void (*place)(struct registry *reg, const struct reg_batch *b, size_t from,
                size_t to);
  void (*keep)(struct registry *reg, struct reg_batch *b);
};

static const struct batch_kind storage_kind = {
    check_storage_range, admit_storages, place_storages, keep_storages};
static const struct batch_kind tensor_kind = {check_tensors, admit_tensors,
                                              place_tensors, keep_tensors};

/* The end of the next range of at most budget entries from b->done. */
static size_t range_end(const struct reg_batch *b, size_t budget) {
  return b->n - b->done < budget ? b->n : b->done + budget;
}

int registry_batch_step(struct registry *reg, struct reg_batch *b,
                        const struct sp_frame *frame, size_t budget, char *msg,
                        size_t msglen) {
  const struct batch_kind *k = b->tensors ? &tensor_kind : &storage_kind;
  int rc;
  if (b->stage == BATCH_DONE)
    return 0;
  if (b->stage == BATCH_CHECK) {
    size_t to = range_end(b, budget);
    if ((rc = k->check(reg, b, b->done, to, msg, msglen)) != 0)
      return rc;
    budget -= to - b->done;
    b->done = to;
    if (b->done < b->n)
      return 1;
    if ((rc = k->admit(reg, b, frame, msg, msglen)) != 0)
      return rc;
    b->stage = BATCH_INDEX;
    b->done = 0;
  }
  if (budget == 0 && b->n > 0)
    return 1;
  size_t to = range_end(b, budget);
  k->place(reg, b, b->done, to);
  b->done = to;
  if (b->done < b->n)
    return 1;
  k->keep(reg, b);
  b->stage = BATCH_DONE;
  return 0;
}

void registry_batch_free(struct reg_batch *b) {
  if (b == NULL)
    return;
  registry_batch_close_opened(b);
  regmap_frame_free(b->fm);
  if (b->keys != NULL)
    for (size_t i = 0; i < b->n; i++)
      free((char *)b->keys[i].name);
  free(b->keys);
  free(b->fresh);
  free(b->hash);
  free(b);
}

int registry_plan_rank(const struct registry *reg, uint32_t rank, uint64_t node,
                       const struct req_groups *groups,
                       struct plan_input_store *store, char *msg,
                       size_t msglen) {
  struct plan_rank_desc desc = {.rank = rank,
                                .node = node,
                                .nstorages = reg->nstorages,
                                .storages = reg->storages,
                                .nkeys = reg->nkeys,
                                .keys = reg->keys};
  if (groups != NULL) {
    desc.ngroups = groups->ngroups;
    desc.groups = groups->groups;
  }
  return plan_input_add_rank(store, &desc, msg, msglen);
}

int registry_add_remote_storages(struct registry *reg,
                                 const struct req_storage *s,
                                 const struct sp_device *device, size_t n,
                                 char *msg, size_t msglen) {
  struct reg_batch *b;
  int rc = registry_batch_storages(s, n, &b, msg, msglen);
  if (rc != 0)
    return rc;
  if (n > REQ_MAX_PER_RANK - reg->nstorages)
    rc = sp__failf(msg, msglen, SP_ELIMIT,
                   "a rank may register at most %u storages", REQ_MAX_PER_RANK);
  if (rc != 0 || (rc = check_storages(reg, b, 0, n, msg, msglen)) != 0 ||
      (rc = reserve_storages(reg, n, &b->more, msg, msglen)) != 0) {
    registry_batch_free(b);
    return rc;
  }
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
  }
  index_storages(reg, b, 0, n);
  charge(reg, &b->more);
  registry_batch_free(b);
  reg->nstorages += n;
  return 0;
}
