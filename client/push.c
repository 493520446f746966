/*
 * push.c - sp_push (a trainer rank's collective) and sp_receive (a
 * consumer's part in the next push): one request each, answered once the
 * push delivered every byte or failed (docs/protocol.md, "push").
 */
#include <string.h>

#include "client/client.h"

/* The longest timeout_ms the protocol allows (docs/protocol.md). */
#define PUSH_TIMEOUT_MAX_MS UINT64_C(86400000)

/* Sends the request in mb and waits for its one answer.  As for exports,
 * the daemon bounds the wait for the others and for progress with
 * timeout_ms (0: its export_timeout, which the library cannot know, so it
 * allows the longest the protocol permits); the library waits that long
 * plus its own timeout, so that the daemon's answer ends the wait. */
static int await_push(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                      const char *op, uint32_t timeout_ms,
                      sp_push_result *out) {
  int rc = client_start(c, mb, id);
  if (rc < 0)
    return rc;
  uint64_t daemon_ms = timeout_ms ? timeout_ms : PUSH_TIMEOUT_MAX_MS;
  uint64_t wait_ms = c->timeout_ms == 0 ? 0 : c->timeout_ms + daemon_ms;
  struct client_reply reply;
  struct sp_msg_head head;
  rc = client_next(c, id, wait_ms, &reply, &head);
  if (rc < 0)
    return rc;
  sp_push_result r = {0};
  bool reused = false;
  if (strcmp(head.op, op) != 0)
    rc = SP_EBADMSG;
  if (rc == 0)
    rc = sp__msg_get_u64(&reply.map, "push_id", false, &r.push_id);
  if (rc == 0)
    rc = sp__msg_get_u64(&reply.map, "bytes", false, &r.bytes);
  if (rc == 0)
    rc = sp__msg_get_bool(&reply.map, "plan_reused", false, &reused);
  client_reply_release(&reply);
  if (rc < 0)
    return SP_EBADMSG;
  r.plan_reused = reused;
  if (out)
    *out = r;
  return 0;
}

SP_EXPORT int sp_push(sp_client *client, const sp_push_opts *opts,
                      sp_push_result *out) {
  static const sp_push_opts defaults;
  if (!opts)
    opts = &defaults;
  if (!client || opts->timeout_ms > PUSH_TIMEOUT_MAX_MS)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "push", 3);
  sp__pack_kv_u64(&mb.pk, "max_keys", opts->max_keys);
  sp__pack_kv_u64(&mb.pk, "max_bytes", opts->max_bytes);
  sp__pack_kv_u64(&mb.pk, "timeout_ms", opts->timeout_ms);
  return await_push(client, &mb, id, "push", opts->timeout_ms, out);
}

SP_EXPORT int sp_receive(sp_client *client, uint32_t timeout_ms,
                         sp_push_result *out) {
  if (!client || timeout_ms > PUSH_TIMEOUT_MAX_MS)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "receive", 1);
  sp__pack_kv_u64(&mb.pk, "timeout_ms", timeout_ms);
  return await_push(client, &mb, id, "receive", timeout_ms, out);
}
