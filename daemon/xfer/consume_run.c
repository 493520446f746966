/*
 * consume_run.c - a push's local moves: from the sending rank's storage
 * straight into the consumer's buffer, one strided box copy per move or
 * per slice of rows, shared by the copying threads through one counter.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/xfer/consume_run.h"
#include "daemon/xfer/copy.h"
#include "daemon/xfer/thread.h"
#include "proto/dtype.h"
#include "shardport.h"

/* Rows [row, row + rows) of one move's dim 0 (the whole move when its
 * view is 0-d: rows is then 1). */
struct item {
  const struct consume_move *move;
  int64_t row;
  int64_t rows;
};

/* One run's shared state: the caller's inputs, the current round's items
 * and the first failure. */
struct runner {
  struct consume_run *run;
  uint64_t chunk;
  uint32_t threads;
  struct item *items;
  size_t nitems;
  _Atomic size_t next;
  _Atomic bool failed;
  pthread_mutex_t fail_lock;
};

struct worker {
  struct runner *r;
  const struct item *current;
  pthread_t thread;
};

/* Records the first failure; later ones are dropped. */
__attribute__((format(printf, 3, 4))) static void
fail(struct runner *r, int code, const char *fmt, ...) {
  pthread_mutex_lock(&r->fail_lock);
  if (r->run->rc == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->run->msg, sizeof r->run->msg, fmt, ap);
    va_end(ap);
    r->run->rc = code;
  }
  atomic_store(&r->failed, true);
  pthread_mutex_unlock(&r->fail_lock);
}

static bool stopped(struct runner *r) {
  return atomic_load_explicit(&r->failed, memory_order_relaxed) ||
         atomic_load_explicit(&r->run->cancel, memory_order_relaxed);
}

static const uint8_t *source(const struct consume_run *run,
                             const struct consume_move *m) {
  return run->src[m->src][m->src_storage].data;
}

static uint8_t *dest(const struct consume_run *run,
                     const struct consume_move *m) {
  return run->dst[m->dst][m->dst_storage];
}

static void copy_item(struct runner *r, const struct item *it) {
  const struct consume_move *m = it->move;
  size_t esz = sp__dtype_size(m->from.dtype);
  const uint8_t *src = source(r->run, m) + (size_t)m->from.offset * esz;
  uint8_t *dst = dest(r->run, m) + (size_t)m->to.offset * esz;
  uint64_t n;

  if (m->from.ndim == 0) {
    memcpy(dst, src, esz);
    n = esz;
  } else {
    struct xfer_box box = {.ndim = (int)m->from.ndim, .elem_size = esz};
    for (uint32_t d = 0; d < m->from.ndim; d++) {
      box.shape[d] = m->from.shape[d];
      box.src_stride[d] = m->from.stride[d];
      box.dst_stride[d] = m->to.stride[d];
    }
    box.shape[0] = it->rows;
    n = xfer_copy(dst + (size_t)(it->row * m->to.stride[0]) * esz,
                  src + (size_t)(it->row * m->from.stride[0]) * esz, &box);
  }
  atomic_fetch_add_explicit(&r->run->bytes_moved, n, memory_order_relaxed);
  if (r->run->received != NULL)
    atomic_fetch_add_explicit(&r->run->received[m->dst], n,
                              memory_order_relaxed);
}

static void take_items(void *arg) {
  struct worker *w = arg;
  struct runner *r = w->r;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed);
    if (i >= r->nitems || stopped(r))
      return;
    w->current = &r->items[i];
    copy_item(r, w->current);
  }
}

/* Whether addr lies in the bytes a view reaches from base. */
static bool reaches(const struct sp_view *v, const uint8_t *base,
                    const uint8_t *addr) {
  size_t esz = sp__dtype_size(v->dtype);
  int64_t last = v->offset;
  for (uint32_t d = 0; d < v->ndim; d++)
    last += (v->shape[d] - 1) * v->stride[d];
  return addr >= base + (size_t)v->offset * esz &&
         addr < base + (size_t)(last + 1) * esz;
}

/* Says which side of the current move a SIGBUS hit: the consumer's
 * buffer or the sending rank's storage. */
