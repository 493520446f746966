/*
 * tlayout.c - affine layouts of the synthetic model; see tlayout.h.
 */
#include "tests/integration/tlayout.h"

#include <stdbool.h>
#include <string.h>

#include "tests/integration/model.h"

void tlayout_init(struct tlayout *l, uint32_t world, uint32_t ndim,
                  const int64_t *shape) {
  memset(l, 0, sizeof *l);
  l->world = world;
  l->ndim = ndim;
  memcpy(l->shape, shape, ndim * sizeof *shape);
}

void tlayout_piece(struct tlayout *l, uint32_t rank, const int64_t *origin,
                   const int64_t *size, int64_t src_offset,
                   const int64_t *src_stride, const uint32_t *holders,
                   uint32_t nholders) {
  sp_piece *p = &l->pieces[rank][l->npieces[rank]++];
  uint32_t *h = &l->holders[l->nholders];
  memcpy(h, holders, nholders * sizeof *holders);
  l->nholders += nholders;
  *p = (sp_piece){.ndim = l->ndim, .src_offset = src_offset,
                  .nholders = nholders, .holders = h};
  int64_t full_stride = 1, end = src_offset + 1;
  for (uint32_t d = l->ndim; d-- > 0;) {
    p->shape[d] = size[d];
    p->src_stride[d] = src_stride[d];
    p->dst_stride[d] = full_stride;
    p->dst_offset += origin[d] * full_stride;
    full_stride *= l->shape[d];
    end += (size[d] - 1) * src_stride[d];
    if (size[d] == 0)
      end = 0;
  }
  if (end > l->numel[rank])
    l->numel[rank] = end;
}

void tlayout_tp_dp(struct tlayout *l, uint32_t world, uint32_t tp,
                   uint32_t tp_stride, uint32_t dim, uint32_t fused,
                   const int64_t *shape) {
  tlayout_init(l, world, 2, shape);
  int64_t block = shape[dim] / fused;
  for (uint32_t r = 0; r < world; r++) {
    uint32_t t = (r / tp_stride) % tp;
    uint32_t holders[TLAYOUT_MAX_RANKS], n = 0;
    for (uint32_t h = 0; h < world; h++)
      if ((h / tp_stride) % tp == t)
        holders[n++] = h;
    int64_t start = block * t / tp;
    int64_t width = block * (t + 1) / tp - start;
    if (width == 0)
      continue;
    /* The shard: the rank's part of each block side by side along dim. */
    int64_t other = shape[1 - dim];
    int64_t row = dim == 1 ? fused * width : other;
    for (uint32_t f = 0; f < fused; f++) {
      int64_t origin[2], size[2];
      origin[dim] = f * block + start;
      origin[1 - dim] = 0;
      size[dim] = width;
      size[1 - dim] = other;
      int64_t at = dim == 1 ? f * width : f * width * other;
      tlayout_piece(l, r, origin, size, at, (int64_t[]){row, 1}, holders, n);
    }
  }
}

void tlayout_fill(const struct tlayout *l, uint32_t rank, const char *name,
                  size_t es, uint8_t *shard) {
  for (size_t i = 0; i < l->npieces[rank]; i++) {
    const sp_piece *p = &l->pieces[rank][i];
    int64_t idx[TLAYOUT_MAX_DIMS] = {0};
    bool empty = false;
    for (uint32_t d = 0; d < p->ndim; d++)
      empty = empty || p->shape[d] == 0;
    while (!empty) {
      int64_t src = p->src_offset, dst = p->dst_offset;
      for (uint32_t d = 0; d < p->ndim; d++) {
        src += idx[d] * p->src_stride[d];
        dst += idx[d] * p->dst_stride[d];
      }
      model_element(name, (uint64_t)dst, es, shard + (size_t)src * es);
      uint32_t d = p->ndim;
      while (d > 0 && ++idx[d - 1] == p->shape[d - 1])
        idx[--d] = 0;
      empty = d == 0;
    }
  }
}

/* Rank whole holds the 4x4 tensor as one piece; rank halves holds a whole
 * copy too, but lists it as two 4x2 column pieces (strided sources). */
static void whole_and_halves(struct tlayout *l, uint32_t whole,
                             uint32_t halves) {
  const int64_t shape[2] = {4, 4}, rows[2] = {4, 1};
  uint32_t holders[2] = {whole < halves ? whole : halves,
                         whole < halves ? halves : whole};
  tlayout_init(l, 4, 2, shape);
  tlayout_piece(l, whole, (int64_t[]){0, 0}, shape, 0, rows, holders, 2);
  for (int64_t c = 0; c < 4; c += 2)
    tlayout_piece(l, halves, (int64_t[]){0, c}, (int64_t[]){4, 2}, c, rows,
                  holders, 2);
}

void tlayout_family(struct tlayout_key keys[TLAYOUT_FAMILY]) {
  static const struct {
    const char *name, *dtype;
    uint32_t es, tp_stride, dim, fused;
    int64_t shape[2];
  } tp[] = {
      /* a fused gate_up weight by columns: strided sources */
      {"gate_up.cols", "bfloat16", 2, 1, 1, 2, {6, 16}},
      {"gate_up.rows", "float32", 4, 1, 0, 2, {8, 5}},
      {"o_proj.cols", "float32", 4, 1, 1, 1, {5, 6}},
      /* q, k and v fused, each cut unevenly (2 and 3 columns) */
      {"qkv.cols", "float32", 4, 1, 1, 3, {4, 15}},
      /* tensor parallel ranks on both nodes, replicas on one */
      {"gate_up.cols.across", "float32", 4, 2, 1, 2, {6, 12}},
  };
  size_t n = sizeof tp / sizeof tp[0];
  _Static_assert(sizeof tp / sizeof tp[0] + 2 == TLAYOUT_FAMILY,
                 "every layout of the family is built");
  for (size_t i = 0; i < n; i++) {
    keys[i].name = tp[i].name;
    keys[i].dtype = tp[i].dtype;
    keys[i].es = tp[i].es;
    tlayout_tp_dp(&keys[i].layout, 4, 2, tp[i].tp_stride, tp[i].dim,
                  tp[i].fused, tp[i].shape);
  }
  keys[n].name = "whole.halves";
  keys[n].dtype = "float32";
  keys[n].es = 4;
  whole_and_halves(&keys[n].layout, 0, 2);
  keys[n + 1].name = "halves.whole";
  keys[n + 1].dtype = "int16";
  keys[n + 1].es = 2;
  whole_and_halves(&keys[n + 1].layout, 2, 0);
}
