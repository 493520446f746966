/*
 * status.c - sp_status: the daemon's status reply as an sp_status_info.
 *
 * Every field docs/protocol.md lists is required and checked for its type
 * (and for counts that must fit 32 bits, for floats that must be finite and
 * not negative); fields this build does not know are ignored, so a newer
 * daemon may add some.  All strings are copied, so the snapshot outlives the
 * reply frame.
 */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"

int client_copy_str(const msgpack_object *map, const char *key,
                    bool optional, char **out) {
  const char *p;
  size_t len;
  int rc = sp__msg_get_str(map, key, optional, &p, &len);
  if (rc != 0)
    return rc == 1 ? 0 : rc;
  if (memchr(p, '\0', len))
    return SP_EBADMSG;
  *out = strndup(p, len);
  return *out ? 0 : SP_ENOMEM;
}

int client_get_u32(const msgpack_object *map, const char *key, bool optional,
                   uint32_t *out) {
  uint64_t v;
  int rc = sp__msg_get_u64(map, key, optional, &v);
  if (rc != 0)
    return rc == 1 ? 0 : rc;
  if (v > UINT32_MAX)
    return SP_EBADMSG;
  *out = (uint32_t)v;
  return 0;
}

int client_get_amount(const msgpack_object *map, const char *key,
                      double *out) {
  int rc = sp__msg_get_f64(map, key, false, out);
  if (rc < 0)
    return rc;
  return isfinite(*out) && *out >= 0 ? 0 : SP_EBADMSG;
}

/* The array of backend names joined with commas.  A name must be non-empty
 * and hold no comma or NUL, so that the joined form splits back exactly. */
static int join_backends(const msgpack_object *map, char **out) {
  const msgpack_object_array *a;
  int rc = sp__msg_get_array(map, "backends_built", false, &a);
  if (rc < 0)
    return rc;
  size_t total = 1;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *o = &a->ptr[i];
    if (o->type != MSGPACK_OBJECT_STR || o->via.str.size == 0 ||
        memchr(o->via.str.ptr, ',', o->via.str.size) ||
        memchr(o->via.str.ptr, '\0', o->via.str.size))
      return SP_EBADMSG;
    total += o->via.str.size + 1;
  }
  char *s = malloc(total);
  if (!s)
    return SP_ENOMEM;
  size_t off = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    if (i > 0)
      s[off++] = ',';
    memcpy(s + off, a->ptr[i].via.str.ptr, a->ptr[i].via.str.size);
    off += a->ptr[i].via.str.size;
  }
  s[off] = '\0';
  *out = s;
  return 0;
}

static int get_flag(const msgpack_object *map, const char *key, int *out) {
  bool v;
  int rc = sp__msg_get_bool(map, key, false, &v);
  if (rc == 0)
    *out = v ? 1 : 0;
  return rc;
}

static int decode_node(const msgpack_object *o, sp_node_status *n) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  int rc = client_get_u32(o, "node", false, &n->node);
  if (rc == 0)
    rc = client_copy_str(o, "address", false, &n->address);
  if (rc == 0)
    rc = get_flag(o, "self", &n->self);
  if (rc == 0)
    rc = get_flag(o, "connected", &n->connected);
  if (rc == 0)
    rc = sp__msg_get_u64(o, "bytes_sent", false, &n->bytes_sent);
  if (rc == 0)
    rc = sp__msg_get_u64(o, "bytes_received", false, &n->bytes_received);
  return rc;
}

/* The fields of a job across nodes; a daemon that predates them sends none
 * (plan_digest stays NULL, nodes empty). */
