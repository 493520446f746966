/*
 * layout.c - placement names, as registration messages carry them.
 */
#include <string.h>

#include "shardport.h"
#include "daemon/plan/layout.h"

static const char *const placement_names[] = {
    [PLAN_SHARD0] = "shard0", [PLAN_REPLICATED] = "replicated",
    [PLAN_PLAIN] = "plain",   [PLAN_EXPERT] = "expert",
    [PLAN_AFFINE] = "affine",
};

#define PLACEMENT_END (PLAN_AFFINE + 1)

const char *plan_layout_placement_name(enum plan_placement placement) {
  if (placement < PLAN_SHARD0 || placement >= PLACEMENT_END)
    return "unknown";
  return placement_names[placement];
}

int plan_layout_placement_from_name(const char *name, size_t len,
                                    enum plan_placement *out) {
  for (int p = PLAN_SHARD0; p < PLACEMENT_END; p++) {
    if (strlen(placement_names[p]) == len &&
        memcmp(placement_names[p], name, len) == 0) {
      *out = (enum plan_placement)p;
      return 0;
    }
  }
  return SP_EUNSUPPORTED;
}
