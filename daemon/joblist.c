/*
 * joblist.c - the operator's view of jobs (docs/protocol.md, "jobs" and
 * "job_status"): a job found by its id or a unique prefix of it, the list
 * of jobs a page at a time, and one job in full, with each rank (its
 * state, the pid of its process, its node) and the job's last finished
 * exports.
 *
 * Any peer the daemon lets in may look, as with status; only abort
 * (abort.c) asks who is asking.  Everything is read from the loop's own
 * state and the engines' atomics, so it answers at once during an export.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/history.h"
#include "daemon/job.h"
#include "daemon/joblist.h"
#include "daemon/mesh/mesh.h"
#include "daemon/peer.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "proto/fail.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* Jobs in one reply to jobs: far below every frame limit however many
 * nodes a job spans (a summary is a few dozen items). */
#define JOBLIST_PAGE 1024u

int joblist_find(const struct server *srv, const char *ref, struct job **out,
                 uint32_t *named, char *msg, size_t msglen) {
  size_t len = strlen(ref);
  uint32_t matches = 0;
  bool several_ids = false;
  *out = NULL;
  for (struct job *job = srv->jobs; job != NULL; job = job->next)
    if (strncmp(job->hex, ref, len) == 0) {
      if (*out == NULL)
        *out = job;
      else if (strcmp(job->hex, (*out)->hex) != 0)
        several_ids = true;
      matches++;
    }
  if (matches == 0)
    return sp__failf(msg, msglen, SP_ENOJOB,
                     "no job %s on this daemon (it ended, or was never here)",
                     ref);
  if (several_ids) {
    *out = NULL;
    return sp__failf(msg, msglen, SP_EINVAL,
                     "job id prefix %s matches %" PRIu32 " jobs; give more "
                     "digits",
                     ref, matches);
  }
  *named = matches;
  return 0;
}

static double age_s(uint64_t since_ms, uint64_t now_ms) {
  return now_ms > since_ms ? (double)(now_ms - since_ms) / 1000.0 : 0.0;
}

/* What jobs lists of a job, and job_status adds to the status job map. */
static void pack_owner(const struct job *job, msgpack_packer *pk,
                       uint64_t now) {
  sp__pack_kv_u64(pk, "owner_uid", job->owner_uid);
  sp__pack_kv_u64(pk, "owner_pid", (uint64_t)job->owner_pid);
  sp__pack_kv_f64(pk, "age_s", age_s(job->created_ms, now));
  sp__pack_kv_u64(pk, "exports", job->history.total);
}

static void pack_summary(const struct job *job, msgpack_packer *pk,
                         uint64_t now) {
  struct export_view v;
  uint32_t joined, asked;
  export_view(job, &v);
  job_count_ranks(job, &joined, &asked);
  msgpack_pack_map(pk, 12);
  sp__pack_kv_str(pk, "job_id", job->hex);
  sp__pack_kv_str(pk, "phase", export_phase_name(v.phase));
  pack_owner(job, pk, now);
  sp__pack_kv_u64(pk, "world", job->world);
  sp__pack_kv_u64(pk, "joined", joined);
  sp__pack_kv_u64(pk, "asked", asked);
  sp__pack_kv_u64(pk, "export_id", v.export_id);
  sp__pack_kv_u64(pk, "node", mesh_self(job));
  sp__pack_kv_u64(pk, "node_count", mesh_node_count(job));
}

/* By id, and the jobs of one id (joblist_find) oldest first. */
static int by_id(const void *a, const void *b) {
  const struct job *x = *(struct job *const *)a;
  const struct job *y = *(struct job *const *)b;
  int c = strcmp(x->hex, y->hex);
  if (c != 0)
    return c;
  return (x->created_ms > y->created_ms) - (x->created_ms < y->created_ms);
}

int joblist_op_jobs(struct conn *c, const struct sp_msg_head *head,
                    const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct server *srv = conn_server(c);
  char after[2 * JOB_ID_BYTES + 1], msg[256];
  int rc = request_parse_jobs(map, after, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "jobs: %s", msg);
  /* Pages in id order, so that a listing in several requests neither
   * skips nor repeats a job that outlives it. */
  struct job **all = malloc((srv->njobs > 0 ? srv->njobs : 1) * sizeof *all);
  if (all == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "jobs: out of memory");
  size_t n = 0;
  for (struct job *job = srv->jobs; job != NULL; job = job->next)
    all[n++] = job;
  qsort(all, n, sizeof *all, by_id);
  size_t first = 0;
  while (first < n && after[0] != '\0' && strcmp(all[first]->hex, after) <= 0)
    first++;
  size_t count = n - first < JOBLIST_PAGE ? n - first : JOBLIST_PAGE;
  /* The next page starts after the last id of this one, so the jobs of
   * one id (shadows, joblist_find) stay on one page: none is skipped. */
  while (first + count < n &&
         strcmp(all[first + count]->hex, all[first + count - 1]->hex) == 0)
    count++;
  uint64_t now = monotonic_ms();
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "jobs", head->id, 2);
  sp__pack_str(&mb.pk, "jobs");
  msgpack_pack_array(&mb.pk, (uint32_t)count);
  for (size_t i = first; i < first + count; i++)
    pack_summary(all[i], &mb.pk, now);
  sp__pack_kv_bool(&mb.pk, "more", first + count < n);
  free(all);
  return conn_send_msgbuf(c, &mb);
}

