/*
 * test_text.c - UTF-8 sequences, and peers' bytes made safe to show in an
 * error reply, a log line or on a terminal (proto/text.c).
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "proto/text.h"

START_TEST(utf8_lengths) {
  uint32_t cp;
  ck_assert_uint_eq(sp__utf8_len((const unsigned char *)"A", 1, &cp), 1);
  ck_assert_uint_eq(cp, 'A');
  ck_assert_uint_eq(sp__utf8_len((const unsigned char *)"\xc3\xa9", 2, &cp), 2);
  ck_assert_uint_eq(cp, 0xe9);
  ck_assert_uint_eq(sp__utf8_len((const unsigned char *)"\xc3\xa9", 1, &cp), 0);
  ck_assert_uint_eq(
      sp__utf8_len((const unsigned char *)"\xf0\x9f\x98\x80", 4, &cp), 4);
  ck_assert_uint_eq(cp, 0x1f600);
  ck_assert_uint_eq(sp__utf8_len((const unsigned char *)"\xc1\xbf", 2, &cp), 0);
  ck_assert_uint_eq(
      sp__utf8_len((const unsigned char *)"\xf5\x80\x80\x80", 4, &cp), 0);
}
END_TEST

/* What a key or a checkpoint's string may be: no NUL, no surrogate, no
 * overlong form, nothing past U+10FFFF, no sequence cut short. */
START_TEST(utf8_valid_strings) {
  ck_assert(sp__utf8_valid("caf\xc3\xa9 \xf0\x9f\x98\x80\x7f", 11));
  ck_assert(sp__utf8_valid("", 0));
  ck_assert(!sp__utf8_valid("a\0b", 3));
  ck_assert(!sp__utf8_valid("\xed\xa0\x80", 3));
  ck_assert(!sp__utf8_valid("\xe0\x80\xaf", 3));
  ck_assert(!sp__utf8_valid("\xf4\x90\x80\x80", 4));
  ck_assert(!sp__utf8_valid("\xc3", 1));
}
END_TEST

START_TEST(sanitize_for_terminal) {
  char buf[64];
  sp__text_sanitize("host", buf, sizeof buf);
  ck_assert_str_eq(buf, "host");
  sp__text_sanitize("a\x1b[2Jb", buf, sizeof buf);
  ck_assert_str_eq(buf, "a\\x1b[2Jb");
  sp__text_sanitize("caf\xc3\xa9\xff", buf, sizeof buf);
  ck_assert_str_eq(buf, "caf\xc3\xa9\\xff");
  /* U+009B is CSI in 8-bit terminals: escaped byte by byte. */
  sp__text_sanitize("\xc2\x9b", buf, sizeof buf);
  ck_assert_str_eq(buf, "\\xc2\\x9b");
  sp__text_sanitize("tab\there", buf, sizeof buf);
  ck_assert_str_eq(buf, "tab\\x09here");
  /* Truncation keeps whole characters and escapes. */
  sp__text_sanitize("abc\x1b", buf, 6);
  ck_assert_str_eq(buf, "abc");
  sp__text_sanitize("ab\xc3\xa9", buf, 4);
  ck_assert_str_eq(buf, "ab");
}
END_TEST

/* What the daemon quotes back from a peer: an op of bytes ff ff ff, and
 * a message cut in the middle of a character, come out as valid UTF-8. */
START_TEST(sanitize_peer_bytes) {
  char buf[64];
  sp__text_sanitize("unknown operation \"\xff\xff\xff\"", buf, sizeof buf);
  ck_assert_str_eq(buf, "unknown operation \"\\xff\\xff\\xff\"");
  sp__text_sanitize("key 'caf\xc3", buf, sizeof buf);
  ck_assert_str_eq(buf, "key 'caf\\xc3");
  sp__text_sanitize("line\nforged", buf, sizeof buf);
  ck_assert_str_eq(buf, "line\\x0aforged");
  sp__text_sanitize("", buf, sizeof buf);
  ck_assert_str_eq(buf, "");
}
END_TEST

int main(void) {
  Suite *s = suite_create("proto-text");
  TCase *tc = tcase_create("text");
  tcase_add_test(tc, utf8_lengths);
  tcase_add_test(tc, utf8_valid_strings);
  tcase_add_test(tc, sanitize_for_terminal);
  tcase_add_test(tc, sanitize_peer_bytes);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
