/*
 * copy.c - strided box copies with contiguous runs merged into memcpy.
 */
#include <string.h>

#include "daemon/xfer/copy.h"

void xfer_box_simplify(const struct xfer_box *in, struct xfer_box *out) {
  out->elem_size = in->elem_size;
  out->ndim = 0;
  for (int d = 0; d < in->ndim; d++) {
    if (in->shape[d] == 1)
      continue;
    int o = out->ndim;
    if (o > 0 && out->src_stride[o - 1] == in->shape[d] * in->src_stride[d] &&
        out->dst_stride[o - 1] == in->shape[d] * in->dst_stride[d]) {
      out->shape[o - 1] *= in->shape[d];
      out->src_stride[o - 1] = in->src_stride[d];
      out->dst_stride[o - 1] = in->dst_stride[d];
      continue;
    }
    out->shape[o] = in->shape[d];
    out->src_stride[o] = in->src_stride[d];
    out->dst_stride[o] = in->dst_stride[d];
    out->ndim++;
  }
}

uint64_t xfer_copy(void *dst, const void *src, const struct xfer_box *box) {
  for (int d = 0; d < box->ndim; d++)
    if (box->shape[d] == 0)
      return 0;

  struct xfer_box b;
  xfer_box_simplify(box, &b);
  size_t esz = b.elem_size;
  if (b.ndim == 0) {
    memcpy(dst, src, esz);
    return esz;
  }

  /* The innermost dimension is a run: one memcpy when dense on both sides. */
  int inner = b.ndim - 1;
  int64_t run = b.shape[inner];
  int dense = b.src_stride[inner] == 1 && b.dst_stride[inner] == 1;
  int64_t index[XFER_MAX_DIMS] = {0};
  uint64_t copied = 0;
  for (;;) {
    int64_t src_off = 0, dst_off = 0;
    for (int d = 0; d < inner; d++) {
      src_off += index[d] * b.src_stride[d];
      dst_off += index[d] * b.dst_stride[d];
    }
    const char *s = (const char *)src + (size_t)src_off * esz;
    char *t = (char *)dst + (size_t)dst_off * esz;
    if (dense) {
      memcpy(t, s, (size_t)run * esz);
    } else {
      for (int64_t i = 0; i < run; i++)
        memcpy(t + (size_t)(i * b.dst_stride[inner]) * esz,
               s + (size_t)(i * b.src_stride[inner]) * esz, esz);
    }
    copied += (uint64_t)run * esz;

    int d = inner - 1;
    while (d >= 0 && ++index[d] == b.shape[d])
      index[d--] = 0;
    if (d < 0)
      return copied;
  }
}
