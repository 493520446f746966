/*
 * client.h - what the files of libshardport share and nothing else sees.
 *
 * The library speaks one request at a time on a blocking socket: a caller
 * begins a message with client_begin, packs its fields, and client_call sends
 * it and reads frames until the reply that carries the request's id.  Every
 * symbol here is hidden from the shared object's dynamic table.
 */
#ifndef SP_CLIENT_CLIENT_H
#define SP_CLIENT_CLIENT_H

#include <msgpack.h>
#include <stdint.h>

#include "proto/frame.h"
#include "proto/msg.h"
#include "shardport.h"

/* How long one request may take unless sp_set_timeout says otherwise. */
#define CLIENT_DEFAULT_TIMEOUT_MS 30000u

struct sp_client {
  int sock;
  struct sp_frame_rx rx;
  uint64_t next_id;
  uint32_t timeout_ms; /* 0 waits forever */
  /* The first error that left the stream out of step (a partly written
   * request, a framing error); every later request fails with it. */
  int broken;
  /* The daemon's text from the last error reply, for sp_last_message. */
  char message[SP_ERRMSG_MAX + 1];
};

/* A reply being held: map points into frame.data and zone, which the reply
 * owns until client_reply_release. */
struct client_reply {
  struct sp_frame frame;
  msgpack_zone zone;
  msgpack_object map;
};

/* Begins a request with nfields fields after op and id; returns its id. */
uint64_t client_begin(sp_client *c, struct sp_msgbuf *mb, const char *op,
                      uint32_t nfields);

/*
 * Sends the request in mb (left empty whatever happens) and waits for the
 * frame that answers it.  Returns 0 with the reply in *reply when it carries
 * op; the error reply's code (its text kept for sp_last_message) when the
 * daemon refused; SP_EBADMSG for a reply with another op; SP_ETIMEOUT when
 * the client's timeout passed first; or a transport code.
 */
int client_call(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                const char *op, struct client_reply *reply);

void client_reply_release(struct client_reply *reply);

#endif /* SP_CLIENT_CLIENT_H */
