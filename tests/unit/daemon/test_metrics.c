/*
 * test_metrics.c - the exposition's bounds, without a daemon: peers past
 * METRICS_MAX_PEERS summed under peer="other", label values escaped as
 * the text format says, histogram buckets inclusive of their bounds, a
 * code the table lacks counted as "unknown", and a scrape that the loop
 * never answers served with the last gauges once its wait ends.
 */
#include <check.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/metrics.h"
#include "proto/text.h"
#include "shardport.h"

static int refreshes;

static void count_refresh(void *arg) {
  (void)arg;
  refreshes++;
}

static atomic_bool asked;

static void note_ask(void *arg) {
  (void)arg;
  atomic_store(&asked, true);
}

static void *render_waiting_an_hour(void *arg) {
  char *text;
  size_t len;
  if (metrics_render(arg, 3600u * 1000u, &text, &len) != 0)
    return NULL;
  return text;
}

static char *render(struct metrics *m) {
  char *text;
  size_t len;
  ck_assert_int_eq(metrics_render(m, 1, &text, &len), 0);
  ck_assert_uint_eq(strlen(text), len);
  return text;
}

static size_t count_lines(const char *text, const char *prefix) {
  size_t n = 0;
  for (const char *p = text; p != NULL && *p != '\0';) {
    if (strncmp(p, prefix, strlen(prefix)) == 0)
      n++;
    p = strchr(p, '\n');
    if (p != NULL)
      p++;
  }
  return n;
}

START_TEST(peers_past_the_cap_are_summed_as_other) {
  struct metrics *m = metrics_new("host", "why", count_refresh, NULL);
  ck_assert_ptr_nonnull(m);
  char addr[NODE_ADDR_MAX];
  for (int i = 0; i < METRICS_MAX_PEERS; i++) {
    snprintf(addr, sizeof addr, "10.0.0.%d:7070", i);
    struct metrics_peer *p = metrics_peer(m, addr);
    atomic_fetch_add(&p->sent, 1);
    /* The same address again is the same entry. */
    ck_assert_ptr_eq(metrics_peer(m, addr), p);
  }
  char *text = render(m);
  ck_assert_uint_eq(count_lines(text, "shardport_peer_sent_bytes_total{"),
                    METRICS_MAX_PEERS);
  ck_assert_ptr_null(strstr(text, "peer=\"other\""));
  free(text);
  /* Two more addresses share one entry. */
  struct metrics_peer *a = metrics_peer(m, "10.0.1.1:7070");
  struct metrics_peer *b = metrics_peer(m, "10.0.1.2:7070");
  ck_assert_ptr_eq(a, b);
  atomic_fetch_add(&a->sent, 5);
  atomic_fetch_add(&b->received, 7);
  text = render(m);
  ck_assert_uint_eq(count_lines(text, "shardport_peer_sent_bytes_total{"),
                    METRICS_MAX_PEERS + 1);
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_peer_sent_bytes_total{peer=\"other\"} 5\n"));
  ck_assert_ptr_nonnull(strstr(
      text, "shardport_peer_received_bytes_total{peer=\"other\"} 7\n"));
  free(text);
  metrics_free(m);
}
END_TEST

START_TEST(label_values_are_escaped) {
  struct metrics *m =
      metrics_new("host", "a \"quoted\" C:\\path\nand a line", count_refresh,
                  NULL);
  ck_assert_ptr_nonnull(m);
  char *text = render(m);
  ck_assert_ptr_nonnull(strstr(
      text, "reason=\"a \\\"quoted\\\" C:\\\\path\\nand a line\"} 1\n"));
  free(text);
  metrics_free(m);
}
END_TEST

/* A reason cut mid-character or naming a path in another encoding: the
 * exposition stays UTF-8 (Prometheus refuses a whole scrape with one label
 * value that is not), the bytes shown as \xNN. */
START_TEST(label_values_stay_utf8) {
  struct metrics *m = metrics_new(
      "host", "libcudart at /opt/\xe9t\xe9 \xc3\xa9 cut \xe2\x82",
      count_refresh, NULL);
  ck_assert_ptr_nonnull(m);
  char *text = render(m);
  ck_assert_ptr_nonnull(
      strstr(text, "reason=\"libcudart at /opt/\\\\xe9t\\\\xe9 \xc3\xa9 cut "
                   "\\\\xe2\\\\x82\"} 1\n"));
  const unsigned char *s = (const unsigned char *)text;
  size_t n = strlen(text);
  while (n > 0) {
    uint32_t cp;
    size_t k = sp__utf8_len(s, n, &cp);
    ck_assert_msg(k > 0, "not UTF-8 at %.20s", (const char *)s);
    s += k;
    n -= k;
  }
  free(text);
  metrics_free(m);
}
END_TEST

