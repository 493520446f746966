/*
 * test_cover.c - the coverage sweep (daemon/plan/cover.c): what it costs,
 * in steps bounded by the boxes however many elements they reach, and what
 * it decides, against a count of writers per element on thousands of small
 * random layouts.
 */
#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"
#include "tests/unit/plan/tjob.h"

/* Steps allowed for the few boxes of a [4, C] key below, whatever C: a few
 * runs per box and row, and the attempts to skip between them.  Judging
 * run after run would take one step per element or more (33 million for
 * C = 2^23). */
#define FEW_STEPS 200u

#define MAX_BOXES 64

struct layout {
  size_t nboxes;
  int64_t offset[MAX_BOXES];
  uint32_t ndim[MAX_BOXES];
  int64_t shape[MAX_BOXES][SP_MAX_DIMS];
  int64_t stride[MAX_BOXES][SP_MAX_DIMS];
  bool shared[MAX_BOXES];
};

/* Adds a 2-D box: rows at row_stride, cols at col_stride, from offset. */
static void add2(struct layout *l, int64_t offset, int64_t rows,
                 int64_t row_stride, int64_t cols, int64_t col_stride,
                 bool shared) {
  size_t i = l->nboxes++;
  l->offset[i] = offset;
  l->ndim[i] = 2;
  l->shape[i][0] = rows;
  l->stride[i][0] = row_stride;
  l->shape[i][1] = cols;
  l->stride[i][1] = col_stride;
  l->shared[i] = shared;
}

static int check(const struct layout *l, uint64_t n, bool complete,
                 struct cover_defect *d, struct cover_work *work) {
  struct cover_box boxes[MAX_BOXES];
  for (size_t i = 0; i < l->nboxes; i++)
    boxes[i] = (struct cover_box){l->offset[i], l->ndim[i], l->shape[i],
                                  l->stride[i], l->shared[i]};
  return cover_check(boxes, l->nboxes, n, complete, NULL, d, work);
}

static const int widths[] = {23, 27, 31};

/* Column 0 of every row (runs a row apart) beside the other columns dealt
 * over two pieces (runs two apart): the long period must not stretch the
 * pattern of the short ones. */
static void column_and_dealt(struct layout *l, int64_t C) {
  memset(l, 0, sizeof *l);
  add2(l, 0, 4, C, 1, 1, false);
  add2(l, 1, 4, C, C / 2, 2, false);
  add2(l, 2, 4, C, C / 2 - 1, 2, false);
}

START_TEST(long_period_column_beside_dealt_columns_costs_its_pieces) {
  for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
    int64_t C = (int64_t)1 << widths[w];
    struct layout l;
    struct cover_defect d;
    struct cover_work work;

    column_and_dealt(&l, C);
    ck_assert_int_eq(check(&l, 4 * (uint64_t)C, true, &d, &work), 0);
    printf("cover: [4, 2^%d], column 0 and the others dealt over 2: %llu "
           "steps, %llu runs skipped\n",
           widths[w], (unsigned long long)work.steps,
           (unsigned long long)work.skipped);
    ck_assert_uint_le(work.steps, FEW_STEPS);
    ck_assert_uint_eq(work.steps + work.skipped >= 4 * (uint64_t)C, true);
  }
}
END_TEST

/* Half of every row in one piece, the other half dealt over two; then the
 * same as replicas of a whole copy dealt over two: the first half's long
 * runs end past where the dealt runs start, and are kept apart from them. */
