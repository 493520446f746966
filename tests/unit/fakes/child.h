/*
 * child.h - child processes for the fakes' suites: fork+exec (posix_spawn)
 * of the fakepeer helper with a changed environment, line-wise reading of
 * its stdout, and bounded waits that kill a child that overstays.
 *
 * posix_spawn, never a bare fork(): the test process has the fake runtime
 * loaded with its threads running, and the rule for real CUDA is the same,
 * no fork() after initialisation unless the child execs at once.
 */
#ifndef SP_TESTS_FAKES_CHILD_H
#define SP_TESTS_FAKES_CHILD_H

#include <stddef.h>
#include <sys/types.h>

struct child {
  pid_t pid;
  int out;          /* read end of the child's stdout, -1 once at EOF */
  char buf[16384];  /* stdout not yet handed out as lines */
  size_t len;
};

/* Starts argv[0] with the environment of this process changed by env: each
 * "NAME=value" sets, each bare "NAME" removes (NULL-terminated; NULL for no
 * change).  pass_fd >= 0 becomes the child's fd 3.  0 or -errno. */
int child_start(struct child *ch, char *const argv[], char *const env[],
                int pass_fd);

/* The fakepeer helper (FAKEPEER in the environment) with the
 * NULL-terminated args. */
int peer_start(struct child *ch, const char *const args[], char *const env[],
               int pass_fd);

/* Runs fakepeer to the end: its exit status as child_finish() gives it,
 * its stdout in out. */
int peer_run(const char *const args[], char *const env[], int pass_fd,
             int timeout_ms, char *out, size_t n);

/* The next line of stdout, without its newline: 0, or -1 at EOF or after
 * timeout_ms. */
int child_line(struct child *ch, char *line, size_t n, int timeout_ms);

/* Waits up to timeout_ms for the child to exit, killing it after that;
 * appends the rest of its stdout to out (may be NULL).  Returns the exit
 * status, 128 + signal if it was killed by one, or -1 if it timed out. */
int child_finish(struct child *ch, int timeout_ms, char *out, size_t n);

/* Sends sig to a running child. */
void child_kill(struct child *ch, int sig);

/* Hex text for bytes and back; hex_decode returns 0 or -1. */
void hex_encode(const void *bytes, size_t n, char *out);
int hex_decode(const char *hex, void *bytes, size_t n);

#endif
