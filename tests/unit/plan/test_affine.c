/*
 * test_affine.c - affine validation, rebuild and extract (seed 003).
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/affine.h"

static const uint32_t R0[] = {0}, R1[] = {1}, R01[] = {0, 1};

/* A 1-D piece of n elements, stride 1 on both sides. */
static struct affine_piece p1(int64_t n, int64_t src, int64_t dst,
                              const uint32_t *holders, uint32_t nholders) {
  struct affine_piece p = {.ndim = 1,
                           .src_offset = src,
                           .dst_offset = dst,
                           .nholders = nholders,
                           .holders = holders};
  p.shape[0] = n;
  p.src_stride[0] = 1;
  p.dst_stride[0] = 1;
  return p;
}

static struct affine_piece p2(int64_t a, int64_t b, int64_t src, int64_t ss0,
                              int64_t ss1, int64_t dst, int64_t ds0,
                              int64_t ds1, const uint32_t *holders,
                              uint32_t nholders) {
  struct affine_piece p = {.ndim = 2,
                           .src_offset = src,
                           .dst_offset = dst,
                           .nholders = nholders,
                           .holders = holders};
  p.shape[0] = a;
  p.shape[1] = b;
  p.src_stride[0] = ss0;
  p.src_stride[1] = ss1;
  p.dst_stride[0] = ds0;
  p.dst_stride[1] = ds1;
  return p;
}

struct two {
  int64_t shape[2];
  struct affine_shard shards[2];
  struct affine_map map;
};

static void two_init(struct two *t, uint32_t ndim, int64_t d0, int64_t d1,
                     uint64_t n0, const struct affine_piece *pieces0,
                     size_t np0, uint64_t n1,
                     const struct affine_piece *pieces1, size_t np1) {
  t->shape[0] = d0;
  t->shape[1] = d1;
  t->shards[0] = (struct affine_shard){n0, np0, pieces0};
  t->shards[1] = (struct affine_shard){n1, np1, pieces1};
  t->map = (struct affine_map){"w", ndim, t->shape, 2, t->shards};
}

/* Extracts both shards from a full tensor of distinct values, rebuilds,
 * and checks the result is bit-exact. */
static void round_trip(const struct affine_map *map, uint64_t full_numel) {
  uint32_t *full = malloc(full_numel * sizeof *full);
  uint32_t *back = calloc(full_numel, sizeof *back);
  uint32_t *shard[2];
  char msg[256];

  for (uint64_t i = 0; i < full_numel; i++)
    full[i] = 0x1000u + (uint32_t)i;
  for (uint32_t r = 0; r < 2; r++) {
    shard[r] = malloc((map->shards[r].numel + 1) * sizeof *shard[r]);
    ck_assert_msg(affine_extract(map, r, 4, full, shard[r], msg, sizeof msg) ==
                      0,
                  "%s", msg);
  }
  ck_assert_msg(affine_rebuild(map, 4, (const void *const *)shard, back, msg,
                               sizeof msg) == 0,
                "%s", msg);
  ck_assert_mem_eq(full, back, full_numel * sizeof *full);
  free(shard[0]);
  free(shard[1]);
  free(full);
  free(back);
}

/* Seed 003's reproduction: rank 1 points at rank 0's block, so one block
 * is claimed twice and the other held by nobody. */
START_TEST(two_ranks_claiming_one_block_refused) {
  struct affine_piece a = p1(4, 0, 0, R0, 1), b = p1(4, 0, 0, R1, 1);
  struct two t;
  uint32_t s0[4] = {1, 2, 3, 4}, s1[4] = {5, 6, 7, 8}, full[8];
  const void *shards[2] = {s0, s1};
  char msg[256];

  two_init(&t, 1, 8, 0, 4, &a, 1, 4, &b, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDOUBLEWRITE);
  ck_assert_ptr_nonnull(strstr(msg, "key 'w'"));
  ck_assert_ptr_nonnull(strstr(msg, "rank 0"));
  ck_assert_ptr_nonnull(strstr(msg, "rank 1"));
  ck_assert_int_eq(affine_rebuild(&t.map, 4, shards, full, msg, sizeof msg),
                   SP_EDOUBLEWRITE);
  b.dst_offset = 4;
  ck_assert_int_eq(affine_rebuild(&t.map, 4, shards, full, msg, sizeof msg), 0);
  ck_assert_uint_eq(full[5], 6);
}
END_TEST

