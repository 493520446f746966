/*
 * test_publish.c - where owned tensors live and how each owner is told:
 * aligned, disjoint regions; tied keys sharing one; identity keys taking no
 * pool memory; replies cut into parts that fit a frame and list only the
 * rank's own tensors.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/save.h"
#include "proto/wire.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

static struct plan *build(struct tmodel *m) {
  struct plan *plan;
  char msg[512];
  int rc = plan_build(tmodel_input(m, 0, 0), &plan, msg, sizeof msg);
  ck_assert_msg(rc == 0, "plan_build: %s", msg);
  return plan;
}

START_TEST(layout_rules) {
  struct tmodel m;
  tmodel_init(&m, 3, 1 << 16);
  tmodel_shard0(&m, "a", SP_DTYPE_FLOAT32, 2, (int64_t[]){7, 3},
                (int64_t[]){3, 0, 4});
  tmodel_shard0(&m, "b", SP_DTYPE_UINT8, 1, (int64_t[]){13},
                (int64_t[]){5, 4, 4});
  tmodel_shard0(&m, "c.empty", SP_DTYPE_FLOAT32, 2, (int64_t[]){0, 3},
                (int64_t[]){0, 0, 0});
  tmodel_whole(&m, "d.replicated", SP_DTYPE_FLOAT32, PLAN_REPLICATED, 1,
               (int64_t[]){5}, 0);
  tmodel_whole(&m, "e.expert", SP_DTYPE_INT16, PLAN_EXPERT, 1, (int64_t[]){4},
               1);
  tmodel_columns(&m, "f.columns", SP_DTYPE_BFLOAT16, 3, 3);
  tmodel_tie(&m, "g.tied", "a");
  tmodel_tie(&m, "0.tied_first", "b");
  struct plan *plan = build(&m);
  struct publish_layout l;
  ck_assert_int_eq(publish_layout_build(plan, &l), 0);
  bool seen[16] = {false};
  for (uint32_t r = 0; r < 3; r++) {
    /* Each rank's keys in name order, each one its own. */
    for (size_t i = l.owned_first[r]; i < l.owned_first[r + 1]; i++) {
      uint32_t k = l.owned[i];
      ck_assert_uint_eq(plan->keys[k].owner, r);
      ck_assert(!seen[k]);
      seen[k] = true;
      if (i > l.owned_first[r])
        ck_assert_uint_lt(l.owned[i - 1], k);
    }
  }
  ck_assert_uint_eq(l.owned_first[3], plan->nkeys);
  for (size_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    ck_assert(seen[k]);
    switch (key->kind) {
    case PLAN_KEY_IDENTITY:
      ck_assert_uint_eq(l.offset[k], PUBLISH_IDENTITY);
      break;
    case PLAN_KEY_ALIAS:
      ck_assert_uint_eq(l.offset[k], l.offset[key->alias_of]);
      ck_assert_uint_eq(key->owner, plan->keys[key->alias_of].owner);
      break;
    default:
      ck_assert_uint_eq(l.offset[k] % PUBLISH_ALIGN, 0);
      ck_assert_uint_le(l.offset[k] + key->nbytes, l.seg_size[key->owner]);
      /* Disjoint from every other region of the same owner. */
      for (size_t j = 0; j < plan->nkeys; j++) {
        const struct plan_key *o = &plan->keys[j];
        if (j == k || o->owner != key->owner ||
            (o->kind != PLAN_KEY_MOVE && o->kind != PLAN_KEY_EMPTY))
          continue;
        ck_assert(l.offset[j] + o->nbytes <= l.offset[k] ||
                  l.offset[k] + key->nbytes <= l.offset[j] || o->nbytes == 0 ||
                  key->nbytes == 0);
      }
      break;
    }
  }
  /* A tie's first key by name moves; the other shares its buffer. */
  uint32_t first = plan_find_key(plan, "0.tied_first");
  uint32_t b = plan_find_key(plan, "b");
  ck_assert_int_eq(plan->keys[b].kind, PLAN_KEY_ALIAS);
  ck_assert_uint_eq(plan->keys[b].alias_of, first);
  ck_assert_uint_eq(l.offset[b], l.offset[first]);
  uint32_t g = plan_find_key(plan, "g.tied");
  ck_assert_int_eq(plan->keys[g].kind, PLAN_KEY_ALIAS);
  ck_assert_uint_eq(l.offset[g], l.offset[plan_find_key(plan, "a")]);
  publish_layout_free(&l);
  plan_free(plan);
  tmodel_free(&m);
}
END_TEST

/* A rank that owns only empty tensors still gets a (one-byte) segment to
 * map; a rank that owns only identity tensors gets none. */
