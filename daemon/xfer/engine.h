/*
 * engine.h - the engine: one run of a plan's rounds, every move copied from
 * its source rank's storage into its owner's segment (engine.c on the
 * host; gpu_engine_run, daemon/cuda/gpu.h, on the GPUs), with the part that
 * crosses nodes exchanged through remote.h.
 *
 * A mover knows buffers and peers, never jobs or connections: its inputs
 * are the plan, the storages it reads, the segments it writes and, across
 * nodes, the peers' sockets; it reports through atomics and one callback.
 */
#ifndef SP_DAEMON_XFER_ENGINE_H
#define SP_DAEMON_XFER_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/cuda/mapping.h"
#include "daemon/plan/plan.h"
#include "daemon/xfer/layer.h"
#include "proto/msg.h"

struct engine_item;
struct gpu_run;
struct remote;

/* A registered storage as the movers read it.  The registry keeps its
 * storages in this form (its info array), so that an export hands each
 * rank's array to the movers as it is. */
struct xfer_storage {
  uint32_t sid;
  /* The storage's first byte, in a read-only mapping of its file that the
   * registry holds (reg_map, maps[map]); NULL when empty. */
  const uint8_t *data;
  uint32_t map;
  /* A CUDA storage: its opened allocation and device address (gpu.data;
   * data is then NULL: it is not host memory). */
  struct gpu_mapping gpu;
};

/* One run of a plan's rounds.  The caller fills the inputs; the engine's
 * threads write only the segments, the progress atomics and the result. */
struct engine {
  const struct plan *plan;
  const struct xfer_storage *const *src; /* [world]: each rank's storages */
  uint8_t *const *dst;                   /* [world]: owner's segment */
  const uint64_t *dst_size;              /* [world] */
  /* [world]: a segment kept from its owner's earlier export (pool.h):
   * present pages holding that owner's earlier tensors.  NULL: none. */
  const bool *dst_warm;
  const uint64_t *key_offset;            /* [nkeys]: publish_layout offsets */
  uint32_t threads;                      /* copying threads, at least 1 */
  uint32_t round_delay_ms;               /* test seam */
  /* What engine_start runs on its thread: engine_run, or the CUDA
   * backend's gpu_engine_run (daemon/cuda/gpu.h), whose part of the run is
   * gpu_run (src[r][i].gpu and dst are then device memory).  NULL is
   * engine_run. */
  int (*run)(struct engine *e);
  const struct gpu_run *gpu_run;
  /* A job across nodes (remote.h): this node's part of each round, moves
   * to and from other nodes included; NULL on one node. */
  struct remote *remote;
  /* Called from the engine thread when a round starts and when it ends. */
  void (*notify)(void *arg);
  void *notify_arg;
  _Atomic uint32_t round; /* 1-based; 0 before the first */
  _Atomic uint64_t bytes_moved;
  /* Bytes of the owners' segments populated before round 1. */
  _Atomic uint64_t bytes_prepared;
  _Atomic bool cancel;
  _Atomic bool done;
  /* Valid once done: 0, or a code and a sentence naming key and ranks. */
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
  /* With rc SP_ENODELOST from the data plane: the node it lost, else
   * PLAN_NONE. */
  uint32_t lost_node;
  /* Across nodes, valid once done: the rounds during whose exchange the
   * next round's first byte left before the round's last local copy ended
   * (rounds overlapping, remote.c). */
  uint32_t rounds_overlapped;
  pthread_t thread;
  /* The current round's work, shared by its copying threads. */
  struct engine_item *items;
  size_t nitems;
  uint64_t chunk; /* the bytes one item holds */
  _Atomic size_t next_item;
  _Atomic uint64_t copies_end_ns; /* when the round's last copy ended */
  _Atomic bool failed;
  pthread_mutex_t fail_lock;
};

/* Runs every round from the calling thread (with e->threads - 1 helpers);
 * returns e->rc. */
int engine_run(struct engine *e);
/* Runs e->run on a new thread, which sets done and notifies at the end; 0
 * or SP_ENOMEM. */
int engine_start(struct engine *e);
void engine_join(struct engine *e);

#endif /* SP_DAEMON_XFER_ENGINE_H */
