/*
 * copy.c - the device engine: a plan's rounds run on the GPUs; see
 * gpu_engine_run in gpu.h.
 *
 * One thread issues everything.  Each round's local moves are copied
 * straight from the trainers' storages (opened IPC or cuMem mappings) into
 * the owners' segments, on this run's stream of the owner's GPU (no other
 * job's copies queue there; gpu_stream_take), all issued before any
 * is waited for (batched: the GPU's copy engines run them back to back);
 * under unified addressing a copy between two GPUs is a peer copy, direct
 * where peer access was enabled and staged by the runtime elsewhere.  The
 * round's moves between nodes go through NCCL (comm.c).  Then an event per
 * stream is recorded and polled, never waited on blindly: a stuck peer or
 * an async NCCL error must end in an error within the round's timeout, and
 * a canceled export (a lost rank) must stop within milliseconds.  A round
 * is counted moved when all its events have completed.
 *
 * Work already issued when an export fails still runs to its end on the
 * streams (copies are finite; NCCL operations end when the communicators
 * are aborted), and the engine waits for it before returning, so that the
 * segments are never freed under a running copy.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/cuda/internal.h"
#include "daemon/xfer/replicas.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* The widest pitch a 2-D copy is given: the real limit is the device's
 * cudaDevAttrMaxPitch (2^31 - 1 or more); wider strides copy row by row. */
#define GPU_MAX_PITCH ((size_t)INT32_MAX)

void gpu_backoff(unsigned *spins) {
  /* 20 us at first, up to 1 ms: a round of small copies is done in tens of
   * microseconds, a large one in tens of milliseconds. */
  unsigned us = *spins < 50 ? 20 : 1000;
  (*spins)++;
  struct timespec ts = {0, (long)us * 1000};
  nanosleep(&ts, NULL);
}

static int copy_2d(const struct gpu *gpu, cudaStream_t stream, uint8_t *dst,
                   size_t dpitch, const uint8_t *src, size_t spitch,
                   size_t width, size_t height, char *msg, size_t msglen) {
  const struct cuda_api *a = &gpu->api;
  cudaError_t err;
  if (height == 1 || dpitch > GPU_MAX_PITCH || spitch > GPU_MAX_PITCH) {
    for (size_t row = 0; row < height; row++) {
      err = a->cudaMemcpyAsync(dst + row * dpitch, src + row * spitch, width,
                               cudaMemcpyDefault, stream);
      if (err != cudaSuccess)
        return gpu_cuda_fail(gpu, err, "cudaMemcpyAsync", msg, msglen);
    }
    return 0;
  }
  err = a->cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                             cudaMemcpyDefault, stream);
  if (err != cudaSuccess)
    return gpu_cuda_fail(gpu, err, "cudaMemcpy2DAsync", msg, msglen);
  return 0;
}

int gpu_box_copy(const struct gpu *gpu, cudaStream_t stream, uint8_t *dst,
                 const uint8_t *src, const struct xfer_box *box, char *msg,
                 size_t msglen) {
  for (int d = 0; d < box->ndim; d++)
    if (box->shape[d] == 0)
      return 0;
  struct xfer_box b;
  xfer_box_simplify(box, &b);
  size_t esz = b.elem_size;
  if (b.ndim == 0)
    return copy_2d(gpu, stream, dst, esz, src, esz, esz, 1, msg, msglen);
  int inner = b.ndim - 1;
  /* The slab: rows of a dense run, or single elements down a strided
   * innermost dimension; the dimensions outside it are walked here. */
  int slab_dim, outer;
  size_t width;
  if (b.src_stride[inner] == 1 && b.dst_stride[inner] == 1) {
    width = (size_t)b.shape[inner] * esz;
    if (b.ndim == 1)
      return copy_2d(gpu, stream, dst, width, src, width, width, 1, msg,
                     msglen);
    slab_dim = inner - 1;
  } else {
    width = esz;
    slab_dim = inner;
  }
  outer = slab_dim;
  size_t height = (size_t)b.shape[slab_dim];
  size_t spitch = (size_t)b.src_stride[slab_dim] * esz;
  size_t dpitch = (size_t)b.dst_stride[slab_dim] * esz;
  int64_t index[XFER_MAX_DIMS] = {0};
  for (;;) {
    int64_t so = 0, doff = 0;
    for (int d = 0; d < outer; d++) {
      so += index[d] * b.src_stride[d];
      doff += index[d] * b.dst_stride[d];
    }
    int rc = copy_2d(gpu, stream, dst + (size_t)doff * esz, dpitch,
                     src + (size_t)so * esz, spitch, width, height, msg,
                     msglen);
    if (rc != 0)
      return rc;
    int d = outer - 1;
    while (d >= 0 && ++index[d] == b.shape[d])
      index[d--] = 0;
    if (d < 0)
      return 0;
  }
}

