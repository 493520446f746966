/*
 * pool.c - memfd segments for assembled tensors; see pool.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shardport.h"
#include "daemon/cuda/gpu.h"
#include "daemon/pool.h"

struct pool {
  uint64_t capacity;
  uint64_t used;        /* host segments */
  uint64_t device_used; /* device segments */
};

int pool_create(uint64_t capacity, struct pool **out) {
  struct pool *pool = calloc(1, sizeof *pool);
  if (!pool)
    return SP_ENOMEM;
  if (capacity == 0) {
    long pages = sysconf(_SC_PHYS_PAGES);
    long page_size = sysconf(_SC_PAGESIZE);
    capacity = pages > 0 && page_size > 0
                   ? (uint64_t)pages * (uint64_t)page_size / 2
                   : UINT64_MAX;
  }
  pool->capacity = capacity;
  *out = pool;
  return 0;
}

void pool_destroy(struct pool *pool) { free(pool); }

int pool_segment_new(struct pool *pool, uint64_t size,
                     struct pool_segment **out) {
  if (size > pool->capacity - pool->used)
    return SP_EPOOL;
  struct pool_segment *seg = calloc(1, sizeof *seg);
  if (!seg)
    return SP_ENOMEM;
  seg->fd = memfd_create("shardport-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (seg->fd < 0)
    goto fail;
  if (ftruncate(seg->fd, (off_t)size) != 0 ||
      fcntl(seg->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    goto fail;
  if (size > 0) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, seg->fd, 0);
    if (p == MAP_FAILED)
      goto fail;
    seg->base = p;
  }
  seg->size = size;
  pool->used += size;
  *out = seg;
  return 0;

fail:;
  int rc = errno == ENOMEM || errno == ENOSPC ? SP_EPOOL : SP_EBACKEND;
  if (seg->fd >= 0)
    close(seg->fd);
  free(seg);
  return rc;
}

int pool_segment_new_device(struct pool *pool, struct gpu *gpu, int device,
                            uint64_t size, struct pool_segment **out,
                            char *msg, size_t msglen) {
  struct pool_segment *seg = calloc(1, sizeof *seg);
  if (!seg)
    return SP_ENOMEM;
  int rc = gpu_segment_new(gpu, device, size, &seg->dev, msg, msglen);
  if (rc != 0) {
    free(seg);
    return rc;
  }
  const struct gpu_segment_info *info = gpu_segment_info(seg->dev);
  seg->fd = -1;
  seg->base = info->ptr;
  seg->size = info->size;
  seg->gpu = gpu;
  pool->device_used += seg->size;
  *out = seg;
  return 0;
}

void pool_segment_free(struct pool *pool, struct pool_segment *segment) {
  if (!segment)
    return;
  if (segment->dev) {
    gpu_segment_free(segment->gpu, segment->dev);
    pool->device_used -= segment->size;
    free(segment);
    return;
  }
  if (segment->base)
    munmap(segment->base, segment->size);
  close(segment->fd);
  pool->used -= segment->size;
  free(segment);
}

uint64_t pool_used(const struct pool *pool) {
  return pool->used + pool->device_used;
}

uint64_t pool_capacity(const struct pool *pool) { return pool->capacity; }
