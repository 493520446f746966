/*
 * log.h - the daemon's one logging call, to stderr or the journal (log.c).
 */
#ifndef SP_DAEMON_LOG_H
#define SP_DAEMON_LOG_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"

/* The values are syslog priorities, so they double as the journal prefix. */
enum log_level {
  LOG_LEVEL_ERROR = 3,
  LOG_LEVEL_WARN = 4,
  LOG_LEVEL_INFO = 6,
  LOG_LEVEL_DEBUG = 7,
};

/* Messages above level are dropped.  Detects whether stderr is the journal
 * (JOURNAL_STREAM names it) to choose "<N>" prefixes over plain text. */
void log_init(enum log_level level);
void log_set_level(enum log_level level);
/* The one logging call: one line to stderr, or one journal entry. */
void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* What a line is about, as journal fields (log.c): a job's line carries
 * them so that `journalctl SHARDPORT_JOB=ID` finds it.  LOG_NONE, NULL or
 * 0 leaves a field out. */
#define LOG_NONE (-1)
struct log_fields {
  const char *job; /* SHARDPORT_JOB: the job's id in hex */
  int64_t rank;    /* SHARDPORT_RANK */
  int64_t node;    /* SHARDPORT_NODE: the job's node on this daemon */
  uint64_t export_id; /* SHARDPORT_EXPORT */
  int error;       /* SHARDPORT_ERROR: the code's wire name */
};
/* A job's fields: rank and node LOG_NONE, no export, no error. */
#define LOG_JOB(hex) \
  (&(struct log_fields){.job = (hex), .rank = LOG_NONE, .node = LOG_NONE})
void log_with(enum log_level level, const struct log_fields *f,
              const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* An event that may repeat as fast as the loop turns (an accept failing at
 * EMFILE, links dropped at a cap) is logged with log_limited: at most one
 * line per LOG_LIMIT_MS, which says how many were not logged since the
 * last.  Zero-initialise one per event. */
#define LOG_LIMIT_MS 1000u
struct log_limit {
  bool logged;
  uint64_t last_ms;
  uint64_t suppressed;
};
void log_limited(struct log_limit *lim, enum log_level level,
                 const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "error", "warn", "info", "debug" <-> level; -1 for an unknown name. */
int log_level_parse(const char *name);
const char *log_level_name(enum log_level level);

#endif /* SP_DAEMON_LOG_H */
