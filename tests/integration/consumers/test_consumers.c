/*
 * test_consumers.c - pushes into consumers end to end: a private shardportd
 * per test, trainer ranks and consumers as threads of the test, each with
 * its own sp_client (docs/protocol.md, "Consumers").
 *
 * The model: 4 trainer ranks hold
 *   w      float32 [10, 7], shard0 in uneven rows 3, 0, 5, 2; consumers take
 *          it as column shards, uneven: 3 and 4 columns;
 *   bias   float32 [5], replicated; only consumer 0 wants it, whole;
 *   expert bfloat16 [4, 3], an expert of rank 2; only consumer 1 wants it;
 *   q, k, v float32 [6, 4], [2, 4], [2, 4], shard0 in rows 2, 1, 2, 1 / 1, 0,
 *          1, 0 / 0, 1, 0, 1; each consumer takes its tensor-parallel heads
 *          of all three as pieces of one fused qkv buffer [5, 4]: q's rows
 *          3c .. 3c+3 at row 0, k's row c at row 3, v's row c at row 4.
 * Every element of every key has a value made from the key, its index in
 * the whole tensor and the push's step, so repeated pushes change every
 * byte; every delivered byte is compared with that unsharded original.
 */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"

#define WORLD 4
#define NCONSUMERS 2

enum { KEY_W, KEY_BIAS, KEY_EXPERT, KEY_Q, KEY_K, KEY_V, NKEYS };

struct key_def {
  const char *name;
  const char *dtype;
  size_t esize;
  uint32_t ndim;
  int64_t shape[2];
  uint32_t rows[WORLD]; /* shard0 rows per rank; unused otherwise */
  sp_placement placement;
  uint32_t expert_rank;
};

static const struct key_def keys[NKEYS] = {
    {"w", "float32", 4, 2, {10, 7}, {3, 0, 5, 2}, SP_PLACEMENT_SHARD0, 0},
    {"bias", "float32", 4, 1, {5, 1}, {0}, SP_PLACEMENT_REPLICATED, 0},
    {"expert", "bfloat16", 2, 2, {4, 3}, {0}, SP_PLACEMENT_EXPERT, 2},
    {"q", "float32", 4, 2, {6, 4}, {2, 1, 2, 1}, SP_PLACEMENT_SHARD0, 0},
    {"k", "float32", 4, 2, {2, 4}, {1, 0, 1, 0}, SP_PLACEMENT_SHARD0, 0},
    {"v", "float32", 4, 2, {2, 4}, {0, 1, 0, 1}, SP_PLACEMENT_SHARD0, 0},
};

static int64_t row_len(const struct key_def *k) {
  return k->ndim == 1 ? 1 : k->shape[1];
}

/* The unsharded original: element i of key at step. */
static uint32_t value(int key, int64_t i, uint32_t step) {
  return (uint32_t)(key + 1) * 0x01000193u ^ (uint32_t)i * 2654435761u ^
         step * 0x9e3779b9u;
}

static void put(uint8_t *p, size_t esize, uint32_t v) {
  if (esize == 4)
    memcpy(p, &v, 4);
  else {
    uint16_t h = (uint16_t)v;
    memcpy(p, &h, 2);
  }
}

/* The first row rank r holds of a shard0 key. */
static int64_t first_row(const struct key_def *k, uint32_t r) {
  int64_t row = 0;
  for (uint32_t i = 0; i < r; i++)
    row += k->rows[i];
  return row;
}

static bool holds(const struct key_def *k, uint32_t r) {
  return k->placement != SP_PLACEMENT_EXPERT || k->expert_rank == r;
}

/* Rows of key rank r holds, and the first of them. */
static void held_rows(const struct key_def *k, uint32_t r, int64_t *first,
                      int64_t *n) {
  if (k->placement == SP_PLACEMENT_SHARD0) {
    *first = first_row(k, r);
    *n = k->rows[r];
  } else {
    *first = 0;
    *n = k->shape[0];
  }
}

/* ---- trainers ---- */

struct trainer {
  const char *socket;
  const sp_ticket *ticket;
  uint32_t rank;
  sp_client *c;
  int fd;
  uint8_t *mem;
  size_t size;
  size_t offset[NKEYS];
  sp_push_opts opts; /* what it pushes with */
  /* What its pushes returned. */
  int rc;
  sp_push_result result;
  char message[SP_ERRMSG_MAX + 1];
};

