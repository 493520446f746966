/*
 * gather.c - the gather's decisions, for one node and many alike; see
 * gather.h.  Nothing here knows a job, a connection or a node: the
 * callers say what each rank asked for, and hear whether the export may
 * start, with what, or why not.
 */
#include <inttypes.h>
#include <stdio.h>

#include "daemon/config.h"
#include "daemon/gather.h"
#include "daemon/plan/plan.h"
#include "shardport.h"

/* At most this many ranks are named when a gather times out; the rest are
 * counted. */
#define GATHER_NAMED 8

/* A save's options that rank r asked unlike rank 0 (whose are first): 0,
 * or SP_EINVAL with the sentence.  The directory and the metadata are
 * compared by the digests each rank's library sent. */
static int save_differs(const struct req_save *first, uint32_t r,
                        const struct req_save *a, char *msg, size_t msglen) {
  if (a->limit != first->limit)
    snprintf(msg, msglen,
             "ranks disagree on the save's max_shard_bytes: rank 0 asked %"
             PRIu64 ", rank %" PRIu32 " asked %" PRIu64,
             first->limit, r, a->limit);
  else if (a->overwrite != first->overwrite)
    snprintf(msg, msglen,
             "ranks disagree on the save's overwrite: rank 0 asked %s, rank "
             "%" PRIu32 " %s", first->overwrite ? "true" : "false", r,
             a->overwrite ? "true" : "false");
  else if (a->directory != first->directory)
    snprintf(msg, msglen,
             "ranks disagree on the save's directory: ranks 0 and %" PRIu32
             " name different ones (after following symbolic links and "
             "their own working directories)", r);
  else if (a->metadata != first->metadata)
    snprintf(msg, msglen,
             "ranks disagree on the save's metadata: ranks 0 and %" PRIu32
             " passed different strings", r);
  else
    return 0;
  return SP_EINVAL;
}

int gather_agree(const struct gather_ranks *g, const struct config *cfg,
                 struct gather_options *out, char *msg, size_t msglen) {
  *out = (struct gather_options){.timeout_ms = UINT32_MAX};
  struct gather_ask a;
  for (uint32_t r = 0; r < g->world; r++) {
    g->ask(g->ctx, r, &a);
    if (a.save.limit != 0 && a.save.refused < 0) {
      snprintf(msg, msglen, "the save was refused by rank %" PRIu32 ": %s",
               r, a.save.refusal);
      return a.save.refused;
    }
  }
  struct req_save first = {0};
  for (uint32_t r = 0; r < g->world; r++) {
    g->ask(g->ctx, r, &a);
    uint32_t keys = a.max_keys > 0 ? a.max_keys : PLAN_DEFAULT_MAX_KEYS;
    uint64_t bytes = a.max_bytes > 0 ? a.max_bytes : cfg->max_bytes;
    uint32_t t = a.timeout_ms > 0 ? a.timeout_ms : cfg->export_timeout_ms;
    if (t < out->timeout_ms)
      out->timeout_ms = t;
    if (r == 0) {
      out->max_keys = keys;
      out->max_bytes = bytes;
      out->save_limit = a.save.limit;
      first = a.save;
    } else if ((a.save.limit == 0) != (first.limit == 0)) {
      snprintf(msg, msglen,
               "ranks disagree on what to do: rank 0 asked for %s, rank "
               "%" PRIu32 " for %s",
               first.limit ? "a save" : "an export", r,
               a.save.limit ? "a save" : "an export");
      return SP_EINVAL;
    } else if (first.limit != 0 &&
               save_differs(&first, r, &a.save, msg, msglen) != 0) {
      return SP_EINVAL;
    } else if (keys != out->max_keys || bytes != out->max_bytes) {
      snprintf(msg, msglen,
               "ranks disagree on the export options: rank 0 asked max_keys "
               "%" PRIu32 " and max_bytes %" PRIu64 ", rank %" PRIu32
               " asked %" PRIu32 " and %" PRIu64,
               out->max_keys, out->max_bytes, r, keys, bytes);
      return SP_EINVAL;
    }
  }
  return 0;
}

int gather_overdue(const struct gather_ranks *g, uint64_t now,
                   const char *hex, char *msg, size_t msglen) {
  uint32_t asked = 0;
  uint64_t deadline = UINT64_MAX;
  for (uint32_t r = 0; r < g->world; r++) {
    struct gather_ask a;
    g->ask(g->ctx, r, &a);
    if (!a.asked)
      continue;
    asked++;
    if (a.deadline_ms < deadline)
      deadline = a.deadline_ms;
  }
  if (asked == 0 || asked == g->world || now < deadline)
    return 0;
  /* "2, 5 (not joined) and 3 more": the ranks it waited for. */
  char who[200];
  size_t used = 0, named = 0, count = 0;
  who[0] = '\0';
  for (uint32_t r = 0; r < g->world; r++) {
    struct gather_ask a;
    g->ask(g->ctx, r, &a);
    if (a.asked)
      continue;
    count++;
    if (named < GATHER_NAMED && used < sizeof who) {
      used += (size_t)snprintf(who + used, sizeof who - used,
                               "%s%" PRIu32 "%s", named > 0 ? ", " : "", r,
                               a.joined ? "" : " (not joined)");
      named++;
    }
  }
  if (count > named && used < sizeof who)
    snprintf(who + used, sizeof who - used, " and %zu more", count - named);
  snprintf(msg, msglen,
           "the export of job %s timed out waiting for rank(s) %s to ask for "
           "it",
           hex, who);
  return SP_ETIMEOUT;
}
