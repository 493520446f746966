/*
 * nodeblob.c - frame bytes shared by the links that send them (the root
 * relays one rank's registrations to every node); see nodelink.h.
 */
#include <stdlib.h>

#include <xxhash.h>

#include "daemon/mesh/nodelink.h"

struct nodeblob *nodeblob_wrap(uint8_t *mem, const uint8_t *payload,
                               size_t len) {
  struct nodeblob *b = calloc(1, sizeof *b);
  if (b == NULL)
    return NULL;
  b->refs = 1;
  b->mem = mem;
  b->payload = payload;
  b->len = len;
  b->hdr[0] = (uint8_t)(len >> 24);
  b->hdr[1] = (uint8_t)(len >> 16);
  b->hdr[2] = (uint8_t)(len >> 8);
  b->hdr[3] = (uint8_t)len;
  return b;
}

struct nodeblob *nodeblob_ref(struct nodeblob *b) {
  b->refs++;
  return b;
}

uint64_t nodeblob_digest(const struct nodeblob *b) {
  return XXH3_64bits(b->payload, b->len);
}

void nodeblob_unref(struct nodeblob *b) {
  if (b == NULL || --b->refs > 0)
    return;
  free(b->mem);
  free(b);
}
