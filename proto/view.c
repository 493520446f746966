/*
 * view.c - view checks and the storage/view codec.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/fail.h"
#include "shardport.h"
#include "proto/view.h"

int sp__view_numel(uint32_t ndim, const int64_t *shape, uint64_t *numel) {
  uint64_t n = 1;

  if (ndim > SP_MAX_DIMS)
    return SP_EINVAL;
  for (uint32_t i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return SP_EINVAL;
  /* A zero dim empties the tensor whatever the other dims multiply to, so
   * it is looked for before the product can overflow. */
  for (uint32_t i = 0; i < ndim; i++) {
    if (shape[i] == 0) {
      *numel = 0;
      return 0;
    }
  }
  for (uint32_t i = 0; i < ndim; i++)
    if (__builtin_mul_overflow(n, (uint64_t)shape[i], &n) ||
        n > (uint64_t)INT64_MAX)
      return SP_EOVERFLOW;
  *numel = n;
  return 0;
}

int sp__view_check_overlap(uint32_t ndim, const int64_t *shape,
                           const int64_t *stride) {
  uint32_t axes[SP_MAX_DIMS];
  uint32_t nmoving = 0;
  uint64_t reach = 0;

  if (ndim > SP_MAX_DIMS)
    return SP_EINVAL;
  for (uint32_t i = 0; i < ndim; i++)
    if (shape[i] == 0)
      return 0;
  for (uint32_t i = 0; i < ndim; i++) {
    if (shape[i] == 1)
      continue;
    if (stride[i] == 0)
      return SP_EZEROSTRIDE;
    axes[nmoving++] = i;
  }
  /* At most eight axes: an insertion sort, stable so that equal strides
   * keep their order and the verdict does not depend on it. */
  for (uint32_t i = 1; i < nmoving; i++) {
    uint32_t a = axes[i];
    uint32_t j = i;
    for (; j > 0 && stride[axes[j - 1]] > stride[a]; j--)
      axes[j] = axes[j - 1];
    axes[j] = a;
  }
  for (uint32_t k = 0; k < nmoving; k++) {
    uint64_t s = (uint64_t)stride[axes[k]];
    uint64_t span;
    if (s <= reach)
      return SP_ESELFOVERLAP;
    if (__builtin_mul_overflow(s, (uint64_t)(shape[axes[k]] - 1), &span) ||
        __builtin_add_overflow(reach, span, &reach) ||
        reach > (uint64_t)INT64_MAX)
      return SP_EOVERFLOW;
  }
  return 0;
}

int sp__view_extent(uint32_t ndim, const int64_t *shape, const int64_t *stride,
                    int64_t offset, uint64_t *extent) {
  uint64_t reach = 0;

  if (ndim > SP_MAX_DIMS)
    return SP_EINVAL;
  for (uint32_t i = 0; i < ndim; i++) {
    if (shape[i] == 0) {
      *extent = 0;
      return 0;
    }
  }
  for (uint32_t i = 0; i < ndim; i++) {
    uint64_t span;
    if (__builtin_mul_overflow((uint64_t)stride[i], (uint64_t)(shape[i] - 1),
                               &span) ||
        __builtin_add_overflow(reach, span, &reach))
      return SP_EOVERFLOW;
  }
  if (__builtin_add_overflow(reach, (uint64_t)offset, &reach) ||
      __builtin_add_overflow(reach, 1, &reach) || reach > (uint64_t)INT64_MAX)
    return SP_EOVERFLOW;
  *extent = reach;
  return 0;
}

uint64_t sp__view_whole_elements(uint64_t nbytes, enum sp_dtype dtype) {
  uint32_t size = sp__dtype_size(dtype);
  return size == 0 ? 0 : nbytes / size;
}

