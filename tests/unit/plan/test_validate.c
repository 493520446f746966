/*
 * test_validate.c - every cross-rank refusal, seen from every rank.
 *
 * A daemon gathers the metadata with its own ranks first, and ranks list
 * their keys in any order; each refusal is checked from the point of view
 * of every rank (the agreeing ones and the one that disagrees), with keys
 * shuffled as well, and must carry the same code and the same message,
 * naming the key and the ranks.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shardport.h"
#include "daemon/plan/plan.h"
#include "tests/unit/plan/tjob.h"

static const int64_t SHAPE2[2] = {8, 4};

/* A job of `world` ranks with shard0 keys a, b, c (rows dealt unevenly) and
 * a replicated key r. */
static struct tjob *dense_job(uint32_t world) {
  struct tjob *job = tjob_new(world);
  int64_t rows[8];
  for (uint32_t r = 0; r < world; r++)
    rows[r] = r == 0 ? 8 - (int64_t)(world - 1) * 2 : 2;
  tjob_shard0(job, "a", SP_DTYPE_FLOAT32, 2, SHAPE2, rows);
  tjob_shard0(job, "b", SP_DTYPE_BFLOAT16, 2, SHAPE2, rows);
  tjob_shard0(job, "c", SP_DTYPE_INT8, 2, SHAPE2, rows);
  tjob_whole(job, "r", PLAN_REPLICATED, SP_DTYPE_FLOAT32, 2, SHAPE2);
  return job;
}

/* The same code and message from every rank's point of view, keys in
 * their order and shuffled; the message names what `needles` list. */
static void expect_refusal(struct tjob *job, int code, const char *needle1,
                           const char *needle2) {
  char first[512] = "", msg[512];
  const struct plan_input *in = tjob_input(job, 0, 0);
  uint32_t world = in->world;

  for (uint32_t view = 0; view < world; view++) {
    for (uint64_t seed = 0; seed < 3; seed++) {
      struct plan *plan = (struct plan *)&first;
      int rc = plan_build(tjob_input(job, view, seed), &plan, msg, sizeof msg);
      ck_assert_msg(rc == code, "rank %u's view: got %d (%s), want %d", view,
                    rc, msg, code);
      ck_assert_ptr_null(plan);
      if (first[0] == '\0')
        memcpy(first, msg, sizeof first);
      else
        ck_assert_str_eq(msg, first);
    }
  }
  if (needle1 != NULL)
    ck_assert_msg(strstr(first, needle1) != NULL, "'%s' lacks '%s'", first,
                  needle1);
  if (needle2 != NULL)
    ck_assert_msg(strstr(first, needle2) != NULL, "'%s' lacks '%s'", first,
                  needle2);
}

static void expect_plan(struct tjob *job) {
  struct plan *plan;
  char msg[512];
  ck_assert_msg(plan_build(tjob_input(job, 0, 0), &plan, msg, sizeof msg) == 0,
                "%s", msg);
  plan_free(plan);
}

START_TEST(valid_job_is_planned) {
  struct tjob *job = dense_job(4);
  expect_plan(job);
  tjob_free(job);
}
END_TEST

START_TEST(key_sets_differ) {
  struct tjob *job = dense_job(4);
  tjob_drop(job, 2, "b");
  expect_refusal(job, SP_EKEYSET, "key 'b'",
                 "by ranks 0, 1 and 3 but not by rank 2");
  tjob_free(job);
}
END_TEST

START_TEST(placement_differs) {
  struct tjob *job = dense_job(4);
  tjob_key(job, 1, "a")->placement = PLAN_REPLICATED;
  expect_refusal(job, SP_EPLACEMENT, "key 'a'",
                 "shard0 on rank 0 but replicated on rank 1");
  tjob_free(job);
}
END_TEST

