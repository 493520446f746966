/*
 * daemon_operator.c - what an operator sees of and does to jobs
 * (docs/protocol.md, "jobs", "job_status", "job_abort"): the phase that
 * prepares the pool before round 1, an export that failed while its ranks
 * waited shown as failed with its error, the history of finished exports,
 * each rank's state, pid and node, the job list in pages, job references,
 * and abort.  Permissions (owner or root) are tested in daemon_access.c,
 * which runs as root.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"
#include "tests/integration/ranks.h"

static struct sp_test_daemon daemon_;
static uint64_t next_id = 1;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A daemon with config lines, the engine pausing delay_ms (NULL: not). */
static void start_with(const char *config, const char *delay_ms) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, config), 0);
  if (delay_ms != NULL)
    setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", delay_ms, 1);
  const char *args[] = {"--config", path, NULL};
  int rc = sp_test_daemon_start(&daemon_, args);
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
  sp_test_rmdir(dir);
  ck_assert_int_eq(rc, 0);
}

static void teardown(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* Sends mb, reads its reply into r: the reply's error code or 0. */
static int call(int sock, struct sp_msgbuf *mb, uint64_t id,
                struct sp_test_reply *r) {
  ck_assert_int_eq(sp_test_send_msgbuf(sock, mb, NULL, 0), 0);
  for (;;) {
    ck_assert_int_eq(sp_test_recv(sock, r, SP_TEST_TIMEOUT_MS), 0);
    if (r->head.id == id)
      return r->code;
    /* Progress of an export request this connection made. */
    ck_assert_str_eq(r->head.op, "progress");
    sp_test_reply_free(r);
  }
}

static int call_ref(int sock, const char *op, const char *ref,
                    struct sp_test_reply *r) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, op, id, 1);
  sp__pack_kv_str(&mb.pk, "job", ref);
  return call(sock, &mb, id, r);
}

/* A job of world ranks: its 32-digit id in hex, its ticket in t. */
static void job_create(int sock, uint32_t world, char *hex,
                       struct sp_test_reply *ticket) {
  struct sp_msgbuf mb;
  struct sp_test_reply local;
  struct sp_test_reply *r = ticket != NULL ? ticket : &local;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "job_create", id, 1);
  sp__pack_kv_u64(&mb.pk, "world", world);
  ck_assert_int_eq(call(sock, &mb, id, r), 0);
  ck_assert_int_eq(sp__msg_get_strbuf(&r->map, "job_id", false, hex, 33), 0);
  if (ticket == NULL)
    sp_test_reply_free(&local);
}

/* The only job of the status reply: its phase and error ("" when none). */
static void status_job(int sock, char *phase, char *error, size_t errlen,
                       uint64_t *round, uint64_t *prepared,
                       uint64_t *to_prepare) {
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "status", id, 0);
  ck_assert_int_eq(call(sock, &mb, id, &r), 0);
  const msgpack_object_array *jobs;
  ck_assert_int_eq(sp__msg_get_array(&r.map, "jobs", false, &jobs), 0);
  ck_assert_uint_eq(jobs->size, 1);
  const msgpack_object *j = &jobs->ptr[0];
  ck_assert_int_eq(sp__msg_get_strbuf(j, "phase", false, phase, 32), 0);
  error[0] = '\0';
  sp__msg_get_strbuf(j, "error", true, error, errlen);
  ck_assert_int_eq(sp__msg_get_u64(j, "round", false, round), 0);
  ck_assert_int_eq(sp__msg_get_u64(j, "bytes_prepared", false, prepared), 0);
  ck_assert_int_eq(sp__msg_get_u64(j, "bytes_to_prepare", false, to_prepare),
                   0);
  sp_test_reply_free(&r);
}

/* The one job's id, through the library. */
static void only_job(char *hex) {
  sp_client *c;
  sp_job_list *list;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_jobs(c, &list), 0);
  ck_assert_uint_eq(list->njobs, 1);
  memcpy(hex, list->jobs[0].job_id, 33);
  sp_job_list_free(list);
  sp_close(c);
}

/* Before round 1 the engine prepares the owners' segments: status says
 * allocating, with the bytes prepared, not a stalled round 0; the ranks
 * in the export show as exporting, with their process and node. */
