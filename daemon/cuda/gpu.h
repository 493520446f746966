/*
 * gpu.h - the CUDA backend as the rest of shardportd sees it: which GPUs
 * this node has, CUDA storages opened from their IPC handles or cuMem
 * descriptors, device pool segments published as IPC handles, the device
 * copy engine and NCCL between nodes.
 *
 * Nothing here needs the CUDA headers, so the generic daemon (registry.c,
 * export.c, job.c, pool.c) includes it in every build; a build without the
 * CUDA backend links daemon/cuda/none.c, whose functions only refuse.  The
 * implementation (daemon/cuda/gpu.c and its neighbours) reaches CUDA and
 * NCCL through the run-time loaded table of daemon/cuda/api.h and never
 * links them.
 *
 * Threads: gpu_open/gpu_close on the main thread; storages, segments and
 * communicators are made and freed on the loop thread (or a worker it
 * waits for); the engine's thread only issues copies, sends and receives
 * and records events.  NCCL groups are issued only under their devices'
 * NCCL locks, and communicators are aborted and destroyed on helper
 * threads (docs/gpu.md, Threads).  Each function sets the current device
 * it needs on the calling thread.
 *
 * Errors are a negative SP_E* code and one sentence in msg (SP_EBACKEND for
 * a failed CUDA or NCCL call, naming the call and its error).
 */
#ifndef SP_DAEMON_CUDA_GPU_H
#define SP_DAEMON_CUDA_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/cuda/layer.h"
#include "daemon/cuda/mapping.h"

/* Bytes of a cudaIpcMemHandle_t and of a cudaIpcEventHandle_t. */
#define GPU_IPC_HANDLE_BYTES 64
/* Bytes of an ncclUniqueId. */
#define GPU_NCCL_ID_BYTES 128
/* "cuda:GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" and its NUL. */
#define GPU_DEVICE_NAME_MAX 48

struct gpu;
struct gpu_import;
struct gpu_segment;
struct gpu_comms;
struct engine;
struct plan;

/* ---- gpu.c: the backend ------------------------------------------------ */

/* Loads the CUDA runtime and NCCL (daemon/cuda/api.h), probes every visible
 * GPU, skips those whose compute mode forbids sharing them (no context is
 * made there; the reason is in gpu_describe), enables peer access between
 * the pairs that allow it and makes each served GPU's context.
 * SP_EBACKEND with why when there is no usable GPU: the sentence
 * shardport status shows as the backend reason. */
int gpu_open(struct gpu **out, char *why, size_t whylen);
/* Frees everything gpu_open made; every storage, segment and communicator
 * must have been released.  NULL is allowed. */
void gpu_close(struct gpu *gpu);
/* "2 GPUs (GPU-…, GPU-…); CUDA runtime 13.0, driver 13.0, NCCL 2.28.9". */
void gpu_describe(const struct gpu *gpu, char *out, size_t outlen);
int gpu_device_count(const struct gpu *gpu);
/* The local ordinal of the GPU named "cuda:<UUID>" (or the bare UUID), or
 * -1 when no visible GPU has that UUID.  GPUs are told apart by UUID, never
 * by index: a trainer's index depends on its own CUDA_VISIBLE_DEVICES. */
int gpu_find_device(const struct gpu *gpu, const char *name, size_t len);
/* "cuda:<UUID>" of a local ordinal. */
const char *gpu_device_name(const struct gpu *gpu, int device);
/* The 16 bytes of a local ordinal's UUID. */
const uint8_t *gpu_device_uuid(const struct gpu *gpu, int device);

/* ---- gpu.c: GPUs whose context a sticky error ended -------------------- */

/* After an illegal address, a launch failure and the other errors that
 * driver_types.h documents as "any further CUDA work will return the same
 * error", the device's context is gone until the process restarts.  The
 * backend marks the device failed when a call answers one, and refuses
 * every new storage, segment and export on it.  gpu_failure gives the
 * first such device (from device from on), with one sentence naming it
 * and the error, or -1 when there is none. */
int gpu_failure(const struct gpu *gpu, int from, char *why, size_t whylen);

/* ---- handle.c: what a trainer sends ------------------------------------ */

/* The cudaIpcMemHandle_t inside handle bytes as trainers send them: either
 * the 64 bytes of the handle itself, or PyTorch's _share_cuda_() bytes,
 * which put a version byte (1 to 3 so far) and a type byte before it: 'c'
 * for a cudaMalloc block (then the 64 handle bytes), 'e' for an expandable
 * segment (not an IPC handle: those storages are registered as cuMem
 * descriptors, kind cuda_fd).  Returns 0, or SP_EINVAL with a sentence.
 * Pure byte checks; built in every configuration. */
