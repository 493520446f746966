/*
 * cover.c - how a set of strided boxes reaches the elements of [0, n): no
 * element reached by two boxes unless both are shared (replicas) and, when
 * asked, no element left out.  Decided exactly, in memory proportional to
 * the boxes and never to n: the tensors checked may be sparse files of
 * terabytes (docs/planner.md, "Affine layouts").
 *
 * A box is normalised into
 *   runs   `run` consecutive elements (its stride-1 axes merged),
 *   a comb `count` runs, `period` elements apart (its next axis),
 *   outer  the odometer of its remaining axes, stepping comb to comb.
 * The caller has refused every box that reaches one element twice
 * (sp__view_check_overlap: each stride clears what the axes below reach),
 * so a box's combs, and a comb's runs, come in increasing order without
 * overlapping.
 *
 * The sweep visits every run of every box in order of its first element,
 * taken from two heaps: boxes whose next run opens a comb (pending) and
 * boxes inside a comb (active).  Two maxima decide each run as it comes:
 * the furthest end of any run so far and of any unshared run.  A run that
 * starts before the unshared end, or an unshared run that starts before
 * the end of any run, overlaps the run that reached that far; a run that
 * starts past the end of every run leaves a gap.  The first defect found
 * is the one at the lowest element, in whatever order the boxes come.
 *
 * Runs can be as many as elements (columns dealt round-robin), so the
 * sweep also skips what repeats (sweep_try_skip): the combs in progress of
 * the shortest periods repeat with the least common multiple L of their
 * periods, from the point W where nothing else left a trace (the ends of
 * closed combs, kept apart, and the runs of the other combs in progress)
 * up to the next comb to open, close, or run of another comb.  Once two
 * whole L past W are swept, every later run before that horizon is judged
 * as its copy a period before it was: the pattern's combs and both maxima
 * move forward by as many L as fit.  A comb of a long period in progress
 * (one column of every row) is left out of the pattern of the short ones
 * (the other columns dealt round-robin) instead of stretching it to its
 * own period.  A row, column or block split of any height then costs a few
 * runs per box, interleaved columns a few runs per row and box; attempts
 * come after as many runs as there are combs in progress, and twice as
 * far apart after each that finds nothing to skip, so they at most double
 * the runs of a pattern that never repeats.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

/* How many steps the sweep takes between two looks at the stop flag. */
#define STOP_EVERY 4096u

struct box {
  uint64_t run;    /* elements of one run */
  uint64_t period; /* between the runs of a comb; 0 when count is 1 */
  uint64_t count;  /* runs per comb */
  uint32_t nouter;
  uint64_t outer_count[SP_MAX_DIMS];
  uint64_t outer_stride[SP_MAX_DIMS]; /* ascending */
  /* Where the sweep is in it. */
  uint64_t outer_idx[SP_MAX_DIMS];
  uint64_t comb; /* the current comb's first element */
  uint64_t next; /* the run of the current comb visited next */
  bool shared;
};

struct heap_entry {
  uint64_t key; /* the first element of the box's next run */
  uint32_t box;
};

struct heap {
  struct heap_entry *e;
  size_t n;
};

static bool entry_less(struct heap_entry a, struct heap_entry b) {
  return a.key < b.key || (a.key == b.key && a.box < b.box);
}

static void heap_push(struct heap *h, struct heap_entry x) {
  size_t i = h->n++;
  while (i > 0 && entry_less(x, h->e[(i - 1) / 2])) {
    h->e[i] = h->e[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  h->e[i] = x;
}

/* Moves h->e[i] down until neither child comes before it. */
static void heap_sift_down(struct heap *h, size_t i) {
  struct heap_entry x = h->e[i];
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= h->n)
      break;
    if (c + 1 < h->n && entry_less(h->e[c + 1], h->e[c]))
      c++;
    if (!entry_less(h->e[c], x))
      break;
    h->e[i] = h->e[c];
    i = c;
  }
  h->e[i] = x;
}

static struct heap_entry heap_pop(struct heap *h) {
  struct heap_entry top = h->e[0];
  h->e[0] = h->e[--h->n];
  if (h->n > 0)
    heap_sift_down(h, 0);
  return top;
}

/* Restores the order of a heap whose keys changed. */
static void heap_make(struct heap *h) {
  for (size_t i = h->n / 2; i-- > 0;)
    heap_sift_down(h, i);
}

