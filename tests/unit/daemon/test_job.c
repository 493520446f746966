/*
 * test_job.c - jobs without a daemon (fakeworld.h): job_create's ticket
 * joins, each join's refusals, leave and the job's end with its last rank,
 * an export asked after a rank left, and the dispatch table's contract.
 */
#include <check.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/ops.h"
#include "shardport.h"
#include "tests/unit/daemon/fakeworld.h"

START_TEST(a_ticket_joins_every_rank) {
  struct fake_world w;
  fake_world_init(&w, 1u << 20);
  struct conn *c[2] = {fake_conn(&w), fake_conn(&w)};
  uint8_t ticket[SP_TICKET_MAX];
  size_t len;
  ck_assert_int_eq(fake_create(c[0], 2, ticket, &len), 0);
  ck_assert_uint_eq(w.t.srv.njobs, 1);
  struct job *job = w.t.srv.jobs;
  ck_assert_uint_eq(job->world, 2);
  for (uint32_t r = 0; r < 2; r++) {
    ck_assert_int_eq(fake_join(c[r], ticket, len, r, 2), 0);
    ck_assert_str_eq(fake_last(c[r])->op, "join");
    ck_assert_ptr_eq(conn_member(c[r]), job->members[r]);
  }
  ck_assert_uint_eq(job->joined, 2);
  fake_world_free(&w);
}
END_TEST

START_TEST(joins_are_refused_as_the_protocol_says) {
  struct fake_world w;
  fake_world_init(&w, 1u << 20);
  struct conn *c0 = fake_conn(&w), *c1 = fake_conn(&w);
  uint8_t ticket[SP_TICKET_MAX];
  size_t len;
  ck_assert_int_eq(fake_create(c0, 2, ticket, &len), 0);
  ck_assert_int_eq(fake_join(c0, ticket, len, 0, 2), 0);
  /* One connection is one rank. */
  ck_assert_int_eq(fake_join(c0, ticket, len, 1, 2), SP_ESTATE);
  /* A rank joins once. */
  ck_assert_int_eq(fake_join(c1, ticket, len, 0, 2), SP_ERANK);
  /* The world is the job's; the rank is below it. */
  ck_assert_int_eq(fake_join(c1, ticket, len, 1, 3), SP_ERANK);
  ck_assert_int_eq(fake_join(c1, ticket, len, 2, 2), SP_ERANK);
  /* A ticket of no job here, and bytes that are no ticket. */
  uint8_t other[SP_TICKET_MAX];
  memcpy(other, ticket, len);
  other[len - 1] ^= 1;
  ck_assert_int_eq(fake_join(c1, other, len, 1, 2), SP_ETICKET);
  ck_assert_int_eq(fake_join(c1, (const uint8_t *)"junk", 4, 1, 2),
                   SP_ETICKET);
  ck_assert_uint_eq(w.t.srv.jobs->joined, 1);
  ck_assert_int_eq(fake_join(c1, ticket, len, 1, 2), 0);
  fake_world_free(&w);
}
END_TEST

static bool no_jobs(void *arg) {
  const struct fake_world *w = arg;
  return w->t.srv.njobs == 0;
}

START_TEST(the_job_ends_with_its_last_rank) {
  struct fake_world w;
  fake_world_init(&w, 1u << 20);
  struct conn *c[2] = {fake_conn(&w), fake_conn(&w)};
  uint8_t ticket[SP_TICKET_MAX];
  size_t len;
  ck_assert_int_eq(fake_create(c[0], 2, ticket, &len), 0);
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(fake_join(c[r], ticket, len, r, 2), 0);
  ck_assert_int_eq(fake_request(c[0], "leave", 0, NULL, NULL, NULL, 0), 0);
  ck_assert_str_eq(fake_last(c[0])->op, "leave");
  ck_assert_ptr_null(conn_member(c[0]));
  fake_turn(&w);
  ck_assert_uint_eq(w.t.srv.njobs, 1);
  ck_assert_uint_eq(w.t.srv.jobs->joined, 1);
  /* Leaving twice: the connection is in no job. */
  ck_assert_int_eq(fake_request(c[0], "leave", 0, NULL, NULL, NULL, 0), 0);
  ck_assert_int_eq(fake_last(c[0])->code, SP_ESTATE);
  fake_conn_drop(c[1]);
  fake_run_until(&w, no_jobs, &w);
  fake_world_free(&w);
}
END_TEST

static bool engine_started(void *arg) {
  (void)arg;
  return fake_engine_starts() > 0;
}

static bool export_over(void *arg) { return !export_busy(arg); }