static void trainer_fill(struct trainer *t, uint32_t step) {
  for (int key = 0; key < NKEYS; key++) {
    const struct key_def *k = &keys[key];
    if (!holds(k, t->rank))
      continue;
    int64_t first, n;
    held_rows(k, t->rank, &first, &n);
    for (int64_t e = 0; e < n * row_len(k); e++)
      put(t->mem + t->offset[key] + (size_t)e * k->esize, k->esize,
          value(key, first * row_len(k) + e, step));
  }
}

static void trainer_open(struct trainer *t) {
  ck_assert_int_eq(sp_connect(t->socket, &t->c), 0);
  ck_assert_int_eq(sp_job_join(t->c, t->ticket, t->rank, WORLD, "cpu"), 0);
  t->size = 0;
  for (int key = 0; key < NKEYS; key++) {
    const struct key_def *k = &keys[key];
    int64_t first, n;
    held_rows(k, t->rank, &first, &n);
    t->offset[key] = t->size;
    if (holds(k, t->rank))
      t->size += (size_t)(n * row_len(k)) * k->esize;
    t->size = (t->size + 63) & ~(size_t)63;
  }
  t->fd = sp_test_memfd("trainer", t->size);
  ck_assert_int_ge(t->fd, 0);
  t->mem = mmap(NULL, t->size, PROT_READ | PROT_WRITE, MAP_SHARED, t->fd, 0);
  ck_assert_ptr_ne(t->mem, MAP_FAILED);
  sp_storage_desc s = {.id = 1, .fd = t->fd, .length = t->size,
                       .addr = t->mem};
  ck_assert_int_eq(sp_register_storages(t->c, &s, 1), 0);
  sp_tensor_desc d[NKEYS];
  size_t nd = 0;
  for (int key = 0; key < NKEYS; key++) {
    const struct key_def *k = &keys[key];
    if (!holds(k, t->rank))
      continue;
    int64_t first, n;
    held_rows(k, t->rank, &first, &n);
    sp_tensor_desc *x = &d[nd++];
    *x = (sp_tensor_desc){.key = k->name,
                          .storage = 1,
                          .dtype = k->dtype,
                          .ndim = k->ndim,
                          .offset = (int64_t)(t->offset[key] / k->esize),
                          .placement = k->placement,
                          .global_ndim = k->ndim};
    x->shape[0] = n;
    x->shape[1] = k->shape[1];
    x->stride[0] = row_len(k);
    x->stride[1] = 1;
    x->global_shape[0] = k->shape[0];
    x->global_shape[1] = k->shape[1];
  }
  ck_assert_int_eq(sp_register_tensors(t->c, d, nd), 0);
}

static void trainer_close(struct trainer *t) {
  sp_close(t->c);
  munmap(t->mem, t->size);
  close(t->fd);
}

static void *trainer_push(void *arg) {
  struct trainer *t = arg;
  t->rc = sp_push(t->c, &t->opts, &t->result);
  snprintf(t->message, sizeof t->message, "%s", sp_last_message(t->c));
  return NULL;
}

/* ---- consumers ---- */

/* Where consumer c's parts land in its one buffer (elements of 4 bytes,
 * the bfloat16 expert at a 4-byte aligned offset). */
struct consumer {
  const char *socket;
  const sp_ticket *ticket;
  uint32_t index;
  sp_client *c;
  int fd;
  uint8_t *mem;
  size_t size;
  size_t w_off, bias_off, expert_off, qkv_off;
  int rc;
  sp_push_result result;
  char message[SP_ERRMSG_MAX + 1];
};

/* The consumers' column shards of w: 3 and 4 columns. */
static int64_t w_col0(uint32_t c) { return c == 0 ? 0 : 3; }
static int64_t w_cols(uint32_t c) { return c == 0 ? 3 : 4; }

static void consumer_layout(struct consumer *k) {
  k->w_off = 0;
  k->bias_off = k->w_off + (size_t)(10 * w_cols(k->index)) * 4;
  k->expert_off = k->bias_off + 5 * 4;
  k->qkv_off = k->expert_off + 12 * 2;
  k->size = k->qkv_off + 5 * 4 * 4;
}