int gpu_handle_decode(const uint8_t *bytes, size_t len,
                      uint8_t out[GPU_IPC_HANDLE_BYTES], char *why,
                      size_t whylen);

/* ---- storage.c: registered CUDA storages ------------------------------- */

enum gpu_storage_kind {
  GPU_STORAGE_IPC = 1, /* a cudaIpcMemHandle_t of the allocation's base */
  GPU_STORAGE_FD,      /* a cuMem POSIX descriptor of the allocation */
};

/* One registered CUDA storage as the engine reads it: struct gpu_mapping
 * (daemon/cuda/mapping.h). */

/* Opens bytes [offset, offset + length) of an allocation on local GPU
 * device: by its IPC handle (kind GPU_STORAGE_IPC, handle) or its cuMem
 * descriptor (GPU_STORAGE_FD, fd; the caller keeps the fd).  Each IPC
 * allocation is opened once per daemon process and its mapping shared by
 * every storage in it (counted); each storage registered by descriptor is
 * mapped on its own, since descriptors cannot be told apart (storage.c); a storage that reaches past the end of
 * its allocation is refused (SP_EBADFD).  A cuMem allocation is mapped
 * read-only: the daemon never writes a trainer's memory. */
int gpu_storage_open(struct gpu *gpu, int device, enum gpu_storage_kind kind,
                     const uint8_t handle[GPU_IPC_HANDLE_BYTES], int fd,
                     uint64_t offset, uint64_t length, struct gpu_mapping *out,
                     char *msg, size_t msglen);
/* Drops the storage's reference; the last one closes the handle or unmaps
 * the allocation.  Safe on a zeroed mapping. */
void gpu_storage_close(struct gpu *gpu, struct gpu_mapping *m);
/* Allocations open now (for tests and status). */
size_t gpu_storage_open_count(const struct gpu *gpu);

/* ---- segment.c: the device pool ---------------------------------------- */

/* A segment of device memory that one owner rank's tensors of one export
 * are assembled in: its own allocation on one GPU, exported once as one IPC
 * handle (tensors are published as offsets into it, never one handle per
 * tensor), with an interprocess event that the engine records once the
 * tensors are assembled and the library waits on.  The pool (pool.c)
 * keeps a released segment for the same job member only and frees it when
 * that member leaves; never reused for another rank. */
struct gpu_segment_info {
  int device;
  uint8_t *ptr;
  uint64_t size;
  uint8_t handle[GPU_IPC_HANDLE_BYTES];
  uint8_t event[GPU_IPC_HANDLE_BYTES];
};

/* A segment of size bytes (at least 1) on local GPU device.  The engine
 * zeroes it before assembling (device memory is not zeroed, and may hold an
 * earlier export's bytes).  SP_EPOOL when the GPU has no memory left. */
int gpu_segment_new(struct gpu *gpu, int device, uint64_t size,
                    struct gpu_segment **out, char *msg, size_t msglen);
void gpu_segment_free(struct gpu *gpu, struct gpu_segment *seg);
const struct gpu_segment_info *gpu_segment_info(const struct gpu_segment *seg);

/* ---- copy.c: the device engine ------------------------------------------ */

/* What the device engine needs besides struct engine's plan, sources
 * (xfer_storage.gpu mappings), owners' segment addresses (engine.dst) and
 * publication offsets. */
struct gpu_run {
  struct gpu *gpu;
  /* The owners' segments on this node, [world]; NULL for ranks that own
   * nothing and ranks of other nodes.  Their events are recorded once
   * every round is done. */
  struct gpu_segment *const *segments;
  /* The node this daemon serves (plan->node values); moves whose source
   * and owner both sit on it are copied, the others go through comms. */
  uint64_t node;
  /* The job's communicators, or NULL when every rank is on this node. */
  struct gpu_comms *comms;
  /* How long one round may make no progress before the export fails (and
   * the communicators are aborted). */
  uint32_t timeout_ms;
};

/* Runs every round of e->plan on the GPUs: the owners' segments zeroed,
 * then per round the local moves as batched device-to-device and peer
 * copies (cudaMemcpy2DAsync for strided boxes, cudaMemcpyAsync for dense
 * ones) on the run's own stream of each owner's GPU, the moves between
 * nodes as one NCCL group of sends and receives, and events polled until
 * the round is done, while e->cancel, the communicators' async errors and
 * the round's deadline are watched.  Updates e->round and e->bytes_moved
 * as struct engine documents; returns e->rc. */
int gpu_engine_run(struct engine *e);

/* ---- comm.c: NCCL between nodes ----------------------------------------- */

/* One local rank of a job's communicator. */
struct gpu_comm_rank {
  uint32_t rank;   /* the job rank, which is its NCCL rank */
  int device;      /* local ordinal */
};

