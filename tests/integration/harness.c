/*
 * harness.c - private daemons and raw socket helpers for integration tests.
 */
#include "tests/integration/harness.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto/wire.h"

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

const char *sp_test_daemon_path(void) {
  const char *path = getenv("SHARDPORTD");
  if (path == NULL || path[0] == '\0') {
    fprintf(stderr, "harness: SHARDPORTD is not set (run through meson test)\n");
    abort();
  }
  return path;
}

pid_t sp_test_spawn(const char *const *args) {
  const char *path = sp_test_daemon_path();
  size_t n = 0;
  while (args != NULL && args[n] != NULL)
    n++;
  char **argv = calloc(n + 2, sizeof(*argv));
  if (argv == NULL)
    return -1;
  argv[0] = (char *)path;
  for (size_t i = 0; i < n; i++)
    argv[i + 1] = (char *)args[i];
  pid_t pid = fork();
  if (pid == 0) {
    execv(path, argv);
    fprintf(stderr, "harness: exec %s: %s\n", path, strerror(errno));
    _exit(127);
  }
  free(argv);
  return pid;
}

int sp_test_wait(pid_t pid, int timeout_ms) {
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    int status;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 && errno != EINTR)
      return -1;
    if (now_ms() >= deadline)
      return SP_ETIMEOUT;
    sleep_ms(5);
  }
}

void sp_test_rmdir(const char *dir) {
  DIR *d = opendir(dir);
  if (d != NULL) {
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
        continue;
      char path[512];
      snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
      if (e->d_type == DT_DIR)
        sp_test_rmdir(path);
      else
        unlink(path);
    }
    closedir(d);
  }
  rmdir(dir);
}

/* A connect that succeeds means the daemon listens; the probe connection is
 * closed again at once. */
static int probe(const char *path) {
  int sock = sp_test_connect(path);
  if (sock < 0)
    return -1;
  close(sock);
  return 0;
}

int sp_test_mkdtemp(char *buf, size_t size) {
  const char *tmp = getenv("TMPDIR");
  if (tmp == NULL || tmp[0] == '\0')
    tmp = "/tmp";
  int n = snprintf(buf, size, "%s/sp-test-XXXXXX", tmp);
  if (n < 0 || (size_t)n >= size || mkdtemp(buf) == NULL)
    return -1;
  return 0;
}

int sp_test_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return -1;
  size_t len = strlen(text);
  int rc = fwrite(text, 1, len, f) == len ? 0 : -1;
  if (fclose(f) != 0)
    rc = -1;
  return rc;
}

int sp_test_daemon_start(struct sp_test_daemon *d,
                         const char *const *extra_args) {
  memset(d, 0, sizeof(*d));
  d->pid = -1;
  if (sp_test_mkdtemp(d->dir, sizeof(d->dir)) != 0)
    return -1;
  snprintf(d->socket, sizeof(d->socket), "%s/s.sock", d->dir);

  size_t n = 0;
  while (extra_args != NULL && extra_args[n] != NULL)
    n++;
  const char **args = calloc(n + 5, sizeof(*args));
  if (args == NULL) {
    sp_test_rmdir(d->dir);
    return -1;
  }
  args[0] = "--socket";
  args[1] = d->socket;
  args[2] = "--config";
  args[3] = "/dev/null";
  for (size_t i = 0; i < n; i++)
    args[4 + i] = extra_args[i];
  d->pid = sp_test_spawn(args);
  free(args);
  if (d->pid < 0) {
    sp_test_rmdir(d->dir);
    return -1;
  }

  int64_t deadline = now_ms() + SP_TEST_TIMEOUT_MS;
  while (now_ms() < deadline) {
    if (probe(d->socket) == 0)
      return 0;
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      fprintf(stderr, "harness: shardportd exited before listening\n");
      d->pid = -1;
      sp_test_rmdir(d->dir);
      return -1;
    }
    sleep_ms(5);
  }
  fprintf(stderr, "harness: shardportd did not listen on %s in time\n",
          d->socket);
  kill(d->pid, SIGKILL);
  waitpid(d->pid, NULL, 0);
  d->pid = -1;
  sp_test_rmdir(d->dir);
  return -1;
}

int sp_test_daemon_stop(struct sp_test_daemon *d) {
  int status = -1;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    status = sp_test_wait(d->pid, SP_TEST_TIMEOUT_MS);
    if (status == SP_ETIMEOUT) {
      fprintf(stderr, "harness: shardportd ignored SIGTERM, killing it\n");
      kill(d->pid, SIGKILL);
      waitpid(d->pid, NULL, 0);
      status = -1;
    }
    d->pid = -1;
  }
  if (d->dir[0] != '\0') {
    sp_test_rmdir(d->dir);
    d->dir[0] = '\0';
  }
  return status;
}

