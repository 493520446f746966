/*
 * pool.c - memfd segments for assembled tensors; see pool.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/log.h"
#include "shardport.h"
#include "daemon/cuda/gpu.h"
#include "daemon/pool.h"

struct pool {
  uint64_t capacity;
  uint64_t used;        /* host segments */
  uint64_t device_used; /* device segments, in use and kept */
  uint64_t gpu_capacity; /* per GPU; 0: as much as the GPU has */
  uint64_t per_device[POOL_MAX_DEVICES];
  /* Released segments, device and host, each kept for its owner only;
   * and the bytes of the host ones (counted in used too). */
  struct pool_segment *kept;
  size_t nkept;
  uint64_t kept_host;
  /* Whether host segments ask the kernel for transparent huge pages. */
  bool huge_pages;
  /* Host segments shared with their ranks, watched for the close of the
   * rank's description; and the bytes of those released meanwhile. */
  int watch_fd;
  struct pool_segment *watched;
  uint64_t held;
  /* Device segments waiting for their ranks' processes to end, and one
   * descriptor that is readable when that or the inotify one is (what
   * the loop polls). */
  struct pool_segment *abandoned;
  int poll_fd;
  /* Where large segments' memory is given back; NULL: on the caller. */
  uv_loop_t *loop;
};

static void segment_free(struct pool *pool, struct pool_segment *segment,
                         bool now);

/* The smallest segment whose memory a worker gives back. */
#define POOL_FREE_ON_WORKER_BYTES (16u << 20)

struct pool_give_back {
  uv_work_t work;
  void *base;
  size_t size;
  int fd;
};

static void unmap_and_close(void *base, size_t size, int fd) {
  if (base != NULL)
    munmap(base, size);
  if (fd >= 0)
    close(fd);
}

static void give_back_work(uv_work_t *work) {
  struct pool_give_back *g = work->data;
  unmap_and_close(g->base, g->size, g->fd);
}

static void give_back_done(uv_work_t *work, int status) {
  (void)status;
  free(work->data);
}

/* The daemon's mapping and descriptor of a host segment, let go: on a
 * worker when the segment is large, a loop has been given, and the caller
 * does not need the room back before it returns (now). */
static void give_back(struct pool *pool, void *base, size_t size, int fd,
                      bool now) {
  struct pool_give_back *g =
      !now && pool->loop != NULL && size >= POOL_FREE_ON_WORKER_BYTES
          ? malloc(sizeof *g)
          : NULL;
  if (g != NULL) {
    *g = (struct pool_give_back){.base = base, .size = size, .fd = fd};
    g->work.data = g;
    if (uv_queue_work(pool->loop, &g->work, give_back_work, give_back_done) ==
        0)
      return;
    free(g);
  }
  unmap_and_close(base, size, fd);
}

void pool_free_on_workers(struct pool *pool, uv_loop_t *loop) {
  pool->loop = loop;
}

void pool_use_huge_pages(struct pool *pool, bool on) { pool->huge_pages = on; }

int pool_create(uint64_t capacity, uint64_t gpu_capacity, struct pool **out) {
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
  pool->gpu_capacity = gpu_capacity;
  pool->watch_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (pool->watch_fd < 0)
    log_msg(LOG_LEVEL_WARN, "inotify: %s; a released segment is counted "
            "only until its release, however long its rank holds it",
            strerror(errno));
  pool->poll_fd = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event ev = {.events = EPOLLIN};
  if (pool->poll_fd >= 0 && pool->watch_fd >= 0 &&
      epoll_ctl(pool->poll_fd, EPOLL_CTL_ADD, pool->watch_fd, &ev) != 0) {
    close(pool->poll_fd);
    pool->poll_fd = -1;
  }
  *out = pool;
  return 0;
}

void pool_destroy(struct pool *pool) {
  if (pool == NULL)
    return;
  /* The loop has stopped: what is left is given back here. */
  pool->loop = NULL;
  while (pool->kept != NULL) {
    struct pool_segment *seg = pool->kept;
    pool->kept = seg->next;
    pool->nkept--;
    segment_free(pool, seg, true);
  }
  /* Released segments still held: the daemon stops counting them; the
   * device memory of abandoned ones goes with the daemon's process. */
  while (pool->watched != NULL)
    segment_free(pool, pool->watched, true);
  while (pool->abandoned != NULL) {
    struct pool_segment *seg = pool->abandoned;
    pool->abandoned = seg->abandoned_next;
    close(seg->pidfd);
    pool->held -= seg->size;
    segment_free(pool, seg, true);
  }
  if (pool->watch_fd >= 0)
    close(pool->watch_fd);
  if (pool->poll_fd >= 0)
    close(pool->poll_fd);
  free(pool);
}

