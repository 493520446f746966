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
 *   - NCCL connects a send and a receive pair lazily, at the first send
 *     or receive to that peer, and allocates its buffers on the device
 *     then: the warm-up is a group of one-byte sends and receives to every
 *     peer the export's plan uses, before the pool takes device memory;
 *   - only one thread issues to a device's communicators at a time (the
 *     device's NCCL lock, held across each group), device memory is never
 *     freed under NCCL work (ncclwork.c), and abort and destroy run on
 *     helper threads, since either may block.
 *
 * A round's bucket travels as bytes (ncclUint8): the transport moves every
 * dtype exactly, fp8 and packed integers included.  Each local rank packs
 * its send buckets, bucket after bucket in the plan's order, into its
 * staging buffer, receives its buckets after them, and unpacks them into
 * the owners' tensors; packing, the group and unpacking are ordered on the
 * rank's own stream.  Staging is sized for the largest round of the plan
 * when the communicators are warmed for an export, never during one, and
 * kept with the communicators for the job's next export.
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
  /* A group was launched (gpu_nccl_begin) and its work not yet seen over. */
  bool inflight;
};

/* The devices of the local ranks, for the NCCL locks; how many. */
static size_t comm_devices(const struct gpu_comms *c, int *devices) {
  for (size_t i = 0; i < c->n; i++)
    devices[i] = c->ranks[i].id.device;
  return c->n;
}

/* The group just launched: its work is in flight until gpu_comms_query
 * sees it over, or an abort ends it.  Device locks held. */
static void work_begins(struct gpu_comms *c, const int *devices, size_t n) {
  gpu_nccl_begin(c->gpu, devices, n);
  c->inflight = true;
}

static void work_ends(struct gpu_comms *c) {
  if (!c->inflight)
    return;
  int devices[GPU_MAX_DEVICES];
  gpu_nccl_end(c->gpu, devices, comm_devices(c, devices));
  c->inflight = false;
}

/* What a helper thread aborts: communicators taken off their set, and
 * whether their work was counted in flight on those devices. */
struct aborting {
  struct gpu *gpu;
  size_t n;
  ncclComm_t comms[GPU_MAX_DEVICES];
  int devices[GPU_MAX_DEVICES];
  bool inflight;
};

static void abort_main(void *arg) {
  struct aborting *ab = arg;
  const struct cuda_api *a = &ab->gpu->api;
  for (size_t i = 0; i < ab->n; i++)
    if (ab->comms[i] != NULL) {
      a->cudaSetDevice(ab->devices[i]);
      a->ncclCommAbort(ab->comms[i]);
    }
  /* Aborted, their kernels are gone: what waited to be freed may go. */
  if (ab->inflight)
    gpu_nccl_end(ab->gpu, ab->devices, ab->n);
  free(ab);
}

/* A peer's failure (its process died, its node aborted) is node_lost:
 * the job fails everywhere naming it; anything else is this node's
 * backend failing. */
static int nccl_fail(const struct gpu_comms *c, ncclResult_t res,
                     const char *what, char *msg, size_t msglen) {
  int rc = cuda_api_nccl_error(&c->gpu->api, res, what, msg, msglen);
  return res == ncclRemoteError ? SP_ENODELOST : rc;
}

/* ncclCommAbort tells no peer and may block: it runs on a helper thread,
 * and the other nodes hear of the failure through the daemons' mesh
 * (docs/gpu.md, Threads). */
