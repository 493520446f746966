/*
 * tensor.c - a tensor's description on the wire; see tensor.h.
 */
#include "proto/tensor.h"
#include "proto/msg.h"

void sp__pack_kv_dims(msgpack_packer *pk, const char *key, const int64_t *dims,
                      uint32_t ndim) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, ndim);
  for (uint32_t d = 0; d < ndim; d++)
    msgpack_pack_uint64(pk, (uint64_t)dims[d]);
}

static void pack_piece(msgpack_packer *pk, const struct sp_piece_wire *p) {
  msgpack_pack_map(pk, 6);
  sp__pack_kv_dims(pk, "shape", p->shape, p->ndim);
  sp__pack_kv_dims(pk, "src_stride", p->src_stride, p->ndim);
  sp__pack_kv_dims(pk, "dst_stride", p->dst_stride, p->ndim);
  sp__pack_kv_u64(pk, "src_offset", (uint64_t)p->src_offset);
  sp__pack_kv_u64(pk, "dst_offset", (uint64_t)p->dst_offset);
  sp__pack_str(pk, "holders");
  msgpack_pack_array(pk, p->nholders);
  for (uint32_t h = 0; h < p->nholders; h++)
    msgpack_pack_uint32(pk, p->holders[h]);
}

void sp__tensor_pack(msgpack_packer *pk, const struct sp_tensor_wire *t) {
  msgpack_pack_map(pk, t->affine ? 9 : 8);
  sp__pack_kv_str(pk, "key", t->key);
  sp__pack_kv_u64(pk, "sid", t->sid);
  sp__pack_kv_str(pk, "dtype", t->dtype);
  sp__pack_kv_dims(pk, "shape", t->shape, t->ndim);
  sp__pack_kv_dims(pk, "stride", t->stride, t->ndim);
  sp__pack_kv_u64(pk, "offset", (uint64_t)t->offset);
  sp__pack_kv_str(pk, "placement", t->placement);
  sp__pack_kv_dims(pk, "global_shape", t->global_shape, t->global_ndim);
  if (!t->affine)
    return;
  sp__pack_str(pk, "pieces");
  msgpack_pack_array(pk, (uint32_t)t->npieces);
  for (size_t i = 0; i < t->npieces; i++) {
    struct sp_piece_wire p;
    t->piece(t->pieces, i, &p);
    pack_piece(pk, &p);
  }
}
