/*
 * registration.c - storage_add and tensor_add (docs/protocol.md), in two
 * steps.
 *
 * One frame may register hundreds of thousands of storages or tensors, and
 * reading them out of the frame costs far more than adding them to a
 * registry.  So a registration is prepared first, from the decoded frame
 * alone: the request is parsed, checked against itself and hashed for the
 * registry's tables (registry_batch_storages), touching nothing of the
 * loop's state, so that conn.c can prepare a large frame on a worker
 * thread while the loop serves everyone else.  It is then served on the
 * loop in steps of REGISTRATION_STEP entries (registry_batch_step), each
 * in its own turn of the loop, so that no step holds the loop for more
 * than about a millisecond.  Before each step the rank is looked up again:
 * between steps its job may have ended or its connection closed, and the
 * registration is then dropped.  A frame of up to REGISTRATION_STEP
 * entries, which small frames are, is served in one step.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/job.h"
#include "daemon/plancache.h"
#include "daemon/registration.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "shardport.h"

/* Entries checked or indexed per step: about a millisecond of the loop. */
#define REGISTRATION_STEP 4096u

struct registration {
  bool tensors;
  /* A refusal found while preparing: its code and message, or 0. */
  int rc;
  char msg[512];
  struct req_storage *storages;
  struct req_tensor *tensor;
  size_t n;
  struct reg_batch *batch;
  /* The rank it is served for, from its first step on. */
  struct job_member *member;
};

static struct registration *prepare(bool tensors, const msgpack_object *map,
                                    const struct sp_frame *frame) {
  struct registration *r = calloc(1, sizeof *r);
  if (r == NULL)
    return NULL;
  r->tensors = tensors;
  if (tensors) {
    r->rc = request_parse_tensors(map, &r->tensor, &r->n, r->msg,
                                  sizeof r->msg);
    if (r->rc == 0)
      r->rc = registry_batch_tensors(r->tensor, r->n, &r->batch, r->msg,
                                     sizeof r->msg);
  } else {
    r->rc = request_parse_storages(map, frame->nfds, &r->storages, &r->n,
                                   r->msg, sizeof r->msg);
    if (r->rc == 0)
      r->rc = registry_batch_storages(r->storages, r->n, &r->batch, r->msg,
                                      sizeof r->msg);
  }
  return r;
}

static void *prepare_storages(const msgpack_object *map,
                              const struct sp_frame *frame) {
  return prepare(false, map, frame);
}

static void *prepare_tensors(const msgpack_object *map,
                             const struct sp_frame *frame) {
  return prepare(true, map, frame);
}

static void close_opened(void *prepared) {
  struct registration *r = prepared;
  registry_batch_close_opened(r->batch);
}

static void free_registration(void *prepared) {
  struct registration *r = prepared;
  if (r == NULL)
    return;
  registry_batch_free(r->batch);
  free(r->storages);
  request_tensors_free(r->tensor, r->n);
  free(r);
}

/* A registration needs a member, and no export running on its storages. */
static struct job_member *registering_member(struct conn *c, uint64_t id,
                                             const char *op) {
  struct job_member *m = conn_member(c);
  if (m == NULL) {
    conn_send_error(c, id, SP_ESTATE, "%s: join a job first", op);
    return NULL;
  }
  /* Registrations sent after the rank asked would count on one node and be
   * missed across nodes (its registrations already went to the root), so
   * they are refused from the ask on, the same everywhere. */
  if (m->job->running != NULL || m->asked || m->job->pushing != NULL ||
      m->push_asked) {
    conn_send_error(c, id, SP_EEXPORTING,
                    "%s: job %s is running an export or a push, or this "
                    "rank asked for one; register before or after it",
                    op, m->job->hex);
    return NULL;
  }
  return m;
}

/* Keeps the rank's first refused registration: if the rank leaves, that is
 * most likely why, and its peers hear it. */
static void note_refused(struct job_member *m, int code, const char *op,
                         const char *msg) {
  char text[SP_ERRMSG_MAX + 1];
  if (m->refused != NULL)
    return;
  snprintf(text, sizeof text,
           "rank %" PRIu32 "'s registration was refused: %s: %s: %s", m->rank,
           sp_err_name(code), op, msg);
  m->refused = strdup(text);
}

static int serve_registration(struct conn *c, const struct sp_msg_head *head,
                              struct sp_frame *frame, void *prepared) {
  struct registration *r = prepared;
  const char *op = head->op;
  if (r == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "%s: out of memory", op);
  /* A consumer's storages are the buffers it grants: mapped writable, not
   * into a trainer's registry (consumer.c). */
  struct job_consumer *k = conn_consumer(c);
  if (k != NULL && r->tensors)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "%s: this connection is a consumer; consumers "
                           "register targets (target_add)",
                           op);
  if (k != NULL && r->rc != 0)
    return conn_send_error(c, head->id, r->rc, "%s: %s", op, r->msg);
  if (k != NULL)
    return consumer_add_storages(c, k, head->id, r->storages, r->n, frame);
  struct job_member *m = registering_member(c, head->id, op);
  if (m == NULL)
    return 0;
  /* A rank that left and joined again is another member: what was checked
   * for the first says nothing of the second's registry. */
  if (r->member != NULL && m != r->member)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "%s: the rank left its job during the frame", op);
  r->member = m;
  int rc = r->rc;
  if (rc == 0) {
    rc = registry_batch_step(&m->reg, r->batch, frame, REGISTRATION_STEP,
                             r->msg, sizeof r->msg);
    if (rc == 1)
      return 1;
  }
  if (rc != 0) {
    note_refused(m, rc, op, r->msg);
    return conn_send_error(c, head->id, rc, "%s: %s", op, r->msg);
  }
  plancache_drop(m->job);
  push_cache_drop(m->job);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, head->id, 1);
  sp__pack_kv_u64(&mb.pk, "count", r->n);
  return conn_send_msgbuf(c, &mb);
}

/* Both steps at once, on the loop: a frame too small to be worth a worker
 * (conn.c), whose steps then follow each other at once. */
static int serve_now(struct conn *c, const struct sp_msg_head *head,
                     struct sp_frame *frame, void *r) {
  int rc;
  while ((rc = serve_registration(c, head, frame, r)) == 1)
    ;
  free_registration(r);
  return rc;
}

const struct conn_prepared_op registration_storages_op = {
    prepare_storages, serve_registration, close_opened, free_registration};
const struct conn_prepared_op registration_tensors_op = {
    prepare_tensors, serve_registration, close_opened, free_registration};

int registration_op_storage_add(struct conn *c,
                                const struct sp_msg_head *head,
                                const msgpack_object *map,
                                struct sp_frame *frame) {
  return serve_now(c, head, frame, prepare_storages(map, frame));
}

int registration_op_tensor_add(struct conn *c,
                               const struct sp_msg_head *head,
                               const msgpack_object *map,
                               struct sp_frame *frame) {
  return serve_now(c, head, frame, prepare_tensors(map, frame));
}
