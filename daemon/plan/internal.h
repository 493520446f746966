/*
 * internal.h - what the planner's files share; nothing outside
 * daemon/plan/ includes it.  One section per file.
 */
#ifndef SP_DAEMON_PLAN_INTERNAL_H
#define SP_DAEMON_PLAN_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "daemon/plan/layout.h"
#include "daemon/plan/plan.h"
#include "proto/fail.h"

/* refuse.c */

/* "rank 3" or "ranks 1, 2 and 5", naming at most eight and counting the
 * rest, so a refusal in a world of thousands stays one line. */
void plan_refuse_ranks(char *buf, size_t len, const uint32_t *ranks, size_t n);
/* SP_ETIMEOUT with its sentence once *stop is set (stop may be NULL),
 * else 0: looked at between steps, so that planning stops soon. */
int plan_check_stop(const _Atomic bool *stop, char *msg, size_t msglen);

/* cover.c: how strided boxes reach the elements [0, n), in memory
 * proportional to the boxes (about 320 bytes each), never to n. */

struct cover_box {
  int64_t offset;
  uint32_t ndim;
  const int64_t *shape;
  const int64_t *stride;
  bool shared; /* a replica: may reach what other shared boxes reach */
};

struct cover_defect {
  uint64_t element; /* the lowest element found at fault */
  uint32_t box;     /* SP_EDOUBLEWRITE: the two boxes reaching it, */
  uint32_t other;   /* box < other */
};

/* What a sweep cost, for the tests that bound it by the boxes. */
struct cover_work {
  uint64_t steps;   /* runs judged, plus combs looked at by skip attempts */
  uint64_t skipped; /* runs judged by a skip instead, as copies */
};

/* The boxes must have passed sp__view_check_overlap and lie inside [0, n).
 * Returns 0; SP_EDOUBLEWRITE when an element is reached by two boxes not
 * both shared; SP_EUNCOVERED when complete and an element is reached by
 * none; SP_ETIMEOUT once *stop (NULL: never) is set; SP_ENOMEM.  *work
 * (work may be NULL) receives what the sweep cost, whatever it returns. */
int cover_check(const struct cover_box *boxes, size_t nboxes, uint64_t n,
                bool complete, const _Atomic bool *stop,
                struct cover_defect *out, struct cover_work *work);

/* index.c: every rank's entries, gathered per key in rank order.  Keys
 * are the distinct names of the key table; rows of one name (ranks that
 * declare it differently) share one key. */

struct plan_index {
  uint32_t world;
  const struct plan_input *in;
  const struct plan_rank_in **rank; /* [world], by rank number */
  size_t nkeys;                     /* distinct names over all ranks */
  const char **name;                /* [nkeys], in strcmp order */
  uint32_t *key_of;                 /* [in->nkeys]: each row's key */
  size_t *first;                    /* [nkeys + 1]: key k's slots are */
                                    /* first[k] .. first[k + 1] */
  /* When every rank lists the same keys in the same order (one model on
   * every rank), the ranks' own arrays are the index: key k's entry on
   * rank r is rank[r]->entries[pos[k]], in slot k * world + r, and nothing
   * is transposed.  Otherwise pos is NULL and a counting sort filled entry
   * and entry_rank. */
  uint32_t *pos;                   /* [nkeys] */
  const struct plan_entry **entry; /* [slots] */
  uint32_t *entry_rank;            /* [slots] */
  const _Atomic bool *stop;        /* the input's */
};

/* The rank of the entry in slot, and the entry. */
static inline uint32_t plan_index_rank(const struct plan_index *ix,
                                       size_t slot) {
  return ix->pos != NULL ? (uint32_t)(slot % ix->world) : ix->entry_rank[slot];
}

static inline const struct plan_entry *
plan_index_entry(const struct plan_index *ix, size_t slot) {
  if (ix->pos != NULL)
    return &ix->rank[slot % ix->world]->entries[ix->pos[slot / ix->world]];
  return ix->entry[slot];
}

int plan_index_build(const struct plan_input *in, struct plan_index *ix,
                     char *msg, size_t msglen);
void plan_index_free(struct plan_index *ix);
/* The key named name, or PLAN_NONE. */
uint32_t plan_index_find(const struct plan_index *ix, const char *name);

/* The entry in slot in full form (plan_input_holding). */
static inline void plan_index_holding(const struct plan_index *ix, size_t slot,
                                      struct plan_key_in *out) {
  plan_input_holding(ix->in, ix->rank[plan_index_rank(ix, slot)],
                     plan_index_entry(ix, slot), out);
}

/* The full form of the entry in slot when it is kept in its rank's side
 * table; NULL for a compact entry. */
static inline const struct plan_key_in *
plan_index_full(const struct plan_index *ix, size_t slot) {
  const struct plan_entry *e = plan_index_entry(ix, slot);
  if (e->storage != PLAN_ENTRY_FULL)
    return NULL;
  return &ix->rank[plan_index_rank(ix, slot)]->full[e->offset];
}

