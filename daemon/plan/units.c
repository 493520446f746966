/*
 * units.c - keys that must land on one owner become one unit.
 *
 * Two sources merge keys, transitively: together-groups (the inputs of a
 * merge), and tied weights, keys whose storage and view are identical on
 * every rank.  A tied key moves once: the first of its ties by name is the
 * one that moves, the others become aliases of it and share its buffer on
 * the owner.  Ties are found by hashing each key's holdings over all ranks
 * and comparing exactly only keys of equal hash, so finding them costs
 * O(entries + keys log keys), never a comparison of every pair of keys.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

/* Union-find whose root is always the smallest key of its set, so units
 * are named by their first key whatever order merges happen in. */
static uint32_t set_find(uint32_t *parent, uint32_t k) {
  while (parent[k] != k) {
    parent[k] = parent[parent[k]];
    k = parent[k];
  }
  return k;
}

static void set_union(uint32_t *parent, uint32_t a, uint32_t b) {
  a = set_find(parent, a);
  b = set_find(parent, b);
  if (a < b)
    parent[b] = a;
  else if (b < a)
    parent[a] = b;
}

/* Only whole views can be tied: a tie between affine maps would also need
 * equal pieces, and experts are never balanced. */
static bool tie_candidate(const struct plan_key *key) {
  return key->placement == PLAN_SHARD0 || key->placement == PLAN_REPLICATED ||
         key->placement == PLAN_PLAIN;
}

static const struct sp_storage *entry_storage(const struct plan_index *ix,
                                              size_t slot) {
  const struct plan_key_in *full = plan_index_full(ix, slot);
  uint32_t storage =
      full != NULL ? full->storage : plan_index_entry(ix, slot)->storage;
  return &ix->rank[plan_index_rank(ix, slot)]->storages[storage];
}

/* A hash of where the key starts on every rank: equal holdings hash
 * equal, and tied() decides exactly among keys of one hash. */
static uint64_t holdings_hash(const struct plan_index *ix,
                              const struct plan_key *key, uint32_t k) {
  struct plan_hash h;

  plan_hash_init(&h);
  plan_hash_u64(&h, (uint64_t)key->placement);
  for (size_t slot = ix->first[k]; slot < ix->first[k + 1]; slot++) {
    const struct sp_storage *s = entry_storage(ix, slot);
    const struct plan_key_in *full = plan_index_full(ix, slot);
    plan_hash_u64(&h, s->base);
    plan_hash_u64(&h, (uint64_t)(uint32_t)s->device.index);
    if (full != NULL) {
      plan_hash_u64(&h, (uint64_t)full->view.offset);
      plan_hash_u64(&h,
                    full->view.ndim > 0 ? (uint64_t)full->view.shape[0] : 0);
    } else {
      plan_hash_u64(&h, plan_index_entry(ix, slot)->offset);
      plan_hash_u64(&h, plan_index_entry(ix, slot)->rows);
    }
  }
  return plan_hash_final(&h);
}

static bool view_equal(const struct sp_view *a, const struct sp_view *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim || a->offset != b->offset)
    return false;
  for (uint32_t d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d])
      return false;
  return true;
}

/* Both keys are dense, so both have one entry per rank in rank order. */
static bool tied(const struct plan_index *ix, const struct plan *plan,
                 uint32_t a, uint32_t b) {
  const struct plan_key *ka = &plan->keys[a], *kb = &plan->keys[b];

  if (ka->placement != kb->placement || ka->ndim != kb->ndim ||
      memcmp(ka->shape, kb->shape, ka->ndim * sizeof ka->shape[0]) != 0)
    return false;
  for (uint32_t r = 0; r < ix->world; r++) {
    size_t sa = ix->first[a] + r, sb = ix->first[b] + r;
    const struct sp_storage *x = entry_storage(ix, sa);
    const struct sp_storage *y = entry_storage(ix, sb);
    struct plan_key_in ea, eb;
    plan_index_holding(ix, sa, &ea);
    plan_index_holding(ix, sb, &eb);
    if (!sp__device_equal(&x->device, &y->device) || x->base != y->base ||
        !view_equal(&ea.view, &eb.view))
      return false;
  }
  return true;
}

struct tie_slot {
  uint64_t hash;
  uint32_t key;
};

static int tie_slot_cmp(const void *pa, const void *pb) {
  const struct tie_slot *a = pa, *b = pb;
  if (a->hash != b->hash)
    return a->hash < b->hash ? -1 : 1;
  return a->key < b->key ? -1 : a->key > b->key;
}

/* Keys' holdings are hashed in runs of this many, one run per task, each
 * into its own slots. */
#define KEYS_PER_TASK 4096u

struct hash_work {
  const struct plan_index *ix;
  const struct plan *plan;
  struct tie_slot *slots; /* [nkeys], by key */
};

