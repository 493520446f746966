/*
 * model.h - shardport-demo's synthetic sharded model: its keys, how the
 * trainer ranks hold them, and the unsharded original of every element
 * at every step, so that any process (a rank, a consumer) can check what
 * it received without the others.
 *
 * Each element is a hash of its key, the step and its flat index: a
 * trainer that updates its weights between pushes writes the values of
 * the next step, and step 0 is what an export moves.
 */
#ifndef SP_CLIENT_DEMO_MODEL_H
#define SP_CLIENT_DEMO_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_RANKS 64
#define LAYERS 32
#define EXPERTS 4

enum kind { SHARD0, REPLICATED, PLAIN, EXPERT };

struct key {
  char name[64];
  enum kind kind;
  bool bf16; /* else float32 */
  uint32_t ndim;
  int64_t shape[2];
  uint32_t expert; /* EXPERT: the one rank holding it */
  uint32_t group;  /* the storage it lives in on every rank */
  uint64_t seed;
  int64_t rows[MAX_RANKS + 1]; /* SHARD0: rank r holds [rows[r], rows[r+1]) */
};

struct model {
  uint32_t ranks;
  size_t nkeys;
  struct key *keys;   /* in the order built */
  uint32_t *by_name;  /* key indices sorted by name */
  uint32_t ngroups;
  uint64_t bytes;     /* every whole tensor */
};


uint32_t key_esize(const struct key *k);
/* The columns of a row: a 1-D key is one row of shape[0] columns. */
int64_t key_cols(const struct key *k);
uint64_t key_numel(const struct key *k);
uint64_t key_nbytes(const struct key *k);

/* The unsharded original at step: count elements from flat index first,
 * into out. */
void key_fill(const struct key *k, uint32_t step, uint64_t first,
              uint64_t count, uint8_t *out);

/* About 450 MiB in 289 keys at scale 1 over ranks trainer ranks: 0 or -1
 * (out of memory).  model_free frees it. */
int model_build(struct model *m, uint32_t ranks, double scale);
void model_free(struct model *m);

/* The key called name and its index, or NULL. */
const struct key *model_find_key(const struct model *m, const char *name,
                                 uint32_t *index);

#endif
