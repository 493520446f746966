/*
 * refuse.c - the planner's refusal messages: the ranks and the element a
 * refusal names, and the refusal of a stopped plan (each sentence is written
 * with sp__failf, proto/fail.h, as everywhere in the daemon).
 */
#include <stdio.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

#define NAMED_RANKS 8

int plan_check_stop(const _Atomic bool *stop, char *msg, size_t msglen) {
  if (stop == NULL || !atomic_load(stop))
    return 0;
  return sp__failf(msg, msglen, SP_ETIMEOUT, "planning was stopped");
}

void plan_refuse_ranks(char *buf, size_t len, const uint32_t *ranks, size_t n) {
  size_t named = n < NAMED_RANKS ? n : NAMED_RANKS;
  size_t used = 0;

  if (len == 0)
    return;
  buf[0] = '\0';
  used += (size_t)snprintf(buf, len, "%s", n == 1 ? "rank" : "ranks");
  for (size_t i = 0; i < named && used < len; i++) {
    const char *sep = i == 0 ? " " : (i + 1 == n ? " and " : ", ");
    used += (size_t)snprintf(buf + used, len - used, "%s%u", sep, ranks[i]);
  }
  if (n > named && used < len)
    snprintf(buf + used, len - used, " and %zu more", n - named);
}

void plan_refuse_index(uint32_t ndim, const int64_t *shape, uint64_t flat,
                       char *buf, size_t len) {
  uint64_t idx[SP_MAX_DIMS];
  size_t used = 0;

  for (uint32_t d = ndim; d-- > 0;) {
    uint64_t dim = (uint64_t)shape[d];
    idx[d] = dim == 0 ? 0 : flat % dim;
    flat = dim == 0 ? 0 : flat / dim;
  }
  used += (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu",
                             d > 0 ? ", " : "", (unsigned long long)idx[d]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
}
