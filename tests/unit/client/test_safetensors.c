/*
 * test_safetensors.c - the bytes client/safetensors.c builds: a header's
 * length field, JSON, escaping and padding, the files' names and the
 * index, compared with what docs/checkpoints.md says, byte for byte.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "client/safetensors.h"

static uint64_t le64(const char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | (uint8_t)p[i];
  return v;
}

START_TEST(header_bytes_and_padding) {
  static const int64_t shape_a[] = {2, 3}, shape_b[] = {0};
  struct st_tensor t[] = {
      {.key = "a", .dtype = SP_DTYPE_BFLOAT16, .ndim = 2, .shape = shape_a,
       .nbytes = 12},
      {.key = "b\"\\\n", .dtype = SP_DTYPE_BOOL, .ndim = 1, .shape = shape_b,
       .nbytes = 0},
  };
  sp_metadata meta[] = {{"k", "v\t"}};
  struct st_buf b;
  ck_assert_int_eq(st_header(t, 2, meta, 1, &b), 0);
  const char *json = "{\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\\u0009\"},"
                     "\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],"
                     "\"data_offsets\":[0,12]},"
                     "\"b\\\"\\\\\\u000a\":{\"dtype\":\"BOOL\",\"shape\":[0],"
                     "\"data_offsets\":[12,12]}}";
  size_t n = strlen(json);
  size_t padded = (n + 7) / 8 * 8;
  ck_assert_uint_eq(b.len, 8 + padded);
  ck_assert_uint_eq(le64(b.data), padded);
  ck_assert_int_eq(memcmp(b.data + 8, json, n), 0);
  for (size_t i = 8 + n; i < b.len; i++)
    ck_assert_int_eq(b.data[i], ' ');
  st_buf_free(&b);
}
END_TEST

/* A dtype safetensors cannot name is refused, and nothing is left. */
START_TEST(unnamed_dtype_is_refused) {
  static const int64_t shape[] = {1};
  struct st_tensor t = {.key = "z", .dtype = SP_DTYPE_COMPLEX64, .ndim = 1,
                        .shape = shape, .nbytes = 8};
  struct st_buf b;
  ck_assert_int_eq(st_header(&t, 1, NULL, 0, &b), SP_EDTYPE);
  ck_assert_ptr_null(b.data);
}
END_TEST

/* The header of one F32 tensor [1] named by a key of n 'k's: the length
 * of its JSON without the padding, or -1 when st_header refuses it
 * (freeing everything). */
static long header_with_key(size_t n) {
  static const int64_t shape[] = {1};
  char *key = malloc(n + 1);
  ck_assert_ptr_nonnull(key);
  memset(key, 'k', n);
  key[n] = '\0';
  struct st_tensor t = {.key = key, .dtype = SP_DTYPE_FLOAT32, .ndim = 1,
                        .shape = shape, .nbytes = 4};
  struct st_buf b;
  int rc = st_header(&t, 1, NULL, 0, &b);
  free(key);
  if (rc == SP_ELIMIT) {
    ck_assert_ptr_null(b.data);
    return -1;
  }
  ck_assert_int_eq(rc, 0);
  long len = (long)le64(b.data);
  ck_assert_uint_eq(b.len, 8 + (size_t)len);
  while (b.data[8 + len - 1] == ' ')
    len--;
  st_buf_free(&b);
  return len;
}

/* safetensors' reader refuses a header past ST_MAX_HEADER bytes: one of
 * exactly that many is written, one byte more (8 with the padding) is
 * refused. */
START_TEST(header_limit_at_its_edge) {
  long small = header_with_key(1000);
  /* A multiple of 8: the header at the limit needs no padding. */
  ck_assert_int_eq(ST_MAX_HEADER % 8, 0);
  size_t edge = 1000 + (size_t)(ST_MAX_HEADER - (unsigned long)small);
  ck_assert_int_eq(header_with_key(edge), (long)ST_MAX_HEADER);
  ck_assert_int_eq(header_with_key(edge + 1), -1);
}
END_TEST

START_TEST(file_names_and_index) {
  char name[64];
  st_file_name(0, 1, name, sizeof name);
  ck_assert_str_eq(name, "model.safetensors");
  st_file_name(1, 4, name, sizeof name);
  ck_assert_str_eq(name, "model-00002-of-00004.safetensors");
  struct st_buf b;
  st_index_begin(&b, 42);
  st_index_add(&b, "x.weight", 0, 2, true);
  st_index_add(&b, "y", 1, 2, false);
  ck_assert_int_eq(st_index_end(&b), 0);
  const char *want = "{\n  \"metadata\": {\n    \"total_size\": 42\n  },\n"
                     "  \"weight_map\": {\n"
                     "    \"x.weight\": \"model-00001-of-00002.safetensors\",\n"
                     "    \"y\": \"model-00002-of-00002.safetensors\"\n"
                     "  }\n}\n";
  ck_assert_uint_eq(b.len, strlen(want));
  ck_assert_int_eq(memcmp(b.data, want, b.len), 0);
  st_buf_free(&b);
}
END_TEST

int main(void) {
  Suite *s = suite_create("client-safetensors");
  TCase *tc = tcase_create("safetensors");
  tcase_add_test(tc, header_bytes_and_padding);
  tcase_add_test(tc, unnamed_dtype_is_refused);
  tcase_add_test(tc, file_names_and_index);
  tcase_add_test(tc, header_limit_at_its_edge);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
