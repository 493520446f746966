/*
 * tcons.h - consumer inputs for the consumer planner's tests
 * (daemon/plan/consume.h), host buffers for both sides, and the oracle:
 * the bytes each consumer must hold, written element by element from the
 * unsharded tensors and the targets alone, and a plain engine that carries
 * a plan's moves, so every delivered byte is compared with the original.
 */
#ifndef SP_TESTS_UNIT_PLAN_TCONS_H
#define SP_TESTS_UNIT_PLAN_TCONS_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/consume.h"
#include "tests/unit/plan/tjob.h"

/* Bytes every consumer buffer holds before a push: a byte no target
 * covers must still hold it after. */
#define TCONS_UNTOUCHED 0xa5

struct tcons;

struct tcons *tcons_new(uint32_t nconsumers);
void tcons_free(struct tcons *cons);

void tcons_node(struct tcons *cons, uint32_t consumer, uint64_t node);

/* A storage of nbytes on consumer's device type, in a memory object of its
 * own; tcons_storage_in places it memory_offset bytes into `memory`, which
 * other storages may share. */
uint32_t tcons_storage(struct tcons *cons, uint32_t consumer, uint64_t nbytes);
uint32_t tcons_storage_in(struct tcons *cons, uint32_t consumer,
                          uint64_t memory, uint64_t memory_offset,
                          uint64_t nbytes);
struct consume_storage *tcons_storage_at(struct tcons *cons, uint32_t consumer,
                                         uint32_t storage);

/* Targets, each in a storage of its own, contiguous: the whole tensor, or
 * `rows` of dim `dim`.  The returned target is valid until the next one is
 * added to the consumer. */
struct consume_target *tcons_whole(struct tcons *cons, uint32_t consumer,
                                   const char *key, enum sp_dtype dtype,
                                   uint32_t ndim, const int64_t *shape);
struct consume_target *tcons_shard(struct tcons *cons, uint32_t consumer,
                                   const char *key, enum sp_dtype dtype,
                                   uint32_t ndim, const int64_t *shape,
                                   uint32_t dim, int64_t rows);
/* Pieces (copied) into storages the caller made. */
struct consume_target *tcons_pieces(struct tcons *cons, uint32_t consumer,
                                    const char *key, enum sp_dtype dtype,
                                    uint32_t ndim, const int64_t *shape,
                                    size_t npieces,
                                    const struct consume_piece *pieces);

/* The consumers, and how many targets consumer has. */
uint32_t tcons_count(const struct tcons *cons);
size_t tcons_target_count(const struct tcons *cons, uint32_t consumer);
/* Consumer's i-th target, valid until the next one is added to it. */
struct consume_target *tcons_target(struct tcons *cons, uint32_t consumer,
                                    size_t i);

/* The input over the trainers' (tjob_input's); seed non-zero shuffles the
 * consumers and each one's targets. */
const struct consume_input *tcons_input(struct tcons *cons,
                                        const struct plan_input *trainers,
                                        uint64_t seed);

/* Host data for a job: one buffer per trainer storage, filled from the
 * unsharded tensor of every key, whose bytes are drawn from `values`. */
struct tdata;

struct tdata *tdata_new(const struct plan_input *trainers, uint64_t values);
void tdata_free(struct tdata *data);

/* Carries every move of every round of plan into the consumers' buffers,
 * which it first fills with TCONS_UNTOUCHED. */
void tcons_push(struct tcons *cons, const struct tdata *data,
                const struct consume_plan *plan);

/* Compares every consumer buffer with what the oracle says it must hold:
 * each target's elements from the unsharded tensors, every other byte
 * TCONS_UNTOUCHED.  Returns the bytes that differ (0: all right) and
 * describes the first in msg. */
uint64_t tcons_compare(struct tcons *cons, const struct tdata *data, char *msg,
                       size_t msglen);

#endif /* SP_TESTS_UNIT_PLAN_TCONS_H */
