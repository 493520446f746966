/*
 * fake_stream.c - streams, events and copies of the fake CUDA runtime.
 *
 * Each stream is a queue served by its own worker thread, so work really is
 * asynchronous: a copy has not happened when cudaMemcpyAsync returns, only
 * once the stream reaches it (SHARDPORT_FAKE_DELAY_US widens that window).
 * Code that reads a result without synchronising sees stale bytes, as it
 * would on a GPU.
 *
 * An event is a pair of counters: how many records were issued and the
 * highest record a stream has reached.  cudaEventQuery, cudaEventSynchronize
 * and cudaStreamWaitEvent look at the record that was the latest when they
 * were called, as documented.  An interprocess event keeps its counters in a
 * memfd page that another process maps through the event's IPC handle.
 *
 * The legacy default stream (NULL) is one stream per device, but the fake
 * does not model its implicit synchronisation with other streams:
 * docs/fakes.md says why that is the conservative choice.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"

enum op_kind { OP_COPY, OP_COPY2D, OP_COPY3D, OP_SET, OP_RECORD, OP_WAIT, OP_HOST };

struct event_state {
  _Atomic uint64_t recorded;  /* records issued */
  _Atomic uint64_t completed; /* highest record a stream has reached */
};

struct fake_event {
  struct fake_event *next; /* every live event, to validate handles */
  unsigned flags;
  struct event_state *state;
  int fd;          /* interprocess events: the memfd, kept for export */
  uint64_t ino;
  bool mapped;     /* state lives in a shared mapping */
  atomic_int refs; /* the handle, plus one per queued operation */
};

/* The device memory an operation reads or writes, as queued: the region
 * (fake_region_of) each range began in, checked again when it runs. */
#define OP_RANGES 2

struct op {
  struct op *next;
  enum op_kind kind;
  int phys;                       /* the device whose stream runs it */
  const void *range[OP_RANGES];
  uint64_t region[OP_RANGES];     /* 0: host memory, or unused */
  union {
    struct { void *dst; const void *src; size_t n; } copy;
    struct {
      char *dst; size_t dpitch; const char *src; size_t spitch, width, height;
    } copy2d;
    struct {
      char *dst; size_t dpitch, dslice;
      const char *src; size_t spitch, sslice, width, height, depth;
    } copy3d;
    struct { void *dst; int value; size_t n; } set;
    struct { struct fake_event *ev; uint64_t seq; } event;
    struct { void (*fn)(void *); void *arg; } host;
  } u;
};

struct fake_stream {
  struct fake_stream *next; /* every stream whose worker still runs */
  bool is_default;
  int phys;                 /* the physical device whose work it queues */
  bool destroyed;           /* under reg.lock: the handle is gone */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct op *head, *tail;
  uint64_t enqueued, done;
  bool closing;
  atomic_int refs; /* the handle, the worker, and anyone waiting on it */
};

static struct {
  pthread_mutex_t lock;
  struct fake_stream *all;
  struct fake_stream *dflt[FAKE_MAX_GPUS];
  struct fake_event *events;
} reg = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The interprocess event handle's bytes. */
struct ipc_event_wire {
  char magic[8];
  uint32_t node;
  int32_t pid;
  int32_t fd;
  uint64_t ino;
};
_Static_assert(sizeof(struct ipc_event_wire) <= sizeof(cudaIpcEventHandle_t),
               "the fake handle must fit a cudaIpcEventHandle_t");
static const char ipc_event_magic[8] = "SPFKEVT1";

static void event_unref(struct fake_event *ev) {
  if (atomic_fetch_sub(&ev->refs, 1) != 1)
    return;
  if (ev->mapped)
    munmap(ev->state, sizeof(*ev->state));
  else
    free(ev->state);
  if (ev->fd >= 0)
    close(ev->fd);
  free(ev);
}

static void stream_unref(struct fake_stream *s) {
  if (atomic_fetch_sub(&s->refs, 1) != 1)
    return;
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->cond);
  free(s);
}

