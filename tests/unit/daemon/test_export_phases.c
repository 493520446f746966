/*
 * test_export_phases.c - an export's state machine on one daemon, driven
 * through its real job and planner with fake connections and a fake engine
 * (fakeworld.h): each phase from the asks to the publication, a failure in
 * each phase (every rank hears the same error, and what the export took
 * goes back), a rank lost in each phase, each timeout, and the plan cache.
 */
#include <check.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "daemon/pool.h"
#include "shardport.h"
#include "tests/unit/daemon/fakeworld.h"

#define POOL_BYTES (64u << 20)

static struct fake_world world;
static struct fake_job fj;

static void up(uint32_t ranks, uint64_t rows) {
  fake_world_init(&world, POOL_BYTES);
  fake_job_up(&fj, &world, ranks, rows);
}

static void down(void) {
  fake_world_free(&world);
  fake_job_free(&fj);
}

static void nap_ms(long ms) {
  nanosleep(&(struct timespec){.tv_sec = ms / 1000,
                               .tv_nsec = (ms % 1000) * 1000000},
            NULL);
}

static bool engine_started(void *arg) {
  return fake_engine_starts() > *(const unsigned *)arg;
}

static bool export_over(void *arg) {
  (void)arg;
  return !export_busy(fj.job);
}

static bool in_phase(void *arg) {
  return fake_phase(&fj) == *(const enum job_phase *)arg;
}

static void run_to(enum job_phase phase) {
  fake_run_until(&world, in_phase, &phase);
}

/* Both ranks asked; runs until the planner handed the plan to the engine. */
static void ask_all_and_plan(uint32_t timeout_ms) {
  unsigned before = fake_engine_starts();
  for (uint32_t r = 0; r < fj.world; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], timeout_ms, 0), 0);
  fake_run_until(&world, engine_started, &before);
}

/* The distinct phases of the progress frames c got, in order. */
static void phases_seen(const struct conn *c, char *buf, size_t len) {
  buf[0] = '\0';
  const char *last = "";
  for (size_t i = 0; i < c->nreplies; i++) {
    const struct fake_reply *r = &c->replies[i];
    if (strcmp(r->op, "progress") != 0 || strcmp(r->phase, last) == 0)
      continue;
    size_t used = strlen(buf);
    snprintf(buf + used, len - used, "%s%s", used > 0 ? " " : "", r->phase);
    last = r->phase;
  }
}

/* Every rank's last reply is the same error. */
static void all_failed_with(int code, const char *words) {
  const struct fake_reply *first = fake_last(fj.rank[0]);
  for (uint32_t r = 0; r < fj.world; r++) {
    const struct fake_reply *e = fake_last(fj.rank[r]);
    ck_assert_ptr_nonnull(e);
    ck_assert_str_eq(e->op, "error");
    ck_assert_int_eq(e->code, code);
    ck_assert_str_eq(e->message, first->message);
  }
  ck_assert_msg(strstr(first->message, words) != NULL, "%s", first->message);
}

/* ---- the phases ---------------------------------------------------------- */

START_TEST(export_walks_every_phase_to_published) {
  up(2, 1024);
  ck_assert_int_eq(fake_phase(&fj), JOB_WAITING);
  ck_assert_int_eq(fake_ask(fj.rank[0], 0, 0), 0);
  fake_turn(&world);
  /* One rank asked: the export waits for the other. */
  ck_assert_int_eq(fake_phase(&fj), JOB_WAITING);
  ck_assert(!export_busy(fj.job));
  unsigned none = 0;
  ck_assert_int_eq(fake_ask(fj.rank[1], 0, 0), 0);
  fake_run_until(&world, engine_started, &none);
  /* The engine has the plan; before round 1 status says allocating. */
  struct engine *e = fake_engine();
  ck_assert_ptr_nonnull(e->plan);
  ck_assert_int_eq(fake_phase(&fj), JOB_ALLOCATING);
  atomic_store(&e->round, 1);
  ck_assert_int_eq(fake_phase(&fj), JOB_MOVING);
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  ck_assert(!export_busy(fj.job));
  /* Every rank heard each phase once, in order, then its reply, whose
   * part 0 carries the owner's segment. */
  size_t segments = 0;
  for (uint32_t r = 0; r < 2; r++) {
    char seen[128];
    phases_seen(fj.rank[r], seen, sizeof seen);
    ck_assert_str_eq(seen, "waiting planning moving publishing");
    const struct fake_reply *reply = fake_last_op(fj.rank[r], "export");
    ck_assert_ptr_nonnull(reply);
    ck_assert_uint_eq(reply->export_id, 1);
    ck_assert_uint_eq(reply->part, 0);
    segments += reply->nfds;
  }
  ck_assert_uint_eq(segments, 1);
  ck_assert_uint_eq(fj.job->history.total, 1);
  ck_assert(!history_at(&fj.job->history, 0)->failed);
  /* The owner holds its segment until it releases it; an export is
   * released once. */
  ck_assert_uint_gt(pool_used(world.t.srv.pool), 0);
  for (uint32_t r = 0; r < 2; r++) {
    ck_assert_int_eq(fake_release(fj.rank[r], 1), 0);
    ck_assert_int_eq(fake_release(fj.rank[r], 1), SP_ENOEXPORT);
  }
  down();
}
END_TEST

