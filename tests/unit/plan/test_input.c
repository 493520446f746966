/*
 * test_input.c - the planner's compact input (daemon/plan/input.c): which
 * holdings become 16-byte entries, that each is rebuilt exactly as it was
 * described, and that the key table holds a declaration once per job.
 */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/plan.h"

static const struct sp_storage storage = {.device = {.type = SP_DEVICE_CPU},
                                          .base = 0x10000,
                                          .nbytes = UINT64_C(1) << 40};

/* A row-major view of shape[0..ndim) at offset, rows in dim 0. */
static struct plan_key_in holding(const char *name,
                                  enum plan_placement placement, uint32_t ndim,
                                  const int64_t *shape, int64_t rows,
                                  int64_t offset) {
  struct plan_key_in e = {.name = name,
                          .placement = placement,
                          .device_type = SP_DEVICE_CPU,
                          .ndim = ndim};
  int64_t stride = 1;
  uint64_t numel = 1;

  e.view.dtype = SP_DTYPE_FLOAT32;
  e.view.ndim = ndim;
  e.view.offset = offset;
  for (uint32_t d = ndim; d-- > 0;) {
    e.shape[d] = shape[d];
    e.view.shape[d] = d == 0 ? rows : shape[d];
    e.view.stride[d] = stride;
    stride *= e.view.shape[d];
  }
  for (uint32_t d = 0; d < ndim; d++)
    numel *= (uint64_t)e.view.shape[d];
  e.nbytes = numel * 4;
  return e;
}

/* One rank holding keys[0..n) in a fresh store. */
static struct plan_input_store *store_of(const struct plan_key_in *keys,
                                         size_t n) {
  struct plan_input_store *s = plan_input_store_new(1);
  struct plan_rank_desc desc = {
      .nstorages = 1, .storages = &storage, .nkeys = n, .keys = keys};
  char msg[256];

  ck_assert_ptr_nonnull(s);
  ck_assert_msg(plan_input_add_rank(s, &desc, msg, sizeof msg) == 0, "%s", msg);
  return s;
}

/* The holding rebuilt from entry i is the one described. */
static void assert_rebuilt(const struct plan_input *in, size_t i,
                           const struct plan_key_in *want) {
  struct plan_key_in got;

  plan_input_holding(in, &in->ranks[0], &in->ranks[0].entries[i], &got);
  ck_assert_str_eq(got.name, want->name);
  ck_assert_int_eq(got.placement, want->placement);
  ck_assert_uint_eq(got.device_type, want->device_type);
  ck_assert_uint_eq(got.ndim, want->ndim);
  ck_assert_uint_eq(got.storage, want->storage);
  ck_assert_int_eq(got.view.dtype, want->view.dtype);
  ck_assert_uint_eq(got.view.ndim, want->view.ndim);
  ck_assert_int_eq(got.view.offset, want->view.offset);
  for (uint32_t d = 0; d < want->ndim; d++) {
    ck_assert_int_eq(got.shape[d], want->shape[d]);
    ck_assert_int_eq(got.view.shape[d], want->view.shape[d]);
    ck_assert_int_eq(got.view.stride[d], want->view.stride[d]);
  }
  ck_assert_uint_eq(got.nbytes, want->nbytes);
  ck_assert_uint_eq(got.npieces, want->npieces);
}

START_TEST(dense_holdings_are_compact_and_rebuilt_exactly) {
  const int64_t shape[3] = {10, 3, 5}, scalar[1] = {0};
  struct plan_key_in keys[5] = {
      holding("shard", PLAN_SHARD0, 3, shape, 4, 96),
      holding("empty", PLAN_SHARD0, 3, shape, 0, 0),
      holding("rep", PLAN_REPLICATED, 2, shape, 10, 7),
      holding("plain", PLAN_PLAIN, 1, shape, 10, 0),
      holding("scalar", PLAN_REPLICATED, 0, scalar, 0, 3),
  };
  struct plan_input_store *s = store_of(keys, 5);
  const struct plan_input *in = plan_input_of(s);

  ck_assert_uint_eq(sizeof(struct plan_entry), 16);
  ck_assert_uint_eq(in->ranks[0].nentries, 5);
  ck_assert_uint_eq(in->ranks[0].nfull, 0);
  for (size_t i = 0; i < 5; i++) {
    ck_assert_uint_ne(in->ranks[0].entries[i].storage, PLAN_ENTRY_FULL);
    assert_rebuilt(in, i, &keys[i]);
  }
  plan_input_store_free(s);
}
END_TEST

