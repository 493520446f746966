/*
 * consumer.c - a job's consumers: joining with the job's ticket and an
 * index, the buffers they grant (mapped writable by consumer_buffer.c),
 * their targets, leaving, and what status shows of them (consumer.h).
 *
 * As for ranks (job.c), a connection that closes only marks its consumer
 * lost and wakes the job; the job's wake-up fails the push it waits for or
 * takes part in (push.c), and frees it once no push writes its buffers.
 * A consumer that left is remembered until it joins again: every push
 * meanwhile fails at once with consumer_lost, naming it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/mesh/mesh.h"
#include "daemon/peer.h"
#include "daemon/push.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "proto/fail.h"
#include "proto/view.h"
#include "shardport.h"

static void consumer_free(struct job_consumer *k) {
  consumer_buffers_unmap(k->buffers, k->nbuffers);
  free(k->buffers);
  request_targets_free(k->targets, k->ntargets);
  if (k->conn != NULL)
    conn_set_consumer(k->conn, NULL);
  free(k);
}

void consumer_free_all(struct job *job) {
  for (uint32_t i = 0; i < job->nconsumers; i++)
    if (job->consumers[i] != NULL) {
      consumer_free(job->consumers[i]);
      job->consumers[i] = NULL;
    }
}

void consumer_departure_text(const struct job *job, uint32_t index,
                             bool disconnected, const char *when, char *buf,
                             size_t len) {
  snprintf(buf, len, "consumer %" PRIu32 " %s job %s%s", index,
           disconnected ? "disconnected from" : "left", job->hex, when);
}

bool consumer_departed(const struct job *job, char *buf, size_t len) {
  uint32_t first = UINT32_MAX;
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    const struct job_departure *d = &job->consumer_departed[i];
    if (d->gone &&
        (first == UINT32_MAX || d->seq < job->consumer_departed[first].seq))
      first = i;
  }
  if (first == UINT32_MAX)
    return false;
  consumer_departure_text(job, first, job->consumer_departed[first].disconnected,
                          ", which cannot push without it (it may join again)",
                          buf, len);
  return true;
}

/* A consumer left or disconnected: the job remembers it, and the push it
 * waits for or runs in fails (once). */
static void consumer_departs(struct job_consumer *k) {
  struct job *job = k->job;
  if (k->lost_handled)
    return;
  k->lost_handled = true;
  if (!job->dying) {
    struct job_departure *d = &job->consumer_departed[k->index];
    d->seq = ++job->departures;
    d->gone = true;
    d->disconnected = k->disconnected;
  }
  push_consumer_lost(job, k);
}

void consumer_process_lost(struct job *job) {
  for (uint32_t i = 0; i < job->nconsumers; i++)
    if (job->consumers[i] != NULL && job->consumers[i]->lost)
      consumer_departs(job->consumers[i]);
}

void consumer_free_lost(struct job *job) {
  if (push_busy(job))
    return;
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    struct job_consumer *k = job->consumers[i];
    if (k == NULL || !k->lost)
      continue;
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex), "job %s: consumer %u %s",
             job->hex, i, k->disconnected ? "disconnected" : "left");
    consumer_free(k);
    job->consumers[i] = NULL;
    push_cache_drop(job);
  }
}

void consumer_conn_closed(struct job_consumer *k) {
  k->conn = NULL;
  k->lost = true;
  k->disconnected = true;
  job_wake(k->job);
}

int consumer_leave(struct conn *c, struct job_consumer *k,
                   uint64_t request_id) {
  k->lost = true;
  consumer_departs(k);
  conn_set_consumer(c, NULL);
  k->conn = NULL;
  job_wake(k->job);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "leave", request_id, 0);
  return conn_send_msgbuf(c, &mb);
}

