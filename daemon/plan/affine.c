/*
 * affine.c - validation of affine layouts; see affine.h.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/affine.h"
#include "daemon/plan/internal.h"

static const char *piece_role(const struct affine_piece *p) {
  return p->nholders > 1 ? "replica" : "single holder";
}

static int check_side(const struct affine_map *map, uint32_t rank, size_t pi,
                      const char *side, int bounds_code, int64_t offset,
                      const int64_t *stride, uint64_t numel, uint64_t limit,
                      char *msg, size_t msglen) {
  const struct affine_piece *p = &map->shards[rank].pieces[pi];
  uint64_t extent = 0;
  int rc;

  for (uint32_t k = 0; k < p->ndim; k++)
    if (stride[k] < 0)
      return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                       "key '%s': piece %zu of rank %u has %s stride %lld "
                       "in dim %u; negative strides are not supported",
                       map->key, pi, rank, side, (long long)stride[k], k);
  if (offset < 0)
    return sp__failf(msg, msglen, bounds_code,
                     "key '%s': piece %zu of rank %u has %s offset %lld",
                     map->key, pi, rank, side, (long long)offset);
  rc = sp__view_check_overlap(p->ndim, p->shape, stride);
  if (rc == SP_EZEROSTRIDE)
    return sp__failf(msg, msglen, rc,
                     "key '%s': piece %zu of rank %u has a zero %s stride",
                     map->key, pi, rank, side);
  if (rc == SP_ESELFOVERLAP)
    return sp__failf(msg, msglen, rc,
                     "key '%s': piece %zu of rank %u reaches one %s element "
                     "twice within itself",
                     map->key, pi, rank, side);
  if (rc == 0 && numel > 0)
    rc = sp__view_extent(p->ndim, p->shape, stride, offset, &extent);
  if (rc != 0)
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "key '%s': piece %zu of rank %u: its %s reach "
                     "overflows",
                     map->key, pi, rank, side);
  if (numel > 0 && extent > limit)
    return sp__failf(msg, msglen, bounds_code,
                     "key '%s': piece %zu of rank %u reaches %s element "
                     "%llu of %llu",
                     map->key, pi, rank, side, (unsigned long long)(extent - 1),
                     (unsigned long long)limit);
  return 0;
}

static int check_piece(const struct affine_map *map, uint32_t rank, size_t pi,
                       uint64_t full_numel, char *msg, size_t msglen) {
  const struct affine_piece *p = &map->shards[rank].pieces[pi];
  bool own = false;
  uint64_t numel;
  int rc;

  if (p->ndim > SP_MAX_DIMS)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "key '%s': piece %zu of rank %u has %u dims, more "
                     "than %d",
                     map->key, pi, rank, p->ndim, SP_MAX_DIMS);
  rc = sp__view_numel(p->ndim, p->shape, &numel);
  if (rc != 0)
    return sp__failf(msg, msglen, rc,
                     "key '%s': piece %zu of rank %u has a negative or "
                     "overflowing shape",
                     map->key, pi, rank);
  /* Holders in ascending order make a duplicate visible in one pass. */
  for (uint32_t h = 0; h < p->nholders; h++) {
    if (p->holders[h] >= map->nranks ||
        (h > 0 && p->holders[h] <= p->holders[h - 1]))
      return sp__failf(msg, msglen, SP_EINVAL,
                       "key '%s': piece %zu of rank %u lists holders that "
                       "are not distinct ranks in ascending order below %u",
                       map->key, pi, rank, map->nranks);
    own = own || p->holders[h] == rank;
  }
  if (!own)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "key '%s': piece %zu of rank %u does not list rank %u "
                     "among its holders",
                     map->key, pi, rank, rank);
  rc = check_side(map, rank, pi, "source", SP_ESOURCEBOUNDS, p->src_offset,
                  p->src_stride, numel, map->shards[rank].numel, msg, msglen);
  if (rc != 0)
    return rc;
  return check_side(map, rank, pi, "destination", SP_EDESTBOUNDS, p->dst_offset,
                    p->dst_stride, numel, full_numel, msg, msglen);
}

/* A sweep that neither passed nor found a fault in the layout. */
static int refuse_sweep(const struct affine_map *map, int rc, char *msg,
                        size_t msglen) {
  if (rc == SP_ETIMEOUT)
    return sp__failf(msg, msglen, rc,
                     "key '%s': planning was stopped while checking its "
                     "affine pieces",
                     map->key);
  return sp__failf(msg, msglen, rc,
                   "key '%s': no memory to check its affine pieces", map->key);
}

/* Refuses what a sweep over one rank's sources found. */
static int refuse_source(const struct affine_map *map, uint32_t rank, int rc,
                         const struct cover_defect *d, char *msg,
                         size_t msglen) {
  if (rc == SP_EDOUBLEWRITE)
    return sp__failf(msg, msglen, rc,
                     "key '%s': rank %u reads element %llu of its shard "
                     "in pieces %u and %u",
                     map->key, rank, (unsigned long long)d->element, d->box,
                     d->other);
  return refuse_sweep(map, rc, msg, msglen);
}

/* Checks rank's pieces on their own; boxes holds at least their count. */
static int check_rank(const struct affine_map *map, uint32_t rank,
                      uint64_t full_numel, struct cover_box *boxes, char *msg,
                      size_t msglen) {
  const struct affine_shard *shard = &map->shards[rank];
  struct cover_defect d;
  int rc;

  for (size_t pi = 0; pi < shard->npieces; pi++) {
    const struct affine_piece *p = &shard->pieces[pi];
    rc = check_piece(map, rank, pi, full_numel, msg, msglen);
    if (rc != 0)
      return rc;
    boxes[pi] = (struct cover_box){p->src_offset, p->ndim, p->shape,
                                   p->src_stride, false};
  }
  rc = cover_check(boxes, shard->npieces, shard->numel, false, map->stop, &d,
                  NULL);
  return rc != 0 ? refuse_source(map, rank, rc, &d, msg, msglen) : 0;
}