/* Offsets and rows of 32 bits are compact, one more is kept in full. */
START_TEST(offset_and_rows_at_32_bits) {
  const int64_t shape[2] = {INT64_C(1) << 33, 1};
  struct plan_key_in keys[4] = {
      holding("a", PLAN_SHARD0, 2, shape, 1, UINT32_MAX),
      holding("b", PLAN_SHARD0, 2, shape, 1, (int64_t)UINT32_MAX + 1),
      holding("c", PLAN_SHARD0, 2, shape, UINT32_MAX, 0),
      holding("d", PLAN_SHARD0, 2, shape, (int64_t)UINT32_MAX + 1, 0),
  };
  struct plan_input_store *s = store_of(keys, 4);
  const struct plan_input *in = plan_input_of(s);
  const struct plan_entry *e = in->ranks[0].entries;

  ck_assert_uint_eq(e[0].storage, 0);
  ck_assert_uint_eq(e[0].offset, UINT32_MAX);
  ck_assert_uint_eq(e[1].storage, PLAN_ENTRY_FULL);
  ck_assert_uint_eq(e[2].storage, 0);
  ck_assert_uint_eq(e[2].rows, UINT32_MAX);
  ck_assert_uint_eq(e[3].storage, PLAN_ENTRY_FULL);
  ck_assert_uint_eq(in->ranks[0].nfull, 2);
  for (size_t i = 0; i < 4; i++)
    assert_rebuilt(in, i, &keys[i]);
  plan_input_store_free(s);
}
END_TEST

/* What a compact entry cannot say is kept whole, so the planner sees (and
 * refuses) exactly what was registered. */
START_TEST(other_holdings_keep_their_full_form) {
  const int64_t shape[2] = {4, 6};
  static const struct affine_piece piece = {.ndim = 1, .shape = {24}};
  struct plan_key_in keys[5];

  keys[0] = holding("strided", PLAN_REPLICATED, 2, shape, 4, 0);
  keys[0].view.stride[0] = 1;
  keys[0].view.stride[1] = 4;
  keys[1] = holding("affine", PLAN_AFFINE, 2, shape, 4, 0);
  keys[1].npieces = 1;
  keys[1].pieces = &piece;
  keys[2] = holding("lies", PLAN_SHARD0, 2, shape, 2, 0);
  keys[2].nbytes += 4;
  keys[3] = holding("narrow", PLAN_SHARD0, 2, shape, 2, 0);
  keys[3].view.shape[1] = 5;
  keys[4] = holding("negative", PLAN_REPLICATED, 2, shape, 4, -1);
  struct plan_input_store *s = store_of(keys, 5);
  const struct plan_input *in = plan_input_of(s);

  ck_assert_uint_eq(in->ranks[0].nfull, 5);
  for (size_t i = 0; i < 5; i++) {
    ck_assert_uint_eq(in->ranks[0].entries[i].storage, PLAN_ENTRY_FULL);
    assert_rebuilt(in, i, &keys[i]);
  }
  plan_input_store_free(s);
}
END_TEST

/* A declaration is held once however many ranks hold the key; a rank that
 * declares it otherwise gets a row of its own, for the planner to name. */
START_TEST(key_table_once_per_job) {
  const int64_t shape[2] = {8, 2};
  struct plan_key_in keys[4][3];
  struct plan_input_store *s = plan_input_store_new(4);
  char msg[256];

  for (uint32_t r = 0; r < 4; r++) {
    keys[r][0] = holding("w0", PLAN_SHARD0, 2, shape, 2, 0);
    keys[r][1] = holding("w1", PLAN_SHARD0, 2, shape, 2, 4);
    keys[r][2] = holding("w2", PLAN_REPLICATED, 2, shape, 8, 8);
  }
  keys[3][2].view.dtype = SP_DTYPE_INT32;
  for (uint32_t r = 0; r < 4; r++) {
    struct plan_rank_desc desc = {.rank = r,
                                  .nstorages = 1,
                                  .storages = &storage,
                                  .nkeys = 3,
                                  .keys = keys[r]};
    ck_assert_int_eq(plan_input_add_rank(s, &desc, msg, sizeof msg), 0);
  }
  const struct plan_input *in = plan_input_of(s);
  ck_assert_uint_eq(in->nranks, 4);
  ck_assert_uint_eq(in->nkeys, 4);
  ck_assert_uint_eq(in->ranks[3].entries[2].key, 3);
  ck_assert_uint_eq(in->ranks[2].entries[2].key, 2);
  ck_assert_int_eq(in->keys[3].dtype, SP_DTYPE_INT32);
  plan_input_store_free(s);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-input");
  TCase *tc = tcase_create("input");
  SRunner *sr;
  int failed;

  tcase_add_test(tc, dense_holdings_are_compact_and_rebuilt_exactly);
  tcase_add_test(tc, offset_and_rows_at_32_bits);
  tcase_add_test(tc, other_holdings_keep_their_full_form);
  tcase_add_test(tc, key_table_once_per_job);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