/* Waits until the event's counter reaches seq.  Polls, because the counter
 * may be advanced by another process. */
static void event_wait(struct fake_event *ev, uint64_t seq) {
  long nap = 20000;
  while (atomic_load(&ev->state->completed) < seq) {
    struct timespec ts = {0, nap};
    nanosleep(&ts, NULL);
    if (nap < 1000000)
      nap *= 2;
  }
}

/* Whether the memory op was queued on is still there.  cuMemUnmap and
 * cudaIpcCloseMemHandle do not wait for the streams (fake_memory.c): an
 * operation that outlived its memory would be an illegal address on a GPU,
 * so it is one here (sticky, as a fault is) and says so on stderr, loudly,
 * since the program that unmapped under it has a bug. */
static bool op_memory_alive(const struct op *op) {
  for (int i = 0; i < OP_RANGES; i++)
    if (!fake_region_alive(op->range[i], op->region[i])) {
      fprintf(stderr,
              "spfake: an operation queued on device %d reached %p after "
              "its memory was unmapped or closed (cuMemUnmap and "
              "cudaIpcCloseMemHandle do not wait for queued work): illegal "
              "address\n",
              op->phys, op->range[i]);
      fake_fault(op->phys, cudaErrorIllegalAddress);
      return false;
    }
  return true;
}

static void run_op(struct op *op) {
  bool touches = op->kind == OP_COPY || op->kind == OP_COPY2D ||
                 op->kind == OP_COPY3D || op->kind == OP_SET;
  if (touches) {
    fake_memory_use_begin();
    if (!op_memory_alive(op)) {
      fake_memory_use_end();
      return;
    }
  }
  switch (op->kind) {
  case OP_COPY:
    if (op->u.copy.n > 0)
      memmove(op->u.copy.dst, op->u.copy.src, op->u.copy.n);
    break;
  case OP_COPY2D:
    for (size_t row = 0; row < op->u.copy2d.height; row++)
      memmove(op->u.copy2d.dst + row * op->u.copy2d.dpitch,
              op->u.copy2d.src + row * op->u.copy2d.spitch, op->u.copy2d.width);
    break;
  case OP_COPY3D:
    for (size_t z = 0; z < op->u.copy3d.depth; z++)
      for (size_t row = 0; row < op->u.copy3d.height; row++)
        memmove(op->u.copy3d.dst + z * op->u.copy3d.dslice +
                    row * op->u.copy3d.dpitch,
                op->u.copy3d.src + z * op->u.copy3d.sslice +
                    row * op->u.copy3d.spitch,
                op->u.copy3d.width);
    break;
  case OP_SET:
    if (op->u.set.n > 0)
      memset(op->u.set.dst, op->u.set.value, op->u.set.n);
    break;
  case OP_RECORD: {
    struct event_state *st = op->u.event.ev->state;
    uint64_t cur = atomic_load(&st->completed);
    while (cur < op->u.event.seq &&
           !atomic_compare_exchange_weak(&st->completed, &cur, op->u.event.seq))
      ;
    event_unref(op->u.event.ev);
    break;
  }
  case OP_WAIT:
    event_wait(op->u.event.ev, op->u.event.seq);
    event_unref(op->u.event.ev);
    break;
  case OP_HOST:
    op->u.host.fn(op->u.host.arg);
    break;
  }
  if (touches)
    fake_memory_use_end();
}