static void consumer_targets(const struct consumer *k, sp_target_desc *t,
                             size_t *n, sp_target_piece *pieces) {
  *n = 0;
  sp_target_desc *w = &t[(*n)++];
  *w = (sp_target_desc){.key = "w", .dtype = "float32", .ndim = 2,
                        .global_shape = {10, 7}, .part = SP_TARGET_SHARD,
                        .storage = 1, .shape = {10, w_cols(k->index)},
                        .stride = {w_cols(k->index), 1},
                        .offset = (int64_t)(k->w_off / 4), .dim = 1};
  if (k->index == 0)
    t[(*n)++] = (sp_target_desc){.key = "bias", .dtype = "float32",
                                 .ndim = 1, .global_shape = {5},
                                 .part = SP_TARGET_WHOLE, .storage = 1,
                                 .shape = {5}, .stride = {1},
                                 .offset = (int64_t)(k->bias_off / 4)};
  else
    t[(*n)++] = (sp_target_desc){.key = "expert", .dtype = "bfloat16",
                                 .ndim = 2, .global_shape = {4, 3},
                                 .part = SP_TARGET_WHOLE, .storage = 1,
                                 .shape = {4, 3}, .stride = {3, 1},
                                 .offset = (int64_t)(k->expert_off / 2)};
  /* Tensor-parallel heads of q, k and v into one fused [5, 4] buffer. */
  const char *names[3] = {"q", "k", "v"};
  int64_t rows[3] = {3, 1, 1}, at[3] = {0, 3, 4}, whole[3] = {6, 2, 2};
  for (int i = 0; i < 3; i++) {
    pieces[i] = (sp_target_piece){.start = {rows[i] * k->index, 0},
                                  .shape = {rows[i], 4}, .storage = 1,
                                  .stride = {4, 1},
                                  .offset = (int64_t)(k->qkv_off / 4) + at[i] * 4};
    t[(*n)++] = (sp_target_desc){.key = names[i], .dtype = "float32",
                                 .ndim = 2, .global_shape = {whole[i], 4},
                                 .part = SP_TARGET_PIECES, .npieces = 1,
                                 .pieces = &pieces[i]};
  }
}

static void consumer_open(struct consumer *k) {
  consumer_layout(k);
  ck_assert_int_eq(sp_connect(k->socket, &k->c), 0);
  ck_assert_int_eq(sp_consumer_join(k->c, k->ticket, k->index, NCONSUMERS,
                                    "cpu"),
                   0);
  k->fd = sp_test_memfd("consumer", k->size);
  ck_assert_int_ge(k->fd, 0);
  k->mem = mmap(NULL, k->size, PROT_READ | PROT_WRITE, MAP_SHARED, k->fd, 0);
  ck_assert_ptr_ne(k->mem, MAP_FAILED);
  sp_storage_desc s = {.id = 1, .fd = k->fd, .length = k->size,
                       .addr = k->mem};
  ck_assert_int_eq(sp_register_storages(k->c, &s, 1), 0);
  sp_target_desc t[8];
  sp_target_piece pieces[3];
  size_t n;
  consumer_targets(k, t, &n, pieces);
  ck_assert_int_eq(sp_register_targets(k->c, t, n), 0);
}

static void consumer_close(struct consumer *k) {
  sp_close(k->c);
  munmap(k->mem, k->size);
  close(k->fd);
}

static void *consumer_receive(void *arg) {
  struct consumer *k = arg;
  k->rc = sp_receive(k->c, 0, &k->result);
  snprintf(k->message, sizeof k->message, "%s", sp_last_message(k->c));
  return NULL;
}

static void expect(const uint8_t *at, size_t esize, uint32_t want,
                   const char *what, int64_t i) {
  uint32_t got = 0;
  memcpy(&got, at, esize);
  if (esize == 2)
    want &= 0xffff;
  ck_assert_msg(got == want, "%s element %lld: %08x, want %08x", what,
                (long long)i, got, want);
}

/* Every byte consumer k asked for, against the originals of step. */
static uint64_t consumer_check(const struct consumer *k, uint32_t step) {
  uint64_t bytes = 0;
  for (int64_t r = 0; r < 10; r++)
    for (int64_t c = 0; c < w_cols(k->index); c++, bytes += 4)
      expect(k->mem + k->w_off + (size_t)(r * w_cols(k->index) + c) * 4, 4,
             value(KEY_W, r * 7 + w_col0(k->index) + c, step), "w", r * 7 + c);
  if (k->index == 0)
    for (int64_t i = 0; i < 5; i++, bytes += 4)
      expect(k->mem + k->bias_off + (size_t)i * 4, 4,
             value(KEY_BIAS, i, step), "bias", i);
  else
    for (int64_t i = 0; i < 12; i++, bytes += 2)
      expect(k->mem + k->expert_off + (size_t)i * 2, 2,
             value(KEY_EXPERT, i, step), "expert", i);
  int fused_key[5] = {KEY_Q, KEY_Q, KEY_Q, KEY_K, KEY_V};
  int64_t fused_row[5] = {3 * k->index, 3 * k->index + 1, 3 * k->index + 2,
                          k->index, k->index};
  for (int r = 0; r < 5; r++)
    for (int64_t c = 0; c < 4; c++, bytes += 4)
      expect(k->mem + k->qkv_off + (size_t)(r * 4 + c) * 4, 4,
             value(fused_key[r], fused_row[r] * 4 + c, step), "qkv",
             r * 4 + c);
  return bytes;
}