static int hash_task(void *ctx, uint32_t worker, size_t task) {
  struct hash_work *hw = ctx;
  size_t end = (task + 1) * KEYS_PER_TASK;

  (void)worker;
  if (end > hw->plan->nkeys)
    end = hw->plan->nkeys;
  for (size_t k = task * KEYS_PER_TASK; k < end; k++)
    if (tie_candidate(&hw->plan->keys[k]))
      hw->slots[k] = (struct tie_slot){
          holdings_hash(hw->ix, &hw->plan->keys[k], (uint32_t)k), (uint32_t)k};
  return 0;
}

static int find_ties(const struct plan_index *ix, struct plan *plan,
                     uint32_t *parent, char *msg, size_t msglen) {
  struct tie_slot *slots =
      malloc((plan->nkeys > 0 ? plan->nkeys : 1) * sizeof *slots);
  uint32_t *reps = malloc((plan->nkeys > 0 ? plan->nkeys : 1) * sizeof *reps);
  size_t n = 0;

  if (slots == NULL || reps == NULL) {
    free(slots);
    free(reps);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  struct hash_work hw = {ix, plan, slots};
  plan_workers_run(plan->threads,
                   (plan->nkeys + KEYS_PER_TASK - 1) / KEYS_PER_TASK, hash_task,
                   &hw);
  for (uint32_t k = 0; k < plan->nkeys; k++)
    if (tie_candidate(&plan->keys[k]))
      slots[n++] = slots[k];
  qsort(slots, n, sizeof *slots, tie_slot_cmp);
  /* Within a run of equal hashes, each key is compared with the distinct
   * holdings met so far in the run; keys come in name order, so the first
   * key of a tie is the one the others alias. */
  for (size_t i = 0; i < n;) {
    size_t end = i, nreps = 0;
    while (end < n && slots[end].hash == slots[i].hash)
      end++;
    for (size_t j = i; j < end; j++) {
      uint32_t k = slots[j].key;
      size_t rep = 0;
      while (rep < nreps && !tied(ix, plan, reps[rep], k))
        rep++;
      if (rep == nreps) {
        reps[nreps++] = k;
      } else {
        plan->keys[k].alias_of = reps[rep];
        set_union(parent, reps[rep], k);
      }
    }
    i = end;
  }
  free(slots);
  free(reps);
  return 0;
}

int plan_units_build(const struct plan_index *ix,
                     const struct plan_groups *groups, struct plan *plan,
                     char *msg, size_t msglen) {
  size_t n = plan->nkeys > 0 ? plan->nkeys : 1;
  uint32_t *parent = malloc(n * sizeof *parent);
  uint32_t *unit_of = malloc(n * sizeof *unit_of);
  size_t nunits = 0;
  int rc;

  if (parent == NULL || unit_of == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (uint32_t k = 0; k < plan->nkeys; k++)
    parent[k] = k;
  for (size_t g = 0; g < groups->ngroups; g++)
    for (size_t j = 1; j < groups->groups[g].nkeys; j++)
      set_union(parent, groups->groups[g].keys[0], groups->groups[g].keys[j]);
  rc = find_ties(ix, plan, parent, msg, msglen);
  if (rc != 0)
    goto out;
  for (uint32_t k = 0; k < plan->nkeys; k++)
    unit_of[k] = PLAN_NONE;
  /* The root of a set is its smallest key, met first in this walk. */
  for (uint32_t k = 0; k < plan->nkeys; k++) {
    uint32_t root;
    if (plan->keys[k].placement == PLAN_EXPERT)
      continue;
    root = set_find(parent, k);
    if (unit_of[root] == PLAN_NONE)
      unit_of[root] = (uint32_t)nunits++;
    plan->keys[k].unit = unit_of[root];
  }
  plan->units = calloc(nunits > 0 ? nunits : 1, sizeof *plan->units);
  plan->unit_keys = malloc(n * sizeof *plan->unit_keys);
  if (plan->units == NULL || plan->unit_keys == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  plan->nunits = nunits;
  for (uint32_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    struct plan_unit *u;
    if (key->unit == PLAN_NONE)
      continue;
    u = &plan->units[key->unit];
    u->nkeys++;
    /* An alias shares its buffer: its bytes land on the owner once. */
    if (key->alias_of == PLAN_NONE &&
        __builtin_add_overflow(u->nbytes, key->nbytes, &u->nbytes)) {
      rc = sp__failf(msg, msglen, SP_EOVERFLOW,
                     "the unit of key '%s' overflows", key->name);
      goto out;
    }
  }
  for (size_t u = 1; u < nunits; u++)
    plan->units[u].first = plan->units[u - 1].first + plan->units[u - 1].nkeys;
  for (size_t u = 0; u < nunits; u++)
    plan->units[u].nkeys = 0;
  for (uint32_t k = 0; k < plan->nkeys; k++) {
    struct plan_unit *u;
    if (plan->keys[k].unit == PLAN_NONE)
      continue;
    u = &plan->units[plan->keys[k].unit];
    plan->unit_keys[u->first + u->nkeys++] = k;
  }
out:
  free(parent);
  free(unit_of);
  return rc;
}