static void *stream_worker(void *arg) {
  struct fake_stream *s = arg;
  unsigned delay = fake_config(NULL)->delay_us;
  pthread_mutex_lock(&s->lock);
  for (;;) {
    while (s->head == NULL && !s->closing)
      pthread_cond_wait(&s->cond, &s->lock);
    struct op *op = s->head;
    if (op == NULL)
      break;
    s->head = op->next;
    if (s->head == NULL)
      s->tail = NULL;
    pthread_mutex_unlock(&s->lock);
    if (delay > 0)
      usleep(delay);
    run_op(op);
    free(op);
    pthread_mutex_lock(&s->lock);
    s->done++;
    pthread_cond_broadcast(&s->cond);
  }
  pthread_mutex_unlock(&s->lock);
  /* Only now does the stream leave the list that cudaFree waits on. */
  pthread_mutex_lock(&reg.lock);
  for (struct fake_stream **pp = &reg.all; *pp != NULL; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  pthread_mutex_unlock(&reg.lock);
  stream_unref(s);
  return NULL;
}

static struct fake_stream *stream_new(bool is_default) {
  struct fake_stream *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return NULL;
  s->is_default = is_default;
  s->phys = fake_physical(fake_current_device());
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->cond, NULL);
  atomic_init(&s->refs, 2);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  int rc = pthread_create(&thread, &attr, stream_worker, s);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    free(s);
    return NULL;
  }
  return s;
}

/* The stream a handle names, with a reference the caller drops; NULL and
 * the two special handles mean the current device's default stream. */
static struct fake_stream *stream_get(cudaStream_t handle) {
  struct fake_stream *s = NULL;
  pthread_mutex_lock(&reg.lock);
  if (handle == NULL || handle == cudaStreamLegacy ||
      handle == cudaStreamPerThread) {
    int dev = fake_current_device();
    if (reg.dflt[dev] == NULL && (reg.dflt[dev] = stream_new(true)) != NULL) {
      reg.dflt[dev]->next = reg.all;
      reg.all = reg.dflt[dev];
    }
    s = reg.dflt[dev];
  } else {
    for (s = reg.all; s != NULL; s = s->next)
      if (s == (struct fake_stream *)handle && !s->destroyed)
        break;
  }
  if (s != NULL)
    atomic_fetch_add(&s->refs, 1);
  pthread_mutex_unlock(&reg.lock);
  return s;
}

/* The physical device of a stream, -1 for no stream. */
static int stream_phys(cudaStream_t handle) {
  struct fake_stream *s = stream_get(handle);
  if (s == NULL)
    return -1;
  int phys = s->phys;
  stream_unref(s);
  return phys;
}

/* Queues op on the stream, unless the stream's device has faulted: its
 * context is gone, and so is any work for it. */
static cudaError_t stream_push(cudaStream_t handle, struct op *op) {
  struct fake_stream *s = stream_get(handle);
  if (s == NULL) {
    free(op);
    return fake_error(cudaErrorInvalidResourceHandle);
  }
  cudaError_t sticky = fake_sticky(s->phys);
  if (sticky != cudaSuccess) {
    stream_unref(s);
    free(op);
    return fake_error(sticky);
  }
  op->phys = s->phys;
  pthread_mutex_lock(&s->lock);
  op->next = NULL;
  if (s->tail != NULL)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  s->enqueued++;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  stream_unref(s);
  return cudaSuccess;
}

static void stream_drain(struct fake_stream *s, uint64_t target) {
  pthread_mutex_lock(&s->lock);
  while (s->done < target)
    pthread_cond_wait(&s->cond, &s->lock);
  pthread_mutex_unlock(&s->lock);
}

