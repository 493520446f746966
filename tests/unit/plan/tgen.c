/*
 * tgen.c - random affine layouts and their corruptions; see tgen.h.
 */
#include "tests/unit/plan/tgen.h"

#include <stdbool.h>
#include <string.h>

#include "tests/unit/plan/tjob.h"

static uint64_t rnd(uint64_t *s, uint64_t n) { return tjob_rand(s) % n; }

/* Room for n elements at the end of rank's shard: where they start. */
static int64_t shard_take(struct tgen_layout *l, uint32_t rank, uint64_t n) {
  int64_t at = (int64_t)l->shard_numel[rank];
  l->shard_numel[rank] += n;
  return at;
}

static uint64_t box_numel(const struct tgen_layout *l, const int64_t *size) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < l->ndim; d++)
    n *= (uint64_t)size[d];
  return n;
}

/* The strides of a box of size laid out row-major, or with its axes in
 * reverse order (column-major). */
static void box_strides(const struct tgen_layout *l, const int64_t *size,
                        bool column_major, int64_t *stride) {
  int64_t s = 1;
  for (uint32_t k = 0; k < l->ndim; k++) {
    uint32_t d = column_major ? k : l->ndim - 1 - k;
    stride[d] = s;
    s *= size[d];
  }
}

/* Rank holds the box at origin of extent size, read from its shard at
 * src_offset with src_stride. */
static void add_piece(struct tgen_layout *l, uint32_t rank,
                      const int64_t *origin, const int64_t *size,
                      int64_t src_offset, const int64_t *src_stride,
                      const uint32_t *holders, uint32_t nholders) {
  struct affine_piece *p = &l->pieces[rank][l->npieces[rank]++];

  memset(p, 0, sizeof *p);
  p->ndim = l->ndim;
  p->src_offset = src_offset;
  for (uint32_t d = 0; d < l->ndim; d++) {
    p->shape[d] = size[d];
    p->src_stride[d] = src_stride[d];
    p->dst_stride[d] = l->fstride[d];
    p->dst_offset += origin[d] * l->fstride[d];
  }
  p->holders = holders;
  p->nholders = nholders;
}

/* A piece with a copy of its own in rank's shard. */
static void add_copy(struct tgen_layout *l, uint32_t rank,
                     const int64_t *origin, const int64_t *size,
                     bool column_major, const uint32_t *holders,
                     uint32_t nholders) {
  int64_t stride[3];
  box_strides(l, size, column_major, stride);
  add_piece(l, rank, origin, size, shard_take(l, rank, box_numel(l, size)),
            stride, holders, nholders);
}

/* Holders in ascending order: a random subset of at least two ranks. */
static uint32_t pick_replicas(struct tgen_layout *l, uint64_t *s,
                              const uint32_t **out) {
  uint32_t *h = &l->holders[l->nholders];
  uint32_t n = 0;

  while (n < 2) {
    n = 0;
    for (uint32_t r = 0; r < l->nranks; r++)
      if (rnd(s, 2))
        h[n++] = r;
  }
  l->nholders += n;
  *out = h;
  return n;
}

/* A replica holder that lists its box as two pieces, cut at `cut` along
 * dim: from two copies (dim 0), or from one whole copy read in two
 * column blocks (the last dim: strided sources). */
static void add_cut_replica(struct tgen_layout *l, uint32_t rank,
                            const int64_t *origin, const int64_t *size,
                            uint32_t dim, int64_t cut, const uint32_t *holders,
                            uint32_t n) {
  int64_t o2[3], s2[3];
  memcpy(o2, origin, sizeof o2);
  memcpy(s2, size, sizeof s2);
  s2[dim] = cut;
  if (dim == 0) {
    add_copy(l, rank, o2, s2, false, holders, n);
    o2[0] += cut;
    s2[0] = size[0] - cut;
    add_copy(l, rank, o2, s2, false, holders, n);
    return;
  }
  int64_t stride[3];
  box_strides(l, size, false, stride);
  int64_t at = shard_take(l, rank, box_numel(l, size));
  add_piece(l, rank, o2, s2, at, stride, holders, n);
  o2[dim] += cut;
  s2[dim] = size[dim] - cut;
  add_piece(l, rank, o2, s2, at + cut * stride[dim], stride, holders, n);
}