/* The entry in slot's place among its rank's entries. */
static inline uint32_t plan_index_entry_of(const struct plan_index *ix,
                                           size_t slot) {
  return (uint32_t)(plan_index_entry(ix, slot) -
                    ix->rank[plan_index_rank(ix, slot)]->entries);
}

/* validate.c */

/* Together-groups in canonical form: each group's keys sorted without
 * repeats, groups of two or more keys only, sorted and without repeats. */
struct plan_group_keys {
  const uint32_t *keys;
  size_t nkeys;
};

struct plan_groups {
  uint32_t *keys;
  struct plan_group_keys *groups;
  size_t ngroups;
};

/* Fills plan->keys (name, placement, dtype, device type, shape, nbytes; the
 * owner of experts) or refuses, key after key in name order. */
int plan_validate_keys(const struct plan_index *ix, struct plan *plan,
                       char *msg, size_t msglen);
/* Refuses ranks whose together-groups differ; *out receives the groups
 * every rank agrees on. */
int plan_validate_groups(const struct plan_index *ix, const struct plan *plan,
                         struct plan_groups *out, char *msg, size_t msglen);
void plan_groups_free(struct plan_groups *groups);

/* units.c: key->unit and key->alias_of, plan->units and plan->unit_keys. */
int plan_units_build(const struct plan_index *ix,
                     const struct plan_groups *groups, struct plan *plan,
                     char *msg, size_t msglen);

/* owners.c: key->owner and plan->load. */
int plan_owners_assign(struct plan *plan, char *msg, size_t msglen);

/* moves.c: what each key needs, and the moves that carry it. */
int plan_moves_classify(const struct plan_index *ix, struct plan *plan,
                        char *msg, size_t msglen);
/* Writes key k's moves to out (when not NULL) and returns how many there
 * are: one per non-empty shard0 shard, one per non-empty affine piece. */
size_t plan_moves_of_key(const struct plan_index *ix, const struct plan *plan,
                         uint32_t k, struct plan_move *out);

/* rounds.c: plan->transfer and plan->rounds. */
int plan_rounds_build(const struct plan_index *ix, struct plan *plan, char *msg,
                      size_t msglen);

/* The one rule that closes a round, for exports (rounds.c) and pushes
 * (consume_moves.c) alike: a round that already holds keys takes no more
 * once it has max_keys of them, or once the next key's traffic would pass
 * max_bytes.  A key larger than max_bytes therefore travels alone. */
static inline bool plan_round_is_full(size_t keys, uint64_t bytes,
                                      uint64_t traffic, uint32_t max_keys,
                                      uint64_t max_bytes) {
  uint64_t sum;

  return keys > 0 && (keys == max_keys ||
                      __builtin_add_overflow(bytes, traffic, &sum) ||
                      sum > max_bytes);
}

/* workers.c: task(ctx, worker, i) for every i in [0, n), on up to
 * threads threads, this one included; worker (below
 * plan_workers_count(threads, n)) names the thread, for scratch of its own.
 * Returns 0, or the code of the failing task of lowest index. */
uint32_t plan_workers_count(uint32_t threads, size_t n);
int plan_workers_run(uint32_t threads, size_t n,
                     int (*task)(void *ctx, uint32_t worker, size_t i),
                     void *ctx);

/* digest.c, and the word hash it shares with units.c's tie finding.  A
 * word at a time, inline, because the digest covers every move of a plan:
 * millions of words for a large job.  Values are fed as integers, never as
 * memory images, so the hash does not depend on padding or byte order. */

struct plan_hash {
  uint64_t state;
  uint64_t words;
};

static inline void plan_hash_init(struct plan_hash *h) {
  h->state = 0x27d4eb2f165667c5ull;
  h->words = 0;
}

static inline void plan_hash_u64(struct plan_hash *h, uint64_t v) {
  uint64_t x = h->state ^ (v * 0xc2b2ae3d27d4eb4full);
  h->state = ((x << 31) | (x >> 33)) * 0x9e3779b185ebca87ull;
  h->words++;
}

/* A string as its length and then its bytes, eight to a word. */
static inline void plan_hash_str(struct plan_hash *h, const char *s) {
  size_t len = strlen(s);

  plan_hash_u64(h, len);
  for (size_t i = 0; i < len; i += 8) {
    uint64_t word = 0;
    for (size_t j = 0; j < 8 && i + j < len; j++)
      word |= (uint64_t)(uint8_t)s[i + j] << (8 * j);
    plan_hash_u64(h, word);
  }
}

static inline uint64_t plan_hash_final(const struct plan_hash *h) {
  uint64_t x = h->state ^ h->words;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* The digest of one round's buckets and moves, once they are built: every
 * round's on the thread that built it, so that hashing the moves goes as
 * wide as building them. */
uint64_t plan_digest_round(const struct plan *plan,
                           const struct plan_round *round);
/* The plan's, over its keys, units and each round's digest in order. */
uint64_t plan_digest_compute(const struct plan *plan);

#endif /* SP_DAEMON_PLAN_INTERNAL_H */
