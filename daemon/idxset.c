/*
 * idxset.c - an open-addressing set of indices into a caller's array, found
 * by hash and a caller's match function; see idxset.h.
 *
 * A slot holds the hash's high 32 bits and index + 1, so a free slot is 0,
 * growing never calls back into the caller, and most mismatches are
 * rejected without touching the caller's array.  The load stays at most
 * one half, so a probe is short and a full table cannot happen.
 *
 * The ids, base addresses and key names hashed here are chosen by clients.
 * With a fixed hash a client can pick values that all land in one run of
 * slots, and every insertion then walks the whole run: one storage_add
 * frame held the event loop for over a minute that way.  So the hash is
 * SipHash-2-4 (libsodium's crypto_shorthash), a keyed pseudo-random
 * function, under a key drawn from getrandom() once per process: without
 * the key a client cannot tell which values collide, every value's slot is
 * as good as uniformly random whatever the client picks, and at a load of
 * at most one half linear probing takes 2.5 probes per insertion or
 * failed lookup on average.  A frame of n items thus costs O(n) probes.
 */
#include <pthread.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "daemon/idxset.h"
#include "daemon/log.h"
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
  /* Written through now, not calloc'd: a large calloc is fresh pages that
   * an insertion's probe reads first, which maps the shared zero page, and
   * its write then replaces that page, which flushes the TLB of every CPU
   * the daemon's threads run on.  With workers busy, those waits made the
   * loop's steps that index a large frame several times slower.  Cleared
   * with explicit_bzero, which the compiler does not fold back into a
   * calloc as it does malloc and memset. */
  uint64_t *slot = malloc(ncap * sizeof *slot);
  if (slot == NULL)
    return SP_ENOMEM;
  explicit_bzero(slot, ncap * sizeof *slot);
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

static uint8_t hash_key[crypto_shorthash_KEYBYTES];
static pthread_once_t hash_key_once = PTHREAD_ONCE_INIT;

/* getrandom() of at most 256 bytes neither fails nor returns less once the
 * kernel's pool is ready (it blocks until then), so a failure here is a
 * broken system, not a condition to serve on with a guessable key. */
static void hash_key_init(void) {
  if (sodium_init() < 0 ||
      getrandom(hash_key, sizeof hash_key, 0) != (ssize_t)sizeof hash_key) {
    log_msg(LOG_LEVEL_ERROR, "no random key for the hash tables");
    abort();
  }
}

/* Registries are also built on planning threads (nodemsg.c): the key is
 * drawn once, by whichever thread hashes first. */
static uint64_t keyed_hash(const void *data, size_t len) {
  pthread_once(&hash_key_once, hash_key_init);
  unsigned char out[crypto_shorthash_BYTES];
  crypto_shorthash(out, data, len, hash_key);
  uint64_t h;
  memcpy(&h, out, sizeof h);
  return h;
}

uint64_t idxset_hash_bytes(const void *data, size_t len) {
  return keyed_hash(data, len);
}

uint64_t idxset_hash_u64(uint64_t v) {
  uint8_t bytes[8];
  for (size_t i = 0; i < sizeof bytes; i++)
    bytes[i] = (uint8_t)(v >> (8 * i));
  return keyed_hash(bytes, sizeof bytes);
}
