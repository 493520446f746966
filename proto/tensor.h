/*
 * tensor.h - a tensor's description as tensor_add spells it
 * (docs/protocol.md, "tensor_add"): encoded in one place for the client
 * library, which registers a rank's tensors, and the daemon, which relays
 * a rank's registrations to the other daemons of its job in the same
 * words (tensor.c).
 */
#ifndef SP_PROTO_TENSOR_H
#define SP_PROTO_TENSOR_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One affine piece, pointing into the caller's own piece type. */
struct sp_piece_wire {
  uint32_t ndim;
  const int64_t *shape, *src_stride, *dst_stride;
  int64_t src_offset, dst_offset;
  uint32_t nholders;
  const uint32_t *holders;
};

/* One tensor, pointing into the caller's own tensor type; for an affine
 * placement, piece(pieces, i, out) describes piece i of npieces. */
struct sp_tensor_wire {
  const char *key;
  uint64_t sid;
  const char *dtype;
  uint32_t ndim;
  const int64_t *shape, *stride;
  int64_t offset; /* elements */
  const char *placement;
  uint32_t global_ndim;
  const int64_t *global_shape;
  bool affine;
  size_t npieces;
  void (*piece)(const void *pieces, size_t i, struct sp_piece_wire *out);
  const void *pieces;
};

/* `key: [d0, d1, ...]`: a shape, stride or offset list, as unsigned
 * integers (the wire has no negative dims). */
void sp__pack_kv_dims(msgpack_packer *pk, const char *key, const int64_t *dims,
                      uint32_t ndim);
/* The tensor's map: 8 pairs, 9 with the pieces of an affine placement. */
void sp__tensor_pack(msgpack_packer *pk, const struct sp_tensor_wire *t);

#endif /* SP_PROTO_TENSOR_H */