int consumer_op_join(struct conn *c, const struct sp_msg_head *head,
                     const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct server *srv = conn_server(c);
  if (conn_member(c) != NULL || conn_consumer(c) != NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "consumer_join: this connection is in a job "
                           "already");
  struct req_join req;
  struct req_ticket ticket;
  char msg[256];
  int rc = request_parse_consumer_join(map, &req, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "consumer_join: %s", msg);
  if (request_parse_ticket(req.ticket, req.ticket_len, &srv->cfg->limits,
                           &ticket) != 0)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "consumer_join: the ticket is not a shardport job "
                           "ticket");
  struct job *job = job_find_ticket(srv, &ticket);
  if (job == NULL && ticket.root[0] != '\0' &&
      strcmp(ticket.root, srv->peer_address) != 0)
    return conn_send_error(c, head->id, SP_EUNSUPPORTED,
                           "consumer_join: job's root is the daemon at %s; "
                           "this daemon serves consumers of its own jobs "
                           "only, so join on that node",
                           ticket.root);
  if (job != NULL && job->mesh != NULL && !mesh_is_root(job->mesh))
    return conn_send_error(c, head->id, SP_EUNSUPPORTED,
                           "consumer_join: job %s is rooted on another "
                           "daemon (%s); this daemon serves consumers of its "
                           "own jobs only, so join on that node",
                           job->hex, ticket.root);
  if (job == NULL || job->dying)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "consumer_join: no job of this ticket on this "
                           "daemon (it ended, or was never created here)");
  if (req.world != job->nconsumers)
    return conn_send_error(c, head->id, SP_ERANK,
                           "consumer_join: %" PRIu32 " consumers differ from "
                           "job %s's %" PRIu32,
                           req.world, job->hex, job->nconsumers);
  if (req.rank >= job->nconsumers)
    return conn_send_error(c, head->id, SP_ERANK,
                           "consumer_join: consumer %" PRIu32 " is not below "
                           "the job's %" PRIu32 " consumers",
                           req.rank, job->nconsumers);
  if (job->consumers[req.rank] != NULL)
    return conn_send_error(c, head->id, SP_ERANK,
                           "consumer_join: consumer %" PRIu32 " of job %s has "
                           "already joined%s",
                           req.rank, job->hex,
                           job->consumers[req.rank]->lost
                               ? " (it is leaving; try again shortly)"
                               : "");
  if (req.device_type != SP_DEVICE_CPU)
    return conn_send_error(c, head->id, SP_EUNSUPPORTED,
                           "consumer_join: device \"%s\": this daemon "
                           "delivers pushes into host buffers only",
                           req.device);
  struct job_consumer *k = calloc(1, sizeof *k);
  if (k == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "consumer_join: out of memory");
  k->job = job;
  k->conn = c;
  k->index = req.rank;
  k->device_type = req.device_type;
  k->pid = (uint32_t)conn_peer(c)->pid;
  snprintf(k->device, sizeof k->device, "%s", req.device);
  job->consumers[req.rank] = k;
  job->consumer_departed[req.rank] = (struct job_departure){0};
  conn_set_consumer(c, k);
  push_cache_drop(job);
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: consumer %" PRIu32 " joined", job->hex, req.rank);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "consumer_join", head->id, 1);
  sp__pack_kv_str(&mb.pk, "job_id", job->hex);
  conn_send_msgbuf(c, &mb);
  job_wake(job);
  return 0;
}

/* A consumer registers only while no push it takes part in waits or
 * runs: the plan of a running push reads its buffers and targets. */
static bool may_register(struct conn *c, const struct job_consumer *k,
                         uint64_t id, const char *op) {
  if (k->job->pushing == NULL && !k->receiving)
    return true;
  conn_send_error(c, id, SP_EEXPORTING,
                  "%s: job %s is running a push or consumer %" PRIu32
                  " waits for one; register before or after it",
                  op, k->job->hex, k->index);
  return false;
}

/* The trainer registries of this daemon, whose memory no consumer buffer
 * may share: every rank of every job here. */
static struct consumer_trainer *node_trainers(const struct server *srv,
                                              size_t *n) {
  size_t count = 0;
  for (const struct job *j = srv->jobs; j != NULL; j = j->next)
    for (uint32_t r = 0; r < j->world; r++)
      count += j->members[r] != NULL;
  struct consumer_trainer *t = calloc(count + 1, sizeof *t);
  if (t == NULL)
    return NULL;
  *n = 0;
  for (const struct job *j = srv->jobs; j != NULL; j = j->next)
    for (uint32_t r = 0; r < j->world; r++)
      if (j->members[r] != NULL)
        t[(*n)++] = (struct consumer_trainer){r, &j->members[r]->reg};
  return t;
}

static bool has_sid(const struct job_consumer *k, uint32_t sid) {
  for (size_t b = 0; b < k->nbuffers; b++)
    if (k->buffers[b].sid == sid)
      return true;
  return false;
}

int consumer_add_storages(struct conn *c, struct job_consumer *k,
                          uint64_t request_id, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame) {
  if (!may_register(c, k, request_id, "storage_add"))
    return 0;
  for (size_t i = 0; i < n; i++)
    if (has_sid(k, s[i].sid))
      return conn_send_error(c, request_id, SP_EINVAL,
                             "storage_add: storages[%zu]: sid %" PRIu32
                             " is registered already",
                             i, s[i].sid);
  if (k->nbuffers + n > REQ_MAX_PER_RANK)
    return conn_send_error(c, request_id, SP_ELIMIT,
                           "storage_add: a consumer registers at most %u "
                           "buffers",
                           REQ_MAX_PER_RANK);
  if (k->nbuffers + n > k->buffers_cap) {
    size_t cap = k->buffers_cap > 0 ? k->buffers_cap : 8;
    while (cap < k->nbuffers + n)
      cap *= 2;
    struct consumer_buffer *grown =
        realloc(k->buffers, cap * sizeof *grown);
    if (grown == NULL)
      return conn_send_error(c, request_id, SP_ENOMEM,
                             "storage_add: out of memory");
    k->buffers = grown;
    k->buffers_cap = cap;
  }
  size_t ntrainers = 0;
  struct consumer_trainer *trainers = node_trainers(conn_server(c), &ntrainers);
  if (trainers == NULL)
    return conn_send_error(c, request_id, SP_ENOMEM,
                           "storage_add: out of memory");
  char msg[SP_ERRMSG_MAX + 1];
  int rc = consumer_buffers_map(s, n, frame, trainers, ntrainers,
                                &k->job->consumer_files,
                                k->buffers + k->nbuffers, msg, sizeof msg);
  free(trainers);
  if (rc != 0)
    return conn_send_error(c, request_id, rc, "storage_add: %s", msg);
  k->nbuffers += n;
  push_cache_drop(k->job);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "storage_add", request_id, 1);
  sp__pack_kv_u64(&mb.pk, "count", n);
  return conn_send_msgbuf(c, &mb);
}