void gpu_move_box(const struct engine *e, const struct plan_move *m,
                  const uint8_t **src, uint8_t **dst, struct xfer_box *box) {
  const struct plan_key *key = &e->plan->keys[m->key];
  size_t esz = sp__dtype_size(key->dtype);
  struct sp_view sv;
  struct plan_region dr;
  plan_moves_regions(e->plan, m, &sv, &dr);
  memset(box, 0, sizeof *box);
  box->ndim = (int)sv.ndim;
  box->elem_size = esz;
  for (uint32_t d = 0; d < sv.ndim; d++) {
    box->shape[d] = sv.shape[d];
    box->src_stride[d] = sv.stride[d];
    box->dst_stride[d] = dr.stride[d];
  }
  if (src != NULL)
    *src = e->src[m->src][m->storage].gpu.data + (size_t)sv.offset * esz;
  if (dst != NULL)
    *dst = e->dst[m->dst] + e->key_offset[m->key] + (size_t)dr.offset * esz;
}

/* The run's state besides struct engine. */
struct runner {
  struct engine *e;
  const struct gpu_run *run;
  const struct cuda_api *a;
  cudaEvent_t events[GPU_MAX_DEVICES]; /* one per device, re-recorded */
  cudaStream_t streams[GPU_MAX_DEVICES]; /* this run's own, taken on use */
  bool used[GPU_MAX_DEVICES];          /* streams with work this step */
  bool comm_used;                      /* NCCL work this step */
};