START_TEST(an_export_after_a_rank_left_fails_until_it_returns) {
  struct fake_world w;
  struct fake_job fj;
  fake_world_init(&w, 1u << 20);
  fake_job_up(&fj, &w, 2, 64);
  ck_assert_int_eq(fake_request(fj.rank[1], "leave", 0, NULL, NULL, NULL, 0),
                   0);
  fake_turn(&w);
  ck_assert_int_eq(fake_ask(fj.rank[0], 0, 0), 0);
  fake_turn(&w);
  const struct fake_reply *e = fake_last(fj.rank[0]);
  ck_assert_str_eq(e->op, "error");
  ck_assert_int_eq(e->code, SP_ERANKLOST);
  ck_assert_msg(strstr(e->message, "rank 1 left job") != NULL, "%s",
                e->message);
  /* Back on a new connection, with its registrations: the job exports. */
  struct conn *back = fake_conn(&w);
  ck_assert_int_eq(fake_join(back, fj.ticket, fj.ticket_len, 1, 2), 0);
  ck_assert_int_eq(fake_storage(back, fj.fd[1], 64 * 4, 0x200000), 0);
  ck_assert_int_eq(fake_tensor(back, "w", 64, 128, "shard0"), 0);
  ck_assert_int_eq(fake_ask(fj.rank[0], 0, 0), 0);
  ck_assert_int_eq(fake_ask(back, 0, 0), 0);
  fake_run_until(&w, engine_started, NULL);
  fake_engine_end(0, NULL);
  fake_run_until(&w, export_over, fj.job);
  ck_assert_uint_eq(fake_count_op(fj.rank[0], "export"), 1);
  ck_assert_uint_eq(fake_count_op(back, "export"), 1);
  fake_world_free(&w);
  fake_job_free(&fj);
}
END_TEST

/* The ops of docs/protocol.md, and what the table promises of each: only
 * storage_add carries descriptors, and the ops that start new work are
 * the ones a draining daemon refuses (docs/protocol.md, "Stopping"). */
START_TEST(the_table_serves_every_documented_op) {
  static const struct {
    const char *name;
    bool takes_fds, new_work, steps;
  } documented[] = {
      {"hello", false, false, false},      {"ping", false, false, false},
      {"status", false, false, false},     {"job_create", false, true, false},
      {"join", false, true, false},        {"leave", false, false, false},
      {"storage_add", true, true, true},   {"tensor_add", false, true, true},
      {"export", false, true, true},      {"release", false, false, false},
      {"jobs", false, false, false},       {"job_status", false, false, false},
      {"job_abort", false, false, false},
  };
  for (size_t i = 0; i < sizeof documented / sizeof documented[0]; i++) {
    const struct op *op = ops_find(documented[i].name);
    ck_assert_msg(op != NULL, "%s", documented[i].name);
    ck_assert_str_eq(op->name, documented[i].name);
    ck_assert_ptr_nonnull(op->handle);
    ck_assert_int_eq(op->takes_fds, documented[i].takes_fds);
    ck_assert_int_eq(op->new_work, documented[i].new_work);
    /* Ops whose frames may be large have a part that may run on a worker
     * and a part served on the loop. */
    ck_assert_int_eq(op->prepared != NULL, documented[i].steps);
    if (op->prepared != NULL)
      ck_assert(op->prepared->prepare != NULL && op->prepared->serve != NULL);
  }
  ck_assert_ptr_null(ops_find("export_all"));
  ck_assert_ptr_null(ops_find(""));
}
END_TEST

START_TEST(a_request_reaches_its_handler_through_the_table) {
  struct fake_world w;
  fake_world_init(&w, 1u << 20);
  struct conn *c = fake_conn(&w);
  ck_assert_int_eq(fake_request(c, "ping", 0, NULL, NULL, NULL, 0), 0);
  ck_assert_str_eq(fake_last(c)->op, "ping");
  ck_assert_int_eq(fake_request(c, "status", 0, NULL, NULL, NULL, 0), 0);
  ck_assert_str_eq(fake_last(c)->op, "status");
  /* Handlers that need a job say so. */
  ck_assert_int_eq(fake_ask(c, 0, 0), SP_ESTATE);
  ck_assert_int_eq(fake_release(c, 1), SP_ESTATE);
  fake_world_free(&w);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-job");
  TCase *tc = tcase_create("jobs");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, a_ticket_joins_every_rank);
  tcase_add_test(tc, joins_are_refused_as_the_protocol_says);
  tcase_add_test(tc, the_job_ends_with_its_last_rank);
  tcase_add_test(tc, an_export_after_a_rank_left_fails_until_it_returns);
  suite_add_tcase(s, tc);
  tc = tcase_create("ops");
  tcase_add_test(tc, the_table_serves_every_documented_op);
  tcase_add_test(tc, a_request_reaches_its_handler_through_the_table);
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
