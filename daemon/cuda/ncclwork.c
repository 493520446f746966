/*
 * ncclwork.c - who may issue NCCL work on each GPU, what waits until that
 * work is over, and the helper threads that end communicators; see
 * internal.h and docs/gpu.md (Threads).
 *
 * NCCL is not safe when several threads issue work to communicators of
 * one device at once, and all of a group's operations must come from one
 * thread (NCCL's "Thread Safety"); a job's export runs on its own engine
 * thread and the loop starts communicators as ranks join, so each device
 * has one lock, held from ncclGroupStart to ncclGroupEnd.  cudaFree while
 * NCCL kernels are in flight on a device can deadlock (the free
 * synchronises the device while the kernels wait for their peers), so a
 * free of device memory waits, deferred, until that device's NCCL work is
 * over.  ncclCommAbort and ncclCommDestroy may block for as long as a
 * peer or a kernel takes, so they run on helper threads, never on the
 * caller's; gpu_close waits for those helpers, bounded.
 */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "daemon/cuda/internal.h"

/* How long gpu_close waits for helper threads still ending communicators:
 * NCCL's own teardown is bounded by the peers' timeouts, not by shardport. */
#define REAPERS_WAIT_MS 10000

struct deferred_free {
  struct deferred_free *next;
  void *ptr;
};

static void join_done(struct gpu *gpu);

void gpu_nccl_init(struct gpu *gpu) {
  for (int d = 0; d < GPU_MAX_DEVICES; d++)
    pthread_mutex_init(&gpu->nccl.lock[d], NULL);
  pthread_mutex_init(&gpu->nccl.reap_lock, NULL);
  pthread_cond_init(&gpu->nccl.reap_done, NULL);
}

bool gpu_comms_wait_ended(struct gpu *gpu, uint32_t timeout_ms) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += timeout_ms / 1000;
  until.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
  if (until.tv_nsec >= 1000000000) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000;
  }
  pthread_mutex_lock(&gpu->nccl.reap_lock);
  int rc = 0;
  while (gpu->nccl.reapers > 0 && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&gpu->nccl.reap_done, &gpu->nccl.reap_lock,
                                &until);
  bool idle = gpu->nccl.reapers == 0;
  pthread_mutex_unlock(&gpu->nccl.reap_lock);
  return idle;
}

bool gpu_nccl_fini(struct gpu *gpu) {
  if (!gpu_comms_wait_ended(gpu, REAPERS_WAIT_MS))
    return false;
  pthread_mutex_lock(&gpu->nccl.reap_lock);
  join_done(gpu);
  pthread_mutex_unlock(&gpu->nccl.reap_lock);
  for (int d = 0; d < GPU_MAX_DEVICES; d++) {
    for (struct deferred_free *f = gpu->nccl.frees[d], *next; f != NULL;
         f = next) {
      next = f->next;
      gpu->api.cudaSetDevice(d);
      gpu->api.cudaFree(f->ptr);
      free(f);
    }
    pthread_mutex_destroy(&gpu->nccl.lock[d]);
  }
  pthread_mutex_destroy(&gpu->nccl.reap_lock);
  pthread_cond_destroy(&gpu->nccl.reap_done);
  return true;
}

/* Each device once, in ascending order, so that two threads locking sets
 * that share devices cannot deadlock. */
static void for_each_device(struct gpu *gpu, const int *devices, size_t n,
                            void (*fn)(struct gpu *, int)) {
  uint64_t seen = 0;
  for (int d = 0; d < GPU_MAX_DEVICES; d++)
    for (size_t i = 0; i < n; i++)
      if (devices[i] == d && !(seen & (UINT64_C(1) << d))) {
        seen |= UINT64_C(1) << d;
        fn(gpu, d);
      }
}

static void lock_one(struct gpu *gpu, int d) {
  pthread_mutex_lock(&gpu->nccl.lock[d]);
}

static void unlock_one(struct gpu *gpu, int d) {
  pthread_mutex_unlock(&gpu->nccl.lock[d]);
}

void gpu_nccl_lock(struct gpu *gpu, const int *devices, size_t n) {
  for_each_device(gpu, devices, n, lock_one);
}