START_TEST(allocating_before_round_one) {
  start_with("", "600");
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 3,
                        .max_keys = 1};
  j.rank[0].asks = j.rank[1].asks = true;
  ranks_start(&j);
  ranks_wait_moving(&j, 0);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  char phase[32], error[1100];
  uint64_t round = 0, prepared = 0, to_prepare = 0;
  bool allocating = false, moving = false;
  for (int i = 0; i < 1000 && !moving; i++) {
    status_job(sock, phase, error, sizeof error, &round, &prepared,
               &to_prepare);
    if (strcmp(phase, "allocating") == 0) {
      allocating = true;
      ck_assert_uint_eq(round, 0);
      ck_assert_uint_gt(to_prepare, 0);
      ck_assert_uint_le(prepared, to_prepare);
    }
    moving = strcmp(phase, "moving") == 0 && round >= 1;
    if (moving)
      ck_assert_uint_eq(prepared, to_prepare);
    sleep_ms(10);
  }
  ck_assert_msg(allocating, "status never said allocating");
  ck_assert_msg(moving, "status never said moving in round 1");

  char hex[33];
  only_job(hex);
  struct sp_test_reply r;
  ck_assert_int_eq(call_ref(sock, "job_status", hex, &r), 0);
  const msgpack_object *job;
  ck_assert_int_eq(sp__msg_get_map(&r.map, "job", false, &job), 0);
  const msgpack_object_array *ranks;
  ck_assert_int_eq(sp__msg_get_array(job, "ranks", false, &ranks), 0);
  ck_assert_uint_eq(ranks->size, 2);
  for (uint32_t i = 0; i < 2; i++) {
    char state[32];
    uint64_t pid, node;
    ck_assert_int_eq(
        sp__msg_get_strbuf(&ranks->ptr[i], "state", false, state, sizeof state),
        0);
    ck_assert_str_eq(state, "exporting");
    ck_assert_int_eq(sp__msg_get_u64(&ranks->ptr[i], "pid", false, &pid), 0);
    ck_assert_uint_eq(pid, (uint64_t)getpid());
    ck_assert_int_eq(sp__msg_get_u64(&ranks->ptr[i], "node", false, &node), 0);
    ck_assert_uint_eq(node, 0);
  }
  sp_test_reply_free(&r);
  ranks_wait_exported(&j);
  for (uint32_t i = 0; i < 2; i++)
    ck_assert_int_eq(j.rank[i].export_rc, 0);

  /* The export is the job's history now. */
  ck_assert_int_eq(call_ref(sock, "job_status", hex, &r), 0);
  ck_assert_int_eq(sp__msg_get_map(&r.map, "job", false, &job), 0);
  const msgpack_object_array *history;
  ck_assert_int_eq(sp__msg_get_array(job, "history", false, &history), 0);
  ck_assert_uint_eq(history->size, 1);
  const msgpack_object *e = &history->ptr[0];
  char outcome[16];
  uint64_t export_id, rounds, moved, total;
  ck_assert_int_eq(
      sp__msg_get_strbuf(e, "outcome", false, outcome, sizeof outcome), 0);
  ck_assert_str_eq(outcome, "published");
  ck_assert_ptr_null(sp__msg_field(e, "error"));
  ck_assert_int_eq(sp__msg_get_u64(e, "export_id", false, &export_id), 0);
  ck_assert_uint_eq(export_id, 1);
  ck_assert_int_eq(sp__msg_get_u64(e, "rounds", false, &rounds), 0);
  ck_assert_uint_eq(rounds, j.nkeys);
  ck_assert_int_eq(sp__msg_get_u64(e, "bytes_moved", false, &moved), 0);
  ck_assert_int_eq(sp__msg_get_u64(e, "bytes_total", false, &total), 0);
  ck_assert_uint_gt(total, 0);
  ck_assert_uint_eq(moved, total);
  sp_test_reply_free(&r);
  close(sock);
  ranks_finish(&j);
}
END_TEST

