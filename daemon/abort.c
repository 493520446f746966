/*
 * abort.c - job_abort (docs/protocol.md): an operator ends a job for good.
 *
 * Only the job's owner (the uid that created it, from SO_PEERCRED) and
 * root may abort it.  Its running export and its waiting ranks fail with
 * `aborted`, naming who aborted it, and every rank's connection is ended
 * with that error (job_terminate), so that each trainer hears it on its
 * next call whatever it was doing.  Across nodes the running export fails
 * on every node (the root passes the failure on); the job's ranks on other
 * nodes stay until they leave, or until their own daemon aborts it too.
 */
#include <stdio.h>

#include "daemon/daemon.h"
#include "shardport.h"

int abort_op_job_abort(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  char ref[2 * JOB_ID_BYTES + 1], msg[256];
  struct job *job;
  int rc = request_parse_job_ref(map, ref, msg, sizeof msg);
  if (rc == 0)
    rc = joblist_find(conn_server(c), ref, &job, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "job_abort: %s", msg);
  const struct peer *who = conn_peer(c);
  if (who->uid != 0 && (!job->has_owner || who->uid != job->owner_uid))
    return conn_send_error(c, head->id, SP_EPERM,
                           "job_abort: job %s belongs to uid %u; only its "
                           "owner or root may abort it",
                           job->hex, (unsigned)job->owner_uid);
  if (job->dying)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "job_abort: job %s is ending already", job->hex);
  char why[SP_ERRMSG_MAX + 1];
  snprintf(why, sizeof why,
           "job %s was aborted by uid %u (pid %d); create a new job to go on",
           job->hex, (unsigned)who->uid, (int)who->pid);
  log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex),
           "job %s: aborted by uid %u (pid %d)", job->hex, (unsigned)who->uid,
           (int)who->pid);
  /* Answered first: the one asking may be a rank of the job, whose
   * connection the abort ends. */
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "job_abort", head->id, 1);
  sp_pack_kv_str(&mb.pk, "job_id", job->hex);
  rc = conn_send_msgbuf(c, &mb);
  job_terminate(job, SP_EABORTED, why);
  return rc;
}
