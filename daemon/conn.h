/*
 * conn.h - one client connection: framed requests in, replies out (conn.c).
 */
#ifndef SP_DAEMON_CONN_H
#define SP_DAEMON_CONN_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;

/* An op whose frames may be large, in two parts (conn.c, "Large frames"
 * in docs/operations.md): prepare reads the request out of the decoded
 * frame, touching nothing else, so on a worker thread; serve does the
 * rest on the loop, and returns 1 when it wants another step in a later
 * turn of the loop, or else has replied (0, or a negative code to reply;
 * prepared NULL means prepare ran out of memory).  close, when set, lets
 * go on the loop of what only the loop's thread may (a GPU's handles),
 * before free, which may run on any thread. */
struct conn_prepared_op {
  void *(*prepare)(const msgpack_object *map, const struct sp_frame *frame);
  int (*serve)(struct conn *c, const struct sp_msg_head *head,
               struct sp_frame *frame, void *prepared);
  void (*close)(void *prepared);
  void (*free)(void *prepared);
};
struct peer;
struct server;

/* Takes an accepted, checked, non-blocking socket.  Returns 0 or a negative
 * code (the socket is then closed). */
int conn_open(struct server *srv, int sock, const struct peer *peer);
/* Closes the connection at once, dropping unsent replies, and takes it off
 * the server's list. */
void conn_close(struct conn *c);
/* Queues a complete reply (the conn takes tx and its buffer). */
int conn_send(struct conn *c, struct sp_frame_tx *tx);
/* Queues an error reply.  Returns 0 or a negative code. */
int conn_send_error(struct conn *c, uint64_t id, int code, const char *fmt,
                    ...) __attribute__((format(printf, 4, 5)));
/* Finishes mb and queues it. */
int conn_send_msgbuf(struct conn *c, struct sp_msgbuf *mb);
struct server *conn_server(const struct conn *c);
/* The peer's uid, as SO_PEERCRED gave it. */
uid_t conn_uid(const struct conn *c);
/* The peer's credentials, read when it connected (SO_PEERCRED). */
const struct peer *conn_peer(const struct conn *c);
/* The next of the server's open connections (srv->conns first), or NULL. */
struct conn *conn_next(const struct conn *c);
/* Ends the connection with a last error reply of id 0 (docs/protocol.md,
 * "Connections the daemon ends"): nothing more is read, the queued replies
 * and this one are written (or the drain timeout passes), then it closes.
 * A rank on it leaves its job as if it had disconnected. */
void conn_finish(struct conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The connection's number, and the open connection of that number (NULL
 * once it closed): a reference that cannot dangle. */
uint64_t conn_id(const struct conn *c);
struct conn *conn_find(const struct server *srv, uint64_t id);

struct job_member;
/* The job rank this connection joined as, or NULL. */
struct job_member *conn_member(const struct conn *c);
void conn_set_member(struct conn *c, struct job_member *member);
struct job_consumer;
/* The job consumer this connection joined as, or NULL. */
struct job_consumer *conn_consumer(const struct conn *c);
void conn_set_consumer(struct conn *c, struct job_consumer *consumer);
/* The hello op's handler (ops.c): the connection's first exchange, which
 * checks the protocol version and lifts the frame limit to max_frame. */
int conn_op_hello(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame);
/* Bytes of replies the connection may still queue before max_output. */
uint64_t conn_output_room(const struct conn *c);
/* Calls fn(c, arg) whenever a write leaves the reply queue at most half
 * full, until set to NULL: how long replies are streamed without letting
 * them pile up past max_output. */
void conn_on_drained(struct conn *c, void (*fn)(struct conn *c, void *arg),
                     void *arg);

#endif /* SP_DAEMON_CONN_H */