/* Takes a host segment off the watched list. */
static void unwatch(struct pool *pool, struct pool_segment *seg) {
  for (struct pool_segment **p = &pool->watched; *p != NULL;
       p = &(*p)->watch_next)
    if (*p == seg) {
      *p = seg->watch_next;
      seg->watch_next = NULL;
      return;
    }
}

/* Takes a kept segment out of the list. */
static void unkeep(struct pool *pool, struct pool_segment *seg) {
  for (struct pool_segment **p = &pool->kept; *p != NULL; p = &(*p)->next)
    if (*p == seg) {
      *p = seg->next;
      seg->next = NULL;
      pool->nkept--;
      return;
    }
}

/* The smallest segment kept for owner that holds size bytes, on the host
 * (device < 0) or on that GPU: only ever the bytes of its own earlier
 * tensors. */
static struct pool_segment *own_kept(const struct pool *pool,
                                     const void *owner, int device,
                                     uint64_t size) {
  struct pool_segment *best = NULL;
  for (struct pool_segment *seg = pool->kept; seg != NULL; seg = seg->next)
    if (seg->owner == owner && (seg->dev != NULL) == (device >= 0) &&
        (device < 0 || seg->device == device) && seg->size >= size &&
        (best == NULL || seg->size < best->size))
      best = seg;
  return best;
}

/* Frees a segment; a host one's pages are given back before this returns
 * when now is set, else (large ones) on a worker. */
static void segment_free(struct pool *pool, struct pool_segment *segment,
                         bool now) {
  if (segment->dev) {
    gpu_segment_free(segment->gpu, segment->dev);
    pool->device_used -= segment->size;
    pool->per_device[segment->device] -= segment->size;
    free(segment);
    return;
  }
  if (segment->wd >= 0) {
    unwatch(pool, segment);
    inotify_rm_watch(pool->watch_fd, segment->wd);
  }
  if (segment->released)
    pool->held -= segment->size;
  give_back(pool, segment->base, segment->size, segment->fd, now);
  pool->used -= segment->size;
  free(segment);
}

/* A host segment the daemon is done with: freed, or once shared, its own
 * mapping and descriptor let go and its bytes counted (pool_held) until
 * the kernel says its file is gone (no descriptor or mapping of it is left
 * anywhere; if the rank closed it already, that is with these,
 * pool_collect). */
static void let_go(struct pool *pool, struct pool_segment *segment, bool now) {
  if (segment->wd < 0) {
    segment_free(pool, segment, now);
    return;
  }
  give_back(pool, segment->base, segment->size, segment->fd, now);
  segment->base = NULL;
  segment->fd = -1;
  segment->released = true;
  pool->held += segment->size;
}

/* Kept host segments make room for size more bytes under the capacity.
 * Their pages are given back before this returns, since the allocation
 * needs the room now; a segment its rank still maps stays counted. */
static void evict_host(struct pool *pool, uint64_t size) {
  struct pool_segment **p = &pool->kept;
  while (*p != NULL && size > pool->capacity - pool->used) {
    struct pool_segment *seg = *p;
    if (seg->dev != NULL) {
      p = &seg->next;
      continue;
    }
    *p = seg->next;
    seg->next = NULL;
    pool->nkept--;
    let_go(pool, seg, true);
    pool_collect(pool);
  }
}

