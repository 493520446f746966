/*
 * status.c - the status reply (docs/protocol.md, "status"): what the daemon
 * is, which backend serves and why, how long it has run, who is connected,
 * the memory pool, the jobs, and what each user holds.  Everything is read from the loop's own
 * state and the engines' atomics, so it answers at once during an export.
 */
#include "build_config.h"
#include "daemon/backend.h"
#include "daemon/cuda/gpu.h"
#include "daemon/drain.h"
#include "daemon/job.h"
#include "daemon/loopwatch.h"
#include "daemon/pool.h"
#include "daemon/quota.h"
#include "daemon/server.h"
#include "daemon/status.h"

void status_pack(struct server *srv, uint64_t id, struct sp_msgbuf *mb) {
  /* Segments whose ranks closed them are freed before they are counted. */
  pool_collect(srv->pool);
  sp__msgbuf_begin(mb, "status", id, 16);
  msgpack_packer *pk = &mb->pk;
  sp__pack_kv_str(pk, "daemon_version", SP_VERSION);
  sp__pack_kv_u64(pk, "protocol_version", SP_PROTOCOL_VERSION);
  sp__pack_str(pk, "backends_built");
  msgpack_pack_array(pk, backend_nbuilt);
  for (size_t i = 0; i < backend_nbuilt; i++)
    sp__pack_str(pk, backend_built[i]);
  sp__pack_kv_str(pk, "backend_active", srv->backend->active);
  /* A GPU a sticky error ended: the reason says so, and that the daemon
   * is draining to restart (drain.c). */
  drain_check_gpus(srv);
  char failure[SP_ERRMSG_MAX + 1];
  struct gpu *gpu = srv->backend->gpu;
  sp__pack_kv_str(pk, "backend_reason",
                 gpu != NULL && gpu_failure(gpu, 0, failure, sizeof failure) >= 0
                     ? failure
                     : srv->backend->reason);
  sp__pack_kv_f64(pk, "uptime_s",
                 (double)(uv_hrtime() - srv->started_ns) / 1e9);
  sp__pack_kv_u64(pk, "clients", srv->nclients);
  sp__pack_kv_u64(pk, "pool_used", pool_used(srv->pool));
  sp__pack_kv_u64(pk, "pool_capacity", pool_capacity(srv->pool));
  /* Released segments their ranks still hold (part of pool_used). */
  sp__pack_kv_u64(pk, "pool_held", pool_held(srv->pool));
  /* Released segments kept for their owners' next exports (part of
   * pool_used). */
  sp__pack_kv_u64(pk, "pool_warm", pool_kept(srv->pool));
  /* Where other daemons reach this one ("" when peer_listen is off). */
  sp__pack_kv_str(pk, "peer_address", srv->peer_address);
  /* Stopping: new work is refused while running exports finish. */
  sp__pack_kv_bool(pk, "draining", srv->draining);
  /* The longest the loop was busy in one iteration since the previous
   * status: how long any client may have waited for an answer. */
  sp__pack_kv_u64(pk, "loop_max_busy_us",
                  loopwatch_take_max_ns(srv, LOOPWATCH_STATUS) / 1000);
  sp__pack_str(pk, "jobs");
  job_status_pack(srv, pk);
  /* What each user holds against its quotas (docs/operations.md). */
  sp__pack_str(pk, "users");
  quota_status_pack(srv, pk);
}
