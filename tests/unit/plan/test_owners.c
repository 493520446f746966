/*
 * test_owners.c - units, owners and what each key needs (seed 002).
 */
#include <check.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/plan.h"
#include "tests/unit/plan/tjob.h"

static struct plan *build(struct tjob *job) {
  struct plan *plan;
  char msg[512];
  ck_assert_msg(plan_build(tjob_input(job, 0, 0), &plan, msg, sizeof msg) == 0,
                "%s", msg);
  return plan;
}

static const struct plan_key *key(const struct plan *plan, const char *name) {
  uint32_t k = plan_find_key(plan, name);
  ck_assert_uint_ne(k, PLAN_NONE);
  return &plan->keys[k];
}

/* Whether name is published as rank's own registration reg. */
static bool holds(const struct plan *plan, const char *name, uint32_t rank,
                  const struct plan_key_in *reg) {
  uint32_t k = plan_find_key(plan, name);
  struct plan_key_in h;

  if (k == PLAN_NONE || plan->keys[k].held == PLAN_NONE ||
      plan->keys[k].owner != rank)
    return false;
  plan_key_holding(plan, k, &h);
  if (h.storage != reg->storage || h.view.ndim != reg->view.ndim ||
      h.view.offset != reg->view.offset || h.view.dtype != reg->view.dtype)
    return false;
  for (uint32_t d = 0; d < h.view.ndim; d++)
    if (h.view.shape[d] != reg->view.shape[d] ||
        h.view.stride[d] != reg->view.stride[d])
      return false;
  return true;
}

/* A 1-D float32 shard0 key of n elements, all rows on rank `holder`. */
static void vec(struct tjob *job, const char *name, int64_t n,
                uint32_t holder) {
  int64_t rows[8] = {0};
  rows[holder] = n;
  tjob_shard0(job, name, SP_DTYPE_FLOAT32, 1, &n, rows);
}