int sp_test_connect(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof(sa.sun_path))
    return SP_EINVAL;
  memcpy(sa.sun_path, path, strlen(path) + 1);
  int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0)
    return SP_EIO;
  if (connect(sock, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
    close(sock);
    return SP_ENODAEMON;
  }
  int flags = fcntl(sock, F_GETFL);
  if (flags < 0 || fcntl(sock, F_SETFL, flags | O_NONBLOCK) != 0) {
    close(sock);
    return SP_EIO;
  }
  return sock;
}

static int wait_fd(int sock, short events, int64_t deadline) {
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0)
      return SP_ETIMEOUT;
    struct pollfd p = {.fd = sock, .events = events};
    int r = poll(&p, 1, (int)left);
    if (r > 0)
      return 0;
    if (r < 0 && errno != EINTR)
      return SP_EIO;
  }
}

/* Writes a whole frame_tx, waiting for room as needed. */
static int write_tx(int sock, struct sp_frame_tx *tx) {
  int64_t deadline = now_ms() + SP_TEST_TIMEOUT_MS;
  for (;;) {
    int r = sp_frame_tx_write(tx, sock);
    if (r <= 0)
      return r;
    r = wait_fd(sock, POLLOUT, deadline);
    if (r < 0)
      return r;
  }
}

int sp_test_send_raw(int sock, const void *buf, size_t len, const int *fds,
                     size_t nfds) {
  if (nfds > SP_FDS_MAX)
    return SP_EINVAL;
  struct sp_frame_tx tx = {.buf = (uint8_t *)buf, .len = len};
  if (nfds > 0)
    memcpy(tx.fds, fds, nfds * sizeof(*fds));
  tx.nfds = nfds;
  return write_tx(sock, &tx);
}

int sp_test_send_msgbuf(int sock, struct sp_msgbuf *mb, const int *fds,
                        size_t nfds) {
  struct sp_frame_tx tx = {0};
  int r = sp_msgbuf_finish(mb, &tx);
  if (r < 0)
    return r;
  r = sp_test_send_raw(sock, tx.buf, tx.len, fds, nfds);
  free(tx.buf);
  return r;
}

int sp_test_send_op(int sock, const char *op, uint64_t id, const int *fds,
                    size_t nfds) {
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, op, id, 0);
  return sp_test_send_msgbuf(sock, &mb, fds, nfds);
}

int sp_test_recv(int sock, struct sp_test_reply *reply, int timeout_ms) {
  memset(reply, 0, sizeof(*reply));
  struct sp_limits limits;
  sp_limits_default(&limits);
  limits.max_fds = SP_FDS_MAX;
  struct sp_frame_rx rx;
  sp_frame_rx_init(&rx, &limits);
  int64_t deadline = now_ms() + timeout_ms;
  int r;
  for (;;) {
    r = sp_frame_rx_read(&rx, sock, &reply->frame);
    if (r != 0)
      break;
    r = wait_fd(sock, POLLIN, deadline);
    if (r < 0)
      break;
  }
  sp_frame_rx_reset(&rx);
  if (r < 0)
    return r;

  msgpack_zone_init(&reply->zone, 2048);
  reply->has_zone = 1;
  r = sp_wire_decode(reply->frame.data, reply->frame.len, &limits,
                     &reply->zone, &reply->map);
  if (r == 0)
    r = sp_msg_head(&reply->map, &reply->head);
  if (r == 0 && strcmp(reply->head.op, "error") == 0)
    reply->code = sp_msg_error_code(&reply->map, reply->message,
                                    sizeof(reply->message));
  if (r < 0) {
    sp_test_reply_free(reply);
    return r;
  }
  return 0;
}

void sp_test_reply_free(struct sp_test_reply *reply) {
  if (reply->has_zone)
    msgpack_zone_destroy(&reply->zone);
  sp_frame_release(&reply->frame);
  memset(reply, 0, sizeof(*reply));
}

int sp_test_wait_closed(int sock, int timeout_ms) {
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    char buf[4096];
    ssize_t n = recv(sock, buf, sizeof(buf), 0);
    if (n == 0)
      return 0;
    if (n < 0 && errno == ECONNRESET)
      return 0;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return SP_EIO;
    if (n < 0) {
      int r = wait_fd(sock, POLLIN, deadline);
      if (r < 0)
        return r;
    }
  }
}

