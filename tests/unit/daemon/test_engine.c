/*
 * test_engine.c - the engine runs a real plan's rounds from read-only
 * registry mappings into owner segments: every assembled tensor equals the
 * unsharded original, replicas are compared and a differing one is
 * refused, a cancel stops it, a truncated trainer file fails the export
 * instead of killing the process, and a warm segment (kept from its
 * owner's earlier export) gets its tensors rewritten and every other byte
 * zeroed.
 */
#include <check.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/registry.h"
#include "daemon/xfer/engine.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

/* A plan, its layout, zeroed segments and an engine wired to them. */
struct run {
  struct plan *plan;
  struct publish_layout layout;
  uint8_t *seg[TMODEL_MAX_RANKS];
  const struct xfer_storage *src[TMODEL_MAX_RANKS];
  struct engine e;
};

static void run_setup(struct run *run, struct tmodel *m, uint32_t max_keys,
                      uint64_t max_bytes) {
  char msg[512];
  memset(run, 0, sizeof *run);
  int rc = plan_build(tmodel_input(m, max_keys, max_bytes), &run->plan, msg,
                      sizeof msg);
  ck_assert_msg(rc == 0, "plan_build: %s", msg);
  ck_assert_int_eq(publish_layout_build(run->plan, &run->layout), 0);
  for (uint32_t r = 0; r < m->world; r++) {
    run->src[r] = m->reg[r].info;
    if (run->layout.seg_size[r] > 0) {
      run->seg[r] = aligned_alloc(
          PUBLISH_ALIGN, (run->layout.seg_size[r] + PUBLISH_ALIGN - 1) &
                             ~(uint64_t)(PUBLISH_ALIGN - 1));
      memset(run->seg[r], 0, run->layout.seg_size[r]);
    }
  }
  run->e.plan = run->plan;
  run->e.src = run->src;
  run->e.dst = run->seg;
  run->e.dst_size = run->layout.seg_size;
  run->e.key_offset = run->layout.offset;
}

static void run_free(struct run *run, uint32_t world) {
  for (uint32_t r = 0; r < world; r++)
    free(run->seg[r]);
  publish_layout_free(&run->layout);
  plan_free(run->plan);
}

static uint64_t plan_traffic(const struct plan *plan) {
  uint64_t n = 0;
  for (size_t r = 0; r < plan->nrounds; r++)
    n += plan->rounds[r].nbytes;
  return n;
}

/* Three ranks, every kind of key. */
static void build_model(struct tmodel *m) {
  tmodel_init(m, 3, 1 << 16);
  tmodel_shard0(m, "a.uneven", SP_DTYPE_FLOAT32, 2, (int64_t[]){7, 5},
                (int64_t[]){3, 0, 4});
  tmodel_shard0(m, "b.one_rank", SP_DTYPE_INT16, 2, (int64_t[]){4, 3},
                (int64_t[]){0, 4, 0});
  tmodel_shard0(m, "c.empty", SP_DTYPE_FLOAT32, 2, (int64_t[]){0, 3},
                (int64_t[]){0, 0, 0});
  tmodel_shard0(m, "d.bytes", SP_DTYPE_UINT8, 1, (int64_t[]){11},
                (int64_t[]){5, 3, 3});
  tmodel_whole(m, "e.replicated", SP_DTYPE_BFLOAT16, PLAN_REPLICATED, 1,
               (int64_t[]){6}, 0);
  tmodel_whole(m, "f.plain", SP_DTYPE_FLOAT64, PLAN_PLAIN, 2, (int64_t[]){2, 2},
               0);
  tmodel_whole(m, "g.expert", SP_DTYPE_FLOAT8_E4M3FN, PLAN_EXPERT, 2,
               (int64_t[]){3, 3}, 2);
  tmodel_columns(m, "h.columns", SP_DTYPE_FLOAT32, 4, 2);
  tmodel_replica(m, "i.replica", SP_DTYPE_INT32, 3, 5, 0x5);
  tmodel_tie(m, "j.tied", "a.uneven");
  for (int i = 0; i < 6; i++) {
    char *name = malloc(16);
    snprintf(name, 16, "k.%d", i);
    tmodel_shard0(m, name, SP_DTYPE_FLOAT16, 1, (int64_t[]){6},
                  (int64_t[]){2, 2, 2});
  }
}

static void free_model(struct tmodel *m) {
  for (size_t i = 0; i < m->nkeys; i++)
    if (strncmp(m->key_name[i], "k.", 2) == 0)
      free((char *)m->key_name[i]);
  tmodel_free(m);
}

