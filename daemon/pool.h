/*
 * pool.h - the host memory pool: memfd segments that owned tensors are
 * assembled in and published from.
 *
 * A segment is one memfd, sealed against shrinking and growing before any
 * trainer sees it (a trainer that could truncate it would make the daemon
 * fault while assembling), mapped read-write in the daemon and published as
 * (segment fd, offset) per tensor.  Used only from the daemon's loop
 * thread.
 *
 * The pool is warm: a segment released by its rank is kept for that same
 * job member (job and rank) and handed back to it, and to nobody else, by
 * its next export that fits in it (pool_segment_new with that owner): no
 * new memfd and no fresh pages, whose first touch costs more than the copy
 * into them.  Its bytes are then the owner's earlier tensors: the engine
 * overwrites every tensor and zeroes only the bytes between and after them
 * (engine.h, dst_warm).  A trainer that kept a mapping of it past its
 * release sees its own next tensors appear in it, never another rank's or
 * job's: segments are never handed to another owner.  Kept segments are
 * counted in pool_used (and pool_kept, which status calls pool_warm), and
 * freed when the owner leaves or its job ends (pool_owner_gone), or
 * earlier when another allocation needs the room.
 *
 * On the CUDA backend a segment is device memory on the owner's GPU
 * instead (daemon/cuda/gpu.h, gpu_segment_new): its own allocation,
 * published as one IPC handle, kept and handed back the same way (the
 * same IPC handle, no new cudaMalloc), and freed early when another
 * allocation on its GPU needs the room.  Device bytes (in use and kept)
 * are counted in pool_used and bounded per GPU by the device capacity
 * (gpu_pool_capacity), not by the pool's capacity, which is host memory.
 *
 * A host segment's pages outlive the daemon's own use of it while a trainer
 * still holds what it was given (a descriptor, a mapping, or a copy of the
 * descriptor it passed on), and the daemon wrote them, so they are charged
 * to it.  So each segment the daemon shares is watched with inotify, and
 * when the daemon lets it go (its owner gone, or evicted, or an owner-less
 * segment released) it closes its own descriptor and mapping: the kernel
 * reports the end of the memfd's file when the last descriptor and mapping
 * of it are gone, in any process.  Such a segment stays counted in
 * pool_used (and pool_held) until then.
 *
 * A device segment its rank never released (the rank left or its
 * connection closed while it held the export, which sp_close allows) may
 * still be open in the rank's process: freeing IPC memory another process
 * has open is undefined, and the driver keeps it taken until that process
 * closes it (docs/fakes.md).  Such a segment is freed only once the rank's
 * process is gone, which its pidfd (taken when it joined) says, and stays
 * counted in pool_used and pool_held until then.  Where the kernel gives
 * no pidfd, a descriptor of the process's /proc directory stands in; it
 * cannot be polled, so it is looked at whenever the pool collects.  A released one was
 * closed by its rank before the release was sent (client/export.c), so
 * it is kept or freed at once.
 */
#ifndef SP_DAEMON_POOL_H
#define SP_DAEMON_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "daemon/layer.h"

struct gpu;
struct gpu_segment;
struct pool;

/* GPUs whose device memory the pool counts (GPU_MAX_DEVICES). */
#define POOL_MAX_DEVICES 64

struct pool_segment {
  int fd;        /* the memfd; -1 for a device segment */
  uint8_t *base; /* the daemon's mapping, or the device address */
  uint64_t size;
  struct gpu *gpu;         /* a device segment's backend, else NULL */
  struct gpu_segment *dev; /* a device segment, else NULL */
  int device;              /* a device segment's local ordinal */
  const void *owner;       /* its owner (a job member), or NULL */
  struct pool_segment *next; /* kept segments */
  /* Handed back from the kept segments: its bytes are its owner's earlier
   * tensors, and its pages are present. */
  bool warm;
  /* A shared host segment: its inotify watch (-1 when none), the next
   * watched one, and whether the daemon let it go and only waits for its
   * file's end (fd is -1 then). */
  int wd;
  struct pool_segment *watch_next;
  bool released;
  /* A device segment its rank never released: the rank process's pidfd,
   * which turns readable when it ends, or its /proc directory (-1
   * otherwise), and the next such segment. */
  int pidfd;
  bool pid_dir;
  struct pool_segment *abandoned_next;
};