void fake_sync_all_streams(void) {
  size_t n = 0;
  pthread_mutex_lock(&reg.lock);
  for (struct fake_stream *s = reg.all; s != NULL; s = s->next)
    n++;
  struct fake_stream **v = calloc(n ? n : 1, sizeof(*v));
  uint64_t *targets = calloc(n ? n : 1, sizeof(*targets));
  n = 0;
  for (struct fake_stream *s = reg.all; v != NULL && targets != NULL && s != NULL;
       s = s->next) {
    atomic_fetch_add(&s->refs, 1);
    pthread_mutex_lock(&s->lock);
    targets[n] = s->enqueued;
    pthread_mutex_unlock(&s->lock);
    v[n++] = s;
  }
  pthread_mutex_unlock(&reg.lock);
  for (size_t i = 0; i < n; i++) {
    stream_drain(v[i], targets[i]);
    stream_unref(v[i]);
  }
  free(v);
  free(targets);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  FAKE_LIVE();
  if (pStream == NULL || (flags & ~(unsigned)cudaStreamNonBlocking) != 0)
    return fake_error(cudaErrorInvalidValue);
  struct fake_stream *s = stream_new(false);
  if (s == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&reg.lock);
  s->next = reg.all;
  reg.all = s;
  pthread_mutex_unlock(&reg.lock);
  *pStream = (cudaStream_t)s;
  return cudaSuccess;
}

/* Returns at once; the worker finishes the queued work, then goes, as the
 * real call documents. */
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  FAKE_READY();
  pthread_mutex_lock(&reg.lock);
  struct fake_stream *s = reg.all;
  while (s != NULL && (s != (struct fake_stream *)stream || s->is_default ||
                       s->destroyed))
    s = s->next;
  if (s != NULL)
    s->destroyed = true;
  pthread_mutex_unlock(&reg.lock);
  if (s == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&s->lock);
  s->closing = true;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  stream_unref(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  FAKE_LIVE();
  struct fake_stream *s = stream_get(stream);
  if (s == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&s->lock);
  uint64_t target = s->enqueued;
  pthread_mutex_unlock(&s->lock);
  stream_drain(s, target);
  /* A fault of the work it waited for is reported here, as the
   * asynchronous error it is on a GPU. */
  cudaError_t sticky = fake_sticky(s->phys);
  stream_unref(s);
  return fake_error(sticky);
}

/* "Not ready" is an answer, not an error: it is not recorded as one. */
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  FAKE_LIVE();
  struct fake_stream *s = stream_get(stream);
  if (s == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&s->lock);
  bool idle = s->done == s->enqueued;
  pthread_mutex_unlock(&s->lock);
  cudaError_t sticky = fake_sticky(s->phys);
  stream_unref(s);
  if (sticky != cudaSuccess)
    return fake_error(sticky);
  return idle ? cudaSuccess : cudaErrorNotReady;
}

static struct op *op_new(enum op_kind kind) {
  struct op *op = calloc(1, sizeof(*op));
  if (op != NULL)
    op->kind = kind;
  return op;
}

/* Notes the memory an operation will touch, to check when it runs. */
static void op_ranges(struct op *op, const void *a, const void *b) {
  op->range[0] = a;
  op->region[0] = fake_region_of(a);
  op->range[1] = b;
  op->region[1] = b != NULL ? fake_region_of(b) : 0;
}

/* SHARDPORT_FAKE_FAULT: whether this copy or memset on physical device
 * phys is the one that faults, as a kernel's bad access would. */
static _Atomic long device_ops[FAKE_MAX_GPUS];

static bool injected_fault(int phys) {
  const struct fake_config *cfg = fake_config(NULL);
  return phys == cfg->fault_phys &&
         atomic_fetch_add(&device_ops[phys], 1) + 1 == cfg->fault_nth;
}

/* SHARDPORT_FAKE_PAGEABLE=fail: an async copy between device memory and
 * pageable host memory ends the process with a message.  The runtime's
 * "API synchronization behavior" says such a copy "might be synchronous
 * with respect to host" (the driver stages it through pinned memory after
 * synchronizing the stream), so a program that means its copies to
 * overlap must use page-locked memory (cudaHostAlloc). */
static void check_pageable(const void *dst, const void *src, size_t dlen,
                           size_t slen) {
  if (!fake_config(NULL)->pageable_fails)
    return;
  bool dst_dev = fake_region_of(dst) != 0, src_dev = fake_region_of(src) != 0;
  const void *host = dst_dev ? src : dst;
  size_t len = dst_dev ? slen : dlen;
  if (dst_dev == src_dev || len == 0 || fake_host_pinned(host, len))
    return;
  fprintf(stderr,
          "fake CUDA: async copy %s pageable host memory %p (%zu bytes): "
          "synchronous on a GPU; use cudaHostAlloc\n",
          dst_dev ? "from" : "into", host, len);
  abort();
}

