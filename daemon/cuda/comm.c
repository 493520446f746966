/*
 * comm.c - NCCL between nodes: a job's communicators, their warm-up, the
 * rounds' sends and receives, the watchdog and the abort; see gpu.h.
 *
 * The rules (DESIGN section 8, from NCCL's own documentation and sources):
 *   - one thread issues every local rank's operations inside one
 *     ncclGroupStart/End, and every rank splits its groups identically (a
 *     group per round, on every rank), or ranks of one node wait for each
 *     other's kernels and deadlock;
 *   - the local communicators are created inside one group, cudaSetDevice
 *     before each ncclCommInitRankConfig;
 *   - communicators are non-blocking: no call waits for a peer, and the
 *     caller polls ncclCommGetAsyncError (ncclInProgress while set-up or a
 *     launch is still being enqueued) with its own deadline; a failed,
 *     timed-out or canceled operation ends with ncclCommAbort on every
 *     local communicator, which makes their peers' operations fail too, so
 *     the job fails on every node instead of hanging;
 *   - a one-element all-reduce on every communicator warms them before the
 *     pool takes device memory (connections are set up lazily and allocate
 *     device memory of their own).
 *
 * A round's bucket travels as bytes (ncclUint8): the transport moves every
 * dtype exactly, fp8 and packed integers included.  Each local rank packs
 * its send buckets, bucket after bucket in the plan's order, into its
 * staging buffer, receives its buckets after them, and unpacks them into
 * the owners' tensors; packing, the group and unpacking are ordered on the
 * rank's own stream.  Staging grows to the largest round and is kept with
 * the communicators for the job's next export.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/fail.h"
#include "daemon/cuda/internal.h"
#include "proto/monotonic.h"
#include "shardport.h"

struct comm_rank {
  struct gpu_comm_rank id;
  ncclComm_t comm;
  cudaStream_t stream;
  cudaEvent_t event;
  uint8_t *staging;
  uint64_t staging_size;
  bool pending; /* an event was recorded and has not been seen complete */
};

struct gpu_comms {
  struct gpu *gpu;
  uint32_t world;
  uint8_t id[GPU_NCCL_ID_BYTES];
  size_t n; /* ranks holds GPU_MAX_DEVICES */
  struct comm_rank *ranks;
  bool aborted;
};

/* A peer's failure (its process died, its node aborted) is node_lost:
 * the job fails everywhere naming it; anything else is this node's
 * backend failing. */
static int nccl_fail(const struct gpu_comms *c, ncclResult_t res,
                     const char *what, char *msg, size_t msglen) {
  int rc = cuda_api_nccl_error(&c->gpu->api, res, what, msg, msglen);
  return res == ncclRemoteError ? SP_ENODELOST : rc;
}

int gpu_comms_unique_id(struct gpu *gpu, uint8_t id[GPU_NCCL_ID_BYTES],
                        char *msg, size_t msglen) {
  ncclUniqueId uid;
  ncclResult_t res = gpu->api.ncclGetUniqueId(&uid);
  if (res != ncclSuccess)
    return cuda_api_nccl_error(&gpu->api, res, "ncclGetUniqueId", msg, msglen);
  memcpy(id, uid.internal, GPU_NCCL_ID_BYTES);
  return 0;
}

void gpu_comms_abort(struct gpu_comms *c) {
  if (c == NULL || c->aborted)
    return;
  c->aborted = true;
  for (size_t i = 0; i < c->n; i++)
    if (c->ranks[i].comm != NULL) {
      c->gpu->api.cudaSetDevice(c->ranks[i].id.device);
      c->gpu->api.ncclCommAbort(c->ranks[i].comm);
      c->ranks[i].comm = NULL;
    }
}

bool gpu_comms_failed(const struct gpu_comms *c) { return c->aborted; }

ncclComm_t gpu_comms_comm(const struct gpu_comms *c, size_t i) {
  return c->ranks[i].comm;
}

cudaStream_t gpu_comms_stream(const struct gpu_comms *c, size_t i) {
  return c->ranks[i].stream;
}

