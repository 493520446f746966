/*
 * consumer_buffer.c - a consumer's memfd storages mapped writable, after
 * the checks of consumer_buffer.h.  Each buffer has a mapping of its own
 * pages: consumers register few, large buffers, so sharing pages between
 * them (as regmap.c does for a trainer's many storages) would buy little.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/consumer_buffer.h"
#include "daemon/regoverlap.h"
#include "proto/fail.h"
#include "shardport.h"

void consumer_files_free(struct consumer_files *files) {
  free(files->files);
  *files = (struct consumer_files){0};
}

/* The file's memory id, adding it to the table when new: 0 for want of
 * memory. */
static uint64_t file_id(struct consumer_files *files, const struct stat *st) {
  for (size_t i = 0; i < files->nfiles; i++)
    if (files->files[i].dev == st->st_dev && files->files[i].ino == st->st_ino)
      return i + 1;
  if (files->nfiles == files->cap) {
    size_t cap = files->cap > 0 ? 2 * files->cap : 8;
    struct reg_file *grown = realloc(files->files, cap * sizeof *grown);
    if (grown == NULL)
      return 0;
    files->files = grown;
    files->cap = cap;
  }
  files->files[files->nfiles++] = (struct reg_file){st->st_dev, st->st_ino};
  return files->nfiles;
}

/* Refuses a buffer in a trainer's registered bytes. */
static int check_trainers(const struct req_storage *rs, size_t i,
                          const struct stat *st,
                          const struct consumer_trainer *trainers,
                          size_t ntrainers, char *msg, size_t msglen) {
  for (size_t t = 0; t < ntrainers; t++) {
    uint32_t sid = regoverlap_sid(trainers[t].reg, st->st_dev, st->st_ino,
                                  rs->offset, rs->length);
    if (sid != 0)
      return sp__failf(msg, msglen, SP_EPERM,
                       "storages[%zu] (sid %u) shares bytes with rank %u's "
                       "storage sid %u: a trainer's memory is never written",
                       i, rs->sid, trainers[t].rank, sid);
  }
  return 0;
}

static int map_one(const struct req_storage *rs, size_t i, int fd,
                   const struct consumer_trainer *trainers, size_t ntrainers,
                   struct consumer_files *files, struct consumer_buffer *b,
                   char *msg, size_t msglen) {
  struct stat st;
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);

  *b = (struct consumer_buffer){
      .sid = rs->sid,
      .s = {.device = {.type = SP_DEVICE_CPU}, .nbytes = rs->length}};
  if (rs->kind != REQ_STORAGE_MEMFD)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "storages[%zu] (sid %u): a consumer's buffers are memfd "
                     "storages on the host backend",
                     i, rs->sid);
  if (fstat(fd, &st) != 0)
    return sp__failf(msg, msglen, SP_EBADFD,
                     "storages[%zu] (sid %u): fstat: %s", i, rs->sid,
                     strerror(errno));
  if (!S_ISREG(st.st_mode))
    return sp__failf(msg, msglen, SP_EBADFD,
                     "storages[%zu] (sid %u): the descriptor is not a memfd "
                     "or shm file",
                     i, rs->sid);
  if (rs->offset > UINT64_MAX - rs->length ||
      (uint64_t)st.st_size < rs->offset + rs->length)
    return sp__failf(msg, msglen, SP_EBADFD,
                     "storages[%zu] (sid %u): the file has %lld bytes, fewer "
                     "than offset + length",
                     i, rs->sid, (long long)st.st_size);
  int rc = check_trainers(rs, i, &st, trainers, ntrainers, msg, msglen);
  if (rc != 0)
    return rc;
  b->s.memory = file_id(files, &st);
  b->s.memory_offset = rs->offset;
  if (b->s.memory == 0)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  if (rs->length == 0)
    return 0;
  uint64_t lo = rs->offset / page * page;
  uint64_t hi = (rs->offset + rs->length + page - 1) / page * page;
  if (hi - lo > SIZE_MAX)
    return sp__failf(msg, msglen, SP_EBADFD,
                     "storages[%zu] (sid %u): too many bytes to map", i,
                     rs->sid);
  void *p = mmap(NULL, (size_t)(hi - lo), PROT_READ | PROT_WRITE, MAP_SHARED,
                 fd, (off_t)lo);
  if (p == MAP_FAILED) {
    int err = errno;
    return sp__failf(msg, msglen, err == ENOMEM ? SP_ENOMEM : SP_EBADFD,
                     "storages[%zu] (sid %u): cannot map it writable (is "
                     "the descriptor read-only or the memfd sealed?): %s",
                     i, rs->sid, strerror(err));
  }
  b->map = p;
  b->map_len = (size_t)(hi - lo);
  b->data = (uint8_t *)p + (rs->offset - lo);
  return 0;
}

int consumer_buffers_map(const struct req_storage *s, size_t n,
                         const struct sp_frame *frame,
                         const struct consumer_trainer *trainers,
                         size_t ntrainers, struct consumer_files *files,
                         struct consumer_buffer *out, char *msg,
                         size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    int fd = s[i].kind == REQ_STORAGE_MEMFD && s[i].fd < frame->nfds
                 ? frame->fds[s[i].fd]
                 : -1;
    int rc =
        map_one(&s[i], i, fd, trainers, ntrainers, files, &out[i], msg, msglen);
    if (rc != 0) {
      consumer_buffers_unmap(out, i);
      return rc;
    }
  }
  return 0;
}

void consumer_buffers_unmap(struct consumer_buffer *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (b[i].map != NULL)
      munmap(b[i].map, b[i].map_len);
    b[i].map = NULL;
    b[i].data = NULL;
  }
}
