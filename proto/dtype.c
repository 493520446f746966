/*
 * dtype.c - the dtype table: PyTorch names and element sizes.
 */
#include <string.h>

#include "shardport.h"
#include "proto/dtype.h"

struct dtype_entry {
  const char *name;
  uint32_t size;
  const char *safetensors;
};

static const struct dtype_entry dtype_table[SP_DTYPE_COUNT] = {
    [SP_DTYPE_INVALID] = {"invalid", 0, NULL},
#define SP_DTYPE_ENTRY(name, str, size, st) [SP_DTYPE_##name] = {str, size, st},
    SP_DTYPE_MAP(SP_DTYPE_ENTRY)
#undef SP_DTYPE_ENTRY
};

int sp_dtype_from_name(const char *name, size_t len, enum sp_dtype *out) {
  static const char prefix[] = "torch.";
  const size_t plen = sizeof prefix - 1;

  if (len > plen && memcmp(name, prefix, plen) == 0) {
    name += plen;
    len -= plen;
  }
  for (int d = SP_DTYPE_INVALID + 1; d < SP_DTYPE_COUNT; d++) {
    const char *known = dtype_table[d].name;
    if (strlen(known) == len && memcmp(known, name, len) == 0) {
      *out = (enum sp_dtype)d;
      return 0;
    }
  }
  return SP_EDTYPE;
}

const char *sp_dtype_name(enum sp_dtype dtype) {
  if ((unsigned)dtype >= SP_DTYPE_COUNT)
    return dtype_table[SP_DTYPE_INVALID].name;
  return dtype_table[dtype].name;
}

uint32_t sp_dtype_size(enum sp_dtype dtype) {
  if ((unsigned)dtype >= SP_DTYPE_COUNT)
    return 0;
  return dtype_table[dtype].size;
}

const char *sp_dtype_safetensors_name(enum sp_dtype dtype) {
  if ((unsigned)dtype >= SP_DTYPE_COUNT)
    return NULL;
  return dtype_table[dtype].safetensors;
}
