/*
 * test_view.c - the dtype table, view checks and the storage/view codec.
 */
#include <check.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "proto/dtype.h"
#include "proto/view.h"

static struct sp_view view1(enum sp_dtype dtype, int64_t n, int64_t stride,
                            int64_t offset) {
  struct sp_view v = {.dtype = dtype, .ndim = 1, .offset = offset};
  v.shape[0] = n;
  v.stride[0] = stride;
  return v;
}

static struct sp_view view2(enum sp_dtype dtype, int64_t a, int64_t b,
                            int64_t sa, int64_t sb, int64_t offset) {
  struct sp_view v = {.dtype = dtype, .ndim = 2, .offset = offset};
  v.shape[0] = a;
  v.shape[1] = b;
  v.stride[0] = sa;
  v.stride[1] = sb;
  return v;
}

START_TEST(dtype_names_and_sizes) {
  static const struct {
    const char *name;
    uint32_t size;
  } want[] = {
      {"float64", 8},       {"float32", 4},
      {"float16", 2},       {"bfloat16", 2},
      {"float8_e4m3fn", 1}, {"float8_e4m3fnuz", 1},
      {"float8_e5m2", 1},   {"float8_e5m2fnuz", 1},
      {"int8", 1},          {"int16", 2},
      {"int32", 4},         {"int64", 8},
      {"uint8", 1},         {"uint16", 2},
      {"uint32", 4},        {"uint64", 8},
      {"bool", 1},          {"complex64", 8},
      {"complex128", 16},
  };
  enum sp_dtype d;

  ck_assert_int_eq(sizeof want / sizeof want[0], SP_DTYPE_COUNT - 1);
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    ck_assert_int_eq(
        sp__dtype_from_name(want[i].name, strlen(want[i].name), &d), 0);
    ck_assert_uint_eq(sp__dtype_size(d), want[i].size);
    ck_assert_str_eq(sp__dtype_name(d), want[i].name);
  }
  ck_assert_int_eq(sp__dtype_from_name("torch.bfloat16", 14, &d), 0);
  ck_assert_int_eq(d, SP_DTYPE_BFLOAT16);
  /* A name is matched whole, never by prefix. */
  ck_assert_int_eq(sp__dtype_from_name("float", 5, &d), SP_EDTYPE);
  ck_assert_int_eq(sp__dtype_from_name("float32x", 8, &d), SP_EDTYPE);
  ck_assert_int_eq(sp__dtype_from_name("float32", 6, &d), SP_EDTYPE);
  ck_assert_uint_eq(sp__dtype_size(SP_DTYPE_INVALID), 0);
  ck_assert_uint_eq(sp__dtype_size((enum sp_dtype)99), 0);
  ck_assert_str_eq(sp__dtype_name((enum sp_dtype)99), "invalid");
}
END_TEST

START_TEST(view_inside_its_storage) {
  struct sp_view v = view2(SP_DTYPE_FLOAT32, 2, 3, 3, 1, 0);
  char msg[256];

  ck_assert_int_eq(sp__view_check(&v, 24, msg, sizeof msg), 0);
  v.offset = 1;
  ck_assert_int_eq(sp__view_check(&v, 24, msg, sizeof msg), SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(msg, "storage of 24 bytes"));
  ck_assert_int_eq(sp__view_check(&v, 28, NULL, 0), 0);
  /* A transposed view reaches the same six elements. */
  v = view2(SP_DTYPE_FLOAT32, 3, 2, 1, 3, 0);
  ck_assert_int_eq(sp__view_check(&v, 24, NULL, 0), 0);
  ck_assert(!sp__view_is_contiguous(&v));
  v = view2(SP_DTYPE_FLOAT32, 2, 3, 3, 1, 0);
  ck_assert(sp__view_is_contiguous(&v));
  /* An axis of one element may carry any stride. */
  v = view2(SP_DTYPE_FLOAT32, 1, 3, 77, 1, 0);
  ck_assert(sp__view_is_contiguous(&v));
}
END_TEST

/* A reinterpretation reads whole elements only: the tail of a storage
 * that is not a multiple of the element size is never part of a view. */