START_TEST(dtype_differs) {
  struct tjob *job = dense_job(4);
  tjob_key(job, 3, "b")->view.dtype = SP_DTYPE_FLOAT16;
  expect_refusal(job, SP_EDTYPEMISMATCH, "key 'b'",
                 "bfloat16 on rank 0 but float16 on rank 3");
  tjob_free(job);
}
END_TEST

START_TEST(declared_device_differs) {
  struct tjob *job = dense_job(3);
  tjob_key(job, 1, "c")->device_type = SP_DEVICE_CUDA;
  expect_refusal(job, SP_EDEVICEMISMATCH, "key 'c'", "cuda by rank 1");
  tjob_free(job);
}
END_TEST

START_TEST(global_shape_differs) {
  struct tjob *job = dense_job(4);
  tjob_key(job, 2, "r")->shape[1] = 5;
  expect_refusal(job, SP_ESHAPE, "key 'r'", "(8, 5) on rank 2");
  tjob_free(job);
}
END_TEST

START_TEST(shards_do_not_tile) {
  struct tjob *job = tjob_new(3);
  const int64_t rows[3] = {2, 2, 2}, shape[2] = {7, 3};
  tjob_shard0(job, "t", SP_DTYPE_FLOAT32, 2, shape, rows);
  expect_refusal(job, SP_ETILING, "key 't'", "hold 6 rows");
  tjob_free(job);
  /* A padded chunk (FSDP's padding) is refused too: more rows than the
   * tensor has. */
  job = tjob_new(2);
  tjob_shard0(job, "t", SP_DTYPE_FLOAT32, 2, shape, (const int64_t[]){4, 4});
  expect_refusal(job, SP_ETILING, "key 't'", "hold 8 rows");
  tjob_free(job);
  job = tjob_new(2);
  tjob_shard0(job, "t", SP_DTYPE_FLOAT32, 2, shape, (const int64_t[]){4, 3});
  tjob_key(job, 1, "t")->view.shape[1] = 2;
  tjob_key(job, 1, "t")->view.stride[0] = 2;
  tjob_key(job, 1, "t")->nbytes = 24;
  expect_refusal(job, SP_ETILING, "rank 1's shard has shape (3, 2)", NULL);
  tjob_free(job);
}
END_TEST

START_TEST(shards_on_two_device_types) {
  struct tjob *job = dense_job(4);
  tjob_storage(job, 2, "a")->device.type = SP_DEVICE_CUDA;
  expect_refusal(job, SP_EMIXEDDEVICE, "key 'a'",
                 "cpu by rank 0 but on cuda by rank 2");
  tjob_free(job);
}
END_TEST

START_TEST(expert_held_twice) {
  struct tjob *job = dense_job(3);
  tjob_expert(job, 0, "e", SP_DTYPE_FLOAT32, 2, SHAPE2);
  tjob_expert(job, 2, "e", SP_DTYPE_FLOAT32, 2, SHAPE2);
  expect_refusal(job, SP_EEXPERT, "key 'e'", "ranks 0 and 2");
  tjob_free(job);
}
END_TEST

START_TEST(expert_on_one_rank_dense_on_others) {
  struct tjob *job = dense_job(3);
  tjob_key(job, 1, "c")->placement = PLAN_EXPERT;
  expect_refusal(job, SP_EPLACEMENT, "key 'c'",
                 "expert on rank 1 but shard0 on rank 0");
  tjob_free(job);
}
END_TEST

START_TEST(groups_differ) {
  struct tjob *job = dense_job(3);
  tjob_group(job, PLAN_NONE, 2, (const char *const[]){"a", "b"});
  tjob_group(job, 1, 2, (const char *const[]){"b", "c"});
  expect_refusal(job, SP_EGROUPS, "ranks 0 and 1", "key 'b'");
  tjob_free(job);

  job = dense_job(3);
  tjob_group(job, PLAN_NONE, 2, (const char *const[]){"a", "zz"});
  expect_refusal(job, SP_EGROUPS, "unregistered key 'zz'", "rank 0");
  tjob_free(job);

  job = dense_job(3);
  tjob_expert(job, 1, "e", SP_DTYPE_FLOAT32, 2, SHAPE2);
  tjob_group(job, PLAN_NONE, 2, (const char *const[]){"a", "e"});
  expect_refusal(job, SP_EGROUPS, "expert key 'e'", NULL);
  tjob_free(job);
}
END_TEST