int sp__view_check(const struct sp_view *view, uint64_t storage_bytes,
                   char *msg, size_t msglen) {
  uint32_t size = sp__dtype_size(view->dtype);
  uint64_t numel, nbytes, extent, whole, offset_bytes;
  int rc;

  if (size == 0)
    return sp__failf(msg, msglen, SP_EDTYPE, "the view has no known dtype");
  if (view->ndim > SP_MAX_DIMS)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "the view has %u dims, more than %d", view->ndim,
                     SP_MAX_DIMS);
  for (uint32_t i = 0; i < view->ndim; i++)
    if (view->shape[i] < 0 || view->stride[i] < 0)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "dim %u has size %lld and stride %lld; both must be "
                       "non-negative",
                       i, (long long)view->shape[i],
                       (long long)view->stride[i]);
  if (view->offset < 0)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "the storage offset %lld is negative",
                     (long long)view->offset);
  if (sp__view_numel(view->ndim, view->shape, &numel) != 0 ||
      __builtin_mul_overflow(numel, size, &nbytes))
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "the view's size in bytes overflows");
  rc = sp__view_check_overlap(view->ndim, view->shape, view->stride);
  if (rc != 0)
    return sp__failf(msg, msglen, rc,
                     rc == SP_EZEROSTRIDE ? "the view has a zero stride"
                     : rc == SP_ESELFOVERLAP
                         ? "the view reaches one element twice"
                         : "the view's reach overflows");
  if (sp__view_extent(view->ndim, view->shape, view->stride, view->offset,
                      &extent) != 0)
    return sp__failf(msg, msglen, SP_EOVERFLOW, "the view's extent overflows");
  /* An empty view reaches no element, so its offset may lie anywhere
   * (PyTorch leaves an empty slice's offset past the end of its storage),
   * but its first byte must still be an address. */
  if (__builtin_mul_overflow((uint64_t)view->offset, size, &offset_bytes) ||
      offset_bytes > (uint64_t)INT64_MAX)
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "the storage offset %lld in bytes overflows",
                     (long long)view->offset);
  /* Whole elements only: the tail of a storage that is not a multiple of
   * the element size is never part of a view. */
  whole = sp__view_whole_elements(storage_bytes, view->dtype);
  if (extent > whole)
    return sp__failf(msg, msglen, SP_EOUTOFBOUNDS,
                     "the view reaches %llu %s elements; its storage of %llu "
                     "bytes holds %llu",
                     (unsigned long long)extent, sp__dtype_name(view->dtype),
                     (unsigned long long)storage_bytes,
                     (unsigned long long)whole);
  return 0;
}

int sp__view_nbytes(const struct sp_view *view, uint64_t *nbytes) {
  uint64_t numel;
  int rc = sp__view_numel(view->ndim, view->shape, &numel);
  if (rc != 0)
    return rc;
  if (__builtin_mul_overflow(numel, sp__dtype_size(view->dtype), nbytes))
    return SP_EOVERFLOW;
  return 0;
}

bool sp__view_is_contiguous(const struct sp_view *view) {
  int64_t expected = 1;

  for (uint32_t i = 0; i < view->ndim; i++)
    if (view->shape[i] == 0)
      return true;
  for (uint32_t i = view->ndim; i-- > 0;) {
    if (view->shape[i] != 1 && view->stride[i] != expected)
      return false;
    if (__builtin_mul_overflow(expected, view->shape[i], &expected))
      return false;
  }
  return true;
}

static int device_cmp(const struct sp_device *a, const struct sp_device *b) {
  if (a->type != b->type)
    return a->type < b->type ? -1 : 1;
  if (a->index != b->index)
    return a->index < b->index ? -1 : 1;
  return memcmp(a->uuid, b->uuid, sizeof a->uuid);
}

bool sp__device_equal(const struct sp_device *a, const struct sp_device *b) {
  return device_cmp(a, b) == 0;
}

struct encode_slot {
  const struct sp_storage *storage;
  size_t index;
};

/* Orders by (device, base), then by position, so the first of a run of
 * equal storages is the tensor that names the storage first. */
static int encode_slot_cmp(const void *pa, const void *pb) {
  const struct encode_slot *a = pa, *b = pb;
  int c = device_cmp(&a->storage->device, &b->storage->device);
  if (c != 0)
    return c;
  if (a->storage->base != b->storage->base)
    return a->storage->base < b->storage->base ? -1 : 1;
  return a->index < b->index ? -1 : a->index > b->index;
}