START_TEST(whole_elements_only) {
  struct sp_view v = view1(SP_DTYPE_FLOAT32, 2, 1, 0);

  ck_assert_uint_eq(sp__view_whole_elements(10, SP_DTYPE_FLOAT32), 2);
  ck_assert_uint_eq(sp__view_whole_elements(9, SP_DTYPE_FLOAT64), 1);
  ck_assert_uint_eq(sp__view_whole_elements(7, SP_DTYPE_COMPLEX128), 0);
  ck_assert_int_eq(sp__view_check(&v, 10, NULL, 0), 0);
  ck_assert_int_eq(sp__view_check(&v, 11, NULL, 0), 0);
  v.shape[0] = 3;
  ck_assert_int_eq(sp__view_check(&v, 11, NULL, 0), SP_EOUTOFBOUNDS);
  v = view1(SP_DTYPE_FLOAT64, 1, 1, 1);
  ck_assert_int_eq(sp__view_check(&v, 15, NULL, 0), SP_EOUTOFBOUNDS);
  ck_assert_int_eq(sp__view_check(&v, 16, NULL, 0), 0);
}
END_TEST

/* An empty view touches no byte: PyTorch leaves an empty dim-0 slice of a
 * column-sliced tensor past its storage's end (z[:, 2:7][9:9] of a 9x7
 * float32 z has offset 65 on 63 elements), and so may a registration.  Its
 * offset must still count bytes in 63 bits. */
START_TEST(empty_view_anywhere) {
  struct sp_view v = view2(SP_DTYPE_FLOAT32, 0, 5, 7, 1, 65);
  uint64_t extent = 1;
  char msg[256];

  ck_assert_int_eq(sp__view_check(&v, 63 * 4, msg, sizeof msg), 0);
  ck_assert_int_eq(sp__view_check(&v, 0, msg, sizeof msg), 0);
  ck_assert_int_eq(
      sp__view_extent(v.ndim, v.shape, v.stride, v.offset, &extent), 0);
  ck_assert_uint_eq(extent, 0);
  /* One row there reaches past the end. */
  v.shape[0] = 1;
  ck_assert_int_eq(sp__view_check(&v, 63 * 4, NULL, 0), SP_EOUTOFBOUNDS);
  /* The last offset whose bytes fit 63 bits passes; the next overflows. */
  v = view1(SP_DTYPE_FLOAT32, 0, 1, INT64_MAX / 4);
  ck_assert_int_eq(sp__view_check(&v, 16, NULL, 0), 0);
  v.offset++;
  ck_assert_int_eq(sp__view_check(&v, 16, msg, sizeof msg), SP_EOVERFLOW);
  ck_assert_ptr_nonnull(strstr(msg, "in bytes overflows"));
  v = view1(SP_DTYPE_UINT8, 0, 1, INT64_MAX);
  ck_assert_int_eq(sp__view_check(&v, 16, NULL, 0), 0);
}
END_TEST

START_TEST(negative_values_refused) {
  struct sp_view v = view1(SP_DTYPE_UINT8, -1, 1, 0);
  ck_assert_int_eq(sp__view_check(&v, 100, NULL, 0), SP_EINVAL);
  v = view1(SP_DTYPE_UINT8, 4, -1, 3);
  ck_assert_int_eq(sp__view_check(&v, 100, NULL, 0), SP_EINVAL);
  v = view1(SP_DTYPE_UINT8, 4, 1, -1);
  ck_assert_int_eq(sp__view_check(&v, 100, NULL, 0), SP_EINVAL);
  v = view1(SP_DTYPE_INVALID, 4, 1, 0);
  ck_assert_int_eq(sp__view_check(&v, 100, NULL, 0), SP_EDTYPE);
  v = view1(SP_DTYPE_UINT8, 4, 1, 0);
  v.ndim = SP_MAX_DIMS + 1;
  ck_assert_int_eq(sp__view_check(&v, 100, NULL, 0), SP_EINVAL);
}
END_TEST

START_TEST(overflow_refused) {
  struct sp_view v = view2(SP_DTYPE_FLOAT32, INT64_C(1) << 62, 4, 4, 1, 0);
  uint64_t n;

  ck_assert_int_eq(sp__view_check(&v, UINT64_MAX, NULL, 0), SP_EOVERFLOW);
  v = view1(SP_DTYPE_UINT8, 3, INT64_MAX, 0);
  ck_assert_int_eq(sp__view_check(&v, UINT64_MAX, NULL, 0), SP_EOVERFLOW);
  v = view1(SP_DTYPE_UINT8, 2, 1, INT64_MAX);
  ck_assert_int_eq(sp__view_check(&v, UINT64_MAX, NULL, 0), SP_EOVERFLOW);
  /* Elements that fit 63 bits but whose bytes do not. */
  v = view1(SP_DTYPE_COMPLEX128, INT64_C(1) << 61, 1, 0);
  ck_assert_int_eq(sp__view_check(&v, UINT64_MAX, NULL, 0), SP_EOVERFLOW);
  /* A zero dim empties the tensor before the others can overflow. */
  {
    int64_t shape[3] = {INT64_MAX, 0, INT64_MAX};
    ck_assert_int_eq(sp__view_numel(3, shape, &n), 0);
    ck_assert_uint_eq(n, 0);
  }
}
END_TEST

