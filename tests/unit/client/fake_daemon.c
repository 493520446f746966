/*
 * fake_daemon.c - a scripted stand-in for shardportd (see fake_daemon.h).
 */
#include "tests/unit/client/fake_daemon.h"

#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "proto/wire.h"
#include "shardport.h"

static void *fake_thread(void *p) {
  struct fake_daemon *d = p;
  struct pollfd pfd = {.fd = d->listen_fd, .events = POLLIN};
  if (poll(&pfd, 1, FAKE_TIMEOUT_MS) != 1)
    return NULL;
  int conn = accept4(d->listen_fd, NULL, NULL, SOCK_CLOEXEC);
  if (conn < 0)
    return NULL;
  struct timeval tv = {FAKE_TIMEOUT_MS / 1000, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  d->script(conn, d->arg);
  close(conn);
  return NULL;
}

int fake_daemon_start(struct fake_daemon *d, fake_script *script, void *arg) {
  memset(d, 0, sizeof *d);
  d->listen_fd = -1;
  d->script = script;
  d->arg = arg;
  snprintf(d->dir, sizeof d->dir, "/tmp/sp-fake-XXXXXX");
  if (!mkdtemp(d->dir))
    return -1;
  snprintf(d->socket, sizeof d->socket, "%s/fake.sock", d->dir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  memcpy(sa.sun_path, d->socket, strlen(d->socket) + 1);
  d->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (d->listen_fd < 0 ||
      bind(d->listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      listen(d->listen_fd, 4) != 0 ||
      pthread_create(&d->thread, NULL, fake_thread, d) != 0) {
    if (d->listen_fd >= 0)
      close(d->listen_fd);
    unlink(d->socket);
    rmdir(d->dir);
    return -1;
  }
  return 0;
}

void fake_daemon_stop(struct fake_daemon *d) {
  pthread_join(d->thread, NULL);
  close(d->listen_fd);
  unlink(d->socket);
  rmdir(d->dir);
}

int fake_recv(int conn, struct fake_request *req) {
  memset(req, 0, sizeof *req);
  struct sp_limits limits;
  sp__limits_default(&limits);
  struct sp_frame_rx rx;
  sp__frame_rx_init(&rx, &limits);
  /* The socket is blocking with SO_RCVTIMEO: 0 means the timeout passed. */
  int rc = sp__frame_rx_read(&rx, conn, &req->frame);
  sp__frame_rx_reset(&rx);
  if (rc == 0)
    return SP_ETIMEOUT;
  if (rc < 0)
    return rc;
  msgpack_zone_init(&req->zone, 1024);
  rc = sp__wire_decode(req->frame.data, req->frame.len, &limits, &req->zone,
                       &req->map);
  if (rc == 0)
    rc = sp__msg_head(&req->map, &req->head);
  if (rc < 0)
    fake_request_free(req);
  return rc;
}

void fake_request_free(struct fake_request *req) {
  msgpack_zone_destroy(&req->zone);
  sp__frame_release(&req->frame);
  memset(req, 0, sizeof *req);
}

int fake_send(int conn, struct sp_msgbuf *mb, const int *fds, size_t nfds) {
  struct sp_frame_tx tx;
  int rc = sp__msgbuf_finish(mb, &tx);
  if (rc < 0)
    return rc;
  rc = sp__frame_send(conn, tx.buf, tx.len, fds, nfds);
  free(tx.buf);
  return rc;
}

int fake_send_op(int conn, const char *op, uint64_t id) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, id, 0);
  return fake_send(conn, &mb, NULL, 0);
}

int fake_send_error(int conn, uint64_t id, const char *code,
                    const char *message) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "error", id, 2);
  sp__pack_kv_str(&mb.pk, "code", code);
  sp__pack_kv_str(&mb.pk, "message", message);
  return fake_send(conn, &mb, NULL, 0);
}

int fake_hello(int conn) {
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  if (rc < 0)
    return rc;
  uint64_t version;
  const char *client;
  size_t client_len;
  if (strcmp(req.head.op, "hello") != 0 ||
      sp__msg_get_u64(&req.map, "version", false, &version) != 0 ||
      version != SP_PROTOCOL_VERSION_NUMBER ||
      sp__msg_get_str(&req.map, "client", false, &client, &client_len) != 0)
    rc = SP_EBADMSG;
  uint64_t id = req.head.id;
  fake_request_free(&req);
  if (rc < 0)
    return rc;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", id, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION_NUMBER);
  sp__pack_kv_str(&mb.pk, "daemon", "0.1.0-fake");
  return fake_send(conn, &mb, NULL, 0);
}

/* Packs key with value, or with a value of the wrong type when corrupt
 * names it. */
