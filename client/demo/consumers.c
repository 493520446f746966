/*
 * consumers.c - shardport-demo's consumers' layouts, their registration
 * and the checks of what they received (consumers.h).
 */
#include "client/demo/consumers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ALIGN 64

/* Part index of n elements cut over parts, as torch.tensor_split cuts. */
static void cut(int64_t n, uint32_t parts, uint32_t index, int64_t *first,
                int64_t *count) {
  int64_t each = n / parts, extra = n % parts;
  *first = index * each + (index < extra ? index : extra);
  *count = each + (index < extra ? 1 : 0);
}

static int64_t rows_of(const struct key *k) { return k->shape[0]; }

/* Appends a slab, placed after the previous ones. */
static void add_slab(struct consumer_layout *l, const struct key *k,
                     struct slab s) {
  s.byte_off = (l->bytes + ALIGN - 1) / ALIGN * ALIGN;
  uint64_t n = (uint64_t)(s.shape[0] * s.shape[1]) * key_esize(k);
  l->bytes = s.byte_off + n;
  l->delivered += n;
  l->slabs[l->nslabs++] = s;
}

static int expert_number(const struct key *k) {
  const char *at = strstr(k->name, "experts.");
  return at ? atoi(at + strlen("experts.")) : -1;
}

int consumer_layout_build(const struct model *m, uint32_t index, uint32_t n,
                          struct consumer_layout *out) {
  *out = (struct consumer_layout){.index = index};
  /* At most three slabs a key (q, k and v). */
  out->slabs = calloc(3 * m->nkeys, sizeof *out->slabs);
  if (out->slabs == NULL)
    return -1;
  for (uint32_t i = 0; i < m->nkeys; i++) {
    const struct key *k = &m->keys[i];
    int64_t cols = key_cols(k), first, count;
    if (k->kind == EXPERT) {
      if (expert_number(k) % (int)n == (int)index)
        add_slab(out, k, (struct slab){.key = i, .part = SP_TARGET_WHOLE,
                                       .shape = {rows_of(k), cols}});
    } else if (k->kind != SHARD0) {
      add_slab(out, k, (struct slab){.key = i, .part = SP_TARGET_WHOLE,
                                     .shape = {rows_of(k), cols}});
    } else if (strstr(k->name, "attn.qkv") != NULL) {
      /* Its heads of each of q, k and v, which lie one after the other
       * along the key's rows. */
      int64_t block = rows_of(k) / 3;
      cut(block, n, index, &first, &count);
      for (int64_t b = 0; b < 3; b++)
        add_slab(out, k, (struct slab){.key = i, .part = SP_TARGET_PIECES,
                                       .start = {b * block + first, 0},
                                       .shape = {count, cols}});
    } else if (strncmp(k->name, "embed", 5) == 0) {
      cut(rows_of(k), n, index, &first, &count);
      add_slab(out, k, (struct slab){.key = i, .part = SP_TARGET_SHARD,
                                     .dim = 0, .start = {first, 0},
                                     .shape = {count, cols}});
    } else {
      cut(cols, n, index, &first, &count);
      add_slab(out, k, (struct slab){.key = i, .part = SP_TARGET_SHARD,
                                     .dim = 1, .start = {0, first},
                                     .shape = {rows_of(k), count}});
    }
  }
  if (out->bytes == 0)
    out->bytes = 1; /* a memfd of no bytes cannot be mapped */
  return 0;
}

void consumer_layout_free(struct consumer_layout *l) {
  free(l->slabs);
  l->slabs = NULL;
}

/* A slab's view in the key's own dims, in elements. */
static void slab_view(const struct key *k, const struct slab *s,
                      int64_t *shape, int64_t *stride, int64_t *offset) {
  shape[0] = s->shape[0];
  stride[0] = k->ndim == 2 ? s->shape[1] : 1;
  shape[1] = s->shape[1];
  stride[1] = 1;
  *offset = (int64_t)(s->byte_off / key_esize(k));
}

