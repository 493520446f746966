/*
 * history.h - a job's last finished exports, for status (history.c).
 */
#ifndef SP_DAEMON_HISTORY_H
#define SP_DAEMON_HISTORY_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"

/* One finished export, as job_status shows it. */
struct history_entry {
  uint64_t export_id; /* 0: it failed while its ranks asked, unstarted */
  bool failed;
  char *error; /* "<code>: <message>" when failed, else NULL */
  uint64_t started_ms, ended_ms;
  uint32_t rounds;
  uint64_t bytes_moved, bytes_total;
  double rate_bps;
};

/* The last cap finished exports of a job. */
struct history {
  struct history_entry *ring; /* [cap] once the first is recorded */
  uint32_t cap, count, next;
  uint64_t total; /* every export recorded, kept or not */
};

void history_init(struct history *h, uint32_t cap);
void history_free(struct history *h);
/* Records e (its error is copied); the oldest entry goes when full. */
void history_add(struct history *h, const struct history_entry *e);
/* The i-th newest entry (0: the last one), for i < count. */
const struct history_entry *history_at(const struct history *h, uint32_t i);

#endif /* SP_DAEMON_HISTORY_H */
