/*
 * copy.h - strided copies of element boxes between two memory regions, the
 * one primitive the host backend moves data with.
 */
#ifndef SP_XFER_COPY_H
#define SP_XFER_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/xfer/layer.h"

#define XFER_MAX_DIMS 8

/* An n-dimensional box of elements: shape, and the strides (in elements) of
 * its source and destination.  Strides are non-negative; callers have
 * validated that both views stay inside their regions. */
struct xfer_box {
  int ndim;
  size_t elem_size;
  int64_t shape[XFER_MAX_DIMS];
  int64_t src_stride[XFER_MAX_DIMS];
  int64_t dst_stride[XFER_MAX_DIMS];
};

/* Drops unit dimensions and merges each dimension into the one inside it
 * when both sides are contiguous across the boundary, so that the innermost
 * dimension becomes the longest run one copy can move at once (the host
 * copies here and the CUDA backend's device copies share it). */
void xfer_box_simplify(const struct xfer_box *in, struct xfer_box *out);

/* Copies the box; dimensions that are contiguous on both sides are merged so
 * that a dense box is one memcpy.  Returns the bytes copied. */
uint64_t xfer_copy(void *dst, const void *src, const struct xfer_box *box);

#endif /* SP_XFER_COPY_H */