static int full_numel_of(const struct affine_map *map, uint64_t *numel,
                         char *msg, size_t msglen) {
  int rc = sp__view_numel(map->ndim, map->shape, numel);
  if (rc != 0)
    return sp__failf(msg, msglen, rc,
                     "key '%s': the full shape is too deep, negative or "
                     "overflowing",
                     map->key);
  return 0;
}

/* Box indices are 32 bits (cover.c's heaps): a key's pieces over all ranks
 * stay below 2^32, far beyond what any frame limit lets through. */
static int count_pieces(const struct affine_map *map, size_t *total, char *msg,
                        size_t msglen) {
  *total = 0;
  for (uint32_t r = 0; r < map->nranks; r++)
    if (__builtin_add_overflow(*total, map->shards[r].npieces, total) ||
        *total >= UINT32_MAX)
      return sp__failf(msg, msglen, SP_EOVERFLOW,
                       "key '%s' has 2^32 or more affine pieces", map->key);
  return 0;
}

static struct cover_box *boxes_new(const struct affine_map *map, size_t n,
                                   int *rc, char *msg, size_t msglen) {
  struct cover_box *boxes = malloc((n > 0 ? n : 1) * sizeof *boxes);
  if (boxes == NULL)
    *rc = sp__failf(msg, msglen, SP_ENOMEM,
                    "key '%s': no memory to check %zu affine pieces", map->key,
                    n);
  return boxes;
}

int affine_check_rank(const struct affine_map *map, uint32_t rank, char *msg,
                      size_t msglen) {
  struct cover_box *boxes;
  uint64_t full_numel;
  int rc;

  if (rank >= map->nranks)
    return sp__failf(msg, msglen, SP_ERANK, "key '%s': rank %u of %u", map->key,
                     rank, map->nranks);
  rc = full_numel_of(map, &full_numel, msg, msglen);
  if (rc != 0)
    return rc;
  boxes = boxes_new(map, map->shards[rank].npieces, &rc, msg, msglen);
  if (boxes == NULL)
    return rc;
  rc = check_rank(map, rank, full_numel, boxes, msg, msglen);
  free(boxes);
  return rc;
}

/* The rank and piece of box i, the pieces of all ranks numbered in rank
 * order. */
static void box_piece(const struct affine_map *map, uint32_t i, uint32_t *rank,
                      size_t *piece) {
  uint32_t r = 0;
  while (i >= map->shards[r].npieces) {
    i -= (uint32_t)map->shards[r].npieces;
    r++;
  }
  *rank = r;
  *piece = i;
}

static int refuse_destination(const struct affine_map *map, int rc,
                              const struct cover_defect *d, char *msg,
                              size_t msglen) {
  char where[96];
  uint32_t r0, r1;
  size_t p0, p1;

  if (rc != SP_EDOUBLEWRITE && rc != SP_EUNCOVERED)
    return refuse_sweep(map, rc, msg, msglen);
  plan_refuse_index(map->ndim, map->shape, d->element, where, sizeof where);
  if (rc == SP_EUNCOVERED)
    return sp__failf(msg, msglen, rc,
                     "key '%s': element %s is held by no "
                     "rank",
                     map->key, where);
  box_piece(map, d->box, &r0, &p0);
  box_piece(map, d->other, &r1, &p1);
  return sp__failf(msg, msglen, rc,
                   "key '%s': element %s is written by rank %u (piece %zu, "
                   "%s) and rank %u (piece %zu, %s); only replicas may "
                   "share an element",
                   map->key, where, r0, p0,
                   piece_role(&map->shards[r0].pieces[p0]), r1, p1,
                   piece_role(&map->shards[r1].pieces[p1]));
}

/* Every rank's pieces on their own, then every piece's destination
 * together: replicas may share elements with replicas only, and every
 * element is written.  Memory proportional to the pieces (cover.c). */
int affine_validate(const struct affine_map *map, char *msg, size_t msglen) {
  struct cover_box *boxes;
  struct cover_defect d;
  uint64_t full_numel;
  size_t total, at = 0;
  int rc;

  rc = full_numel_of(map, &full_numel, msg, msglen);
  if (rc == 0)
    rc = count_pieces(map, &total, msg, msglen);
  if (rc != 0)
    return rc;
  boxes = boxes_new(map, total, &rc, msg, msglen);
  if (boxes == NULL)
    return rc;
  for (uint32_t r = 0; r < map->nranks && rc == 0; r++)
    rc = check_rank(map, r, full_numel, boxes, msg, msglen);
  for (uint32_t r = 0; r < map->nranks && rc == 0; r++) {
    for (size_t pi = 0; pi < map->shards[r].npieces; pi++) {
      const struct affine_piece *p = &map->shards[r].pieces[pi];
      boxes[at++] = (struct cover_box){p->dst_offset, p->ndim, p->shape,
                                       p->dst_stride, p->nholders > 1};
    }
  }
  if (rc == 0) {
    rc = cover_check(boxes, total, full_numel, true, map->stop, &d, NULL);
    if (rc != 0)
      rc = refuse_destination(map, rc, &d, msg, msglen);
  }
  free(boxes);
  return rc;
}