START_TEST(zero_stride_and_self_overlap) {
  struct sp_view v = view1(SP_DTYPE_FLOAT32, 3, 0, 0);
  ck_assert_int_eq(sp__view_check(&v, 64, NULL, 0), SP_EZEROSTRIDE);
  v = view1(SP_DTYPE_FLOAT32, 1, 0, 0);
  ck_assert_int_eq(sp__view_check(&v, 64, NULL, 0), 0);
  v = view2(SP_DTYPE_FLOAT32, 2, 2, 1, 1, 0);
  ck_assert_int_eq(sp__view_check(&v, 64, NULL, 0), SP_ESELFOVERLAP);
  /* Conservative: interleaved without overlap is refused as well. */
  v = view2(SP_DTYPE_FLOAT32, 3, 2, 2, 3, 0);
  ck_assert_int_eq(sp__view_check(&v, 64, NULL, 0), SP_ESELFOVERLAP);
  /* A sliced view with gaps is fine. */
  v = view2(SP_DTYPE_FLOAT32, 2, 2, 4, 2, 1);
  ck_assert_int_eq(sp__view_check(&v, 64, NULL, 0), 0);
  /* An empty view reaches nothing, whatever its strides and offset
   * (empty_view_anywhere). */
  v = view2(SP_DTYPE_FLOAT32, 0, 5, 0, 0, 3);
  ck_assert_int_eq(sp__view_check(&v, 12, NULL, 0), 0);
  v.offset = 4;
  ck_assert_int_eq(sp__view_check(&v, 12, NULL, 0), 0);
}
END_TEST

static struct sp_tensor tensor(uint32_t type, int32_t index, uint8_t uuid0,
                               uint64_t base, uint64_t nbytes,
                               struct sp_view v) {
  struct sp_tensor t;
  memset(&t, 0, sizeof t);
  t.storage.device.type = type;
  t.storage.device.index = index;
  t.storage.device.uuid[0] = uuid0;
  t.storage.base = base;
  t.storage.nbytes = nbytes;
  t.view = v;
  return t;
}

static bool view_same(const struct sp_view *a, const struct sp_view *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim || a->offset != b->offset)
    return false;
  for (uint32_t d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d])
      return false;
  return true;
}

/* One address on the host and on two GPUs is three storages; two views of
 * one storage are one. */
START_TEST(codec_dedupes_by_device_and_address) {
  struct sp_tensor in[6] = {
      tensor(SP_DEVICE_CPU, 0, 0, 0x1000, 64, view1(SP_DTYPE_FLOAT32, 4, 1, 0)),
      tensor(SP_DEVICE_CPU, 0, 0, 0x1000, 64,
             view2(SP_DTYPE_FLOAT16, 2, 4, 4, 1, 8)),
      tensor(SP_DEVICE_CUDA, 0, 1, 0x1000, 64,
             view1(SP_DTYPE_FLOAT32, 16, 1, 0)),
      tensor(SP_DEVICE_CUDA, 1, 2, 0x1000, 64, view1(SP_DTYPE_INT64, 8, 1, 0)),
      tensor(SP_DEVICE_CPU, 0, 0, 0x2000, 7, view1(SP_DTYPE_UINT8, 7, 1, 0)),
      tensor(SP_DEVICE_CUDA, 0, 1, 0x1000, 64,
             view1(SP_DTYPE_BFLOAT16, 4, 2, 1)),
  };
  static const uint32_t want[6] = {0, 0, 1, 2, 3, 1};
  struct sp_storage *storages;
  struct sp_view_meta *metas;
  struct sp_tensor out[6];
  size_t ns;
  char msg[256];

  ck_assert_int_eq(
      sp__view_encode(in, 6, &storages, &ns, &metas, msg, sizeof msg), 0);
  ck_assert_uint_eq(ns, 4);
  for (size_t i = 0; i < 6; i++) {
    ck_assert_uint_eq(metas[i].storage, want[i]);
    ck_assert(view_same(&metas[i].view, &in[i].view));
  }
  ck_assert_int_eq(storages[1].device.type, SP_DEVICE_CUDA);
  ck_assert_int_eq(storages[2].device.index, 1);
  ck_assert_int_eq(
      sp__view_decode(storages, ns, metas, 6, out, msg, sizeof msg), 0);
  for (size_t i = 0; i < 6; i++) {
    ck_assert(sp__device_equal(&out[i].storage.device, &in[i].storage.device));
    ck_assert_uint_eq(out[i].storage.base, in[i].storage.base);
    ck_assert_uint_eq(out[i].storage.nbytes, in[i].storage.nbytes);
    ck_assert(view_same(&out[i].view, &in[i].view));
  }
  free(storages);
  free(metas);
}
END_TEST

