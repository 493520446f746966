/*
 * watch.c - `--watch SECONDS`: run a command again and again until SIGINT or
 * SIGTERM.
 *
 * SIGINT and SIGTERM are blocked for the whole loop and taken with
 * sigtimedwait as the wait between snapshots, so a signal that arrives while
 * a snapshot is being fetched is never lost: it ends the loop at the next
 * wait, and the exit is clean (client closed, output flushed).  A snapshot
 * is rendered into memory first and written in one go, so a terminal is
 * cleared only when the new picture is ready; to a pipe or file, snapshots
 * follow each other, a blank line apart (JSON: one object per line).
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "client/cli/cli.h"

/* ANSI: cursor home, then erase the screen. */
#define CLEAR_SCREEN "\033[H\033[2J"

static void add_ns(struct timespec *t, double seconds) {
  long long ns = (long long)(seconds * 1e9);
  t->tv_sec += (time_t)(ns / 1000000000);
  t->tv_nsec += (long)(ns % 1000000000);
  if (t->tv_nsec >= 1000000000) {
    t->tv_sec++;
    t->tv_nsec -= 1000000000;
  }
}

/* Waits until the monotonic time next or a signal in set: true when a signal
 * came. */
static bool wait_until(const struct timespec *next, const sigset_t *set) {
  for (;;) {
    struct timespec now, left;
    clock_gettime(CLOCK_MONOTONIC, &now);
    left.tv_sec = next->tv_sec - now.tv_sec;
    left.tv_nsec = next->tv_nsec - now.tv_nsec;
    if (left.tv_nsec < 0) {
      left.tv_sec--;
      left.tv_nsec += 1000000000;
    }
    if (left.tv_sec < 0)
      left.tv_sec = left.tv_nsec = 0;
    if (sigtimedwait(set, NULL, &left) >= 0)
      return true;
    if (errno == EAGAIN)
      return false;
    /* EINTR: another signal's handler ran; wait for the rest. */
  }
}

/* Renders one snapshot and writes it.  Returns 0, an SP_E* code from the
 * command, or 1 when stdout failed. */
static int draw(const struct cli_command *cmd, sp_client *client,
                const struct cli_options *opts, bool tty, bool first) {
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (!mem)
    return SP_ENOMEM;
  int rc = cmd->exec(client, opts, mem);
  if (fclose(mem) != 0 && rc == 0)
    rc = SP_ENOMEM;
  if (rc == 0) {
    if (tty && !opts->json)
      fputs(CLEAR_SCREEN, stdout);
    else if (!first && !opts->json)
      fputc('\n', stdout);
    fwrite(text, 1, len, stdout);
    if (fflush(stdout) != 0)
      rc = 1;
  }
  free(text);
  return rc;
}

int watch_run(const struct cli_command *cmd, sp_client *client,
              const struct cli_options *opts) {
  sigset_t set, old;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, &old);

  bool tty = isatty(STDOUT_FILENO) == 1;
  struct timespec next;
  clock_gettime(CLOCK_MONOTONIC, &next);
  int status = CLI_EXIT_OK;
  for (bool first = true;; first = false) {
    int rc = draw(cmd, client, opts, tty, first);
    if (rc < 0) {
      status = cli_report(cmd->name, rc, client);
      break;
    }
    if (rc > 0) {
      status = CLI_EXIT_ERROR; /* main reports the failed stdout */
      break;
    }
    add_ns(&next, opts->watch_s);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    /* After a slow snapshot, start counting again from now rather than
     * drawing a burst to catch up. */
    if (now.tv_sec > next.tv_sec ||
        (now.tv_sec == next.tv_sec && now.tv_nsec > next.tv_nsec))
      next = now;
    if (wait_until(&next, &set))
      break;
  }
  sigprocmask(SIG_SETMASK, &old, NULL);
  return status;
}
