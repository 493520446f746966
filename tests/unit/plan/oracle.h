/*
 * oracle.h - the tests' oracle for affine layouts (daemon/plan/affine.h):
 * the full tensor rebuilt from every rank's shard, and one rank's shard
 * cut from the full tensor, element by element.  The planner suites, the
 * property test and the across-nodes suite check the planner and the
 * daemons against it; the daemon never uses it.
 */
#ifndef SP_TESTS_UNIT_PLAN_ORACLE_H
#define SP_TESTS_UNIT_PLAN_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/affine.h"

/* Builds the full tensor (elsize bytes per element, row-major) from every
 * rank's shard after affine_validate's checks, comparing replicas with the
 * help of one byte per element of the full tensor:
 * SP_EDIFFERENT when two holders of an element hold different bytes.
 * shards[r] holds map->shards[r].numel elements. */
int oracle_rebuild(const struct affine_map *map, size_t elsize,
                   const void *const *shards, void *full, char *msg,
                   size_t msglen);

/* Fills rank's shard from the full tensor after affine_check_rank; shard
 * elements no piece reads (padding) are zeroed, never left uninitialised. */
int oracle_extract(const struct affine_map *map, uint32_t rank, size_t elsize,
                   const void *full, void *shard, char *msg, size_t msglen);

#endif /* SP_TESTS_UNIT_PLAN_ORACLE_H */