/* What each copy direction requires of its pointers: device memory where
 * the direction says so, every device range inside one allocation, and
 * each reachable from the device whose stream runs the copy.  A range that
 * device was not granted is an illegal address, which ends its context
 * (sticky), as the fault would on a GPU. */
static _Atomic unsigned long copy_calls;

unsigned long spfake_copy_calls(void) { return atomic_load(&copy_calls); }

static cudaError_t check_copy(void *dst, const void *src, size_t dlen,
                              size_t slen, enum cudaMemcpyKind kind,
                              cudaStream_t stream) {
  atomic_fetch_add(&copy_calls, 1);
  bool dst_dev, src_dev;
  switch (kind) {
  case cudaMemcpyHostToHost: dst_dev = src_dev = false; break;
  case cudaMemcpyHostToDevice: dst_dev = true; src_dev = false; break;
  case cudaMemcpyDeviceToHost: dst_dev = false; src_dev = true; break;
  case cudaMemcpyDeviceToDevice: dst_dev = src_dev = true; break;
  case cudaMemcpyDefault: dst_dev = src_dev = false; break;
  default: return cudaErrorInvalidMemcpyDirection;
  }
  if (kind == cudaMemcpyHostToHost)
    return cudaSuccess;
  int phys = stream_phys(stream);
  if (phys < 0)
    return cudaErrorInvalidResourceHandle;
  cudaError_t err = fake_check_range(dst, dlen, FAKE_WRITE, dst_dev, phys);
  if (err == cudaSuccess)
    err = fake_check_range(src, slen, FAKE_READ, src_dev, phys);
  if (err == cudaSuccess && injected_fault(phys))
    err = cudaErrorIllegalAddress;
  if (err == cudaErrorIllegalAddress)
    fake_fault(phys, err);
  if (err == cudaSuccess)
    check_pageable(dst, src, dlen, slen);
  return err;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                            enum cudaMemcpyKind kind, cudaStream_t stream) {
  FAKE_LIVE();
  cudaError_t err = check_copy(dst, src, count, count, kind, stream);
  if (err != cudaSuccess)
    return fake_error(err);
  struct op *op = op_new(OP_COPY);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.copy.dst = dst;
  op->u.copy.src = src;
  op->u.copy.n = count;
  op_ranges(op, dst, src);
  return stream_push(stream, op);
}

/* The bytes a pitched region spans: (height - 1) rows of pitch, plus width. */
static bool pitched_extent(size_t pitch, size_t width, size_t height,
                           size_t *extent) {
  if (height == 0 || width == 0) {
    *extent = 0;
    return true;
  }
  if (height - 1 > (SIZE_MAX - width) / pitch)
    return false;
  *extent = (height - 1) * pitch + width;
  return true;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src,
                              size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t stream) {
  FAKE_LIVE();
  if (dpitch < width || spitch < width)
    return fake_error(cudaErrorInvalidPitchValue);
  size_t dlen, slen;
  if (!pitched_extent(dpitch, width, height, &dlen) ||
      !pitched_extent(spitch, width, height, &slen))
    return fake_error(cudaErrorInvalidValue);
  cudaError_t err = check_copy(dst, src, dlen, slen, kind, stream);
  if (err != cudaSuccess)
    return fake_error(err);
  struct op *op = op_new(OP_COPY2D);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.copy2d.dst = dst;
  op->u.copy2d.dpitch = dpitch;
  op->u.copy2d.src = src;
  op->u.copy2d.spitch = spitch;
  op->u.copy2d.width = dlen == 0 ? 0 : width;
  op->u.copy2d.height = height;
  op_ranges(op, dst, src);
  return stream_push(stream, op);
}

