/*
 * export_run.h - a running export, as the files that run it see it: its
 * state machine (export.c), its plan cache (plancache.c), its engine's
 * inputs (moving.c) and the stream of its replies (pump.c).  Nothing else
 * may look inside; the rest of the daemon knows an export through
 * export.h.
 */
#ifndef SP_DAEMON_EXPORT_RUN_H
#define SP_DAEMON_EXPORT_RUN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/cuda/gpu.h"
#include "daemon/job.h"
#include "daemon/layer.h"
#include "daemon/plan/plan.h"
#include "daemon/publish.h"
#include "daemon/request.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/replicas.h"
#include "proto/msg.h"

struct mesh_export;
struct pool_segment;

struct export_rank {
  struct job_member *m;
  uint64_t request_id;
  bool progress;
  /* Got its error or every part of its reply. */
  bool answered;
  struct req_groups groups;
  struct pool_segment *segment; /* until handed to a job_published */
  int segment_fd;               /* a duplicate for part 0 of the reply, or -1 */
  /* A device segment's handles for part 0 of the reply (copied: the rank
   * may release the export before part 0 is written). */
  bool device_segment;
  struct gpu_segment_info device_info;
  size_t *part_first;
  size_t nparts;
  size_t next_part;
  /* What the last progress frame said. */
  uint32_t sent_round;
  uint64_t sent_bytes;
  enum job_phase sent_phase;
};

struct export {
  struct job *job;
  uint64_t id;
  enum job_phase phase;
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms; /* the smallest the ranks asked for */
  /* A save: its files' limit (0 for an export), and once planned its
   * numbering and commit (save.c). */
  uint64_t save_limit;
  struct save *save;
  struct export_rank *ranks;
  bool failed;
  int fail_code; /* the code it failed with, once failed */
  /* Planning: the worker's input and output. */
  /* The planner's input, filled on the planning thread (plan_main); the
   * plan borrows it, and it goes with the plan into the job's cache. */
  struct plan_input_store *store;
  struct plan *new_plan;
  struct publish_layout new_layout;
  int plan_rc;
  char plan_msg[SP_ERRMSG_MAX + 1];
  uint64_t planning_ms;    /* when the planning thread started */
  _Atomic bool plan_stop;  /* read by plan_build (plan_input.stop) */
  _Atomic bool plan_built; /* plan_build and the layout are done */
  _Atomic bool planned;
  pthread_t planner;
  bool thread_alive;
  /* The job's cached plan applies: the planning thread only compares. */
  bool reuse_plan;
  /* The digests of the local ranks' replicated and plain keys. */
  struct replica_digests replicas;
  /* compare_replicas and engine_threads as the export started: a reload
   * (reload.c) rewrites the configuration on the loop while the planning
   * thread runs. */
  bool compare;
  uint32_t compare_threads;
  /* The plan used, owned by the job's cache. */
  const struct plan *plan;
  const struct publish_layout *layout;
  uint64_t bytes_total;
  uint64_t bytes_to_prepare; /* the owners' segments on this node */
  uint64_t part_limit; /* the most bytes of one reply frame */
  /* Moving. */
  struct engine engine;
  const struct xfer_storage **src;
  uint8_t **dst;
  uint64_t *dst_size;
  bool *dst_warm;
  /* On the CUDA backend: the owners' device segments and the engine's
   * GPU part (daemon/cuda/gpu.h). */
  struct gpu_segment **gpu_segments;
  struct gpu_run gpu_run;
  /* A job across nodes (daemon/mesh/): the gathered metadata and data
   * plane, and which word of the root the export waits for. */
  struct mesh_export *mx;
  enum { AWAIT_NONE, AWAIT_GO, AWAIT_PUBLISH } await;
  /* Watching. */
  uint64_t started_ms, moving_ms, sample_ms, progress_ms;
  uint64_t sample_bytes;
  double rate_bps;
};

/* The rounds of the export's plan (0 before it has one). */
uint32_t export_rounds(const struct export *ex);
/* The backend of the export's ranks when they are on GPUs (job.c admits
 * no mix), else NULL. */
struct gpu *export_gpu(const struct export *ex);

#endif /* SP_DAEMON_EXPORT_RUN_H */
