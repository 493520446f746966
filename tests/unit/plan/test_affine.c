/*
 * test_affine.c - affine validation, rebuild and extract (seed 003).
 */
#include <check.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "daemon/plan/affine.h"
#include "shardport.h"
#include "tests/unit/plan/oracle.h"

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
    ck_assert_msg(oracle_extract(map, r, 4, full, shard[r], msg, sizeof msg) ==
                      0,
                  "%s", msg);
  }
  ck_assert_msg(oracle_rebuild(map, 4, (const void *const *)shard, back, msg,
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
  ck_assert_int_eq(oracle_rebuild(&t.map, 4, shards, full, msg, sizeof msg),
                   SP_EDOUBLEWRITE);
  b.dst_offset = 4;
  ck_assert_int_eq(oracle_rebuild(&t.map, 4, shards, full, msg, sizeof msg), 0);
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
  /* Each rank on its own is fine: only the check across ranks sees it. */
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
  ck_assert_int_eq(oracle_extract(&t.map, 0, 4, full, s0, msg, sizeof msg), 0);
  ck_assert_int_eq(oracle_extract(&t.map, 1, 4, full, s1, msg, sizeof msg), 0);
  s1[6] ^= 1; /* the second half drifts */
  ck_assert_int_eq(oracle_rebuild(&t.map, 4, shards, back, msg, sizeof msg),
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
  ck_assert_int_eq(oracle_rebuild(&t.map, 4, shards, full, msg, sizeof msg),
                   SP_ESELFOVERLAP);
  ck_assert_int_eq(oracle_extract(&t.map, 0, 4, full, s0, msg, sizeof msg),
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
  ck_assert_int_eq(oracle_extract(&t.map, 0, 4, full, shard, msg, sizeof msg),
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

/* A (rows, 16, 2) piece with strides (64, 4, 1): columns 4c + off and
 * 4c + off + 1 of rows [row0, row0 + rows) of a (50, 64) tensor. */
static struct affine_piece pairs(int64_t rows, int64_t off,
                                 const uint32_t *holders, uint32_t nholders) {
  struct affine_piece p = {.ndim = 3,
                           .shape = {rows, 16, 2},
                           .src_stride = {32, 2, 1},
                           .dst_offset = off,
                           .dst_stride = {64, 4, 1},
                           .nholders = nholders,
                           .holders = holders};
  return p;
}

/* Replicas that overlap one another: rank 0's covers columns 1 and 2 mod 4
 * of rows 0-19, rank 1's columns 2 and 3 mod 4 of rows 0-39; rank 2 alone
 * holds columns 0 mod 4 of rows 0-39, columns 1 mod 4 of rows 20-39 and
 * the last 10 rows whole.  The runs repeat every 4 elements, so the sweep
 * skips most of the rows, and must stop before rank 0's replica ends, where
 * a single holder's elements begin. */
START_TEST(overlapping_replicas_over_many_rows) {
  static const uint32_t R2[] = {2};
  const int64_t shape[2] = {50, 64};
  struct affine_piece a = pairs(20, 1, R01, 2), b = pairs(40, 2, R01, 2);
  struct affine_piece single[4] = {
      p2(40, 16, 0, 16, 1, 0, 64, 4, R2, 1),
      p2(20, 16, 640, 16, 1, 20 * 64 + 1, 64, 4, R2, 1),
      p1(640, 960, 40 * 64, R2, 1), p1(1, 1600, 30 * 64 + 6, R2, 1)};
  struct affine_shard shards[3] = {
      {640, 1, &a}, {1280, 1, &b}, {1601, 3, single}};
  struct affine_map map = {"w", 2, shape, 3, shards, NULL};
  char msg[256];

  ck_assert_msg(affine_validate(&map, msg, sizeof msg) == 0, "%s", msg);
  /* Columns 0 mod 4 stop a row short: that row's first element is the
   * first one nobody writes. */
  single[0].shape[0] = 39;
  ck_assert_int_eq(affine_validate(&map, msg, sizeof msg), SP_EUNCOVERED);
  ck_assert_ptr_nonnull(strstr(msg, "element [39, 0]"));
  /* One more element of rank 2 lands on a replica, 30 rows down. */
  single[0].shape[0] = 40;
  shards[2].npieces = 4;
  ck_assert_int_eq(affine_validate(&map, msg, sizeof msg), SP_EDOUBLEWRITE);
  ck_assert_ptr_nonnull(strstr(msg, "element [30, 6]"));
  ck_assert_ptr_nonnull(strstr(msg, "(piece 3, single holder)"));
}
END_TEST

static long max_rss_kib(void) {
  struct rusage ru;
  ck_assert_int_eq(getrusage(RUSAGE_SELF, &ru), 0);
  return ru.ru_maxrss;
}

/* One rank, a shard of 2^31 uint8 elements (a sparse file costs nothing to
 * register) and one piece: the checks cost what the piece does, not a byte
 * per element of the shard and of the full tensor (4 GiB, the daemon's
 * resident set for as long as the checks ran). */
START_TEST(huge_sparse_layout_checked_in_the_memory_of_its_pieces) {
  const int64_t n = (int64_t)1 << 31;
  const int64_t shape[1] = {n};
  struct affine_piece piece = p1(1, 0, 0, R0, 1);
  struct affine_shard shard = {(uint64_t)n, 1, &piece};
  struct affine_map map = {"huge", 1, shape, 1, &shard, NULL};
  long before = max_rss_kib();
  char msg[256];

  ck_assert_int_eq(affine_validate(&map, msg, sizeof msg), SP_EUNCOVERED);
  ck_assert_ptr_nonnull(strstr(msg, "element [1]"));
  piece.shape[0] = n;
  ck_assert_msg(affine_validate(&map, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_int_eq(affine_check_rank(&map, 0, msg, sizeof msg), 0);
  ck_assert_msg(max_rss_kib() - before < 16 * 1024,
                "the peak resident set grew from %ld to %ld KiB", before,
                max_rss_kib());
}
END_TEST

/* A valid layout of 2^22 elements in 22 pieces whose runs are single
 * elements at periods 2, 4, ..., 2^22 (element e in the piece of the lowest
 * zero bit of e), and e = 2^22 - 1 alone: no run pattern repeats before
 * the end, so the sweep visits every element. */
struct dyadic {
  int64_t shape[1];
  struct affine_piece pieces[23];
  struct affine_shard shard;
  struct affine_map map;
};

static void dyadic_init(struct dyadic *d, const _Atomic bool *stop) {
  const int64_t n = (int64_t)1 << 22;

  d->shape[0] = n;
  /* The shard is laid out like the full tensor, so that both sides of the
   * checks visit every element. */
  for (int i = 0; i < 22; i++) {
    int64_t first = ((int64_t)1 << i) - 1;
    d->pieces[i] = p1(n >> (i + 1), first, first, R0, 1);
    d->pieces[i].src_stride[0] = (int64_t)2 << i;
    d->pieces[i].dst_stride[0] = (int64_t)2 << i;
  }
  d->pieces[22] = p1(1, n - 1, n - 1, R0, 1);
  d->shard = (struct affine_shard){(uint64_t)n, 23, d->pieces};
  d->map = (struct affine_map){"dyadic", 1, d->shape, 1, &d->shard, stop};
}

/* Planning stops when asked, in the middle of one key's checks (the
 * export's timeout sets the flag from another thread). */
START_TEST(checks_stop_when_asked) {
  static struct dyadic d;
  _Atomic bool stop = false;
  char msg[256];

  dyadic_init(&d, &stop);
  ck_assert_msg(affine_validate(&d.map, msg, sizeof msg) == 0, "%s", msg);
  atomic_store(&stop, true);
  ck_assert_int_eq(affine_validate(&d.map, msg, sizeof msg), SP_ETIMEOUT);
  ck_assert_ptr_nonnull(strstr(msg, "key 'dyadic': planning was stopped"));
  ck_assert_int_eq(affine_check_rank(&d.map, 0, msg, sizeof msg), SP_ETIMEOUT);
  d.map.stop = NULL;
  ck_assert_msg(affine_check_rank(&d.map, 0, msg, sizeof msg) == 0, "%s", msg);
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
  tcase_add_test(tc, overlapping_replicas_over_many_rows);
  tcase_add_test(tc, huge_sparse_layout_checked_in_the_memory_of_its_pieces);
  tcase_add_test(tc, checks_stop_when_asked);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