int pool_segment_new(struct pool *pool, uint64_t size, const void *owner,
                     struct pool_segment **out) {
  /* Segments whose holders have gone make room first. */
  pool_collect(pool);
  struct pool_segment *kept =
      owner != NULL ? own_kept(pool, owner, -1, size) : NULL;
  if (kept != NULL) {
    unkeep(pool, kept);
    kept->warm = true;
    *out = kept;
    return 0;
  }
  if (size > pool->capacity - pool->used)
    evict_host(pool, size);
  if (size > pool->capacity - pool->used)
    return SP_EPOOL;
  struct pool_segment *seg = calloc(1, sizeof *seg);
  if (!seg)
    return SP_ENOMEM;
  seg->wd = -1;
  seg->pidfd = -1;
  seg->owner = owner;
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
    /* Best effort: the kernel backs shared memory with huge pages only
     * where its shmem_enabled setting allows (docs/operations.md). */
    if (pool->huge_pages)
      madvise(p, size, MADV_HUGEPAGE);
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

/* Frees kept segments on device (every one when all, else only until size
 * more bytes fit under the device capacity); whether any was freed. */
static bool evict(struct pool *pool, int device, uint64_t size, bool all) {
  bool freed = false;
  struct pool_segment **p = &pool->kept;
  while (*p != NULL) {
    struct pool_segment *seg = *p;
    if (!all && (pool->gpu_capacity == 0 ||
                 pool->per_device[device] + size <= pool->gpu_capacity))
      break;
    if (seg->dev == NULL || seg->device != device) {
      p = &seg->next;
      continue;
    }
    *p = seg->next;
    seg->next = NULL;
    pool->nkept--;
    pool_segment_free(pool, seg);
    freed = true;
  }
  return freed;
}

int pool_segment_new_device(struct pool *pool, struct gpu *gpu, int device,
                            uint64_t size, const void *owner,
                            struct pool_segment **out, char *msg,
                            size_t msglen) {
  if (device < 0 || device >= POOL_MAX_DEVICES) {
    snprintf(msg, msglen, "no GPU %d", device);
    return SP_EINVAL;
  }
  struct pool_segment *best = own_kept(pool, owner, device, size);
  if (best != NULL) {
    unkeep(pool, best);
    best->warm = true;
    *out = best;
    return 0;
  }
  if (size == 0)
    size = 1;
  if (pool->gpu_capacity != 0 &&
      pool->per_device[device] + size > pool->gpu_capacity) {
    evict(pool, device, size, false);
    if (pool->per_device[device] + size > pool->gpu_capacity) {
      snprintf(msg, msglen,
               "%s: %" PRIu64 " of its gpu_pool_capacity of %" PRIu64
               " bytes are in use, %" PRIu64 " more do not fit",
               gpu_device_name(gpu, device), pool->per_device[device],
               pool->gpu_capacity, size);
      return SP_EPOOL;
    }
  }
  struct pool_segment *seg = calloc(1, sizeof *seg);
  if (!seg) {
    snprintf(msg, msglen, "out of memory");
    return SP_ENOMEM;
  }
  int rc = gpu_segment_new(gpu, device, size, &seg->dev, msg, msglen);
  /* The GPU is full: what is kept on it for other exports goes first. */
  if (rc == SP_EPOOL && evict(pool, device, 0, true))
    rc = gpu_segment_new(gpu, device, size, &seg->dev, msg, msglen);
  if (rc != 0) {
    free(seg);
    return rc;
  }
  const struct gpu_segment_info *info = gpu_segment_info(seg->dev);
  seg->fd = -1;
  seg->wd = -1;
  seg->pidfd = -1;
  seg->base = info->ptr;
  seg->size = info->size;
  seg->gpu = gpu;
  seg->device = device;
  seg->owner = owner;
  pool->device_used += seg->size;
  pool->per_device[device] += seg->size;
  *out = seg;
  return 0;
}

void pool_segment_put(struct pool *pool, struct pool_segment *segment) {
  if (!segment)
    return;
  if (segment->owner != NULL) {
    segment->next = pool->kept;
    pool->kept = segment;
    pool->nkept++;
    return;
  }
  if (segment->dev) {
    pool_segment_free(pool, segment);
    return;
  }
  let_go(pool, segment, false);
}

void pool_segment_abandon(struct pool *pool, struct pool_segment *segment,
                          int pidfd) {
  if (!segment)
    return;
  if (!segment->dev) {
    pool_segment_put(pool, segment);
    return;
  }
  struct epoll_event ev = {.events = EPOLLIN};
  segment->pidfd = pidfd >= 0 ? fcntl(pidfd, F_DUPFD_CLOEXEC, 0) : -1;
  struct stat st;
  segment->pid_dir = segment->pidfd >= 0 && fstat(segment->pidfd, &st) == 0 &&
                     S_ISDIR(st.st_mode);
  if (segment->pidfd >= 0 && !segment->pid_dir &&
      (pool->poll_fd < 0 ||
       epoll_ctl(pool->poll_fd, EPOLL_CTL_ADD, segment->pidfd, &ev) != 0)) {
    close(segment->pidfd);
    segment->pidfd = -1;
  }
  if (segment->pidfd < 0) {
    pool_segment_free(pool, segment);
    return;
  }
  segment->owner = NULL;
  segment->abandoned_next = pool->abandoned;
  pool->abandoned = segment;
  pool->held += segment->size;
}

/* Whether an abandoned segment's rank process ended: its pidfd is
 * readable, or its /proc directory lost its entries. */
static bool holder_process_gone(const struct pool_segment *seg) {
  if (seg->pid_dir)
    return faccessat(seg->pidfd, "stat", F_OK, 0) != 0;
  struct pollfd pfd = {.fd = seg->pidfd, .events = POLLIN};
  return poll(&pfd, 1, 0) > 0;
}

/* Frees the abandoned device segments whose ranks' processes ended. */
static void collect_abandoned(struct pool *pool) {
  for (struct pool_segment **p = &pool->abandoned; *p != NULL;) {
    struct pool_segment *seg = *p;
    if (!holder_process_gone(seg)) {
      p = &seg->abandoned_next;
      continue;
    }
    *p = seg->abandoned_next;
    /* Closing the pidfd takes it out of the epoll set. */
    close(seg->pidfd);
    pool->held -= seg->size;
    segment_free(pool, seg, true);
  }
}

void pool_owner_gone(struct pool *pool, const void *owner) {
  struct pool_segment **p = &pool->kept;
  while (*p != NULL) {
    struct pool_segment *seg = *p;
    if (seg->owner != owner) {
      p = &seg->next;
      continue;
    }
    *p = seg->next;
    seg->next = NULL;
    pool->nkept--;
    if (seg->dev)
      pool_segment_free(pool, seg);
    else
      let_go(pool, seg, false);
  }
}

size_t pool_kept_count(const struct pool *pool) { return pool->nkept; }

uint64_t pool_kept(const struct pool *pool) {
  uint64_t bytes = 0;
  for (const struct pool_segment *seg = pool->kept; seg != NULL;
       seg = seg->next)
    bytes += seg->size;
  return bytes;
}

uint64_t pool_device_used(const struct pool *pool, int device) {
  return device >= 0 && device < POOL_MAX_DEVICES ? pool->per_device[device]
                                                 : 0;
}

uint64_t pool_gpu_capacity(const struct pool *pool) {
  return pool->gpu_capacity;
}

void pool_segment_free(struct pool *pool, struct pool_segment *segment) {
  if (segment == NULL)
    return;
  if (segment->dev == NULL && segment->wd >= 0 && !segment->released)
    let_go(pool, segment, false);
  else
    segment_free(pool, segment, false);
}

int pool_segment_share(struct pool *pool, struct pool_segment *segment,
                       char *msg, size_t msglen) {
  /* Opening the memfd again through /proc makes a description of the
   * rank's own, so that the daemon's, closed at release, is not one a
   * reply still being written holds. */
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", segment->fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    snprintf(msg, msglen, "cannot open the segment again through %s: %s",
             path, strerror(errno));
    return SP_EBACKEND;
  }
  if (pool->watch_fd < 0 || segment->wd >= 0)
    return fd;
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  /* Not the closes of the file (IN_CLOSE_*): they are reported for every
   * description of it, and a rank could open and close another (through
   * /proc) while it keeps its own.  A memfd has no name, so its file ends
   * (IN_DELETE_SELF, then IN_IGNORED) once the last descriptor and mapping
   * of it, in any process, are gone: inotify(7), and the kernel's
   * dentry_unlink_inode(), which reports a file without links at its
   * end. */
  segment->wd = inotify_add_watch(pool->watch_fd, path, IN_DELETE_SELF);
  if (segment->wd < 0) {
    snprintf(msg, msglen, "cannot watch the segment (inotify: %s)",
             strerror(errno));
    close(fd);
    return SP_EBACKEND;
  }
  segment->watch_next = pool->watched;
  pool->watched = segment;
  return fd;
}

