/*
 * fake_daemon.h - a scripted stand-in for shardportd, for testing how
 * libshardport and the CLI handle replies a real daemon never sends.
 *
 * fake_daemon_start listens on a fresh socket in a private temporary
 * directory and runs script on a thread for the first connection; the
 * script talks to the client with the helpers below and returns, which
 * closes the connection.  Every blocking call has a timeout, so a client
 * that stops talking fails the test instead of hanging it.
 */
#ifndef SP_TEST_FAKE_DAEMON_H
#define SP_TEST_FAKE_DAEMON_H

#include <limits.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/frame.h"
#include "proto/msg.h"

#define FAKE_TIMEOUT_MS 10000

typedef void fake_script(int conn, void *arg);

struct fake_daemon {
  char dir[128];
  char socket[160];
  int listen_fd;
  pthread_t thread;
  fake_script *script;
  void *arg;
};

/* Returns 0 or -1; on success the socket accepts connections at once. */
int fake_daemon_start(struct fake_daemon *d, fake_script *script, void *arg);
/* Waits for the script to end, closes and removes everything. */
void fake_daemon_stop(struct fake_daemon *d);

/* One decoded request. */
struct fake_request {
  struct sp_frame frame;
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
};

/* Reads one request: 0, SP_ECLOSED at the end of the stream, or a code. */
int fake_recv(int conn, struct fake_request *req);
void fake_request_free(struct fake_request *req);

/* Sends a message begun with sp__msgbuf_begin, fds attached. */
int fake_send(int conn, struct sp_msgbuf *mb, const int *fds, size_t nfds);
/* Sends {"op":op,"id":id}. */
int fake_send_op(int conn, const char *op, uint64_t id);
int fake_send_error(int conn, uint64_t id, const char *code,
                    const char *message);
/* The backend_reason of fake_send_status: control characters, quotes, a
 * backslash, valid UTF-8 and one invalid byte, for the CLI's escaping. */
extern const char fake_backend_reason[];

/* Sends a status reply with two jobs and an unknown field.  corrupt names a
 * field to send with the wrong type ("clients"), or "missing:clients",
 * "protocol_version:big", "uptime_s:nan", "jobs[0]"; NULL for a good
 * reply. */
int fake_send_status(int conn, uint64_t id, const char *corrupt);

/* Reads the hello and answers it as shardportd would.  Returns 0, or a code
 * when the request was not a well-formed hello. */
int fake_hello(int conn);

#endif /* SP_TEST_FAKE_DAEMON_H */