/* Destinations of different strides that collide in one element. */
START_TEST(destination_collision_of_any_stride_refused) {
  struct affine_piece a = p1(2, 0, 0, R0, 1), b = p1(3, 0, 1, R1, 1);
  struct two t;
  char msg[256];

  a.dst_stride[0] = 2;
  two_init(&t, 1, 4, 0, 2, &a, 1, 3, &b, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDOUBLEWRITE);
  ck_assert_ptr_nonnull(strstr(msg, "element [2]"));
  /* Each rank on its own is fine: only the writer record sees it. */
  ck_assert_int_eq(affine_check_rank(&t.map, 0, msg, sizeof msg), 0);
  ck_assert_int_eq(affine_check_rank(&t.map, 1, msg, sizeof msg), 0);
}
END_TEST

/* One rank holds a replica whole, the other in halves: compared in full. */
START_TEST(replicas_cut_at_different_boundaries_compared_in_full) {
  struct affine_piece whole = p1(8, 0, 0, R01, 2);
  struct affine_piece halves[2] = {p1(4, 0, 0, R01, 2), p1(4, 4, 4, R01, 2)};
  struct two t;
  uint32_t full[8], s0[8], s1[8], back[8];
  const void *shards[2] = {s0, s1};
  char msg[256];

  two_init(&t, 1, 8, 0, 8, &whole, 1, 8, halves, 2);
  round_trip(&t.map, 8);
  for (int i = 0; i < 8; i++)
    full[i] = 100u + (uint32_t)i;
  ck_assert_int_eq(affine_extract(&t.map, 0, 4, full, s0, msg, sizeof msg), 0);
  ck_assert_int_eq(affine_extract(&t.map, 1, 4, full, s1, msg, sizeof msg), 0);
  s1[6] ^= 1; /* the second half drifts */
  ck_assert_int_eq(affine_rebuild(&t.map, 4, shards, back, msg, sizeof msg),
                   SP_EDIFFERENT);
  ck_assert_ptr_nonnull(strstr(msg, "element [6]"));
  ck_assert_ptr_nonnull(strstr(msg, "rank 0"));
  ck_assert_ptr_nonnull(strstr(msg, "rank 1"));
}
END_TEST

START_TEST(uncovered_element_refused) {
  struct affine_piece a = p1(4, 0, 0, R0, 1), b = p1(3, 0, 4, R1, 1);
  struct two t;
  char msg[256];

  two_init(&t, 1, 8, 0, 4, &a, 1, 3, &b, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EUNCOVERED);
  ck_assert_ptr_nonnull(strstr(msg, "element [7]"));
}
END_TEST

/* A block declared replicated on one rank and single-held on another is
 * refused whichever rank is visited first. */
START_TEST(replica_over_single_holder_refused_in_either_order) {
  struct affine_piece rep = p1(4, 0, 0, R01, 2);
  struct affine_piece single0 = p1(4, 0, 0, R0, 1);
  struct affine_piece single1 = p1(4, 0, 0, R1, 1);
  struct two t;
  char msg[256];

  two_init(&t, 1, 4, 0, 4, &rep, 1, 4, &single1, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDOUBLEWRITE);
  two_init(&t, 1, 4, 0, 4, &single0, 1, 4, &rep, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDOUBLEWRITE);
  /* Replica on replica is the one overlap allowed. */
  two_init(&t, 1, 4, 0, 4, &rep, 1, 4, &rep, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), 0);
}
END_TEST

/* A source view reading one shard address twice would lose a shard value
 * (which one depends on the device); refused on both paths, as are a zero
 * stride and a destination that writes one address twice. */
START_TEST(view_overlapping_itself_refused) {
  struct affine_piece a = p2(2, 2, 0, 1, 1, 0, 2, 1, R0, 1);
  struct affine_piece b = p1(2, 0, 4, R1, 1);
  struct two t;
  uint32_t full[6] = {0}, s0[4] = {9, 8, 7, 6}, s1[2] = {1, 2};
  const void *shards[2] = {s0, s1};
  char msg[256];

  two_init(&t, 1, 6, 0, 4, &a, 1, 2, &b, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_ESELFOVERLAP);
  ck_assert_ptr_nonnull(strstr(msg, "source"));
  ck_assert_int_eq(affine_rebuild(&t.map, 4, shards, full, msg, sizeof msg),
                   SP_ESELFOVERLAP);
  ck_assert_int_eq(affine_extract(&t.map, 0, 4, full, s0, msg, sizeof msg),
                   SP_ESELFOVERLAP);
  a = p2(2, 2, 0, 0, 1, 0, 2, 1, R0, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EZEROSTRIDE);
  a = p2(2, 2, 0, 2, 1, 0, 1, 1, R0, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_ESELFOVERLAP);
  ck_assert_ptr_nonnull(strstr(msg, "destination"));
  /* The check is conservative: interleaved without overlap is refused. */
  a = p2(3, 2, 0, 2, 3, 0, 2, 1, R0, 1);
  ck_assert_int_eq(affine_check_rank(&t.map, 0, msg, sizeof msg),
                   SP_ESELFOVERLAP);
}
END_TEST

