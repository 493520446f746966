/*
 * test_property.c - the corrupted-map property of seed 003.
 *
 * With a fixed seed, random layouts of 2-D and 3-D tensors over 2 to 8
 * ranks: row splits, column splits of uneven widths, block grids, replicas
 * (some holders cutting them at other boundaries), interleaved columns, and
 * pieces listed in random order.  Each rank's shard is built from the true
 * map; then one offset or stride of one piece is corrupted and the true
 * shards are rebuilt through the corrupted map.  Every corrupted map must
 * be refused or still rebuild bit-exact, and every true map must round-trip
 * (extract, then rebuild) exactly.
 */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/affine.h"
#include "tests/unit/plan/tjob.h"

#define LAYOUTS 2400
#define MAX_RANKS 8
#define MAX_PIECES 64
#define MAX_HOLDERS (MAX_RANKS * MAX_PIECES * MAX_RANKS)

struct layout {
  uint32_t nranks;
  uint32_t ndim;
  int64_t shape[3];
  int64_t fstride[3];
  uint64_t numel;
  uint64_t shard_numel[MAX_RANKS];
  size_t npieces[MAX_RANKS];
  struct affine_piece pieces[MAX_RANKS][MAX_PIECES];
  struct affine_shard shards[MAX_RANKS];
  struct affine_map map;
};

struct pool {
  uint32_t holders[MAX_HOLDERS];
  size_t used;
};

static uint64_t rnd(uint64_t *s, uint64_t n) { return tjob_rand(s) % n; }

static void add_piece(struct layout *l, uint32_t rank, const int64_t *origin,
                      const int64_t *size, const uint32_t *holders,
                      uint32_t nholders) {
  struct affine_piece *p = &l->pieces[rank][l->npieces[rank]++];
  int64_t stride = 1;
  uint64_t numel = 1;

  memset(p, 0, sizeof *p);
  p->ndim = l->ndim;
  p->src_offset = (int64_t)l->shard_numel[rank];
  for (uint32_t d = l->ndim; d-- > 0;) {
    p->shape[d] = size[d];
    p->src_stride[d] = stride;
    stride *= size[d];
    p->dst_stride[d] = l->fstride[d];
    p->dst_offset += origin[d] * l->fstride[d];
    numel *= (uint64_t)size[d];
  }
  p->holders = holders;
  p->nholders = nholders;
  l->shard_numel[rank] += numel;
}

/* Holders in ascending order: a random subset of at least two ranks. */
static uint32_t pick_replicas(struct layout *l, struct pool *pool, uint64_t *s,
                              const uint32_t **out) {
  uint32_t *h = &pool->holders[pool->used];
  uint32_t n = 0;

  while (n < 2) {
    n = 0;
    for (uint32_t r = 0; r < l->nranks; r++)
      if (rnd(s, 2))
        h[n++] = r;
  }
  pool->used += n;
  *out = h;
  return n;
}

static void add_box(struct layout *l, struct pool *pool, uint64_t *s,
                    const int64_t *origin, const int64_t *size) {
  const uint32_t *holders;
  uint32_t n;

  if (rnd(s, 4) != 0) {
    uint32_t *h = &pool->holders[pool->used++];
    *h = (uint32_t)rnd(s, l->nranks);
    add_piece(l, *h, origin, size, h, 1);
    return;
  }
  n = pick_replicas(l, pool, s, &holders);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t r = holders[i];
    /* Some holders cut the replica at another boundary along dim 0. */
    if (size[0] >= 2 && rnd(s, 2)) {
      int64_t cut = 1 + (int64_t)rnd(s, (uint64_t)size[0] - 1);
      int64_t o2[3], s2[3];
      memcpy(o2, origin, sizeof o2);
      memcpy(s2, size, sizeof s2);
      s2[0] = cut;
      add_piece(l, r, o2, s2, holders, n);
      o2[0] += cut;
      s2[0] = size[0] - cut;
      add_piece(l, r, o2, s2, holders, n);
    } else {
      add_piece(l, r, origin, size, holders, n);
    }
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

static void grid_layout(struct layout *l, struct pool *pool, uint64_t *s,
                        int style) {
  int64_t edge[3][10];
  uint32_t n[3] = {1, 1, 1};
  int64_t origin[3], size[3];

  for (uint32_t d = 0; d < l->ndim; d++) {
    bool split = style == 2 || (style == 0 && d == 0) ||
                 (style == 1 && d == l->ndim - 1);
    /* A grid over every dim takes at most three parts per dim, so a rank
     * never holds more than MAX_PIECES pieces. */
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
        add_box(l, pool, s, origin, size);
      }
}

/* Columns dealt round-robin over k ranks: destination stride k in the last
 * dim; rows optionally split in two. */
static void interleaved_layout(struct layout *l, uint64_t *s,
                               struct pool *pool) {
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
      uint32_t *h = &pool->holders[pool->used++];
      struct affine_piece *p;
      int64_t origin[3] = {r0, 0, 0}, size[3];
      *h = (c + (uint32_t)half) % l->nranks;
      memcpy(size, l->shape, sizeof size);
      size[0] = r1 - r0;
      origin[last] = c;
      size[last] = (cols - c + k - 1) / k;
      add_piece(l, *h, origin, size, h, 1);
      p = &l->pieces[*h][l->npieces[*h] - 1];
      p->dst_stride[last] = k;
    }
  }
}

