/*
 * test_regoverlap.c - a file range against a registry's host storages
 * (daemon/regoverlap.h): storages that share a mapped page with the range
 * but none of its bytes are not met, edges are exact, another file and an
 * empty range meet nothing.
 */
#include <check.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/registry.h"
#include "daemon/regoverlap.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

/* One memfd of three pages; sid 5 at bytes [page + 100, page + 200) and
 * sid 3 at [2 * page, 2 * page + 10), so both share pages with bytes no
 * storage holds. */
struct world {
  struct registry reg;
  int fd;
  struct stat st;
  uint64_t page;
};

static void world_init(struct world *w) {
  w->page = (uint64_t)sysconf(_SC_PAGESIZE);
  registry_init(&w->reg, SP_DEVICE_CPU);
  w->fd = tmodel_memfd("regoverlap", (size_t)(3 * w->page));
  ck_assert_int_eq(fstat(w->fd, &w->st), 0);
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = w->fd;
  struct req_storage s[2] = {{.sid = 5,
                              .fd = 0,
                              .offset = w->page + 100,
                              .length = 100,
                              .base = 0x100000},
                             {.sid = 3,
                              .fd = 0,
                              .offset = 2 * w->page,
                              .length = 10,
                              .base = 0x200000}};
  char msg[256];
  ck_assert_msg(registry_add_storages(&w->reg, s, 2, &frame, msg, sizeof msg) ==
                    0,
                "%s", msg);
}

static void world_free(struct world *w) {
  registry_free(&w->reg);
  close(w->fd);
}

static uint32_t meets(const struct world *w, uint64_t offset, uint64_t length) {
  return regoverlap_sid(&w->reg, w->st.st_dev, w->st.st_ino, offset, length);
}

START_TEST(bytes_of_a_storage_are_met_exactly_at_its_edges) {
  struct world w;
  world_init(&w);
  uint64_t p = w.page;
  ck_assert_uint_eq(meets(&w, 0, p + 100), 0);
  ck_assert_uint_eq(meets(&w, 0, p + 101), 5);
  ck_assert_uint_eq(meets(&w, p + 199, 1), 5);
  ck_assert_uint_eq(meets(&w, p + 200, p - 200), 0);
  ck_assert_uint_eq(meets(&w, 2 * p + 9, 1), 3);
  ck_assert_uint_eq(meets(&w, 2 * p + 10, p - 10), 0);
  world_free(&w);
}
END_TEST

START_TEST(the_lowest_sid_of_several) {
  struct world w;
  world_init(&w);
  ck_assert_uint_eq(meets(&w, 0, 3 * w.page), 3);
  ck_assert_uint_eq(meets(&w, w.page + 150, UINT64_MAX), 3);
  world_free(&w);
}
END_TEST

START_TEST(another_file_and_an_empty_range_meet_nothing) {
  struct world w;
  world_init(&w);
  int other = tmodel_memfd("regoverlap-other", (size_t)(3 * w.page));
  struct stat st;
  ck_assert_int_eq(fstat(other, &st), 0);
  ck_assert_uint_eq(regoverlap_sid(&w.reg, st.st_dev, st.st_ino, 0, 3 * w.page),
                    0);
  ck_assert_uint_eq(meets(&w, w.page + 150, 0), 0);
  close(other);
  world_free(&w);
}
END_TEST

int main(void) {
  Suite *s = suite_create("regoverlap");
  TCase *tc = tcase_create("regoverlap");
  tcase_add_test(tc, bytes_of_a_storage_are_met_exactly_at_its_edges);
  tcase_add_test(tc, the_lowest_sid_of_several);
  tcase_add_test(tc, another_file_and_an_empty_range_meet_nothing);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
