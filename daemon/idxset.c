/*
 * idxset.c - an open-addressing set of indices into a caller's array, found
 * by hash and a caller's match function; see daemon.h.
 *
 * A slot holds the hash's high 32 bits and index + 1, so a free slot is 0,
 * growing never calls back into the caller, and most mismatches are
 * rejected without touching the caller's array.  The load stays at most
 * one half, so a probe is short and a full table cannot happen.
 */
#include <stdlib.h>

#include "daemon/daemon.h"
#include "shardport.h"

#define IDXSET_MIN 16u

void idxset_init(struct idxset *s) {
  s->slot = NULL;
  s->mask = 0;
  s->count = 0;
}

void idxset_free(struct idxset *s) {
  free(s->slot);
  idxset_init(s);
}

static void place(uint64_t *slot, size_t mask, uint64_t entry) {
  size_t i = (size_t)(entry >> 32) & mask;
  while (slot[i] != 0)
    i = (i + 1) & mask;
  slot[i] = entry;
}

int idxset_reserve(struct idxset *s, size_t more) {
  size_t need = s->count + more;
  size_t cap = s->slot != NULL ? s->mask + 1 : 0;
  if (need < s->count || need > SIZE_MAX / 4)
    return SP_ENOMEM;
  if (need * 2 <= cap)
    return 0;
  size_t ncap = cap > 0 ? cap : IDXSET_MIN;
  while (ncap < need * 2)
    ncap *= 2;
  uint64_t *slot = calloc(ncap, sizeof *slot);
  if (slot == NULL)
    return SP_ENOMEM;
  for (size_t i = 0; i < cap; i++)
    if (s->slot[i] != 0)
      place(slot, ncap - 1, s->slot[i]);
  free(s->slot);
  s->slot = slot;
  s->mask = ncap - 1;
  return 0;
}

uint32_t idxset_find(const struct idxset *s, uint64_t hash, idxset_match match,
                     const void *ctx) {
  if (s->slot == NULL)
    return IDXSET_NONE;
  uint64_t high = hash >> 32;
  for (size_t i = (size_t)high & s->mask; s->slot[i] != 0;
       i = (i + 1) & s->mask) {
    uint64_t e = s->slot[i];
    uint32_t idx = (uint32_t)(e & 0xffffffffu) - 1;
    if ((e >> 32) == high && match(ctx, idx))
      return idx;
  }
  return IDXSET_NONE;
}

void idxset_insert(struct idxset *s, uint64_t hash, uint32_t idx) {
  place(s->slot, s->mask, (hash & 0xffffffff00000000ull) | ((uint64_t)idx + 1));
  s->count++;
}

uint64_t idxset_hash_bytes(const void *data, size_t len) {
  const uint8_t *p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  /* FNV's high bits mix poorly for short keys; the table uses them. */
  return idxset_hash_u64(h);
}

uint64_t idxset_hash_u64(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  v ^= v >> 33;
  return v;
}