static void finish(struct layout *l, uint64_t *s) {
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

static void generate(struct layout *l, struct pool *pool, uint64_t *s) {
  int64_t stride = 1;

  memset(l, 0, sizeof *l);
  pool->used = 0;
  l->nranks = 2 + (uint32_t)rnd(s, MAX_RANKS - 1);
  l->ndim = 2 + (uint32_t)rnd(s, 2);
  for (uint32_t d = 0; d < l->ndim; d++)
    l->shape[d] = 1 + (int64_t)rnd(s, l->ndim == 2 ? 10 : 6);
  for (uint32_t d = l->ndim; d-- > 0;) {
    l->fstride[d] = stride;
    stride *= l->shape[d];
  }
  l->numel = (uint64_t)stride;
  if (rnd(s, 5) == 0)
    interleaved_layout(l, s, pool);
  else
    grid_layout(l, pool, s, (int)rnd(s, 3));
  finish(l, s);
}

/* Changes one offset or stride of one piece to a different value. */
static void corrupt(struct layout *l, uint64_t *s) {
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

START_TEST(corrupted_maps_are_refused_or_exact) {
  static struct layout truth, bad;
  static struct pool pool;
  uint64_t seed = 0x5eed5eedu;
  unsigned refused = 0, exact = 0, wrong = 0, roundtrip_failed = 0;
  char msg[256];

  for (unsigned n = 0; n < LAYOUTS; n++) {
    size_t elsize = (size_t)1 << rnd(&seed, 4);
    uint8_t *full, *back, *shards[MAX_RANKS];
    int rc;

    generate(&truth, &pool, &seed);
    ck_assert_msg(affine_validate(&truth.map, msg, sizeof msg) == 0,
                  "layout %u: the true map is refused: %s", n, msg);
    full = malloc(truth.numel * elsize);
    back = malloc(truth.numel * elsize);
    for (uint64_t i = 0; i < truth.numel * elsize; i++)
      full[i] = (uint8_t)tjob_rand(&seed);
    for (uint32_t r = 0; r < truth.nranks; r++) {
      shards[r] = malloc(truth.shard_numel[r] * elsize + 1);
      ck_assert_int_eq(affine_extract(&truth.map, r, elsize, full, shards[r],
                                      msg, sizeof msg),
                       0);
    }
    rc = affine_rebuild(&truth.map, elsize, (const void *const *)shards, back,
                        msg, sizeof msg);
    roundtrip_failed += rc != 0 || memcmp(full, back, truth.numel * elsize);

    bad = truth;
    for (uint32_t r = 0; r < bad.nranks; r++)
      bad.shards[r].pieces = bad.pieces[r];
    bad.map.shards = bad.shards;
    bad.map.shape = bad.shape;
    corrupt(&bad, &seed);
    memset(back, 0, truth.numel * elsize);
    rc = affine_rebuild(&bad.map, elsize, (const void *const *)shards, back,
                        msg, sizeof msg);
    if (rc != 0)
      refused++;
    else if (memcmp(full, back, truth.numel * elsize) == 0)
      exact++;
    else
      wrong++;
    for (uint32_t r = 0; r < truth.nranks; r++)
      free(shards[r]);
    free(full);
    free(back);
  }
  printf("affine property: %u layouts, refused %u, exact %u, wrong %u\n",
         LAYOUTS, refused, exact, wrong);
  fflush(stdout);
  ck_assert_uint_eq(refused + exact + wrong, LAYOUTS);
  ck_assert_uint_eq(roundtrip_failed, 0);
  ck_assert_uint_eq(wrong, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-property");
  TCase *tc = tcase_create("property");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, corrupted_maps_are_refused_or_exact);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