int consumer_register(sp_client *c, const struct model *m,
                      const struct consumer_layout *l, int fd, uint8_t *addr) {
  sp_storage_desc storage = {
      .id = 0, .fd = fd, .length = l->bytes, .addr = addr};
  int rc = sp_register_storages(c, &storage, 1);
  if (rc < 0)
    return rc;
  sp_target_desc *targets = calloc(l->nslabs, sizeof *targets);
  sp_target_piece *pieces = calloc(l->nslabs, sizeof *pieces);
  size_t n = 0;
  if (targets == NULL || pieces == NULL) {
    free(targets);
    free(pieces);
    return SP_ENOMEM;
  }
  for (size_t i = 0; i < l->nslabs; i++) {
    const struct slab *s = &l->slabs[i];
    const struct key *k = &m->keys[s->key];
    sp_target_desc *t = &targets[n];
    if (n > 0 && targets[n - 1].key == k->name) {
      /* Another piece of the key before. */
      targets[n - 1].npieces++;
    } else {
      *t = (sp_target_desc){.key = k->name,
                            .dtype = k->bf16 ? "bfloat16" : "float32",
                            .ndim = k->ndim,
                            .global_shape = {k->shape[0], k->shape[1]},
                            .part = s->part,
                            .dim = s->dim};
      if (s->part == SP_TARGET_PIECES) {
        t->pieces = &pieces[i];
        t->npieces = 1;
      } else {
        slab_view(k, s, t->shape, t->stride, &t->offset);
      }
      n++;
    }
    if (s->part == SP_TARGET_PIECES) {
      sp_target_piece *p = &pieces[i];
      p->start[0] = s->start[0];
      p->start[1] = s->start[1];
      slab_view(k, s, p->shape, p->stride, &p->offset);
    }
  }
  rc = sp_register_targets(c, targets, n);
  free(targets);
  free(pieces);
  return rc;
}

int consumer_verify(const struct model *m, const struct consumer_layout *l,
                    const uint8_t *buf, uint32_t step, char *err,
                    size_t len) {
  uint8_t chunk[64 * 1024];
  for (size_t i = 0; i < l->nslabs; i++) {
    const struct slab *s = &l->slabs[i];
    const struct key *k = &m->keys[s->key];
    int64_t cols = key_cols(k);
    uint32_t es = key_esize(k);
    const uint8_t *at = buf + s->byte_off;
    /* Whole rows are one run of the original; else a run a row. */
    bool whole_rows = s->shape[1] == cols;
    int64_t runs = whole_rows ? 1 : s->shape[0];
    uint64_t run = (uint64_t)(whole_rows ? s->shape[0] * cols : s->shape[1]);
    for (int64_t r = 0; r < runs; r++) {
      uint64_t first = (uint64_t)((s->start[0] + r) * cols + s->start[1]);
      for (uint64_t done = 0; done < run;) {
        uint64_t n = run - done < sizeof chunk / es ? run - done
                                                    : sizeof chunk / es;
        key_fill(k, step, first + done, n, chunk);
        if (memcmp(at, chunk, n * es) != 0) {
          snprintf(err, len,
                   "consumer %u: %s differs from the original of step %u "
                   "in its box at (%lld, %lld)",
                   l->index, k->name, step, (long long)s->start[0],
                   (long long)s->start[1]);
          return -1;
        }
        at += n * es;
        done += n;
      }
    }
  }
  return 0;
}

void consumer_copy_owned(const struct model *m,
                         const struct consumer_layout *l, uint32_t key,
                         const sp_owned_tensor *t, uint8_t *buf) {
  const struct key *k = &m->keys[key];
  uint32_t es = key_esize(k);
  int64_t row_stride = t->stride[0];
  int64_t col_stride = k->ndim == 2 ? t->stride[1] : 1;
  for (size_t i = 0; i < l->nslabs; i++) {
    const struct slab *s = &l->slabs[i];
    if (s->key != key)
      continue;
    uint8_t *to = buf + s->byte_off;
    for (int64_t r = 0; r < s->shape[0]; r++) {
      const uint8_t *from =
          (const uint8_t *)t->data +
          ((s->start[0] + r) * row_stride + s->start[1] * col_stride) * es;
      if (col_stride == 1) {
        memcpy(to, from, (size_t)s->shape[1] * es);
        to += (size_t)s->shape[1] * es;
        continue;
      }
      for (int64_t c = 0; c < s->shape[1]; c++, to += es)
        memcpy(to, from + c * col_stride * es, es);
    }
  }
}