/* A raw connection joined as rank 0 of a job of world 2. */
static int joined_rank0(char *hex) {
  int owner = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(owner, 0);
  struct sp_test_reply t;
  job_create(owner, 2, hex, &t);
  const uint8_t *ticket;
  size_t len;
  ck_assert_int_eq(sp__msg_get_bin(&t.map, "ticket", false, &ticket, &len), 0);
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "join", id, 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket, len);
  sp__pack_kv_u64(&mb.pk, "rank", 0);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  sp__pack_kv_str(&mb.pk, "device", "cpu");
  ck_assert_int_eq(call(owner, &mb, id, &r), 0);
  sp_test_reply_free(&r);
  sp_test_reply_free(&t);
  return owner;
}

/* An export that times out while its ranks wait is failed, with its error,
 * in status and in the history; the history keeps export_history of them,
 * newest first. */
START_TEST(timed_out_asks_are_failed_exports) {
  start_with("export_history = 2\n", NULL);
  char hex[33];
  int rank0 = joined_rank0(hex);
  for (uint32_t n = 1; n <= 3; n++) {
    struct sp_msgbuf mb;
    struct sp_test_reply r;
    uint64_t id = next_id++;
    sp__msgbuf_begin(&mb, "export", id, 1);
    sp__pack_kv_u64(&mb.pk, "timeout_ms", 100 * n);
    ck_assert_int_eq(call(rank0, &mb, id, &r), SP_ETIMEOUT);
    sp_test_reply_free(&r);

    char phase[32], error[1100];
    uint64_t round, prepared, to_prepare;
    status_job(rank0, phase, error, sizeof error, &round, &prepared,
               &to_prepare);
    ck_assert_str_eq(phase, "failed");
    ck_assert_msg(strncmp(error, "timeout: ", 9) == 0 &&
                      strstr(error, "rank(s) 1 (not joined)") != NULL,
                  "%s", error);

    ck_assert_int_eq(call_ref(rank0, "job_status", hex, &r), 0);
    const msgpack_object *job;
    const msgpack_object_array *history, *ranks;
    uint64_t exports;
    ck_assert_int_eq(sp__msg_get_map(&r.map, "job", false, &job), 0);
    ck_assert_int_eq(sp__msg_get_u64(job, "exports", false, &exports), 0);
    ck_assert_uint_eq(exports, n);
    ck_assert_int_eq(sp__msg_get_array(job, "history", false, &history), 0);
    /* Kept up to export_history (2): the third drops the oldest. */
    ck_assert_uint_eq(history->size, (n < 2 ? n : 2));
    for (uint32_t i = 0; i < history->size; i++) {
      const msgpack_object *e = &history->ptr[i];
      char outcome[16], herror[1100];
      uint64_t export_id;
      double duration;
      ck_assert_int_eq(
          sp__msg_get_strbuf(e, "outcome", false, outcome, sizeof outcome), 0);
      ck_assert_str_eq(outcome, "failed");
      ck_assert_int_eq(sp__msg_get_u64(e, "export_id", false, &export_id), 0);
      ck_assert_uint_eq(export_id, 0);
      ck_assert_int_eq(
          sp__msg_get_strbuf(e, "error", false, herror, sizeof herror), 0);
      ck_assert_ptr_nonnull(strstr(herror, "timed out waiting"));
      /* Newest first: the i-th newest waited (n - i) * 100 ms. */
      ck_assert_int_eq(sp__msg_get_f64(e, "duration_s", false, &duration), 0);
      ck_assert_msg(duration >= 0.1 * (n - i) - 0.01, "entry %u took %f", i,
                    duration);
    }
    ck_assert_int_eq(sp__msg_get_array(job, "ranks", false, &ranks), 0);
    ck_assert_uint_eq(ranks->size, 2);
    char state[16];
    uint64_t pid;
    ck_assert_int_eq(
        sp__msg_get_strbuf(&ranks->ptr[0], "state", false, state, sizeof state),
        0);
    ck_assert_str_eq(state, "joined");
    ck_assert_int_eq(sp__msg_get_u64(&ranks->ptr[0], "pid", false, &pid), 0);
    ck_assert_uint_eq(pid, (uint64_t)getpid());
    ck_assert_int_eq(
        sp__msg_get_strbuf(&ranks->ptr[1], "state", false, state, sizeof state),
        0);
    ck_assert_str_eq(state, "absent");
    ck_assert_ptr_null(sp__msg_field(&ranks->ptr[1], "pid"));
    sp_test_reply_free(&r);
  }
  close(rank0);
}
END_TEST