/* ---- a job and its pushes ---- */

struct world {
  struct sp_test_daemon d;
  sp_client *creator;
  sp_ticket ticket;
  struct trainer t[WORLD];
  struct consumer k[NCONSUMERS];
};

static void world_start(struct world *w) {
  memset(w, 0, sizeof *w);
  ck_assert_int_eq(sp_test_daemon_start(&w->d, NULL), 0);
  ck_assert_int_eq(sp_connect(w->d.socket, &w->creator), 0);
  ck_assert_int_eq(sp_job_create_with_consumers(w->creator, WORLD, NCONSUMERS,
                                                &w->ticket),
                   0);
  for (uint32_t r = 0; r < WORLD; r++) {
    w->t[r] = (struct trainer){.socket = w->d.socket, .ticket = &w->ticket,
                               .rank = r};
    trainer_open(&w->t[r]);
  }
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    w->k[c] = (struct consumer){.socket = w->d.socket, .ticket = &w->ticket,
                                .index = c};
}

static void world_stop(struct world *w) {
  for (uint32_t r = 0; r < WORLD; r++)
    if (w->t[r].c != NULL)
      trainer_close(&w->t[r]);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    if (w->k[c].c != NULL)
      consumer_close(&w->k[c]);
  sp_close(w->creator);
  ck_assert_int_eq(sp_test_daemon_stop(&w->d), 0);
}

/* One push: every trainer pushes, every consumer receives, from threads;
 * returns when all of them returned. */
static void push_once(struct world *w, uint32_t step) {
  pthread_t th[WORLD + NCONSUMERS];
  for (uint32_t r = 0; r < WORLD; r++) {
    trainer_fill(&w->t[r], step);
    ck_assert_int_eq(pthread_create(&th[r], NULL, trainer_push, &w->t[r]), 0);
  }
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    ck_assert_int_eq(
        pthread_create(&th[WORLD + c], NULL, consumer_receive, &w->k[c]), 0);
  for (uint32_t i = 0; i < WORLD + NCONSUMERS; i++)
    pthread_join(th[i], NULL);
}

/* The same error, code and message, on every trainer and consumer. */
static void expect_refused(const struct world *w, int code,
                           const char *part) {
  for (uint32_t r = 0; r < WORLD; r++) {
    ck_assert_msg(w->t[r].rc == code, "rank %u: %s (%s), want %s", r,
                  sp_err_name(w->t[r].rc), w->t[r].message,
                  sp_err_name(code));
    ck_assert_str_eq(w->t[r].message, w->t[0].message);
  }
  for (uint32_t c = 0; c < NCONSUMERS; c++) {
    ck_assert_msg(w->k[c].rc == code, "consumer %u: %s (%s), want %s", c,
                  sp_err_name(w->k[c].rc), w->k[c].message,
                  sp_err_name(code));
    ck_assert_str_eq(w->k[c].message, w->t[0].message);
  }
  ck_assert_msg(strstr(w->t[0].message, part) != NULL,
                "\"%s\" does not say \"%s\"", w->t[0].message, part);
}