static void report_fault(struct worker *w, const void *fault) {
  struct runner *r = w->r;
  const struct consume_move *m = w->current->move;
  const char *key = r->run->plan->keys[m->key].name;
  if (reaches(&m->to, dest(r->run, m), fault)) {
    fail(r, SP_EBADFD,
         "consumer %u's storage %u could not be written for key '%s' (was "
         "its file truncated after it was registered?)",
         m->dst, m->dst_storage, key);
    return;
  }
  fail(r, SP_EBADFD,
       "rank %u's storage sid %u could not be read for key '%s' pushed to "
       "consumer %u (was its file truncated after it was registered?)",
       m->src, r->run->src[m->src][m->src_storage].sid, key, m->dst);
}

static void work(struct worker *w) {
  const void *fault = NULL;
  w->current = NULL;
  if (xfer_guarded(take_items, w, &fault) != 0)
    report_fault(w, fault);
}

static void *worker_main(void *arg) {
  work(arg);
  return NULL;
}

/* Appends the items of one move: a move larger than the chunk becomes
 * slices of whole rows (counting only when r->items is NULL). */
static void add_move(struct runner *r, const struct consume_move *m) {
  int64_t rows = m->from.ndim > 0 ? m->from.shape[0] : 1;
  int64_t per = rows;
  if (m->nbytes > r->chunk && rows > 1) {
    uint64_t row_bytes = m->nbytes / (uint64_t)rows;
    per = (int64_t)(r->chunk / row_bytes);
    if (per < 1)
      per = 1;
  }
  for (int64_t row = 0; row < rows; row += per) {
    if (r->items != NULL)
      r->items[r->nitems] = (struct item){
          .move = m, .row = row, .rows = rows - row < per ? rows - row : per};
    r->nitems++;
  }
}

/* The round's local moves sent from this node, as items. */
static int cut_round(struct runner *r, const struct consume_round *round) {
  const struct consume_plan *plan = r->run->plan;
  free(r->items);
  r->items = NULL;
  for (int pass = 0; pass < 2; pass++) {
    r->nitems = 0;
    for (size_t i = 0; i < round->nlocal; i++) {
      const struct consume_move *m = &round->local[i];
      if (plan->rank_node[m->src] == r->run->node && m->nbytes > 0)
        add_move(r, m);
    }
    if (pass == 0) {
      r->items = malloc((r->nitems > 0 ? r->nitems : 1) * sizeof *r->items);
      if (r->items == NULL)
        return SP_ENOMEM;
    }
  }
  return 0;
}

/* The round's items on run->threads threads, this one included. */
static void run_items(struct runner *r, struct worker *workers) {
  uint32_t helpers = 0;
  atomic_store(&r->next, 0);
  for (uint32_t t = 1; t < r->threads && t < r->nitems; t++) {
    workers[t] = (struct worker){.r = r};
    if (xfer_spawn(&workers[t].thread, worker_main, &workers[t]) != 0)
      break;
    helpers++;
  }
  workers[0] = (struct worker){.r = r};
  work(&workers[0]);
  for (uint32_t t = 1; t <= helpers; t++)
    pthread_join(workers[t].thread, NULL);
}

int consume_run_local(struct consume_run *run) {
  struct runner r = {.run = run,
                     .chunk = run->chunk > 0 ? run->chunk : CONSUME_RUN_CHUNK,
                     .threads = run->threads > 0 ? run->threads : 1};
  struct worker *workers = calloc(r.threads, sizeof *workers);

  run->rc = 0;
  run->msg[0] = '\0';
  pthread_mutex_init(&r.fail_lock, NULL);
  if (workers == NULL)
    fail(&r, SP_ENOMEM, "out of memory for the push's copying threads");
  for (size_t i = 0; i < run->plan->nrounds && !stopped(&r); i++) {
    if (cut_round(&r, &run->plan->rounds[i]) != 0) {
      fail(&r, SP_ENOMEM, "out of memory for round %zu of the push", i + 1);
      break;
    }
    run_items(&r, workers);
  }
  if (run->rc == 0 && atomic_load(&run->cancel))
    fail(&r, SP_EABORTED, "the push was cancelled");
  free(r.items);
  free(workers);
  pthread_mutex_destroy(&r.fail_lock);
  return run->rc;
}
