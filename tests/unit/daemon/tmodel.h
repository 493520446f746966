/*
 * tmodel.h - jobs for the daemon's unit tests: one registry per rank over a
 * real memfd (registered as storage sid 1, mapped read-only by the registry
 * as in the daemon), tensors registered through registry_add_tensors, and
 * the plan_input the daemon would gather from them.
 */
#ifndef SP_TESTS_UNIT_DAEMON_TMODEL_H
#define SP_TESTS_UNIT_DAEMON_TMODEL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/publish.h"
#include "daemon/registry.h"

#define TMODEL_MAX_RANKS 4
#define TMODEL_MAX_KEYS 1024

struct tmodel {
  uint32_t world;
  struct registry reg[TMODEL_MAX_RANKS];
  int fd[TMODEL_MAX_RANKS];
  uint8_t *map[TMODEL_MAX_RANKS]; /* the trainer's own read-write mapping */
  size_t size[TMODEL_MAX_RANKS];
  size_t used[TMODEL_MAX_RANKS];
  /* Every input built, kept until tmodel_free: plans borrow them. */
  struct plan_input_store **stores;
  size_t nstores;
  /* The keys the pattern helpers registered, and whose pattern holds
   * each one's data (a tie's is its leader's). */
  size_t nkeys;
  const char *key_name[TMODEL_MAX_KEYS];
  uint32_t key_data[TMODEL_MAX_KEYS];
};

/* A memfd of bytes bytes (a hole) named name (/proc/self/maps shows
 * it), asserting success. */
int tmodel_memfd(const char *name, size_t bytes);
/* world ranks, each with a memfd of bytes bytes filled with a pattern. */
void tmodel_init(struct tmodel *m, uint32_t world, size_t bytes);
void tmodel_free(struct tmodel *m);
/* bytes of rank r's storage, 64-byte aligned: their byte offset. */
uint64_t tmodel_alloc(struct tmodel *m, uint32_t r, size_t bytes);
/* Registers one tensor on rank r (asserting success): the global shape,
 * its view in elements, and affine pieces (copied). */
void tmodel_tensor(struct tmodel *m, uint32_t r, const char *key,
                   enum sp_dtype dtype, enum plan_placement placement,
                   uint32_t ndim, const int64_t *global, uint32_t vndim,
                   const int64_t *shape, const int64_t *stride, int64_t offset,
                   const struct affine_piece *pieces, size_t npieces);
/* A contiguous row-major tensor of shape placed at a fresh offset;
 * returns that byte offset. */
uint64_t tmodel_dense(struct tmodel *m, uint32_t r, const char *key,
                      enum sp_dtype dtype, enum plan_placement placement,
                      uint32_t ndim, const int64_t *global,
                      const int64_t *shape);
const struct plan_input *tmodel_input(struct tmodel *m, uint32_t max_keys,
                                      uint64_t max_bytes);

/* Pattern models: each key's whole tensor is a byte pattern of (key id,
 * element, byte); every rank's holding is written from it, so any
 * assembled or published tensor can be checked against it. */
uint8_t tmodel_pattern(uint32_t key, uint64_t elem, uint32_t byte);
/* shard0: rows[r] rows on rank r. */
void tmodel_shard0(struct tmodel *m, const char *name, enum sp_dtype dtype,
                   uint32_t ndim, const int64_t *global, const int64_t *rows);
/* replicated or plain on every rank, or expert on rank only. */
void tmodel_whole(struct tmodel *m, const char *name, enum sp_dtype dtype,
                  enum plan_placement placement, uint32_t ndim,
                  const int64_t *global, uint32_t rank);
/* affine: a (rows, world * cols) tensor, rank r holding columns
 * [r * cols, (r + 1) * cols) as one piece. */
void tmodel_columns(struct tmodel *m, const char *name, enum sp_dtype dtype,
                    int64_t rows, int64_t cols);
/* affine: the ranks in mask hold the whole (rows, cols) tensor as one
 * replicated piece; the others hold an empty shard. */
void tmodel_replica(struct tmodel *m, const char *name, enum sp_dtype dtype,
                    int64_t rows, int64_t cols, uint32_t mask);
/* name registered on every rank with leader's storage and view. */
void tmodel_tie(struct tmodel *m, const char *name, const char *leader);
/* The byte offset of rank r's registration of name in its storage. */
uint64_t tmodel_offset(const struct tmodel *m, uint32_t r, const char *name);
/* Checks every key of plan as published: assembled ones in their owner's
 * segment at layout's offsets, identity ones in the owner's own storage. */
void tmodel_check(const struct tmodel *m, const struct plan *plan,
                  const struct publish_layout *layout, uint8_t *const *seg);

#endif
