/*
 * gather.h - the gather of one export: every rank of a job asks, and the
 * export starts once all have, with the options they agree on; or it
 * fails once the first ask's deadline passes.  One implementation for a
 * job on one node (export.c reads its members' asks) and for a job across
 * nodes (its root reads the asks every node relayed, daemon/mesh/coord.c),
 * so that both decide alike and say so in the same words (gather.c).
 */
#ifndef SP_DAEMON_GATHER_H
#define SP_DAEMON_GATHER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/request.h"

struct config;

/* One rank's part in a gather, as the daemon that decides it knows it. */
struct gather_ask {
  bool joined;
  bool asked;
  /* What the rank asked for; 0: the default. */
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms;
  /* A save's options (save.limit 0: an export), and the rank's refusal. */
  struct req_save save;
  /* When its ask times out (set when asked). */
  uint64_t deadline_ms;
};

/* The ranks of a gather: ask(ctx, rank, out) fills rank's part. */
struct gather_ranks {
  uint32_t world;
  void (*ask)(const void *ctx, uint32_t rank, struct gather_ask *out);
  const void *ctx;
};

/* What every rank agreed on, resolved against the daemon's defaults. */
struct gather_options {
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms; /* the smallest any rank asked for */
  uint64_t save_limit; /* every rank's alike: a save, or 0 */
};

/* Every rank asked: their options, or SP_EINVAL with a sentence naming
 * rank 0's and those of the first rank that differs (whether they save,
 * and the save's limit, overwrite, directory and metadata included); a
 * rank's own refusal of a save comes first, with its code and its words
 * naming the rank. */
int gather_agree(const struct gather_ranks *g, const struct config *cfg,
                 struct gather_options *out, char *msg, size_t msglen);
/* Some ranks asked, not all, and the first of their deadlines passed by
 * now: SP_ETIMEOUT with a sentence naming job hex and the ranks it waits
 * for; else 0. */
int gather_overdue(const struct gather_ranks *g, uint64_t now,
                   const char *hex, char *msg, size_t msglen);

#endif /* SP_DAEMON_GATHER_H */