START_TEST(pushes_deliver_every_layout_repeatedly) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  for (uint32_t step = 1; step <= 3; step++) {
    push_once(&w, step);
    for (uint32_t r = 0; r < WORLD; r++) {
      ck_assert_msg(w.t[r].rc == 0, "rank %u: %s: %s", r,
                    sp_err_name(w.t[r].rc), w.t[r].message);
      ck_assert_uint_eq(w.t[r].result.push_id, step);
      /* The first push plans; the next ones reuse its plan. */
      ck_assert_int_eq(w.t[r].result.plan_reused, step > 1);
    }
    for (uint32_t c = 0; c < NCONSUMERS; c++) {
      ck_assert_msg(w.k[c].rc == 0, "consumer %u: %s: %s", c,
                    sp_err_name(w.k[c].rc), w.k[c].message);
      ck_assert_uint_eq(w.k[c].result.bytes, consumer_check(&w.k[c], step));
      ck_assert_int_eq(w.k[c].result.plan_reused, step > 1);
    }
  }
  /* Status counts the pushes, the one plan they took, and each consumer's
   * bytes beside the ranks. */
  sp_status_info *st;
  ck_assert_int_eq(sp_status(w.creator, &st), 0);
  ck_assert_uint_eq(st->njobs, 1);
  const sp_job_status *job = &st->jobs[0];
  ck_assert_uint_eq(job->pushes, 3);
  ck_assert_uint_eq(job->push_plans, 1);
  ck_assert_uint_eq(job->nconsumers, NCONSUMERS);
  for (uint32_t c = 0; c < NCONSUMERS; c++) {
    ck_assert_uint_eq(job->consumers[c].index, c);
    ck_assert_str_eq(job->consumers[c].state, "joined");
    ck_assert_str_eq(job->consumers[c].device, "cpu");
    ck_assert_int_eq(job->consumers[c].node, 0);
    ck_assert_uint_eq(job->consumers[c].bytes_received,
                      3 * w.k[c].result.bytes);
  }
  sp_status_free(st);
  world_stop(&w);
}
END_TEST

/* A consumer that registers again changes the plan: the next push plans
 * anew, and still delivers every byte. */
START_TEST(a_registration_drops_the_plan) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  push_once(&w, 1);
  ck_assert_int_eq(w.k[0].rc, 0);
  int fd = sp_test_memfd("more", 64);
  void *more = mmap(NULL, 64, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  sp_storage_desc s = {.id = 2, .fd = fd, .length = 64, .addr = more};
  ck_assert_int_eq(sp_register_storages(w.k[1].c, &s, 1), 0);
  push_once(&w, 2);
  ck_assert_int_eq(w.t[0].rc, 0);
  ck_assert_int_eq(w.t[0].result.plan_reused, 0);
  consumer_check(&w.k[0], 2);
  consumer_check(&w.k[1], 2);
  munmap(more, 64);
  close(fd);
  world_stop(&w);
}
END_TEST

/* Refusals reach every trainer and consumer with one code and message. */
static void refused_target(const sp_target_desc *bad, int code,
                           const char *part) {
  struct world w;
  world_start(&w);
  consumer_open(&w.k[0]);
  consumer_layout(&w.k[1]);
  struct consumer *k = &w.k[1];
  ck_assert_int_eq(sp_connect(k->socket, &k->c), 0);
  ck_assert_int_eq(sp_consumer_join(k->c, k->ticket, 1, NCONSUMERS, "cpu"), 0);
  k->fd = sp_test_memfd("consumer", k->size);
  k->mem = mmap(NULL, k->size, PROT_READ | PROT_WRITE, MAP_SHARED, k->fd, 0);
  sp_storage_desc s = {.id = 1, .fd = k->fd, .length = k->size,
                       .addr = k->mem};
  ck_assert_int_eq(sp_register_storages(k->c, &s, 1), 0);
  sp_target_desc t[8];
  sp_target_piece pieces[3];
  size_t n;
  consumer_targets(k, t, &n, pieces);
  t[0] = *bad;
  ck_assert_int_eq(sp_register_targets(k->c, t, n), 0);
  push_once(&w, 1);
  expect_refused(&w, code, part);
  world_stop(&w);
}

START_TEST(an_unknown_key_is_refused_everywhere) {
  refused_target(&(sp_target_desc){.key = "nope", .dtype = "float32",
                                   .ndim = 1, .global_shape = {4},
                                   .part = SP_TARGET_WHOLE, .storage = 1,
                                   .shape = {4}, .stride = {1}},
                 SP_EKEYSET, "nope");
}
END_TEST

START_TEST(a_wrong_dtype_is_refused_everywhere) {
  refused_target(&(sp_target_desc){.key = "w", .dtype = "float16", .ndim = 2,
                                   .global_shape = {10, 7},
                                   .part = SP_TARGET_SHARD, .storage = 1,
                                   .shape = {10, 4}, .stride = {4, 1},
                                   .dim = 1},
                 SP_EDTYPEMISMATCH, "'w'");
}
END_TEST

START_TEST(shards_that_do_not_tile_are_refused_everywhere) {
  /* Consumer 0 holds 3 columns, consumer 1 now 3 too: 6 of 7. */
  refused_target(&(sp_target_desc){.key = "w", .dtype = "float32", .ndim = 2,
                                   .global_shape = {10, 7},
                                   .part = SP_TARGET_SHARD, .storage = 1,
                                   .shape = {10, 3}, .stride = {3, 1},
                                   .dim = 1},
                 SP_ETILING, "'w'");
}
END_TEST

