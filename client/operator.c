/*
 * operator.c - the operator's calls on jobs (docs/protocol.md, "jobs",
 * "job_status", "job_abort"): every job of the daemon, one job in full,
 * and abort.
 *
 * Replies are read as strictly as status's (client/status.c, whose readers
 * these share): every documented field is required with its type, counts
 * must fit their fields, and a reply that breaks a promise of the protocol
 * (a page that does not advance in id order, a ranks array that is not
 * the job's world) is SP_EBADMSG.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"

/* The protocol's bounds: job ids of 32 hex digits, at most 65,536 jobs on
 * a daemon (max_jobs) and ranks in a job (world). */
#define JOB_HEX 32
#define JOBS_MAX 65536u
#define WORLD_MAX 65536u

/* A job reference as the daemon takes it: 1 to 32 hex digits. */
static bool job_ref_ok(const char *job) {
  size_t len = job != NULL ? strlen(job) : 0;
  return len >= 1 && len <= JOB_HEX &&
         strspn(job, "0123456789abcdefABCDEF") == len;
}

static int get_uint(const msgpack_object *map, const char *key,
                    uint64_t *out) {
  return sp__msg_get_u64(map, key, false, out);
}

static int decode_entry(const msgpack_object *o, sp_job_entry *e) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  int rc = client_copy_str(o, "job_id", false, &e->job_id);
  if (rc == 0 && strlen(e->job_id) != JOB_HEX)
    rc = SP_EBADMSG;
  if (rc == 0)
    rc = client_copy_str(o, "phase", false, &e->phase);
  if (rc == 0)
    rc = client_get_u32(o, "owner_uid", false, &e->owner_uid);
  if (rc == 0)
    rc = client_get_u32(o, "owner_pid", false, &e->owner_pid);
  if (rc == 0)
    rc = client_get_amount(o, "age_s", &e->age_s);
  if (rc == 0)
    rc = get_uint(o, "exports", &e->exports);
  if (rc == 0)
    rc = client_get_u32(o, "world", false, &e->world);
  if (rc == 0)
    rc = client_get_u32(o, "joined", false, &e->joined);
  if (rc == 0)
    rc = client_get_u32(o, "asked", false, &e->asked);
  if (rc == 0)
    rc = get_uint(o, "export_id", &e->export_id);
  if (rc == 0)
    rc = client_get_u32(o, "node", false, &e->node);
  if (rc == 0)
    rc = client_get_u32(o, "node_count", false, &e->node_count);
  return rc;
}

/* One page after `after` ("" for the first) appended to list; *more says
 * whether another follows. */
static int fetch_page(sp_client *client, const char *after,
                      sp_job_list *list, bool *more) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "jobs", after[0] ? 1 : 0);
  if (after[0])
    sp__pack_kv_str(&mb.pk, "after", after);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "jobs", &reply);
  if (rc < 0)
    return rc;
  const msgpack_object_array *a;
  rc = sp__msg_get_array(&reply.map, "jobs", false, &a);
  if (rc == 0)
    rc = sp__msg_get_bool(&reply.map, "more", false, more);
  if (rc == 0 && (a->size > JOBS_MAX - list->njobs || (*more && a->size == 0)))
    rc = SP_EBADMSG;
  sp_job_entry *grown = NULL;
  if (rc == 0 && a->size > 0) {
    grown = realloc(list->jobs, (list->njobs + a->size) * sizeof *grown);
    if (grown == NULL)
      rc = SP_ENOMEM;
    else
      list->jobs = grown;
  }
  for (uint32_t i = 0; rc == 0 && i < a->size; i++) {
    sp_job_entry *e = &list->jobs[list->njobs];
    memset(e, 0, sizeof *e);
    list->njobs++;
    rc = decode_entry(&a->ptr[i], e);
    /* Pages come in id order, each after the last id of the one before:
     * anything else could loop for ever.  Within a page one id may come
     * more than once (shadows of one job id with different secrets, which
     * the daemon keeps on one page). */
    int order = i == 0 ? strcmp(e->job_id, after)
                       : strcmp(e->job_id, list->jobs[list->njobs - 2].job_id);
    if (rc == 0 && (i == 0 ? order <= 0 : order < 0))
      rc = SP_EBADMSG;
  }
  client_reply_release(&reply);
  return rc;
}

SP_EXPORT int sp_jobs(sp_client *client, sp_job_list **out) {
  if (!client || !out)
    return SP_EINVAL;
  sp_job_list *list = calloc(1, sizeof *list);
  if (!list)
    return SP_ENOMEM;
  char after[JOB_HEX + 1] = "";
  bool more = true;
  int rc = 0;
  while (rc == 0 && more) {
    rc = fetch_page(client, after, list, &more);
    if (rc == 0 && list->njobs > 0)
      memcpy(after, list->jobs[list->njobs - 1].job_id, JOB_HEX + 1);
  }
  if (rc < 0) {
    sp_job_list_free(list);
    return rc;
  }
  *out = list;
  return 0;
}

SP_EXPORT void sp_job_list_free(sp_job_list *list) {
  if (!list)
    return;
  for (size_t i = 0; i < list->njobs; i++) {
    free(list->jobs[i].job_id);
    free(list->jobs[i].phase);
  }
  free(list->jobs);
  free(list);
}

