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
 *
 * On the CUDA backend a segment is device memory on the owner's GPU
 * instead (daemon/cuda/gpu.h, gpu_segment_new): its own allocation,
 * published as one IPC handle, never reused either.  Device bytes are
 * counted in pool_used but bounded by the GPU's memory, not by the pool's
 * capacity, which is host memory.
 */
#ifndef SP_DAEMON_POOL_H
#define SP_DAEMON_POOL_H

#include <stddef.h>
#include <stdint.h>

struct gpu;
struct gpu_segment;
struct pool;

struct pool_segment {
  int fd;        /* the memfd; -1 for a device segment */
  uint8_t *base; /* the daemon's mapping, or the device address */
  uint64_t size;
  struct gpu *gpu;         /* a device segment's backend, else NULL */
  struct gpu_segment *dev; /* a device segment, else NULL */
};

/* capacity 0 means half of the machine's physical memory. */
int pool_create(uint64_t capacity, struct pool **out);
/* Every segment must have been freed. */
void pool_destroy(struct pool *pool);

/* A zero-filled segment of size bytes; SP_EPOOL beyond the capacity. */
int pool_segment_new(struct pool *pool, uint64_t size,
                     struct pool_segment **out);
/* A segment of size bytes on local GPU device: SP_EPOOL when the GPU has
 * no room, with a sentence in msg. */
int pool_segment_new_device(struct pool *pool, struct gpu *gpu, int device,
                            uint64_t size, struct pool_segment **out,
                            char *msg, size_t msglen);
void pool_segment_free(struct pool *pool, struct pool_segment *segment);

uint64_t pool_used(const struct pool *pool);
uint64_t pool_capacity(const struct pool *pool);

#endif /* SP_DAEMON_POOL_H */