START_TEST(the_next_export_starts_once_the_last_is_published) {
  up(2, 1024);
  ask_all_and_plan(0);
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  ask_all_and_plan(0);
  ck_assert(export_busy(fj.job));
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  ck_assert_uint_eq(fake_last_op(fj.rank[0], "export")->export_id, 2);
  ck_assert_uint_eq(fj.job->history.total, 2);
  down();
}
END_TEST

/* ---- failures ------------------------------------------------------------ */

START_TEST(ranks_that_disagree_fail_while_gathering) {
  up(2, 1024);
  ck_assert_int_eq(fake_ask(fj.rank[0], 0, 10), 0);
  ck_assert_int_eq(fake_ask(fj.rank[1], 0, 20), 0);
  fake_turn(&world);
  all_failed_with(SP_EINVAL, "ranks disagree on the export options");
  ck_assert(!export_busy(fj.job));
  ck_assert_int_eq(fake_phase(&fj), JOB_FAILED);
  /* It never started: no export id was spent. */
  ck_assert_uint_eq(fj.job->next_export_id, 1);
  ck_assert(history_at(&fj.job->history, 0)->failed);
  down();
}
END_TEST

START_TEST(a_plan_refused_fails_every_rank) {
  up(2, 1024);
  /* A key only rank 0 lists, and not as an expert: no plan. */
  ck_assert_int_eq(fake_tensor(fj.rank[0], "alone", 8, 16, "shard0"), 0);
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], 0, 0), 0);
  fake_run_until(&world, export_over, NULL);
  ck_assert_ptr_null(fake_engine());
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  all_failed_with(e->code, "alone");
  ck_assert_int_eq(fake_phase(&fj), JOB_FAILED);
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  down();
}
END_TEST

START_TEST(a_pool_too_small_fails_allocating_and_keeps_nothing) {
  /* 1024 rows of float32 on each of two ranks: 8 KiB for the owner. */
  fake_world_init(&world, 4096);
  fake_job_up(&fj, &world, 2, 1024);
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], 0, 0), 0);
  fake_run_until(&world, export_over, NULL);
  all_failed_with(SP_EPOOL, "bytes of pool");
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  down();
}
END_TEST

START_TEST(an_engine_failure_fails_every_rank_and_frees_the_segments) {
  up(2, 1024);
  ask_all_and_plan(0);
  ck_assert_uint_gt(pool_used(world.t.srv.pool), 0);
  fake_engine_end(SP_EBADFD, "rank 1's storage 1 shrank");
  fake_run_until(&world, export_over, NULL);
  all_failed_with(SP_EBADFD, "shrank");
  ck_assert_int_eq(fake_phase(&fj), JOB_FAILED);
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  down();
}
END_TEST

START_TEST(an_engine_that_cannot_start_fails_the_export) {
  up(2, 1024);
  fake_engine_refuse_start();
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], 0, 0), 0);
  fake_run_until(&world, export_over, NULL);
  all_failed_with(SP_ENOMEM, "cannot start the engine thread");
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  down();
}
END_TEST

/* ---- ranks lost ---------------------------------------------------------- */

START_TEST(a_rank_lost_while_gathering_fails_the_asks) {
  up(2, 1024);
  ck_assert_int_eq(fake_ask(fj.rank[0], 0, 0), 0);
  fake_conn_drop(fj.rank[1]);
  fake_turn(&world);
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  ck_assert_int_eq(e->code, SP_ERANKLOST);
  ck_assert_msg(strstr(e->message, "rank 1 disconnected from job") != NULL,
                "%s", e->message);
  ck_assert(!export_busy(fj.job));
  down();
}
END_TEST