static int decode_nodes(const msgpack_object *o, sp_job_status *job) {
  int rc = client_copy_str(o, "plan_digest", true, &job->plan_digest);
  uint64_t node = 0;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "node", true, &node)) == 1)
    rc = 0;
  if (rc == 0 && node > UINT32_MAX)
    rc = SP_EBADMSG;
  job->node = (uint32_t)node;
  const msgpack_object_array *a;
  int has = rc == 0 ? sp__msg_get_array(o, "nodes", true, &a) : rc;
  if (has != 0 || a->size == 0)
    return has < 0 ? has : rc;
  job->nodes = calloc(a->size, sizeof *job->nodes);
  if (!job->nodes)
    return SP_ENOMEM;
  job->nnodes = a->size;
  for (uint32_t i = 0; i < a->size && rc == 0; i++)
    rc = decode_node(&a->ptr[i], &job->nodes[i]);
  return rc;
}

static int decode_consumer(const msgpack_object *o, sp_consumer_status *k) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  int rc = client_get_u32(o, "index", false, &k->index);
  if (rc == 0)
    rc = client_copy_str(o, "state", false, &k->state);
  if (rc == 0)
    rc = client_copy_str(o, "device", false, &k->device);
  if (rc == 0)
    rc = sp__msg_get_u64(o, "bytes_received", false, &k->bytes_received);
  uint64_t node = 0;
  k->node = -1;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "node", true, &node)) == 0)
    k->node = node > UINT32_MAX ? -1 : (int64_t)node;
  return rc == 1 ? 0 : rc;
}

/* From protocol 4 on; a daemon without them leaves none and zeros. */
static int decode_consumers(const msgpack_object *o, sp_job_status *job) {
  int rc = sp__msg_get_u64(o, "pushes", true, &job->pushes);
  if (rc >= 0)
    rc = sp__msg_get_u64(o, "push_plans", true, &job->push_plans);
  const msgpack_object_array *a;
  int has = rc >= 0 ? sp__msg_get_array(o, "consumers", true, &a) : rc;
  if (has != 0 || a->size == 0)
    return has < 0 ? has : 0;
  job->consumers = calloc(a->size, sizeof *job->consumers);
  if (!job->consumers)
    return SP_ENOMEM;
  job->nconsumers = a->size;
  rc = 0;
  for (uint32_t i = 0; i < a->size && rc == 0; i++)
    rc = decode_consumer(&a->ptr[i], &job->consumers[i]);
  return rc;
}

int client_decode_job(const msgpack_object *o, sp_job_status *job) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return SP_EBADMSG;
  int rc = client_copy_str(o, "job_id", false, &job->job_id);
  if (rc == 0)
    rc = client_copy_str(o, "phase", false, &job->phase);
  if (rc == 0)
    rc = client_copy_str(o, "error", true, &job->error);
  if (rc == 0 && strcmp(job->phase, "failed") != 0) {
    /* The header promises error only for a failed job. */
    free(job->error);
    job->error = NULL;
  }
  if (rc == 0)
    rc = client_get_u32(o, "world", false, &job->world);
  if (rc == 0)
    rc = client_get_u32(o, "joined", false, &job->joined);
  if (rc == 0)
    rc = client_get_u32(o, "round", false, &job->round);
  if (rc == 0)
    rc = client_get_u32(o, "rounds", false, &job->rounds);
  if (rc == 0)
    rc = sp__msg_get_u64(o, "bytes_moved", false, &job->bytes_moved);
  if (rc == 0)
    rc = sp__msg_get_u64(o, "bytes_total", false, &job->bytes_total);
  if (rc == 0)
    rc = client_get_amount(o, "rate_bps", &job->rate_bps);
  if (rc == 0)
    rc = decode_nodes(o, job);
  /* From protocol 2 on; a daemon without them leaves zeros. */
  if (rc == 0)
    rc = client_get_u32(o, "asked", true, &job->asked);
  if (rc == 0 &&
      (rc = sp__msg_get_u64(o, "export_id", true, &job->export_id)) == 1)
    rc = 0;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "bytes_prepared", true,
                                       &job->bytes_prepared)) == 1)
    rc = 0;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "bytes_to_prepare", true,
                                       &job->bytes_to_prepare)) == 1)
    rc = 0;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "bytes_written", true,
                                      &job->bytes_written)) == 1)
    rc = 0;
  if (rc == 0 && (rc = sp__msg_get_u64(o, "bytes_to_write", true,
                                      &job->bytes_to_write)) == 1)
    rc = 0;
  if (rc == 0)
    rc = decode_consumers(o, job);
  return rc;
}