/* Polls every communicator until none is still enqueuing (set-up, a
 * launch, a finalize): 0, or a code with msg after an error or the
 * deadline, or when *cancel turns true.  Aborts nothing itself. */
static int poll_once(struct gpu_comms *c, const char *what, char *msg,
                     size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  bool busy = false;
  for (size_t i = 0; i < c->n; i++) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t res = a->ncclCommGetAsyncError(c->ranks[i].comm, &st);
    if (res != ncclSuccess)
      st = res;
    if (st == ncclInProgress) {
      busy = true;
    } else if (st != ncclSuccess) {
      char w[96];
      snprintf(w, sizeof w, "%s on NCCL rank %" PRIu32, what,
               c->ranks[i].id.rank);
      return nccl_fail(c, st, w, msg, msglen);
    }
  }
  return busy ? 1 : 0;
}

static int settle(struct gpu_comms *c, uint64_t deadline,
                  const _Atomic bool *cancel, const char *what, char *msg,
                  size_t msglen) {
  unsigned spins = 0;
  for (;;) {
    int p = poll_once(c, what, msg, msglen);
    if (p <= 0)
      return p;
    if (cancel != NULL && atomic_load(cancel))
      return sp__failf(msg, msglen, SP_EBUSY, "%s was canceled", what);
    if (monotonic_ms() > deadline)
      return sp__failf(msg, msglen, SP_ETIMEOUT,
                       "%s did not complete in time (a peer did not join or "
                       "stopped)",
                       what);
    gpu_backoff(&spins);
  }
}

static void free_ranks(struct gpu_comms *c) {
  const struct cuda_api *a = &c->gpu->api;
  for (size_t i = 0; i < c->n; i++) {
    struct comm_rank *cr = &c->ranks[i];
    a->cudaSetDevice(cr->id.device);
    if (cr->staging != NULL)
      a->cudaFree(cr->staging);
    if (cr->event != NULL)
      a->cudaEventDestroy(cr->event);
    if (cr->stream != NULL)
      a->cudaStreamDestroy(cr->stream);
  }
  free(c->ranks);
  free(c);
}

/* Records each rank's event and polls them and the communicators. */
static int wait_all(struct gpu_comms *c, uint64_t deadline, const char *what,
                    char *msg, size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  for (size_t i = 0; i < c->n; i++) {
    a->cudaSetDevice(c->ranks[i].id.device);
    cudaError_t err = a->cudaEventRecord(c->ranks[i].event, c->ranks[i].stream);
    if (err != cudaSuccess)
      return gpu_cuda_fail(c->gpu, err, "cudaEventRecord", msg, msglen);
    c->ranks[i].pending = true;
  }
  unsigned spins = 0;
  for (;;) {
    int q = gpu_comms_query(c, msg, msglen);
    if (q <= 0)
      return q;
    if (monotonic_ms() > deadline)
      return sp__failf(msg, msglen, SP_ETIMEOUT, "%s did not complete in time",
                       what);
    gpu_backoff(&spins);
  }
}

/* A one-element all-reduce on every local communicator, in one group. */
static int warm_up(struct gpu_comms *c, uint64_t deadline, char *msg,
                   size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  float *buf[GPU_MAX_DEVICES] = {0};
  int rc = 0;
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    a->cudaSetDevice(c->ranks[i].id.device);
    cudaError_t err = a->cudaMalloc((void **)&buf[i], sizeof(float));
    if (err == cudaSuccess)
      err = a->cudaMemsetAsync(buf[i], 0, sizeof(float), c->ranks[i].stream);
    if (err != cudaSuccess)
      rc = gpu_cuda_fail(c->gpu, err, "warming up", msg, msglen);
  }
  if (rc == 0) {
    a->ncclGroupStart();
    ncclResult_t res = ncclSuccess;
    for (size_t i = 0; i < c->n && res == ncclSuccess; i++) {
      a->cudaSetDevice(c->ranks[i].id.device);
      res = a->ncclAllReduce(buf[i], buf[i], 1, ncclFloat, ncclSum,
                             c->ranks[i].comm, c->ranks[i].stream);
    }
    ncclResult_t end = a->ncclGroupEnd();
    if (res == ncclSuccess)
      res = end;
    if (res != ncclSuccess && res != ncclInProgress)
      rc = nccl_fail(c, res, "the warm-up all-reduce", msg, msglen);
  }
  if (rc == 0)
    rc = settle(c, deadline, NULL, "the warm-up all-reduce", msg, msglen);
  if (rc == 0)
    rc = wait_all(c, deadline, "the warm-up all-reduce", msg, msglen);
  if (rc != 0)
    gpu_comms_abort(c);
  for (size_t i = 0; i < c->n; i++)
    if (buf[i] != NULL) {
      a->cudaSetDevice(c->ranks[i].id.device);
      a->cudaFree(buf[i]);
    }
  return rc;
}