START_TEST(a_wrong_shape_is_refused_everywhere) {
  refused_target(&(sp_target_desc){.key = "w", .dtype = "float32", .ndim = 2,
                                   .global_shape = {10, 8},
                                   .part = SP_TARGET_SHARD, .storage = 1,
                                   .shape = {10, 4}, .stride = {4, 1},
                                   .dim = 1},
                 SP_ESHAPE, "'w'");
}
END_TEST

START_TEST(a_piece_past_the_tensor_is_refused_everywhere) {
  static const sp_target_piece piece = {.start = {1, 0}, .shape = {2, 4},
                                        .storage = 1, .stride = {4, 1}};
  refused_target(&(sp_target_desc){.key = "k", .dtype = "float32", .ndim = 2,
                                   .global_shape = {2, 4},
                                   .part = SP_TARGET_PIECES, .npieces = 1,
                                   .pieces = &piece},
                 SP_EDESTBOUNDS, "'k'");
}
END_TEST

/* Two consumers handed one memfd, their targets overlapping. */
START_TEST(consumers_sharing_bytes_are_refused_everywhere) {
  struct world w;
  world_start(&w);
  consumer_open(&w.k[0]);
  struct consumer *k = &w.k[1];
  consumer_layout(k);
  ck_assert_int_eq(sp_connect(k->socket, &k->c), 0);
  ck_assert_int_eq(sp_consumer_join(k->c, k->ticket, 1, NCONSUMERS, "cpu"), 0);
  /* Consumer 1's layout is the larger: the shared file grows to it. */
  k->fd = dup(w.k[0].fd);
  ck_assert_int_eq(ftruncate(k->fd, (off_t)k->size), 0);
  k->mem = mmap(NULL, k->size, PROT_READ | PROT_WRITE, MAP_SHARED, k->fd, 0);
  sp_storage_desc s = {.id = 1, .fd = k->fd, .length = k->size,
                       .addr = k->mem};
  ck_assert_int_eq(sp_register_storages(k->c, &s, 1), 0);
  sp_target_desc t[8];
  sp_target_piece pieces[3];
  size_t n;
  consumer_targets(k, t, &n, pieces);
  ck_assert_int_eq(sp_register_targets(k->c, t, n), 0);
  push_once(&w, 1);
  expect_refused(&w, SP_EDOUBLEWRITE, "consumer");
  world_stop(&w);
}
END_TEST

/* A consumer's buffer in a trainer's registered bytes is refused at once;
 * a trainer registering later over a consumer's buffer fails the push. */
START_TEST(trainer_memory_is_never_a_consumer_buffer) {
  struct world w;
  world_start(&w);
  struct consumer *k = &w.k[0];
  ck_assert_int_eq(sp_connect(k->socket, &k->c), 0);
  ck_assert_int_eq(sp_consumer_join(k->c, k->ticket, 0, NCONSUMERS, "cpu"), 0);
  sp_storage_desc s = {.id = 1, .fd = w.t[0].fd, .length = w.t[0].size,
                       .addr = w.t[0].mem};
  ck_assert_int_eq(sp_register_storages(k->c, &s, 1), SP_EPERM);
  ck_assert_ptr_nonnull(strstr(sp_last_message(k->c), "rank 0"));
  sp_close(k->c);
  k->c = NULL;
  world_stop(&w);

  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  /* Rank 3 registers consumer 1's buffer as a storage of its own. */
  sp_storage_desc over = {.id = 7, .fd = w.k[1].fd, .length = 64,
                          .addr = w.k[1].mem};
  ck_assert_int_eq(sp_register_storages(w.t[3].c, &over, 1), 0);
  push_once(&w, 1);
  expect_refused(&w, SP_EPERM, "consumer 1");
  world_stop(&w);
}
END_TEST

/* Waits until status shows `asked` ranks waiting for the push, and every consumer in `receiving` (a bit per consumer) receiving:
 * the push waits for the rest. */
static void wait_for_push(sp_client *c, uint32_t asked, unsigned receiving) {
  for (int tries = 0; tries < 500; tries++) {
    sp_status_info *st;
    ck_assert_int_eq(sp_status(c, &st), 0);
    const sp_job_status *job = &st->jobs[0];
    bool ready = job->asked == asked && job->nconsumers == NCONSUMERS;
    for (uint32_t k = 0; ready && k < NCONSUMERS; k++)
      if (receiving & (1u << k))
        ready = strcmp(job->consumers[k].state, "receiving") == 0;
    sp_status_free(st);
    if (ready)
      return;
    usleep(10 * 1000);
  }
  ck_abort_msg("the push never waited with %u ranks asked", asked);
}

