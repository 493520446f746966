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
 * follow each other, a blank line apart (JSON: one object per line).  A
 * text snapshot starts with the time it was taken.
 *
 * A daemon that goes away (a restart: it says it is stopping, nothing
 * listens, the connection closes) does not end the watch: the snapshot
 * says so, and the next tick connects again.  Any other failure (a
 * refusal, a bad reply) ends it.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
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

/* "every 2s  2026-05-01 12:00:03": the first line of a text snapshot. */
static void heading(FILE *out, const struct cli_options *opts) {
  char when[32] = "";
  time_t now = time(NULL);
  struct tm tm;
  if (localtime_r(&now, &tm) != NULL)
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
  fprintf(out, "every %gs  %s\n", opts->watch_s, when);
}

/* Writes one rendered snapshot: over the last one on a terminal, else a
 * blank line after it (text) or on the next line (JSON).  0, or 1 when
 * stdout failed. */
static int show(const char *text, size_t len, const struct cli_options *opts,
                bool tty, bool first) {
  if (tty && !opts->json)
    fputs(CLEAR_SCREEN, stdout);
  else if (!first && !opts->json)
    fputc('\n', stdout);
  fwrite(text, 1, len, stdout);
  return fflush(stdout) != 0 ? 1 : 0;
}

/* Renders one snapshot of cmd and shows it.  Returns 0, an SP_E* code from
 * the command (nothing shown), or 1 when stdout failed. */
static int draw(const struct cli_command *cmd, sp_client *client,
                const struct cli_options *opts, bool tty, bool first) {
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (!mem)
    return SP_ENOMEM;
  if (!opts->json)
    heading(mem, opts);
  int rc = cmd->exec(client, opts, mem);
  if (fclose(mem) != 0 && rc == 0)
    rc = SP_ENOMEM;
  if (rc == 0)
    rc = show(text, len, opts, tty, first);
  free(text);
  return rc;
}

/* The snapshot while the daemon is away: why, in the text output, or on
 * stderr beside JSON (whose stdout holds snapshots only). */
static int draw_away(const char *why, const struct cli_options *opts,
                     bool tty, bool first) {
  char safe[4 * CLI_WHY_MAX + 1];
  sp__text_sanitize(why, safe, sizeof safe);
  if (opts->json) {
    fprintf(stderr, "shardport: %s; connecting again every %gs\n", safe,
            opts->watch_s);
    return 0;
  }
  char *text = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&text, &len);
  if (!mem)
    return 1;
  heading(mem, opts);
  fprintf(mem, "shardport: %s; connecting again every %gs\n", safe,
          opts->watch_s);
  int rc = fclose(mem) != 0 ? 1 : show(text, len, opts, tty, first);
  free(text);
  return rc;
}

/* Codes that mean the daemon is not there now (stopped, restarting; a
 * stopping daemon says so before it closes the connection): the watch
 * goes on. */
static bool daemon_away(int code) {
  return code == SP_ENODAEMON || code == SP_ECLOSED || code == SP_EIO ||
         code == SP_ETIMEOUT || code == SP_EDAEMONSTOPPING ||
         code == SP_EDAEMONRESTARTED;
}

int watch_run(const struct cli_command *cmd, const struct cli_options *opts) {
  sigset_t set, old;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, &old);

  bool tty = isatty(STDOUT_FILENO) == 1;
  struct timespec next;
  clock_gettime(CLOCK_MONOTONIC, &next);
  int status = CLI_EXIT_OK;
  sp_client *client = NULL;
  for (bool first = true;; first = false) {
    char why[CLI_WHY_MAX] = "";
    int rc = client == NULL ? cli_connect(opts, &client, why, sizeof why) : 0;
    if (rc == 0) {
      rc = draw(cmd, client, opts, tty, first);
      if (rc < 0 && daemon_away(rc)) {
        snprintf(why, sizeof why, "the daemon at %s went away: %s",
                 opts->socket, sp_strerror(rc));
        sp_close(client);
        client = NULL;
      }
    } else {
      client = NULL;
    }
    if (rc < 0 && daemon_away(rc))
      rc = draw_away(why, opts, tty, first);
    if (rc < 0) {
      status = client != NULL ? cli_report(cmd->name, rc, client)
                              : cli_report_connect(rc, why);
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
  sp_close(client);
  sigprocmask(SIG_SETMASK, &old, NULL);
  return status;
}