START_TEST(half_rows_beside_dealt_half_cost_their_pieces) {
  for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
    int64_t C = (int64_t)1 << widths[w];
    for (int replicas = 0; replicas < 2; replicas++) {
      struct layout l = {0};
      struct cover_defect d;
      struct cover_work work;
      int64_t dealt_from = replicas ? 0 : C / 2;

      add2(&l, 0, 4, C, C / 2, 1, replicas);
      add2(&l, dealt_from, 4, C, (C - dealt_from) / 2, 2, replicas);
      add2(&l, dealt_from + 1, 4, C, (C - dealt_from) / 2, 2, replicas);
      ck_assert_int_eq(check(&l, 4 * (uint64_t)C, true, &d, &work), 0);
      printf("cover: [4, 2^%d], half rows beside %s: %llu steps\n",
             widths[w], replicas ? "replicas dealt over 2" : "a half dealt",
             (unsigned long long)work.steps);
      ck_assert_uint_le(work.steps, FEW_STEPS);
    }
  }
}
END_TEST

/* The first element held by nobody: refused at element 0 at once, and
 * without completeness (a shard's padding) accepted in a few steps. */
START_TEST(first_element_uncovered) {
  for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
    int64_t C = (int64_t)1 << widths[w];
    struct layout l = {0};
    struct cover_defect d;
    struct cover_work work;

    add2(&l, C, 3, C, 1, 1, false); /* column 0 of rows 1 to 3 */
    add2(&l, 1, 4, C, C / 2, 2, false);
    add2(&l, 2, 4, C, C / 2 - 1, 2, false);
    ck_assert_int_eq(check(&l, 4 * (uint64_t)C, true, &d, &work),
                     SP_EUNCOVERED);
    ck_assert_uint_eq(d.element, 0);
    ck_assert_uint_le(work.steps, FEW_STEPS);
    ck_assert_int_eq(check(&l, 4 * (uint64_t)C, false, &d, &work), 0);
    printf("cover: [4, 2^%d], element 0 uncovered: %llu steps unrefused\n",
           widths[w], (unsigned long long)work.steps);
    ck_assert_uint_le(work.steps, FEW_STEPS);
  }
}
END_TEST

/* A defect at the very last element, after every repeat was skipped: found
 * there, by the runs judged after the last skip. */
START_TEST(defect_at_the_last_element_found_past_the_skips) {
  for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
    int64_t C = (int64_t)1 << widths[w];
    uint64_t n = 4 * (uint64_t)C;
    struct layout l;
    struct cover_defect d;
    struct cover_work work;

    column_and_dealt(&l, C);
    add2(&l, (int64_t)n - 1, 1, 1, 1, 1, false);
    ck_assert_int_eq(check(&l, n, true, &d, &work), SP_EDOUBLEWRITE);
    ck_assert_uint_eq(d.element, n - 1);
    ck_assert_uint_eq(d.box, 1); /* the odd columns */
    ck_assert_uint_eq(d.other, 3);
    ck_assert_uint_le(work.steps, FEW_STEPS);

    column_and_dealt(&l, C);
    l.shape[2][0] = 3; /* the last row's even columns in a box of their own, */
    add2(&l, 3 * C + 2, 1, 1, C / 2 - 2, 2, false); /* but for the last */
    ck_assert_int_eq(check(&l, n, true, &d, &work), SP_EUNCOVERED);
    ck_assert_uint_eq(d.element, n - 2);
    ck_assert_uint_le(work.steps, FEW_STEPS);
  }
}
END_TEST

/* The oracle: one count of single and shared writers per element. */
static int count_writers(const struct layout *l, uint64_t n, bool complete,
                         uint64_t *element) {
  static uint8_t single[4096], replica[4096];
  uint64_t doubled = UINT64_MAX, uncovered = UINT64_MAX;

  memset(single, 0, n);
  memset(replica, 0, n);
  for (size_t i = 0; i < l->nboxes; i++) {
    uint64_t numel = 1;
    for (uint32_t k = 0; k < l->ndim[i]; k++)
      numel *= (uint64_t)l->shape[i][k];
    for (uint64_t e = 0; e < numel; e++) {
      uint64_t rest = e, at = (uint64_t)l->offset[i];
      for (uint32_t k = l->ndim[i]; k-- > 0;) {
        at += rest % (uint64_t)l->shape[i][k] * (uint64_t)l->stride[i][k];
        rest /= (uint64_t)l->shape[i][k];
      }
      (l->shared[i] ? replica : single)[at]++;
    }
  }
  for (uint64_t e = 0; e < n; e++) {
    if (doubled == UINT64_MAX &&
        (single[e] > 1 || (single[e] == 1 && replica[e] > 0)))
      doubled = e;
    if (uncovered == UINT64_MAX && single[e] == 0 && replica[e] == 0)
      uncovered = e;
  }
  if (!complete)
    uncovered = UINT64_MAX;
  if (doubled == UINT64_MAX && uncovered == UINT64_MAX)
    return 0;
  *element = doubled < uncovered ? doubled : uncovered;
  return doubled < uncovered ? SP_EDOUBLEWRITE : SP_EUNCOVERED;
}