static void add_box(struct tgen_layout *l, uint64_t *s, const int64_t *origin,
                    const int64_t *size) {
  const uint32_t *holders;
  uint32_t n;

  if (rnd(s, 4) != 0) {
    uint32_t *h = &l->holders[l->nholders++];
    *h = (uint32_t)rnd(s, l->nranks);
    /* Some single holders keep their box column-major. */
    add_copy(l, *h, origin, size, rnd(s, 4) == 0, h, 1);
    return;
  }
  n = pick_replicas(l, s, &holders);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t r = holders[i];
    /* Some holders cut the replica at another boundary. */
    uint32_t dim = rnd(s, 2) ? 0 : l->ndim - 1;
    if (size[dim] >= 2 && rnd(s, 2))
      add_cut_replica(l, r, origin, size, dim,
                      1 + (int64_t)rnd(s, (uint64_t)size[dim] - 1), holders,
                      n);
    else
      add_copy(l, r, origin, size, false, holders, n);
  }
}

/* Uneven cut points along one dim: up to `parts` parts of random widths
 * (edge[0] = 0 < edge[1] < ... < edge[n] = dim); returns n. */
static uint32_t cuts(uint64_t *s, int64_t dim, uint32_t parts, int64_t *edge) {
  uint32_t n = 0;
  int64_t inner[8];

  for (uint32_t i = 0; i + 1 < parts && dim > 1; i++)
    inner[n++] = 1 + (int64_t)rnd(s, (uint64_t)dim - 1);
  for (uint32_t i = 1; i < n; i++)
    for (uint32_t j = i; j > 0 && inner[j - 1] > inner[j]; j--) {
      int64_t t = inner[j];
      inner[j] = inner[j - 1];
      inner[j - 1] = t;
    }
  edge[0] = 0;
  parts = 1;
  for (uint32_t i = 0; i < n; i++)
    if (inner[i] != edge[parts - 1])
      edge[parts++] = inner[i];
  edge[parts] = dim;
  return parts;
}

static void grid_layout(struct tgen_layout *l, uint64_t *s, int style) {
  int64_t edge[3][10];
  uint32_t n[3] = {1, 1, 1};
  int64_t origin[3], size[3];

  for (uint32_t d = 0; d < l->ndim; d++) {
    bool split = style == 2 || (style == 0 && d == 0) ||
                 (style == 1 && d == l->ndim - 1);
    /* A grid over every dim takes at most three parts per dim, so a rank
     * never holds more than TGEN_MAX_PIECES pieces. */
    uint32_t most = style == 2 ? 3 : l->nranks + 1;
    n[d] =
        cuts(s, l->shape[d], split ? 1 + (uint32_t)rnd(s, most) : 1, edge[d]);
  }
  for (uint32_t i = 0; i < n[0]; i++)
    for (uint32_t j = 0; j < n[1]; j++)
      for (uint32_t k = 0; k < (l->ndim == 3 ? n[2] : 1); k++) {
        uint32_t at[3] = {i, j, k};
        for (uint32_t d = 0; d < l->ndim; d++) {
          origin[d] = edge[d][at[d]];
          size[d] = edge[d][at[d] + 1] - edge[d][at[d]];
        }
        add_box(l, s, origin, size);
      }
}

/* Columns dealt round-robin over k ranks: destination stride k in the last
 * dim; rows optionally split in two. */