static int decode_jobs(const msgpack_object *map, sp_status_info *info) {
  const msgpack_object_array *a;
  int rc = sp__msg_get_array(map, "jobs", false, &a);
  if (rc < 0 || a->size == 0)
    return rc;
  info->jobs = calloc(a->size, sizeof *info->jobs);
  if (!info->jobs)
    return SP_ENOMEM;
  info->njobs = a->size;
  for (uint32_t i = 0; i < a->size && rc == 0; i++)
    rc = client_decode_job(&a->ptr[i], &info->jobs[i]);
  return rc;
}

static int decode_status(const msgpack_object *map, sp_status_info *info) {
  int rc = client_copy_str(map, "daemon_version", false, &info->daemon_version);
  if (rc == 0)
    rc = client_get_u32(map, "protocol_version", false, &info->protocol_version);
  if (rc == 0)
    rc = join_backends(map, &info->backends_built);
  if (rc == 0)
    rc = client_copy_str(map, "backend_active", false, &info->backend_active);
  if (rc == 0)
    rc = client_copy_str(map, "backend_reason", false, &info->backend_reason);
  if (rc == 0)
    rc = client_get_amount(map, "uptime_s", &info->uptime_s);
  if (rc == 0)
    rc = client_get_u32(map, "clients", false, &info->clients);
  if (rc == 0)
    rc = sp__msg_get_u64(map, "pool_used", false, &info->pool_used);
  if (rc == 0)
    rc = sp__msg_get_u64(map, "pool_capacity", false, &info->pool_capacity);
  if (rc == 0)
    rc = decode_jobs(map, info);
  if (rc == 0)
    rc = client_copy_str(map, "peer_address", true, &info->peer_address);
  if (rc == 0 && info->peer_address && info->peer_address[0] == '\0') {
    /* Sent empty when the daemon does not listen for peers. */
    free(info->peer_address);
    info->peer_address = NULL;
  }
  bool draining = false;
  if (rc == 0 && (rc = sp__msg_get_bool(map, "draining", true, &draining)) == 1)
    rc = 0;
  info->draining = draining ? 1 : 0;
  if (rc == 0 && (rc = sp__msg_get_u64(map, "loop_max_busy_us", true,
                                       &info->loop_max_busy_us)) == 1)
    rc = 0;
  return rc;
}

SP_EXPORT int sp_status(sp_client *client, sp_status_info **out) {
  if (!client || !out)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "status", 0);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "status", &reply);
  if (rc < 0)
    return rc;
  sp_status_info *info = calloc(1, sizeof *info);
  rc = info ? decode_status(&reply.map, info) : SP_ENOMEM;
  client_reply_release(&reply);
  if (rc < 0) {
    sp_status_free(info);
    return rc;
  }
  *out = info;
  return 0;
}

void client_job_clear(sp_job_status *job) {
  free(job->job_id);
  free(job->phase);
  free(job->error);
  free(job->plan_digest);
  for (size_t n = 0; n < job->nnodes; n++)
    free(job->nodes[n].address);
  free(job->nodes);
  for (uint32_t k = 0; k < job->nconsumers; k++) {
    free(job->consumers[k].state);
    free(job->consumers[k].device);
  }
  free(job->consumers);
}

SP_EXPORT void sp_status_free(sp_status_info *status) {
  if (!status)
    return;
  for (size_t i = 0; i < status->njobs; i++)
    client_job_clear(&status->jobs[i]);
  free(status->peer_address);
  free(status->jobs);
  free(status->daemon_version);
  free(status->backends_built);
  free(status->backend_active);
  free(status->backend_reason);
  free(status);
}