/* A consumer that dies while the others wait fails the push for everyone,
 * naming it; the next push fails at once, until it joins again. */
START_TEST(a_consumer_that_dies_fails_the_push) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  pthread_t th[WORLD + 1];
  for (uint32_t r = 0; r < WORLD; r++)
    ck_assert_int_eq(pthread_create(&th[r], NULL, trainer_push, &w.t[r]), 0);
  ck_assert_int_eq(pthread_create(&th[WORLD], NULL, consumer_receive, &w.k[0]),
                   0);
  wait_for_push(w.creator, WORLD, 1u << 0);
  consumer_close(&w.k[1]);
  w.k[1].c = NULL;
  for (uint32_t i = 0; i <= WORLD; i++)
    pthread_join(th[i], NULL);
  for (uint32_t r = 0; r < WORLD; r++) {
    ck_assert_int_eq(w.t[r].rc, SP_ECONSUMERLOST);
    ck_assert_ptr_nonnull(strstr(w.t[r].message, "consumer 1"));
  }
  ck_assert_int_eq(w.k[0].rc, SP_ECONSUMERLOST);
  /* Without consumer 1, the next push fails at once. */
  trainer_push(&w.t[0]);
  ck_assert_int_eq(w.t[0].rc, SP_ECONSUMERLOST);
  /* With it back, every byte arrives. */
  consumer_open(&w.k[1]);
  push_once(&w, 2);
  ck_assert_msg(w.t[0].rc == 0, "%s", w.t[0].message);
  consumer_check(&w.k[0], 2);
  consumer_check(&w.k[1], 2);
  world_stop(&w);
}
END_TEST

/* A trainer that dies while the others wait fails the push for every rank
 * and consumer, naming the rank. */
START_TEST(a_trainer_that_dies_fails_the_push) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  pthread_t th[WORLD - 1 + NCONSUMERS];
  for (uint32_t r = 0; r + 1 < WORLD; r++)
    ck_assert_int_eq(pthread_create(&th[r], NULL, trainer_push, &w.t[r]), 0);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    ck_assert_int_eq(
        pthread_create(&th[WORLD - 1 + c], NULL, consumer_receive, &w.k[c]),
        0);
  wait_for_push(w.creator, WORLD - 1, (1u << NCONSUMERS) - 1);
  trainer_close(&w.t[WORLD - 1]);
  w.t[WORLD - 1].c = NULL;
  for (uint32_t i = 0; i < WORLD - 1 + NCONSUMERS; i++)
    pthread_join(th[i], NULL);
  for (uint32_t r = 0; r + 1 < WORLD; r++) {
    ck_assert_int_eq(w.t[r].rc, SP_ERANKLOST);
    ck_assert_ptr_nonnull(strstr(w.t[r].message, "rank 3"));
  }
  for (uint32_t c = 0; c < NCONSUMERS; c++) {
    ck_assert_int_eq(w.k[c].rc, SP_ERANKLOST);
    ck_assert_str_eq(w.k[c].message, w.t[0].message);
  }
  world_stop(&w);
}
END_TEST

/* A consumer's joins that the job refuses. */
START_TEST(consumer_joins_are_checked) {
  struct world w;
  world_start(&w);
  sp_client *c;
  ck_assert_int_eq(sp_connect(w.d.socket, &c), 0);
  ck_assert_int_eq(sp_consumer_join(c, &w.ticket, 2, NCONSUMERS, "cpu"),
                   SP_ERANK);
  ck_assert_int_eq(sp_consumer_join(c, &w.ticket, 0, 3, "cpu"), SP_ERANK);
  ck_assert_int_eq(sp_consumer_join(c, &w.ticket, 0, NCONSUMERS, "cpu"), 0);
  sp_client *again;
  ck_assert_int_eq(sp_connect(w.d.socket, &again), 0);
  ck_assert_int_eq(sp_consumer_join(again, &w.ticket, 0, NCONSUMERS, "cpu"),
                   SP_ERANK);
  /* A consumer neither pushes nor registers tensors; a rank never
   * receives. */
  ck_assert_int_eq(sp_push(c, NULL, NULL), SP_ESTATE);
  ck_assert_int_eq(sp_receive(w.t[0].c, 0, NULL), SP_ESTATE);
  sp_close(again);
  sp_close(c);
  world_stop(&w);
}
END_TEST

