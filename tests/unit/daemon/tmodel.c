/*
 * tmodel.c - registries over memfds for the daemon's unit tests.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/request.h"
#include "tests/unit/daemon/tmodel.h"

int tmodel_memfd(const char *name, size_t bytes) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
  return fd;
}

void tmodel_init(struct tmodel *m, uint32_t world, size_t bytes) {
  ck_assert_uint_le(world, TMODEL_MAX_RANKS);
  memset(m, 0, sizeof *m);
  m->world = world;
  for (uint32_t r = 0; r < world; r++) {
    registry_init(&m->reg[r], SP_DEVICE_CPU);
    m->fd[r] = tmodel_memfd("tmodel", bytes);
    m->map[r] =
        mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd[r], 0);
    ck_assert_ptr_ne(m->map[r], MAP_FAILED);
    m->size[r] = bytes;
    for (size_t i = 0; i < bytes; i++)
      m->map[r][i] = (uint8_t)(i * 31 + r * 101 + 7);
    struct sp_frame frame = {.nfds = 1};
    frame.fds[0] = m->fd[r];
    struct req_storage s = {.sid = 1,
                            .fd = 0,
                            .offset = 0,
                            .length = bytes,
                            .base = 0x100000ull * (r + 1)};
    char msg[256];
    ck_assert_msg(
        registry_add_storages(&m->reg[r], &s, 1, &frame, msg, sizeof msg) == 0,
        "%s", msg);
  }
}

void tmodel_free(struct tmodel *m) {
  for (uint32_t r = 0; r < m->world; r++) {
    registry_free(&m->reg[r]);
    munmap(m->map[r], m->size[r]);
    close(m->fd[r]);
  }
  for (size_t i = 0; i < m->nstores; i++)
    plan_input_store_free(m->stores[i]);
  free(m->stores);
}

uint64_t tmodel_alloc(struct tmodel *m, uint32_t r, size_t bytes) {
  uint64_t at = (m->used[r] + 63) & ~(uint64_t)63;
  ck_assert_uint_le(at + bytes, m->size[r]);
  m->used[r] = at + bytes;
  return at;
}

void tmodel_tensor(struct tmodel *m, uint32_t r, const char *key,
                   enum sp_dtype dtype, enum plan_placement placement,
                   uint32_t ndim, const int64_t *global, uint32_t vndim,
                   const int64_t *shape, const int64_t *stride, int64_t offset,
                   const struct affine_piece *pieces, size_t npieces) {
  struct req_tensor t;
  memset(&t, 0, sizeof t);
  t.key = key;
  t.key_len = strlen(key);
  t.sid = 1;
  t.view.dtype = dtype;
  t.view.ndim = vndim;
  t.view.offset = offset;
  for (uint32_t d = 0; d < vndim; d++) {
    t.view.shape[d] = shape[d];
    t.view.stride[d] = stride[d];
  }
  t.placement = placement;
  t.ndim = ndim;
  memcpy(t.shape, global, ndim * sizeof *global);
  if (npieces > 0) {
    size_t nholders = 0;
    for (size_t i = 0; i < npieces; i++)
      nholders += pieces[i].nholders;
    uint8_t *block =
        malloc(npieces * sizeof *pieces + nholders * sizeof(uint32_t));
    struct affine_piece *copy = (struct affine_piece *)block;
    uint32_t *holders = (uint32_t *)(block + npieces * sizeof *pieces);
    for (size_t i = 0; i < npieces; i++) {
      copy[i] = pieces[i];
      memcpy(holders, pieces[i].holders, pieces[i].nholders * sizeof *holders);
      copy[i].holders = holders;
      holders += pieces[i].nholders;
    }
    t.pieces = copy;
    t.npieces = npieces;
  }
  char msg[256];
  int rc = registry_add_tensors(&m->reg[r], &t, 1, msg, sizeof msg);
  free(t.pieces);
  ck_assert_msg(rc == 0, "%s", msg);
}

uint64_t tmodel_dense(struct tmodel *m, uint32_t r, const char *key,
                      enum sp_dtype dtype, enum plan_placement placement,
                      uint32_t ndim, const int64_t *global,
                      const int64_t *shape) {
  int64_t stride[SP_MAX_DIMS];
  uint64_t n = 1;
  for (uint32_t d = ndim; d-- > 0;) {
    stride[d] = (int64_t)n;
    n *= (uint64_t)(shape[d] > 0 ? shape[d] : 1);
  }
  for (uint32_t d = 0; d < ndim; d++)
    if (shape[d] == 0)
      n = 0;
  uint32_t esz = sp__dtype_size(dtype);
  uint64_t at = tmodel_alloc(m, r, n * esz);
  tmodel_tensor(m, r, key, dtype, placement, ndim, global, ndim, shape, stride,
                (int64_t)(at / esz), NULL, 0);
  return at;
}

const struct plan_input *tmodel_input(struct tmodel *m, uint32_t max_keys,
                                      uint64_t max_bytes) {
  struct plan_input_store *store = plan_input_store_new(m->world);
  char msg[256];
  ck_assert_ptr_nonnull(store);
  m->stores = realloc(m->stores, (m->nstores + 1) * sizeof *m->stores);
  ck_assert_ptr_nonnull(m->stores);
  m->stores[m->nstores++] = store;
  for (uint32_t r = 0; r < m->world; r++)
    ck_assert_int_eq(
        registry_plan_rank(&m->reg[r], r, 0, NULL, store, msg, sizeof msg), 0);
  struct plan_input *in = plan_input_of(store);
  in->max_keys = max_keys;
  in->max_bytes = max_bytes;
  return in;
}

uint8_t tmodel_pattern(uint32_t key, uint64_t elem, uint32_t byte) {
  return (uint8_t)(key * 131u + elem * 7u + byte * 13u + 1u);
}

static uint32_t note_key(struct tmodel *m, const char *name, uint32_t data) {
  ck_assert_uint_lt(m->nkeys, TMODEL_MAX_KEYS);
  uint32_t id = (uint32_t)m->nkeys++;
  m->key_name[id] = name;
  m->key_data[id] = data == UINT32_MAX ? id : data;
  return id;
}

static uint64_t shape_numel(uint32_t ndim, const int64_t *shape) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < ndim; d++)
    n *= (uint64_t)shape[d];
  return n;
}

void tmodel_shard0(struct tmodel *m, const char *name, enum sp_dtype dtype,
                   uint32_t ndim, const int64_t *global, const int64_t *rows) {
  uint32_t id = note_key(m, name, UINT32_MAX);
  uint32_t esz = sp__dtype_size(dtype);
  uint64_t row = shape_numel(ndim - 1, global + 1), start = 0;
  for (uint32_t r = 0; r < m->world; r++) {
    int64_t shape[SP_MAX_DIMS];
    memcpy(shape, global, ndim * sizeof *shape);
    shape[0] = rows[r];
    uint64_t at =
        tmodel_dense(m, r, name, dtype, PLAN_SHARD0, ndim, global, shape);
    uint64_t n = (uint64_t)rows[r] * row;
    for (uint64_t e = 0; e < n; e++)
      for (uint32_t b = 0; b < esz; b++)
        m->map[r][at + e * esz + b] = tmodel_pattern(id, start + e, b);
    start += n;
  }
}

void tmodel_whole(struct tmodel *m, const char *name, enum sp_dtype dtype,
                  enum plan_placement placement, uint32_t ndim,
                  const int64_t *global, uint32_t rank) {
  uint32_t id = note_key(m, name, UINT32_MAX);
  uint32_t esz = sp__dtype_size(dtype);
  uint64_t n = shape_numel(ndim, global);
  for (uint32_t r = 0; r < m->world; r++) {
    if (placement == PLAN_EXPERT && r != rank)
      continue;
    uint64_t at =
        tmodel_dense(m, r, name, dtype, placement, ndim, global, global);
    for (uint64_t e = 0; e < n; e++)
      for (uint32_t b = 0; b < esz; b++)
        m->map[r][at + e * esz + b] = tmodel_pattern(id, e, b);
  }
}

/* Registers rank r's affine shard of numel elements at a fresh offset with
 * one piece (or none), filling it from the full tensor's pattern. */
