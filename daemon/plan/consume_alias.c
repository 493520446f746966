/*
 * consume_alias.c - no byte of a consumer's memory is written by two
 * destinations.
 *
 * Two destinations alias when they reach one byte of one memory object:
 * two targets of one consumer (q and k laid over each other in a fused
 * buffer), or targets of two consumers whose storages are one memfd or one
 * CUDA allocation.  Storages name their memory (consume_storage.memory, on
 * their device), so the destinations are grouped by memory object and each
 * group is swept as byte boxes by cover.c, exactly and in memory
 * proportional to the destinations.  A view's elements become bytes by
 * folding the element size into its stride-1 axis, or, when it has none,
 * into one more axis of `size` bytes.  Element strides that clear the axes
 * before them (sp__view_check_overlap, which every destination passed)
 * still clear them once multiplied by the size, so the boxes are what
 * cover_check takes.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/consume_internal.h"

struct byte_box {
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
};

struct alias_ctx {
  const struct consume_trainers *tr;
  const struct consume_in *const *by_index;
  const struct consume_wants *wants;
};

static const struct consume_storage *box_storage(const struct alias_ctx *ax,
                                                 size_t b) {
  const struct consume_box *box = &ax->wants->box[b];
  return &ax->by_index[box->side]->storages[box->storage];
}

/* A destination with the memory object it lies in, to sort by. */
struct mem_ref {
  const struct consume_storage *s;
  size_t box;
};

static int memory_cmp(const struct consume_storage *a,
                      const struct consume_storage *b) {
  int c;

  if (a->device.type != b->device.type)
    return a->device.type < b->device.type ? -1 : 1;
  if (a->device.index != b->device.index)
    return a->device.index < b->device.index ? -1 : 1;
  c = memcmp(a->device.uuid, b->device.uuid, sizeof a->device.uuid);
  if (c != 0)
    return c;
  return a->memory < b->memory ? -1 : a->memory > b->memory;
}

static int by_memory(const void *pa, const void *pb) {
  const struct mem_ref *a = pa, *b = pb;
  int c = memory_cmp(a->s, b->s);
  if (c != 0)
    return c;
  return a->box < b->box ? -1 : a->box > b->box;
}

/* The destination's bytes as a cover box; false when they need more axes
 * than a box has. */
static bool to_bytes(const struct consume_box *box,
                     const struct consume_storage *s, struct byte_box *bb,
                     struct cover_box *out, uint64_t *end) {
  int64_t size = sp__dtype_size(box->view.dtype);
  uint32_t n = 0;
  bool folded = size == 1;
  uint64_t extent = 0;

  for (uint32_t d = 0; d < box->view.ndim; d++) {
    if (box->view.shape[d] == 1)
      continue;
    bb->shape[n] = box->view.shape[d];
    bb->stride[n] = box->view.stride[d] * size;
    if (!folded && box->view.stride[d] == 1) {
      bb->shape[n] *= size;
      bb->stride[n] = 1;
      folded = true;
    }
    n++;
  }
  if (!folded) {
    if (n == SP_MAX_DIMS)
      return false;
    bb->shape[n] = size;
    bb->stride[n++] = 1;
  }
  *out = (struct cover_box){.offset = (int64_t)s->memory_offset +
                                      box->view.offset * size,
                            .ndim = n,
                            .shape = bb->shape,
                            .stride = bb->stride};
  sp__view_extent(n, bb->shape, bb->stride, out->offset, &extent);
  *end = extent;
  return true;
}

static void name_sides(const struct alias_ctx *ax, size_t a, size_t b,
                       uint64_t byte, char *msg, size_t msglen, int *rc) {
  const struct consume_box *x = &ax->wants->box[a], *y = &ax->wants->box[b];
  const char *kx = ax->tr->keys.keys[ax->wants->box_key[a]].name;
  const char *ky = ax->tr->keys.keys[ax->wants->box_key[b]].name;

  if (x->side == y->side)
    *rc = sp__failf(msg, msglen, SP_EDOUBLEWRITE,
                    "consumer %u's targets for keys '%s' and '%s' share byte "
                    "%llu of one buffer",
                    x->side, kx, ky, (unsigned long long)byte);
  else
    *rc = sp__failf(msg, msglen, SP_EDOUBLEWRITE,
                    "the targets of consumer %u for key '%s' and of consumer "
                    "%u for key '%s' share byte %llu of one buffer",
                    x->side, kx, y->side, ky, (unsigned long long)byte);
}

/* Sweeps the destinations order[0..n), all in one memory object. */
static int check_group(const struct alias_ctx *ax, const struct mem_ref *order,
                       size_t n, struct byte_box *bb, struct cover_box *boxes,
                       char *msg, size_t msglen) {
  uint64_t limit = 0;
  struct cover_defect defect;
  int rc;

  for (size_t i = 0; i < n; i++) {
    const struct consume_box *box = &ax->wants->box[order[i].box];
    const struct consume_storage *s = order[i].s;
    uint64_t end;
    if (s->nbytes > INT64_MAX || s->memory_offset > INT64_MAX - s->nbytes)
      return sp__failf(msg, msglen, SP_EOVERFLOW,
                       "consumer %u's storage %u ends past 2^63 bytes of its "
                       "memory",
                       box->side, box->storage);
    if (!to_bytes(box, s, &bb[i], &boxes[i], &end))
      return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                       "consumer %u's target for key '%s' has %d strided "
                       "dims, too many to check against its other targets",
                       box->side,
                       ax->tr->keys.keys[ax->wants->box_key[order[i].box]].name,
                       SP_MAX_DIMS);
    limit = end > limit ? end : limit;
  }
  rc = cover_check(boxes, n, limit, false, ax->tr->ix.stop, &defect, NULL);
  if (rc == SP_EDOUBLEWRITE)
    name_sides(ax, order[defect.box].box, order[defect.other].box,
               defect.element, msg, msglen, &rc);
  else if (rc == SP_ETIMEOUT)
    rc = sp__failf(msg, msglen, rc, "planning was stopped");
  else if (rc != 0)
    rc = sp__failf(msg, msglen, rc, "out of memory");
  return rc;
}

int consume_alias_check(const struct consume_trainers *tr,
                        const struct consume_in *const *by_index,
                        const struct consume_wants *wants, char *msg,
                        size_t msglen) {
  struct alias_ctx ax = {tr, by_index, wants};
  size_t total = wants->first[wants->nkeys];
  size_t room = total > 0 ? total : 1;
  struct mem_ref *order = malloc(room * sizeof *order);
  struct byte_box *bb = malloc(room * sizeof *bb);
  struct cover_box *boxes = malloc(room * sizeof *boxes);
  int rc = 0;

  if (order == NULL || bb == NULL || boxes == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < total; i++)
    order[i] = (struct mem_ref){box_storage(&ax, i), i};
  qsort(order, total, sizeof *order, by_memory);
  /* A group of one destination cannot alias: its view reaches no element
   * twice (sp__view_check). */
  for (size_t i = 0; i < total && rc == 0;) {
    size_t j = i + 1;
    while (j < total && memory_cmp(order[i].s, order[j].s) == 0)
      j++;
    if (j - i > 1)
      rc = check_group(&ax, order + i, j - i, bb, boxes, msg, msglen);
    i = j;
  }
out:
  free(order);
  free(bb);
  free(boxes);
  return rc;
}