/* One key per round: the push takes several rounds, byte for byte. */
START_TEST(a_push_in_rounds_of_one_key) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  for (uint32_t r = 0; r < WORLD; r++)
    w.t[r].opts.max_keys = 1;
  push_once(&w, 5);
  ck_assert_msg(w.t[0].rc == 0, "%s", w.t[0].message);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    ck_assert_uint_eq(w.k[c].result.bytes, consumer_check(&w.k[c], 5));
  world_stop(&w);
}
END_TEST

START_TEST(ranks_pushing_different_options_are_refused_everywhere) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  w.t[2].opts.max_keys = 2;
  push_once(&w, 1);
  expect_refused(&w, SP_EINVAL, "rank 2");
  world_stop(&w);
}
END_TEST

/* A consumer that never receives: the push times out on every rank and
 * on the consumer that came, naming the one that did not. */
START_TEST(a_push_times_out_naming_who_did_not_come) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  pthread_t th[WORLD + 1];
  for (uint32_t r = 0; r < WORLD; r++) {
    w.t[r].opts.timeout_ms = 300;
    ck_assert_int_eq(pthread_create(&th[r], NULL, trainer_push, &w.t[r]), 0);
  }
  ck_assert_int_eq(pthread_create(&th[WORLD], NULL, consumer_receive, &w.k[0]),
                   0);
  for (uint32_t i = 0; i <= WORLD; i++)
    pthread_join(th[i], NULL);
  for (uint32_t r = 0; r < WORLD; r++) {
    ck_assert_int_eq(w.t[r].rc, SP_ETIMEOUT);
    ck_assert_str_eq(w.t[r].message, w.t[0].message);
  }
  ck_assert_int_eq(w.k[0].rc, SP_ETIMEOUT);
  ck_assert_str_eq(w.k[0].message, w.t[0].message);
  ck_assert_ptr_nonnull(strstr(w.t[0].message, "consumer 1"));
  ck_assert_ptr_null(strstr(w.t[0].message, "consumer 0"));
  world_stop(&w);
}
END_TEST

/* A consumer's buffer cut short after it was granted fails the push with
 * bad_fd everywhere, and the daemon serves on. */
START_TEST(a_buffer_cut_short_fails_the_push) {
  struct world w;
  world_start(&w);
  for (uint32_t c = 0; c < NCONSUMERS; c++)
    consumer_open(&w.k[c]);
  munmap(w.k[1].mem, w.k[1].size);
  ck_assert_int_eq(ftruncate(w.k[1].fd, 0), 0);
  w.k[1].mem = mmap(NULL, w.k[1].size, PROT_READ | PROT_WRITE, MAP_SHARED,
                    w.k[1].fd, 0);
  push_once(&w, 1);
  expect_refused(&w, SP_EBADFD, "consumer 1");
  sp_client *c;
  ck_assert_int_eq(sp_connect(w.d.socket, &c), 0);
  ck_assert_int_eq(sp_ping(c, NULL), 0);
  sp_close(c);
  world_stop(&w);
}
END_TEST

static Suite *consumers_suite(void) {
  Suite *s = suite_create("consumers");
  TCase *tc = tcase_create("push");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, pushes_deliver_every_layout_repeatedly);
  tcase_add_test(tc, a_registration_drops_the_plan);
  tcase_add_test(tc, an_unknown_key_is_refused_everywhere);
  tcase_add_test(tc, a_wrong_dtype_is_refused_everywhere);
  tcase_add_test(tc, shards_that_do_not_tile_are_refused_everywhere);
  tcase_add_test(tc, a_wrong_shape_is_refused_everywhere);
  tcase_add_test(tc, a_piece_past_the_tensor_is_refused_everywhere);
  tcase_add_test(tc, consumers_sharing_bytes_are_refused_everywhere);
  tcase_add_test(tc, trainer_memory_is_never_a_consumer_buffer);
  tcase_add_test(tc, a_consumer_that_dies_fails_the_push);
  tcase_add_test(tc, a_trainer_that_dies_fails_the_push);
  tcase_add_test(tc, consumer_joins_are_checked);
  tcase_add_test(tc, a_push_in_rounds_of_one_key);
  tcase_add_test(tc, ranks_pushing_different_options_are_refused_everywhere);
  tcase_add_test(tc, a_push_times_out_naming_who_did_not_come);
  tcase_add_test(tc, a_buffer_cut_short_fails_the_push);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(consumers_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
