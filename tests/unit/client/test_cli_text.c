/*
 * test_cli_text.c - the CLI's JSON strings and numbers, byte counts, the
 * gist of a reason and durations (terminal-safe text is
 * tests/unit/proto/test_text.c's).
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

static char out_buf[4096];

/* Runs json_string on s and returns what it wrote. */
static const char *json_of(const char *s) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  ck_assert_ptr_nonnull(f);
  json_string(f, s);
  ck_assert_int_eq(fclose(f), 0);
  ck_assert_uint_lt(len, sizeof out_buf);
  memcpy(out_buf, text, len + 1);
  free(text);
  return out_buf;
}

static const char *double_of(double v) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  ck_assert_ptr_nonnull(f);
  json_double(f, v);
  ck_assert_int_eq(fclose(f), 0);
  memcpy(out_buf, text, len + 1);
  free(text);
  return out_buf;
}

START_TEST(json_plain_and_escapes) {
  ck_assert_str_eq(json_of(""), "\"\"");
  ck_assert_str_eq(json_of("host"), "\"host\"");
  ck_assert_str_eq(json_of("a\"b\\c/d"), "\"a\\\"b\\\\c/d\"");
  ck_assert_str_eq(json_of("\n\r\t\b\f"), "\"\\n\\r\\t\\b\\f\"");
  ck_assert_str_eq(json_of("\x01\x1f\x1b[2J"), "\"\\u0001\\u001f\\u001b[2J\"");
  /* DEL is legal in JSON and passes through. */
  ck_assert_str_eq(json_of("\x7f"), "\"\x7f\"");
}
END_TEST

START_TEST(json_utf8_passes_through) {
  ck_assert_str_eq(json_of("caf\xc3\xa9"), "\"caf\xc3\xa9\"");
  ck_assert_str_eq(json_of("\xe2\x82\xac"), "\"\xe2\x82\xac\"");         /* € */
  ck_assert_str_eq(json_of("\xf0\x9f\x98\x80"), "\"\xf0\x9f\x98\x80\""); /* 😀 */
  ck_assert_str_eq(json_of("\xf4\x8f\xbf\xbf"), "\"\xf4\x8f\xbf\xbf\""); /* U+10FFFF */
  /* Line and paragraph separators are escaped for JavaScript's sake. */
  ck_assert_str_eq(json_of("\xe2\x80\xa8\xe2\x80\xa9"), "\"\\u2028\\u2029\"");
}
END_TEST

START_TEST(json_invalid_utf8_is_replaced) {
  ck_assert_str_eq(json_of("\xff"), "\"\\ufffd\"");
  ck_assert_str_eq(json_of("a\x80z"), "\"a\\ufffdz\"");
  /* Overlong forms, surrogates, past U+10FFFF, truncated sequences. */
  ck_assert_str_eq(json_of("\xc0\xaf"), "\"\\ufffd\\ufffd\"");
  ck_assert_str_eq(json_of("\xe0\x80\xaf"), "\"\\ufffd\\ufffd\\ufffd\"");
  ck_assert_str_eq(json_of("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");
  ck_assert_str_eq(json_of("\xf4\x90\x80\x80"),
                   "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
  ck_assert_str_eq(json_of("\xe2\x82"), "\"\\ufffd\\ufffd\"");
  ck_assert_str_eq(json_of("\xc3" "A"), "\"\\ufffdA\"");
}
END_TEST

START_TEST(json_doubles_round_trip) {
  ck_assert_str_eq(double_of(0), "0");
  ck_assert_str_eq(double_of(93784.5), "93784.5");
  ck_assert_str_eq(double_of(0.1), "0.1");
  ck_assert_str_eq(double_of(5e8), "500000000");
  ck_assert_double_eq(strtod(double_of(1.0 / 3), NULL), 1.0 / 3);
  ck_assert_double_eq(strtod(double_of(1e300), NULL), 1e300);
  ck_assert_double_eq(strtod(double_of(4.9e-324), NULL), 4.9e-324);
  ck_assert_str_eq(double_of(NAN), "null");
  ck_assert_str_eq(double_of(INFINITY), "null");
}
END_TEST

START_TEST(reasons_keep_their_gist) {
  char buf[64];
  ck_assert(text_gist("the CUDA backend cannot serve: no usable NVIDIA "
                      "driver: cudaGetDeviceCount failed with error 35 (x); "
                      "CUDA runtime 13.0",
                      buf, sizeof buf));
  ck_assert_str_eq(buf, "the CUDA backend cannot serve: no usable NVIDIA "
                        "driver");
  ck_assert(!text_gist("selected by configuration", buf, sizeof buf));
  ck_assert_str_eq(buf, "selected by configuration");
  ck_assert(text_gist("2 GPUs; CUDA 13.0", buf, sizeof buf));
  ck_assert_str_eq(buf, "2 GPUs");
  ck_assert(text_gist("0123456789", buf, 5));
  ck_assert_str_eq(buf, "0123");
  ck_assert(!text_gist("", buf, sizeof buf));
  ck_assert_str_eq(buf, "");
}
END_TEST

START_TEST(bytes_are_human) {
  char buf[32];
  sp_format_bytes(0, buf, sizeof buf);
  ck_assert_str_eq(buf, "0 B");
  sp_format_bytes(1023, buf, sizeof buf);
  ck_assert_str_eq(buf, "1023 B");
  sp_format_bytes(1024, buf, sizeof buf);
  ck_assert_str_eq(buf, "1.0 KiB");
  sp_format_bytes(1536, buf, sizeof buf);
  ck_assert_str_eq(buf, "1.5 KiB");
  sp_format_bytes(UINT64_C(1) << 30, buf, sizeof buf);
  ck_assert_str_eq(buf, "1.0 GiB");
  sp_format_bytes((UINT64_C(1) << 20) - 1, buf, sizeof buf);
  ck_assert_str_eq(buf, "1.0 MiB");
  sp_format_bytes(UINT64_MAX, buf, sizeof buf);
  ck_assert_str_eq(buf, "16.0 EiB");
}
END_TEST

START_TEST(durations_are_human) {
  char buf[64];
  text_duration(0.4, buf, sizeof buf);
  ck_assert_str_eq(buf, "0s");
  text_duration(59.9, buf, sizeof buf);
  ck_assert_str_eq(buf, "59s");
  text_duration(60, buf, sizeof buf);
  ck_assert_str_eq(buf, "1m 0s");
  text_duration(3723, buf, sizeof buf);
  ck_assert_str_eq(buf, "1h 2m 3s");
  text_duration(93784.5, buf, sizeof buf);
  ck_assert_str_eq(buf, "1d 2h 3m 4s");
  text_duration(-5, buf, sizeof buf);
  ck_assert_str_eq(buf, "0s");
  text_duration(NAN, buf, sizeof buf);
  ck_assert_str_eq(buf, "0s");
  text_duration(1e300, buf, sizeof buf);
  ck_assert_uint_gt(strlen(buf), 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("cli_text");
  TCase *json = tcase_create("json");
  tcase_add_test(json, json_plain_and_escapes);
  tcase_add_test(json, json_utf8_passes_through);
  tcase_add_test(json, json_invalid_utf8_is_replaced);
  tcase_add_test(json, json_doubles_round_trip);
  suite_add_tcase(s, json);
  TCase *text = tcase_create("text");
  tcase_add_test(text, bytes_are_human);
  tcase_add_test(text, reasons_keep_their_gist);
  tcase_add_test(text, durations_are_human);
  suite_add_tcase(s, text);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