static bool same_storage(const struct sp_storage *a,
                         const struct sp_storage *b) {
  return sp__device_equal(&a->device, &b->device) && a->base == b->base;
}

int sp__view_encode(const struct sp_tensor *tensors, size_t n,
                    struct sp_storage **storages, size_t *nstorages,
                    struct sp_view_meta **metas, char *msg, size_t msglen) {
  struct encode_slot *slots = NULL;
  size_t *leader = NULL;
  uint32_t *id = NULL;
  struct sp_storage *out_storages = NULL;
  struct sp_view_meta *out_metas = NULL;
  uint32_t count = 0;
  char why[192];
  int rc;

  *storages = NULL;
  *nstorages = 0;
  *metas = NULL;
  if (n == 0)
    return 0;
  if (n > UINT32_MAX)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "%zu tensors, more than a storage index can name", n);
  for (size_t i = 0; i < n; i++) {
    rc = sp__view_check(&tensors[i].view, tensors[i].storage.nbytes, why,
                        sizeof why);
    if (rc != 0)
      return sp__failf(msg, msglen, rc, "tensor %zu: %s", i, why);
  }
  slots = calloc(n, sizeof *slots);
  leader = calloc(n, sizeof *leader);
  id = calloc(n, sizeof *id);
  if (slots == NULL || leader == NULL || id == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory encoding views");
    goto out;
  }
  for (size_t i = 0; i < n; i++)
    slots[i] = (struct encode_slot){&tensors[i].storage, i};
  qsort(slots, n, sizeof *slots, encode_slot_cmp);
  for (size_t j = 0; j < n; j++) {
    if (j > 0 && same_storage(slots[j].storage, slots[j - 1].storage)) {
      if (slots[j].storage->nbytes != slots[j - 1].storage->nbytes) {
        rc = sp__failf(msg, msglen, SP_EINVAL,
                       "tensors %zu and %zu name one storage with lengths "
                       "%llu and %llu",
                       slots[j - 1].index, slots[j].index,
                       (unsigned long long)slots[j - 1].storage->nbytes,
                       (unsigned long long)slots[j].storage->nbytes);
        goto out;
      }
      leader[slots[j].index] = leader[slots[j - 1].index];
    } else {
      leader[slots[j].index] = slots[j].index;
    }
  }
  for (size_t i = 0; i < n; i++)
    if (leader[i] == i)
      id[i] = count++;
  out_storages = calloc(count, sizeof *out_storages);
  out_metas = calloc(n, sizeof *out_metas);
  if (out_storages == NULL || out_metas == NULL) {
    free(out_storages);
    free(out_metas);
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory encoding views");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    if (leader[i] == i)
      out_storages[id[i]] = tensors[i].storage;
    out_metas[i].storage = id[leader[i]];
    out_metas[i].view = tensors[i].view;
  }
  *storages = out_storages;
  *nstorages = count;
  *metas = out_metas;
  rc = 0;
out:
  free(slots);
  free(leader);
  free(id);
  return rc;
}

int sp__view_decode(const struct sp_storage *storages, size_t nstorages,
                    const struct sp_view_meta *metas, size_t nmetas,
                    struct sp_tensor *out, char *msg, size_t msglen) {
  char why[192];

  for (size_t i = 0; i < nmetas; i++) {
    const struct sp_storage *s;
    int rc;
    if (metas[i].storage >= nstorages)
      return sp__failf(msg, msglen, SP_ENOSTORAGE,
                       "view %zu names storage %u of %zu", i, metas[i].storage,
                       nstorages);
    s = &storages[metas[i].storage];
    rc = sp__view_check(&metas[i].view, s->nbytes, why, sizeof why);
    if (rc != 0)
      return sp__failf(msg, msglen, rc, "view %zu: %s", i, why);
    out[i].storage = *s;
    out[i].view = metas[i].view;
  }
  return 0;
}