void gpu_comms_abort(struct gpu_comms *c) {
  if (c == NULL || c->aborted)
    return;
  c->aborted = true;
  struct aborting *ab = calloc(1, sizeof *ab);
  if (ab == NULL) {
    /* No memory to hand them over: abort here rather than leave them. */
    for (size_t i = 0; i < c->n; i++)
      if (c->ranks[i].comm != NULL) {
        c->gpu->api.cudaSetDevice(c->ranks[i].id.device);
        c->gpu->api.ncclCommAbort(c->ranks[i].comm);
        c->ranks[i].comm = NULL;
      }
    work_ends(c);
    return;
  }
  ab->gpu = c->gpu;
  ab->n = comm_devices(c, ab->devices);
  for (size_t i = 0; i < c->n; i++) {
    ab->comms[i] = c->ranks[i].comm;
    c->ranks[i].comm = NULL;
  }
  ab->inflight = c->inflight;
  c->inflight = false;
  gpu_nccl_reap(c->gpu, abort_main, ab);
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
    gpu_device_free(c->gpu, cr->id.device, cr->staging);
    if (cr->event != NULL)
      a->cudaEventDestroy(cr->event);
    if (cr->stream != NULL) {
      gpu_stream_unwatch(c->gpu, cr->stream);
      a->cudaStreamDestroy(cr->stream);
    }
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

/* Where each bucket starts in staging: NCCL moves a buffer fastest when it
 * is aligned (its kernels load 16 bytes at a time and more), and a bucket
 * of an odd dtype or count would leave the next one unaligned, so every
 * bucket takes a whole number of these. */
#define STAGING_ALIGN 256

static uint64_t slot_bytes(const struct plan_bucket *b) {
  return (b->nbytes + STAGING_ALIGN - 1) / STAGING_ALIGN * STAGING_ALIGN;
}

/* The round's buckets of one local rank: its sends, then its receives, at
 * consecutive aligned offsets of its staging (slot_bytes). */
struct rank_round {
  const struct plan_rank_round *pr;
  uint64_t send_bytes, recv_bytes;
};

static void measure(const struct plan_round *rd, uint32_t rank,
                    struct rank_round *out) {
  out->pr = &rd->ranks[rank];
  out->send_bytes = out->recv_bytes = 0;
  for (size_t b = 0; b < out->pr->nsend; b++)
    out->send_bytes += slot_bytes(&rd->buckets[out->pr->send_first + b]);
  for (size_t b = 0; b < out->pr->nrecv; b++)
    out->recv_bytes +=
        slot_bytes(&rd->buckets[rd->recv_order[out->pr->recv_first + b]]);
}

static int grow_staging(struct gpu_comms *c, struct comm_rank *cr,
                        uint64_t need, char *msg, size_t msglen);

/* Marks the peers rank sends to (sends[p]) and receives from (recvs[p])
 * in some round of the plan; NULL: a plan of no rounds. */
static void plan_peers(const struct plan *plan, uint32_t rank, bool *sends,
                       bool *recvs) {
  for (size_t k = 0; plan != NULL && k < plan->nrounds; k++) {
    const struct plan_round *rd = &plan->rounds[k];
    const struct plan_rank_round *pr = &rd->ranks[rank];
    for (size_t b = 0; b < pr->nsend; b++)
      sends[rd->buckets[pr->send_first + b].dst] = true;
    for (size_t b = 0; b < pr->nrecv; b++)
      recvs[rd->buckets[rd->recv_order[pr->recv_first + b]].src] = true;
  }
}

/* The staging each local rank needs for the plan's largest round (its
 * sends, then its receives), and at least one byte per peer each way for
 * the warm-up. */
static uint64_t staging_need(const struct gpu_comms *c, size_t i,
                             const struct plan *plan) {
  uint64_t need = 2 * (uint64_t)c->world;
  for (size_t k = 0; plan != NULL && k < plan->nrounds; k++) {
    struct rank_round rr;
    measure(&plan->rounds[k], c->ranks[i].id.rank, &rr);
    if (rr.send_bytes + rr.recv_bytes > need)
      need = rr.send_bytes + rr.recv_bytes;
  }
  return need;
}

/* NCCL connects each peer lazily, at the first send or receive to it, and
 * takes device memory for the connection then: one group of a one-byte
 * send and receive to every peer the plan's rounds use, before the pool is
 * carved, so that no round allocates.  Staging is sized for the plan's
 * largest round first; the warm-up's bytes live in it. */
static int warm_up(struct gpu_comms *c, const struct plan *plan,
                   uint64_t deadline, char *msg, size_t msglen) {
  const struct cuda_api *a = &c->gpu->api;
  int rc = 0;
  for (size_t i = 0; i < c->n && rc == 0; i++)
    rc = grow_staging(c, &c->ranks[i], staging_need(c, i, plan), msg, msglen);
  if (rc != 0)
    return rc;
  bool *peers = calloc(2 * (size_t)c->world * c->n, sizeof *peers);
  if (peers == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory warming up");
  for (size_t i = 0; i < c->n; i++)
    plan_peers(plan, c->ranks[i].id.rank, peers + 2 * i * c->world,
               peers + (2 * i + 1) * c->world);
  int devices[GPU_MAX_DEVICES];
  size_t ndev = comm_devices(c, devices);
  gpu_nccl_lock(c->gpu, devices, ndev);
  ncclResult_t res = a->ncclGroupStart();
  for (size_t i = 0; i < c->n && res == ncclSuccess; i++) {
    struct comm_rank *cr = &c->ranks[i];
    const bool *sends = peers + 2 * i * c->world, *recvs = sends + c->world;
    a->cudaSetDevice(cr->id.device);
    for (uint32_t p = 0; p < c->world && res == ncclSuccess; p++) {
      if (p == cr->id.rank)
        continue;
      if (sends[p])
        res = a->ncclSend(cr->staging + p, 1, ncclUint8, (int)p, cr->comm,
                          cr->stream);
      if (res == ncclSuccess && recvs[p])
        res = a->ncclRecv(cr->staging + c->world + p, 1, ncclUint8, (int)p,
                          cr->comm, cr->stream);
    }
  }
  ncclResult_t end = a->ncclGroupEnd();
  work_begins(c, devices, ndev);
  gpu_nccl_unlock(c->gpu, devices, ndev);
  free(peers);
  if (res == ncclSuccess)
    res = end;
  if (res != ncclSuccess && res != ncclInProgress)
    rc = nccl_fail(c, res, "the warm-up sends and receives", msg, msglen);
  if (rc == 0)
    rc = settle(c, deadline, NULL, "the warm-up sends and receives", msg,
                msglen);
  if (rc == 0)
    rc = wait_all(c, deadline, "the warm-up sends and receives", msg, msglen);
  if (rc != 0)
    gpu_comms_abort(c);
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
    if (rc == 0)
      rc = gpu_stream_watch(gpu, cr->id.device, cr->stream, msg, msglen);
  }
  if (rc != 0) {
    gpu_comms_abort(c);
    return rc;
  }
  ncclUniqueId uid;
  memcpy(uid.internal, c->id, GPU_NCCL_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  int devices[GPU_MAX_DEVICES];
  size_t ndev = 0;
  for (size_t i = first; i < c->n; i++)
    devices[ndev++] = c->ranks[i].id.device;
  gpu_nccl_lock(gpu, devices, ndev);
  ncclResult_t res = a->ncclGroupStart();
  for (size_t i = first; i < c->n && res == ncclSuccess; i++) {
    a->cudaSetDevice(c->ranks[i].id.device);
    res = a->ncclCommInitRankConfig(&c->ranks[i].comm, (int)c->world, uid,
                                    (int)c->ranks[i].id.rank, &config);
    if (res == ncclInProgress)
      res = ncclSuccess;
  }
  ncclResult_t end = a->ncclGroupEnd();
  gpu_nccl_unlock(gpu, devices, ndev);
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

int gpu_comms_warm(struct gpu_comms *c, const struct plan *plan,
                   uint32_t timeout_ms, char *msg, size_t msglen) {
  if (c->aborted)
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "the job's NCCL communicators were aborted");
  uint64_t deadline = monotonic_ms() + timeout_ms;
  int rc = settle(c, deadline, NULL, "creating the communicators", msg,
                  msglen);
  if (rc == 0)
    rc = warm_up(c, plan, deadline, msg, msglen);
  if (rc != 0)
    gpu_comms_abort(c);
  return rc;
}

int gpu_comms_fit(struct gpu_comms *c, const struct plan *plan, char *msg,
                  size_t msglen) {
  int rc = 0;
  for (size_t i = 0; i < c->n && rc == 0; i++)
    rc = grow_staging(c, &c->ranks[i], staging_need(c, i, plan), msg, msglen);
  return rc;
}

int gpu_comms_create(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                     uint32_t world, const struct gpu_comm_rank *ranks,
                     size_t nranks, const struct plan *plan,
                     uint32_t timeout_ms, struct gpu_comms **out, char *msg,
                     size_t msglen) {
  struct gpu_comms *c;
  int rc = gpu_comms_begin(gpu, id, world, &c, msg, msglen);
  if (rc != 0)
    return rc;
  rc = gpu_comms_add(c, ranks, nranks, msg, msglen);
  if (rc == 0)
    rc = gpu_comms_warm(c, plan, timeout_ms, msg, msglen);
  if (rc != 0) {
    gpu_comms_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

/* Finalizes and destroys, or aborts, then frees: on a helper thread
 * (gpu_comms_free). */
static void free_main(void *arg) {
  struct gpu_comms *c = arg;
  const struct cuda_api *a = &c->gpu->api;
  char msg[256];
  int devices[GPU_MAX_DEVICES];
  size_t ndev = comm_devices(c, devices);
  /* A set still being made (its ranks joined, no export warmed it) or
   * failing is aborted: finalize is for communicators that are set up. */
  if (!c->aborted && poll_once(c, "ncclCommFinalize", msg, sizeof msg) != 0)
    gpu_comms_abort(c);
  if (!c->aborted) {
    /* Finalize flushes what is still issued; non-blocking, it is polled
     * like everything else, and a communicator that will not finish is
     * aborted instead.  Each call is made under the devices' NCCL locks,
     * as every call that issues work is. */
    ncclResult_t res = ncclSuccess;
    gpu_nccl_lock(c->gpu, devices, ndev);
    for (size_t i = 0; i < c->n && (res == ncclSuccess || res == ncclInProgress);
         i++) {
      a->cudaSetDevice(c->ranks[i].id.device);
      res = a->ncclCommFinalize(c->ranks[i].comm);
    }
    gpu_nccl_unlock(c->gpu, devices, ndev);
    if ((res != ncclSuccess && res != ncclInProgress) ||
        settle(c, monotonic_ms() + 5000, NULL, "ncclCommFinalize", msg,
               sizeof msg) != 0) {
      gpu_comms_abort(c);
    } else {
      gpu_nccl_lock(c->gpu, devices, ndev);
      for (size_t i = 0; i < c->n; i++) {
        a->cudaSetDevice(c->ranks[i].id.device);
        a->ncclCommDestroy(c->ranks[i].comm);
        c->ranks[i].comm = NULL;
      }
      gpu_nccl_unlock(c->gpu, devices, ndev);
      work_ends(c);
    }
  }
  free_ranks(c);
}

void gpu_comms_free(struct gpu_comms *c) {
  if (c == NULL)
    return;
  gpu_nccl_reap(c->gpu, free_main, c);
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
  if (!pending)
    work_ends(c);
  return pending ? 1 : 0;
}

/* Staging of at least need bytes, between exports: the old buffer is
 * freed once no NCCL work is in flight on its device (ncclwork.c). */
static int grow_staging(struct gpu_comms *c, struct comm_rank *cr,
                        uint64_t need, char *msg, size_t msglen) {
  if (need <= cr->staging_size)
    return 0;
  const struct cuda_api *a = &c->gpu->api;
  gpu_device_free(c->gpu, cr->id.device, cr->staging);
  a->cudaSetDevice(cr->id.device);
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
      off += slot_bytes(b);
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
    /* Sized at the warm-up from this plan: no round allocates (or frees)
     * device memory while other NCCL work may be in flight. */
    if (rr[i].send_bytes + rr[i].recv_bytes > cr->staging_size) {
      rc = sp__failf(msg, msglen, SP_EINTERNAL,
                     "round %zu needs %" PRIu64 " bytes of NCCL staging on "
                     "%s, more than the %" PRIu64 " its plan was warmed for",
                     (size_t)(rd - e->plan->rounds),
                     rr[i].send_bytes + rr[i].recv_bytes,
                     gpu_device_name(c->gpu, cr->id.device), cr->staging_size);
      break;
    }
    a->cudaSetDevice(cr->id.device);
    uint64_t off = 0;
    for (size_t k = 0; k < rr[i].pr->nsend && rc == 0; k++) {
      const struct plan_bucket *b = &rd->buckets[rr[i].pr->send_first + k];
      rc = copy_bucket(c, cr, e, rd, b, cr->staging + off, true, msg, msglen);
      off += slot_bytes(b);
    }
  }
  /* One group of all local ranks' sends and receives, in the plan's order:
   * sends by (peer, dtype), receives by (peer, dtype), the same split on
   * every rank of every node. */
  if (rc == 0) {
    int devices[GPU_MAX_DEVICES];
    size_t ndev = comm_devices(c, devices);
    gpu_nccl_lock(c->gpu, devices, ndev);
    ncclResult_t res = a->ncclGroupStart();
    for (size_t i = 0; i < c->n && res == ncclSuccess; i++) {
      struct comm_rank *cr = &c->ranks[i];
      a->cudaSetDevice(cr->id.device);
      uint64_t off = 0;
      for (size_t k = 0; k < rr[i].pr->nsend && res == ncclSuccess; k++) {
        const struct plan_bucket *b = &rd->buckets[rr[i].pr->send_first + k];
        res = a->ncclSend(cr->staging + off, b->nbytes, ncclUint8, (int)b->dst,
                          cr->comm, cr->stream);
        off += slot_bytes(b);
      }
      for (size_t k = 0; k < rr[i].pr->nrecv && res == ncclSuccess; k++) {
        const struct plan_bucket *b =
            &rd->buckets[rd->recv_order[rr[i].pr->recv_first + k]];
        res = a->ncclRecv(cr->staging + off, b->nbytes, ncclUint8, (int)b->src,
                          cr->comm, cr->stream);
        off += slot_bytes(b);
      }
      if (res == ncclInProgress)
        res = ncclSuccess;
    }
    ncclResult_t end = a->ncclGroupEnd();
    work_begins(c, devices, ndev);
    gpu_nccl_unlock(c->gpu, devices, ndev);
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
      off += slot_bytes(b);
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