int pool_watch_fd(const struct pool *pool) {
  return pool->poll_fd >= 0 ? pool->poll_fd : pool->watch_fd;
}

/* The segment's file is gone: only a released segment's can be, since
 * until its release the daemon holds it.  The kernel has removed the
 * watch. */
static void holder_gone(struct pool *pool, struct pool_segment *segment) {
  if (!segment->released)
    return;
  unwatch(pool, segment);
  segment->wd = -1;
  segment_free(pool, segment, false);
}

void pool_collect(struct pool *pool) {
  collect_abandoned(pool);
  if (pool->watch_fd < 0)
    return;
  _Alignas(struct inotify_event) char buf[4096];
  for (;;) {
    ssize_t n = read(pool->watch_fd, buf, sizeof buf);
    if (n <= 0)
      return;
    for (ssize_t off = 0; off < n;) {
      const struct inotify_event *ev = (const void *)(buf + off);
      off += (ssize_t)(sizeof *ev + ev->len);
      if (ev->mask & IN_Q_OVERFLOW) {
        /* Closes were lost: which holders are gone cannot be told, so the
         * released segments are no longer counted. */
        log_msg(LOG_LEVEL_WARN, "inotify queue overflow: released segments "
                "still held by ranks are no longer counted");
        for (struct pool_segment *seg = pool->watched, *next; seg != NULL;
             seg = next) {
          next = seg->watch_next;
          if (seg->released)
            segment_free(pool, seg, false);
        }
        continue;
      }
      for (struct pool_segment *seg = pool->watched; seg != NULL;
           seg = seg->watch_next)
        if (seg->wd == ev->wd) {
          holder_gone(pool, seg);
          break;
        }
    }
  }
}

uint64_t pool_held(const struct pool *pool) { return pool->held; }

uint64_t pool_used(const struct pool *pool) {
  return pool->used + pool->device_used;
}

uint64_t pool_host_used(const struct pool *pool) { return pool->used; }

uint64_t pool_capacity(const struct pool *pool) { return pool->capacity; }