/* One side of a 3-D copy between linear memories (cudaMemcpy3D): the
 * address of its first byte and its slice pitch, once the position and the
 * extent are checked against the pitched pointer's logical size ("The
 * source object must entirely contain the region defined by srcPos and
 * extent"); false when they are not. */
static bool pitched_3d(const struct cudaPitchedPtr *pp,
                       const struct cudaPos *pos, const struct cudaExtent *ex,
                       char **first, size_t *slice, size_t *span) {
  if (pp->ptr == NULL || pp->pitch < pp->xsize || pos->x > pp->xsize ||
      ex->width > pp->xsize - pos->x || pos->y > pp->ysize ||
      ex->height > pp->ysize - pos->y || pp->ysize > SIZE_MAX / pp->pitch)
    return false;
  *slice = pp->pitch * pp->ysize;
  size_t rows;
  if (!pitched_extent(pp->pitch, ex->width, ex->height, &rows) ||
      (ex->depth > 0 && ex->depth - 1 > (SIZE_MAX - rows) / *slice))
    return false;
  *span = ex->depth == 0 || rows == 0 ? 0 : (ex->depth - 1) * *slice + rows;
  *first = (char *)pp->ptr + pos->z * *slice + pos->y * pp->pitch + pos->x;
  return true;
}

cudaError_t cudaMemcpy3DAsync(const struct cudaMemcpy3DParms *p,
                              cudaStream_t stream) {
  FAKE_LIVE();
  /* Arrays are not modelled: the fake's objects are linear memory. */
  if (p == NULL || p->srcArray != NULL || p->dstArray != NULL)
    return fake_error(cudaErrorInvalidValue);
  char *src, *dst;
  size_t sslice, dslice, slen, dlen;
  if (!pitched_3d(&p->srcPtr, &p->srcPos, &p->extent, &src, &sslice, &slen) ||
      !pitched_3d(&p->dstPtr, &p->dstPos, &p->extent, &dst, &dslice, &dlen))
    return fake_error(cudaErrorInvalidValue);
  cudaError_t err = check_copy(dst, src, dlen, slen, p->kind, stream);
  if (err != cudaSuccess)
    return fake_error(err);
  struct op *op = op_new(OP_COPY3D);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.copy3d.dst = dst;
  op->u.copy3d.dpitch = p->dstPtr.pitch;
  op->u.copy3d.dslice = dslice;
  op->u.copy3d.src = src;
  op->u.copy3d.spitch = p->srcPtr.pitch;
  op->u.copy3d.sslice = sslice;
  op->u.copy3d.width = dlen == 0 ? 0 : p->extent.width;
  op->u.copy3d.height = p->extent.height;
  op->u.copy3d.depth = p->extent.depth;
  op_ranges(op, dst, src);
  return stream_push(stream, op);
}

cudaError_t cudaMemcpyPeerAsync(void *dst, int dstDevice, const void *src,
                                int srcDevice, size_t count,
                                cudaStream_t stream) {
  FAKE_LIVE();
  if (fake_physical(dstDevice) < 0 || fake_physical(srcDevice) < 0)
    return fake_error(cudaErrorInvalidDevice);
  cudaError_t err = check_copy(dst, src, count, count, cudaMemcpyDeviceToDevice,
                               stream);
  if (err != cudaSuccess)
    return fake_error(err);
  struct op *op = op_new(OP_COPY);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.copy.dst = dst;
  op->u.copy.src = src;
  op->u.copy.n = count;
  op_ranges(op, dst, src);
  return stream_push(stream, op);
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count,
                            cudaStream_t stream) {
  FAKE_LIVE();
  int phys = stream_phys(stream);
  if (phys < 0)
    return fake_error(cudaErrorInvalidResourceHandle);
  cudaError_t err = fake_check_range(devPtr, count, FAKE_WRITE, true, phys);
  if (err == cudaSuccess && injected_fault(phys))
    err = cudaErrorIllegalAddress;
  if (err == cudaErrorIllegalAddress)
    fake_fault(phys, err);
  if (err != cudaSuccess)
    return fake_error(err);
  struct op *op = op_new(OP_SET);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.set.dst = devPtr;
  op->u.set.value = value;
  op->u.set.n = count;
  op_ranges(op, devPtr, NULL);
  return stream_push(stream, op);
}