/* One page of jobs after `after` ("": the first): its size, and whether
 * more follow; the ids are checked to ascend. */
static uint32_t jobs_page(int sock, const char *after, bool *more,
                          char *last) {
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "jobs", id, after[0] ? 1 : 0);
  if (after[0])
    sp__pack_kv_str(&mb.pk, "after", after);
  ck_assert_int_eq(call(sock, &mb, id, &r), 0);
  const msgpack_object_array *jobs;
  ck_assert_int_eq(sp__msg_get_array(&r.map, "jobs", false, &jobs), 0);
  ck_assert_int_eq(sp__msg_get_bool(&r.map, "more", false, more), 0);
  char prev[33];
  snprintf(prev, sizeof prev, "%s", after);
  for (uint32_t i = 0; i < jobs->size; i++) {
    char hex[33];
    ck_assert_int_eq(
        sp__msg_get_strbuf(&jobs->ptr[i], "job_id", false, hex, sizeof hex), 0);
    ck_assert_int_gt(strcmp(hex, prev), 0);
    memcpy(prev, hex, sizeof prev);
  }
  memcpy(last, prev, 33);
  uint32_t n = jobs->size;
  sp_test_reply_free(&r);
  return n;
}

/* jobs answers 1024 jobs a page: 1024 fit in one, the 1025th starts a
 * second; the library gathers every page. */
START_TEST(jobs_in_pages) {
  start_with("max_jobs = 1100\nmax_user_jobs = 1100\n", NULL);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  char hex[33], last[33];
  bool more;
  for (int i = 0; i < 1024; i++)
    job_create(sock, 1, hex, NULL);
  ck_assert_uint_eq(jobs_page(sock, "", &more, last), 1024);
  ck_assert(!more);
  job_create(sock, 1, hex, NULL);
  ck_assert_uint_eq(jobs_page(sock, "", &more, last), 1024);
  ck_assert(more);
  ck_assert_uint_eq(jobs_page(sock, last, &more, last), 1);
  ck_assert(!more);

  struct sp_msgbuf mb;
  struct sp_test_reply r;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "jobs", id, 1);
  sp__pack_kv_str(&mb.pk, "after", "abc");
  ck_assert_int_eq(call(sock, &mb, id, &r), SP_EINVAL);
  sp_test_reply_free(&r);
  close(sock);

  sp_client *c;
  sp_job_list *list;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_jobs(c, &list), 0);
  ck_assert_uint_eq(list->njobs, 1025);
  ck_assert_uint_eq(list->jobs[0].world, 1);
  ck_assert_uint_eq(list->jobs[0].owner_uid, (uint32_t)geteuid());
  ck_assert_uint_eq(list->jobs[0].owner_pid, (uint32_t)getpid());
  sp_job_list_free(list);
  sp_close(c);
}
END_TEST

/* The largest world the protocol allows still fits one job_status reply,
 * within the library's own limits. */
START_TEST(job_status_of_the_largest_world) {
  start_with("", NULL);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  char hex[33];
  job_create(sock, 65536, hex, NULL);
  sp_client *c;
  sp_job_detail *d;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_job_show(c, hex, &d), 0);
  ck_assert_uint_eq(d->nranks, 65536);
  ck_assert_uint_eq(d->job.world, 65536);
  ck_assert_str_eq(d->ranks[65535].state, "absent");
  ck_assert_int_eq(d->ranks[65535].node, -1);
  ck_assert_uint_eq(d->nhistory, 0);
  sp_job_detail_free(d);
  sp_close(c);
  close(sock);
}
END_TEST

