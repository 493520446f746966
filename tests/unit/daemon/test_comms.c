/*
 * test_comms.c - a job's NCCL communicators through their states (comms.c)
 * on the fake CUDA runtime and fake NCCL (docs/fakes.md): started as the
 * ranks join, set up once every rank is in, taken over and warmed by the
 * first export, dropped when a rank leaves first or when the export's
 * ranks are not the ones that joined, replaced by a new generation, and
 * refused when a failure aborted them and no new id came.
 *
 * Both ranks of the job are on this process's two fake GPUs, so NCCL's
 * set-up completes here.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/comms.h"
#include "daemon/cuda/gpu.h"
#include "daemon/job.h"
#include "shardport.h"

static struct gpu *gpu;
static struct job job;
static struct job_member members[2];
static struct job_member *slots[2];
/* comms.c asks only whether the job spans nodes. */
static char spans_nodes;

static void setup(void) {
  char why[512];
  ck_assert_msg(gpu_open(&gpu, why, sizeof why) == 0, "%s", why);
  ck_assert_int_ge(gpu_device_count(gpu), 2);
  memset(&job, 0, sizeof job);
  job.world = 2;
  job.members = slots;
  job.mesh = (struct mesh *)&spans_nodes;
  snprintf(job.hex, sizeof job.hex, "%s", "0123456789abcdef0123456789abcdef");
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_comms_unique_id(gpu, job.nccl_id, &job.nccl_root, msg, sizeof msg), 0);
  job.has_nccl_id = true;
  for (int r = 0; r < 2; r++) {
    memset(&members[r], 0, sizeof members[r]);
    members[r].job = &job;
    members[r].rank = (uint32_t)r;
    members[r].reg.gpu = gpu;
    members[r].reg.device = r;
    slots[r] = NULL;
  }
}

static void teardown(void) {
  gpu_comms_free(job.gpu_comms);
  gpu_close(gpu);
}

/* Joins the ranks in mask (bit r: rank r), as job.c admits them. */
static void join(unsigned mask) {
  for (int r = 0; r < 2; r++)
    if (mask & (1u << r))
      slots[r] = &members[r];
  comms_join(&job);
}

/* The loop's wake-ups and ticks poll the set-up until it is done. */
static void poll_until_joined(void) {
  for (int i = 0; i < 10000 && job.comms_state == COMMS_JOINING; i++) {
    nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    comms_join(&job);
  }
  ck_assert_int_eq(job.comms_state, COMMS_JOINED);
}

static struct comms_want want(unsigned mask, uint64_t gen, const uint8_t *id) {
  struct comms_want w = {.spans_nodes = true, .timeout_ms = 10000};
  for (uint32_t r = 0; r < 2; r++)
    if (mask & (1u << r))
      comms_want_rank(&w, r, &members[r]);
  w.has_id = id != NULL;
  if (id != NULL)
    memcpy(w.id, id, GPU_NCCL_ID_BYTES);
  w.gen = gen;
  return w;
}

START_TEST(join_time_communicators_are_taken_over_by_the_first_export) {
  ck_assert_int_eq(job.comms_state, COMMS_UNSTARTED);
  join(1);
  /* One rank of two: NCCL waits for the other. */
  ck_assert_int_eq(job.comms_state, COMMS_JOINING);
  ck_assert(comms_joining(&job));
  join(2);
  poll_until_joined();
  ck_assert(!comms_joining(&job));
  struct gpu_comms *made = job.gpu_comms;
  ck_assert(gpu_comms_holds(made, 0) && gpu_comms_holds(made, 1));
  struct comms_want w = want(3, 0, job.nccl_id);
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), 0);
  ck_assert_int_eq(job.comms_state, COMMS_EXPORTS);
  ck_assert_ptr_eq(job.gpu_comms, made);
  ck_assert_uint_eq(job.gpu_comms_gen, 0);
  /* From now on joins start nothing, and the next export keeps them. */
  comms_join(&job);
  ck_assert_ptr_eq(job.gpu_comms, made);
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), 0);
  ck_assert_ptr_eq(job.gpu_comms, made);
}
END_TEST