START_TEST(rounds_assemble_every_tensor) {
  struct tmodel m;
  struct run run;
  build_model(&m);
  /* Three keys a round: the moves cross several round boundaries. */
  run_setup(&run, &m, 3, 0);
  ck_assert_uint_gt(run.plan->nrounds, 2);
  run.e.threads = (uint32_t)_i + 1; /* one, two and three threads */
  ck_assert_int_eq(engine_run(&run.e), 0);
  ck_assert_uint_eq(atomic_load(&run.e.round), run.plan->nrounds);
  ck_assert_uint_eq(atomic_load(&run.e.bytes_moved), plan_traffic(run.plan));
  tmodel_check(&m, run.plan, &run.layout, run.seg);
  /* The trainers' memory is as it was: the engine only read it. */
  for (uint32_t r = 0; r < m.world; r++) {
    const struct xfer_storage *s = &m.reg[r].info[0];
    ck_assert_mem_eq(s->data, m.map[r], m.size[r]);
  }
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

START_TEST(identity_moves_nothing) {
  struct tmodel m;
  struct run run;
  tmodel_init(&m, 2, 4096);
  tmodel_whole(&m, "r", SP_DTYPE_FLOAT32, PLAN_REPLICATED, 1, (int64_t[]){9},
               0);
  tmodel_whole(&m, "p", SP_DTYPE_FLOAT64, PLAN_PLAIN, 2, (int64_t[]){2, 3}, 0);
  tmodel_whole(&m, "x", SP_DTYPE_INT8, PLAN_EXPERT, 1, (int64_t[]){3}, 1);
  run_setup(&run, &m, 0, 0);
  ck_assert_uint_eq(run.plan->nrounds, 0);
  ck_assert_uint_eq(run.layout.seg_size[0], 0);
  ck_assert_uint_eq(run.layout.seg_size[1], 0);
  ck_assert_int_eq(engine_run(&run.e), 0);
  ck_assert_uint_eq(atomic_load(&run.e.bytes_moved), 0);
  tmodel_check(&m, run.plan, &run.layout, run.seg);
  run_free(&run, m.world);
  tmodel_free(&m);
}
END_TEST

START_TEST(different_replicas_refused) {
  struct tmodel m;
  struct run run;
  build_model(&m);
  /* Rank 2's copy of i.replica differs at element (1, 2). */
  uint64_t at = tmodel_offset(&m, 2, "i.replica");
  m.map[2][at + (1 * 5 + 2) * 4 + 3] ^= 0x40;
  run_setup(&run, &m, 0, 0);
  run.e.threads = 2;
  ck_assert_int_eq(engine_run(&run.e), SP_EDIFFERENT);
  ck_assert_ptr_nonnull(strstr(run.e.msg, "'i.replica'"));
  ck_assert_ptr_nonnull(strstr(run.e.msg, "[1, 2]"));
  ck_assert_ptr_nonnull(strstr(run.e.msg, "rank 0 and rank 2"));
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

START_TEST(cancel_stops_before_copying) {
  struct tmodel m;
  struct run run;
  build_model(&m);
  run_setup(&run, &m, 3, 0);
  atomic_store(&run.e.cancel, true);
  ck_assert_int_ne(engine_run(&run.e), 0);
  ck_assert_uint_eq(atomic_load(&run.e.bytes_moved), 0);
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

static _Atomic int notified;

static void count_notify(void *arg) {
  (void)arg;
  atomic_fetch_add(&notified, 1);
}

START_TEST(thread_reports_rounds_and_end) {
  struct tmodel m;
  struct run run;
  build_model(&m);
  run_setup(&run, &m, 2, 0);
  atomic_store(&notified, 0);
  run.e.notify = count_notify;
  ck_assert_int_eq(engine_start(&run.e), 0);
  engine_join(&run.e);
  ck_assert(atomic_load(&run.e.done));
  ck_assert_int_eq(run.e.rc, 0);
  /* Once per round and once at the end. */
  ck_assert_int_eq(atomic_load(&notified), (int)run.plan->nrounds + 1);
  tmodel_check(&m, run.plan, &run.layout, run.seg);
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

/* A trainer truncating its registered memfd makes the engine's next read
 * fault: the export fails naming the rank and key, the process lives, and
 * the next run works (the handler and the signal mask are restored). */
START_TEST(truncated_source_fails_the_run) {
  for (int attempt = 0; attempt < 2; attempt++) {
    struct tmodel m;
    struct run run;
    build_model(&m);
    run_setup(&run, &m, 0, 0);
    run.e.threads = (uint32_t)attempt * 2 + 1;
    ck_assert_int_eq(ftruncate(m.fd[1], 0), 0);
    ck_assert_int_eq(engine_run(&run.e), SP_EBADFD);
    ck_assert_ptr_nonnull(strstr(run.e.msg, "rank 1"));
    ck_assert_ptr_nonnull(strstr(run.e.msg, "truncated"));
    run_free(&run, m.world);
    free_model(&m);
  }
  struct tmodel m;
  struct run run;
  build_model(&m);
  run_setup(&run, &m, 0, 0);
  ck_assert_int_eq(engine_run(&run.e), 0);
  tmodel_check(&m, run.plan, &run.layout, run.seg);
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

/* A shard bigger than the engine's slice is copied slice by slice. */
START_TEST(large_shard_in_slices) {
  struct tmodel m;
  struct run run;
  const int64_t cols = 1 << 20; /* 4 MiB rows */
  tmodel_init(&m, 2, (size_t)(10 * cols * 4 + 4096));
  int64_t global[2] = {11, cols};
  int64_t shape[2] = {10, cols};
  uint64_t at = tmodel_dense(&m, 0, "big", SP_DTYPE_FLOAT32, PLAN_SHARD0, 2,
                             global, shape);
  shape[0] = 1;
  tmodel_dense(&m, 1, "big", SP_DTYPE_FLOAT32, PLAN_SHARD0, 2, global, shape);
  /* Whichever rank owns it, both shards land in its segment in rank
   * order; rank 0's 40 MiB shard is one move of several slices. */
  run_setup(&run, &m, 0, 0);
  run.e.threads = 4;
  ck_assert_int_eq(engine_run(&run.e), 0);
  const struct plan_key *key = &run.plan->keys[0];
  ck_assert_int_eq(key->kind, PLAN_KEY_MOVE);
  const uint8_t *t = run.seg[key->owner] + run.layout.offset[0];
  ck_assert_int_eq(memcmp(t, m.map[0] + at, (size_t)(10 * cols * 4)), 0);
  ck_assert_int_eq(memcmp(t + 10 * cols * 4,
                          m.map[1] + tmodel_offset(&m, 1, "big"),
                          (size_t)cols * 4),
                   0);
  ck_assert_uint_eq(atomic_load(&run.e.bytes_moved), 11ull * cols * 4);
  run_free(&run, m.world);
  tmodel_free(&m);
}
END_TEST

/* Segments full of an earlier export's bytes (here 0xAB everywhere, and
 * larger than this export needs): every tensor is assembled over them and
 * every byte outside the tensors is zero again, with one to three
 * threads over several rounds. */
START_TEST(warm_segments_rewritten_and_gaps_zeroed) {
  struct tmodel m;
  struct run run;
  build_model(&m);
  run_setup(&run, &m, 3, 0);
  uint64_t size[TMODEL_MAX_RANKS];
  bool warm[TMODEL_MAX_RANKS];
  for (uint32_t r = 0; r < m.world; r++) {
    /* A kept segment of a larger earlier export: a tail to zero too. */
    size[r] = run.layout.seg_size[r] > 0 ? run.layout.seg_size[r] + 4096 : 0;
    warm[r] = size[r] > 0;
    if (size[r] == 0)
      continue;
    free(run.seg[r]);
    run.seg[r] = aligned_alloc(PUBLISH_ALIGN,
                               (size[r] + PUBLISH_ALIGN - 1) &
                                   ~(uint64_t)(PUBLISH_ALIGN - 1));
    memset(run.seg[r], 0xAB, size[r]);
  }
  run.e.dst_size = size;
  run.e.dst_warm = warm;
  run.e.threads = (uint32_t)_i + 1;
  ck_assert_int_eq(engine_run(&run.e), 0);
  tmodel_check(&m, run.plan, &run.layout, run.seg);
  for (uint32_t r = 0; r < m.world; r++) {
    if (size[r] == 0)
      continue;
    uint8_t *covered = calloc(size[r], 1);
    for (size_t k = 0; k < run.plan->nkeys; k++) {
      const struct plan_key *key = &run.plan->keys[k];
      if (key->owner == r &&
          (key->kind == PLAN_KEY_MOVE || key->kind == PLAN_KEY_EMPTY))
        memset(covered + run.layout.offset[k], 1, key->nbytes);
    }
    for (uint64_t b = 0; b < size[r]; b++)
      if (!covered[b])
        ck_assert_msg(run.seg[r][b] == 0, "rank %u byte %" PRIu64 ": 0x%02x",
                      r, b, run.seg[r][b]);
    free(covered);
  }
  run_free(&run, m.world);
  free_model(&m);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-engine");
  TCase *tc = tcase_create("engine");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, rounds_assemble_every_tensor, 0, 3);
  tcase_add_test(tc, identity_moves_nothing);
  tcase_add_test(tc, different_replicas_refused);
  tcase_add_test(tc, cancel_stops_before_copying);
  tcase_add_test(tc, thread_reports_rounds_and_end);
  tcase_add_test(tc, truncated_source_fails_the_run);
  tcase_add_test(tc, large_shard_in_slices);
  tcase_add_loop_test(tc, warm_segments_rewritten_and_gaps_zeroed, 0, 3);
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
