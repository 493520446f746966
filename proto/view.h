/*
 * view.h - views into registered storages, their checks, and the
 * storage/view codec that registration uses.
 *
 * A view is PyTorch's (dtype, shape, stride, storage offset), all counted in
 * elements of its dtype.  Nothing from a trainer is used before
 * sp__view_check() has placed it inside its storage: the storage's bytes are
 * read as whole elements only (a 7-byte storage holds one float32), so a
 * reinterpretation never reads past the end.
 *
 * The codec turns a rank's tensors into unique storages plus one
 * (storage index, view) per tensor.  Storages are told apart by (device,
 * base address), never by address alone: two GPUs, or a GPU and the host,
 * can hand out the same address for different memory.
 */
#ifndef SP_PROTO_VIEW_H
#define SP_PROTO_VIEW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/dtype.h"

#define SP_MAX_DIMS 8

struct sp_view {
  enum sp_dtype dtype;
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
  int64_t offset; /* storage offset, in elements */
};

enum sp_device_type {
  SP_DEVICE_CPU = 0,
  SP_DEVICE_CUDA = 1,
  SP_DEVICE_TYPE_COUNT
};

/* A device as a trainer names it.  The uuid identifies a GPU across
 * processes (the index depends on each process's CUDA_VISIBLE_DEVICES); two
 * devices are equal when type, index and uuid all agree, which is exact
 * within the one process that registers them. */
struct sp_device {
  uint32_t type; /* enum sp_device_type */
  int32_t index;
  uint8_t uuid[16];
};

struct sp_storage {
  struct sp_device device;
  uint64_t base;   /* the allocation's address in the trainer */
  uint64_t nbytes; /* its byte length */
};

/* A tensor as a trainer holds it: where its storage is, and the view. */
struct sp_tensor {
  struct sp_storage storage;
  struct sp_view view;
};

/* What registration sends per tensor besides the unique storages. */
struct sp_view_meta {
  uint32_t storage; /* index into the unique storages */
  struct sp_view view;
};

/* Elements of shape[0..ndim): SP_EINVAL for ndim > SP_MAX_DIMS or a negative
 * dim, SP_EOVERFLOW when the product does not fit in 63 bits. */
int sp__view_numel(uint32_t ndim, const int64_t *shape, uint64_t *numel);

/* Refuses a layout that reaches one element twice: SP_EZEROSTRIDE for a zero
 * stride on an axis of more than one element, SP_ESELFOVERLAP otherwise.  The
 * test is conservative and metadata only: taking the axes of more than one
 * element in order of stride, each stride must clear what the axes before it
 * reach.  Every dense or sliced layout passes; an interleaved one that does
 * not overlap, such as shape (3, 2) with strides (2, 3), is refused too.
 * Strides must already be known non-negative. */
int sp__view_check_overlap(uint32_t ndim, const int64_t *shape,
                           const int64_t *stride);

/* The elements from index 0 up to one past the last element the layout
 * reaches (0 for an empty layout: it reaches none, wherever its offset
 * lies); SP_EOVERFLOW past 63 bits.
 * Dims, strides and offset must already be known non-negative. */
int sp__view_extent(uint32_t ndim, const int64_t *shape, const int64_t *stride,
                    int64_t offset, uint64_t *extent);

/* Whole elements of dtype in nbytes: the most a reinterpretation may read. */
uint64_t sp__view_whole_elements(uint64_t nbytes, enum sp_dtype dtype);

/* Checks a view against a storage of storage_bytes: SP_EDTYPE, SP_EINVAL
 * (too many dims, a negative dim, stride or offset), SP_EOVERFLOW,
 * SP_EZEROSTRIDE, SP_ESELFOVERLAP or SP_EOUTOFBOUNDS, with a sentence in msg
 * (which may be NULL).  An empty view touches no byte: its offset may lie
 * past the storage's end, as long as it counts bytes in 63 bits. */
int sp__view_check(const struct sp_view *view, uint64_t storage_bytes,
                   char *msg, size_t msglen);

/* Bytes the view's elements occupy (numel * element size), for a view that
 * passed sp__view_check. */
int sp__view_nbytes(const struct sp_view *view, uint64_t *nbytes);

/* True when the view's elements lie row-major without gaps from its offset
 * (axes of one element may carry any stride, as in PyTorch). */
bool sp__view_is_contiguous(const struct sp_view *view);

bool sp__device_equal(const struct sp_device *a, const struct sp_device *b);

/* Encodes n tensors: *storages receives the unique storages in order of
 * first use and *metas one entry per tensor, both malloc'ed and owned by the
 * caller (NULL when n is 0).  Every view is checked against its storage; a
 * storage seen with two byte lengths is SP_EINVAL.  On failure nothing is
 * allocated. */
int sp__view_encode(const struct sp_tensor *tensors, size_t n,
                    struct sp_storage **storages, size_t *nstorages,
                    struct sp_view_meta **metas, char *msg, size_t msglen);

/* Decodes nmetas views into out[0..nmetas): SP_ENOSTORAGE for an index past
 * nstorages, or any refusal of sp__view_check. */
int sp__view_decode(const struct sp_storage *storages, size_t nstorages,
                    const struct sp_view_meta *metas, size_t nmetas,
                    struct sp_tensor *out, char *msg, size_t msglen);

#endif /* SP_PROTO_VIEW_H */
