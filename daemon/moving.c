/*
 * moving.c - what an export's moving phase needs before its engine starts
 * (see moving.h): the plan's bytes, every local rank's storages, the
 * owners' segments carved from the pool, the data plane to the other
 * nodes of a job across nodes, and the GPUs' part of the run.
 *
 * The segments are taken here and freed with the export (export.c): an
 * export that fails after this still frees every one of them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon/export_run.h"
#include "daemon/job.h"
#include "daemon/mesh/mesh.h"
#include "daemon/moving.h"
#include "daemon/pool.h"
#include "daemon/server.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/remote.h"
#include "shardport.h"

static void engine_notify(void *arg) { job_wake(arg); }

/* An owner's segment: device memory on its GPU for a CUDA job, else a
 * memfd.  0, or a code with a sentence in msg. */
static int new_segment(struct export *ex, uint32_t r, uint64_t need,
                       char *msg, size_t msglen) {
  struct job *job = ex->job;
  struct server *srv = job->srv;
  struct gpu *gpu = export_gpu(ex);
  char why[256] = "";
  int rc = gpu != NULL
               ? pool_segment_new_device(srv->pool, gpu,
                                         ex->ranks[r].m->reg.device,
                                         ex->layout->seg_size[r],
                                         ex->ranks[r].m, &ex->ranks[r].segment,
                                         why,
                                         sizeof why)
               : pool_segment_new(srv->pool, ex->layout->seg_size[r],
                                  ex->ranks[r].m, &ex->ranks[r].segment);
  if (rc == 0)
    return 0;
  snprintf(msg, msglen,
           "export %" PRIu64 " of job %s needs %" PRIu64
           " bytes of pool (rank %" PRIu32 ": %" PRIu64 "); %" PRIu64
           " of %" PRIu64 " bytes are in use%s%s",
           ex->id, job->hex, need, r, ex->layout->seg_size[r],
           pool_used(srv->pool), pool_capacity(srv->pool),
           why[0] != '\0' ? ": " : "", why);
  return rc;
}

int moving_prepare(struct export *ex, char *msg, size_t msglen) {
  struct job *job = ex->job;
  struct server *srv = job->srv;
  uint32_t world = job->world;
  if (ex->mx == NULL) {
    ex->plan = job->cache.plan;
    ex->layout = &job->cache.layout;
  }
  ex->bytes_total = 0;
  for (size_t r = 0; r < ex->plan->nrounds; r++)
    ex->bytes_total += ex->plan->rounds[r].nbytes;
  ex->src = calloc(world, sizeof *ex->src);
  ex->dst = calloc(world, sizeof *ex->dst);
  ex->dst_size = calloc(world, sizeof *ex->dst_size);
  ex->dst_warm = calloc(world, sizeof *ex->dst_warm);
  ex->gpu_segments = calloc(world, sizeof *ex->gpu_segments);
  if (ex->src == NULL || ex->dst == NULL || ex->dst_size == NULL ||
      ex->dst_warm == NULL || ex->gpu_segments == NULL) {
    snprintf(msg, msglen, "out of memory starting the export");
    return SP_ENOMEM;
  }
  uint64_t need = 0;
  for (uint32_t r = 0; r < world; r++)
    if (ex->ranks[r].m != NULL)
      need += ex->layout->seg_size[r];
  for (uint32_t r = 0; r < world; r++) {
    /* Ranks on other nodes: their storages and segments are theirs. */
    if (ex->ranks[r].m == NULL)
      continue;
    ex->src[r] = ex->ranks[r].m->reg.info;
    ex->dst_size[r] = ex->layout->seg_size[r];
    if (ex->layout->seg_size[r] == 0)
      continue;
    int rc = new_segment(ex, r, need, msg, msglen);
    if (rc != 0)
      return rc;
    /* A host segment kept from the owner's earlier export may be larger
     * than this one needs: the engine prepares all of it (the CUDA
     * backend zeroes the layout's part of a device segment). */
    ex->dst[r] = ex->ranks[r].segment->base;
    if (ex->ranks[r].segment->dev == NULL)
      ex->dst_size[r] = ex->ranks[r].segment->size;
    ex->dst_warm[r] = ex->ranks[r].segment->warm;
    ex->gpu_segments[r] = ex->ranks[r].segment->dev;
  }
  ex->bytes_to_prepare = 0;
  for (uint32_t r = 0; r < world; r++)
    ex->bytes_to_prepare += ex->dst_size[r];
  struct engine *e = &ex->engine;
  e->plan = ex->plan;
  e->src = ex->src;
  e->dst = ex->dst;
  e->dst_size = ex->dst_size;
  e->dst_warm = ex->dst_warm;
  e->key_offset = ex->layout->offset;
  e->threads = srv->engine_threads;
  e->round_delay_ms = srv->test_round_delay_ms;
  e->notify = engine_notify;
  e->notify_arg = job;
  if (ex->mx != NULL) {
    if (mesh_remote(job, ex->mx, ex->plan, ex->src, ex->dst,
                    ex->layout->offset, &e->remote) != 0) {
      snprintf(msg, msglen, "out of memory starting the export");
      return SP_ENOMEM;
    }
    /* What this node copies, sends and receives. */
    ex->bytes_total = remote_bytes_total(e->remote);
  }
  if (export_gpu(ex) != NULL) {
    /* The moves between this node's ranks are device copies, the moves
     * between nodes go through the job's communicators (docs/gpu.md). */
    ex->gpu_run = (struct gpu_run){.gpu = export_gpu(ex),
                                   .segments = ex->gpu_segments,
                                   .node = ex->mx != NULL ? mesh_self(job) : 0,
                                   .comms = job->gpu_comms,
                                   .timeout_ms = ex->timeout_ms};
    e->gpu_run = &ex->gpu_run;
    e->run = gpu_engine_run;
  }
  return 0;
}