static bool wrong(const char *corrupt, const char *key) {
  return corrupt && strcmp(corrupt, key) == 0;
}

static void pack_u64(msgpack_packer *pk, const char *corrupt, const char *key,
                     uint64_t v) {
  if (wrong(corrupt, key))
    sp__pack_kv_str(pk, key, "not a number");
  else
    sp__pack_kv_u64(pk, key, v);
}

static void pack_f64(msgpack_packer *pk, const char *corrupt, const char *key,
                     double v) {
  if (wrong(corrupt, key))
    sp__pack_kv_str(pk, key, "not a number");
  else
    sp__pack_kv_f64(pk, key, v);
}

static void pack_str(msgpack_packer *pk, const char *corrupt, const char *key,
                     const char *v) {
  if (wrong(corrupt, key))
    sp__pack_kv_u64(pk, key, 7);
  else
    sp__pack_kv_str(pk, key, v);
}

const char fake_backend_reason[] =
    "no CUDA driver \xc3\xa9 \x1b[31m \"q\" \\ \t \xff end";

int fake_send_status(int conn, uint64_t id, const char *corrupt) {
  struct sp_msgbuf mb;
  bool drop_clients = wrong(corrupt, "missing:clients");
  sp__msgbuf_begin(&mb, "status", id, drop_clients ? 10 : 11);
  msgpack_packer *pk = &mb.pk;
  pack_str(pk, corrupt, "daemon_version", "0.1.0-fake");
  if (wrong(corrupt, "protocol_version:big"))
    sp__pack_kv_u64(pk, "protocol_version", UINT64_C(1) << 33);
  else
    pack_u64(pk, corrupt, "protocol_version", SP_PROTOCOL_VERSION_NUMBER);
  sp__pack_str(pk, "backends_built");
  msgpack_pack_array(pk, 2);
  sp__pack_str(pk, "host");
  if (wrong(corrupt, "backends_built"))
    msgpack_pack_uint64(pk, 3);
  else
    sp__pack_str(pk, "cuda");
  pack_str(pk, corrupt, "backend_active", "host");
  pack_str(pk, corrupt, "backend_reason", fake_backend_reason);
  if (wrong(corrupt, "uptime_s:nan"))
    sp__pack_kv_f64(pk, "uptime_s", NAN);
  else
    pack_f64(pk, corrupt, "uptime_s", 93784.5);
  if (!drop_clients)
    pack_u64(pk, corrupt, "clients", 2);
  pack_u64(pk, corrupt, "pool_used", 1536);
  pack_u64(pk, corrupt, "pool_capacity", UINT64_C(1) << 30);
  /* A field from a newer daemon: clients ignore it. */
  sp__pack_str(pk, "future_field");
  msgpack_pack_map(pk, 1);
  sp__pack_kv_u64(pk, "x", 1);

  sp__pack_str(pk, "jobs");
  msgpack_pack_array(pk, 2);
  if (wrong(corrupt, "jobs[0]")) {
    msgpack_pack_uint64(pk, 0);
  } else {
    msgpack_pack_map(pk, 11);
    pack_str(pk, corrupt, "job_id", "00ff00ff");
    sp__pack_kv_str(pk, "phase", "moving");
    /* Not failed, so the library drops it. */
    sp__pack_kv_str(pk, "error", "ignored");
    pack_u64(pk, corrupt, "world", 8);
    sp__pack_kv_u64(pk, "joined", 8);
    sp__pack_kv_u64(pk, "round", 3);
    sp__pack_kv_u64(pk, "rounds", 10);
    sp__pack_kv_u64(pk, "bytes_moved", UINT64_C(1) << 20);
    sp__pack_kv_u64(pk, "bytes_total", UINT64_C(1) << 30);
    pack_f64(pk, corrupt, "rate_bps", 5e8);
    sp__pack_kv_u64(pk, "shards", 4);
  }
  msgpack_pack_map(pk, 10);
  sp__pack_kv_str(pk, "job_id", "a1");
  sp__pack_kv_str(pk, "phase", "failed");
  pack_str(pk, corrupt, "error", "rank 3 lost");
  sp__pack_kv_u64(pk, "world", 2);
  sp__pack_kv_u64(pk, "joined", 1);
  sp__pack_kv_u64(pk, "round", 0);
  sp__pack_kv_u64(pk, "rounds", 0);
  sp__pack_kv_u64(pk, "bytes_moved", 0);
  sp__pack_kv_u64(pk, "bytes_total", 0);
  sp__pack_kv_f64(pk, "rate_bps", 0.0);
  return fake_send(conn, &mb, NULL, 0);
}
