/*
 * harness.h - start a private shardportd and talk to it over a raw socket.
 *
 * Each integration test starts its own daemon in its own temporary
 * directory (like tmux's `-L test$$`), so tests never share state and may run
 * in parallel.  The daemon binary comes from $SHARDPORTD, which meson sets in
 * the test environment.
 *
 * Every socket helper here uses a non-blocking socket with an explicit
 * timeout, so a daemon that stops answering fails the test instead of
 * hanging it.  Helpers return 0 (or a count, or an fd) on success and a
 * negative SP_E* code on failure; SP_ETIMEOUT when the timeout passed.
 */
#ifndef SP_TEST_HARNESS_H
#define SP_TEST_HARNESS_H

#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/frame.h"
#include "proto/msg.h"
#include "shardport.h"

/* How long the helpers wait for the daemon by default. */
#define SP_TEST_TIMEOUT_MS 10000

struct sp_test_daemon {
  pid_t pid;
  char dir[256];
  char socket[300];
};

/*
 * Makes a private temporary directory, starts $SHARDPORTD with
 * `--socket dir/s.sock --config /dev/null` followed by extra_args (a
 * NULL-terminated list, or NULL), and waits until the socket accepts a
 * connection.  Returns 0, or -1 (the directory removed, the daemon reaped)
 * when the daemon exits or does not listen in time.
 */
int sp_test_daemon_start(struct sp_test_daemon *d,
                         const char *const *extra_args);

/*
 * Sends SIGTERM, waits for the daemon to exit (SIGKILL after the timeout),
 * removes the directory and everything in it.  Returns the exit status, or
 * -1 when the daemon was killed by a signal or did not exit in time.
 */
int sp_test_daemon_stop(struct sp_test_daemon *d);

/* The daemon binary from $SHARDPORTD; aborts the test when it is unset. */
const char *sp_test_daemon_path(void);

/*
 * Starts $SHARDPORTD with exactly the arguments in args (NULL-terminated,
 * without argv[0]) and returns its pid, or -1.  For tests that need a
 * command line sp_test_daemon_start does not build.
 */
pid_t sp_test_spawn(const char *const *args);

/* Waits for pid to exit: its exit status, -1 when it was killed by a signal,
 * SP_ETIMEOUT (the process is left running) after timeout_ms. */
int sp_test_wait(pid_t pid, int timeout_ms);

/* Removes a directory and the plain files and sockets in it. */
void sp_test_rmdir(const char *dir);

/* Makes a private temporary directory into buf (at least 256 bytes):
 * 0 or -1. */
int sp_test_mkdtemp(char *buf, size_t size);

/* Writes text to path (created 0644, truncated): 0 or -1. */
int sp_test_write_file(const char *path, const char *text);

/* A connected non-blocking socket, or a negative code. */
int sp_test_connect(const char *path);

/* Sends bytes as they are (for hostile frames), with fds attached to the
 * first byte when nfds > 0.  Returns 0 or a negative code. */
int sp_test_send_raw(int sock, const void *buf, size_t len, const int *fds,
                     size_t nfds);

/* Sends {"op":op,"id":id} with fds attached (the caller keeps them). */
int sp_test_send_op(int sock, const char *op, uint64_t id, const int *fds,
                    size_t nfds);

/* Sends a message built with sp_msgbuf_begin; the msgbuf is left empty. */
int sp_test_send_msgbuf(int sock, struct sp_msgbuf *mb, const int *fds,
                        size_t nfds);

/* A received and decoded reply. */
struct sp_test_reply {
  struct sp_frame frame;
  msgpack_zone zone;
  int has_zone;
  msgpack_object map;
  struct sp_msg_head head;
  /* For an error reply: its code and message; 0 and "" otherwise. */
  int code;
  char message[SP_ERRMSG_MAX + 1];
};

/* Reads, checks and decodes one frame.  Returns 0, SP_ECLOSED when the daemon
 * closed the connection, SP_ETIMEOUT, or another negative code.  On success
 * release it with sp_test_reply_free. */
int sp_test_recv(int sock, struct sp_test_reply *reply, int timeout_ms);
void sp_test_reply_free(struct sp_test_reply *reply);

/* Waits until the daemon closes the connection: 0 when it did (discarding
 * any frames before the close), SP_ETIMEOUT otherwise. */
int sp_test_wait_closed(int sock, int timeout_ms);

/* Sends hello with the given protocol version and reads the reply: 0 for a
 * hello reply, else the error reply's code (or a transport code). */
int sp_test_hello(int sock, uint64_t version);

/* Connects and does the hello exchange: a socket, or a negative code. */
int sp_test_connect_hello(const char *path);

/* A join of rank in world with the ticket's bytes, as a rank on device
 * ("cpu", "cuda:<GPU UUID>"), packed into mb. */
void sp_test_pack_join(struct sp_msgbuf *mb, uint64_t id, const uint8_t *ticket,
                       size_t ticket_len, uint32_t rank, uint32_t world,
                       const char *device);
/* Joins as a "cpu" rank and reads the reply: 0, or the error reply's code
 * (or a transport code). */
int sp_test_join(int sock, uint64_t id, const uint8_t *ticket,
                 size_t ticket_len, uint32_t rank, uint32_t world);

/* A raw connection (hello done) joined with id as the one rank of a new
 * job of creator's: the socket, or a negative code. */
int sp_test_raw_rank(const char *path, sp_client *creator, uint64_t id);
/* A memfd of size bytes (a hole: nothing is written), or -1. */
int sp_test_memfd(const char *name, size_t size);

/* One ping round trip: 0 when a ping reply with this id came back. */
int sp_test_ping(int sock, uint64_t id);

/* A "Vm..." line of /proc/PID/status in KiB ("VmRSS", "VmPeak"), or -1. */
long sp_test_vm_kb(pid_t pid, const char *field);
/* The daemon's resident set in KiB, or -1. */
long sp_test_rss_kb(pid_t pid);
/* In a build with AddressSanitizer, makes the daemons started from now on
 * keep a quarantine of freed memory of 4 MiB instead of 256 MiB, which a
 * bound on the daemon's resident set would count as growth; elsewhere
 * nothing. */
void sp_test_small_quarantine(void);

/* The number of open fds of pid from /proc/PID/fd, or -1. */
int sp_test_count_fds(pid_t pid);

#endif /* SP_TEST_HARNESS_H */