static int decode_rank(const msgpack_object *o, sp_rank_info *r) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  r->node = -1;
  int rc = client_copy_str(o, "state", false, &r->state);
  if (rc == 0)
    rc = client_get_u32(o, "pid", true, &r->pid);
  uint64_t node;
  int has = rc == 0 ? sp__msg_get_u64(o, "node", true, &node) : rc;
  if (has < 0)
    return has;
  if (has == 0 && node > UINT32_MAX)
    return SP_EBADMSG;
  if (has == 0)
    r->node = (int64_t)node;
  return 0;
}

static int decode_record(const msgpack_object *o, sp_export_record *e) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  char *outcome = NULL;
  int rc = get_uint(o, "export_id", &e->export_id);
  if (rc == 0)
    rc = client_copy_str(o, "outcome", false, &outcome);
  if (rc == 0) {
    e->failed = strcmp(outcome, "failed") == 0;
    if (!e->failed && strcmp(outcome, "published") != 0)
      rc = SP_EBADMSG;
  }
  free(outcome);
  if (rc == 0 && e->failed)
    rc = client_copy_str(o, "error", false, &e->error);
  if (rc == 0)
    rc = client_get_amount(o, "age_s", &e->age_s);
  if (rc == 0)
    rc = client_get_amount(o, "duration_s", &e->duration_s);
  if (rc == 0)
    rc = client_get_u32(o, "rounds", false, &e->rounds);
  if (rc == 0)
    rc = get_uint(o, "bytes_moved", &e->bytes_moved);
  if (rc == 0)
    rc = get_uint(o, "bytes_total", &e->bytes_total);
  if (rc == 0)
    rc = client_get_amount(o, "rate_bps", &e->rate_bps);
  return rc;
}

static int decode_detail(const msgpack_object *reply, sp_job_detail *d) {
  const msgpack_object *o;
  int rc = sp__msg_get_map(reply, "job", false, &o);
  if (rc < 0)
    return rc;
  rc = client_decode_job(o, &d->job);
  if (rc == 0)
    rc = client_get_u32(o, "owner_uid", false, &d->owner_uid);
  if (rc == 0)
    rc = client_get_u32(o, "owner_pid", false, &d->owner_pid);
  if (rc == 0)
    rc = client_get_amount(o, "age_s", &d->age_s);
  if (rc == 0)
    rc = get_uint(o, "exports", &d->exports);
  const msgpack_object_array *ranks, *history;
  if (rc == 0)
    rc = sp__msg_get_array(o, "ranks", false, &ranks);
  if (rc == 0)
    rc = sp__msg_get_array(o, "history", false, &history);
  if (rc < 0)
    return rc;
  if (ranks->size != d->job.world || ranks->size > WORLD_MAX ||
      history->size > d->exports)
    return SP_EBADMSG;
  if (ranks->size > 0 &&
      (d->ranks = calloc(ranks->size, sizeof *d->ranks)) == NULL)
    return SP_ENOMEM;
  d->nranks = ranks->size;
  for (uint32_t i = 0; rc == 0 && i < ranks->size; i++)
    rc = decode_rank(&ranks->ptr[i], &d->ranks[i]);
  if (rc == 0 && history->size > 0 &&
      (d->history = calloc(history->size, sizeof *d->history)) == NULL)
    return SP_ENOMEM;
  d->nhistory = rc == 0 ? history->size : 0;
  for (uint32_t i = 0; rc == 0 && i < history->size; i++)
    rc = decode_record(&history->ptr[i], &d->history[i]);
  return rc;
}

SP_EXPORT int sp_job_show(sp_client *client, const char *job,
                          sp_job_detail **out) {
  if (!client || !out || !job_ref_ok(job))
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "job_status", 1);
  sp__pack_kv_str(&mb.pk, "job", job);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "job_status", &reply);
  if (rc < 0)
    return rc;
  sp_job_detail *d = calloc(1, sizeof *d);
  rc = d ? decode_detail(&reply.map, d) : SP_ENOMEM;
  client_reply_release(&reply);
  if (rc < 0) {
    sp_job_detail_free(d);
    return rc;
  }
  *out = d;
  return 0;
}

SP_EXPORT void sp_job_detail_free(sp_job_detail *detail) {
  if (!detail)
    return;
  client_job_clear(&detail->job);
  for (size_t i = 0; i < detail->nranks; i++)
    free(detail->ranks[i].state);
  free(detail->ranks);
  for (size_t i = 0; i < detail->nhistory; i++)
    free(detail->history[i].error);
  free(detail->history);
  free(detail);
}

SP_EXPORT int sp_job_abort(sp_client *client, const char *job, char *job_id,
                           size_t size) {
  if (!client || !job_ref_ok(job) || (job_id && size < JOB_HEX + 1))
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "job_abort", 1);
  sp__pack_kv_str(&mb.pk, "job", job);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "job_abort", &reply);
  if (rc < 0)
    return rc;
  char *whole = NULL;
  rc = client_copy_str(&reply.map, "job_id", false, &whole);
  if (rc == 0 && strlen(whole) != JOB_HEX)
    rc = SP_EBADMSG;
  if (rc == 0 && job_id)
    memcpy(job_id, whole, JOB_HEX + 1);
  free(whole);
  client_reply_release(&reply);
  return rc;
}
