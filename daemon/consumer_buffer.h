/*
 * consumer_buffer.h - a consumer's host buffers: checked against their
 * files and the node's trainer registrations, then mapped writable
 * (consumer_buffer.c).
 *
 * A consumer grants the daemon write access to exactly its buffers.  Each
 * is a memfd (or shm file) storage as a trainer's is (docs/protocol.md,
 * "storage_add"), but mapped read-write, and refused when it shares a byte
 * with a host storage a trainer of the node registered: trainers' memory is
 * never written, and the planner, which sees storages and not files,
 * cannot tell.  Each buffer also names its memory object for the planner
 * (daemon/plan/consume.h, consume_storage.memory): buffers in one file get
 * one id from the node's table of files, so two consumers handed one memfd
 * are refused where their targets overlap.
 */
#ifndef SP_DAEMON_CONSUMER_BUFFER_H
#define SP_DAEMON_CONSUMER_BUFFER_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/plan/consume.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/frame.h"

/* The files a node's consumer buffers lie in; a file's memory id is its
 * index here plus one, kept as long as the table. */
struct consumer_files {
  struct reg_file *files;
  size_t nfiles, cap;
};

struct consumer_buffer {
  uint32_t sid;
  uint8_t *data; /* the buffer's first byte; NULL when empty */
  void *map;     /* whole pages of its file, writable */
  size_t map_len;
  struct consume_storage s; /* what the planner reads */
};

/* A trainer registry of the node, with its rank for refusals. */
struct consumer_trainer {
  uint32_t rank;
  const struct registry *reg;
};

void consumer_files_free(struct consumer_files *files);

/* Checks and maps n storages of a consumer whose fds are frame's (the
 * frame keeps them): all or none, out[0..n) filled on success.  Refusals:
 * SP_EINVAL for a storage that is not a memfd (the host backend's only
 * kind of consumer buffer), SP_EBADFD for a descriptor that is no regular
 * file, a file shorter than offset + length or one that cannot be mapped
 * writable (opened read-only, sealed), SP_EPERM for a buffer sharing a
 * byte with a trainer's registered storage, SP_ENOMEM. */
int consumer_buffers_map(const struct req_storage *s, size_t n,
                         const struct sp_frame *frame,
                         const struct consumer_trainer *trainers,
                         size_t ntrainers, struct consumer_files *files,
                         struct consumer_buffer *out, char *msg, size_t msglen);
void consumer_buffers_unmap(struct consumer_buffer *b, size_t n);

#endif /* SP_DAEMON_CONSUMER_BUFFER_H */
