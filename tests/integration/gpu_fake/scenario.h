/*
 * scenario.h - what the GPU export suite runs (tests/integration/gpu_fake/):
 * a scenario is a list of keys (how each rank holds each one), how each
 * rank hands its storage to the library, and a fault to inject; a report
 * is what one rank process tells the test process about its run.  Shared
 * by the rank program (rank.c), the world that forks it (world.c) and the
 * test files.
 */
#ifndef SP_TEST_GPU_FAKE_SCENARIO_H
#define SP_TEST_GPU_FAKE_SCENARIO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/msg.h"
#include "tests/integration/tlayout.h"

#define MAXR 8
/* How long the test process waits for a rank's next message, and a rank
 * for the test process. */
#define WAIT_MS 30000

/* AFFINE_ALL: every rank holds the whole key as one affine piece naming
 * every rank as a holder (replicas the owner compares).  AFFINE_MAP: the
 * pieces .layout gives each rank (tests/integration/tlayout.h), its shard
 * registered as one dim. */
enum kind {
  SHARD0 = 1,
  REPLICATED,
  PLAIN,
  EXPERT,
  AFFINE_COLS,
  AFFINE_ALL,
  AFFINE_MAP
};

struct tkey {
  const char *name;
  enum kind kind;
  const char *dtype;
  uint32_t es;
  uint32_t ndim;
  int64_t shape[2];
  int64_t parts[MAXR];
  uint32_t expert;
  int tie; /* > 0: shares key tie - 1's holding */
  int bad; /* > 0: rank bad - 1's copy differs at element BAD_ELEMENT */
  const struct tlayout *layout; /* AFFINE_MAP, 2 dims */
};

#define BAD_ELEMENT 13

/* How a rank hands its storage to the library. */
enum mode {
  MODE_PTR,   /* SP_STORAGE_CUDA: a device pointer */
  MODE_TORCH, /* SP_STORAGE_CUDA_IPC: [2]['c'][cudaIpcMemHandle_t] */
  MODE_RAW,   /* SP_STORAGE_CUDA_IPC: the 64 handle bytes */
  MODE_FD,    /* SP_STORAGE_CUDA_FD: a cuMem POSIX descriptor */
};

/* KILL_MOVING: rank victim kills itself once data moves; KILL_NODE: the
 * test kills the second daemon then. */
enum fault { NO_FAULT, KILL_MOVING, KILL_NODE };

struct scenario {
  uint32_t world;
  /* Daemons (fake nodes) the ranks are spread over, in rank order; 0 or 1:
   * one. */
  uint32_t nodes;
  size_t nkeys;
  const struct tkey *keys;
  enum mode modes[MAXR];
  int gpus; /* rank r sits on GPU r % gpus */
  uint32_t max_keys;
  uint32_t exports; /* 0 means 1 */
  enum fault fault;
  uint32_t victim;
  /* The first export is expected to fail (a fault injected in a daemon):
   * its result goes to the report's first_rc and the rank goes on with
   * the next exports of the same job. */
  bool fail_first;
  /* When set, each rank waits after joining and registering until this
   * file exists before it asks for its first export. */
  const char *gate;
  /* Each rank talks to the daemon from a thread of its own that has no
   * CUDA context, as an asynchronous checkpoint thread does, and checks at
   * the end that the library made a context on no GPU but the rank's. */
  bool library_thread;
  /* After its first export each rank's connection breaks (the rank shuts
   * its socket down under the library) while it still holds what it owns,
   * and the rank checks that the daemon, once every rank left, still
   * counts that memory in pool_used: freeing it while the rank has it
   * open is undefined (docs/fakes.md). */
  bool close_holding;
  /* The export's timeout (sp_export_opts.timeout_ms), which is also how
   * long a round may make no progress on the GPUs; 0: 20 s. */
  uint32_t timeout_ms;
};

struct report {
  int export_rc;
  char message[SP_ERRMSG_MAX + 1];
  int first_rc; /* fail_first: the first export's */
  char first_message[SP_ERRMSG_MAX + 1];
  char failure[512];
  uint32_t owned_count;
  uint32_t device_tensors; /* owned tensors that came from a segment */
  /* Per export (the first 4): the inode of the fake device allocation the
   * rank's segment is (each cudaMalloc of the fake is a new memfd), or 0. */
  uint64_t seg_inode[4];
};

/* A key of a scenario's list. */
#define K(...) ((struct tkey){__VA_ARGS__})

/* The fake node (daemon) rank sits on: the ranks are spread over
 * sc->nodes in rank order. */
static inline uint32_t scenario_node_of(const struct scenario *sc,
                                        uint32_t rank) {
  return sc->nodes > 1 ? rank * sc->nodes / sc->world : 0;
}

#endif /* SP_TEST_GPU_FAKE_SCENARIO_H */