START_TEST(a_rank_lost_while_planning_fails_at_once) {
  up(2, 1024);
  fake_spawn_hold();
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], 0, 0), 0);
  run_to(JOB_PLANNING);
  fake_conn_drop(fj.rank[1]);
  fake_turn(&world);
  /* Failed while the planner still runs; freed once it stopped. */
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  ck_assert_int_eq(e->code, SP_ERANKLOST);
  ck_assert_int_eq(fake_phase(&fj), JOB_FAILED);
  ck_assert(export_busy(fj.job));
  fake_spawn_release();
  fake_run_until(&world, export_over, NULL);
  ck_assert_ptr_null(fake_engine());
  down();
}
END_TEST

START_TEST(a_rank_lost_while_moving_cancels_the_engine) {
  up(2, 1024);
  ask_all_and_plan(0);
  fake_conn_drop(fj.rank[1]);
  fake_turn(&world);
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  ck_assert_int_eq(e->code, SP_ERANKLOST);
  ck_assert(atomic_load(&fake_engine()->cancel));
  /* The engine still reads the storages: the export waits for it. */
  ck_assert(export_busy(fj.job));
  fake_engine_end(0, NULL);
  fake_run_until(&world, export_over, NULL);
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  ck_assert(history_at(&fj.job->history, 0)->failed);
  down();
}
END_TEST

/* The rank whose reply carries the segment; the engine ran. */
static uint32_t owner_of_w(void) {
  const struct plan *plan = fake_engine()->plan;
  ck_assert_uint_eq(plan->nkeys, 1);
  return plan->keys[0].owner;
}

START_TEST(a_rank_lost_while_publishing_stops_only_its_stream) {
  up(2, 1024);
  ask_all_and_plan(0);
  uint32_t owner = owner_of_w(), other = 1 - owner;
  /* The owner's queue is full: its reply waits for room. */
  fj.rank[owner]->reading = false;
  fj.rank[owner]->out_bytes = world.t.cfg.max_output;
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHING);
  ck_assert_ptr_nonnull(fake_last_op(fj.rank[other], "export"));
  ck_assert_ptr_null(fake_last_op(fj.rank[owner], "export"));
  fake_conn_drop(fj.rank[owner]);
  fake_run_until(&world, export_over, NULL);
  /* The data was whole: the export is published, nobody got an error. */
  ck_assert_int_eq(fake_phase(&fj), JOB_PUBLISHED);
  ck_assert_uint_eq(fake_count_op(fj.rank[other], "error"), 0);
  down();
}
END_TEST

START_TEST(a_reply_waits_for_room_and_goes_when_the_rank_reads) {
  up(2, 1024);
  ask_all_and_plan(0);
  uint32_t owner = owner_of_w();
  fj.rank[owner]->reading = false;
  fj.rank[owner]->out_bytes = world.t.cfg.max_output;
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHING);
  ck_assert_ptr_null(fake_last_op(fj.rank[owner], "export"));
  fake_conn_read(fj.rank[owner]);
  run_to(JOB_PUBLISHED);
  ck_assert_uint_eq(fake_last_op(fj.rank[owner], "export")->nfds, 1);
  down();
}
END_TEST

/* ---- timeouts ------------------------------------------------------------ */

START_TEST(an_ask_times_out_naming_who_did_not_ask) {
  up(2, 1024);
  ck_assert_int_eq(fake_ask(fj.rank[0], 5, 0), 0);
  nap_ms(20);
  export_tick(fj.job);
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  ck_assert_int_eq(e->code, SP_ETIMEOUT);
  ck_assert_msg(strstr(e->message, "waiting for rank(s) 1 to ask") != NULL,
                "%s", e->message);
  ck_assert_uint_eq(fake_count_op(fj.rank[1], "error"), 0);
  down();
}
END_TEST

START_TEST(planning_past_the_timeout_fails_and_stops_the_planner) {
  up(2, 1024);
  fake_spawn_hold();
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_ask(fj.rank[r], 200, 0), 0);
  run_to(JOB_PLANNING);
  export_tick(fj.job);
  /* Not yet past it. */
  ck_assert_int_eq(fake_phase(&fj), JOB_PLANNING);
  nap_ms(300);
  export_tick(fj.job);
  all_failed_with(SP_ETIMEOUT, "planning took longer");
  fake_spawn_release();
  fake_run_until(&world, export_over, NULL);
  ck_assert_ptr_null(fake_engine());
  down();
}
END_TEST