/* The index of the consumer's buffer sid, checked to hold the view. */
static int resolve_view(const struct job_consumer *k, uint32_t sid,
                        const struct sp_view *view, uint32_t *index,
                        const char *where, char *msg, size_t msglen) {
  for (size_t b = 0; b < k->nbuffers; b++)
    if (k->buffers[b].sid == sid) {
      char why[256];
      int rc = sp__view_check(view, k->buffers[b].s.nbytes, why, sizeof why);
      if (rc != 0)
        return sp__failf(msg, msglen, rc, "%s%s", where, why);
      *index = (uint32_t)b;
      return 0;
    }
  return sp__failf(msg, msglen, SP_ENOSTORAGE,
                   "%sstorage sid %" PRIu32 " is not a buffer of consumer %"
                   PRIu32 " (register its storages first)",
                   where, sid, k->index);
}

static int resolve_target(const struct job_consumer *k, struct req_target *t,
                          size_t i, char *msg, size_t msglen) {
  char where[96];
  snprintf(where, sizeof where, "targets[%zu] ('%.24s'): ", i, t->key);
  if (t->t.part != CONSUME_PIECES)
    return resolve_view(k, t->sid, &t->t.view, &t->t.storage, where, msg,
                        msglen);
  for (size_t p = 0; p < t->t.npieces; p++) {
    int rc = resolve_view(k, t->piece_sid[p], &t->pieces[p].dst,
                          &t->pieces[p].storage, where, msg, msglen);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int consumer_op_target_add(struct conn *c, const struct sp_msg_head *head,
                           const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_consumer *k = conn_consumer(c);
  if (k == NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           conn_member(c) != NULL
                               ? "target_add: this connection is a trainer "
                                 "rank; consumers register targets"
                               : "target_add: join a job as a consumer first");
  if (!may_register(c, k, head->id, "target_add"))
    return 0;
  struct req_target *t;
  size_t n;
  char msg[SP_ERRMSG_MAX + 1];
  int rc = request_parse_targets(map, &t, &n, msg, sizeof msg);
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = resolve_target(k, &t[i], i, msg, sizeof msg);
  if (rc == 0 && k->ntargets + n > REQ_MAX_PER_RANK)
    rc = sp__failf(msg, sizeof msg, SP_ELIMIT,
                   "a consumer registers at most %u targets",
                   REQ_MAX_PER_RANK);
  if (rc == 0 && k->ntargets + n > k->targets_cap) {
    size_t cap = k->targets_cap > 0 ? k->targets_cap : 64;
    while (cap < k->ntargets + n)
      cap *= 2;
    struct req_target *grown = realloc(k->targets, cap * sizeof *grown);
    if (grown == NULL)
      rc = sp__failf(msg, sizeof msg, SP_ENOMEM, "out of memory");
    else {
      k->targets = grown;
      k->targets_cap = cap;
    }
  }
  if (rc != 0) {
    request_targets_free(t, n);
    return conn_send_error(c, head->id, rc, "target_add: %s", msg);
  }
  /* The targets' keys and pieces move to the consumer with them. */
  memcpy(k->targets + k->ntargets, t, n * sizeof *t);
  for (size_t i = 0; i < n; i++)
    k->targets[k->ntargets + i].t.pieces = k->targets[k->ntargets + i].pieces;
  k->ntargets += n;
  free(t);
  push_cache_drop(k->job);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "target_add", head->id, 1);
  sp__pack_kv_u64(&mb.pk, "count", n);
  return conn_send_msgbuf(c, &mb);
}

static const char *consumer_state(const struct job_consumer *k) {
  if (k == NULL)
    return "absent";
  if (k->lost)
    return "leaving";
  return k->receiving ? "receiving" : "joined";
}

void consumer_status_pack(const struct job *job, msgpack_packer *pk) {
  msgpack_pack_array(pk, job->nconsumers);
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    const struct job_consumer *k = job->consumers[i];
    msgpack_pack_map(pk, k != NULL ? 5 : 4);
    sp__pack_kv_u64(pk, "index", i);
    sp__pack_kv_str(pk, "state", consumer_state(k));
    sp__pack_kv_str(pk, "device", k != NULL ? k->device : "");
    sp__pack_kv_u64(pk, "bytes_received", k != NULL ? k->bytes_received : 0);
    if (k != NULL)
      sp__pack_kv_u64(pk, "node", mesh_self(job));
  }
}
