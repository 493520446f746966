/*
 * test_wire.c - the bounded scanner and the message layer: golden bytes,
 * round trips, and every limit refused with its code.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "proto/msg.h"
#include "proto/wire.h"

static struct sp_limits limits;

static void setup(void) { sp__limits_default(&limits); }

static int check_bytes(const uint8_t *data, size_t len) {
  return sp__wire_check(data, len, &limits);
}

START_TEST(ping_has_golden_bytes) {
  struct sp_msgbuf mb;
  struct sp_frame_tx tx;
  sp__msgbuf_begin(&mb, "ping", 7, 0);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);
  static const uint8_t golden[] = {0x00, 0x00, 0x00, 0x0d, 0x82, 0xa2, 'o',
                                   'p',  0xa4, 'p',  'i',  'n',  'g',  0xa2,
                                   'i',  'd',  0x07};
  ck_assert_uint_eq(tx.len, sizeof golden);
  ck_assert_mem_eq(tx.buf, golden, sizeof golden);
  free(tx.buf);
}
END_TEST

START_TEST(message_round_trips_every_field_type) {
  struct sp_msgbuf mb;
  struct sp_frame_tx tx;
  sp__msgbuf_begin(&mb, "status", UINT64_MAX, 6);
  sp__pack_kv_str(&mb.pk, "name", "shard\"port");
  sp__pack_kv_u64(&mb.pk, "big", UINT64_MAX - 1);
  sp__pack_kv_i64(&mb.pk, "neg", INT64_MIN);
  sp__pack_kv_f64(&mb.pk, "rate", 1.5);
  sp__pack_kv_bool(&mb.pk, "yes", true);
  sp__pack_str(&mb.pk, "blob");
  sp__pack_bin(&mb.pk, "\0\1\2", 3);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);

  msgpack_zone zone;
  msgpack_zone_init(&zone, 1024);
  msgpack_object map;
  ck_assert_int_eq(sp__wire_decode(tx.buf + SP_FRAME_HEADER,
                                   tx.len - SP_FRAME_HEADER, &limits, &zone,
                                   &map),
                   0);
  struct sp_msg_head head;
  ck_assert_int_eq(sp__msg_head(&map, &head), 0);
  ck_assert_str_eq(head.op, "status");
  ck_assert_uint_eq(head.id, UINT64_MAX);

  char name[32];
  uint64_t big;
  int64_t neg;
  double rate;
  bool yes;
  const uint8_t *blob;
  size_t blob_len;
  ck_assert_int_eq(sp__msg_get_strbuf(&map, "name", false, name, sizeof name),
                   0);
  ck_assert_str_eq(name, "shard\"port");
  ck_assert_int_eq(sp__msg_get_u64(&map, "big", false, &big), 0);
  ck_assert_uint_eq(big, UINT64_MAX - 1);
  ck_assert_int_eq(sp__msg_get_i64(&map, "neg", false, &neg), 0);
  ck_assert(neg == INT64_MIN);
  ck_assert_int_eq(sp__msg_get_f64(&map, "rate", false, &rate), 0);
  ck_assert(rate == 1.5);
  ck_assert_int_eq(sp__msg_get_bool(&map, "yes", false, &yes), 0);
  ck_assert(yes);
  ck_assert_int_eq(sp__msg_get_bin(&map, "blob", false, &blob, &blob_len), 0);
  ck_assert_uint_eq(blob_len, 3);
  ck_assert_mem_eq(blob, "\0\1\2", 3);

  /* Wrong types and absent fields are refused; optional absent ones are not. */
  ck_assert_int_eq(sp__msg_get_u64(&map, "name", false, &big), SP_EBADMSG);
  ck_assert_int_eq(sp__msg_get_u64(&map, "neg", false, &big), SP_EBADMSG);
  ck_assert_int_eq(sp__msg_get_u64(&map, "absent", false, &big), SP_EBADMSG);
  ck_assert_int_eq(sp__msg_get_u64(&map, "absent", true, &big), 1);
  ck_assert_int_eq(sp__msg_get_strbuf(&map, "name", false, name, 4),
                   SP_EBADMSG);
  ck_assert_int_eq(sp__msg_get_i64(&map, "big", false, &neg), SP_EBADMSG);

  msgpack_zone_destroy(&zone);
  free(tx.buf);
}
END_TEST

START_TEST(error_reply_names_its_code) {
  struct sp_frame_tx tx;
  ck_assert_int_eq(
      sp__msg_error(&tx, 9, SP_EVERSION,
                    "protocol version mismatch (client %d, daemon %d)", 2, 1),
      0);
  msgpack_zone zone;
  msgpack_zone_init(&zone, 1024);
  msgpack_object map;
  ck_assert_int_eq(sp__wire_decode(tx.buf + SP_FRAME_HEADER,
                                   tx.len - SP_FRAME_HEADER, &limits, &zone,
                                   &map),
                   0);
  struct sp_msg_head head;
  ck_assert_int_eq(sp__msg_head(&map, &head), 0);
  ck_assert_str_eq(head.op, "error");
  ck_assert_uint_eq(head.id, 9);
  char message[128];
  ck_assert_int_eq(sp__msg_error_code(&map, message, sizeof message),
                   SP_EVERSION);
  ck_assert_str_eq(message, "protocol version mismatch (client 2, daemon 1)");
  msgpack_zone_destroy(&zone);
  free(tx.buf);
}
END_TEST