/* Whether box i reaches element e. */
static bool reaches(const struct layout *l, size_t i, uint64_t e) {
  uint64_t numel = 1;
  for (uint32_t k = 0; k < l->ndim[i]; k++)
    numel *= (uint64_t)l->shape[i][k];
  for (uint64_t x = 0; x < numel; x++) {
    uint64_t rest = x, at = (uint64_t)l->offset[i];
    for (uint32_t k = l->ndim[i]; k-- > 0;) {
      at += rest % (uint64_t)l->shape[i][k] * (uint64_t)l->stride[i][k];
      rest /= (uint64_t)l->shape[i][k];
    }
    if (at == e)
      return true;
  }
  return false;
}

static uint64_t rnd(uint64_t *s, uint64_t n) { return tjob_rand(s) % n; }

/* One axis of the tensor cut into selections: blocks, or indices dealt
 * round-robin over k. */
struct cut {
  size_t n;
  int64_t start[8], count[8], step[8];
};

static void cut_axis(struct cut *c, int64_t dim, uint64_t *seed) {
  uint64_t mode = rnd(seed, 3);
  c->n = 0;
  if (mode == 1 && dim >= 2) {
    int64_t k = 2 + (int64_t)rnd(seed, dim < 4 ? (uint64_t)dim - 1 : 3);
    for (int64_t r = 0; r < k; r++)
      c->start[c->n] = r, c->count[c->n] = (dim - r + k - 1) / k,
      c->step[c->n++] = k;
    return;
  }
  if (mode == 2 && dim >= 2) {
    int64_t at = 0;
    while (at < dim && c->n < 3) {
      int64_t len = 1 + (int64_t)rnd(seed, (uint64_t)(dim - at));
      if (c->n == 2)
        len = dim - at;
      c->start[c->n] = at, c->count[c->n] = len, c->step[c->n++] = 1;
      at += len;
    }
    return;
  }
  c->start[0] = 0, c->count[0] = dim, c->step[0] = 1, c->n = 1;
}

/* An exact cover of a random tensor's elements (its axes cut in blocks or
 * dealt round-robin, each box's axes listed in any order), some boxes
 * doubled as replicas, then perhaps one change: a box dropped or repeated,
 * an offset or a stride moved, a replica made single.  Changes that leave
 * [0, n) or make a box reach an element twice are drawn again. */