/* Groups listed in other orders, with repeats, are the same groups. */
START_TEST(groups_in_any_order_agree) {
  struct tjob *job = dense_job(3);
  tjob_group(job, 0, 2, (const char *const[]){"a", "b"});
  tjob_group(job, 0, 2, (const char *const[]){"c", "r"});
  tjob_group(job, 1, 3, (const char *const[]){"r", "c", "r"});
  tjob_group(job, 1, 2, (const char *const[]){"b", "a"});
  tjob_group(job, 2, 2, (const char *const[]){"b", "a"});
  tjob_group(job, 2, 1, (const char *const[]){"b"});
  tjob_group(job, 2, 2, (const char *const[]){"c", "r"});
  expect_plan(job);
  tjob_free(job);
}
END_TEST

START_TEST(bytes_disagree_with_view) {
  struct tjob *job = dense_job(4);
  tjob_key(job, 2, "c")->nbytes += 1;
  expect_refusal(job, SP_EBYTES, "key 'c'", "rank 2 reports 9 bytes");
  tjob_free(job);
}
END_TEST

START_TEST(key_registered_twice) {
  struct tjob *job = dense_job(3);
  tjob_duplicate(job, 1, "c");
  tjob_duplicate(job, 1, "b");
  expect_refusal(job, SP_EDUPKEY, "key 'b'", "rank 1");
  tjob_free(job);
}
END_TEST

START_TEST(bad_rank_numbers) {
  struct tjob *job = dense_job(3);
  struct plan *plan;
  char msg[256];
  struct plan_input in = *tjob_input(job, 0, 0);

  tjob_ranks(job)[2].rank = 0;
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ERANK);
  ck_assert_ptr_nonnull(strstr(msg, "rank 2 is missing"));
  tjob_ranks(job)[2].rank = 7;
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ERANK);
  ck_assert_ptr_nonnull(strstr(msg, "rank 7 is outside"));
  tjob_ranks(job)[2].rank = 2;
  in.nranks = 2;
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ERANK);
  in.nranks = 3;
  in.world = 0;
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ERANK);
  tjob_free(job);
}
END_TEST

START_TEST(views_checked_against_storages) {
  struct tjob *job = dense_job(3);
  tjob_key(job, 1, "b")->storage = 99;
  expect_refusal(job, SP_ENOSTORAGE, "key 'b' on rank 1", "storage 99");
  tjob_free(job);

  job = dense_job(3);
  tjob_storage(job, 2, "a")->nbytes -= 1;
  expect_refusal(job, SP_EOUTOFBOUNDS, "key 'a' on rank 2", NULL);
  tjob_free(job);

  job = dense_job(3);
  tjob_key(job, 0, "a")->view.stride[0] = 0;
  expect_refusal(job, SP_EZEROSTRIDE, "key 'a' on rank 0", NULL);
  tjob_free(job);
}
END_TEST

START_TEST(unsupported_layouts) {
  struct tjob *job = tjob_new(2);
  const int64_t rows[2] = {0, 0};
  const int64_t none[1] = {0};
  tjob_shard0(job, "s", SP_DTYPE_FLOAT32, 0, none, rows);
  expect_refusal(job, SP_EUNSUPPORTED, "key 's' is a 0-d tensor", NULL);
  tjob_free(job);

  job = dense_job(2);
  tjob_key(job, 1, "a")->placement = (enum plan_placement)42;
  expect_refusal(job, SP_EUNSUPPORTED, "unknown placement 42", "rank 1");
  tjob_free(job);
}
END_TEST

