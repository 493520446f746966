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
 *
 * The checks themselves sweep the pieces (daemon/plan/cover.c) instead of
 * keeping a record per element, so they are held to an oracle that counts
 * every element: on those layouts, on taller ones (residue classes of mixed
 * periods, hundreds of rows), and on both blown up to 2^47 elements, where
 * the verdict must be the small layout's.  The across-nodes suite runs
 * the tgen.h layouts through two daemons (tests/integration/nodes/test_property.c).
 */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/plan/affine.h"
#include "shardport.h"
#include "tests/unit/plan/oracle.h"
#include "tests/unit/plan/tgen.h"
#include "tests/unit/plan/tjob.h"

#define LAYOUTS 2400
#define MAX_RANKS 8
#define MAX_PIECES 64
#define MAX_HOLDERS (MAX_RANKS * MAX_PIECES * MAX_RANKS)
#define SWEEP_LAYOUTS 3000
#define LARGE_LAYOUTS 1000

/* Room for one more dim than generated: blow_up() adds one. */
#define LAYOUT_DIMS 4

struct layout {
  uint32_t nranks;
  uint32_t ndim;
  int64_t shape[LAYOUT_DIMS];
  int64_t fstride[LAYOUT_DIMS];
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

/* Columns partitioned into residue classes of mixed moduli (0 mod 2, 1 mod
 * 4, 3 mod 4, ...): destination strides of several periods meeting in one
 * row, each class a piece (or replicas) over the rows, which may be cut in
 * two. */
static void residue_split(struct layout *l, struct pool *pool, uint64_t *s,
                          int64_t first, int64_t step, int depth,
                          int64_t rows_cut) {
  uint32_t last = l->ndim - 1;
  int64_t cols = l->shape[last];

  if (first >= cols)
    return;
  if (depth < 4 && step * 3 <= cols && rnd(s, 3) != 0) {
    int64_t m = 2 + (int64_t)rnd(s, 2);
    for (int64_t i = 0; i < m; i++)
      residue_split(l, pool, s, first + i * step, step * m, depth + 1,
                    rows_cut);
    return;
  }
  for (int half = 0; half < 2; half++) {
    int64_t r0 = half == 0 ? 0 : rows_cut;
    int64_t r1 = half == 0 ? rows_cut : l->shape[0];
    int64_t origin[LAYOUT_DIMS] = {r0, 0, 0}, size[LAYOUT_DIMS];
    size_t before[MAX_RANKS];
    if (r1 == r0)
      continue;
    memcpy(size, l->shape, sizeof size);
    size[0] = r1 - r0;
    origin[last] = first;
    size[last] = (cols - first + step - 1) / step;
    memcpy(before, l->npieces, sizeof before);
    add_box(l, pool, s, origin, size);
    for (uint32_t r = 0; r < l->nranks; r++)
      for (size_t i = before[r]; i < l->npieces[r]; i++)
        l->pieces[r][i].dst_stride[last] = step;
  }
}

static void residue_layout(struct layout *l, struct pool *pool, uint64_t *s) {
  int64_t rows_cut = l->shape[0] >= 2 && rnd(s, 2)
                         ? 1 + (int64_t)rnd(s, (uint64_t)l->shape[0] - 1)
                         : l->shape[0];
  residue_split(l, pool, s, 0, 1, 0, rows_cut);
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

static void set_shape(struct layout *l, uint32_t ndim, const int64_t *shape) {
  int64_t stride = 1;

  l->ndim = ndim;
  memcpy(l->shape, shape, ndim * sizeof *shape);
  for (uint32_t d = l->ndim; d-- > 0;) {
    l->fstride[d] = stride;
    stride *= l->shape[d];
  }
  l->numel = (uint64_t)stride;
}

/* Taller and more varied than generate(): up to 300 rows of up to 64
 * columns, or (30, 8, 8); columns split, interleaved or in residue classes
 * of mixed moduli; block grids.  Many runs of one period in a row, so the
 * sweep's skipping is exercised. */
static void generate_wide(struct layout *l, struct pool *pool, uint64_t *s) {
  int64_t shape[3];

  memset(l, 0, sizeof *l);
  pool->used = 0;
  l->nranks = 2 + (uint32_t)rnd(s, MAX_RANKS - 1);
  if (rnd(s, 2)) {
    shape[0] = 1 + (int64_t)rnd(s, 300);
    shape[1] = 1 + (int64_t)rnd(s, 64);
    set_shape(l, 2, shape);
  } else {
    shape[0] = 1 + (int64_t)rnd(s, 30);
    shape[1] = 1 + (int64_t)rnd(s, 8);
    shape[2] = 1 + (int64_t)rnd(s, 8);
    set_shape(l, 3, shape);
  }
  switch (rnd(s, 4)) {
  case 0:
    interleaved_layout(l, s, pool);
    break;
  case 1:
    residue_layout(l, pool, s);
    break;
  default:
    grid_layout(l, pool, s, (int)rnd(s, 3));
    break;
  }
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

/* The verdict of the rules counted element by element, in the order the
 * planner checks: each rank's pieces on their own, then the shard elements
 * its pieces read, then every destination.  The oracle the sweep is held
 * to; PIECE_REFUSED covers the per-piece checks (holders, strides, bounds),
 * which the sweep never sees. */
#define PIECE_REFUSED 1

struct verdict {
  int code;
  bool source; /* a shard element read twice, rather than a destination */
  uint64_t element;
};

static bool side_ok(const struct affine_piece *p, int64_t offset,
                    const int64_t *stride, uint64_t limit) {
  uint64_t numel, extent;

  if (offset < 0)
    return false;
  for (uint32_t d = 0; d < p->ndim; d++)
    if (stride[d] < 0)
      return false;
  if (sp__view_check_overlap(p->ndim, p->shape, stride) != 0)
    return false;
  sp__view_numel(p->ndim, p->shape, &numel);
  return numel == 0 ||
         (sp__view_extent(p->ndim, p->shape, stride, offset, &extent) == 0 &&
          extent <= limit);
}

static bool piece_ok(const struct affine_map *m, uint32_t r,
                     const struct affine_piece *p, uint64_t full) {
  uint64_t numel;
  bool own = false;

  if (p->ndim > SP_MAX_DIMS || sp__view_numel(p->ndim, p->shape, &numel) != 0)
    return false;
  for (uint32_t h = 0; h < p->nholders; h++) {
    if (p->holders[h] >= m->nranks ||
        (h > 0 && p->holders[h] <= p->holders[h - 1]))
      return false;
    own = own || p->holders[h] == r;
  }
  return own && side_ok(p, p->src_offset, p->src_stride, m->shards[r].numel) &&
         side_ok(p, p->dst_offset, p->dst_stride, full);
}

/* Calls visit(arg, src, dst) for every element of a piece. */
static void each_element(const struct affine_piece *p,
                         void (*visit)(void *, uint64_t, uint64_t), void *arg) {
  int64_t idx[SP_MAX_DIMS] = {0};
  uint64_t numel;

  sp__view_numel(p->ndim, p->shape, &numel);
  for (uint64_t i = 0; i < numel; i++) {
    uint64_t src = (uint64_t)p->src_offset, dst = (uint64_t)p->dst_offset;
    for (uint32_t d = 0; d < p->ndim; d++) {
      src += (uint64_t)(idx[d] * p->src_stride[d]);
      dst += (uint64_t)(idx[d] * p->dst_stride[d]);
    }
    visit(arg, src, dst);
    for (uint32_t d = p->ndim; d-- > 0;)
      if (++idx[d] < p->shape[d])
        break;
      else
        idx[d] = 0;
  }
}

static void count_src(void *arg, uint64_t src, uint64_t dst) {
  (void)dst;
  ((uint32_t *)arg)[src]++;
}

struct writers {
  uint32_t *single, *replica;
  bool shared;
};

static void count_dst(void *arg, uint64_t src, uint64_t dst) {
  struct writers *w = arg;
  (void)src;
  (w->shared ? w->replica : w->single)[dst]++;
}

static struct verdict oracle(const struct affine_map *m) {
  struct verdict v = {0, false, 0};
  uint64_t full;
  struct writers w;

  sp__view_numel(m->ndim, m->shape, &full);
  for (uint32_t r = 0; r < m->nranks; r++) {
    const struct affine_shard *sh = &m->shards[r];
    uint32_t *reads;
    for (size_t i = 0; i < sh->npieces; i++)
      if (!piece_ok(m, r, &sh->pieces[i], full))
        return (struct verdict){PIECE_REFUSED, false, 0};
    reads = calloc(sh->numel + 1, sizeof *reads);
    for (size_t i = 0; i < sh->npieces; i++)
      each_element(&sh->pieces[i], count_src, reads);
    for (uint64_t e = 0; e < sh->numel && v.code == 0; e++)
      if (reads[e] > 1)
        v = (struct verdict){SP_EDOUBLEWRITE, true, e};
    free(reads);
    if (v.code != 0)
      return v;
  }
  w.single = calloc(full + 1, sizeof *w.single);
  w.replica = calloc(full + 1, sizeof *w.replica);
  for (uint32_t r = 0; r < m->nranks; r++)
    for (size_t i = 0; i < m->shards[r].npieces; i++) {
      w.shared = m->shards[r].pieces[i].nholders > 1;
      each_element(&m->shards[r].pieces[i], count_dst, &w);
    }
  for (uint64_t e = 0; e < full && v.code == 0; e++) {
    uint32_t all = w.single[e] + w.replica[e];
    if (all == 0)
      v = (struct verdict){SP_EUNCOVERED, false, e};
    else if (w.single[e] > 0 && all > 1)
      v = (struct verdict){SP_EDOUBLEWRITE, false, e};
  }
  free(w.single);
  free(w.replica);
  return v;
}

/* What a refusal of v says about its element: "reads element 7 of its
 * shard" or "element [1, 2]"; the small layout's index with trail appended
 * (", 0" for a blown-up layout's added dim). */
static void element_text(const struct affine_map *m, struct verdict v,
                         uint64_t scale, const char *trail, char *buf,
                         size_t len) {
  uint64_t idx[SP_MAX_DIMS], flat = v.element;
  size_t used;

  if (v.source) {
    snprintf(buf, len, "reads element %llu of its shard",
             (unsigned long long)(flat * scale));
    return;
  }
  for (uint32_t d = m->ndim; d-- > 0;) {
    idx[d] = flat % (uint64_t)m->shape[d];
    flat /= (uint64_t)m->shape[d];
  }
  used = (size_t)snprintf(buf, len, "element [");
  for (uint32_t d = 0; d < m->ndim; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu",
                             d > 0 ? ", " : "", (unsigned long long)idx[d]);
  snprintf(buf + used, len - used, "%s]", trail);
}

static bool piece_code(int rc) {
  return rc != 0 && rc != SP_EDOUBLEWRITE && rc != SP_EUNCOVERED;
}

/* affine_validate on m agrees with the verdict v found on small (m itself,
 * or small blown up by scale): the same code and, for a fault in the
 * layout, the same first element. */
static void expect_verdict(const struct affine_map *m,
                           const struct affine_map *small, struct verdict v,
                           uint64_t scale, unsigned n, const char *what) {
  char msg[512], text[128];
  int rc = affine_validate(m, msg, sizeof msg);

  if (v.code == PIECE_REFUSED) {
    ck_assert_msg(piece_code(rc),
                  "layout %u (%s): a piece breaks the rules but the sweep "
                  "says %s: %s",
                  n, what, rc == 0 ? "ok" : sp_err_name(rc), msg);
    return;
  }
  ck_assert_msg(rc == v.code,
                "layout %u (%s): the sweep says %s (%s), counting elements "
                "says %s",
                n, what, rc == 0 ? "ok" : sp_err_name(rc), rc == 0 ? "" : msg,
                v.code == 0 ? "ok" : sp_err_name(v.code));
  if (rc == 0)
    return;
  element_text(small, v, scale, scale > 1 ? ", 0" : "", text, sizeof text);
  ck_assert_msg(strstr(msg, text) != NULL,
                "layout %u (%s): expected \"%s\" in: %s", n, what, text, msg);
}

/* The same layout with each element grown into f consecutive ones: a last
 * dim of f in the full tensor, in every shard and in every piece.  Its
 * verdict is the small layout's at f times the elements. */
static void blow_up(const struct layout *small, int64_t f, struct layout *big) {
  int64_t shape[LAYOUT_DIMS];

  memset(big, 0, sizeof *big);
  big->nranks = small->nranks;
  memcpy(shape, small->shape, sizeof shape);
  shape[small->ndim] = f;
  set_shape(big, small->ndim + 1, shape);
  for (uint32_t r = 0; r < small->nranks; r++) {
    big->shard_numel[r] = small->shard_numel[r] * (uint64_t)f;
    big->npieces[r] = small->npieces[r];
    for (size_t i = 0; i < small->npieces[r]; i++) {
      const struct affine_piece *p = &small->pieces[r][i];
      struct affine_piece *q = &big->pieces[r][i];
      *q = *p;
      q->ndim = p->ndim + 1;
      q->shape[p->ndim] = f;
      q->src_offset = p->src_offset * f;
      q->dst_offset = p->dst_offset * f;
      for (uint32_t d = 0; d < p->ndim; d++) {
        q->src_stride[d] = p->src_stride[d] * f;
        q->dst_stride[d] = p->dst_stride[d] * f;
      }
      q->src_stride[p->ndim] = 1;
      q->dst_stride[p->ndim] = 1;
    }
    big->shards[r] = (struct affine_shard){big->shard_numel[r], big->npieces[r],
                                           big->pieces[r]};
  }
  big->map = (struct affine_map){"p",         big->ndim,   big->shape,
                                 big->nranks, big->shards, NULL};
}

/* A copy whose pieces can be corrupted without touching the original. */
static void copy_layout(const struct layout *from, struct layout *to) {
  *to = *from;
  for (uint32_t r = 0; r < to->nranks; r++)
    to->shards[r].pieces = to->pieces[r];
  to->map.shards = to->shards;
  to->map.shape = to->shape;
}

START_TEST(corrupted_maps_are_refused_or_exact) {
  static struct tgen_layout truth, bad;
  uint64_t seed = 0x5eed5eedu;
  unsigned refused = 0, exact = 0, wrong = 0, roundtrip_failed = 0;
  char msg[256];

  for (unsigned n = 0; n < LAYOUTS; n++) {
    size_t elsize = (size_t)1 << (tjob_rand(&seed) % 4);
    uint8_t *full, *back, *shards[TGEN_MAX_RANKS];
    int rc;

    tgen_generate(&truth, &seed);
    ck_assert_msg(affine_validate(&truth.map, msg, sizeof msg) == 0,
                  "layout %u: the true map is refused: %s", n, msg);
    full = malloc(truth.numel * elsize);
    back = malloc(truth.numel * elsize);
    for (uint64_t i = 0; i < truth.numel * elsize; i++)
      full[i] = (uint8_t)tjob_rand(&seed);
    for (uint32_t r = 0; r < truth.nranks; r++) {
      shards[r] = malloc(truth.shard_numel[r] * elsize + 1);
      ck_assert_int_eq(oracle_extract(&truth.map, r, elsize, full, shards[r],
                                      msg, sizeof msg),
                       0);
    }
    rc = oracle_rebuild(&truth.map, elsize, (const void *const *)shards, back,
                        msg, sizeof msg);
    roundtrip_failed += rc != 0 || memcmp(full, back, truth.numel * elsize);

    tgen_copy(&bad, &truth);
    tgen_corrupt(&bad, &seed);
    memset(back, 0, truth.numel * elsize);
    rc = oracle_rebuild(&bad.map, elsize, (const void *const *)shards, back,
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

/* The sweep decides exactly what counting every element decides, first
 * element included, on true maps and on maps with one field corrupted,
 * for the layouts above and taller ones with many runs per period. */
START_TEST(sweep_agrees_with_counting_elements) {
  static struct layout truth, bad;
  static struct pool pool;
  uint64_t seed = 0xc0ffee11u;
  unsigned faults = 0;

  for (unsigned n = 0; n < SWEEP_LAYOUTS; n++) {
    if (n % 2 == 0)
      generate(&truth, &pool, &seed);
    else
      generate_wide(&truth, &pool, &seed);
    expect_verdict(&truth.map, &truth.map, oracle(&truth.map), 1, n, "true");
    for (int c = 0; c < 3; c++) {
      struct verdict v;
      copy_layout(&truth, &bad);
      corrupt(&bad, &seed);
      v = oracle(&bad.map);
      faults += v.code == SP_EDOUBLEWRITE || v.code == SP_EUNCOVERED;
      expect_verdict(&bad.map, &bad.map, v, 1, n, "corrupted");
    }
  }
  printf("affine sweep: %u layouts, %u corrupted, %u faults in the layout, "
         "all decided as counting decides\n",
         SWEEP_LAYOUTS, 3 * SWEEP_LAYOUTS, faults);
  fflush(stdout);
}
END_TEST

/* The same layouts with every element grown into 2^34: tensors of up to
 * 2^47 elements, which no per-element record could hold, are decided as
 * their small originals are, from the pieces alone. */
START_TEST(large_sparse_layouts_decided_as_small_ones) {
  static struct layout truth, bad, big;
  static struct pool pool;
  const int64_t f = (int64_t)1 << 34;
  uint64_t seed = 0x1a5e5eedu;

  for (unsigned n = 0; n < LARGE_LAYOUTS; n++) {
    struct verdict v;
    if (n % 2 == 0)
      generate(&truth, &pool, &seed);
    else
      generate_wide(&truth, &pool, &seed);
    blow_up(&truth, f, &big);
    expect_verdict(&big.map, &truth.map, oracle(&truth.map), (uint64_t)f, n,
                   "true, 2^34 times larger");
    copy_layout(&truth, &bad);
    corrupt(&bad, &seed);
    v = oracle(&bad.map);
    blow_up(&bad, f, &big);
    expect_verdict(&big.map, &bad.map, v, (uint64_t)f, n,
                   "corrupted, 2^34 times larger");
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-property");
  TCase *tc = tcase_create("property");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, corrupted_maps_are_refused_or_exact);
  tcase_add_test(tc, sweep_agrees_with_counting_elements);
  tcase_add_test(tc, large_sparse_layouts_decided_as_small_ones);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