/* The daemon stopping joins the HTTP thread while the loop answers no
 * more: a scrape waiting for the loop's gauges ends at once with the last
 * ones, rather than holding the stop for its whole wait. */
START_TEST(a_waiting_scrape_ends_when_the_endpoint_stops) {
  struct metrics *m = metrics_new("host", "", note_ask, NULL);
  ck_assert_ptr_nonnull(m);
  atomic_store(&asked, false);
  metrics_set_gauges(m, &(struct metrics_gauges){.clients = 5});
  pthread_t scrape;
  ck_assert_int_eq(pthread_create(&scrape, NULL, render_waiting_an_hour, m),
                   0);
  while (!atomic_load(&asked))
    sched_yield();
  metrics_stop_waiting(m);
  /* Bounds a hang, measures nothing: the scrape would wait an hour. */
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 2;
  void *text = NULL;
  ck_assert_int_eq(pthread_timedjoin_np(scrape, &text, &until), 0);
  ck_assert_ptr_nonnull(text);
  ck_assert_ptr_nonnull(strstr(text, "shardport_clients 5\n"));
  free(text);
  metrics_free(m);
}
END_TEST

START_TEST(buckets_include_their_bound) {
  struct metrics *m = metrics_new("host", "", count_refresh, NULL);
  ck_assert_ptr_nonnull(m);
  metrics_export_done(m, &(struct metrics_export){.duration_s = 1.0});
  metrics_export_done(m, &(struct metrics_export){.duration_s = 1.0001});
  metrics_export_done(m, &(struct metrics_export){.duration_s = 1e9});
  metrics_export_done(m, &(struct metrics_export){.code = -9999,
                                                  .duration_s = 0});
  char *text = render(m);
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_export_duration_seconds_bucket{le=\"0.5\"} 1\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_export_duration_seconds_bucket{le=\"1\"} 2\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_export_duration_seconds_bucket{le=\"2.5\"} 3\n"));
  ck_assert_ptr_nonnull(strstr(
      text, "shardport_export_duration_seconds_bucket{le=\"86400\"} 3\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_export_duration_seconds_bucket{le=\"+Inf\"} 4\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_exports_total{result=\"published\"} 3\n"));
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_exports_total{result=\"unknown\"} 1\n"));
  free(text);
  metrics_free(m);
}
END_TEST

START_TEST(an_unanswered_scrape_shows_the_last_gauges) {
  struct metrics *m = metrics_new("host", "", count_refresh, NULL);
  ck_assert_ptr_nonnull(m);
  refreshes = 0;
  metrics_set_gauges(m, &(struct metrics_gauges){
                            .clients = 3, .ranks = 2,
                            .loop_max_busy_ns = 2500001});
  char *text = render(m);
  ck_assert_int_eq(refreshes, 1);
  ck_assert_ptr_nonnull(strstr(text, "shardport_clients 3\n"));
  ck_assert_ptr_nonnull(strstr(text, "shardport_ranks 2\n"));
  /* Seconds, to the microsecond the status figure has too. */
  ck_assert_ptr_nonnull(strstr(text, "# TYPE shardport_loop_max_busy_seconds "
                                     "gauge\n"));
  ck_assert_ptr_nonnull(strstr(text, "shardport_loop_max_busy_seconds "
                                     "0.002500\n"));
  free(text);
  metrics_refused(m, SP_ETIMEOUT);
  metrics_refused(m, SP_ETIMEOUT);
  text = render(m);
  ck_assert_ptr_nonnull(
      strstr(text, "shardport_requests_refused_total{code=\"timeout\"} 2\n"));
  free(text);
  metrics_free(m);
}
END_TEST

int main(void) {
  Suite *s = suite_create("metrics");
  TCase *tc = tcase_create("exposition");
  tcase_add_test(tc, peers_past_the_cap_are_summed_as_other);
  tcase_add_test(tc, label_values_are_escaped);
  tcase_add_test(tc, label_values_stay_utf8);
  tcase_add_test(tc, a_waiting_scrape_ends_when_the_endpoint_stops);
  tcase_add_test(tc, buckets_include_their_bound);
  tcase_add_test(tc, an_unanswered_scrape_shows_the_last_gauges);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
