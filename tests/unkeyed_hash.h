/*
 * unkeyed_hash.h - the hash the daemon's tables used before they were keyed
 * (daemon/idxset.c): MurmurHash3's 64-bit finalizer, after FNV-1a for
 * bytes.  It is public, fixed and invertible, which is what a client that
 * floods the tables works from; the tests craft their colliding values
 * with it.
 */
#ifndef SP_TEST_UNKEYED_HASH_H
#define SP_TEST_UNKEYED_HASH_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t unkeyed_u64(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  v ^= v >> 33;
  return v;
}

/* The inverse of an odd number modulo 2^64 (Newton's iteration doubles the
 * correct low bits each step). */
static inline uint64_t unkeyed_odd_inverse(uint64_t c) {
  uint64_t x = c;
  for (int i = 0; i < 6; i++)
    x *= 2 - c * x;
  return x;
}

/* x ^= x >> 33 undoes itself; the multiplications undo by the inverses. */
static inline uint64_t unkeyed_u64_inverse(uint64_t v) {
  v ^= v >> 33;
  v *= unkeyed_odd_inverse(0xc4ceb9fe1a85ec53ull);
  v ^= v >> 33;
  v *= unkeyed_odd_inverse(0xff51afd7ed558ccdull);
  v ^= v >> 33;
  return v;
}

static inline uint64_t unkeyed_bytes(const char *s, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; i++) {
    h ^= (uint8_t)s[i];
    h *= 0x100000001b3ull;
  }
  return unkeyed_u64(h);
}

/* The slot a hash starts probing at in a table of cap slots: the daemon's
 * tables take it from the hash's high 32 bits. */
static inline size_t unkeyed_home(uint64_t hash, size_t cap) {
  return (size_t)(hash >> 32) & (cap - 1);
}

#endif /* SP_TEST_UNKEYED_HASH_H */
