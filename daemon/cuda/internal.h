/*
 * internal.h - what the files of the CUDA backend share (gpu.h is what the
 * rest of the daemon sees).  Only daemon/cuda/ and the GPU tests include it.
 */
#ifndef SP_DAEMON_CUDA_INTERNAL_H
#define SP_DAEMON_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/cuda/api.h"
#include "daemon/cuda/gpu.h"
#include "daemon/cuda/layer.h"
#include "daemon/xfer/copy.h"
#include "daemon/xfer/engine.h"

/* Devices one daemon serves: a node with more is refused at start. */
#define GPU_MAX_DEVICES 64

struct gpu_device {
  struct cuda_device_info info;
  char name[GPU_DEVICE_NAME_MAX]; /* "cuda:GPU-…" */
  /* Why shardportd leaves this GPU alone ("" when it serves it): its
   * compute mode lets no context of the daemon's share it (gpu.c).  Set
   * once by gpu_open; no context is ever made on a skipped GPU. */
  char skipped[160];
};

/* Who may issue NCCL work on each GPU and what waits for it to end
 * (ncclwork.c). */
struct gpu_nccl {
  /* Per device: held from ncclGroupStart to ncclGroupEnd, and while the
   * counts below change or a free is decided. */
  pthread_mutex_t lock[GPU_MAX_DEVICES];
  /* Per device: groups launched whose work is not yet seen over. */
  unsigned inflight[GPU_MAX_DEVICES];
  /* Per device: frees waiting until inflight is 0. */
  struct deferred_free *frees[GPU_MAX_DEVICES];
  /* Helper threads ending communicators (running: reapers; all not yet
   * joined: helpers), and their end. */
  pthread_mutex_t reap_lock;
  pthread_cond_t reap_done;
  unsigned reapers;
  struct reap *helpers;
};

struct gpu {
  struct cuda_api api;
  int ndevices;
  struct gpu_device devices[GPU_MAX_DEVICES];
  /* Per device: the sticky CUDA error that ended its context, 0 while it
   * is healthy ([ndevices], gpu.c).  Set by any thread whose call failed
   * so, read by every one, hence atomic; behind a pointer so that the
   * functions given a const struct gpu can record it. */
  _Atomic int *faults;
  /* Copy streams no run holds now (gpu_stream_take), some maybe still
   * working: a run that gave up waiting gives its streams back busy. */
  pthread_mutex_t streams_lock;
  struct gpu_stream *spare_streams;
  /* The communicators' streams, which pack from and unpack into storages
   * (comm.c), kept here while they exist so that gpu_streams_drain waits
   * for them too. */
  struct gpu_stream *comm_streams;
  /* The allocations storages are opened from, each once (storage.c). */
  pthread_mutex_t imports_lock;
  struct gpu_import *imports;
  size_t nimports;
  struct gpu_nccl nccl;
};

/* ---- ncclwork.c: NCCL's threads and device memory ---- */

void gpu_nccl_init(struct gpu *gpu);
/* Waits (bounded) for the helper threads still ending communicators and
 * runs the frees still deferred; false when a helper did not finish, and
 * then nothing may be unloaded. */
bool gpu_nccl_fini(struct gpu *gpu);
/* Locks (and unlocks) the devices' NCCL locks, each once, in ascending
 * order: a thread issues a group only while it holds every device the
 * group's communicators are on. */
void gpu_nccl_lock(struct gpu *gpu, const int *devices, size_t n);
void gpu_nccl_unlock(struct gpu *gpu, const int *devices, size_t n);
/* A group was launched on the devices (call with their locks held); its
 * work is over (or aborted): frees deferred meanwhile run when the last
 * work on a device ends.  Each begin is matched by one end. */
void gpu_nccl_begin(struct gpu *gpu, const int *devices, size_t n);
void gpu_nccl_end(struct gpu *gpu, const int *devices, size_t n);
/* cudaFree(ptr) of device memory, deferred while NCCL work is in flight
 * on the device.  NULL is allowed. */
void gpu_device_free(struct gpu *gpu, int device, void *ptr);
/* Runs fn(arg) on a helper thread of its own (ncclCommAbort and
 * ncclCommDestroy may block): the caller does not wait. */
void gpu_nccl_reap(struct gpu *gpu, void (*fn)(void *), void *arg);

/* "<what>: CUDA error …" into msg; SP_EBACKEND.  A sticky error (one that
 * ends the context, gpu_error_is_sticky) also marks the calling thread's
 * current device failed, which is the device the call worked on, and the
 * sentence names it and says that the daemon must restart. */
int gpu_cuda_fail(const struct gpu *gpu, cudaError_t err, const char *what,
                  char *msg, size_t msglen);
