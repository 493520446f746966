/*
 * consume_pack.h - a push's buckets between nodes (daemon/plan/consume.h):
 * packed on the sender's node straight from the sending rank's storage,
 * and unpacked on the consumer's node straight into its buffers
 * (consume_pack.c).  The bytes between are the transport's (the mesh's
 * data links): a bucket is its moves back to back at their bucket_offset,
 * each move's elements in row-major order of its shape, so sender and
 * consumer agree on every byte from the plan alone.
 *
 * Reads of trainers' mappings and writes into consumers' run under the
 * SIGBUS guard (thread.h): a file truncated after registration fails the
 * bucket with the rank or consumer and the key named.
 */
#ifndef SP_DAEMON_XFER_CONSUME_PACK_H
#define SP_DAEMON_XFER_CONSUME_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/consume.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/layer.h"

/* Packs bucket `bucket` of round `round` into out (the bucket's nbytes)
 * from the sending rank's storages src (indexed as its registration lists
 * them): 0, or SP_EBADFD with a sentence in msg. */
int consume_pack(const struct consume_plan *plan, size_t round, size_t bucket,
                 const struct xfer_storage *src, uint8_t *out, char *msg,
                 size_t msglen);
/* Writes the bucket's bytes in into the receiving consumer's buffers dst
 * (writable mappings, indexed as its registration lists them): 0, or
 * SP_EBADFD with a sentence in msg. */
int consume_unpack(const struct consume_plan *plan, size_t round, size_t bucket,
                   const uint8_t *in, uint8_t *const *dst, char *msg,
                   size_t msglen);

#endif /* SP_DAEMON_XFER_CONSUME_PACK_H */