static uint64_t draw(struct layout *l, uint64_t *seed) {
  uint32_t ndim = 1 + (uint32_t)rnd(seed, 3);
  int64_t dim[3], fstride[3], s = 1;
  struct cut cuts[3];
  uint64_t n;

  for (uint32_t k = 0; k < ndim; k++)
    dim[k] = 1 + (int64_t)rnd(seed, k + 1 == ndim ? 96 : 5);
  for (uint32_t k = ndim; k-- > 0;)
    fstride[k] = s, s *= dim[k];
  n = (uint64_t)s;
  for (uint32_t k = 0; k < ndim; k++)
    cut_axis(&cuts[k], dim[k], seed);
  memset(l, 0, sizeof *l);
  size_t total = 1;
  for (uint32_t k = 0; k < ndim; k++)
    total *= cuts[k].n;
  for (size_t b = 0; b < total && l->nboxes < MAX_BOXES / 2; b++) {
    size_t i = l->nboxes++, rest = b;
    uint32_t perm[3] = {0, 1, 2};
    for (uint32_t k = ndim; k > 1; k--) {
      uint32_t j = (uint32_t)rnd(seed, k), t = perm[k - 1];
      perm[k - 1] = perm[j], perm[j] = t;
    }
    l->ndim[i] = ndim;
    for (uint32_t d = 0; d < ndim; d++) {
      size_t c = rest % cuts[d].n;
      rest /= cuts[d].n;
      l->offset[i] += cuts[d].start[c] * fstride[d];
      l->shape[i][perm[d]] = cuts[d].count[c];
      l->stride[i][perm[d]] = cuts[d].step[c] * fstride[d];
    }
  }
  /* Replicas: a box and a copy of it, or of its two halves. */
  for (size_t r = rnd(seed, 3); r > 0 && l->nboxes + 2 < MAX_BOXES; r--) {
    size_t i = rnd(seed, l->nboxes), j = l->nboxes++;
    uint32_t a = (uint32_t)rnd(seed, l->ndim[i]);
    l->shared[i] = true;
    l->offset[j] = l->offset[i];
    l->ndim[j] = l->ndim[i];
    memcpy(l->shape[j], l->shape[i], sizeof l->shape[j]);
    memcpy(l->stride[j], l->stride[i], sizeof l->stride[j]);
    l->shared[j] = true;
    if (l->shape[i][a] >= 2 && rnd(seed, 2) == 0) {
      size_t h = l->nboxes++;
      int64_t first = l->shape[i][a] / 2;
      l->offset[h] = l->offset[j] + first * l->stride[j][a];
      l->ndim[h] = l->ndim[j];
      memcpy(l->shape[h], l->shape[j], sizeof l->shape[h]);
      memcpy(l->stride[h], l->stride[j], sizeof l->stride[h]);
      l->shape[h][a] -= first;
      l->shape[j][a] = first;
      l->shared[h] = true;
    }
  }
  /* A replica of a stretch of the tensor in one run, over every box it
   * meets made a replica too: long runs across the others' repeats. */
  if (rnd(seed, 3) == 0 && l->nboxes < MAX_BOXES) {
    size_t j = l->nboxes++;
    int64_t from = (int64_t)rnd(seed, n), len = 1 + (int64_t)rnd(seed, n);
    if (from + len > (int64_t)n)
      len = (int64_t)n - from;
    l->offset[j] = from;
    l->ndim[j] = 1;
    l->shape[j][0] = len;
    l->stride[j][0] = 1;
    l->shared[j] = true;
    for (size_t i = 0; i < j; i++) {
      int64_t lo = l->offset[i], hi = l->offset[i];
      for (uint32_t k = 0; k < l->ndim[i]; k++)
        hi += (l->shape[i][k] - 1) * l->stride[i][k];
      if (lo < from + len && hi >= from)
        l->shared[i] = true;
    }
  }
  for (int tries = 0; tries < 16; tries++) {
    struct layout t = *l;
    size_t i = rnd(seed, t.nboxes);
    uint32_t a = (uint32_t)rnd(seed, t.ndim[i]);
    int64_t delta = rnd(seed, 2) ? 1 + (int64_t)rnd(seed, 3)
                                 : -1 - (int64_t)rnd(seed, 3);
    bool valid = true;
    switch (rnd(seed, 7)) {
    case 0: /* unchanged */
    case 1:
      return n;
    case 2:
      t.offset[i] = t.offset[t.nboxes - 1];
      t.ndim[i] = t.ndim[t.nboxes - 1];
      memcpy(t.shape[i], t.shape[t.nboxes - 1], sizeof t.shape[i]);
      memcpy(t.stride[i], t.stride[t.nboxes - 1], sizeof t.stride[i]);
      t.shared[i] = t.shared[t.nboxes - 1];
      t.nboxes--;
      break;
    case 3:
      if (t.nboxes == MAX_BOXES)
        continue;
      t.offset[t.nboxes] = t.offset[i];
      t.ndim[t.nboxes] = t.ndim[i];
      memcpy(t.shape[t.nboxes], t.shape[i], sizeof t.shape[i]);
      memcpy(t.stride[t.nboxes], t.stride[i], sizeof t.stride[i]);
      t.shared[t.nboxes] = false;
      t.nboxes++;
      break;
    case 4:
      t.offset[i] += delta;
      break;
    case 5:
      t.stride[i][a] += delta;
      break;
    default:
      t.shared[i] = false;
      break;
    }
    for (size_t b = 0; b < t.nboxes && valid; b++) {
      uint64_t extent;
      for (uint32_t k = 0; k < t.ndim[b]; k++)
        valid = valid && t.stride[b][k] > 0;
      valid = valid && t.offset[b] >= 0 &&
              sp__view_check_overlap(t.ndim[b], t.shape[b], t.stride[b]) == 0 &&
              sp__view_extent(t.ndim[b], t.shape[b], t.stride[b], t.offset[b],
                              &extent) == 0 &&
              extent <= n;
    }
    if (valid && t.nboxes > 0) {
      *l = t;
      return n;
    }
  }
  return n;
}

