/*
 * consumers.h - shardport-demo's consumers: tensor-parallel inference
 * workers that take the model the trainers push, laid out as an engine
 * keeps it.
 *
 * Consumer i of n holds, in one buffer of its own:
 *   - its heads of every fused attention weight (attn.qkv: its rows of
 *     the q, k and v blocks, side by side in the buffer as one fused
 *     [q | k | v] of its own: three pieces of one key);
 *   - its rows of the embedding (vocabulary parallel, a dim-0 shard);
 *   - its columns of the other sharded weights (a dim-1 shard: the
 *     trainers' rows cut into columns, every move strided);
 *   - the norms whole;
 *   - the experts e with e % n == i whole, and no other (a subset of the
 *     keys).
 * Cuts are uneven where the dims do not divide, as torch.tensor_split's.
 */
#ifndef SP_CLIENT_DEMO_CONSUMERS_H
#define SP_CLIENT_DEMO_CONSUMERS_H

#include <stddef.h>
#include <stdint.h>

#include "client/demo/model.h"
#include "shardport.h"

/* A box of a key (rows and columns of the key taken as rows x
 * key_cols()) held row-major at byte_off in the consumer's buffer. */
struct slab {
  uint32_t key;
  sp_target_part part;
  uint32_t dim; /* SP_TARGET_SHARD */
  int64_t start[2];
  int64_t shape[2];
  uint64_t byte_off;
};

struct consumer_layout {
  uint32_t index;
  size_t nslabs;
  struct slab *slabs; /* a key's slabs one after the other */
  uint64_t bytes;     /* the buffer's length */
  uint64_t delivered; /* the bytes a push writes into it */
};

/* Consumer index of n's layout of m: 0 or -1 (out of memory). */
int consumer_layout_build(const struct model *m, uint32_t index, uint32_t n,
                          struct consumer_layout *out);
void consumer_layout_free(struct consumer_layout *l);

/* Registers the buffer (a memfd of l->bytes mapped at addr) and every
 * target on a consumer's connection: 0 or the library's negative code. */
int consumer_register(sp_client *c, const struct model *m,
                      const struct consumer_layout *l, int fd, uint8_t *addr);

/* Checks the buffer against the model at step: 0, or -1 with the first
 * difference in err. */
int consumer_verify(const struct model *m, const struct consumer_layout *l,
                    const uint8_t *buf, uint32_t step, char *err, size_t len);

/* The path without consumers: copies this consumer's boxes of the whole
 * tensor t of key (an export's owned tensor) into its buffer buf. */
void consumer_copy_owned(const struct model *m,
                         const struct consumer_layout *l, uint32_t key,
                         const sp_owned_tensor *t, uint8_t *buf);

#endif