int sp_test_hello(int sock, uint64_t version) {
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "hello", 1, 2);
  sp_pack_kv_u64(&mb.pk, "version", version);
  sp_pack_kv_str(&mb.pk, "client", "shardport-tests");
  int sent = sp_test_send_msgbuf(sock, &mb, NULL, 0);
  /* A daemon that refuses the peer replies and closes without waiting for
   * the hello, so the send may fail while the reply is there to read. */
  if (sent < 0 && sent != SP_ECLOSED && sent != SP_EIO)
    return sent;
  struct sp_test_reply reply;
  int r = sp_test_recv(sock, &reply, SP_TEST_TIMEOUT_MS);
  if (r < 0)
    return sent < 0 ? sent : r;
  if (reply.code != 0)
    r = reply.code;
  else if (strcmp(reply.head.op, "hello") != 0 || reply.head.id != 1)
    r = SP_EBADMSG;
  sp_test_reply_free(&reply);
  return r;
}

int sp_test_connect_hello(const char *path) {
  int sock = sp_test_connect(path);
  if (sock < 0)
    return sock;
  int r = sp_test_hello(sock, SP_PROTOCOL_VERSION_NUMBER);
  if (r < 0) {
    close(sock);
    return r;
  }
  return sock;
}

void sp_test_pack_join(struct sp_msgbuf *mb, uint64_t id, const uint8_t *ticket,
                       size_t ticket_len, uint32_t rank, uint32_t world,
                       const char *device) {
  sp_msgbuf_begin(mb, "join", id, 4);
  sp_pack_str(&mb->pk, "ticket");
  sp_pack_bin(&mb->pk, ticket, ticket_len);
  sp_pack_kv_u64(&mb->pk, "rank", rank);
  sp_pack_kv_u64(&mb->pk, "world", world);
  sp_pack_kv_str(&mb->pk, "device", device);
}

int sp_test_join(int sock, uint64_t id, const uint8_t *ticket,
                 size_t ticket_len, uint32_t rank, uint32_t world) {
  struct sp_msgbuf mb;
  sp_test_pack_join(&mb, id, ticket, ticket_len, rank, world, "cpu");
  int r = sp_test_send_msgbuf(sock, &mb, NULL, 0);
  if (r < 0)
    return r;
  struct sp_test_reply reply;
  r = sp_test_recv(sock, &reply, SP_TEST_TIMEOUT_MS);
  if (r < 0)
    return r;
  if (reply.code != 0)
    r = reply.code;
  else if (strcmp(reply.head.op, "join") != 0 || reply.head.id != id)
    r = SP_EBADMSG;
  sp_test_reply_free(&reply);
  return r;
}

int sp_test_raw_rank(const char *path, sp_client *creator, uint64_t id) {
  sp_ticket t;
  int r = sp_job_create(creator, 1, &t);
  if (r != 0)
    return r;
  int sock = sp_test_connect_hello(path);
  if (sock < 0)
    return sock;
  if ((r = sp_test_join(sock, id, t.bytes, t.len, 0, 1)) != 0) {
    close(sock);
    return r;
  }
  return sock;
}

int sp_test_memfd(const char *name, size_t size) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int sp_test_ping(int sock, uint64_t id) {
  int r = sp_test_send_op(sock, "ping", id, NULL, 0);
  if (r < 0)
    return r;
  struct sp_test_reply reply;
  r = sp_test_recv(sock, &reply, SP_TEST_TIMEOUT_MS);
  if (r < 0)
    return r;
  if (reply.code != 0)
    r = reply.code;
  else if (strcmp(reply.head.op, "ping") != 0 || reply.head.id != id)
    r = SP_EBADMSG;
  sp_test_reply_free(&reply);
  return r;
}

long sp_test_rss_kb(pid_t pid) { return sp_test_vm_kb(pid, "VmRSS"); }

void sp_test_small_quarantine(void) {
#if defined(__SANITIZE_ADDRESS__)
  const char *opts = getenv("ASAN_OPTIONS");
  if (opts != NULL && strstr(opts, "quarantine_size_mb=4") != NULL)
    return;
  char buf[512];
  snprintf(buf, sizeof(buf), "%s%squarantine_size_mb=4",
           opts != NULL ? opts : "", opts != NULL && opts[0] != '\0' ? ":" : "");
  setenv("ASAN_OPTIONS", buf, 1);
#endif
}

long sp_test_vm_kb(pid_t pid, const char *field) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof(line), f) != NULL) {
    size_t n = strlen(field);
    if (strncmp(line, field, n) == 0 && line[n] == ':') {
      kb = strtol(line + n + 1, NULL, 10);
      break;
    }
  }
  fclose(f);
  return kb;
}

int sp_test_count_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n;
}