/* Largest first onto the lightest rank, ties to the lowest rank. */
START_TEST(largest_first_onto_lightest_rank) {
  struct tjob *job = tjob_new(2);
  struct plan *plan;

  vec(job, "d", 10, 1); /* 40 bytes */
  vec(job, "a", 25, 1); /* 100 bytes */
  vec(job, "c", 12, 1); /* 48 bytes */
  vec(job, "b", 15, 1); /* 60 bytes */
  vec(job, "e", 12, 1); /* 48 bytes, ties with c: c first by name */
  plan = build(job);
  ck_assert_uint_eq(key(plan, "a")->owner, 0); /* 100 -> r0 (tie, lowest) */
  ck_assert_uint_eq(key(plan, "b")->owner, 1); /* 60 -> r1 */
  ck_assert_uint_eq(key(plan, "c")->owner, 1); /* 48 -> r1 (60 < 100) */
  ck_assert_uint_eq(key(plan, "e")->owner, 0); /* 48 -> r0 (100 < 108) */
  ck_assert_uint_eq(key(plan, "d")->owner, 1); /* 40 -> r1 (108 < 148) */
  ck_assert_uint_eq(plan->load[0], 148);
  ck_assert_uint_eq(plan->load[1], 148);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

START_TEST(equal_keys_go_round_the_ranks) {
  struct tjob *job = tjob_new(4);
  struct plan *plan;
  static const char *const names[] = {"k0", "k1", "k2", "k3", "k4"};

  for (int i = 0; i < 5; i++)
    vec(job, names[i], 4, 0);
  plan = build(job);
  for (uint32_t i = 0; i < 5; i++)
    ck_assert_uint_eq(key(plan, names[i])->owner, i % 4);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* Experts stay put and seed their rank's load. */
START_TEST(expert_bytes_seed_the_loads) {
  struct tjob *job = tjob_new(2);
  const int64_t big = 250; /* 1000 bytes */
  struct plan *plan;

  tjob_expert(job, 0, "expert0", SP_DTYPE_FLOAT32, 1, &big);
  vec(job, "x", 150, 0); /* 600 bytes */
  vec(job, "y", 150, 0); /* 600 bytes */
  plan = build(job);
  ck_assert_uint_eq(key(plan, "expert0")->owner, 0);
  ck_assert_int_eq(key(plan, "expert0")->kind, PLAN_KEY_IDENTITY);
  ck_assert_uint_eq(key(plan, "expert0")->unit, PLAN_NONE);
  ck_assert(holds(plan, "expert0", 0, tjob_key(job, 0, "expert0")));
  /* Without seeding, x would go to rank 0; with it, both go to rank 1
   * (600 < 1000). */
  ck_assert_uint_eq(key(plan, "x")->owner, 1);
  ck_assert_uint_eq(key(plan, "y")->owner, 1);
  ck_assert_uint_eq(plan->load[0], 1000);
  ck_assert_uint_eq(plan->load[1], 1200);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* [a,b], [c,d], [b,c] collapse into one unit whatever the order, although
 * balancing alone would spread the four keys over the ranks. */
START_TEST(together_chain_is_one_unit) {
  static const char *const g1[] = {"a", "b"}, *const g2[] = {"c", "d"},
                           *const g3[] = {"b", "c"};
  for (int order = 0; order < 2; order++) {
    struct tjob *job = tjob_new(4);
    struct plan *plan;
    const struct plan_unit *u;
    vec(job, "a", 8, 0);
    vec(job, "b", 8, 1);
    vec(job, "c", 8, 2);
    vec(job, "d", 8, 3);
    vec(job, "e", 2, 3);
    if (order == 0) {
      tjob_group(job, PLAN_NONE, 2, g1);
      tjob_group(job, PLAN_NONE, 2, g2);
      tjob_group(job, PLAN_NONE, 2, g3);
    } else {
      tjob_group(job, PLAN_NONE, 2, g3);
      tjob_group(job, PLAN_NONE, 2, g2);
      tjob_group(job, PLAN_NONE, 2, g1);
    }
    plan = build(job);
    ck_assert_uint_eq(plan->nunits, 2);
    u = &plan->units[key(plan, "a")->unit];
    ck_assert_uint_eq(u->nkeys, 4);
    ck_assert_uint_eq(u->nbytes, 128);
    for (const char *n = "abcd"; *n != '\0'; n++) {
      char name[2] = {*n, '\0'};
      ck_assert_uint_eq(key(plan, name)->unit, key(plan, "a")->unit);
      ck_assert_uint_eq(key(plan, name)->owner, 0);
    }
    ck_assert_uint_eq(key(plan, "e")->owner, 1);
    plan_free(plan);
    tjob_free(job);
  }
}
END_TEST

/* Keys whose storage and view are identical on every rank are one unit;
 * the first by name moves, the other aliases it and counts once. */
START_TEST(tied_weights_move_once) {
  struct tjob *job = tjob_new(2);
  const int64_t shape[2] = {6, 4}, rows[2] = {3, 3};
  struct plan *plan;
  const struct plan_key *embed, *head;
  size_t moves = 0;

  tjob_shard0(job, "embed", SP_DTYPE_BFLOAT16, 2, shape, rows);
  tjob_tie(job, "lm_head", "embed");
  tjob_shard0(job, "other", SP_DTYPE_BFLOAT16, 2, shape, rows);
  plan = build(job);
  embed = key(plan, "embed");
  head = key(plan, "lm_head");
  ck_assert_int_eq(embed->kind, PLAN_KEY_MOVE);
  ck_assert_int_eq(head->kind, PLAN_KEY_ALIAS);
  ck_assert_uint_eq(head->alias_of, plan_find_key(plan, "embed"));
  ck_assert_uint_eq(head->unit, embed->unit);
  ck_assert_uint_eq(head->owner, embed->owner);
  ck_assert_uint_eq(plan->units[embed->unit].nbytes, 48);
  ck_assert_uint_eq(plan->ntransfer, 2);
  for (size_t r = 0; r < plan->nrounds; r++) {
    for (size_t i = 0; i < plan->rounds[r].nmoves; i++)
      moves += plan->rounds[r].moves[i].key == plan_find_key(plan, "lm_head");
    for (size_t i = 0; i < plan->rounds[r].nlocal; i++)
      moves += plan->rounds[r].local[i].key == plan_find_key(plan, "lm_head");
  }
  ck_assert_uint_eq(moves, 0);
  plan_free(plan);
  /* Same storage but another view on one rank: not tied. */
  tjob_storage(job, 1, "lm_head")->nbytes += 8;
  tjob_key(job, 1, "lm_head")->view.offset = 1;
  plan = build(job);
  ck_assert_int_eq(key(plan, "lm_head")->kind, PLAN_KEY_MOVE);
  ck_assert_uint_eq(key(plan, "lm_head")->alias_of, PLAN_NONE);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* What each key needs once it has an owner. */
START_TEST(identity_empty_and_moved_keys) {
  struct tjob *job = tjob_new(2);
  const int64_t shape[2] = {4, 4}, none[2] = {0, 4};
  struct plan *plan;

  tjob_whole(job, "rep", PLAN_REPLICATED, SP_DTYPE_FLOAT32, 2, shape);
  tjob_whole(job, "plain", PLAN_PLAIN, SP_DTYPE_INT64, 2, shape);
  tjob_shard0(job, "nothing", SP_DTYPE_FLOAT32, 2, none,
              (const int64_t[]){0, 0});
  tjob_shard0(job, "split", SP_DTYPE_FLOAT32, 2, shape,
              (const int64_t[]){1, 3});
  plan = build(job);
  /* plain (128 bytes) -> r0; rep (64) -> r1; split (64) -> r1 (64 < 128). */
  ck_assert_int_eq(key(plan, "rep")->kind, PLAN_KEY_IDENTITY);
  ck_assert(holds(plan, "rep", 1, tjob_key(job, 1, "rep")));
  ck_assert_int_eq(key(plan, "plain")->kind, PLAN_KEY_IDENTITY);
  ck_assert(holds(plan, "plain", 0, tjob_key(job, 0, "plain")));
  ck_assert_int_eq(key(plan, "nothing")->kind, PLAN_KEY_EMPTY);
  ck_assert_int_eq(key(plan, "split")->kind, PLAN_KEY_MOVE);
  ck_assert_uint_eq(key(plan, "split")->round, 0);
  ck_assert_uint_eq(key(plan, "rep")->round, PLAN_NONE);
  ck_assert_uint_eq(plan->ntransfer, 1);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* A shard0 key whose owner holds every row is published as it is. */
START_TEST(shard0_held_whole_by_owner_is_identity) {
  struct tjob *job = tjob_new(2);
  const int64_t shape[1] = {4};
  struct plan *plan;

  tjob_shard0(job, "a", SP_DTYPE_FLOAT32, 1, shape, (const int64_t[]){4, 0});
  tjob_shard0(job, "b", SP_DTYPE_FLOAT32, 1, shape, (const int64_t[]){0, 4});
  plan = build(job);
  /* a -> r0, which holds it whole; b -> r1, which holds it whole. */
  ck_assert_int_eq(key(plan, "a")->kind, PLAN_KEY_IDENTITY);
  ck_assert_int_eq(key(plan, "b")->kind, PLAN_KEY_IDENTITY);
  ck_assert(holds(plan, "b", 1, tjob_key(job, 1, "b")));
  plan_free(plan);
  tjob_free(job);
  /* Both on rank 1: a goes to rank 0 and must move. */
  job = tjob_new(2);
  tjob_shard0(job, "a", SP_DTYPE_FLOAT32, 1, shape, (const int64_t[]){0, 4});
  plan = build(job);
  ck_assert_int_eq(key(plan, "a")->kind, PLAN_KEY_MOVE);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* Owners, units and the digest do not depend on the order ranks and keys
 * arrive in. */
START_TEST(owners_are_deterministic) {
  struct tjob *job = tjob_new(5);
  uint64_t state = 11;
  uint32_t owners[64];
  uint64_t digest = 0;

  for (int i = 0; i < 40; i++) {
    int64_t rows[5], n = 0, shape[2];
    for (int r = 0; r < 5; r++)
      n += rows[r] = (int64_t)(tjob_rand(&state) % 4);
    shape[0] = n;
    shape[1] = 1 + (int64_t)(tjob_rand(&state) % 3);
    tjob_shard0(job, tjob_name(job, "layer.%d.w", i), SP_DTYPE_FLOAT16, 2,
                shape, rows);
  }
  tjob_expert(job, 3, "moe.e3", SP_DTYPE_FLOAT32, 1, (const int64_t[]){9});
  tjob_group(job, PLAN_NONE, 2,
             (const char *const[]){"layer.1.w", "layer.7.w"});
  for (uint32_t view = 0; view < 5; view++) {
    for (uint64_t seed = 0; seed < 4; seed++) {
      struct plan *plan;
      char msg[256];
      ck_assert_int_eq(
          plan_build(tjob_input(job, view, seed), &plan, msg, sizeof msg), 0);
      if (view == 0 && seed == 0) {
        digest = plan->digest;
        for (size_t k = 0; k < plan->nkeys; k++)
          owners[k] = plan->keys[k].owner;
      }
      ck_assert_uint_eq(plan->digest, digest);
      for (size_t k = 0; k < plan->nkeys; k++)
        ck_assert_uint_eq(plan->keys[k].owner, owners[k]);
      plan_free(plan);
    }
  }
  tjob_free(job);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-owners");
  TCase *tc = tcase_create("owners");
  SRunner *sr;
  int failed;

  tcase_add_test(tc, largest_first_onto_lightest_rank);
  tcase_add_test(tc, equal_keys_go_round_the_ranks);
  tcase_add_test(tc, expert_bytes_seed_the_loads);
  tcase_add_test(tc, together_chain_is_one_unit);
  tcase_add_test(tc, tied_weights_move_once);
  tcase_add_test(tc, identity_empty_and_moved_keys);
  tcase_add_test(tc, shard0_held_whole_by_owner_is_identity);
  tcase_add_test(tc, owners_are_deterministic);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
