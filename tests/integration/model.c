/*
 * model.c - the synthetic model's values; see model.h.
 */
#include <string.h>

#include "tests/integration/model.h"

/* splitmix64's finaliser: nearby inputs give unrelated outputs. */
static uint64_t mix(uint64_t x) {
  x += UINT64_C(0x9e3779b97f4a7c15);
  x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
  return x ^ (x >> 31);
}

/* FNV-1a of the name, mixed. */
static uint64_t seed_of(const char *s) {
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
  return mix(h);
}

void model_element(const char *name, uint64_t i, size_t es, uint8_t *out) {
  uint64_t v = mix(seed_of(name) + i);
  memcpy(out, &v, es);
}

int64_t model_rows_before(const int64_t *parts, uint32_t rank) {
  int64_t s = 0;
  for (uint32_t r = 0; r < rank; r++)
    s += parts[r];
  return s;
}