cudaError_t spfake_stream_enqueue(cudaStream_t stream, void (*fn)(void *),
                                  void *arg) {
  FAKE_LIVE();
  struct op *op = op_new(OP_HOST);
  if (op == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  op->u.host.fn = fn;
  op->u.host.arg = arg;
  return stream_push(stream, op);
}

/* The event a handle names, with a reference the caller drops. */
static struct fake_event *event_get(cudaEvent_t handle) {
  pthread_mutex_lock(&reg.lock);
  struct fake_event *ev = reg.events;
  while (ev != NULL && ev != (struct fake_event *)handle)
    ev = ev->next;
  if (ev != NULL)
    atomic_fetch_add(&ev->refs, 1);
  pthread_mutex_unlock(&reg.lock);
  return ev;
}

static void event_register(struct fake_event *ev) {
  pthread_mutex_lock(&reg.lock);
  ev->next = reg.events;
  reg.events = ev;
  pthread_mutex_unlock(&reg.lock);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  FAKE_LIVE();
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming |
                         cudaEventInterprocess;
  if (event == NULL || (flags & ~known) != 0 ||
      ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
    return fake_error(cudaErrorInvalidValue);
  struct fake_event *ev = calloc(1, sizeof(*ev));
  if (ev == NULL)
    return fake_error(cudaErrorMemoryAllocation);
  ev->flags = flags;
  ev->fd = -1;
  atomic_init(&ev->refs, 1);
  if (flags & cudaEventInterprocess) {
    struct stat st;
    ev->fd = memfd_create("spfake-event", MFD_CLOEXEC);
    void *p = MAP_FAILED;
    if (ev->fd >= 0 && ftruncate(ev->fd, sizeof(struct event_state)) == 0 &&
        fstat(ev->fd, &st) == 0)
      p = mmap(NULL, sizeof(struct event_state), PROT_READ | PROT_WRITE,
               MAP_SHARED, ev->fd, 0);
    if (p != MAP_FAILED) {
      ev->state = p;
      ev->mapped = true;
      ev->ino = (uint64_t)st.st_ino;
    }
  } else {
    ev->state = calloc(1, sizeof(*ev->state));
  }
  if (ev->state == NULL) {
    if (ev->fd >= 0)
      close(ev->fd);
    free(ev);
    return fake_error(cudaErrorMemoryAllocation);
  }
  event_register(ev);
  *event = (cudaEvent_t)ev;
  return cudaSuccess;
}

/* Returns at once; queued operations keep the event until they have run. */
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  FAKE_READY();
  pthread_mutex_lock(&reg.lock);
  struct fake_event **pp = &reg.events;
  while (*pp != NULL && *pp != (struct fake_event *)event)
    pp = &(*pp)->next;
  struct fake_event *ev = *pp;
  if (ev != NULL)
    *pp = ev->next;
  pthread_mutex_unlock(&reg.lock);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  event_unref(ev);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  FAKE_LIVE();
  struct fake_event *ev = event_get(event);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  struct op *op = op_new(OP_RECORD);
  if (op == NULL) {
    event_unref(ev);
    return fake_error(cudaErrorMemoryAllocation);
  }
  op->u.event.ev = ev;
  op->u.event.seq = atomic_fetch_add(&ev->state->recorded, 1) + 1;
  cudaError_t err = stream_push(stream, op);
  if (err != cudaSuccess) {
    /* The record was counted; complete it so that waiters do not hang on a
     * record that will never run. */
    uint64_t seq = atomic_load(&ev->state->recorded);
    uint64_t cur = atomic_load(&ev->state->completed);
    while (cur < seq && !atomic_compare_exchange_weak(&ev->state->completed, &cur, seq))
      ;
    event_unref(ev);
  }
  return err;
}

/* "Not ready" is an answer, not an error: it is not recorded as one. */
cudaError_t cudaEventQuery(cudaEvent_t event) {
  FAKE_LIVE();
  struct fake_event *ev = event_get(event);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  bool done = atomic_load(&ev->state->completed) >=
              atomic_load(&ev->state->recorded);
  event_unref(ev);
  return done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  FAKE_LIVE();
  struct fake_event *ev = event_get(event);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  event_wait(ev, atomic_load(&ev->state->recorded));
  event_unref(ev);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned int flags) {
  FAKE_LIVE();
  if (flags != 0)
    return fake_error(cudaErrorInvalidValue);
  struct fake_event *ev = event_get(event);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  struct op *op = op_new(OP_WAIT);
  if (op == NULL) {
    event_unref(ev);
    return fake_error(cudaErrorMemoryAllocation);
  }
  op->u.event.ev = ev;
  op->u.event.seq = atomic_load(&ev->state->recorded);
  cudaError_t err = stream_push(stream, op);
  if (err != cudaSuccess)
    event_unref(ev);
  return err;
}

cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *handle,
                                  cudaEvent_t event) {
  FAKE_LIVE();
  const struct fake_config *cfg = fake_config(NULL);
  if (handle == NULL)
    return fake_error(cudaErrorInvalidValue);
  struct fake_event *ev = event_get(event);
  if (ev == NULL)
    return fake_error(cudaErrorInvalidResourceHandle);
  if (!(ev->flags & cudaEventInterprocess) || ev->fd < 0) {
    event_unref(ev);
    return fake_error(cudaErrorInvalidResourceHandle);
  }
  struct ipc_event_wire w = {.node = cfg->node, .pid = (int32_t)getpid(),
                             .fd = ev->fd, .ino = ev->ino};
  memcpy(w.magic, ipc_event_magic, sizeof(w.magic));
  event_unref(ev);
  memset(handle, 0, sizeof(*handle));
  memcpy(handle->reserved, &w, sizeof(w));
  return cudaSuccess;
}