START_TEST(bounds_and_holders_checked) {
  struct affine_piece a = p1(4, 1, 0, R0, 1), b = p1(4, 0, 4, R1, 1);
  struct two t;
  char msg[256];

  two_init(&t, 1, 8, 0, 4, &a, 1, 4, &b, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_ESOURCEBOUNDS);
  a = p1(4, -1, 0, R0, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_ESOURCEBOUNDS);
  a = p1(4, 0, 0, R0, 1);
  b = p1(4, 0, 5, R1, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDESTBOUNDS);
  ck_assert_ptr_nonnull(strstr(msg, "rank 1"));
  b = p1(4, 0, 4, R1, 1);
  b.dst_stride[0] = -1;
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EUNSUPPORTED);
  b = p1(4, 0, 4, R0, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EINVAL);
  b = p1(4, 0, 4, (const uint32_t[]){1, 2}, 2);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EINVAL);
  b = p1(4, 0, 4, (const uint32_t[]){1, 0}, 2);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EINVAL);
  b = p1(4, 0, 4, R1, 1);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), 0);
  ck_assert_int_eq(affine_check_rank(&t.map, 2, msg, sizeof msg), SP_ERANK);
}
END_TEST

/* Two pieces of one rank reading one shard element: extract would write
 * it twice, rebuild would send one value to two places. */
START_TEST(shard_element_read_twice_refused) {
  struct affine_piece a[2] = {p1(4, 0, 0, R0, 1), p1(4, 3, 4, R0, 1)};
  struct two t;
  char msg[256];

  two_init(&t, 1, 8, 0, 8, a, 2, 0, NULL, 0);
  ck_assert_int_eq(affine_validate(&t.map, msg, sizeof msg), SP_EDOUBLEWRITE);
  ck_assert_ptr_nonnull(strstr(msg, "reads element 3 of its shard"));
  ck_assert_ptr_nonnull(strstr(msg, "pieces 0 and 1"));
}
END_TEST

START_TEST(extract_zeroes_padding) {
  struct affine_piece a = p1(4, 0, 0, R0, 1), b = p1(4, 0, 4, R1, 1);
  struct two t;
  uint32_t full[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint32_t shard[6];
  char msg[256];

  memset(shard, 0xee, sizeof shard);
  two_init(&t, 1, 8, 0, 6, &a, 1, 4, &b, 1);
  ck_assert_int_eq(affine_extract(&t.map, 0, 4, full, shard, msg, sizeof msg),
                   0);
  ck_assert_uint_eq(shard[3], 4);
  ck_assert_uint_eq(shard[4], 0);
  ck_assert_uint_eq(shard[5], 0);
}
END_TEST

/* A (4, 6) tensor: columns 0-2 on rank 0, 3-5 on rank 1; then the same
 * tensor with columns dealt alternately (interleaved destinations). */
START_TEST(column_splits_round_trip) {
  struct affine_piece a = p2(4, 3, 0, 3, 1, 0, 6, 1, R0, 1);
  struct affine_piece b = p2(4, 3, 0, 3, 1, 3, 6, 1, R1, 1);
  struct two t;

  two_init(&t, 2, 4, 6, 12, &a, 1, 12, &b, 1);
  round_trip(&t.map, 24);
  a = p2(4, 3, 0, 3, 1, 0, 6, 2, R0, 1);
  b = p2(4, 3, 0, 3, 1, 1, 6, 2, R1, 1);
  round_trip(&t.map, 24);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-affine");
  TCase *tc = tcase_create("affine");
  SRunner *sr;
  int failed;

  tcase_add_test(tc, two_ranks_claiming_one_block_refused);
  tcase_add_test(tc, destination_collision_of_any_stride_refused);
  tcase_add_test(tc, replicas_cut_at_different_boundaries_compared_in_full);
  tcase_add_test(tc, uncovered_element_refused);
  tcase_add_test(tc, replica_over_single_holder_refused_in_either_order);
  tcase_add_test(tc, view_overlapping_itself_refused);
  tcase_add_test(tc, bounds_and_holders_checked);
  tcase_add_test(tc, shard_element_read_twice_refused);
  tcase_add_test(tc, extract_zeroes_padding);
  tcase_add_test(tc, column_splits_round_trip);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