int gpu_comms_begin(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                    uint32_t world, struct gpu_comms **out, char *msg,
                    size_t msglen) {
  struct gpu_comms *c = calloc(1, sizeof *c);
  if (c != NULL)
    c->ranks = calloc(GPU_MAX_DEVICES, sizeof *c->ranks);
  if (c == NULL || c->ranks == NULL) {
    free(c);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  c->gpu = gpu;
  c->world = world;
  memcpy(c->id, id, GPU_NCCL_ID_BYTES);
  *out = c;
  return 0;
}

bool gpu_comms_holds(const struct gpu_comms *c, uint32_t rank) {
  for (size_t i = 0; i < c->n; i++)
    if (c->ranks[i].id.rank == rank)
      return true;
  return false;
}

bool gpu_comms_match(const struct gpu_comms *c,
                     const struct gpu_comm_rank *ranks, size_t nranks) {
  if (c->n != nranks)
    return false;
  for (size_t k = 0; k < nranks; k++) {
    bool found = false;
    for (size_t i = 0; i < c->n && !found; i++)
      found = c->ranks[i].id.rank == ranks[k].rank &&
              c->ranks[i].id.device == ranks[k].device;
    if (!found)
      return false;
  }
  return true;
}

int gpu_comms_add(struct gpu_comms *c, const struct gpu_comm_rank *ranks,
                  size_t nranks, char *msg, size_t msglen) {
  struct gpu *gpu = c->gpu;
  const struct cuda_api *a = &gpu->api;
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted");
  if (nranks == 0 || c->n + nranks > GPU_MAX_DEVICES)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "a node holds 1 to %d ranks of a job's communicator, "
                     "not %zu",
                     GPU_MAX_DEVICES, c->n + nranks);
  size_t first = c->n;
  int rc = 0;
  for (size_t i = 0; i < nranks && rc == 0; i++) {
    struct comm_rank *cr = &c->ranks[c->n++];
    cr->id = ranks[i];
    rc = gpu_set_device(gpu, cr->id.device, msg, msglen);
    cudaError_t err = cudaSuccess;
    if (rc == 0)
      err = a->cudaStreamCreateWithFlags(&cr->stream, cudaStreamNonBlocking);
    if (rc == 0 && err == cudaSuccess)
      err = a->cudaEventCreateWithFlags(&cr->event, cudaEventDisableTiming);
    if (rc == 0 && err != cudaSuccess)
      rc = gpu_cuda_fail(gpu, err, "creating a communicator's stream", msg,
                         msglen);
  }
  if (rc != 0) {
    gpu_comms_abort(c);
    return rc;
  }
  ncclUniqueId uid;
  memcpy(uid.internal, c->id, GPU_NCCL_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t res = a->ncclGroupStart();
  for (size_t i = first; i < c->n && res == ncclSuccess; i++) {
    a->cudaSetDevice(c->ranks[i].id.device);
    res = a->ncclCommInitRankConfig(&c->ranks[i].comm, (int)c->world, uid,
                                    (int)c->ranks[i].id.rank, &config);
    if (res == ncclInProgress)
      res = ncclSuccess;
  }
  ncclResult_t end = a->ncclGroupEnd();
  if (res == ncclSuccess && end != ncclInProgress)
    res = end;
  if (res != ncclSuccess) {
    rc = nccl_fail(c, res, "ncclCommInitRankConfig", msg, msglen);
    /* Communicators that exist are aborted: a half-made set is of no use,
     * and an abort tells the other nodes' ranks at once. */
    gpu_comms_abort(c);
  }
  return rc;
}

int gpu_comms_poll(struct gpu_comms *c, char *msg, size_t msglen) {
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted");
  int rc = poll_once(c, "creating the communicators", msg, msglen);
  if (rc < 0)
    gpu_comms_abort(c);
  return rc;
}

int gpu_comms_warm(struct gpu_comms *c, uint32_t timeout_ms, char *msg,
                   size_t msglen) {
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted");
  uint64_t deadline = monotonic_ms() + timeout_ms;
  int rc = settle(c, deadline, NULL, "creating the communicators", msg,
                  msglen);
  if (rc == 0)
    rc = warm_up(c, deadline, msg, msglen);
  if (rc != 0)
    gpu_comms_abort(c);
  return rc;
}

int gpu_comms_create(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                     uint32_t world, const struct gpu_comm_rank *ranks,
                     size_t nranks, uint32_t timeout_ms,
                     struct gpu_comms **out, char *msg, size_t msglen) {
  struct gpu_comms *c;
  int rc = gpu_comms_begin(gpu, id, world, &c, msg, msglen);
  if (rc != 0)
    return rc;
  rc = gpu_comms_add(c, ranks, nranks, msg, msglen);
  if (rc == 0)
    rc = gpu_comms_warm(c, timeout_ms, msg, msglen);
  if (rc != 0) {
    gpu_comms_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

void gpu_comms_free(struct gpu_comms *c) {
  if (c == NULL)
    return;
  const struct cuda_api *a = &c->gpu->api;
  char msg[256];
  /* A set still being made (its ranks joined, no export warmed it) or
   * failing is aborted: finalize is for communicators that are set up. */
  if (!c->aborted && poll_once(c, "ncclCommFinalize", msg, sizeof msg) != 0)
    gpu_comms_abort(c);
  if (!c->aborted) {
    /* Finalize flushes what is still issued; non-blocking, it is polled
     * like everything else, and a communicator that will not finish is
     * aborted instead. */
    ncclResult_t res = ncclSuccess;
    for (size_t i = 0; i < c->n && (res == ncclSuccess || res == ncclInProgress);
         i++) {
      a->cudaSetDevice(c->ranks[i].id.device);
      res = a->ncclCommFinalize(c->ranks[i].comm);
    }
    if ((res != ncclSuccess && res != ncclInProgress) ||
        settle(c, monotonic_ms() + 5000, NULL, "ncclCommFinalize", msg,
               sizeof msg) != 0) {
      gpu_comms_abort(c);
    } else {
      for (size_t i = 0; i < c->n; i++) {
        a->cudaSetDevice(c->ranks[i].id.device);
        a->ncclCommDestroy(c->ranks[i].comm);
        c->ranks[i].comm = NULL;
      }
    }
  }
  free_ranks(c);
}

int gpu_comms_query(struct gpu_comms *c, char *msg, size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted");
  bool pending = false;
  for (size_t i = 0; i < c->n; i++) {
    struct comm_rank *cr = &c->ranks[i];
    ncclResult_t st = ncclSuccess;
    ncclResult_t res = a->ncclCommGetAsyncError(cr->comm, &st);
    if (res != ncclSuccess)
      st = res;
    if (st != ncclSuccess && st != ncclInProgress) {
      char what[64];
      snprintf(what, sizeof what, "NCCL rank %" PRIu32, cr->id.rank);
      int rc = nccl_fail(c, st, what, msg, msglen);
      gpu_comms_abort(c);
      return rc;
    }
    if (!cr->pending)
      continue;
    cudaError_t q = a->cudaEventQuery(cr->event);
    if (q == cudaErrorNotReady) {
      pending = true;
    } else {
      cr->pending = false;
      if (q != cudaSuccess) {
        a->cudaGetLastError();
        int rc = gpu_cuda_fail(c->gpu, q, "a communicator's stream", msg,
                               msglen);
        gpu_comms_abort(c);
        return rc;
      }
    }
  }
  return pending ? 1 : 0;
}

/* The round's buckets of one local rank: its sends, then its receives, at
 * consecutive offsets of its staging. */
struct rank_round {
  const struct plan_rank_round *pr;
  uint64_t send_bytes, recv_bytes;
};

static void measure(const struct plan_round *rd, uint32_t rank,
                    struct rank_round *out) {
  out->pr = &rd->ranks[rank];
  out->send_bytes = out->recv_bytes = 0;
  for (size_t b = 0; b < out->pr->nsend; b++)
    out->send_bytes += rd->buckets[out->pr->send_first + b].nbytes;
  for (size_t b = 0; b < out->pr->nrecv; b++)
    out->recv_bytes +=
        rd->buckets[rd->recv_order[out->pr->recv_first + b]].nbytes;
}

/* Staging of at least need bytes; the last round's work is done. */
static int grow_staging(struct gpu_comms *c, struct comm_rank *cr,
                        uint64_t need, char *msg, size_t msglen) {
  if (need <= cr->staging_size)
    return 0;
  const struct cuda_api *a = &c->gpu->api;
  a->cudaSetDevice(cr->id.device);
  if (cr->staging != NULL)
    a->cudaFree(cr->staging);
  cr->staging = NULL;
  cr->staging_size = 0;
  uint64_t size = need < (1u << 20) ? (1u << 20) : need;
  cudaError_t err = a->cudaMalloc((void **)&cr->staging, size);
  if (err != cudaSuccess) {
    a->cudaGetLastError();
    cr->staging = NULL;
    return sp__failf(msg, msglen,
                     err == cudaErrorMemoryAllocation ? SP_EPOOL : SP_EBACKEND,
                     "%s has no %" PRIu64 " bytes of device memory for NCCL "
                     "staging (CUDA error %d)",
                     gpu_device_name(c->gpu, cr->id.device), size, (int)err);
  }
  cr->staging_size = size;
  return 0;
}

/* Row-major strides of the box's shape: a move's bytes in a bucket. */
static void dense_strides(const struct xfer_box *box, int64_t *stride) {
  int64_t s = 1;
  for (int d = box->ndim; d-- > 0;) {
    stride[d] = s;
    s *= box->shape[d];
  }
}

/* Packs (send) or unpacks (receive) one bucket's moves on cr's stream. */
static int copy_bucket(struct gpu_comms *c, struct comm_rank *cr,
                       const struct engine *e, const struct plan_round *rd,
                       const struct plan_bucket *b, uint8_t *at, bool pack,
                       char *msg, size_t msglen) {
  for (size_t i = 0; i < b->nmoves; i++) {
    const struct plan_move *m = &rd->moves[b->first + i];
    /* A received replica stays in staging: the engine compares it with
     * the other holders' copies once the round is done (copy.c). */
    if (!pack && (m->flags & PLAN_MOVE_REPLICA))
      continue;
    const uint8_t *src;
    uint8_t *dst;
    struct xfer_box box;
    gpu_move_box(e, m, pack ? &src : NULL, pack ? NULL : &dst, &box);
    uint8_t *slot = at + m->bucket_offset;
    int rc;
    if (pack) {
      dense_strides(&box, box.dst_stride);
      rc = gpu_box_copy(c->gpu, cr->stream, slot, src, &box, msg, msglen);
    } else {
      dense_strides(&box, box.src_stride);
      rc = gpu_box_copy(c->gpu, cr->stream, dst, slot, &box, msg, msglen);
    }
    if (rc != 0)
      return rc;
  }
  return 0;
}

const uint8_t *gpu_comms_received(const struct gpu_comms *c,
                                  const struct plan_round *rd,
                                  const struct plan_move *m) {
  for (size_t i = 0; i < c->n; i++) {
    const struct comm_rank *cr = &c->ranks[i];
    if (cr->id.rank != m->dst)
      continue;
    struct rank_round rr;
    measure(rd, cr->id.rank, &rr);
    uint64_t off = rr.send_bytes;
    for (size_t k = 0; k < rr.pr->nrecv; k++) {
      const struct plan_bucket *b =
          &rd->buckets[rd->recv_order[rr.pr->recv_first + k]];
      if (m >= rd->moves + b->first && m < rd->moves + b->first + b->nmoves)
        return cr->staging + off + m->bucket_offset;
      off += b->nbytes;
    }
  }
  return NULL;
}

int gpu_comms_round(struct gpu_comms *c, const struct engine *e,
                    const struct plan_round *rd, uint64_t deadline_ms,
                    char *msg, size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted by an earlier "
                     "failure");
  struct rank_round rr[GPU_MAX_DEVICES];
  int rc = 0;
  /* Pack every local rank's sends. */
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    struct comm_rank *cr = &c->ranks[i];
    measure(rd, cr->id.rank, &rr[i]);
    rc = grow_staging(c, cr, rr[i].send_bytes + rr[i].recv_bytes, msg, msglen);
    if (rc != 0)
      break;
    a->cudaSetDevice(cr->id.device);
    uint64_t off = 0;
    for (size_t k = 0; k < rr[i].pr->nsend && rc == 0; k++) {
      const struct plan_bucket *b = &rd->buckets[rr[i].pr->send_first + k];
      rc = copy_bucket(c, cr, e, rd, b, cr->staging + off, true, msg, msglen);
      off += b->nbytes;
    }
  }
  /* One group of all local ranks' sends and receives, in the plan's order:
   * sends by (peer, dtype), receives by (peer, dtype), the same split on
   * every rank of every node. */
  if (rc == 0) {
    ncclResult_t res = a->ncclGroupStart();
    for (size_t i = 0; i < c->n && res == ncclSuccess; i++) {
      struct comm_rank *cr = &c->ranks[i];
      a->cudaSetDevice(cr->id.device);
      uint64_t off = 0;
      for (size_t k = 0; k < rr[i].pr->nsend && res == ncclSuccess; k++) {
        const struct plan_bucket *b = &rd->buckets[rr[i].pr->send_first + k];
        res = a->ncclSend(cr->staging + off, b->nbytes, ncclUint8, (int)b->dst,
                          cr->comm, cr->stream);
        off += b->nbytes;
      }
      for (size_t k = 0; k < rr[i].pr->nrecv && res == ncclSuccess; k++) {
        const struct plan_bucket *b =
            &rd->buckets[rd->recv_order[rr[i].pr->recv_first + k]];
        res = a->ncclRecv(cr->staging + off, b->nbytes, ncclUint8, (int)b->src,
                          cr->comm, cr->stream);
        off += b->nbytes;
      }
      if (res == ncclInProgress)
        res = ncclSuccess;
    }
    ncclResult_t end = a->ncclGroupEnd();
    if (res == ncclSuccess && end != ncclInProgress)
      res = end;
    if (res != ncclSuccess)
      rc = nccl_fail(c, res, "the round's sends and receives", msg, msglen);
  }
  if (rc == 0)
    rc = settle(c, deadline_ms, &e->cancel, "launching the round's sends and "
                "receives", msg, msglen);
  /* Unpack what arrived, after the receives in stream order. */
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    struct comm_rank *cr = &c->ranks[i];
    a->cudaSetDevice(cr->id.device);
    uint64_t off = rr[i].send_bytes;
    for (size_t k = 0; k < rr[i].pr->nrecv && rc == 0; k++) {
      const struct plan_bucket *b =
          &rd->buckets[rd->recv_order[rr[i].pr->recv_first + k]];
      rc = copy_bucket(c, cr, e, rd, b, cr->staging + off, false, msg, msglen);
      off += b->nbytes;
    }
  }
  for (size_t i = 0; i < c->n && rc == 0; i++) {
    struct comm_rank *cr = &c->ranks[i];
    a->cudaSetDevice(cr->id.device);
    cudaError_t err = a->cudaEventRecord(cr->event, cr->stream);
    if (err != cudaSuccess)
      rc = gpu_cuda_fail(c->gpu, err, "cudaEventRecord", msg, msglen);
    cr->pending = true;
  }
  if (rc != 0)
    gpu_comms_abort(c);
  return rc;
}
