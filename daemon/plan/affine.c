/*
 * affine.c - validation, rebuild and extract of affine layouts.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/affine.h"
#include "daemon/plan/internal.h"

/* The writer record: one byte per element of the full tensor.  The low bits
 * say who may write the element, WRITTEN says rebuild has stored its bytes,
 * so later replicas compare instead of overwriting. */
enum {
  WRITER_NOBODY = 0,
  WRITER_SINGLE = 1,
  WRITER_REPLICA = 2,
  WRITER_WRITTEN = 4,
};

/* Walks a piece's elements in row-major order of its shape, keeping the
 * source and destination element indices; no callback per element. */
struct piece_iter {
  const struct affine_piece *piece;
  int64_t idx[SP_MAX_DIMS];
  uint64_t src;
  uint64_t dst;
  bool done;
};

static void piece_iter_start(struct piece_iter *it,
                             const struct affine_piece *piece, uint64_t numel) {
  memset(it->idx, 0, sizeof it->idx);
  it->piece = piece;
  it->src = (uint64_t)piece->src_offset;
  it->dst = (uint64_t)piece->dst_offset;
  it->done = numel == 0;
}

static void piece_iter_next(struct piece_iter *it) {
  const struct affine_piece *p = it->piece;

  for (uint32_t d = p->ndim; d-- > 0;) {
    if (++it->idx[d] < p->shape[d]) {
      it->src += (uint64_t)p->src_stride[d];
      it->dst += (uint64_t)p->dst_stride[d];
      return;
    }
    it->src -= (uint64_t)p->src_stride[d] * (uint64_t)(p->shape[d] - 1);
    it->dst -= (uint64_t)p->dst_stride[d] * (uint64_t)(p->shape[d] - 1);
    it->idx[d] = 0;
  }
  it->done = true;
}

/* Elements of a piece that affine's checks accepted. */
static uint64_t piece_numel(const struct affine_piece *p) {
  uint64_t numel = 0;
  sp_view_numel(p->ndim, p->shape, &numel);
  return numel;
}

