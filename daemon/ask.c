/*
 * ask.c - export (docs/protocol.md): a rank asks for its job's next
 * export.  The ask is recorded on the rank and the job wakes; the export
 * starts when every rank asked (export.c, and across nodes the root's
 * gather), and its reply, progress frames included, is the export's.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/ask.h"
#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/job.h"
#include "daemon/pump.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* An export request read out of its frame (conn.h): a large groups list
 * is parsed on a worker (on the loop, 500,000 names held it 220 ms). */
struct export_ask {
  int rc; /* a request that does not parse: its code, and msg */
  char msg[256];
  struct req_export req;
};

static void *prepare_ask(const msgpack_object *map,
                         const struct sp_frame *frame) {
  (void)frame;
  struct export_ask *a = calloc(1, sizeof *a);
  if (a != NULL)
    a->rc = request_parse_export(map, &a->req, a->msg, sizeof a->msg);
  return a;
}

static void free_ask(void *prepared) {
  struct export_ask *a = prepared;
  if (a == NULL)
    return;
  request_groups_free(&a->req.groups);
  free(a);
}

static int serve_ask(struct conn *c, const struct sp_msg_head *head,
                     struct sp_frame *frame, void *prepared) {
  (void)frame;
  struct export_ask *a = prepared;
  if (a == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "export: out of memory");
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE, "export: join a job first");
  struct job *job = m->job;
  if (m->asked || m->in_export)
    return conn_send_error(c, head->id, SP_EEXPORTING,
                           "export: rank %" PRIu32 " of job %s already asked "
                           "for an export that has not finished",
                           m->rank, job->hex);
  if (a->rc != 0)
    return conn_send_error(c, head->id, a->rc, "export: %s", a->msg);
  const struct req_export req = a->req;
  /* The rank's ask holds the groups from now on. */
  memset(&a->req.groups, 0, sizeof a->req.groups);
  m->ask = req;
  m->asked = true;
  m->ask_id = head->id;
  m->asked_ms = monotonic_ms();
  m->ask_deadline_ms =
      monotonic_ms() +
      (req.timeout_ms > 0 ? req.timeout_ms : job->srv->cfg->export_timeout_ms);
  if (req.progress)
    pump_progress_frame(c, head->id, JOB_WAITING, 0, 0, 0, 0);
  job_wake(job);
  job_schedule(job);
  return 0;
}

const struct conn_prepared_op ask_export_op = {prepare_ask, serve_ask, NULL,
                                               free_ask};

int ask_op_export(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame) {
  void *a = prepare_ask(map, frame);
  int rc = serve_ask(c, head, frame, a);
  free_ask(a);
  return rc;
}
