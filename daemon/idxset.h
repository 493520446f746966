/*
 * idxset.h - a set of indices looked up by a keyed hash (idxset.c).
 */
#ifndef SP_DAEMON_IDXSET_H
#define SP_DAEMON_IDXSET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"

/* A set of indices into the caller's array, looked up by a 64-bit hash and
 * a match function over the caller's items (sids, base addresses, keys). */
struct idxset {
  uint64_t *slot;
  size_t mask;
  size_t count;
};

#define IDXSET_NONE UINT32_MAX

typedef bool (*idxset_match)(const void *ctx, uint32_t idx);

void idxset_init(struct idxset *s);
void idxset_free(struct idxset *s);
/* Makes room for more insertions: 0 or SP_ENOMEM. */
int idxset_reserve(struct idxset *s, size_t more);
/* The index whose hash is hash and for which match(ctx, index) holds, or
 * IDXSET_NONE. */
uint32_t idxset_find(const struct idxset *s, uint64_t hash,
                     idxset_match match, const void *ctx);
/* Adds idx; room must have been reserved. */
void idxset_insert(struct idxset *s, uint64_t hash, uint32_t idx);
/* SipHash-2-4 under a random key of this process (idxset.c says why):
 * the only hashes a table of client-chosen values may use. */
uint64_t idxset_hash_bytes(const void *data, size_t len);
uint64_t idxset_hash_u64(uint64_t v);

#endif /* SP_DAEMON_IDXSET_H */