START_TEST(whole_placements_hold_the_global_shape) {
  struct tjob *job = dense_job(3);
  struct plan_key_in *e = tjob_key(job, 1, "r");
  e->view.shape[0] = 4;
  e->nbytes = 4 * 4 * 4;
  expect_refusal(job, SP_ESHAPE, "key 'r' is replicated", "rank 1 holds");
  tjob_free(job);
}
END_TEST

/* Affine refusals reach the planner with the key's name. */
START_TEST(affine_refusals_through_the_planner) {
  static const uint32_t h0[] = {0}, h1[] = {1};
  const int64_t shape[1] = {8};
  const uint64_t numel[2] = {4, 4};
  struct affine_piece a = {.ndim = 1,
                           .shape = {4},
                           .src_stride = {1},
                           .dst_stride = {1},
                           .nholders = 1,
                           .holders = h0};
  struct affine_piece b = a;
  const struct affine_piece *pieces[2] = {&a, &b};
  const size_t npieces[2] = {1, 1};
  struct tjob *job = tjob_new(2);

  b.holders = h1;
  tjob_affine(job, "m", SP_DTYPE_FLOAT32, 1, shape, numel, pieces, npieces);
  expect_refusal(job, SP_EDOUBLEWRITE, "key 'm'", "rank 1");
  b.dst_offset = 4;
  expect_plan(job);
  b.shape[0] = 3;
  expect_refusal(job, SP_EUNCOVERED, "key 'm'", "element [7]");
  b.shape[0] = 4;
  /* An affine shard must be contiguous: pieces index its elements. */
  tjob_key(job, 0, "m")->view.stride[0] = 2;
  tjob_key(job, 0, "m")->view.shape[0] = 2;
  tjob_key(job, 0, "m")->nbytes = 8;
  expect_refusal(job, SP_EUNSUPPORTED, "key 'm'", "not contiguous");
  tjob_free(job);
}
END_TEST

/* Planning stops, freeing what it took, once its stop flag is set: before
 * the first key when set already, and inside one key's affine checks when
 * set while they run. */
struct stopper {
  _Atomic bool flag;
  pthread_t thread;
};

static void *stop_soon(void *arg) {
  struct stopper *st = arg;
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL);
  atomic_store(&st->flag, true);
  return NULL;
}

START_TEST(planning_stops_when_asked) {
  static const uint32_t h0[] = {0};
  const int64_t n = (int64_t)1 << 30;
  const int64_t shape[1] = {n};
  const uint64_t numel[1] = {(uint64_t)n};
  /* Element e in the piece of the lowest zero bit of e, the last alone:
   * every element a run of its own, a billion of them, in 31 pieces. */
  struct affine_piece pieces[31];
  const struct affine_piece *by_rank[1] = {pieces};
  const size_t npieces[1] = {31};
  struct stopper st = {.flag = false};
  struct tjob *job = tjob_new(1);
  struct plan_input in;
  struct plan *plan;
  char msg[512];

  for (int i = 0; i < 30; i++) {
    int64_t first = ((int64_t)1 << i) - 1;
    pieces[i] = (struct affine_piece){.ndim = 1,
                                      .shape = {n >> (i + 1)},
                                      .src_offset = first,
                                      .src_stride = {(int64_t)2 << i},
                                      .dst_offset = first,
                                      .dst_stride = {(int64_t)2 << i},
                                      .nholders = 1,
                                      .holders = h0};
  }
  pieces[30] = (struct affine_piece){.ndim = 1,
                                     .shape = {1},
                                     .src_offset = n - 1,
                                     .src_stride = {1},
                                     .dst_offset = n - 1,
                                     .dst_stride = {1},
                                     .nholders = 1,
                                     .holders = h0};
  tjob_affine(job, "dyadic", SP_DTYPE_UINT8, 1, shape, numel, by_rank, npieces);
  in = *tjob_input(job, 0, 0);
  in.stop = &st.flag;
  atomic_store(&st.flag, true);
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ETIMEOUT);
  ck_assert_ptr_null(plan);
  ck_assert_str_eq(msg, "planning was stopped");
  atomic_store(&st.flag, false);
  ck_assert_int_eq(pthread_create(&st.thread, NULL, stop_soon, &st), 0);
  ck_assert_int_eq(plan_build(&in, &plan, msg, sizeof msg), SP_ETIMEOUT);
  ck_assert_int_eq(pthread_join(st.thread, NULL), 0);
  ck_assert_ptr_null(plan);
  ck_assert_str_eq(msg, "key 'dyadic': planning was stopped while checking "
                        "its affine pieces");
  tjob_free(job);
}
END_TEST

