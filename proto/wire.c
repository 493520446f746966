/*
 * wire.c - the bounded msgpack scanner and the only call into msgpack-c's
 * unpacker.  See wire.h for why the scan comes first.
 */
#include <stdbool.h>

#include "shardport.h"
#include "proto/wire.h"

#include <msgpack/unpack_define.h>

/* msgpack-c's unpacker has a fixed stack of MSGPACK_EMBED_STACK_SIZE
 * levels and fails beyond it with an out-of-memory error, so no configured
 * depth may exceed it. */
#define WIRE_DEPTH_CAP SP_LIMITS_MAX_DEPTH
_Static_assert(WIRE_DEPTH_CAP <= MSGPACK_EMBED_STACK_SIZE,
               "the scanner allows deeper nesting than msgpack-c unpacks");

enum wire_kind { WIRE_SCALAR, WIRE_ARRAY, WIRE_MAP };

/* What one type byte announces, once its length field has been read. */
struct wire_item {
  enum wire_kind kind;
  uint64_t count; /* elements of an array, pairs of a map */
  uint64_t skip;  /* payload bytes after the length field */
  bool is_blob;   /* str, bin or ext: its data is bounded by max_string */
  bool is_ext;    /* an ext's type byte comes before its data */
};

static uint64_t read_be(const uint8_t *p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++)
    v = v << 8 | p[i];
  return v;
}

/* Decodes the type byte at data[*pos] and its length field.  Only the
 * bytes inside the frame are read. */
static int wire_classify(const uint8_t *data, size_t len, size_t *pos,
                         struct wire_item *item) {
  uint8_t t = data[(*pos)++];
  size_t width = 0; /* bytes of the length field that follows */
  *item = (struct wire_item){.kind = WIRE_SCALAR};

  if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3)
    return 0;
  if (t >= 0x80 && t <= 0x8f) {
    item->kind = WIRE_MAP;
    item->count = t & 0x0f;
    return 0;
  }
  if (t >= 0x90 && t <= 0x9f) {
    item->kind = WIRE_ARRAY;
    item->count = t & 0x0f;
    return 0;
  }
  if (t >= 0xa0 && t <= 0xbf) {
    item->skip = t & 0x1f;
    item->is_blob = true;
    return 0;
  }
  switch (t) {
  case 0xcc: case 0xd0: item->skip = 1; return 0;
  case 0xcd: case 0xd1: item->skip = 2; return 0;
  case 0xca: case 0xce: case 0xd2: item->skip = 4; return 0;
  case 0xcb: case 0xcf: case 0xd3: item->skip = 8; return 0;
  case 0xd4: item->skip = 2; return 0;
  case 0xd5: item->skip = 3; return 0;
  case 0xd6: item->skip = 5; return 0;
  case 0xd7: item->skip = 9; return 0;
  case 0xd8: item->skip = 17; return 0;
  case 0xc4: case 0xd9: width = 1; item->is_blob = true; break;
  case 0xc5: case 0xda: width = 2; item->is_blob = true; break;
  case 0xc6: case 0xdb: width = 4; item->is_blob = true; break;
  case 0xc7: width = 1; item->is_blob = true; break;
  case 0xc8: width = 2; item->is_blob = true; break;
  case 0xc9: width = 4; item->is_blob = true; break;
  case 0xdc: width = 2; item->kind = WIRE_ARRAY; break;
  case 0xdd: width = 4; item->kind = WIRE_ARRAY; break;
  case 0xde: width = 2; item->kind = WIRE_MAP; break;
  case 0xdf: width = 4; item->kind = WIRE_MAP; break;
  default: return SP_EMALFORMED; /* 0xc1 is never used */
  }
  if (len - *pos < width)
    return SP_EMALFORMED;
  uint64_t n = read_be(data + *pos, width);
  *pos += width;
  if (item->kind == WIRE_SCALAR) {
    item->is_ext = t >= 0xc7 && t <= 0xc9;
    item->skip = n + item->is_ext;
  } else
    item->count = n;
  return 0;
}

int sp__wire_check(const uint8_t *data, size_t len,
                   const struct sp_limits *limits) {
  uint64_t remaining[WIRE_DEPTH_CAP]; /* items left in each open container */
  uint32_t max_depth = limits->max_depth < WIRE_DEPTH_CAP ? limits->max_depth
                                                          : WIRE_DEPTH_CAP;
  size_t depth = 0;
  size_t pos = 0;
  bool top = true;
  /* msgpack-c spends 24 to 48 bytes on every item it unpacks, so the items
   * of the whole frame are bounded too, not only those of each container. */
  uint64_t total_items = 0;

  do {
    if (pos >= len)
      return SP_EMALFORMED;
    struct wire_item item;
    int rc = wire_classify(data, len, &pos, &item);
    if (rc < 0)
      return rc;
    if (top && item.kind != WIRE_MAP)
      return SP_EMALFORMED;
    top = false;
    size_t left = len - pos;

    if (item.kind == WIRE_SCALAR) {
      if (item.is_blob &&
          (item.skip - item.is_ext > limits->max_string || item.skip > left))
        return SP_ESTRTOOLONG;
      if (item.skip > left)
        return SP_EMALFORMED;
      pos += item.skip;
    } else {
      /* Every item takes at least one byte, so a count beyond the bytes left
       * is a lie, refused before msgpack-c would allocate for it. */
      uint64_t items = item.kind == WIRE_MAP ? item.count * 2 : item.count;
      total_items += items;
      if (item.count > limits->max_items || items > left ||
          total_items > (uint64_t)limits->max_items * 2)
        return SP_ETOOMANY;
      if (depth + 1 > max_depth)
        return SP_ETOODEEP;
      if (items > 0) {
        remaining[depth++] = items;
        continue;
      }
    }
    /* One value is complete: close every container it completes. */
    while (depth > 0 && --remaining[depth - 1] == 0)
      depth--;
  } while (depth > 0);

  return pos == len ? 0 : SP_EMALFORMED;
}

int sp__wire_decode(const uint8_t *data, size_t len,
                    const struct sp_limits *limits, msgpack_zone *zone,
                    msgpack_object *out) {
  int rc = sp__wire_check(data, len, limits);
  if (rc < 0)
    return rc;
  size_t off = 0;
  msgpack_unpack_return ur =
      msgpack_unpack((const char *)data, len, &off, zone, out);
  if (ur == MSGPACK_UNPACK_NOMEM_ERROR)
    return SP_ENOMEM;
  if (ur != MSGPACK_UNPACK_SUCCESS || off != len ||
      out->type != MSGPACK_OBJECT_MAP)
    return SP_EMALFORMED;
  return 0;
}
