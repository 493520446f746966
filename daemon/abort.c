/*
 * abort.c - job_abort (docs/protocol.md): an operator ends a job for good.
 *
 * Only the job's owner (the uid that created it, from SO_PEERCRED) and
 * root may abort it; where shadows share the job's id (joblist.c), each
 * of them that the peer may abort ends.  Its running export and its
 * waiting ranks fail with `aborted`, naming who aborted it, and every
 * rank's connection is ended with that error (job_terminate), so that
 * each trainer hears it on its next call whatever it was doing.  Across
 * nodes, an abort on the job's root ends the job on every node (mesh.c
 * tells each one, and their ranks hear the same error); an abort on
 * another node ends that node's part, and its running export fails on
 * every node (the root passes the failure on).
 */
#include <stdio.h>
#include <stdlib.h>

#include "daemon/abort.h"
#include "daemon/conn.h"
#include "daemon/job.h"
#include "daemon/joblist.h"
#include "daemon/log.h"
#include "daemon/peer.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "shardport.h"

/* Whether who may abort job: its owner and root may. */
static bool may_abort(const struct peer *who, const struct job *job) {
  return who->uid == 0 || (job->has_owner && who->uid == job->owner_uid);
}

static void abort_one(struct job *job, const struct peer *who) {
  char why[SP_ERRMSG_MAX + 1];
  snprintf(why, sizeof why,
           "job %s was aborted by uid %u (pid %d); create a new job to go on",
           job->hex, (unsigned)who->uid, (int)who->pid);
  log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex),
           "job %s: aborted by uid %u (pid %d)", job->hex, (unsigned)who->uid,
           (int)who->pid);
  job_terminate(job, SP_EABORTED, why);
}

int abort_op_job_abort(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  char ref[2 * JOB_ID_BYTES + 1], msg[256];
  struct job *job;
  uint32_t named;
  int rc = request_parse_job_ref(map, ref, msg, sizeof msg);
  if (rc == 0)
    rc = joblist_find(conn_server(c), ref, &job, &named, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "job_abort: %s", msg);
  /* Every job of the id that the peer may abort: several when shadows
   * share it (joblist.c), and the operator named them all.  Taken before
   * any ends, so that no list is walked while jobs end. */
  struct server *srv = conn_server(c);
  const struct peer *who = conn_peer(c);
  struct job **ending = malloc(named * sizeof *ending);
  if (ending == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_abort: out of memory");
  const struct job *refused = NULL;
  uint32_t n = 0;
  for (struct job *j = job_find(srv, NULL, job->id); j != NULL && n < named;
       j = job_find(srv, j, job->id)) {
    if (!may_abort(who, j))
      refused = refused != NULL ? refused : j;
    else if (!j->dying)
      ending[n++] = j;
  }
  if (n == 0) {
    free(ending);
    if (refused != NULL)
      return conn_send_error(c, head->id, SP_EPERM,
                             "job_abort: job %s belongs to uid %u; only its "
                             "owner or root may abort it",
                             refused->hex, (unsigned)refused->owner_uid);
    return conn_send_error(c, head->id, SP_ESTATE,
                           "job_abort: job %s is ending already", job->hex);
  }
  /* Answered first: the one asking may be a rank of the job, whose
   * connection the abort ends. */
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "job_abort", head->id, 1);
  sp__pack_kv_str(&mb.pk, "job_id", job->hex);
  rc = conn_send_msgbuf(c, &mb);
  for (uint32_t i = 0; i < n; i++)
    abort_one(ending[i], who);
  free(ending);
  return rc;
}