/* Rank r as this daemon sees it: "absent" (not in the job here), "joined",
 * "asked" (waiting for the next export or push), "exporting" or "pushing"
 * (in the running one) or "leaving" (left or disconnected; freed once no export reads its
 * memory).  Its process's pid when it is served here, its node when
 * known (on a job's root, for ranks of every node). */
static void pack_rank(const struct job *job, uint32_t r, msgpack_packer *pk) {
  const struct job_member *m = job->members[r];
  uint32_t node;
  bool asked;
  if (m != NULL) {
    bool pid = m->conn != NULL;
    msgpack_pack_map(pk, pid ? 3 : 2);
    sp__pack_kv_str(pk, "state",
                    m->lost                       ? "leaving"
                    : m->in_export                ? "exporting"
                    : m->in_push                  ? "pushing"
                    : m->asked || m->push_asked   ? "asked"
                                                  : "joined");
    if (pid)
      sp__pack_kv_u64(pk, "pid", (uint64_t)conn_peer(m->conn)->pid);
    sp__pack_kv_u64(pk, "node", mesh_self(job));
  } else if (mesh_rank_where(job, r, &node, &asked)) {
    msgpack_pack_map(pk, 2);
    sp__pack_kv_str(pk, "state", asked ? "asked" : "joined");
    sp__pack_kv_u64(pk, "node", node);
  } else {
    msgpack_pack_map(pk, 1);
    sp__pack_kv_str(pk, "state", "absent");
  }
}

static void pack_history(const struct job *job, msgpack_packer *pk,
                         uint64_t now) {
  const struct history *h = &job->history;
  msgpack_pack_array(pk, h->count);
  for (uint32_t i = 0; i < h->count; i++) {
    const struct history_entry *e = history_at(h, i);
    msgpack_pack_map(pk, e->failed ? 9 : 8);
    sp__pack_kv_u64(pk, "export_id", e->export_id);
    sp__pack_kv_str(pk, "outcome", e->failed ? "failed" : "published");
    if (e->failed)
      sp__pack_kv_str(pk, "error", e->error != NULL ? e->error : "");
    sp__pack_kv_f64(pk, "age_s", age_s(e->ended_ms, now));
    sp__pack_kv_f64(pk, "duration_s", age_s(e->started_ms, e->ended_ms));
    sp__pack_kv_u64(pk, "rounds", e->rounds);
    sp__pack_kv_u64(pk, "bytes_moved", e->bytes_moved);
    sp__pack_kv_u64(pk, "bytes_total", e->bytes_total);
    sp__pack_kv_f64(pk, "rate_bps", e->rate_bps);
  }
}

int joblist_op_job_status(struct conn *c, const struct sp_msg_head *head,
                          const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  char ref[2 * JOB_ID_BYTES + 1], msg[256];
  struct job *job;
  uint32_t named;
  int rc = request_parse_job_ref(map, ref, msg, sizeof msg);
  if (rc == 0)
    rc = joblist_find(conn_server(c), ref, &job, &named, msg, sizeof msg);
  if (rc == 0 && named > 1)
    rc = sp__failf(msg, sizeof msg, SP_EINVAL,
                   "job id %s names %" PRIu32 " jobs on this daemon: shadows "
                   "of a job rooted elsewhere, made by tickets with its id "
                   "and different secrets (one at most is the real job); "
                   "shardport jobs lists them, shardport abort ends them all",
                   job->hex, named);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "job_status: %s", msg);
  uint64_t now = monotonic_ms();
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "job_status", head->id, 1);
  sp__pack_str(&mb.pk, "job");
  job_pack(job, &mb.pk, 6);
  pack_owner(job, &mb.pk, now);
  sp__pack_str(&mb.pk, "ranks");
  msgpack_pack_array(&mb.pk, job->world);
  for (uint32_t r = 0; r < job->world; r++)
    pack_rank(job, r, &mb.pk);
  sp__pack_str(&mb.pk, "history");
  pack_history(job, &mb.pk, now);
  return conn_send_msgbuf(c, &mb);
}
