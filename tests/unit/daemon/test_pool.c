/*
 * test_pool.c - the warm pool (daemon/pool.h): a released host segment is
 * kept for its owner and handed back to that owner only; it counts in the
 * pool while kept, and goes when its owner does or when an allocation
 * needs the room, still counted while a rank maps it.
 *
 * Owners are job members in the daemon; here any two distinct addresses
 * stand for two ranks.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/pool.h"
#include "shardport.h"

#define SEG (64u << 10)

static const int rank_a = 0, rank_b = 1;
#define A ((const void *)&rank_a)
#define B ((const void *)&rank_b)

static struct pool *new_pool(uint64_t capacity) {
  struct pool *pool = NULL;
  ck_assert_int_eq(pool_create(capacity, 0, &pool), 0);
  return pool;
}

START_TEST(owner_gets_its_segment_back) {
  struct pool *pool = new_pool(16 * SEG);
  struct pool_segment *a, *b, *again;
  ck_assert_int_eq(pool_segment_new(pool, 2 * SEG, A, &a), 0);
  ck_assert(!a->warm);
  memset(a->base, 0x5A, a->size);
  pool_segment_put(pool, a);
  ck_assert_uint_eq(pool_kept(pool), 2 * SEG);
  ck_assert_uint_eq(pool_used(pool), 2 * SEG);
  /* Another owner of the same size gets a new, zeroed segment. */
  ck_assert_int_eq(pool_segment_new(pool, 2 * SEG, B, &b), 0);
  ck_assert_ptr_ne(b, a);
  ck_assert(!b->warm);
  for (uint64_t i = 0; i < b->size; i++)
    ck_assert_uint_eq(b->base[i], 0);
  ck_assert_uint_eq(pool_used(pool), 4 * SEG);
  /* The owner's next export that fits, smaller too, gets its own back,
   * warm, its earlier bytes in it (the engine overwrites or zeroes them). */
  ck_assert_int_eq(pool_segment_new(pool, SEG, A, &again), 0);
  ck_assert_ptr_eq(again, a);
  ck_assert(again->warm);
  ck_assert_uint_eq(again->size, 2 * SEG);
  ck_assert_uint_eq(again->base[0], 0x5A);
  ck_assert_uint_eq(pool_kept(pool), 0);
  ck_assert_uint_eq(pool_used(pool), 4 * SEG);
  /* One that does not fit is a new segment. */
  pool_segment_put(pool, again);
  struct pool_segment *big;
  ck_assert_int_eq(pool_segment_new(pool, 3 * SEG, A, &big), 0);
  ck_assert_ptr_ne(big, a);
  ck_assert_uint_eq(pool_kept(pool), 2 * SEG);
  pool_segment_free(pool, big);
  pool_segment_free(pool, b);
  pool_destroy(pool);
}
END_TEST

START_TEST(kept_segment_goes_with_its_owner) {
  struct pool *pool = new_pool(16 * SEG);
  struct pool_segment *a, *b;
  ck_assert_int_eq(pool_segment_new(pool, SEG, A, &a), 0);
  ck_assert_int_eq(pool_segment_new(pool, 2 * SEG, B, &b), 0);
  pool_segment_put(pool, a);
  pool_segment_put(pool, b);
  ck_assert_uint_eq(pool_kept_count(pool), 2);
  pool_owner_gone(pool, A);
  ck_assert_uint_eq(pool_kept_count(pool), 1);
  ck_assert_uint_eq(pool_kept(pool), 2 * SEG);
  ck_assert_uint_eq(pool_used(pool), 2 * SEG);
  pool_owner_gone(pool, B);
  ck_assert_uint_eq(pool_used(pool), 0);
  pool_destroy(pool);
}
END_TEST

START_TEST(no_owner_is_never_kept) {
  struct pool *pool = new_pool(16 * SEG);
  struct pool_segment *s;
  ck_assert_int_eq(pool_segment_new(pool, SEG, NULL, &s), 0);
  pool_segment_put(pool, s);
  ck_assert_uint_eq(pool_kept_count(pool), 0);
  ck_assert_uint_eq(pool_used(pool), 0);
  pool_destroy(pool);
}
END_TEST

/* A segment kept for one owner is freed when another's allocation needs
 * its room, at the edge: exactly the capacity fits. */