START_TEST(a_rank_leaving_before_the_first_export_drops_them) {
  join(3);
  poll_until_joined();
  comms_rank_left(&job, 1);
  ck_assert_int_eq(job.comms_state, COMMS_EXPORTS);
  ck_assert_ptr_null(job.gpu_comms);
  /* Joins no longer start them: the first export makes them. */
  comms_join(&job);
  ck_assert_ptr_null(job.gpu_comms);
  /* From a fresh id: the dropped ones used the job's, whose bootstrap
   * root ended once their ranks checked in (docs/fakes.md). */
  uint8_t fresh[GPU_NCCL_ID_BYTES];
  struct gpu_nccl_root *fresh_root;
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_comms_unique_id(gpu, fresh, &fresh_root, msg, sizeof msg), 0);
  struct comms_want w = want(3, 0, fresh);
  ck_assert_msg(comms_for_export(&job, &w, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_ptr_nonnull(job.gpu_comms);
  ck_assert(gpu_comms_match(job.gpu_comms, w.ranks, w.n));
  gpu_nccl_root_end(fresh_root);
}
END_TEST

START_TEST(a_rank_of_no_communicator_leaving_changes_nothing) {
  join(1);
  comms_rank_left(&job, 1);
  ck_assert_int_eq(job.comms_state, COMMS_JOINING);
  ck_assert_ptr_nonnull(job.gpu_comms);
}
END_TEST

START_TEST(an_export_of_other_ranks_makes_its_own) {
  /* Only rank 0 joined here before the export, which has both. */
  join(1);
  struct gpu_comms *made = job.gpu_comms;
  ck_assert_ptr_nonnull(made);
  slots[1] = &members[1];
  struct comms_want w = want(3, 0, job.nccl_id);
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_msg(comms_for_export(&job, &w, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_int_eq(job.comms_state, COMMS_EXPORTS);
  ck_assert(gpu_comms_match(job.gpu_comms, w.ranks, w.n));
}
END_TEST

START_TEST(a_later_generation_does_not_take_the_join_time_set) {
  join(3);
  poll_until_joined();
  /* Generation 1 (an earlier export failed on another node): the
   * join-time set does not serve, whatever ranks it holds (it is freed on
   * a helper thread, so its address may come back for the new set). */
  uint8_t fresh[GPU_NCCL_ID_BYTES];
  struct gpu_nccl_root *fresh_root;
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(gpu_comms_unique_id(gpu, fresh, &fresh_root, msg, sizeof msg), 0);
  struct comms_want w = want(3, 1, fresh);
  ck_assert_msg(comms_for_export(&job, &w, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_uint_eq(job.gpu_comms_gen, 1);
  gpu_nccl_root_end(fresh_root);
}
END_TEST

START_TEST(a_new_generation_replaces_aborted_ones_and_the_old_is_refused) {
  join(3);
  poll_until_joined();
  struct comms_want w = want(3, 0, job.nccl_id);
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), 0);
  /* An export failed and aborted them. */
  gpu_comms_abort(job.gpu_comms);
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), SP_EBACKEND);
  ck_assert_msg(strstr(msg, "aborted by an earlier failure") != NULL, "%s",
                msg);
  uint8_t fresh[GPU_NCCL_ID_BYTES];
  struct gpu_nccl_root *fresh_root;
  ck_assert_int_eq(gpu_comms_unique_id(gpu, fresh, &fresh_root, msg, sizeof msg), 0);
  w = want(3, 1, fresh);
  ck_assert_msg(comms_for_export(&job, &w, msg, sizeof msg) == 0, "%s", msg);
  ck_assert(!gpu_comms_failed(job.gpu_comms));
  ck_assert_uint_eq(job.gpu_comms_gen, 1);
  gpu_nccl_root_end(fresh_root);
}
END_TEST

START_TEST(no_id_from_the_root_is_refused) {
  struct comms_want w = want(3, 0, NULL);
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), SP_EBACKEND);
  ck_assert_msg(strstr(msg, "made no NCCL id") != NULL, "%s", msg);
  ck_assert_ptr_null(job.gpu_comms);
}
END_TEST

START_TEST(one_node_or_the_host_needs_none) {
  join(3);
  poll_until_joined();
  /* The export's ranks are on the host: the join-time set goes. */
  struct comms_want w = {.spans_nodes = true, .has_id = true};
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(comms_for_export(&job, &w, msg, sizeof msg), 0);
  ck_assert_int_eq(job.comms_state, COMMS_EXPORTS);
  ck_assert_ptr_null(job.gpu_comms);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-comms");
  TCase *tc = tcase_create("states");
  tcase_set_timeout(tc, 60);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc,
                 join_time_communicators_are_taken_over_by_the_first_export);
  tcase_add_test(tc, a_rank_leaving_before_the_first_export_drops_them);
  tcase_add_test(tc, a_rank_of_no_communicator_leaving_changes_nothing);
  tcase_add_test(tc, an_export_of_other_ranks_makes_its_own);
  tcase_add_test(tc, a_later_generation_does_not_take_the_join_time_set);
  tcase_add_test(tc,
                 a_new_generation_replaces_aborted_ones_and_the_old_is_refused);
  tcase_add_test(tc, no_id_from_the_root_is_refused);
  tcase_add_test(tc, one_node_or_the_host_needs_none);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