START_TEST(sweep_agrees_with_a_count_per_element) {
  const unsigned layouts = 6000;
  unsigned verdicts[3] = {0}, disagreements = 0, skipping = 0;
  uint64_t seed = 10, steps = 0, skipped = 0;

  for (unsigned t = 0; t < layouts; t++) {
    struct layout l;
    uint64_t n = draw(&l, &seed);
    for (int complete = 1; complete >= 0; complete--) {
      struct cover_defect d;
      struct cover_work work;
      uint64_t element = 0;
      int want = count_writers(&l, n, complete, &element);
      int got = check(&l, n, complete, &d, &work);
      bool agree = got == want && (want == 0 || d.element == element);
      if (agree && got == SP_EDOUBLEWRITE)
        agree = d.box < d.other && d.other < l.nboxes &&
                !(l.shared[d.box] && l.shared[d.other]) &&
                reaches(&l, d.box, element) && reaches(&l, d.other, element);
      if (!agree) {
        if (disagreements++ < 5)
          fprintf(stderr,
                  "layout %u (complete %d): sweep %d at %llu, count %d at "
                  "%llu\n",
                  t, complete, got, (unsigned long long)d.element, want,
                  (unsigned long long)element);
        continue;
      }
      if (!complete)
        continue;
      verdicts[want == 0 ? 0 : want == SP_EDOUBLEWRITE ? 1 : 2]++;
      steps += work.steps;
      skipped += work.skipped;
      skipping += work.skipped > 0;
    }
  }
  printf("cover oracle: %u layouts, %u accepted, %u overlapping, "
         "%u uncovered; %u skipped %llu runs in %llu steps; "
         "%u disagreements\n",
         layouts, verdicts[0], verdicts[1], verdicts[2], skipping,
         (unsigned long long)skipped, (unsigned long long)steps,
         disagreements);
  ck_assert_uint_eq(disagreements, 0);
  for (int v = 0; v < 3; v++)
    ck_assert_uint_ge(verdicts[v], layouts / 10);
  ck_assert_uint_ge(skipping, layouts / 10);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-cover");
  TCase *tc = tcase_create("cover");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, long_period_column_beside_dealt_columns_costs_its_pieces);
  tcase_add_test(tc, half_rows_beside_dealt_half_cost_their_pieces);
  tcase_add_test(tc, first_element_uncovered);
  tcase_add_test(tc, defect_at_the_last_element_found_past_the_skips);
  tcase_add_test(tc, sweep_agrees_with_a_count_per_element);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