/* The imported event shares the exporter's counters and behaves like a
 * local event created with cudaEventDisableTiming, as documented. */
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *event,
                                   cudaIpcEventHandle_t handle) {
  FAKE_LIVE();
  const struct fake_config *cfg = fake_config(NULL);
  struct ipc_event_wire w;
  memcpy(&w, handle.reserved, sizeof(w));
  if (event == NULL || memcmp(w.magic, ipc_event_magic, sizeof(w.magic)) != 0 ||
      w.node != cfg->node)
    return fake_error(cudaErrorInvalidValue);
  if (w.pid == (int32_t)getpid())
    return fake_error(cudaErrorDeviceUninitialized);
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)w.pid, (int)w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd < 0)
    return fake_error(cudaErrorMapBufferObjectFailed);
  void *p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_ino == w.ino &&
      (size_t)st.st_size >= sizeof(struct event_state))
    p = mmap(NULL, sizeof(struct event_state), PROT_READ | PROT_WRITE,
             MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED)
    return fake_error(cudaErrorMapBufferObjectFailed);
  struct fake_event *ev = calloc(1, sizeof(*ev));
  if (ev == NULL) {
    munmap(p, sizeof(struct event_state));
    return fake_error(cudaErrorMemoryAllocation);
  }
  ev->flags = cudaEventDisableTiming;
  ev->state = p;
  ev->mapped = true;
  ev->fd = -1;
  atomic_init(&ev->refs, 1);
  event_register(ev);
  *event = (cudaEvent_t)ev;
  return cudaSuccess;
}