/* Same index, other uuid: another GPU. */
START_TEST(codec_tells_gpus_apart_by_uuid) {
  struct sp_tensor in[2] = {
      tensor(SP_DEVICE_CUDA, 0, 1, 0x1000, 64,
             view1(SP_DTYPE_FLOAT32, 4, 1, 0)),
      tensor(SP_DEVICE_CUDA, 0, 2, 0x1000, 64,
             view1(SP_DTYPE_FLOAT32, 4, 1, 0)),
  };
  struct sp_storage *storages;
  struct sp_view_meta *metas;
  size_t ns;

  ck_assert_int_eq(sp__view_encode(in, 2, &storages, &ns, &metas, NULL, 0), 0);
  ck_assert_uint_eq(ns, 2);
  free(storages);
  free(metas);
}
END_TEST

START_TEST(codec_refusals) {
  struct sp_tensor in[2] = {
      tensor(SP_DEVICE_CPU, 0, 0, 0x1000, 64, view1(SP_DTYPE_FLOAT32, 4, 1, 0)),
      tensor(SP_DEVICE_CPU, 0, 0, 0x1000, 32, view1(SP_DTYPE_FLOAT32, 4, 1, 0)),
  };
  struct sp_storage *storages = (void *)1;
  struct sp_view_meta *metas = (void *)1;
  struct sp_view_meta bad;
  struct sp_tensor out;
  size_t ns = 99;
  char msg[256];

  ck_assert_int_eq(
      sp__view_encode(in, 2, &storages, &ns, &metas, msg, sizeof msg),
      SP_EINVAL);
  ck_assert_ptr_null(storages);
  ck_assert_ptr_null(metas);
  ck_assert_uint_eq(ns, 0);
  in[1] =
      tensor(SP_DEVICE_CPU, 0, 0, 0x3000, 8, view1(SP_DTYPE_FLOAT32, 4, 1, 0));
  ck_assert_int_eq(
      sp__view_encode(in, 2, &storages, &ns, &metas, msg, sizeof msg),
      SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(msg, "tensor 1"));
  ck_assert_int_eq(sp__view_encode(in, 0, &storages, &ns, &metas, NULL, 0), 0);
  ck_assert_ptr_null(storages);
  bad.storage = 1;
  bad.view = view1(SP_DTYPE_FLOAT32, 4, 1, 0);
  ck_assert_int_eq(
      sp__view_decode(&in[0].storage, 1, &bad, 1, &out, msg, sizeof msg),
      SP_ENOSTORAGE);
  bad.storage = 0;
  bad.view = view1(SP_DTYPE_FLOAT32, 17, 1, 0);
  ck_assert_int_eq(
      sp__view_decode(&in[0].storage, 1, &bad, 1, &out, msg, sizeof msg),
      SP_EOUTOFBOUNDS);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-view");
  TCase *tc = tcase_create("view");
  SRunner *sr;
  int failed;

  tcase_add_test(tc, dtype_names_and_sizes);
  tcase_add_test(tc, view_inside_its_storage);
  tcase_add_test(tc, whole_elements_only);
  tcase_add_test(tc, empty_view_anywhere);
  tcase_add_test(tc, negative_values_refused);
  tcase_add_test(tc, overflow_refused);
  tcase_add_test(tc, zero_stride_and_self_overlap);
  tcase_add_test(tc, codec_dedupes_by_device_and_address);
  tcase_add_test(tc, codec_tells_gpus_apart_by_uuid);
  tcase_add_test(tc, codec_refusals);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