START_TEST(moving_nothing_past_the_timeout_fails) {
  up(2, 1024);
  ask_all_and_plan(20);
  nap_ms(40);
  export_tick(fj.job);
  all_failed_with(SP_ETIMEOUT, "moved nothing for 20 ms");
  ck_assert(atomic_load(&fake_engine()->cancel));
  fake_engine_end(0, NULL);
  fake_run_until(&world, export_over, NULL);
  ck_assert_uint_eq(pool_used(world.t.srv.pool), 0);
  down();
}
END_TEST

START_TEST(bytes_moving_keep_an_export_alive) {
  up(2, 1024);
  /* Six ticks 50 ms apart: the export lives past its timeout of 200 ms
   * because bytes moved between any two. */
  ask_all_and_plan(200);
  struct engine *e = fake_engine();
  for (int i = 1; i <= 6; i++) {
    nap_ms(50);
    atomic_store(&e->bytes_moved, (uint64_t)i * 1000);
    export_tick(fj.job);
  }
  ck_assert_int_eq(fake_phase(&fj), JOB_ALLOCATING);
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  down();
}
END_TEST

START_TEST(an_owner_that_does_not_read_is_disconnected) {
  up(2, 1024);
  ask_all_and_plan(20);
  uint32_t owner = owner_of_w();
  fj.rank[owner]->reading = false;
  fj.rank[owner]->out_bytes = world.t.cfg.max_output;
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHING);
  nap_ms(40);
  export_tick(fj.job);
  ck_assert(fj.rank[owner]->closed);
  ck_assert(!fj.rank[1 - owner]->closed);
  fake_run_until(&world, export_over, NULL);
  down();
}
END_TEST

/* ---- the plan cache ------------------------------------------------------ */

START_TEST(an_unchanged_job_reuses_its_plan) {
  up(2, 1024);
  /* Without the replica comparison, a reused plan needs no thread. */
  world.t.cfg.compare_replicas = false;
  ask_all_and_plan(0);
  const struct plan *first = fake_engine()->plan;
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  size_t before = fj.rank[0]->nreplies;
  ask_all_and_plan(0);
  ck_assert_ptr_eq(fake_engine()->plan, first);
  for (size_t i = before; i < fj.rank[0]->nreplies; i++)
    ck_assert_str_ne(fj.rank[0]->replies[i].phase, "planning");
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  /* A registration changes the job: the next export plans again. */
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_tensor(fj.rank[r], "b", 4, 4, "replicated"), 0);
  before = fj.rank[0]->nreplies;
  ask_all_and_plan(0);
  ck_assert_uint_eq(fake_engine()->plan->nkeys, 2);
  bool planned = false;
  for (size_t i = before; i < fj.rank[0]->nreplies; i++)
    planned |= strcmp(fj.rank[0]->replies[i].phase, "planning") == 0;
  ck_assert(planned);
  fake_engine_end(0, NULL);
  run_to(JOB_PUBLISHED);
  down();
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-export");
  TCase *tc = tcase_create("phases");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, export_walks_every_phase_to_published);
  tcase_add_test(tc, the_next_export_starts_once_the_last_is_published);
  suite_add_tcase(s, tc);
  tc = tcase_create("failures");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, ranks_that_disagree_fail_while_gathering);
  tcase_add_test(tc, a_plan_refused_fails_every_rank);
  tcase_add_test(tc, a_pool_too_small_fails_allocating_and_keeps_nothing);
  tcase_add_test(tc,
                 an_engine_failure_fails_every_rank_and_frees_the_segments);
  tcase_add_test(tc, an_engine_that_cannot_start_fails_the_export);
  suite_add_tcase(s, tc);
  tc = tcase_create("ranks lost");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, a_rank_lost_while_gathering_fails_the_asks);
  tcase_add_test(tc, a_rank_lost_while_planning_fails_at_once);
  tcase_add_test(tc, a_rank_lost_while_moving_cancels_the_engine);
  tcase_add_test(tc, a_rank_lost_while_publishing_stops_only_its_stream);
  tcase_add_test(tc, a_reply_waits_for_room_and_goes_when_the_rank_reads);
  suite_add_tcase(s, tc);
  tc = tcase_create("timeouts");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, an_ask_times_out_naming_who_did_not_ask);
  tcase_add_test(tc, planning_past_the_timeout_fails_and_stops_the_planner);
  tcase_add_test(tc, moving_nothing_past_the_timeout_fails);
  tcase_add_test(tc, bytes_moving_keep_an_export_alive);
  tcase_add_test(tc, an_owner_that_does_not_read_is_disconnected);
  suite_add_tcase(s, tc);
  tc = tcase_create("plan cache");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, an_unchanged_job_reuses_its_plan);
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