static uint64_t gcd(uint64_t a, uint64_t b) {
  while (b != 0) {
    uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* lcm(a, b), or 0 when it exceeds limit (0 stands for unknown). */
static uint64_t lcm_within(uint64_t a, uint64_t b, uint64_t limit) {
  uint64_t l;
  if (a == 0 || b == 0)
    return 0;
  if (__builtin_mul_overflow(a / gcd(a, b), b, &l) || l > limit)
    return 0;
  return l;
}

/* Axes of more than one element, by stride, with each axis that continues
 * the one below it (stride = count * stride below) merged into it. */
static void box_normalise(const struct cover_box *in, struct box *b) {
  uint64_t count[SP_MAX_DIMS], stride[SP_MAX_DIMS];
  uint32_t n = 0, at = 0;

  for (uint32_t d = 0; d < in->ndim; d++) {
    uint32_t j;
    if (in->shape[d] == 1)
      continue;
    for (j = n; j > 0 && stride[j - 1] > (uint64_t)in->stride[d]; j--) {
      count[j] = count[j - 1];
      stride[j] = stride[j - 1];
    }
    count[j] = (uint64_t)in->shape[d];
    stride[j] = (uint64_t)in->stride[d];
    n++;
  }
  for (uint32_t k = 0; k < n; k++) {
    if (at > 0 && stride[k] == count[at - 1] * stride[at - 1]) {
      count[at - 1] *= count[k];
      continue;
    }
    count[at] = count[k];
    stride[at] = stride[k];
    at++;
  }
  n = at;
  memset(b, 0, sizeof *b);
  b->shared = in->shared;
  at = 0;
  b->run = 1;
  if (n > 0 && stride[0] == 1)
    b->run = count[at++];
  b->count = 1;
  if (at < n) {
    b->count = count[at];
    b->period = stride[at];
    at++;
  }
  for (; at < n; at++) {
    b->outer_count[b->nouter] = count[at];
    b->outer_stride[b->nouter] = stride[at];
    b->nouter++;
  }
  b->comb = (uint64_t)in->offset;
}

/* Steps b's odometer to its next comb: false when it has none. */
static bool box_next_comb(struct box *b) {
  for (uint32_t k = 0; k < b->nouter; k++) {
    if (++b->outer_idx[k] < b->outer_count[k]) {
      b->comb += b->outer_stride[k];
      b->next = 0;
      return true;
    }
    b->comb -= b->outer_stride[k] * (b->outer_count[k] - 1);
    b->outer_idx[k] = 0;
  }
  return false;
}

/* An active comb's period and position in the active heap. */
struct ordered {
  uint64_t period;
  uint32_t pos;
};

struct sweep {
  struct box *boxes;
  struct heap pending; /* keyed by the comb each box opens next */
  struct heap active;  /* keyed by the next run of the comb in progress */
  uint64_t n;
  bool complete;
  /* The furthest end of any run swept so far, and of any unshared run,
   * with the boxes that reached them first. */
  uint64_t end_any, end_unshared;
  uint32_t box_any, box_unshared;
  /* Over the combs closed so far, kept apart from the combs still open:
   * one past the start of the last run, and the furthest end. */
  uint64_t closed_start, closed_end;
  /* Runs to sweep before the next attempt to skip, and the interval, which
   * doubles after each attempt that finds nothing to skip. */
  uint64_t until_attempt, interval;
  /* Room for one entry per box, for the attempts. */
  struct ordered *order; /* the active combs, by period */
  uint64_t *tail_start; /* see sweep_try_skip */
  uint64_t *tail_end;
  uint64_t *tail_key;
  struct cover_work work;
};

static int defect(struct cover_defect *out, int code, uint64_t element,
                  uint32_t a, uint32_t b) {
  out->element = element;
  out->box = a < b ? a : b;
  out->other = a < b ? b : a;
  return code;
}

/* Judges run [start, start + len) of box i against what came before. */
static int sweep_run(struct sweep *s, uint32_t i, uint64_t start, uint64_t len,
                     struct cover_defect *out) {
  bool shared = s->boxes[i].shared;

  if (s->complete && start > s->end_any)
    return defect(out, SP_EUNCOVERED, s->end_any, i, i);
  if (start < s->end_unshared)
    return defect(out, SP_EDOUBLEWRITE, start, s->box_unshared, i);
  if (!shared && start < s->end_any)
    return defect(out, SP_EDOUBLEWRITE, start, s->box_any, i);
  if (start + len > s->end_any) {
    s->end_any = start + len;
    s->box_any = i;
  }
  if (!shared && start + len > s->end_unshared) {
    s->end_unshared = start + len;
    s->box_unshared = i;
  }
  return 0;
}

static const struct box *active_box(const struct sweep *s, uint32_t pos) {
  return &s->boxes[s->active.e[pos].box];
}

static int by_period(const void *a, const void *b) {
  const struct ordered *x = a, *y = b;
  if (x->period != y->period)
    return x->period < y->period ? -1 : 1;
  return x->pos < y->pos ? -1 : x->pos > y->pos ? 1 : 0;
}

/* Of the runs offered, the one that ends furthest and, of those, the first
 * swept (lowest start, then lowest box): the one a sweep of every run
 * would have kept as its maximum. */
struct reach {
  uint64_t end, start;
  uint32_t box;
};

static void reach_offer(struct reach *r, uint64_t start, uint64_t end,
                        uint32_t box) {
  if (end > r->end ||
      (end == r->end &&
       (start < r->start || (start == r->start && box < r->box))))
    *r = (struct reach){end, start, box};
}

/* Moves the first j + 1 combs of order (the pattern) forward by shift,
 * a multiple of each one's period, and both maxima with them. */
static void sweep_shift(struct sweep *s, size_t j, uint64_t shift) {
  struct reach any = {0, 0, 0}, unshared = {0, 0, 0};

  for (size_t k = 0; k <= j; k++) {
    struct heap_entry *e = &s->active.e[s->order[k].pos];
    struct box *b = &s->boxes[e->box];
    uint64_t last;
    e->key += shift;
    b->next += shift / b->period;
    s->work.skipped += shift / b->period;
    /* A comb's runs end in increasing order: the furthest end of its runs
     * is its last run's, the one before its next. */
    last = e->key - b->period;
    reach_offer(&any, last, last + b->run, e->box);
    if (!b->shared)
      reach_offer(&unshared, last, last + b->run, e->box);
  }
  /* An end equal to one reached before the skip was reached first there. */
  if (any.end > s->end_any) {
    s->end_any = any.end;
    s->box_any = any.box;
  }
  if (unshared.end > s->end_unshared) {
    s->end_unshared = unshared.end;
    s->box_unshared = unshared.box;
  }
  heap_make(&s->active);
}

/*
 * Skips what repeats ahead of next, the first element of every run not yet
 * swept: true when it did.
 *
 * A pattern is the combs in progress of the j + 1 shortest periods, which
 * repeat with their lcm L.  It starts at W, past the start of every run of
 * the other combs, closed or in progress, and past the first run of each
 * of its combs; it holds up to H: up to the next comb to open, the next
 * run of the other combs, and the last run of each of its combs.  Every
 * run that starts in [W, H) is the pattern's, and one at x in [W + L, H)
 * is one at x - L moved by L.  Once [W, next) holds two whole periods, the
 * pattern's own maxima at x and at x - L differ by exactly L.
 *
 * What ends before W does not change that: the pattern's combs' own runs
 * before W end before W + L (a comb's runs are at most a period long).
 * A run before W that ends at E later than that must be shared and reach
 * past every run after W it would refuse, or a defect was found already;
 * so it can only hide a gap, and only before E.  Each run in [next, H)
 * is then judged as its copy a period before it was, without a defect,
 * as long as E ends before the copy or after the run: the pattern's combs
 * move forward by as many periods S as keep each next run before its
 * comb's last (next + S + L <= H) and keep clear of E, and each maximum
 * becomes the furthest of its own and of the last runs moved.
 */
static bool sweep_try_skip(struct sweep *s) {
  size_t a = s->active.n, best_j = 0;
  uint64_t next = s->active.e[0].key, horizon = s->n, best = 0;
  uint64_t period = 1, first = 0, last = UINT64_MAX;

  if (s->pending.n > 0) {
    horizon = s->pending.e[0].key;
    if (horizon < next)
      next = horizon;
  }
  s->work.steps += a;
  for (size_t k = 0; k < a; k++)
    s->order[k] = (struct ordered){active_box(s, (uint32_t)k)->period,
                                   (uint32_t)k};
  qsort(s->order, a, sizeof *s->order, by_period);
  /* Over the combs order[j..], the furthest start of a run swept (plus
   * one) and its end, and the first run not swept. */
  s->tail_start[a] = s->closed_start;
  s->tail_end[a] = s->closed_end;
  s->tail_key[a] = UINT64_MAX;
  for (size_t k = a; k-- > 0;) {
    const struct box *b = active_box(s, s->order[k].pos);
    uint64_t key = s->active.e[s->order[k].pos].key;
    uint64_t start = key - b->period + 1, end = key - b->period + b->run;
    s->tail_start[k] = start > s->tail_start[k + 1] ? start
                                                     : s->tail_start[k + 1];
    s->tail_end[k] = end > s->tail_end[k + 1] ? end : s->tail_end[k + 1];
    s->tail_key[k] = key < s->tail_key[k + 1] ? key : s->tail_key[k + 1];
  }
  for (size_t j = 0; j < a; j++) {
    const struct box *b = active_box(s, s->order[j].pos);
    uint64_t w = s->tail_start[j + 1], h = horizon, e = s->tail_end[j + 1];
    uint64_t comb_last = b->comb + (b->count - 1) * b->period, shift;

    period = lcm_within(period, b->period, s->n);
    if (period == 0)
      break;
    if (b->comb + 1 > first)
      first = b->comb + 1;
    if (comb_last + 1 < last)
      last = comb_last + 1;
    if (first > w)
      w = first;
    if (last < h)
      h = last;
    if (s->tail_key[j + 1] < h)
      h = s->tail_key[j + 1];
    if (next < w || next - w < 2 * period || h <= next ||
        h - next <= period)
      continue;
    shift = (h - next - period) / period * period;
    if (e >= next - period) {
      if (e <= next)
        continue;
      if (e - next < shift)
        shift = (e - next) / period * period;
    }
    if (shift > best) {
      best = shift;
      best_j = j;
    }
  }
  if (best == 0)
    return false;
  sweep_shift(s, best_j, best);
  return true;
}

/* A comb opened or closed: the patterns change, try again soon. */
static void sweep_event(struct sweep *s) {
  s->interval = s->active.n > 0 ? s->active.n : 1;
  if (s->until_attempt > s->interval)
    s->until_attempt = s->interval;
}

/* Takes the next run from either heap, judges it and moves its box on. */
static int sweep_step(struct sweep *s, struct cover_defect *out) {
  bool from_pending =
      s->active.n == 0 ||
      (s->pending.n > 0 && entry_less(s->pending.e[0], s->active.e[0]));
  struct heap_entry e =
      from_pending ? heap_pop(&s->pending) : heap_pop(&s->active);
  struct box *b = &s->boxes[e.box];
  bool event = from_pending;
  int rc;

  s->work.steps++;
  rc = sweep_run(s, e.box, e.key, b->run, out);
  if (rc != 0)
    return rc;
  if (++b->next < b->count) {
    heap_push(&s->active, (struct heap_entry){e.key + b->period, e.box});
  } else {
    event = true;
    if (e.key + 1 > s->closed_start)
      s->closed_start = e.key + 1;
    if (e.key + b->run > s->closed_end)
      s->closed_end = e.key + b->run;
    if (box_next_comb(b))
      heap_push(&s->pending, (struct heap_entry){b->comb, e.box});
  }
  if (event)
    sweep_event(s);
  if (s->active.n > 0 && --s->until_attempt == 0) {
    if (sweep_try_skip(s)) {
      s->interval = s->active.n;
    } else if (s->interval < UINT64_MAX / 2) {
      s->interval *= 2;
    }
    s->until_attempt = s->interval;
  }
  return 0;
}

int cover_check(const struct cover_box *boxes, size_t nboxes, uint64_t n,
                bool complete, const _Atomic bool *stop,
                struct cover_defect *out, struct cover_work *work) {
  size_t room = nboxes > 0 ? nboxes : 1;
  struct sweep s = {
      .n = n, .complete = complete, .until_attempt = 1, .interval = 1};
  uint64_t look_at = STOP_EVERY;
  int rc = 0;

  memset(out, 0, sizeof *out);
  s.boxes = malloc(room * sizeof *s.boxes);
  s.pending.e = malloc(room * sizeof *s.pending.e);
  s.active.e = malloc(room * sizeof *s.active.e);
  s.order = malloc(room * sizeof *s.order);
  s.tail_start = malloc((room + 1) * sizeof *s.tail_start);
  s.tail_end = malloc((room + 1) * sizeof *s.tail_end);
  s.tail_key = malloc((room + 1) * sizeof *s.tail_key);
  if (s.boxes == NULL || s.pending.e == NULL || s.active.e == NULL ||
      s.order == NULL || s.tail_start == NULL || s.tail_end == NULL ||
      s.tail_key == NULL) {
    rc = SP_ENOMEM;
    goto out;
  }
  for (size_t i = 0; i < nboxes; i++) {
    uint64_t numel;
    if (sp__view_numel(boxes[i].ndim, boxes[i].shape, &numel) != 0 ||
        numel == 0)
      continue;
    box_normalise(&boxes[i], &s.boxes[i]);
    heap_push(&s.pending, (struct heap_entry){s.boxes[i].comb, (uint32_t)i});
  }
  while (s.pending.n > 0 || s.active.n > 0) {
    if (s.work.steps >= look_at) {
      look_at = s.work.steps + STOP_EVERY;
      if (stop != NULL && atomic_load(stop)) {
        rc = SP_ETIMEOUT;
        goto out;
      }
    }
    rc = sweep_step(&s, out);
    if (rc != 0)
      goto out;
  }
  if (complete && s.end_any < n)
    rc = defect(out, SP_EUNCOVERED, s.end_any, 0, 0);
out:
  if (work != NULL)
    *work = s.work;
  free(s.boxes);
  free(s.pending.e);
  free(s.active.e);
  free(s.order);
  free(s.tail_start);
  free(s.tail_end);
  free(s.tail_key);
  return rc;
}