static int run_fail(struct engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int run_fail(struct engine *e, int code, const char *fmt, ...) {
  if (e->rc == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->rc = code;
  }
  return e->rc;
}

static bool canceled(const struct engine *e) {
  return atomic_load_explicit(&e->cancel, memory_order_relaxed);
}

static bool is_local(const struct runner *r, uint32_t rank) {
  return r->e->plan->node[rank] == r->run->node;
}

/* The run's stream on device d, taken at its first use (gpu_stream_take):
 * no other run's copies are queued on it.  NULL after a failure, which is
 * the run's. */
static cudaStream_t run_stream(struct runner *r, int d) {
  if (r->streams[d] == NULL) {
    char why[SP_ERRMSG_MAX + 1];
    if (gpu_stream_take(r->run->gpu, d, &r->streams[d], why, sizeof why) != 0)
      run_fail(r->e, SP_EBACKEND, "%s", why);
  }
  return r->streams[d];
}

/* Records an event on every stream that has work and waits for all of
 * them, watching the communicators, e->cancel and the deadline.  On a
 * failure or cancel the communicators are aborted and the streams are
 * still waited for (their work then ends), at most one more timeout. */
static int wait_step(struct runner *r, uint32_t round) {
  struct engine *e = r->e;
  const struct gpu *gpu = r->run->gpu;
  char why[SP_ERRMSG_MAX + 1];
  for (int d = 0; d < gpu->ndevices; d++) {
    if (!r->used[d])
      continue;
    r->a->cudaSetDevice(d);
    cudaError_t err = r->a->cudaEventRecord(r->events[d], r->streams[d]);
    if (err != cudaSuccess) {
      gpu_cuda_fail(gpu, err, "cudaEventRecord", why, sizeof why);
      run_fail(e, SP_EBACKEND, "round %" PRIu32 ": %s", round, why);
      r->used[d] = false;
    }
  }
  uint64_t deadline = monotonic_ms() + r->run->timeout_ms;
  bool stopping = e->rc != 0;
  unsigned spins = 0;
  for (;;) {
    bool pending = false;
    for (int d = 0; d < gpu->ndevices; d++) {
      if (!r->used[d])
        continue;
      cudaError_t q = r->a->cudaEventQuery(r->events[d]);
      if (q == cudaErrorNotReady) {
        pending = true;
        continue;
      }
      r->used[d] = false;
      if (q != cudaSuccess) {
        r->a->cudaGetLastError();
        gpu_cuda_fail(gpu, q, "copying on the GPU", why, sizeof why);
        run_fail(e, SP_EBACKEND, "round %" PRIu32 " on %s: %s", round,
                 gpu_device_name(gpu, d), why);
      }
    }
    if (r->comm_used) {
      int q = gpu_comms_query(r->run->comms, why, sizeof why);
      if (q == 1) {
        pending = true;
      } else {
        r->comm_used = false;
        if (q < 0)
          run_fail(e, q, "round %" PRIu32 ": %s", round, why);
      }
    }
    if (!pending)
      return e->rc;
    if (!stopping && (e->rc != 0 || canceled(e) || monotonic_ms() > deadline)) {
      if (e->rc == 0 && !canceled(e))
        run_fail(e, SP_ETIMEOUT,
                 "round %" PRIu32 " made no progress in %" PRIu32
                 " ms on the GPUs",
                 round, r->run->timeout_ms);
      if (r->run->comms != NULL)
        gpu_comms_abort(r->run->comms);
      stopping = true;
      deadline = monotonic_ms() + r->run->timeout_ms;
    } else if (stopping && monotonic_ms() > deadline) {
      /* A GPU that never finishes: give up waiting; freeing the segments
       * synchronizes with the device. */
      return run_fail(e, SP_ETIMEOUT, "the GPUs did not finish round %" PRIu32,
                      round);
    }
    gpu_backoff(&spins);
  }
}

/* Zeroes every owner segment of this node: device memory comes back from
 * the allocator with whatever it held, maybe another rank's tensors. */
static int zero_segments(struct runner *r) {
  const struct gpu *gpu = r->run->gpu;
  char why[SP_ERRMSG_MAX + 1];
  for (uint32_t rank = 0; rank < r->e->plan->world; rank++) {
    struct gpu_segment *seg = r->run->segments[rank];
    if (seg == NULL)
      continue;
    const struct gpu_segment_info *in = gpu_segment_info(seg);
    r->a->cudaSetDevice(in->device);
    cudaStream_t stream = run_stream(r, in->device);
    if (stream == NULL)
      return r->e->rc;
    cudaError_t err = r->a->cudaMemsetAsync(in->ptr, 0, in->size, stream);
    if (err != cudaSuccess) {
      gpu_cuda_fail(gpu, err, "cudaMemsetAsync", why, sizeof why);
      return run_fail(r->e, SP_EBACKEND, "zeroing rank %" PRIu32 "'s segment: %s",
                      rank, why);
    }
    r->used[in->device] = true;
  }
  return 0;
}

static int issue_moves(struct runner *r, const struct plan_move *moves,
                       size_t n, uint32_t round) {
  struct engine *e = r->e;
  const struct gpu *gpu = r->run->gpu;
  char why[SP_ERRMSG_MAX + 1];
  int current = -1;
  for (size_t i = 0; i < n && !canceled(e); i++) {
    const struct plan_move *m = &moves[i];
    /* Replicas are compared once the round's other copies are done. */
    if (!is_local(r, m->src) || !is_local(r, m->dst) ||
        (m->flags & PLAN_MOVE_REPLICA))
      continue;
    const struct gpu_segment_info *seg =
        gpu_segment_info(r->run->segments[m->dst]);
    if (seg->device != current) {
      current = seg->device;
      r->a->cudaSetDevice(current);
    }
    const uint8_t *src;
    uint8_t *dst;
    struct xfer_box box;
    gpu_move_box(e, m, &src, &dst, &box);
    cudaStream_t stream = run_stream(r, current);
    if (stream == NULL)
      return e->rc;
    int rc = gpu_box_copy(gpu, stream, dst, src, &box,
                          why, sizeof why);
    if (rc != 0)
      return run_fail(e, rc,
                      "round %" PRIu32 ": copying key '%s' from rank %" PRIu32
                      " to rank %" PRIu32 ": %s",
                      round, e->plan->keys[m->key].name, m->src, m->dst, why);
    r->used[current] = true;
  }
  return 0;
}

/* Refuses what the device engine cannot do before anything moves, alike on
 * every node (each sees the same plan): moves between nodes need the
 * job's communicators (daemon/comms.c makes them for every job across nodes;
 * this is the guard that nothing else reaches the engine). */
/* Refuses a device a sticky error ended (gpu_failure): no copy may run on
 * it, or read from it. */
static int check_device(struct runner *r, int device) {
  char why[SP_ERRMSG_MAX + 1];
  if (gpu_failure(r->run->gpu, device, why, sizeof why) != device)
    return 0;
  return run_fail(r->e, SP_EBACKEND, "%s", why);
}

static int check_plan(struct runner *r) {
  const struct plan *plan = r->e->plan;
  for (uint32_t rank = 0; rank < plan->world; rank++)
    if (r->run->segments[rank] != NULL &&
        check_device(r, gpu_segment_info(r->run->segments[rank])->device) != 0)
      return r->e->rc;
  for (size_t k = 0; k < plan->nrounds; k++) {
    const struct plan_round *rd = &plan->rounds[k];
    for (size_t i = 0; i < rd->nlocal; i++) {
      const struct plan_move *m = &rd->local[i];
      if (is_local(r, m->src) &&
          check_device(r, r->e->src[m->src][m->storage].gpu.device) != 0)
        return r->e->rc;
    }
    if (rd->nmoves > 0 && r->run->comms == NULL)
      return run_fail(r->e, SP_EUNSUPPORTED,
                      "key '%s' moves between nodes, but this node has no "
                      "NCCL communicators for the job",
                      plan->keys[rd->moves[0].key].name);
  }
  return 0;
}

/* ---- replicas ---- */

/* One replica of a key landing on an owner of this node: read from the
 * source rank's storage (a local move) or from the owner's NCCL staging
 * (a move received from another node). */
struct replica {
  const struct plan_move *m;
  const uint8_t *src; /* device address of its first element */
  struct xfer_box box;
  struct plan_region dr;
};

static bool replica_before(const struct replica *a, const struct replica *b) {
  return a->m->src != b->m->src ? a->m->src < b->m->src
                                : a->m->piece < b->m->piece;
}

/* Waits for the work issued on device d (a step of the replica pass). */
static int sync_device(struct runner *r, int d, uint32_t round) {
  r->used[d] = true;
  return wait_step(r, round);
}

/* The replicas of key k to local owner o in round rd, compared as the host
 * engine does (engine.c): in order of (source rank, piece), each replica is
 * copied to host staging; an element nobody wrote yet takes its bytes, an
 * element written before must match them byte for byte, else the export
 * fails with different_data naming the key, the element and both ranks.
 * The agreed bytes are then copied into the owner's tensor.  Host staging
 * is the key's size plus its largest replica. */
static int compare_key(struct runner *r, const struct plan_round *rd,
                       uint32_t o, uint32_t k, struct replica *list,
                       uint32_t round) {
  struct engine *e = r->e;
  const struct gpu *gpu = r->run->gpu;
  const struct plan_key *key = &e->plan->keys[k];
  size_t esz = sp__dtype_size(key->dtype);
  char why[SP_ERRMSG_MAX + 1];
  size_t n = 0;
  uint64_t largest = 0;
  const struct plan_move *lists[2] = {rd->local, rd->moves};
  size_t counts[2] = {rd->nlocal, rd->nmoves};
  for (int l = 0; l < 2; l++)
    for (size_t i = 0; i < counts[l]; i++) {
      const struct plan_move *m = &lists[l][i];
      if (m->key != k || m->dst != o || !(m->flags & PLAN_MOVE_REPLICA))
        continue;
      struct replica *p = &list[n];
      *p = (struct replica){.m = m};
      struct sp_view sv;
      plan_moves_regions(e->plan, m, &sv, &p->dr);
      if (l == 0) {
        gpu_move_box(e, m, &p->src, NULL, &p->box);
      } else {
        gpu_move_box(e, m, NULL, NULL, &p->box);
        int64_t st = 1;
        for (int d = p->box.ndim; d-- > 0;) {
          p->box.src_stride[d] = st;
          st *= p->box.shape[d];
        }
        p->src = gpu_comms_received(r->run->comms, rd, m);
        if (p->src == NULL)
          return run_fail(e, SP_EINTERNAL,
                          "round %" PRIu32 ": key '%s': rank %" PRIu32
                          "'s replica was not received",
                          round, key->name, m->src);
      }
      /* Insertion by (source rank, piece): the first holder's bytes
       * stand, on every node alike. */
      size_t j = n++;
      while (j > 0 && replica_before(p, &list[j - 1]))
        j--;
      struct replica tmp = *p;
      memmove(&list[j + 1], &list[j], (n - 1 - j) * sizeof *list);
      list[j] = tmp;
      if (m->nbytes > largest)
        largest = m->nbytes;
    }
  if (n == 0)
    return 0;
  uint64_t numel = key->nbytes / esz;
  uint8_t *image = malloc(key->nbytes > 0 ? key->nbytes : 1);
  uint8_t *seen = calloc((size_t)(numel / 8 + 1), 1);
  uint8_t *staged = malloc(largest > 0 ? largest : 1);
  int rc = 0;
  if (image == NULL || seen == NULL || staged == NULL) {
    rc = run_fail(e, SP_ENOMEM,
                  "out of memory comparing the replicas of key '%s'",
                  key->name);
    goto out;
  }
  int d = gpu_segment_info(r->run->segments[o])->device;
  cudaStream_t stream = run_stream(r, d);
  if (stream == NULL) {
    rc = e->rc;
    goto out;
  }
  for (size_t i = 0; i < n && rc == 0; i++) {
    struct replica *p = &list[i];
    struct xfer_box box = p->box;
    int64_t st = 1;
    for (int dd = box.ndim; dd-- > 0;) {
      box.dst_stride[dd] = st;
      st *= box.shape[dd];
    }
    r->a->cudaSetDevice(d);
    rc = gpu_box_copy(gpu, stream, staged, p->src, &box, why, sizeof why);
    if (rc != 0) {
      rc = run_fail(e, rc,
                    "round %" PRIu32 ": reading rank %" PRIu32
                    "'s replica of key '%s': %s",
                    round, p->m->src, key->name, why);
      break;
    }
    if ((rc = sync_device(r, d, round)) != 0 || canceled(e))
      break;
    /* Staging holds the replica contiguous: box.dst_stride. */
    int64_t t;
    if (!replicas_merge(image, seen, esz, staged, (uint32_t)box.ndim, box.shape,
                        box.dst_stride, &p->dr, &t)) {
      uint32_t earlier = p->m->src;
      for (size_t q = 0; q < i; q++)
        if (replicas_region_contains(&list[q].dr, t)) {
          earlier = list[q].m->src;
          break;
        }
      char msg[SP_ERRMSG_MAX + 1];
      rc = run_fail(
          e, replicas_disagree(key, t, earlier, p->m->src, msg, sizeof msg),
          "%s", msg);
      break;
    }
  }
  /* The agreed bytes into the owner's tensor. */
  for (size_t i = 0; i < n && rc == 0 && !canceled(e); i++) {
    const struct replica *p = &list[i];
    struct xfer_box box = p->box;
    for (int dd = 0; dd < box.ndim; dd++)
      box.src_stride[dd] = box.dst_stride[dd] = p->dr.stride[dd];
    size_t at = (size_t)p->dr.offset * esz;
    r->a->cudaSetDevice(d);
    rc = gpu_box_copy(gpu, stream, e->dst[o] + e->key_offset[k] + at,
                      image + at, &box, why, sizeof why);
    if (rc != 0)
      rc = run_fail(e, rc,
                    "round %" PRIu32 ": writing key '%s' to rank %" PRIu32
                    ": %s",
                    round, key->name, o, why);
  }
  /* The copies read image: it lives until they are done. */
  if (n > 0 && e->rc == 0)
    rc = sync_device(r, d, round);
  else if (n > 0)
    sync_device(r, d, round);
out:
  free(image);
  free(seen);
  free(staged);
  return rc != 0 ? rc : e->rc;
}

/* Every replicated key of round rd whose owner is on this node, once the
 * round's other copies and receives are done. */
static int compare_replicas(struct runner *r, const struct plan_round *rd,
                            uint32_t round) {
  struct engine *e = r->e;
  size_t most = rd->nlocal + rd->nmoves;
  bool any = false;
  for (size_t i = 0; i < rd->nlocal && !any; i++)
    any = (rd->local[i].flags & PLAN_MOVE_REPLICA) != 0;
  for (size_t i = 0; i < rd->nmoves && !any; i++)
    any = (rd->moves[i].flags & PLAN_MOVE_REPLICA) != 0;
  if (!any)
    return 0;
  struct replica *list = calloc(most, sizeof *list);
  if (list == NULL)
    return run_fail(e, SP_ENOMEM, "out of memory comparing replicas");
  int rc = 0;
  for (size_t i = 0; i < rd->nkeys && rc == 0 && !canceled(e); i++) {
    uint32_t k = e->plan->transfer[rd->first + i];
    uint32_t o = e->plan->keys[k].owner;
    if (o < e->plan->world && r->run->segments[o] != NULL && is_local(r, o))
      rc = compare_key(r, rd, o, k, list, round);
  }
  free(list);
  return rc;
}

/* The bytes of a round this node moves: the copies into its owners, and
 * every bucket it sends or receives (as remote.c counts them for the host
 * transport, so progress reaches the export's total on every node). */
static uint64_t round_bytes(const struct runner *r,
                            const struct plan_round *rd) {
  uint64_t n = 0;
  for (size_t i = 0; i < rd->nlocal; i++)
    if (is_local(r, rd->local[i].dst))
      n += rd->local[i].nbytes;
  for (size_t b = 0; b < rd->nbuckets; b++)
    if (is_local(r, rd->buckets[b].src) != is_local(r, rd->buckets[b].dst))
      n += rd->buckets[b].nbytes;
  return n;
}

static void pause_ms(struct engine *e, uint32_t ms) {
  for (uint32_t waited = 0; waited < ms && !canceled(e); waited += 10) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

static int run_rounds(struct runner *r) {
  struct engine *e = r->e;
  const struct plan *plan = e->plan;
  if (check_plan(r) != 0 || zero_segments(r) != 0 || wait_step(r, 0) != 0)
    return e->rc;
  /* The segments are ready: status says allocating until round 1, and the
   * test seam pauses here too, as the host engine does. */
  for (uint32_t rank = 0; rank < plan->world; rank++)
    atomic_fetch_add(&e->bytes_prepared, e->dst_size[rank]);
  pause_ms(e, e->round_delay_ms);
  for (size_t k = 0; k < plan->nrounds && !canceled(e); k++) {
    const struct plan_round *rd = &plan->rounds[k];
    uint32_t round = (uint32_t)(k + 1);
    atomic_store(&e->round, round);
    if (e->notify != NULL)
      e->notify(e->notify_arg);
    if (issue_moves(r, rd->local, rd->nlocal, round) == 0 &&
        rd->nmoves > 0) {
      char why[SP_ERRMSG_MAX + 1];
      int rc =
          gpu_comms_round(r->run->comms, e, rd,
                          monotonic_ms() + r->run->timeout_ms, why, sizeof why);
      if (rc != 0)
        run_fail(e, rc, "round %" PRIu32 ": %s", round, why);
      else
        r->comm_used = true;
    }
    if (wait_step(r, round) != 0 || compare_replicas(r, rd, round) != 0)
      return e->rc;
    atomic_fetch_add(&e->bytes_moved, round_bytes(r, rd));
    pause_ms(e, e->round_delay_ms);
  }
  if (canceled(e))
    return run_fail(e, SP_EBUSY, "the export was canceled");
  /* Every owner's event marks its tensors assembled: the library waits on
   * it before handing out a pointer. */
  for (uint32_t rank = 0; rank < plan->world; rank++) {
    struct gpu_segment *seg = r->run->segments[rank];
    if (seg == NULL)
      continue;
    int d = gpu_segment_info(seg)->device;
    r->a->cudaSetDevice(d);
    cudaStream_t stream = run_stream(r, d);
    if (stream == NULL)
      return e->rc;
    cudaError_t err = r->a->cudaEventRecord(gpu_segment_event(seg), stream);
    if (err != cudaSuccess) {
      char why[SP_ERRMSG_MAX + 1];
      gpu_cuda_fail(r->run->gpu, err, "cudaEventRecord", why, sizeof why);
      return run_fail(e, SP_EBACKEND, "marking rank %" PRIu32 "'s tensors: %s",
                      rank, why);
    }
  }
  return 0;
}

int gpu_engine_run(struct engine *e) {
  struct runner r = {.e = e, .run = e->gpu_run, .a = &e->gpu_run->gpu->api};
  const struct gpu *gpu = r.run->gpu;
  e->rc = 0;
  e->msg[0] = '\0';
  char why[SP_ERRMSG_MAX + 1];
  for (int d = 0; d < gpu->ndevices && e->rc == 0; d++) {
    /* A failed or skipped device gets no event: check_plan refuses a
     * plan that touches it (nothing registers there), and nothing else
     * runs there. */
    if (!gpu_device_usable(gpu, d))
      continue;
    r.a->cudaSetDevice(d);
    cudaError_t err =
        r.a->cudaEventCreateWithFlags(&r.events[d], cudaEventDisableTiming);
    if (err != cudaSuccess) {
      gpu_cuda_fail(gpu, err, "cudaEventCreateWithFlags", why, sizeof why);
      run_fail(e, SP_EBACKEND, "%s", why);
    }
  }
  if (e->rc == 0)
    run_rounds(&r);
  for (int d = 0; d < gpu->ndevices; d++) {
    if (r.events[d] != NULL)
      r.a->cudaEventDestroy(r.events[d]);
    if (r.streams[d] != NULL)
      gpu_stream_give(r.run->gpu, d, r.streams[d]);
  }
  return e->rc;
}
