/*
 * owners.c - one owner per unit (seed 002).
 *
 * Units go largest first, then by name (their first key), each onto the
 * rank with the least load so far, ties to the lowest rank; loads start at
 * each rank's expert bytes, since experts stay where they are.  A heap keyed
 * by (load, rank) makes this O(units log world), after a radix sort of the
 * units.  Ranks are weighed by
 * bytes, not by free device memory: a large embedding must fit its owner.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

struct unit_order {
  uint64_t nbytes;
  uint32_t unit;
};

/* Sorts order[0..n) by bytes descending, stably, so that units of equal
 * bytes stay in unit order (their names' order): a radix sort, a byte at a
 * time from the lowest, skipping bytes that every unit shares, in
 * O(units) where comparing would take O(units log units). */
static int order_units(struct unit_order *order, size_t n) {
  struct unit_order *tmp = malloc((n > 0 ? n : 1) * sizeof *tmp);
  size_t count[257];

  if (tmp == NULL)
    return SP_ENOMEM;
  for (unsigned shift = 0; shift < 64; shift += 8) {
    memset(count, 0, sizeof count);
    /* Descending: the complement's bytes ascend. */
    for (size_t i = 0; i < n; i++)
      count[((~order[i].nbytes >> shift) & 0xff) + 1]++;
    if (n == 0 || count[((~order[0].nbytes >> shift) & 0xff) + 1] == n)
      continue;
    for (size_t v = 0; v < 256; v++)
      count[v + 1] += count[v];
    for (size_t i = 0; i < n; i++)
      tmp[count[(~order[i].nbytes >> shift) & 0xff]++] = order[i];
    memcpy(order, tmp, n * sizeof *order);
  }
  free(tmp);
  return 0;
}

static bool lighter(const uint64_t *load, uint32_t a, uint32_t b) {
  return load[a] < load[b] || (load[a] == load[b] && a < b);
}

static void heap_down(uint32_t *heap, uint32_t n, const uint64_t *load,
                      uint32_t i) {
  for (;;) {
    uint32_t least = i;
    uint64_t l = 2 * (uint64_t)i + 1, r = l + 1;
    if (l < n && lighter(load, heap[l], heap[least]))
      least = (uint32_t)l;
    if (r < n && lighter(load, heap[r], heap[least]))
      least = (uint32_t)r;
    if (least == i)
      return;
    uint32_t t = heap[i];
    heap[i] = heap[least];
    heap[least] = t;
    i = least;
  }
}

int plan_owners_assign(struct plan *plan, char *msg, size_t msglen) {
  uint32_t world = plan->world;
  struct unit_order *order =
      malloc((plan->nunits > 0 ? plan->nunits : 1) * sizeof *order);
  uint32_t *heap = malloc((size_t)world * sizeof *heap);
  int rc = 0;

  plan->load = calloc(world, sizeof *plan->load);
  if (order == NULL || heap == NULL || plan->load == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    if (key->placement == PLAN_EXPERT &&
        __builtin_add_overflow(plan->load[key->owner], key->nbytes,
                               &plan->load[key->owner])) {
      rc = sp__failf(msg, msglen, SP_EOVERFLOW,
                     "rank %u's expert bytes overflow", key->owner);
      goto out;
    }
  }
  for (size_t u = 0; u < plan->nunits; u++)
    order[u] = (struct unit_order){plan->units[u].nbytes, (uint32_t)u};
  if (order_units(order, plan->nunits) != 0) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (uint32_t r = 0; r < world; r++)
    heap[r] = r;
  for (uint32_t i = world / 2; i-- > 0;)
    heap_down(heap, world, plan->load, i);
  for (size_t i = 0; i < plan->nunits; i++) {
    struct plan_unit *u = &plan->units[order[i].unit];
    uint32_t r = heap[0];
    u->owner = r;
    if (__builtin_add_overflow(plan->load[r], u->nbytes, &plan->load[r])) {
      rc = sp__failf(msg, msglen, SP_EOVERFLOW,
                     "rank %u's owned bytes overflow", r);
      goto out;
    }
    heap_down(heap, world, plan->load, 0);
  }
  for (size_t k = 0; k < plan->nkeys; k++)
    if (plan->keys[k].unit != PLAN_NONE)
      plan->keys[k].owner = plan->units[plan->keys[k].unit].owner;
out:
  free(order);
  free(heap);
  return rc;
}