void gpu_nccl_unlock(struct gpu *gpu, const int *devices, size_t n) {
  for_each_device(gpu, devices, n, unlock_one);
}

static void begin_one(struct gpu *gpu, int d) { gpu->nccl.inflight[d]++; }

void gpu_nccl_begin(struct gpu *gpu, const int *devices, size_t n) {
  for_each_device(gpu, devices, n, begin_one);
}

/* The last NCCL work on d is over: the frees that waited for it run. */
static void end_one(struct gpu *gpu, int d) {
  pthread_mutex_lock(&gpu->nccl.lock[d]);
  struct deferred_free *frees = NULL;
  if (--gpu->nccl.inflight[d] == 0) {
    frees = gpu->nccl.frees[d];
    gpu->nccl.frees[d] = NULL;
  }
  for (struct deferred_free *f = frees, *next; f != NULL; f = next) {
    next = f->next;
    gpu->api.cudaSetDevice(d);
    gpu->api.cudaFree(f->ptr);
    free(f);
  }
  pthread_mutex_unlock(&gpu->nccl.lock[d]);
}

void gpu_nccl_end(struct gpu *gpu, const int *devices, size_t n) {
  for_each_device(gpu, devices, n, end_one);
}

void gpu_device_free(struct gpu *gpu, int device, void *ptr) {
  if (ptr == NULL)
    return;
  pthread_mutex_lock(&gpu->nccl.lock[device]);
  struct deferred_free *f =
      gpu->nccl.inflight[device] > 0 ? malloc(sizeof *f) : NULL;
  if (f != NULL) {
    f->ptr = ptr;
    f->next = gpu->nccl.frees[device];
    gpu->nccl.frees[device] = f;
  } else {
    /* No NCCL work in flight on the device (or no memory to remember the
     * pointer: then freeing at once is the lesser harm). */
    gpu->api.cudaSetDevice(device);
    gpu->api.cudaFree(ptr);
  }
  pthread_mutex_unlock(&gpu->nccl.lock[device]);
}

/* One helper thread: joined once it is done (by the next spawn, or at
 * gpu_nccl_fini), so that none is still exiting when the process does. */
struct reap {
  struct reap *next;
  struct gpu *gpu;
  void (*fn)(void *);
  void *arg;
  pthread_t thread;
  bool done;
};

static void *reap_main(void *p) {
  struct reap *r = p;
  struct gpu *gpu = r->gpu;
  r->fn(r->arg);
  pthread_mutex_lock(&gpu->nccl.reap_lock);
  r->done = true;
  gpu->nccl.reapers--;
  pthread_cond_broadcast(&gpu->nccl.reap_done);
  pthread_mutex_unlock(&gpu->nccl.reap_lock);
  return NULL;
}

/* Joins the helpers that are done; reap_lock held, and released while
 * joining. */
static void join_done(struct gpu *gpu) {
  for (struct reap **at = &gpu->nccl.helpers; *at != NULL;) {
    struct reap *r = *at;
    if (!r->done) {
      at = &r->next;
      continue;
    }
    *at = r->next;
    pthread_mutex_unlock(&gpu->nccl.reap_lock);
    pthread_join(r->thread, NULL);
    free(r);
    pthread_mutex_lock(&gpu->nccl.reap_lock);
    at = &gpu->nccl.helpers;
  }
}

void gpu_nccl_reap(struct gpu *gpu, void (*fn)(void *), void *arg) {
  struct reap *r = calloc(1, sizeof *r);
  bool started = false;
  pthread_mutex_lock(&gpu->nccl.reap_lock);
  join_done(gpu);
  if (r != NULL) {
    *r = (struct reap){.gpu = gpu, .fn = fn, .arg = arg};
    started = pthread_create(&r->thread, NULL, reap_main, r) == 0;
    if (started) {
      r->next = gpu->nccl.helpers;
      gpu->nccl.helpers = r;
      gpu->nccl.reapers++;
    }
  }
  pthread_mutex_unlock(&gpu->nccl.reap_lock);
  if (!started) {
    free(r);
    /* Without a thread, the caller ends them itself: late beats never. */
    fn(arg);
  }
}