START_TEST(segments_for_empty_and_identity) {
  struct tmodel m;
  tmodel_init(&m, 2, 4096);
  tmodel_shard0(&m, "empty", SP_DTYPE_FLOAT32, 2, (int64_t[]){0, 3},
                (int64_t[]){0, 0});
  tmodel_whole(&m, "mine", SP_DTYPE_INT8, PLAN_EXPERT, 1, (int64_t[]){3}, 1);
  struct plan *plan = build(&m);
  struct publish_layout l;
  ck_assert_int_eq(publish_layout_build(plan, &l), 0);
  uint32_t e = plan_find_key(plan, "empty");
  ck_assert_int_eq(plan->keys[e].kind, PLAN_KEY_EMPTY);
  uint32_t owner = plan->keys[e].owner;
  ck_assert_uint_eq(l.seg_size[owner], 1);
  ck_assert_uint_eq(l.seg_size[1 - owner], 0);
  ck_assert_uint_eq(l.offset[plan_find_key(plan, "mine")], PUBLISH_IDENTITY);
  publish_layout_free(&l);
  plan_free(plan);
  tmodel_free(&m);
}
END_TEST

/* Decodes a packed part as a client would. */
static void decode(struct sp_msgbuf *mb, msgpack_zone *zone,
                   msgpack_object *map, size_t *len) {
  struct sp_limits limits;
  sp_limits_default(&limits);
  *len = mb->sbuf.size - SP_FRAME_HEADER;
  ck_assert_int_eq(
      sp_wire_decode((const uint8_t *)mb->sbuf.data + SP_FRAME_HEADER, *len,
                     &limits, zone, map),
      0);
}

