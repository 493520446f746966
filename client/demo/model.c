/*
 * model.c - shardport-demo's synthetic model (model.h).
 */
#include "client/demo/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix(uint64_t x) {
  x += UINT64_C(0x9e3779b97f4a7c15);
  x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
  return x ^ (x >> 31);
}

static uint64_t hash_name(const char *s) {
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
  return mix(h);
}

uint32_t key_esize(const struct key *k) { return k->bf16 ? 2 : 4; }

int64_t key_cols(const struct key *k) {
  return k->ndim == 2 ? k->shape[1] : 1;
}

uint64_t key_numel(const struct key *k) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < k->ndim; d++)
    n *= (uint64_t)k->shape[d];
  return n;
}

uint64_t key_nbytes(const struct key *k) {
  return key_numel(k) * key_esize(k);
}

void key_fill(const struct key *k, uint32_t step, uint64_t first,
              uint64_t count, uint8_t *out) {
  /* Steps 2^40 elements apart: more than any key has, so no two steps
   * share a value's hash input. */
  uint64_t base = k->seed + ((uint64_t)step << 40) + first;
  if (k->bf16) {
    for (uint64_t i = 0; i < count; i++) {
      uint16_t v = (uint16_t)mix(base + i);
      memcpy(out + 2 * i, &v, 2);
    }
  } else {
    for (uint64_t i = 0; i < count; i++) {
      uint32_t v = (uint32_t)mix(base + i);
      memcpy(out + 4 * i, &v, 4);
    }
  }
}

/* Uneven rows: each rank weighs 0 to 3 (so some hold nothing), drawn from
 * the key's seed. */
static void split_rows(struct key *k, uint32_t ranks) {
  uint32_t w[MAX_RANKS], total = 0;
  for (uint32_t r = 0; r < ranks; r++) {
    w[r] = (uint32_t)(mix(k->seed ^ (r + 1)) % 4);
    total += w[r];
  }
  if (total == 0) {
    w[0] = 1;
    total = 1;
  }
  uint32_t cum = 0;
  for (uint32_t r = 0; r <= ranks; r++) {
    k->rows[r] = (int64_t)((uint64_t)k->shape[0] * cum / total);
    if (r < ranks)
      cum += w[r];
  }
}

static int64_t scaled(double base, double f) {
  int64_t v = llround(base * f);
  return v < 1 ? 1 : v;
}

static const struct model *sort_model;

static int cmp_name(const void *a, const void *b) {
  return strcmp(sort_model->keys[*(const uint32_t *)a].name,
                sort_model->keys[*(const uint32_t *)b].name);
}

static void add_key(struct model *m, const char *name, enum kind kind,
                    bool bf16, uint32_t ndim, int64_t rows, int64_t ncols,
                    uint32_t group, uint32_t expert) {
  struct key *k = &m->keys[m->nkeys++];
  memset(k, 0, sizeof *k);
  snprintf(k->name, sizeof k->name, "%s", name);
  k->kind = kind;
  k->bf16 = bf16;
  k->ndim = ndim;
  k->shape[0] = rows;
  k->shape[1] = ncols;
  k->group = group;
  k->expert = expert;
  k->seed = hash_name(name);
  if (kind == SHARD0)
    split_rows(k, m->ranks);
  m->bytes += key_nbytes(k);
}

/* Dims grow with sqrt(scale). */
int model_build(struct model *m, uint32_t ranks, double scale) {
  double f = sqrt(scale);
  int64_t d = scaled(1024, f);
  memset(m, 0, sizeof *m);
  m->ranks = ranks;
  m->ngroups = LAYERS + 1;
  m->keys = calloc(LAYERS * (5 + EXPERTS) + 1, sizeof *m->keys);
  m->by_name = calloc(LAYERS * (5 + EXPERTS) + 1, sizeof *m->by_name);
  if (!m->keys || !m->by_name)
    return -1;
  char name[64];
  for (uint32_t l = 0; l < LAYERS; l++) {
    snprintf(name, sizeof name, "layers.%02u.attn.qkv.weight", l);
    add_key(m, name, SHARD0, true, 2, 3 * d, d, l, 0);
    snprintf(name, sizeof name, "layers.%02u.attn.out.weight", l);
    add_key(m, name, SHARD0, false, 2, scaled(1000, f), d, l, 0);
    /* Fewer rows than ranks: some shards are empty. */
    snprintf(name, sizeof name, "layers.%02u.attn.bias", l);
    add_key(m, name, SHARD0, false, 2, 3, d, l, 0);
    snprintf(name, sizeof name, "layers.%02u.norm.weight", l);
    add_key(m, name, REPLICATED, false, 1, d, 0, l, 0);
    snprintf(name, sizeof name, "layers.%02u.norm.bias", l);
    add_key(m, name, PLAIN, true, 1, d, 0, l, 0);
    for (uint32_t e = 0; e < EXPERTS; e++) {
      snprintf(name, sizeof name, "layers.%02u.experts.%u.weight", l, e);
      add_key(m, name, EXPERT, true, 2, scaled(256, f), d, l,
              (l + e) % ranks);
    }
  }
  add_key(m, "embed.weight", SHARD0, true, 2, scaled(32003, f), d, LAYERS, 0);
  for (uint32_t i = 0; i < m->nkeys; i++)
    m->by_name[i] = i;
  sort_model = m;
  qsort(m->by_name, m->nkeys, sizeof *m->by_name, cmp_name);
  return 0;
}

void model_free(struct model *m) {
  free(m->keys);
  free(m->by_name);
}

const struct key *model_find_key(const struct model *m, const char *name,
                                  uint32_t *index) {
  size_t lo = 0, hi = m->nkeys;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    int c = strcmp(m->keys[m->by_name[mid]].name, name);
    if (c == 0) {
      *index = m->by_name[mid];
      return &m->keys[*index];
    }
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}