/* "[1, 2]": the multi-index of element flat in the full tensor. */
static void format_index(const struct affine_map *map, uint64_t flat, char *buf,
                         size_t len) {
  uint64_t idx[SP_MAX_DIMS];
  size_t used = 0;

  for (uint32_t d = map->ndim; d-- > 0;) {
    uint64_t dim = (uint64_t)map->shape[d];
    idx[d] = dim == 0 ? 0 : flat % dim;
    flat = dim == 0 ? 0 : flat / dim;
  }
  used += (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < map->ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu",
                             d > 0 ? ", " : "", (unsigned long long)idx[d]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
}

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
      return plan_refuse(msg, msglen, SP_EUNSUPPORTED,
                         "key '%s': piece %zu of rank %u has %s stride %lld "
                         "in dim %u; negative strides are not supported",
                         map->key, pi, rank, side, (long long)stride[k], k);
  if (offset < 0)
    return plan_refuse(msg, msglen, bounds_code,
                       "key '%s': piece %zu of rank %u has %s offset %lld",
                       map->key, pi, rank, side, (long long)offset);
  rc = sp_view_check_overlap(p->ndim, p->shape, stride);
  if (rc == SP_EZEROSTRIDE)
    return plan_refuse(msg, msglen, rc,
                       "key '%s': piece %zu of rank %u has a zero %s stride",
                       map->key, pi, rank, side);
  if (rc == SP_ESELFOVERLAP)
    return plan_refuse(msg, msglen, rc,
                       "key '%s': piece %zu of rank %u reaches one %s element "
                       "twice within itself",
                       map->key, pi, rank, side);
  if (rc == 0 && numel > 0)
    rc = sp_view_extent(p->ndim, p->shape, stride, offset, &extent);
  if (rc != 0)
    return plan_refuse(msg, msglen, SP_EOVERFLOW,
                       "key '%s': piece %zu of rank %u: its %s reach "
                       "overflows",
                       map->key, pi, rank, side);
  if (numel > 0 && extent > limit)
    return plan_refuse(msg, msglen, bounds_code,
                       "key '%s': piece %zu of rank %u reaches %s element "
                       "%llu of %llu",
                       map->key, pi, rank, side,
                       (unsigned long long)(extent - 1),
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
    return plan_refuse(msg, msglen, SP_EINVAL,
                       "key '%s': piece %zu of rank %u has %u dims, more "
                       "than %d",
                       map->key, pi, rank, p->ndim, SP_MAX_DIMS);
  rc = sp_view_numel(p->ndim, p->shape, &numel);
  if (rc != 0)
    return plan_refuse(msg, msglen, rc,
                       "key '%s': piece %zu of rank %u has a negative or "
                       "overflowing shape",
                       map->key, pi, rank);
  /* Holders in ascending order make a duplicate visible in one pass. */
  for (uint32_t h = 0; h < p->nholders; h++) {
    if (p->holders[h] >= map->nranks ||
        (h > 0 && p->holders[h] <= p->holders[h - 1]))
      return plan_refuse(msg, msglen, SP_EINVAL,
                         "key '%s': piece %zu of rank %u lists holders that "
                         "are not distinct ranks in ascending order below %u",
                         map->key, pi, rank, map->nranks);
    own = own || p->holders[h] == rank;
  }
  if (!own)
    return plan_refuse(msg, msglen, SP_EINVAL,
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

/* The first piece of rank, before piece `before`, that reads shard element
 * s: only walked to name the culprit of a refusal. */
static size_t first_reader(const struct affine_shard *shard, size_t before,
                           uint64_t s) {
  for (size_t pi = 0; pi < before; pi++) {
    struct piece_iter it;
    for (piece_iter_start(&it, &shard->pieces[pi],
                          piece_numel(&shard->pieces[pi]));
         !it.done; piece_iter_next(&it))
      if (it.src == s)
        return pi;
  }
  return before;
}

/* Checks rank's pieces; readmask holds at least the shard's numel bytes. */
static int check_rank(const struct affine_map *map, uint32_t rank,
                      uint64_t full_numel, uint8_t *readmask, char *msg,
                      size_t msglen) {
  const struct affine_shard *shard = &map->shards[rank];
  int rc;

  for (size_t pi = 0; pi < shard->npieces; pi++) {
    rc = check_piece(map, rank, pi, full_numel, msg, msglen);
    if (rc != 0)
      return rc;
  }
  memset(readmask, 0, shard->numel);
  for (size_t pi = 0; pi < shard->npieces; pi++) {
    const struct affine_piece *p = &shard->pieces[pi];
    struct piece_iter it;
    for (piece_iter_start(&it, p, piece_numel(p)); !it.done;
         piece_iter_next(&it)) {
      if (readmask[it.src])
        return plan_refuse(msg, msglen, SP_EDOUBLEWRITE,
                           "key '%s': rank %u reads element %llu of its shard "
                           "in pieces %zu and %zu",
                           map->key, rank, (unsigned long long)it.src,
                           first_reader(shard, pi, it.src), pi);
      readmask[it.src] = 1;
    }
  }
  return 0;
}

static int full_numel_of(const struct affine_map *map, uint64_t *numel,
                         char *msg, size_t msglen) {
  int rc = sp_view_numel(map->ndim, map->shape, numel);
  if (rc != 0)
    return plan_refuse(msg, msglen, rc,
                       "key '%s': the full shape is too deep, negative or "
                       "overflowing",
                       map->key);
  return 0;
}

int affine_check_rank(const struct affine_map *map, uint32_t rank, char *msg,
                      size_t msglen) {
  uint64_t full_numel;
  uint8_t *readmask;
  int rc;

  if (rank >= map->nranks)
    return plan_refuse(msg, msglen, SP_ERANK, "key '%s': rank %u of %u",
                       map->key, rank, map->nranks);
  rc = full_numel_of(map, &full_numel, msg, msglen);
  if (rc != 0)
    return rc;
  readmask = malloc(map->shards[rank].numel > 0 ? map->shards[rank].numel : 1);
  if (readmask == NULL)
    return plan_refuse(msg, msglen, SP_ENOMEM,
                       "key '%s': no memory for a shard of %llu elements",
                       map->key, (unsigned long long)map->shards[rank].numel);
  rc = check_rank(map, rank, full_numel, readmask, msg, msglen);
  free(readmask);
  return rc;
}

/* The first piece, in visiting order before (rank, pi), that writes full
 * element d; walked only to name both sides of a refusal. */
static void first_writer(const struct affine_map *map, uint32_t rank, size_t pi,
                         uint64_t d, uint32_t *wr, size_t *wp) {
  for (uint32_t r = 0; r <= rank; r++) {
    const struct affine_shard *shard = &map->shards[r];
    size_t end = r == rank ? pi : shard->npieces;
    for (size_t p = 0; p < end; p++) {
      struct piece_iter it;
      for (piece_iter_start(&it, &shard->pieces[p],
                            piece_numel(&shard->pieces[p]));
           !it.done; piece_iter_next(&it)) {
        if (it.dst == d) {
          *wr = r;
          *wp = p;
          return;
        }
      }
    }
  }
  *wr = rank;
  *wp = pi;
}

static int refuse_conflict(const struct affine_map *map, uint32_t rank,
                           size_t pi, uint64_t d, int code, char *msg,
                           size_t msglen) {
  char where[96];
  uint32_t wr;
  size_t wp;

  first_writer(map, rank, pi, d, &wr, &wp);
  format_index(map, d, where, sizeof where);
  if (code == SP_EDIFFERENT)
    return plan_refuse(msg, msglen, code,
                       "key '%s': replicas hold different data at element %s: "
                       "rank %u (piece %zu) and rank %u (piece %zu)",
                       map->key, where, wr, wp, rank, pi);
  return plan_refuse(msg, msglen, code,
                     "key '%s': element %s is written by rank %u (piece %zu, "
                     "%s) and rank %u (piece %zu, %s); only replicas may "
                     "share an element",
                     map->key, where, wr, wp,
                     piece_role(&map->shards[wr].pieces[wp]), rank, pi,
                     piece_role(&map->shards[rank].pieces[pi]));
}

/* Runs every check and returns the writer record in *out (the caller frees
 * it).  The verdict does not depend on the visiting order: an element is
 * refused as soon as a single holder meets any other writer, whichever came
 * first, and replicas only ever meet replicas. */
static int writers(const struct affine_map *map, uint64_t *full_numel,
                   uint8_t **out, char *msg, size_t msglen) {
  uint64_t max_shard = 1;
  uint8_t *readmask, *mask;
  int rc;

  rc = full_numel_of(map, full_numel, msg, msglen);
  if (rc != 0)
    return rc;
  for (uint32_t r = 0; r < map->nranks; r++)
    if (map->shards[r].numel > max_shard)
      max_shard = map->shards[r].numel;
  readmask = malloc(max_shard);
  if (readmask == NULL)
    return plan_refuse(msg, msglen, SP_ENOMEM,
                       "key '%s': no memory for a shard of %llu elements",
                       map->key, (unsigned long long)max_shard);
  for (uint32_t r = 0; r < map->nranks; r++) {
    rc = check_rank(map, r, *full_numel, readmask, msg, msglen);
    if (rc != 0) {
      free(readmask);
      return rc;
    }
  }
  free(readmask);
  mask = calloc(*full_numel > 0 ? *full_numel : 1, 1);
  if (mask == NULL)
    return plan_refuse(msg, msglen, SP_ENOMEM,
                       "key '%s': no memory for a writer record of %llu "
                       "elements",
                       map->key, (unsigned long long)*full_numel);
  for (uint32_t r = 0; r < map->nranks; r++) {
    const struct affine_shard *shard = &map->shards[r];
    for (size_t pi = 0; pi < shard->npieces; pi++) {
      const struct affine_piece *p = &shard->pieces[pi];
      uint8_t kind = p->nholders > 1 ? WRITER_REPLICA : WRITER_SINGLE;
      struct piece_iter it;
      for (piece_iter_start(&it, p, piece_numel(p)); !it.done;
           piece_iter_next(&it)) {
        uint8_t seen = mask[it.dst];
        if (seen == WRITER_NOBODY) {
          mask[it.dst] = kind;
        } else if (seen == WRITER_SINGLE || kind == WRITER_SINGLE) {
          rc =
              refuse_conflict(map, r, pi, it.dst, SP_EDOUBLEWRITE, msg, msglen);
          free(mask);
          return rc;
        }
      }
    }
  }
  for (uint64_t d = 0; d < *full_numel; d++) {
    if (mask[d] == WRITER_NOBODY) {
      char where[96];
      uint64_t more = 0;
      for (uint64_t e = d + 1; e < *full_numel; e++)
        more += mask[e] == WRITER_NOBODY;
      format_index(map, d, where, sizeof where);
      free(mask);
      return plan_refuse(msg, msglen, SP_EUNCOVERED,
                         "key '%s': element %s is held by no rank (and %llu "
                         "more elements)",
                         map->key, where, (unsigned long long)more);
    }
  }
  *out = mask;
  return 0;
}

int affine_validate(const struct affine_map *map, char *msg, size_t msglen) {
  uint64_t full_numel;
  uint8_t *mask;
  int rc = writers(map, &full_numel, &mask, msg, msglen);
  if (rc == 0)
    free(mask);
  return rc;
}

int affine_rebuild(const struct affine_map *map, size_t elsize,
                   const void *const *shards, void *full, char *msg,
                   size_t msglen) {
  uint64_t full_numel;
  uint8_t *mask;
  int rc = writers(map, &full_numel, &mask, msg, msglen);
  uint64_t bytes;

  if (rc != 0)
    return rc;
  if (__builtin_mul_overflow(full_numel, (uint64_t)elsize, &bytes)) {
    free(mask);
    return plan_refuse(msg, msglen, SP_EOVERFLOW,
                       "key '%s': the full tensor's size overflows", map->key);
  }
  for (uint32_t r = 0; r < map->nranks; r++) {
    const struct affine_shard *shard = &map->shards[r];
    const uint8_t *src = shards[r];
    for (size_t pi = 0; pi < shard->npieces; pi++) {
      const struct affine_piece *p = &shard->pieces[pi];
      struct piece_iter it;
      for (piece_iter_start(&it, p, piece_numel(p)); !it.done;
           piece_iter_next(&it)) {
        uint8_t *to = (uint8_t *)full + it.dst * elsize;
        const uint8_t *from = src + it.src * elsize;
        if (mask[it.dst] & WRITER_WRITTEN) {
          if (memcmp(to, from, elsize) != 0) {
            rc =
                refuse_conflict(map, r, pi, it.dst, SP_EDIFFERENT, msg, msglen);
            free(mask);
            return rc;
          }
        } else {
          memcpy(to, from, elsize);
          mask[it.dst] |= WRITER_WRITTEN;
        }
      }
    }
  }
  free(mask);
  return 0;
}

int affine_extract(const struct affine_map *map, uint32_t rank, size_t elsize,
                   const void *full, void *shard, char *msg, size_t msglen) {
  const struct affine_shard *own;
  uint64_t bytes;
  int rc = affine_check_rank(map, rank, msg, msglen);

  if (rc != 0)
    return rc;
  own = &map->shards[rank];
  if (__builtin_mul_overflow(own->numel, (uint64_t)elsize, &bytes))
    return plan_refuse(msg, msglen, SP_EOVERFLOW,
                       "key '%s': rank %u's shard size overflows", map->key,
                       rank);
  memset(shard, 0, bytes);
  for (size_t pi = 0; pi < own->npieces; pi++) {
    const struct affine_piece *p = &own->pieces[pi];
    struct piece_iter it;
    for (piece_iter_start(&it, p, piece_numel(p)); !it.done;
         piece_iter_next(&it))
      memcpy((uint8_t *)shard + it.src * elsize,
             (const uint8_t *)full + it.dst * elsize, elsize);
  }
  return 0;
}