static void affine_rank(struct tmodel *m, uint32_t id, uint32_t r,
                        const char *name, enum sp_dtype dtype,
                        const int64_t *global, int64_t numel,
                        const struct affine_piece *piece) {
  uint32_t esz = sp__dtype_size(dtype);
  int64_t shape[1] = {numel}, stride[1] = {1};
  uint64_t at = tmodel_alloc(m, r, (size_t)numel * esz);
  if (piece != NULL)
    for (int64_t i = 0; i < piece->shape[0]; i++)
      for (int64_t j = 0; j < piece->shape[1]; j++) {
        uint64_t s = (uint64_t)(piece->src_offset + i * piece->src_stride[0] +
                                j * piece->src_stride[1]);
        uint64_t g = (uint64_t)(piece->dst_offset + i * piece->dst_stride[0] +
                                j * piece->dst_stride[1]);
        for (uint32_t b = 0; b < esz; b++)
          m->map[r][at + s * esz + b] = tmodel_pattern(id, g, b);
      }
  tmodel_tensor(m, r, name, dtype, PLAN_AFFINE, 2, global, 1, shape, stride,
                (int64_t)(at / esz), piece, piece != NULL ? 1 : 0);
}

void tmodel_columns(struct tmodel *m, const char *name, enum sp_dtype dtype,
                    int64_t rows, int64_t cols) {
  uint32_t id = note_key(m, name, UINT32_MAX);
  int64_t global[2] = {rows, cols * m->world};
  for (uint32_t r = 0; r < m->world; r++) {
    uint32_t holder = r;
    struct affine_piece p = {.ndim = 2,
                             .shape = {rows, cols},
                             .src_offset = 0,
                             .src_stride = {cols, 1},
                             .dst_offset = r * cols,
                             .dst_stride = {global[1], 1},
                             .nholders = 1,
                             .holders = &holder};
    affine_rank(m, id, r, name, dtype, global, rows * cols, &p);
  }
}

