/*
 * oracle.c - the tests' oracle for affine layouts; see oracle.h.
 *
 * It walks every element of every piece, one at a time: slow and plain on
 * purpose, so that what the planner and the engines compute can be checked
 * against it.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/plan/plan.h"
#include "proto/fail.h"
#include "shardport.h"
#include "tests/unit/plan/oracle.h"

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
  sp__view_numel(p->ndim, p->shape, &numel);
  return numel;
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

static int refuse_different(const struct affine_map *map, uint32_t rank,
                            size_t pi, uint64_t d, char *msg, size_t msglen) {
  char where[96];
  uint32_t wr;
  size_t wp;

  first_writer(map, rank, pi, d, &wr, &wp);
  plan_refuse_index(map->ndim, map->shape, d, where, sizeof where);
  return sp__failf(msg, msglen, SP_EDIFFERENT,
                   "key '%s': replicas hold different data at element %s: "
                   "rank %u (piece %zu) and rank %u (piece %zu)",
                   map->key, where, wr, wp, rank, pi);
}

/* After affine_validate, one byte per element of the full tensor (which
 * rebuild fills anyway) says whether its bytes are stored yet, so that a
 * later replica compares instead of overwriting. */
int oracle_rebuild(const struct affine_map *map, size_t elsize,
                   const void *const *shards, void *full, char *msg,
                   size_t msglen) {
  uint64_t full_numel, bytes;
  uint8_t *written;
  int rc = affine_validate(map, msg, msglen);

  if (rc != 0)
    return rc;
  /* affine_validate checked the full shape. */
  sp__view_numel(map->ndim, map->shape, &full_numel);
  if (__builtin_mul_overflow(full_numel, (uint64_t)elsize, &bytes))
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "key '%s': the full tensor's size overflows", map->key);
  written = calloc(full_numel > 0 ? full_numel : 1, 1);
  if (written == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM,
                     "key '%s': no memory to assemble %llu elements", map->key,
                     (unsigned long long)full_numel);
  for (uint32_t r = 0; r < map->nranks && rc == 0; r++) {
    const struct affine_shard *shard = &map->shards[r];
    const uint8_t *src = shards[r];
    for (size_t pi = 0; pi < shard->npieces && rc == 0; pi++) {
      const struct affine_piece *p = &shard->pieces[pi];
      struct piece_iter it;
      for (piece_iter_start(&it, p, piece_numel(p)); !it.done && rc == 0;
           piece_iter_next(&it)) {
        uint8_t *to = (uint8_t *)full + it.dst * elsize;
        const uint8_t *from = src + it.src * elsize;
        if (!written[it.dst]) {
          memcpy(to, from, elsize);
          written[it.dst] = 1;
        } else if (memcmp(to, from, elsize) != 0) {
          rc = refuse_different(map, r, pi, it.dst, msg, msglen);
        }
      }
    }
  }
  free(written);
  return rc;
}

int oracle_extract(const struct affine_map *map, uint32_t rank, size_t elsize,
                   const void *full, void *shard, char *msg, size_t msglen) {
  const struct affine_shard *own;
  uint64_t bytes;
  int rc = affine_check_rank(map, rank, msg, msglen);

  if (rc != 0)
    return rc;
  own = &map->shards[rank];
  if (__builtin_mul_overflow(own->numel, (uint64_t)elsize, &bytes))
    return sp__failf(msg, msglen, SP_EOVERFLOW,
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