/* A job is named by its id or a unique prefix, in either case. */
START_TEST(job_references) {
  start_with("", NULL);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  /* Seventeen ids: two of them share their first digit. */
  char hex[17][33];
  for (int i = 0; i < 17; i++)
    job_create(sock, 1, hex[i], NULL);
  char shared[2] = "";
  for (int a = 0; a < 17 && !shared[0]; a++)
    for (int b = a + 1; b < 17 && !shared[0]; b++)
      if (hex[a][0] == hex[b][0])
        shared[0] = hex[a][0];
  struct sp_test_reply r;
  ck_assert_int_eq(call_ref(sock, "job_status", shared, &r), SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(r.message, "give more digits"));
  sp_test_reply_free(&r);
  ck_assert_int_eq(call_ref(sock, "job_status", hex[3], &r), 0);
  sp_test_reply_free(&r);
  char upper[33];
  for (int i = 0; i < 33; i++)
    upper[i] = (char)(hex[5][i] >= 'a' ? hex[5][i] - 'a' + 'A' : hex[5][i]);
  ck_assert_int_eq(call_ref(sock, "job_status", upper, &r), 0);
  char got[33];
  const msgpack_object *job;
  ck_assert_int_eq(sp__msg_get_map(&r.map, "job", false, &job), 0);
  ck_assert_int_eq(sp__msg_get_strbuf(job, "job_id", false, got, sizeof got),
                   0);
  ck_assert_str_eq(got, hex[5]);
  sp_test_reply_free(&r);
  static const char *const bad[] = {"", "xyz",
                                    "0123456789abcdef0123456789abcdef0"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(call_ref(sock, "job_abort", bad[i], &r), SP_EINVAL);
    sp_test_reply_free(&r);
  }
  char none[33];
  memcpy(none, hex[0], sizeof none);
  none[31] = none[31] == '0' ? '1' : '0';
  ck_assert_int_eq(call_ref(sock, "job_abort", none, &r), SP_ENOJOB);
  sp_test_reply_free(&r);
  close(sock);
}
END_TEST

/* Abort mid-export: every rank's export fails with aborted, naming who,
 * its later calls too; the job and its pool memory go, the daemon serves
 * on. */
START_TEST(abort_fails_the_running_export) {
  start_with("", "300");
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 20,
                        .max_keys = 1};
  j.rank[0].asks = j.rank[1].asks = true;
  ranks_start(&j);
  ranks_wait_moving(&j, 0);
  char hex[33];
  only_job(hex);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  char prefix[9];
  snprintf(prefix, sizeof prefix, "%.8s", hex);
  struct sp_test_reply r;
  ck_assert_int_eq(call_ref(sock, "job_abort", prefix, &r), 0);
  char got[33];
  ck_assert_int_eq(sp__msg_get_strbuf(&r.map, "job_id", false, got, sizeof got),
                   0);
  ck_assert_str_eq(got, hex);
  sp_test_reply_free(&r);
  ranks_wait_exported(&j);
  ranks_finish(&j);
  for (uint32_t i = 0; i < 2; i++) {
    const struct ranks_rank *rk = &j.rank[i];
    ck_assert_msg(rk->export_rc == SP_EABORTED, "rank %u: %s", i,
                  sp_strerror(rk->export_rc));
    ck_assert_ptr_nonnull(strstr(rk->export_message, "aborted by uid 0"));
    ck_assert_int_eq(rk->last_rc, SP_EABORTED);
  }
  bool more;
  char last[33];
  uint32_t left = 1;
  for (int i = 0; i < 500 && left > 0; i++) {
    left = jobs_page(sock, "", &more, last);
    sleep_ms(10);
  }
  ck_assert_uint_eq(left, 0);
  ck_assert_int_eq(call_ref(sock, "job_abort", hex, &r), SP_ENOJOB);
  sp_test_reply_free(&r);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "status", id, 0);
  ck_assert_int_eq(call(sock, &mb, id, &r), 0);
  uint64_t used;
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "pool_used", false, &used), 0);
  ck_assert_uint_eq(used, 0);
  sp_test_reply_free(&r);
  close(sock);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-operator");
  TCase *tc = tcase_create("operator");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, allocating_before_round_one);
  tcase_add_test(tc, timed_out_asks_are_failed_exports);
  tcase_add_test(tc, jobs_in_pages);
  tcase_add_test(tc, job_status_of_the_largest_world);
  tcase_add_test(tc, job_references);
  tcase_add_test(tc, abort_fails_the_running_export);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