START_TEST(kept_segment_makes_room) {
  struct pool *pool = new_pool(4 * SEG);
  struct pool_segment *a, *b, *c;
  ck_assert_int_eq(pool_segment_new(pool, 3 * SEG, A, &a), 0);
  pool_segment_put(pool, a);
  /* Room without it: it stays. */
  ck_assert_int_eq(pool_segment_new(pool, SEG, B, &b), 0);
  ck_assert_uint_eq(pool_kept(pool), 3 * SEG);
  ck_assert_uint_eq(pool_used(pool), 4 * SEG);
  pool_segment_free(pool, b);
  /* One byte more than the room left: it goes. */
  ck_assert_int_eq(pool_segment_new(pool, SEG + 1, B, &c), 0);
  ck_assert_uint_eq(pool_kept(pool), 0);
  ck_assert_uint_eq(pool_used(pool), SEG + 1);
  pool_segment_free(pool, c);
  /* Beyond the capacity even with nothing kept: refused. */
  ck_assert_int_eq(pool_segment_new(pool, 4 * SEG + 1, B, &c), SP_EPOOL);
  pool_destroy(pool);
}
END_TEST

/* An evicted segment that its rank still maps is counted until the rank
 * lets it go: its room is not handed out before. */
START_TEST(evicted_segment_counted_while_mapped) {
  struct pool *pool = new_pool(4 * SEG);
  struct pool_segment *a, *b;
  char msg[256];
  ck_assert_int_eq(pool_segment_new(pool, 3 * SEG, A, &a), 0);
  int fd = pool_segment_share(pool, a, msg, sizeof msg);
  ck_assert_msg(fd >= 0, "%s", msg);
  void *map = mmap(NULL, 3 * SEG, PROT_READ, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(map, MAP_FAILED);
  close(fd);
  pool_segment_put(pool, a);
  ck_assert_int_eq(pool_segment_new(pool, 2 * SEG, B, &b), SP_EPOOL);
  ck_assert_uint_eq(pool_kept(pool), 0);
  ck_assert_uint_eq(pool_held(pool), 3 * SEG);
  ck_assert_uint_eq(pool_used(pool), 3 * SEG);
  munmap(map, 3 * SEG);
  ck_assert_int_eq(pool_segment_new(pool, 2 * SEG, B, &b), 0);
  ck_assert_uint_eq(pool_held(pool), 0);
  ck_assert_uint_eq(pool_used(pool), 2 * SEG);
  pool_segment_free(pool, b);
  pool_destroy(pool);
}
END_TEST

/* A rank that leaves holding a host export abandons its segment, which is
 * kept for it like a released one, and the member's end then lets it go
 * (job.c: member_free abandons, then calls pool_owner_gone): a new owner
 * that the allocator places at the departed one's address gets a fresh,
 * zeroed segment, never the departed rank's bytes. */
START_TEST(abandoned_segment_never_reaches_the_next_owner) {
  struct pool *pool = new_pool(16 * SEG);
  struct pool_segment *a, *next;
  ck_assert_int_eq(pool_segment_new(pool, SEG, A, &a), 0);
  memset(a->base, 0x77, a->size);
  pool_segment_abandon(pool, a, -1);
  ck_assert_uint_eq(pool_kept_count(pool), 1);
  pool_owner_gone(pool, A);
  ck_assert_uint_eq(pool_kept_count(pool), 0);
  ck_assert_uint_eq(pool_used(pool), 0);
  ck_assert_int_eq(pool_segment_new(pool, SEG, A, &next), 0);
  ck_assert(!next->warm);
  for (uint64_t i = 0; i < next->size; i++)
    ck_assert_uint_eq(next->base[i], 0);
  pool_segment_free(pool, next);
  pool_destroy(pool);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("warm");
  tcase_add_test(tc, owner_gets_its_segment_back);
  tcase_add_test(tc, kept_segment_goes_with_its_owner);
  tcase_add_test(tc, no_owner_is_never_kept);
  tcase_add_test(tc, kept_segment_makes_room);
  tcase_add_test(tc, evicted_segment_counted_while_mapped);
  tcase_add_test(tc, abandoned_segment_never_reaches_the_next_owner);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
