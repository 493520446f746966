/*
 * tjob.h - builds planner inputs for the tests: one storage per key per
 * rank (at a distinct base address), contiguous views, byte counts that
 * agree, so each test spoils exactly the one thing it is about.
 */
#ifndef SP_TESTS_UNIT_PLAN_TJOB_H
#define SP_TESTS_UNIT_PLAN_TJOB_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/plan.h"

struct tjob;

struct tjob *tjob_new(uint32_t world);
void tjob_free(struct tjob *job);

/* A name the job owns, for generated keys. */
const char *tjob_name(struct tjob *job, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

void tjob_node(struct tjob *job, uint32_t rank, uint64_t node);

/* shard0: rows[r] rows of shape on rank r. */
void tjob_shard0(struct tjob *job, const char *name, enum sp_dtype dtype,
                 uint32_t ndim, const int64_t *shape, const int64_t *rows);
/* replicated or plain: the whole shape on every rank. */
void tjob_whole(struct tjob *job, const char *name,
                enum plan_placement placement, enum sp_dtype dtype,
                uint32_t ndim, const int64_t *shape);
void tjob_expert(struct tjob *job, uint32_t rank, const char *name,
                 enum sp_dtype dtype, uint32_t ndim, const int64_t *shape);
/* affine: rank r's shard holds numel[r] elements and pieces[r] (borrowed,
 * npieces[r] of them). */
void tjob_affine(struct tjob *job, const char *name, enum sp_dtype dtype,
                 uint32_t ndim, const int64_t *shape, const uint64_t *numel,
                 const struct affine_piece *const *pieces,
                 const size_t *npieces);
/* On every rank, name becomes a second registration of existing's storage
 * and view: tied weights. */
void tjob_tie(struct tjob *job, const char *name, const char *existing);
/* Adds a together-group to one rank, or to all when rank is PLAN_NONE. */
void tjob_group(struct tjob *job, uint32_t rank, size_t n,
                const char *const *names);

/* Rank's registration of name (valid until the next key is added), and
 * its storage. */
struct plan_key_in *tjob_key(struct tjob *job, uint32_t rank, const char *name);
struct sp_storage *tjob_storage(struct tjob *job, uint32_t rank,
                                const char *name);
/* Lists name once more on rank (a duplicate registration). */
void tjob_duplicate(struct tjob *job, uint32_t rank, const char *name);
/* Drops rank's registration of name. */
void tjob_drop(struct tjob *job, uint32_t rank, const char *name);

/* The input with ranks listed from `first` on (as a daemon that lists its
 * own rank first would); `seed` non-zero also shuffles every rank's keys.
 * The ranks' full forms are read into the compact input
 * (plan_input_add_rank) as the daemon reads its registries; every input
 * built stays valid until tjob_free, for the plans that borrow it.
 * max_keys and max_bytes come from tjob_limits, threads from
 * tjob_threads. */
const struct plan_input *tjob_input(struct tjob *job, uint32_t first,
                                    uint64_t seed);
void tjob_limits(struct tjob *job, uint32_t max_keys, uint64_t max_bytes);
/* The input's planning threads (plan_input.threads); 0 at first. */
void tjob_threads(struct tjob *job, uint32_t threads);
/* Direct access for tests that corrupt the rank table itself: the last
 * input's. */
struct plan_rank_in *tjob_ranks(struct tjob *job);

/* A small deterministic generator (splitmix64). */
uint64_t tjob_rand(uint64_t *state);

#endif /* SP_TESTS_UNIT_PLAN_TJOB_H */