/* cudaSetDevice(device) on the calling thread: 0 or SP_EBACKEND, also
 * when a sticky error ended device's context (gpu_failure's sentence) or
 * the GPU is skipped (its reason). */
int gpu_set_device(const struct gpu *gpu, int device, char *msg,
                   size_t msglen);

/* The copy streams of the device engine (gpu.c).  Each run of the engine
 * takes its own stream per GPU it copies on, so that one job's copies
 * never queue behind another's and never count against its round's
 * deadline; zeroing a segment, assembling it and recording its event are
 * ordered on the one stream of its run.  A stream given back is kept for a
 * later run, which takes only one that is idle.  gpu_streams_drain waits
 * for every stream given back and every communicator's stream (storage.c:
 * before memory is unmapped). */
int gpu_stream_take(struct gpu *gpu, int device, cudaStream_t *out,
                    char *msg, size_t msglen);
void gpu_stream_give(struct gpu *gpu, int device, cudaStream_t stream);
void gpu_streams_drain(struct gpu *gpu);
/* A communicator's stream, drained with the copy streams from its creation
 * until gpu_stream_unwatch, before it is destroyed: its packs read the
 * trainers' storages and its unpacks write the owners' segments.  0, or
 * SP_ENOMEM with msg. */
int gpu_stream_watch(struct gpu *gpu, int device, cudaStream_t stream,
                     char *msg, size_t msglen);
void gpu_stream_unwatch(struct gpu *gpu, cudaStream_t stream);

/* Whether the engine may work on device: neither skipped nor failed.  A
 * call on a skipped GPU would make the context its compute mode forbids. */
bool gpu_device_usable(const struct gpu *gpu, int device);

/* The interprocess event the engine records on the segment's GPU stream
 * once the segment's tensors are assembled (segment.c). */
cudaEvent_t gpu_segment_event(const struct gpu_segment *seg);

/* Issues the copies of one box (daemon/xfer/copy.h) on stream: one
 * cudaMemcpyAsync when it is dense on both sides once contiguous dimensions
 * are merged, else one cudaMemcpy3DAsync per 3-D block where the slab's
 * outer dimension strides a whole number of its pitches on both sides
 * (above all a strided innermost dimension: a block of single-element
 * columns), else one cudaMemcpy2DAsync per 2-D slab (rows of the innermost
 * dense run, or single elements when the innermost dimension is strided),
 * or a cudaMemcpyAsync per row where a pitch is too wide for a 2-D copy.
 * Returns 0, or SP_EBACKEND naming the call. */
int gpu_box_copy(const struct gpu *gpu, cudaStream_t stream, uint8_t *dst,
                 const uint8_t *src, const struct xfer_box *box, char *msg,
                 size_t msglen);

/* The source and destination of one move as device addresses and a box
 * (copy.c): src and dst as the engine's inputs give them. */
void gpu_move_box(const struct engine *e, const struct plan_move *m,
                  const uint8_t **src, uint8_t **dst, struct xfer_box *box);

/* ---- comm.c, as the engine drives it ---- */

/* Issues the moves between nodes of round rd for every local rank: each
 * rank's send buckets packed into its staging, one NCCL group of all local
 * ranks' sends and receives, and the received buckets unpacked into the
 * owners' tensors, in that order on each local rank's stream; returns once
 * NCCL has enqueued the group.  Watches e->cancel and the deadline
 * (milliseconds of CLOCK_MONOTONIC) while it waits.  0, or a code with
 * msg; on any failure the communicators are aborted. */
int gpu_comms_round(struct gpu_comms *c, const struct engine *e,
                    const struct plan_round *rd, uint64_t deadline_ms,
                    char *msg, size_t msglen);
/* Where move m of round rd (a move between nodes to a rank of this node)
 * lies in its owner's staging once the round's receives are done: it
 * stays there until the next round.  Receives unpack every move but
 * replicas (PLAN_MOVE_REPLICA), which the engine compares from there.
 * NULL when m is not received here. */
const uint8_t *gpu_comms_received(const struct gpu_comms *c,
                                  const struct plan_round *rd,
                                  const struct plan_move *m);
/* Whether the last round's work on the communicators' streams is done: 0
 * done, 1 still running, or a code with msg when a communicator reported
 * an error (they are then aborted). */
int gpu_comms_query(struct gpu_comms *c, char *msg, size_t msglen);

/* Local communicator i (of the job ranks given at creation, in order)
 * and its stream: for tests that drive NCCL themselves. */
ncclComm_t gpu_comms_comm(const struct gpu_comms *c, size_t i);
cudaStream_t gpu_comms_stream(const struct gpu_comms *c, size_t i);

/* Sleeps a little, longer the longer a wait has lasted (polls). */
void gpu_backoff(unsigned *spins);

#endif /* SP_DAEMON_CUDA_INTERNAL_H */
