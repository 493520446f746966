/*
 * workers.c - the planner's threads: one list of tasks, taken in order by
 * up to plan_input.threads threads, this one included.
 *
 * Tasks write only what is theirs (one round each), so the result does not
 * depend on which thread ran what.  A failure is the failing task with the
 * lowest index: tasks are taken in increasing order, so every task below a
 * failed one has been taken and runs to its end, and those above it need
 * not start.  Without threads (one asked, or none could start) this thread
 * runs every task.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

/* The most threads the planner starts: a few per core is plenty for work
 * bound by memory traffic. */
#define PLAN_MAX_THREADS 64u

struct work {
  int (*task)(void *ctx, uint32_t worker, size_t i);
  void *ctx;
  size_t n;
  _Atomic size_t next;
  pthread_mutex_t lock;
  size_t failed_at; /* the lowest failed task, n when none */
  int rc;
};

struct worker {
  struct work *w;
  uint32_t id;
};

static void *work_loop(void *arg) {
  struct worker *self = arg;
  struct work *w = self->w;

  for (;;) {
    size_t i = atomic_fetch_add(&w->next, 1);
    if (i >= w->n)
      return NULL;
    int rc = w->task(w->ctx, self->id, i);
    if (rc != 0) {
      pthread_mutex_lock(&w->lock);
      if (i < w->failed_at) {
        w->failed_at = i;
        w->rc = rc;
      }
      pthread_mutex_unlock(&w->lock);
      /* Every task above this one may be skipped. */
      atomic_store(&w->next, w->n);
      return NULL;
    }
  }
}

uint32_t plan_workers_count(uint32_t threads, size_t n) {
  uint32_t want = threads > 1 ? threads : 1;
  if (want > PLAN_MAX_THREADS)
    want = PLAN_MAX_THREADS;
  if (want > n)
    want = n > 0 ? (uint32_t)n : 1;
  return want;
}

int plan_workers_run(uint32_t threads, size_t n,
                     int (*task)(void *ctx, uint32_t worker, size_t i),
                     void *ctx) {
  struct work w = {.task = task, .ctx = ctx, .n = n, .failed_at = n};
  uint32_t want = plan_workers_count(threads, n), started = 0;
  struct worker workers[PLAN_MAX_THREADS];
  pthread_t tids[PLAN_MAX_THREADS];

  atomic_init(&w.next, 0);
  pthread_mutex_init(&w.lock, NULL);
  for (uint32_t t = 0; t < want; t++)
    workers[t] = (struct worker){&w, t};
  /* A thread that cannot start leaves its share to the others. */
  for (uint32_t t = 1; t < want; t++) {
    if (pthread_create(&tids[t], NULL, work_loop, &workers[t]) != 0)
      break;
    started++;
  }
  work_loop(&workers[0]);
  for (uint32_t t = 1; t <= started; t++)
    pthread_join(tids[t], NULL);
  pthread_mutex_destroy(&w.lock);
  return w.rc;
}