/* Creates one communicator per local rank, all of one NCCL id, inside one
 * group with cudaSetDevice before each ncclCommInitRankConfig,
 * non-blocking; waits (polling, up to timeout_ms) until every one is ready,
 * then warms them for plan: staging sized for its largest round, and one
 * group of one-byte sends and receives to every peer its rounds use (NCCL
 * connects a peer, and allocates device memory for it, at the first send
 * or receive, so this runs before the pool is carved).  On any error or
 * the timeout every local communicator is aborted and nothing is kept.
 * Blocks: call it from a worker thread. */
int gpu_comms_create(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                     uint32_t world, const struct gpu_comm_rank *ranks,
                     size_t nranks, const struct plan *plan /* NULL: none */,
                     uint32_t timeout_ms, struct gpu_comms **out, char *msg,
                     size_t msglen);
/* The same in steps, for a job's first communicators, which are started
 * as its ranks join (docs/gpu.md): an empty set of one NCCL id and world;
 * gpu_comms_add creates the communicators of ranks (cudaSetDevice before
 * each ncclCommInitRankConfig, all of one call inside one group,
 * non-blocking) and returns at once; gpu_comms_poll says, without
 * waiting, whether every one is set up (0), still setting up (1) or
 * failed (a code with msg; they are aborted); gpu_comms_warm waits (up to
 * timeout_ms) until they are set up and warms them as gpu_comms_create
 * does, or aborts them.  Each runs on one thread at a time; the set is
 * freed with gpu_comms_free (which aborts communicators still setting
 * up). */
int gpu_comms_begin(struct gpu *gpu, const uint8_t id[GPU_NCCL_ID_BYTES],
                    uint32_t world, struct gpu_comms **out, char *msg,
                    size_t msglen);
int gpu_comms_add(struct gpu_comms *comms, const struct gpu_comm_rank *ranks,
                  size_t nranks, char *msg, size_t msglen);
int gpu_comms_poll(struct gpu_comms *comms, char *msg, size_t msglen);
int gpu_comms_warm(struct gpu_comms *comms, const struct plan *plan,
                   uint32_t timeout_ms, char *msg, size_t msglen);
/* Grows the staging of warmed communicators kept for another export to
 * what plan's largest round needs (between exports; no NCCL call, so no
 * new peer is connected: a plan that adds peers connects them in its
 * first round).  0, or a code with msg. */
int gpu_comms_fit(struct gpu_comms *comms, const struct plan *plan,
                  char *msg, size_t msglen);
/* Whether the set holds rank; whether it holds exactly these ranks on
 * these devices. */
bool gpu_comms_holds(const struct gpu_comms *comms, uint32_t rank);
bool gpu_comms_match(const struct gpu_comms *comms,
                     const struct gpu_comm_rank *ranks, size_t nranks);
/* A fresh NCCL unique id (ncclGetUniqueId): what a ticket carries.  Its
 * bootstrap root (a thread and a listening socket that stay until every
 * rank of the id checked in) lives in a helper process, shardport-nccl-root
 * (SHARDPORT_NCCL_ROOT_HELPER, else beside this executable, else in the
 * libexec directory), which *root stands for until gpu_nccl_root_end ends
 * it: once the id's generation is over, completed or not (ncclroot.c). */
struct gpu_nccl_root;
int gpu_comms_unique_id(struct gpu *gpu, uint8_t id[GPU_NCCL_ID_BYTES],
                        struct gpu_nccl_root **root, char *msg,
                        size_t msglen);
void gpu_nccl_root_end(struct gpu_nccl_root *root);
/* Aborts every local communicator, on a helper thread (ncclCommAbort may
 * block), without waiting: NCCL tells no peer, so the other nodes learn
 * of a failure from the daemons' mesh.  Safe to call again;
 * gpu_comms_free still frees them. */
void gpu_comms_abort(struct gpu_comms *comms);
/* Waits, at most timeout_ms, until no communicator of the backend is still
 * being aborted or destroyed on a helper thread: before a set is made
 * again from an id an earlier set used (the fake and real NCCL listen per
 * id and rank).  Whether they all ended.  Blocks: not on the loop. */
bool gpu_comms_wait_ended(struct gpu *gpu, uint32_t timeout_ms);
/* Whether an error or an abort has ended the communicators. */
bool gpu_comms_failed(const struct gpu_comms *comms);
/* Finalizes and destroys the communicators (their peers see a goodbye),
 * or aborts them when they failed or finalizing takes more than 5 s, and
 * frees them, all on a helper thread: returns at once, and gpu_close
 * waits for the helpers (bounded).  NULL is allowed. */
void gpu_comms_free(struct gpu_comms *comms);

#endif /* SP_DAEMON_CUDA_GPU_H */