/* capacity 0 means half of the machine's physical memory; gpu_capacity
 * is the device bytes per GPU, 0 meaning as much as the GPU has. */
int pool_create(uint64_t capacity, uint64_t gpu_capacity, struct pool **out);
/* Every segment must have been freed. */
void pool_destroy(struct pool *pool);
/* From now until pool_destroy, a large host segment's memory is given
 * back on loop's workers: the last unmap or close of a memfd frees its
 * pages there and then, a quarter of a second or more per GiB, which must
 * not hold the loop. */
void pool_free_on_workers(struct pool *pool, uv_loop_t *loop);

/* Whether new host segments ask for transparent huge pages (madvise
 * MADV_HUGEPAGE; the kernel grants them where shmem_enabled allows). */
void pool_use_huge_pages(struct pool *pool, bool on);

/* A host segment of at least size bytes for owner: the smallest one this
 * owner released earlier that fits (warm set), else a new zero-filled one
 * of size bytes, kept segments of any owner freed first when the capacity
 * has no room for it.  SP_EPOOL beyond the capacity.  A NULL owner gets a
 * new segment that is freed, never kept, at its release. */
int pool_segment_new(struct pool *pool, uint64_t size, const void *owner,
                     struct pool_segment **out);
/* A segment of at least size bytes on local GPU device for owner: one
 * this owner released earlier on that GPU when one is large enough (warm
 * set: its bytes are this owner's earlier tensors; the engine zeroes it
 * before assembling), else a new one.  SP_EPOOL beyond the device capacity or
 * when the GPU has no room (after freeing kept segments of that GPU), with
 * a sentence in msg. */
int pool_segment_new_device(struct pool *pool, struct gpu *gpu, int device,
                            uint64_t size, const void *owner,
                            struct pool_segment **out, char *msg,
                            size_t msglen);
/* Frees a segment that will not be kept: a host segment that was shared
 * is let go and counted on while its rank still maps it (a warm one, or
 * one whose export failed after its reply began).  NULL is allowed. */
void pool_segment_free(struct pool *pool, struct pool_segment *segment);
/* Returns a released segment: one with an owner is kept for its owner's
 * next export; another is freed, or, once shared, counted on until its
 * file ends (no descriptor or mapping of it is left anywhere).  NULL is
 * allowed. */
void pool_segment_put(struct pool *pool, struct pool_segment *segment);
/* A published segment its rank never released: a host one is put (its
 * file says when the rank let go); a device one waits, counted, until the
 * rank's process, whose pidfd or /proc directory is given (the pool takes
 * its own duplicate), has ended.  Without one (-1) it is freed at once.
 * NULL is allowed. */
void pool_segment_abandon(struct pool *pool, struct pool_segment *segment,
                          int pidfd);
/* A new open file description of a host segment for its rank (read-write,
 * close-on-exec), the segment watched until its file ends: a descriptor,
 * or SP_EBACKEND with a sentence in msg. */
int pool_segment_share(struct pool *pool, struct pool_segment *segment,
                       char *msg, size_t msglen);
/* The descriptor the loop polls (-1 when the kernel gave none): readable
 * when a shared host segment's file ended (inotify) or the process of an
 * abandoned device segment's rank did; and what reads them: segments
 * whose holders are gone are freed. */
int pool_watch_fd(const struct pool *pool);
void pool_collect(struct pool *pool);
/* Bytes of released host segments and abandoned device segments their
 * ranks still hold. */
uint64_t pool_held(const struct pool *pool);
/* Lets go of every segment kept for owner (it left, or its job ended):
 * freed, or counted on while its rank still maps it. */
void pool_owner_gone(struct pool *pool, const void *owner);
/* Segments kept for reuse (host and device), their bytes, and device
 * bytes per GPU (for status and tests). */
size_t pool_kept_count(const struct pool *pool);
uint64_t pool_kept(const struct pool *pool);
uint64_t pool_device_used(const struct pool *pool, int device);
uint64_t pool_gpu_capacity(const struct pool *pool);

/* Bytes in use on the host and every GPU together; on the host alone (the
 * bytes pool_capacity bounds). */
uint64_t pool_used(const struct pool *pool);
uint64_t pool_host_used(const struct pool *pool);
uint64_t pool_capacity(const struct pool *pool);

#endif /* SP_DAEMON_POOL_H */
