/*
 * test_replicas.c - affine replicas compared on the GPUs: equal ones export
 * byte-exact, a differing one is refused on every rank, on one node and
 * across two (replicas cross the nodes through NCCL and are compared on
 * their owner's node).
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/world.h"

/* Replicated affine keys held by every rank, and a dim-0 shard beside. */
static const struct tkey replica_keys[] = {
    K(.name = "rep.a", .kind = AFFINE_ALL, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 10}),
    K(.name = "rep.b", .kind = AFFINE_ALL, .dtype = "bfloat16", .es = 2,
      .ndim = 1, .shape = {17}),
    K(.name = "rows", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 3}, .parts = {2, 3, 1, 2}),
};
#define NREPLICA (sizeof replica_keys / sizeof replica_keys[0])

/* The same keys with rank bad's copy of "rep.a" differing at element
 * [1, 3] (BAD_ELEMENT). */
static struct tkey bad_replica_keys[NREPLICA];

static void make_bad_replicas(uint32_t bad) {
  memcpy(bad_replica_keys, replica_keys, sizeof replica_keys);
  bad_replica_keys[0].bad = (int)bad + 1;
}

/* Every rank's export fails with different_data naming the key, the
 * element and both ranks. */
static void assert_different(struct world *w, const struct scenario *sc,
                             const char *ranks) {
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].export_rc == SP_EDIFFERENT, "rank %u: %s: %s", i,
                  sp_strerror(w->rep[i].export_rc), w->rep[i].message);
    ck_assert_msg(strstr(w->rep[i].message, "key 'rep.a'") != NULL &&
                      strstr(w->rep[i].message, "element [1, 3]") != NULL &&
                      strstr(w->rep[i].message, ranks) != NULL,
                  "rank %u: %s", i, w->rep[i].message);
  }
}

START_TEST(replicas_compared_on_the_gpus) {
  /* Equal replicas on four ranks over three GPUs export byte-exact, twice;
   * then rank 2's copy differs and every rank is refused. */
  struct scenario sc = {.world = 4,
                        .nkeys = NREPLICA,
                        .keys = replica_keys,
                        .gpus = 3,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
  make_bad_replicas(2);
  sc.keys = bad_replica_keys;
  sc.exports = 1;
  world_run(&sc, &w);
  assert_different(&w, &sc, "rank 0 and rank 2 disagree");
  world_free(&w, &sc);
}
END_TEST

/* Tensor parallel splits replicated over data parallel ranks
 * (tlayout_family), on one node and across two: replicas with strided
 * sources cross the nodes through NCCL and are compared on their owner's
 * node. */
static struct tlayout_key family_[TLAYOUT_FAMILY];
static struct tkey family_keys_[TLAYOUT_FAMILY];

static void make_family_keys(void) {
  tlayout_family(family_);
  for (size_t i = 0; i < TLAYOUT_FAMILY; i++)
    family_keys_[i] =
        K(.name = family_[i].name, .kind = AFFINE_MAP,
          .dtype = family_[i].dtype, .es = family_[i].es, .ndim = 2,
          .shape = {family_[i].layout.shape[0], family_[i].layout.shape[1]},
          .layout = &family_[i].layout);
}

START_TEST(tensor_parallel_replicas) {
  make_family_keys();
  struct scenario sc = {.world = 4,
                        .nkeys = TLAYOUT_FAMILY,
                        .keys = family_keys_,
                        .gpus = 2,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_tensor_parallel_replicas) {
  make_family_keys();
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = TLAYOUT_FAMILY,
                        .keys = family_keys_,
                        .gpus = 2,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(two_nodes_replicas_compared) {
  /* Ranks 0, 1 on node 0 and 2, 3 on node 1: replicas cross the nodes
   * through NCCL and are compared on their owner's node. */
  struct scenario sc = {.world = 4,
                        .nodes = 2,
                        .nkeys = NREPLICA,
                        .keys = replica_keys,
                        .gpus = 2,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
  make_bad_replicas(3);
  sc.keys = bad_replica_keys;
  sc.exports = 1;
  world_run(&sc, &w);
  assert_different(&w, &sc, "rank 0 and rank 3 disagree");
  world_free(&w, &sc);
}
END_TEST

void test_replicas_add(const struct gpu_cases *c) {
  tcase_add_test(c->export, replicas_compared_on_the_gpus);
  tcase_add_test(c->export, tensor_parallel_replicas);
  tcase_add_test(c->nodes, two_nodes_replicas_compared);
  tcase_add_test(c->nodes, two_nodes_tensor_parallel_replicas);
}