void tmodel_replica(struct tmodel *m, const char *name, enum sp_dtype dtype,
                    int64_t rows, int64_t cols, uint32_t mask) {
  uint32_t id = note_key(m, name, UINT32_MAX);
  int64_t global[2] = {rows, cols};
  uint32_t holders[TMODEL_MAX_RANKS], n = 0;
  for (uint32_t r = 0; r < m->world; r++)
    if (mask & (1u << r))
      holders[n++] = r;
  for (uint32_t r = 0; r < m->world; r++) {
    struct affine_piece p = {.ndim = 2,
                             .shape = {rows, cols},
                             .src_offset = 0,
                             .src_stride = {cols, 1},
                             .dst_offset = 0,
                             .dst_stride = {cols, 1},
                             .nholders = n,
                             .holders = holders};
    bool holds = mask & (1u << r);
    affine_rank(m, id, r, name, dtype, global, holds ? rows * cols : 0,
                holds ? &p : NULL);
  }
}

static const struct plan_key_in *find_key(const struct registry *reg,
                                          const char *name) {
  for (size_t i = 0; i < reg->nkeys; i++)
    if (strcmp(reg->keys[i].name, name) == 0)
      return &reg->keys[i];
  ck_abort_msg("no key %s", name);
  return NULL;
}

void tmodel_tie(struct tmodel *m, const char *name, const char *leader) {
  uint32_t lead = 0;
  while (lead < m->nkeys && strcmp(m->key_name[lead], leader) != 0)
    lead++;
  ck_assert_uint_lt(lead, m->nkeys);
  note_key(m, name, m->key_data[lead]);
  for (uint32_t r = 0; r < m->world; r++) {
    const struct plan_key_in *e = find_key(&m->reg[r], leader);
    struct sp_view v = e->view;
    tmodel_tensor(m, r, name, v.dtype, e->placement, e->ndim, e->shape, v.ndim,
                  v.shape, v.stride, v.offset, NULL, 0);
  }
}

uint64_t tmodel_offset(const struct tmodel *m, uint32_t r, const char *name) {
  const struct plan_key_in *e = find_key(&m->reg[r], name);
  return (uint64_t)e->view.offset * sp__dtype_size(e->view.dtype);
}

void tmodel_check(const struct tmodel *m, const struct plan *plan,
                  const struct publish_layout *layout, uint8_t *const *seg) {
  for (size_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    const struct plan_key *as =
        key->kind == PLAN_KEY_ALIAS ? &plan->keys[key->alias_of] : key;
    uint32_t id = 0;
    while (id < m->nkeys && strcmp(m->key_name[id], key->name) != 0)
      id++;
    ck_assert_uint_lt(id, m->nkeys);
    uint32_t esz = sp__dtype_size(key->dtype);
    int64_t stride[SP_MAX_DIMS];
    const uint8_t *base;
    if (as->kind == PLAN_KEY_IDENTITY) {
      /* Published as the owner's own storage: nothing was copied. */
      ck_assert_uint_eq(layout->offset[k], PUBLISH_IDENTITY);
      struct plan_key_in held;
      const struct registry *reg = &m->reg[key->owner];
      ck_assert_uint_lt(as->held, reg->nkeys);
      plan_key_holding(plan, (uint32_t)(as - plan->keys), &held);
      base = reg->info[held.storage].data + (uint64_t)held.view.offset * esz;
      memcpy(stride, held.view.stride, sizeof stride);
    } else {
      ck_assert_uint_ne(layout->offset[k], PUBLISH_IDENTITY);
      ck_assert_uint_eq(layout->offset[k] % PUBLISH_ALIGN, 0);
      ck_assert_uint_le(layout->offset[k] + key->nbytes,
                        layout->seg_size[key->owner]);
      base = seg[key->owner] + layout->offset[k];
      int64_t s = 1;
      for (uint32_t d = key->ndim; d-- > 0;) {
        stride[d] = s;
        s *= key->shape[d];
      }
    }
    uint64_t n = key->nbytes / esz;
    for (uint64_t g = 0; g < n; g++) {
      uint64_t rest = g;
      int64_t at = 0;
      for (uint32_t d = key->ndim; d-- > 0;) {
        at += (int64_t)(rest % (uint64_t)key->shape[d]) * stride[d];
        rest /= (uint64_t)key->shape[d];
      }
      for (uint32_t b = 0; b < esz; b++)
        if (base[(uint64_t)at * esz + b] !=
            tmodel_pattern(m->key_data[id], g, b))
          ck_abort_msg("key %s: element %llu byte %u differs", key->name,
                       (unsigned long long)g, b);
    }
  }
}