static void interleaved_layout(struct tgen_layout *l, uint64_t *s) {
  uint32_t last = l->ndim - 1;
  int64_t cols = l->shape[last];
  uint32_t k = 2 + (uint32_t)rnd(s, l->nranks - 1);
  int64_t rows_cut = l->shape[0] >= 2 && rnd(s, 2)
                         ? 1 + (int64_t)rnd(s, (uint64_t)l->shape[0] - 1)
                         : l->shape[0];

  for (int half = 0; half < 2; half++) {
    int64_t r0 = half == 0 ? 0 : rows_cut;
    int64_t r1 = half == 0 ? rows_cut : l->shape[0];
    if (r1 == r0)
      continue;
    for (uint32_t c = 0; c < k && c < cols; c++) {
      uint32_t *h = &l->holders[l->nholders++];
      int64_t origin[3] = {r0, 0, 0}, size[3];
      *h = (c + (uint32_t)half) % l->nranks;
      memcpy(size, l->shape, sizeof size);
      size[0] = r1 - r0;
      origin[last] = c;
      size[last] = (cols - c + k - 1) / k;
      add_copy(l, *h, origin, size, false, h, 1);
      l->pieces[*h][l->npieces[*h] - 1].dst_stride[last] = k;
    }
  }
}

/* Pieces in random order; the map over them. */
static void finish(struct tgen_layout *l, uint64_t *s) {
  for (uint32_t r = 0; r < l->nranks; r++) {
    for (size_t i = l->npieces[r]; i > 1; i--) {
      size_t j = (size_t)rnd(s, i);
      struct affine_piece t = l->pieces[r][i - 1];
      l->pieces[r][i - 1] = l->pieces[r][j];
      l->pieces[r][j] = t;
    }
  }
  for (uint32_t r = 0; r < l->nranks; r++)
    l->shards[r] =
        (struct affine_shard){l->shard_numel[r], l->npieces[r], l->pieces[r]};
  l->map = (struct affine_map){"p", l->ndim, l->shape, l->nranks, l->shards};
}

void tgen_generate(struct tgen_layout *l, uint64_t *s) {
  int64_t stride = 1;

  memset(l, 0, sizeof *l);
  l->nranks = 2 + (uint32_t)rnd(s, TGEN_MAX_RANKS - 1);
  l->ndim = 2 + (uint32_t)rnd(s, 2);
  for (uint32_t d = 0; d < l->ndim; d++)
    l->shape[d] = 1 + (int64_t)rnd(s, l->ndim == 2 ? 10 : 6);
  for (uint32_t d = l->ndim; d-- > 0;) {
    l->fstride[d] = stride;
    stride *= l->shape[d];
  }
  l->numel = (uint64_t)stride;
  if (rnd(s, 5) == 0)
    interleaved_layout(l, s);
  else
    grid_layout(l, s, (int)rnd(s, 3));
  finish(l, s);
}

void tgen_copy(struct tgen_layout *dst, const struct tgen_layout *src) {
  *dst = *src;
  for (uint32_t r = 0; r < dst->nranks; r++) {
    for (size_t i = 0; i < dst->npieces[r]; i++) {
      struct affine_piece *p = &dst->pieces[r][i];
      p->holders = dst->holders + (p->holders - src->holders);
    }
    dst->shards[r].pieces = dst->pieces[r];
  }
  dst->map.shards = dst->shards;
  dst->map.shape = dst->shape;
}

void tgen_corrupt(struct tgen_layout *l, uint64_t *s) {
  uint32_t r;
  struct affine_piece *p;
  int64_t *field, old, v;

  do
    r = (uint32_t)rnd(s, l->nranks);
  while (l->npieces[r] == 0);
  p = &l->pieces[r][rnd(s, l->npieces[r])];
  switch (rnd(s, 4)) {
  case 0:
    field = &p->src_offset;
    break;
  case 1:
    field = &p->dst_offset;
    break;
  case 2:
    field = &p->src_stride[rnd(s, p->ndim)];
    break;
  default:
    field = &p->dst_stride[rnd(s, p->ndim)];
    break;
  }
  old = *field;
  do {
    switch (rnd(s, 5)) {
    case 0:
      v = old + (rnd(s, 2) ? 1 : -1);
      break;
    case 1:
      v = old + (int64_t)rnd(s, l->numel + 1) - (int64_t)(l->numel / 2);
      break;
    case 2:
      v = 0;
      break;
    case 3:
      v = old * 2;
      break;
    default:
      v = l->fstride[rnd(s, l->ndim)] * (rnd(s, 2) ? 1 : -1) + old;
      break;
    }
  } while (v == old);
  *field = v;
}
