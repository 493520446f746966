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
 * (sp_view_check_overlap: each stride clears what the axes below reach),
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
 * sweep also skips.  Between two events (a comb opening or closing) the
 * combs in progress repeat with the least common multiple L of their
 * periods.  Once a whole L after the last event has been swept, each later
 * whole L before the next event holds the same runs shifted by L: the
 * active heap and both maxima move forward by as many L as fit.  A column
 * split of any height then costs a few runs per box, interleaved columns a
 * few runs per row and box.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

/* How many runs the sweep takes between two looks at the stop flag. */
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

static struct heap_entry heap_pop(struct heap *h) {
  struct heap_entry top = h->e[0], x = h->e[--h->n];
  size_t i = 0;
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
  if (h->n > 0)
    h->e[i] = x;
  return top;
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

static uint64_t comb_end(const struct box *b) {
  return b->comb + (b->count - 1) * b->period + b->run;
}

struct sweep {
  struct box *boxes;
  struct heap pending; /* keyed by the comb each box opens next */
  struct heap active;  /* keyed by the next run of the comb in progress */
  uint64_t n;
  bool complete;
  /* The furthest end of any run swept so far, and of any unshared run,
   * with the boxes that reached them. */
  uint64_t end_any, end_unshared;
  uint32_t box_any, box_unshared;
  /* Skipping: the last event, a multiple of the active combs' periods
   * (0: unknown), and where the next attempt may happen. */
  uint64_t event;
  uint64_t period;
  uint64_t attempt_at;
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

/* Moves the sweep from next (every run before it swept, and at least one
 * whole period since the last event) forward by as many periods as fit
 * before the next event, keeping a period of margin. */
static void sweep_skip(struct sweep *s, uint64_t next) {
  uint64_t period = 1, horizon = s->n, room, shift;

  if (s->pending.n > 0)
    horizon = s->pending.e[0].key;
  for (size_t k = 0; k < s->active.n; k++) {
    const struct box *b = &s->boxes[s->active.e[k].box];
    uint64_t end = comb_end(b);
    period = lcm_within(period, b->period, s->n);
    if (end < horizon)
      horizon = end;
  }
  s->period = period;
  if (period == 0)
    return;
  s->attempt_at = next + period;
  /* Each comb's next run starts at most one period past next, so after the
   * shift before next + shift + period < horizon: still a run of its comb,
   * and no event comes between. */
  room = horizon - next;
  if (room <= 2 * period)
    return;
  shift = ((room - 1) / period - 1) * period;
  for (size_t k = 0; k < s->active.n; k++) {
    struct box *b = &s->boxes[s->active.e[k].box];
    s->active.e[k].key += shift;
    b->next += shift / b->period;
  }
  /* Both maxima come from runs of combs in progress when they lie past the
   * last event; a maximum at or before it is left behind by every later
   * run, shifted or not. */
  if (s->end_any > s->event)
    s->end_any += shift;
  if (s->end_unshared > s->event)
    s->end_unshared += shift;
  s->attempt_at += shift;
}

/* Takes the next run from either heap, judges it and moves its box on. */
static int sweep_step(struct sweep *s, struct cover_defect *out) {
  bool from_pending =
      s->active.n == 0 ||
      (s->pending.n > 0 && entry_less(s->pending.e[0], s->active.e[0]));
  struct heap_entry e =
      from_pending ? heap_pop(&s->pending) : heap_pop(&s->active);
  struct box *b = &s->boxes[e.box];
  int rc;

  if (from_pending) {
    /* A comb opens: the repeating pattern restarts here. */
    if (e.key > s->event)
      s->event = e.key;
    if (b->count > 1)
      s->period = lcm_within(s->period, b->period, s->n);
  }
  rc = sweep_run(s, e.box, e.key, b->run, out);
  if (rc != 0)
    return rc;
  if (++b->next < b->count) {
    heap_push(&s->active, (struct heap_entry){e.key + b->period, e.box});
  } else {
    /* The comb closes where its last run ends. */
    if (e.key + b->run > s->event)
      s->event = e.key + b->run;
    if (box_next_comb(b))
      heap_push(&s->pending, (struct heap_entry){b->comb, e.box});
  }
  if (s->active.n == 0) {
    s->period = 1;
  } else if (s->period != 0) {
    uint64_t next = s->active.e[0].key;
    if (s->pending.n > 0 && s->pending.e[0].key < next)
      next = s->pending.e[0].key;
    /* A gap before next is found only when the run after it comes: no
     * skip over it, so that the first defect is reported where it is. */
    if (next >= s->event && next - s->event >= s->period &&
        next >= s->attempt_at && (!s->complete || s->end_any >= next))
      sweep_skip(s, next);
  }
  return 0;
}

int cover_check(const struct cover_box *boxes, size_t nboxes, uint64_t n,
                bool complete, const _Atomic bool *stop,
                struct cover_defect *out) {
  struct sweep s = {.n = n, .complete = complete, .period = 1};
  uint64_t steps = 0;
  int rc = 0;

  memset(out, 0, sizeof *out);
  s.boxes = malloc((nboxes > 0 ? nboxes : 1) * sizeof *s.boxes);
  s.pending.e = malloc((nboxes > 0 ? nboxes : 1) * sizeof *s.pending.e);
  s.active.e = malloc((nboxes > 0 ? nboxes : 1) * sizeof *s.active.e);
  if (s.boxes == NULL || s.pending.e == NULL || s.active.e == NULL) {
    rc = SP_ENOMEM;
    goto out;
  }
  for (size_t i = 0; i < nboxes; i++) {
    uint64_t numel;
    if (sp_view_numel(boxes[i].ndim, boxes[i].shape, &numel) != 0 || numel == 0)
      continue;
    box_normalise(&boxes[i], &s.boxes[i]);
    heap_push(&s.pending, (struct heap_entry){s.boxes[i].comb, (uint32_t)i});
  }
  while (s.pending.n > 0 || s.active.n > 0) {
    if (++steps % STOP_EVERY == 0 && stop != NULL && atomic_load(stop)) {
      rc = SP_ETIMEOUT;
      goto out;
    }
    rc = sweep_step(&s, out);
    if (rc != 0)
      goto out;
  }
  if (complete && s.end_any < n)
    rc = defect(out, SP_EUNCOVERED, s.end_any, 0, 0);
out:
  free(s.boxes);
  free(s.pending.e);
  free(s.active.e);
  return rc;
}