START_TEST(placement_names_round_trip) {
  for (int p = PLAN_SHARD0; p <= PLAN_AFFINE; p++) {
    const char *name = plan_layout_placement_name((enum plan_placement)p);
    enum plan_placement back;
    ck_assert_int_eq(plan_layout_placement_from_name(name, strlen(name), &back),
                     0);
    ck_assert_int_eq(back, p);
  }
  ck_assert_str_eq(plan_layout_placement_name((enum plan_placement)0),
                   "unknown");
  {
    enum plan_placement back;
    ck_assert_int_eq(plan_layout_placement_from_name("shard", 5, &back),
                     SP_EUNSUPPORTED);
    ck_assert_int_eq(plan_layout_placement_from_name("shard0x", 7, &back),
                     SP_EUNSUPPORTED);
  }
}
END_TEST

/* Keys are validated in runs on several threads, and the refusal is still
 * the first failing key's in name order, however the runs finish: here a
 * later run fails at its first key, an earlier one at its last. */
START_TEST(threads_refuse_the_first_key) {
  struct tjob *job = tjob_new(2);
  const int64_t shape[2] = {2, 4}, rows[2] = {1, 1}, short_rows[2] = {1, 0};

  for (int i = 0; i < 5000; i++) {
    const char *name = tjob_name(job, "k%04d", i);
    tjob_shard0(job, name, SP_DTYPE_FLOAT32, 2, shape,
                i == 2047 || i == 4096 ? short_rows : rows);
  }
  for (uint32_t threads = 1; threads <= 4; threads++) {
    struct plan *plan;
    char msg[512];
    tjob_threads(job, threads);
    ck_assert_int_eq(plan_build(tjob_input(job, 0, 0), &plan, msg, sizeof msg),
                     SP_ETILING);
    ck_assert_msg(strstr(msg, "'k2047'") != NULL, "%u threads: %s", threads,
                  msg);
  }
  tjob_free(job);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-validate");
  TCase *tc = tcase_create("validate");
  SRunner *sr;
  int failed;

  tcase_add_test(tc, placement_names_round_trip);
  tcase_add_test(tc, valid_job_is_planned);
  tcase_add_test(tc, key_sets_differ);
  tcase_add_test(tc, placement_differs);
  tcase_add_test(tc, dtype_differs);
  tcase_add_test(tc, declared_device_differs);
  tcase_add_test(tc, global_shape_differs);
  tcase_add_test(tc, shards_do_not_tile);
  tcase_add_test(tc, shards_on_two_device_types);
  tcase_add_test(tc, expert_held_twice);
  tcase_add_test(tc, expert_on_one_rank_dense_on_others);
  tcase_add_test(tc, groups_differ);
  tcase_add_test(tc, groups_in_any_order_agree);
  tcase_add_test(tc, bytes_disagree_with_view);
  tcase_add_test(tc, key_registered_twice);
  tcase_add_test(tc, bad_rank_numbers);
  tcase_add_test(tc, views_checked_against_storages);
  tcase_add_test(tc, unsupported_layouts);
  tcase_add_test(tc, whole_placements_hold_the_global_shape);
  tcase_add_test(tc, affine_refusals_through_the_planner);
  tcase_add_test(tc, planning_stops_when_asked);
  tcase_add_test(tc, threads_refuse_the_first_key);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
