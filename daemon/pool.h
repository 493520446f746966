/*
 * pool.h - the host memory pool: memfd segments that owned tensors are
 * assembled in and published from.
 *
 * A segment is one memfd, sealed against shrinking and growing before any
 * trainer sees it (a trainer that could truncate it would make the daemon
 * fault while assembling), mapped read-write in the daemon and published as
 * (segment fd, offset) per tensor.  Segments are never reused for another
 * rank: a trainer that kept a mapping after release must not see anyone
 * else's tensors.  Used only from the daemon's loop thread.
 */
#ifndef SP_DAEMON_POOL_H
#define SP_DAEMON_POOL_H

#include <stdint.h>

struct pool;

struct pool_segment {
  int fd;
  uint8_t *base;
  uint64_t size;
};

/* capacity 0 means half of the machine's physical memory. */
int pool_create(uint64_t capacity, struct pool **out);
/* Every segment must have been freed. */
void pool_destroy(struct pool *pool);

/* A zero-filled segment of size bytes; SP_EPOOL beyond the capacity. */
int pool_segment_new(struct pool *pool, uint64_t size,
                     struct pool_segment **out);
void pool_segment_free(struct pool *pool, struct pool_segment *segment);

uint64_t pool_used(const struct pool *pool);
uint64_t pool_capacity(const struct pool *pool);

#endif /* SP_DAEMON_POOL_H */
