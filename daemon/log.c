/*
 * log.c - the daemon's one logging call.
 *
 * Under systemd (stderr is the journal stream named by JOURNAL_STREAM) each
 * line goes to the journal through libsystemd's sd_journal_sendv, with its
 * priority and the structured fields of log_fields (SHARDPORT_JOB,
 * SHARDPORT_RANK, SHARDPORT_NODE, SHARDPORT_EXPORT, SHARDPORT_ERROR;
 * docs/operations.md, "Monitoring"), so that `journalctl SHARDPORT_JOB=ID`
 * shows one job's story.  Should the journal's socket be missing or refuse
 * an entry, the line goes to stderr instead, starting with the syslog priority "<N>",
 * which the journal's stream turns into the entry's priority.  A daemon
 * not under systemd writes plain text lines for a terminal or a file, each
 * starting with the local time to the millisecond.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "daemon/log.h"
#include "proto/monotonic.h"
#include "proto/text.h"
#include "shardport.h"

#if SP_HAVE_SYSTEMD
#include <systemd/sd-journal.h>

/* Where libsystemd sends journal entries (its fixed path). */
#define LOG_JOURNAL_SOCKET "/run/systemd/journal/socket"
#endif

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

#if SP_HAVE_SYSTEMD
/* The line as one journal entry with its fields: 0, or -1 when the
 * journal's socket did not take it. */
static int log_to_journal(enum log_level level, const struct log_fields *f,
                          const char *text) {
  char fields[7][96];
  struct iovec iov[8];
  size_t n = 0;
  snprintf(fields[n++], sizeof fields[0], "PRIORITY=%d", (int)level);
  snprintf(fields[n++], sizeof fields[0], "SYSLOG_IDENTIFIER=shardportd");
  if (f != NULL && f->job != NULL)
    snprintf(fields[n++], sizeof fields[0], "SHARDPORT_JOB=%s", f->job);
  if (f != NULL && f->rank != LOG_NONE)
    snprintf(fields[n++], sizeof fields[0], "SHARDPORT_RANK=%" PRId64,
             f->rank);
  if (f != NULL && f->node != LOG_NONE)
    snprintf(fields[n++], sizeof fields[0], "SHARDPORT_NODE=%" PRId64,
             f->node);
  if (f != NULL && f->export_id != 0)
    snprintf(fields[n++], sizeof fields[0], "SHARDPORT_EXPORT=%" PRIu64,
             f->export_id);
  if (f != NULL && f->error != 0)
    snprintf(fields[n++], sizeof fields[0], "SHARDPORT_ERROR=%s",
             sp_err_name(f->error));
  /* sd_journal_sendv takes one whole field per iovec. */
  char message[1800];
  snprintf(message, sizeof message, "MESSAGE=%s", text);
  iov[0] = (struct iovec){.iov_base = message, .iov_len = strlen(message)};
  for (size_t i = 0; i < n; i++)
    iov[i + 1] = (struct iovec){.iov_base = fields[i],
                                .iov_len = strlen(fields[i])};
  return sd_journal_sendv(iov, (int)n + 1) < 0 ? -1 : 0;
}
#endif

static void log_line(enum log_level level, const struct log_fields *f,
                     uint64_t suppressed, const char *fmt, va_list ap) {
  char raw[1536];
  vsnprintf(raw, sizeof raw, fmt, ap);
  /* Messages quote what peers sent (op and client names, keys): escaped,
   * a control byte there cannot end the line and forge another, with its
   * own priority, in the journal, and the line stays UTF-8, which the
   * journal would otherwise keep as a binary blob. */
  char text[1792];
  sp__text_sanitize(raw, text, sizeof text);
  if (suppressed > 0) {
    size_t used = strlen(text);
    snprintf(text + used, sizeof(text) - used,
             " (%" PRIu64 " more like it not logged)", suppressed);
  }
#if SP_HAVE_SYSTEMD
  /* sd_journal_sendv drops an entry silently (and says it succeeded) when
   * the journal's socket is not there, so it is asked for first. */
  if (log_journal && access(LOG_JOURNAL_SOCKET, W_OK) == 0 &&
      log_to_journal(level, f, text) == 0)
    return;
#else
  (void)f;
#endif
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
  snprintf(line + n, sizeof(line) - (size_t)n - 1, "%s", text);
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
  log_line(level, NULL, 0, fmt, ap);
  va_end(ap);
}

void log_with(enum log_level level, const struct log_fields *f,
              const char *fmt, ...) {
  if (level > log_level)
    return;
  va_list ap;
  va_start(ap, fmt);
  log_line(level, f, 0, fmt, ap);
  va_end(ap);
}

void log_limited(struct log_limit *lim, enum log_level level,
                 const char *fmt, ...) {
  if (level > log_level)
    return;
  uint64_t now = monotonic_ms();
  if (lim->logged && now - lim->last_ms < LOG_LIMIT_MS) {
    lim->suppressed++;
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  log_line(level, NULL, lim->suppressed, fmt, ap);
  va_end(ap);
  lim->logged = true;
  lim->last_ms = now;
  lim->suppressed = 0;
}
