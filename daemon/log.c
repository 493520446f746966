/*
 * log.c - the daemon's one logging call.
 *
 * Lines go to stderr.  Under systemd (stderr is the journal stream named by
 * JOURNAL_STREAM) each line starts with the syslog priority "<N>", which the
 * journal turns into the entry's priority (and stamps with its own time);
 * otherwise lines are plain text for a terminal or a file, each starting
 * with the local time to the millisecond.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "proto/text.h"

static enum log_level log_level = LOG_LEVEL_INFO;
static bool log_journal;

static const struct {
  enum log_level level;
  const char *name;
} log_names[] = {
    {LOG_LEVEL_ERROR, "error"},
    {LOG_LEVEL_WARN, "warn"},
    {LOG_LEVEL_INFO, "info"},
    {LOG_LEVEL_DEBUG, "debug"},
};

/* JOURNAL_STREAM is "DEV:INODE" of the stream systemd connected; it only
 * counts when stderr is still that stream (a child may inherit the
 * variable with stderr redirected elsewhere). */
static bool stderr_is_journal(void) {
  const char *env = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  struct stat st;
  if (env == NULL || sscanf(env, "%llu:%llu", &dev, &ino) != 2)
    return false;
  if (fstat(STDERR_FILENO, &st) != 0)
    return false;
  return (unsigned long long)st.st_dev == dev &&
         (unsigned long long)st.st_ino == ino;
}

void log_init(enum log_level level) {
  log_level = level;
  log_journal = stderr_is_journal();
}

void log_set_level(enum log_level level) { log_level = level; }

int log_level_parse(const char *name) {
  for (size_t i = 0; i < sizeof(log_names) / sizeof(log_names[0]); i++)
    if (strcmp(name, log_names[i].name) == 0)
      return (int)log_names[i].level;
  return -1;
}

const char *log_level_name(enum log_level level) {
  for (size_t i = 0; i < sizeof(log_names) / sizeof(log_names[0]); i++)
    if (log_names[i].level == level)
      return log_names[i].name;
  return "unknown";
}

static void log_line(enum log_level level, uint64_t suppressed,
                     const char *fmt, va_list ap) {
  char text[1536];
  vsnprintf(text, sizeof text, fmt, ap);
  /* One buffer and one write, so that lines from a daemon and its test
   * harness never interleave mid-line. */
  char line[2048];
  int n;
  if (log_journal) {
    n = snprintf(line, sizeof(line), "<%d>", (int)level);
  } else {
    struct timespec ts;
    struct tm tm;
    char when[32] = "";
    clock_gettime(CLOCK_REALTIME, &ts);
    if (localtime_r(&ts.tv_sec, &tm) != NULL)
      strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    n = snprintf(line, sizeof(line), "%s.%03ld shardportd: %s: ", when,
                 ts.tv_nsec / 1000000, log_level_name(level));
  }
  /* Messages quote what peers sent (op and client names, keys): escaped,
   * a control byte there cannot end the line and forge another, with its
   * own priority, in the journal, and the line stays UTF-8, which the
   * journal would otherwise keep as a binary blob. */
  sp_text_sanitize(text, line + n, sizeof(line) - (size_t)n - 1);
  if (suppressed > 0) {
    size_t used = strlen(line);
    snprintf(line + used, sizeof(line) - used - 1,
             " (%" PRIu64 " more like it not logged)", suppressed);
  }
  size_t len = strlen(line);
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}

void log_msg(enum log_level level, const char *fmt, ...) {
  if (level > log_level)
    return;
  va_list ap;
  va_start(ap, fmt);
  log_line(level, 0, fmt, ap);
  va_end(ap);
}

void log_limited(struct log_limit *lim, enum log_level level,
                 const char *fmt, ...) {
  if (level > log_level)
    return;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
  if (lim->logged && now - lim->last_ms < LOG_LIMIT_MS) {
    lim->suppressed++;
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  log_line(level, lim->suppressed, fmt, ap);
  va_end(ap);
  lim->logged = true;
  lim->last_ms = now;
  lim->suppressed = 0;
}
