/*
 * test_client_errors.c - sp_strerror and sp_err_name, as the shared library
 * exports them, for every code of the table and for codes outside it.
 */
#include <check.h>
#include <limits.h>
#include <string.h>

#include "shardport.h"

struct entry {
  int code;
  int num;
  const char *wire;
  const char *message;
};

static const struct entry table[] = {
#define ENTRY(name, num, wire, msg) {SP_E##name, num, wire, msg},
    SP_ERROR_MAP(ENTRY)
#undef ENTRY
};
#define NTABLE (sizeof table / sizeof table[0])

START_TEST(every_code_has_its_name_and_message) {
  for (size_t i = 0; i < NTABLE; i++) {
    ck_assert_int_eq(table[i].code, -table[i].num);
    ck_assert_str_eq(sp_err_name(table[i].code), table[i].wire);
    ck_assert_str_eq(sp_strerror(table[i].code), table[i].message);
    ck_assert_uint_gt(strlen(table[i].message), 0);
  }
}
END_TEST

/* The wire names and numbers are a protocol: each must be unique. */
START_TEST(codes_and_names_are_unique) {
  for (size_t i = 0; i < NTABLE; i++)
    for (size_t j = i + 1; j < NTABLE; j++) {
      ck_assert_int_ne(table[i].code, table[j].code);
      ck_assert_str_ne(table[i].wire, table[j].wire);
    }
}
END_TEST

/* Numbers already on the wire never move. */
START_TEST(numbers_are_stable) {
  ck_assert_int_eq(SP_EIO, -1);
  ck_assert_int_eq(SP_ENODAEMON, -2);
  ck_assert_int_eq(SP_EVERSION, -4);
  ck_assert_int_eq(SP_EBADMSG, -12);
  ck_assert_int_eq(SP_EPERM, -14);
  ck_assert_int_eq(SP_ETIMEOUT, -16);
  ck_assert_int_eq(SP_EINTERNAL, -19);
  ck_assert_int_eq(SP_EPOOL, -100);
  ck_assert_int_eq(SP_EABORTED, -101);
  ck_assert_int_eq(SP_EDAEMONSTOPPING, -102);
  ck_assert_int_eq(SP_EDAEMONRESTARTED, -103);
  ck_assert_int_eq(SP_ECONSUMERLOST, -104);
}
END_TEST

START_TEST(unknown_codes_have_text) {
  static const int unknown[] = {-22, -39, -76, -105, -9999, INT_MIN};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
    ck_assert_str_eq(sp_err_name(unknown[i]), "unknown");
    ck_assert_str_eq(sp_strerror(unknown[i]), "unknown error");
  }
}
END_TEST

START_TEST(success_and_positive_values) {
  ck_assert_str_eq(sp_strerror(0), "success");
  ck_assert_str_eq(sp_err_name(0), "ok");
  ck_assert_str_eq(sp_strerror(3), "success");
  ck_assert_str_eq(sp_err_name(INT_MAX), "ok");
}
END_TEST

int main(void) {
  Suite *s = suite_create("client_errors");
  TCase *tc = tcase_create("errors");
  tcase_add_test(tc, every_code_has_its_name_and_message);
  tcase_add_test(tc, codes_and_names_are_unique);
  tcase_add_test(tc, numbers_are_stable);
  tcase_add_test(tc, unknown_codes_have_text);
  tcase_add_test(tc, success_and_positive_values);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