START_TEST(parts_fit_and_list_only_owned) {
  struct tmodel m;
  tmodel_init(&m, 2, 1 << 20);
  char names[300][80];
  for (int i = 0; i < 300; i++) {
    snprintf(names[i], sizeof names[i],
             "model.layers.%03d.self_attention.a_long_parameter_name", i);
    if (i % 3 == 0)
      tmodel_whole(&m, names[i], SP_DTYPE_FLOAT32, PLAN_REPLICATED, 2,
                   (int64_t[]){2, 3}, 0);
    else
      tmodel_shard0(&m, names[i], SP_DTYPE_BFLOAT16, 2, (int64_t[]){4, 3},
                    (int64_t[]){1, 3});
  }
  struct plan *plan = build(&m);
  struct publish_layout l;
  ck_assert_int_eq(publish_layout_build(plan, &l), 0);
  const uint64_t limit = 4096;
  for (uint32_t r = 0; r < 2; r++) {
    size_t *first, nparts;
    ck_assert_int_eq(
        publish_parts(plan, &l, r, limit, 1u << 20, &first, &nparts), 0);
    ck_assert_uint_gt(nparts, 3);
    size_t listed = 0;
    for (size_t p = 0; p < nparts; p++) {
      size_t end = p + 1 < nparts ? first[p + 1] : l.owned_first[r + 1];
      struct sp_msgbuf mb;
      publish_pack(plan, &l, &m.reg[r], r, 77, 5, p, nparts, first[p], end,
                   NULL, NULL, &mb);
      msgpack_zone zone;
      msgpack_object map;
      size_t len;
      msgpack_zone_init(&zone, 4096);
      decode(&mb, &zone, &map, &len);
      ck_assert_uint_le(len, limit);
      uint64_t v;
      ck_assert_int_eq(sp_msg_get_u64(&map, "id", false, &v), 0);
      ck_assert_uint_eq(v, 77);
      ck_assert_int_eq(sp_msg_get_u64(&map, "export_id", false, &v), 0);
      ck_assert_uint_eq(v, 5);
      ck_assert_int_eq(sp_msg_get_u64(&map, "part", false, &v), 0);
      ck_assert_uint_eq(v, p);
      ck_assert_int_eq(sp_msg_get_u64(&map, "parts", false, &v), 0);
      ck_assert_uint_eq(v, nparts);
      ck_assert_int_eq(sp_msg_get_u64(&map, "segments", true, &v),
                       p == 0 ? 0 : 1);
      if (p == 0)
        ck_assert_uint_eq(v, l.seg_size[r] > 0 ? 1 : 0);
      const msgpack_object_array *t;
      ck_assert_int_eq(sp_msg_get_array(&map, "tensors", false, &t), 0);
      for (uint32_t i = 0; i < t->size; i++) {
        char key[128];
        uint64_t off, sid, seg;
        ck_assert_int_eq(
            sp_msg_get_strbuf(&t->ptr[i], "key", false, key, sizeof key), 0);
        uint32_t k = l.owned[l.owned_first[r] + listed + i];
        ck_assert_str_eq(key, plan->keys[k].name);
        ck_assert_uint_eq(plan->keys[k].owner, r);
        ck_assert_int_eq(sp_msg_get_u64(&t->ptr[i], "byte_offset", false, &off),
                         0);
        const msgpack_object_array *stride;
        ck_assert_int_eq(sp_msg_get_array(&t->ptr[i], "stride", false, &stride),
                         0);
        if (plan->keys[k].kind == PLAN_KEY_IDENTITY) {
          ck_assert_int_eq(sp_msg_get_u64(&t->ptr[i], "sid", false, &sid), 0);
          ck_assert_uint_eq(sid, 1);
          ck_assert_int_eq(sp_msg_get_u64(&t->ptr[i], "segment", true, &seg),
                           1);
          ck_assert_uint_eq(off, tmodel_offset(&m, r, key));
        } else {
          ck_assert_int_eq(sp_msg_get_u64(&t->ptr[i], "segment", false, &seg),
                           0);
          ck_assert_uint_eq(seg, 0);
          ck_assert_uint_eq(off, l.offset[k]);
          ck_assert_uint_eq(stride->ptr[0].via.u64, 3);
          ck_assert_uint_eq(stride->ptr[1].via.u64, 1);
        }
      }
      listed += t->size;
      msgpack_zone_destroy(&zone);
      sp_msgbuf_discard(&mb);
    }
    ck_assert_uint_eq(listed, l.owned_first[r + 1] - l.owned_first[r]);
    free(first);
    /* With few items allowed, parts are cut by items too, and each one
     * passes the wire check of a peer with those limits, a save's reply
     * (a file per tensor) included where one tensor's map fits at all. */
    uint32_t *file_of = calloc(plan->nkeys, sizeof *file_of);
    ck_assert_ptr_nonnull(file_of);
    struct save_files files = {.file = file_of, .nfiles = 1};
    static const uint32_t item_limits[] = {16, 64, 1000};
    for (size_t li = 0; li < 3; li++) {
      struct sp_limits limits;
      sp_limits_default(&limits);
      limits.max_items = item_limits[li];
      ck_assert_int_eq(publish_parts(plan, &l, r, limits.max_frame,
                                     limits.max_items, &first, &nparts),
                       0);
      size_t n = 0;
      for (size_t p = 0; p < nparts; p++) {
        size_t end = p + 1 < nparts ? first[p + 1] : l.owned_first[r + 1];
        struct sp_msgbuf mb;
        publish_pack(plan, &l, &m.reg[r], r, 1, 1, p, nparts, first[p], end,
                     NULL, li > 0 && p % 2 == 0 ? &files : NULL, &mb);
        ck_assert_int_eq(
            sp_wire_check((const uint8_t *)mb.sbuf.data + SP_FRAME_HEADER,
                          mb.sbuf.size - SP_FRAME_HEADER, &limits),
            0);
        n += end - first[p];
        sp_msgbuf_discard(&mb);
      }
      ck_assert_uint_eq(n, listed);
      if (item_limits[li] == 64)
        ck_assert_uint_gt(nparts, listed / 6);
      free(first);
    }
    free(file_of);
  }
  publish_layout_free(&l);
  plan_free(plan);
  tmodel_free(&m);
}
END_TEST

/* A rank that owns nothing is still answered: one part, no tensors. */
START_TEST(rank_owning_nothing_gets_one_part) {
  struct tmodel m;
  tmodel_init(&m, 2, 4096);
  tmodel_whole(&m, "only", SP_DTYPE_INT8, PLAN_EXPERT, 1, (int64_t[]){3}, 0);
  struct plan *plan = build(&m);
  struct publish_layout l;
  ck_assert_int_eq(publish_layout_build(plan, &l), 0);
  size_t *first, nparts;
  ck_assert_int_eq(publish_parts(plan, &l, 1, 4096, 16, &first, &nparts), 0);
  ck_assert_uint_eq(nparts, 1);
  ck_assert_uint_eq(first[0], l.owned_first[1]);
  ck_assert_uint_eq(l.owned_first[2], l.owned_first[1]);
  free(first);
  publish_layout_free(&l);
  plan_free(plan);
  tmodel_free(&m);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-publish");
  TCase *tc = tcase_create("publish");
  tcase_add_test(tc, layout_rules);
  tcase_add_test(tc, segments_for_empty_and_identity);
  tcase_add_test(tc, parts_fit_and_list_only_owned);
  tcase_add_test(tc, rank_owning_nothing_gets_one_part);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