START_TEST(error_table_is_consistent) {
#define CHECK_ENTRY(name, num, wire, msg)                                      \
  ck_assert_int_eq(SP_E##name, -(num));                                        \
  ck_assert_str_eq(sp_err_name(SP_E##name), wire);                             \
  ck_assert_str_eq(sp_strerror(SP_E##name), msg);                              \
  ck_assert_int_eq(sp__error_from_name(wire, strlen(wire)), SP_E##name);
  SP_ERROR_MAP(CHECK_ENTRY)
#undef CHECK_ENTRY
  ck_assert_str_eq(sp_err_name(-9999), "unknown");
  ck_assert_str_eq(sp_strerror(-9999), "unknown error");
  ck_assert_str_eq(sp_err_name(0), "ok");
  ck_assert_int_eq(sp__error_from_name("no_such_code", 12), SP_EINTERNAL);
}
END_TEST

/* The inputs that bring msgpack-c down when it trusts declared counts. */
START_TEST(array_of_four_billion_is_refused) {
  static const uint8_t in[] = {0x81, 0xa1, 'a', 0xdd, 0xff, 0x00, 0x00, 0x00};
  ck_assert_int_eq(check_bytes(in, sizeof in), SP_ETOOMANY);
  static const uint8_t top[] = {0xdd, 0xff, 0x00, 0x00, 0x00};
  ck_assert_int_eq(check_bytes(top, sizeof top), SP_EMALFORMED);
}
END_TEST

START_TEST(map32_of_max_count_is_refused) {
  static const uint8_t in[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
  ck_assert_int_eq(check_bytes(in, sizeof in), SP_ETOOMANY);
}
END_TEST

START_TEST(count_beyond_bytes_left_is_refused) {
  /* {"a": [16 items declared, 3 present]} */
  static const uint8_t in[] = {0x81, 0xa1, 'a', 0xdc, 0x00, 0x10, 1, 2, 3};
  ck_assert_int_eq(check_bytes(in, sizeof in), SP_ETOOMANY);
  /* Exactly as many items as bytes is accepted. */
  static const uint8_t ok[] = {0x81, 0xa1, 'a', 0x93, 1, 2, 3};
  ck_assert_int_eq(check_bytes(ok, sizeof ok), 0);
}
END_TEST

START_TEST(item_limit_is_applied) {
  limits.max_items = 2;
  static const uint8_t in[] = {0x81, 0xa1, 'a', 0x93, 1, 2, 3};
  ck_assert_int_eq(check_bytes(in, sizeof in), SP_ETOOMANY);
  static const uint8_t ok[] = {0x81, 0xa1, 'a', 0x92, 1, 2};
  ck_assert_int_eq(check_bytes(ok, sizeof ok), 0);
}
END_TEST

static uint8_t *nested(size_t depth, size_t *len) {
  /* {"a": [[[ ... [] ... ]]]} with depth levels in all, the map included. */
  uint8_t *buf = malloc(depth + 3);
  size_t n = 0;
  buf[n++] = 0x81;
  buf[n++] = 0xa1;
  buf[n++] = 'a';
  for (size_t i = 1; i < depth; i++)
    buf[n++] = i + 1 < depth ? 0x91 : 0x90;
  *len = n;
  return buf;
}

START_TEST(items_of_the_whole_frame_are_bounded) {
  limits.max_items = 4;
  /* Each container is within the limit; together they hold 4 + 3 + 3 = 10
   * items (a map pair counting two), more than twice the limit. */
  static const uint8_t in[] = {0x82, 0xa1, 'a', 0x93, 1, 2, 3,
                               0xa1, 'b', 0x93, 1, 2, 3};
  ck_assert_int_eq(check_bytes(in, sizeof in), SP_ETOOMANY);
  static const uint8_t ok[] = {0x82, 0xa1, 'a', 0x92, 1, 2, 0xa1, 'b', 0x92, 1, 2};
  ck_assert_int_eq(check_bytes(ok, sizeof ok), 0);
}
END_TEST

START_TEST(nesting_beyond_limit_is_refused) {
  size_t len;
  uint8_t *ok = nested(limits.max_depth, &len);
  ck_assert_int_eq(check_bytes(ok, len), 0);
  free(ok);
  uint8_t *deep = nested(limits.max_depth + 1, &len);
  ck_assert_int_eq(check_bytes(deep, len), SP_ETOODEEP);
  free(deep);
  uint8_t *very = nested(100000, &len);
  ck_assert_int_eq(check_bytes(very, len), SP_ETOODEEP);
  free(very);
}
END_TEST

START_TEST(string_limits_are_applied) {
  /* str32 claiming 4 GiB - 1 bytes in a 9-byte frame. */
  static const uint8_t huge[] = {0x81, 0xa1, 'a', 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'};
  ck_assert_int_eq(check_bytes(huge, sizeof huge), SP_ESTRTOOLONG);
  limits.max_string = 2;
  static const uint8_t three[] = {0x81, 0xa1, 'a', 0xa3, 'x', 'y', 'z'};
  ck_assert_int_eq(check_bytes(three, sizeof three), SP_ESTRTOOLONG);
  static const uint8_t bin[] = {0x81, 0xa1, 'a', 0xc4, 0x03, 'x', 'y', 'z'};
  ck_assert_int_eq(check_bytes(bin, sizeof bin), SP_ESTRTOOLONG);
  static const uint8_t ext[] = {0x81, 0xa1, 'a', 0xc7, 0x03, 0x01, 'x', 'y', 'z'};
  ck_assert_int_eq(check_bytes(ext, sizeof ext), SP_ESTRTOOLONG);
  /* An ext's type byte does not count against the limit on its data. */
  static const uint8_t ext_ok[] = {0x81, 0xa1, 'a', 0xc7, 0x02, 0x01, 'x', 'y'};
  ck_assert_int_eq(check_bytes(ext_ok, sizeof ext_ok), 0);
}
END_TEST

START_TEST(malformed_frames_are_refused) {
  static const uint8_t empty[] = {0};
  ck_assert_int_eq(check_bytes(empty, 0), SP_EMALFORMED);
  static const uint8_t not_map[] = {0x93, 1, 2, 3};
  ck_assert_int_eq(check_bytes(not_map, sizeof not_map), SP_EMALFORMED);
  static const uint8_t trailing[] = {0x80, 0x01};
  ck_assert_int_eq(check_bytes(trailing, sizeof trailing), SP_EMALFORMED);
  static const uint8_t truncated[] = {0x81, 0xa1, 'a', 0xcf, 0, 0};
  ck_assert_int_eq(check_bytes(truncated, sizeof truncated), SP_EMALFORMED);
  static const uint8_t never_used[] = {0x81, 0xa1, 'a', 0xc1};
  ck_assert_int_eq(check_bytes(never_used, sizeof never_used), SP_EMALFORMED);
  static const uint8_t short_len[] = {0x81, 0xa1, 'a', 0xdd, 0x00};
  ck_assert_int_eq(check_bytes(short_len, sizeof short_len), SP_EMALFORMED);
  static const uint8_t missing_value[] = {0x82, 0xa1, 'a', 0x01};
  ck_assert_int_eq(check_bytes(missing_value, sizeof missing_value), SP_ETOOMANY);
}
END_TEST

START_TEST(head_requires_op_and_id) {
  msgpack_zone zone;
  msgpack_zone_init(&zone, 256);
  msgpack_object map;
  struct sp_msg_head head;
  static const uint8_t no_id[] = {0x81, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n', 'g'};
  ck_assert_int_eq(sp__wire_decode(no_id, sizeof no_id, &limits, &zone, &map),
                   0);
  ck_assert_int_eq(sp__msg_head(&map, &head), SP_EBADMSG);
  /* An op one byte longer than SP_OP_MAX. */
  uint8_t long_op[64] = {0x82, 0xa2, 'o', 'p', 0xd9, SP_OP_MAX + 1};
  size_t n = 6;
  memset(long_op + n, 'x', SP_OP_MAX + 1);
  n += SP_OP_MAX + 1;
  long_op[n++] = 0xa2;
  long_op[n++] = 'i';
  long_op[n++] = 'd';
  long_op[n++] = 0x01;
  ck_assert_int_eq(sp__wire_decode(long_op, n, &limits, &zone, &map), 0);
  ck_assert_int_eq(sp__msg_head(&map, &head), SP_EBADMSG);
  msgpack_zone_destroy(&zone);
}
END_TEST

static Suite *wire_suite(void) {
  Suite *s = suite_create("wire");
  TCase *tc = tcase_create("core");
  tcase_add_checked_fixture(tc, setup, NULL);
  tcase_add_test(tc, ping_has_golden_bytes);
  tcase_add_test(tc, message_round_trips_every_field_type);
  tcase_add_test(tc, error_reply_names_its_code);
  tcase_add_test(tc, error_table_is_consistent);
  tcase_add_test(tc, array_of_four_billion_is_refused);
  tcase_add_test(tc, map32_of_max_count_is_refused);
  tcase_add_test(tc, count_beyond_bytes_left_is_refused);
  tcase_add_test(tc, item_limit_is_applied);
  tcase_add_test(tc, items_of_the_whole_frame_are_bounded);
  tcase_add_test(tc, nesting_beyond_limit_is_refused);
  tcase_add_test(tc, string_limits_are_applied);
  tcase_add_test(tc, malformed_frames_are_refused);
  tcase_add_test(tc, head_requires_op_and_id);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(wire_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
