/*
 * test_export.c - exports end to end: a real shardportd and real trainer
 * processes, one forked process and one sp_client per rank.
 *
 * The trainers are tests/integration/trainer.h's: each rank builds its
 * holdings from a deterministic original, registers, exports, checks every
 * owned tensor byte for byte and reports to the test process, which
 * asserts on the reports: every key owned by exactly one rank, refusals
 * identical on every rank, faults reaching every survivor, and a rank that
 * left before the others asked failing their export at once.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/trainer.h"


static struct sp_test_daemon daemon_;

static void start(void) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* Every rank on the one daemon. */
static const char *const *one_daemon(void) {
  static const char *sockets[TRAINER_MAXR];
  for (int i = 0; i < TRAINER_MAXR; i++)
    sockets[i] = daemon_.socket;
  return sockets;
}

static void run(const struct scenario *sc, struct world *w) {
  trainer_start(w, sc, one_daemon());
  trainer_finish(w, sc);
}

/* ---- the mixed model ---- */

static struct tkey mixed_keys[] = {TRAINER_MIXED_KEYS};

static const char *const mixed_group[] = TRAINER_MIXED_GROUP;

START_TEST(mixed_model_exports_exactly) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group};
  struct world w;
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  /* Tied weights and a together-group each land on one owner. */
  ck_assert_uint_eq(trainer_owner_of(&w, &sc, "tied.a"), trainer_owner_of(&w, &sc, "tied.b"));
  ck_assert_uint_eq(trainer_owner_of(&w, &sc, "grp.x"), trainer_owner_of(&w, &sc, "grp.y"));
  /* Experts stay where they are. */
  ck_assert_uint_eq(trainer_owner_of(&w, &sc, "expert.0"), 2);
  ck_assert_uint_eq(trainer_owner_of(&w, &sc, "expert.1"), 1);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].progress_frames, 1);
  trainer_free(&w, &sc);
}
END_TEST

/* Four ranks export the model three times in one job: members, storages
 * and plan stay, and each export is verified again. */
START_TEST(same_job_exports_again) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group,
                        .exports = 3};
  struct world w;
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}
END_TEST

/* ---- more keys than one round holds ---- */

START_TEST(more_than_4096_keys_cross_a_round) {
  enum { N = 5000 };
  struct tkey *keys = calloc(N, sizeof *keys);
  char (*names)[16] = calloc(N, sizeof *names);
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "k.%05d", i);
    bool bf = i % 3 == 0;
    keys[i] = K(.name = names[i], .kind = SHARD0,
                .dtype = bf ? "bfloat16" : "float32", .es = bf ? 2 : 4,
                .ndim = 2, .shape = {3, 2}, .parts = {i % 4, 3 - i % 4});
  }
  struct scenario sc = {.world = 2, .nkeys = N, .keys = keys};
  struct world w;
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  /* Default max_keys is 4096: at least two rounds. */
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].max_rounds, 2);
  trainer_free(&w, &sc);
  free(keys);
  free(names);
}
END_TEST

/* ---- refusals ---- */

static struct tkey refusal_keys[] = {TRAINER_REFUSAL_KEYS};

static void int32_b_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank == 3)
    trainer_desc(t, *n, "b")->dtype = "int32";
}

static void short_a_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank == 3)
    trainer_desc(t, *n, "a")->shape[0] = 1;
}

/* Rank 1 also claims expert "e", pointing at its copy of "b". */
static void expert_on_1_too(const struct scenario *sc, uint32_t rank,
                            sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank != 1)
    return;
  t[*n] = *trainer_desc(t, *n, "b");
  t[*n].key = "e";
  t[*n].placement = SP_PLACEMENT_EXPERT;
  ++*n;
}

static const struct {
  tweak_fn *tweak;
  int code;
} refusals[] = {
    {trainer_drop_b_on_3, SP_EKEYSET},
    {int32_b_on_3, SP_EDTYPEMISMATCH},
    {short_a_on_3, SP_ETILING},
    {expert_on_1_too, SP_EEXPERT},
};

START_TEST(refusal_reaches_every_rank_alike) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof refusal_keys / sizeof refusal_keys[0],
                        .keys = refusal_keys, .tweak = refusals[_i].tweak};
  struct world w;
  run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].export_rc == refusals[_i].code,
                  "rank %u: %s (%s), expected %s: %s", i,
                  sp_err_name(w.rep[i].export_rc), w.rep[i].failure,
                  sp_err_name(refusals[_i].code), w.rep[i].message);
    ck_assert_str_ne(w.rep[i].message, "");
    ck_assert_str_eq(w.rep[i].message, w.rep[0].message);
    for (size_t k = 0; k < sc.nkeys; k++)
      ck_assert_uint_eq(w.owned[i][k], 0);
  }
  trainer_free(&w, &sc);

  /* The daemon serves the next job. */
  struct tkey keys[2] = {refusal_keys[0], refusal_keys[1]};
  keys[0].parts[0] = keys[0].parts[1] = 4;
  struct scenario good = {.world = 2, .nkeys = 2, .keys = keys};
  run(&good, &w);
  trainer_assert_exported(&w, &good);
  trainer_free(&w, &good);
}
END_TEST

/* ---- replicated and plain copies that differ ---- */

/* Every rank refused with different_data and one message, which has want
 * in it; nothing owned. */
static void assert_different(struct world *w, const struct scenario *sc,
                             const char *want) {
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].export_rc == SP_EDIFFERENT,
                  "rank %u: %s (%s): %s", i, sp_err_name(w->rep[i].export_rc),
                  w->rep[i].failure, w->rep[i].message);
    ck_assert_str_eq(w->rep[i].message, w->rep[0].message);
    for (size_t k = 0; k < sc->nkeys; k++)
      ck_assert_uint_eq(w->owned[i][k], 0);
  }
  ck_assert_msg(strstr(w->rep[0].message, want), "%s", w->rep[0].message);
}

/* A rank whose replicated copy differs (a sharded tensor registered as
 * replicated): refused before anything moves, naming the key and ranks. */
START_TEST(replicated_copies_that_differ) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group,
                        .corrupt_key = "norm", .corrupt_ranks = 1u << 2};
  struct world w;
  run(&sc, &w);
  assert_different(&w, &sc,
                   "key 'norm' (replicated): rank 2's copy differs from "
                   "rank 0's");
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert(!w.moving[i]);
  trainer_free(&w, &sc);
}
END_TEST

/* A plain key changed on two ranks between two exports of one job: the
 * second export (on the job's cached plan) reads the copies again. */
START_TEST(plain_copies_that_change_between_exports) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group,
                        .exports = 2, .corrupt_key = "bias",
                        .corrupt_ranks = 1u << 1 | 1u << 3,
                        .corrupt_export = 1};
  struct world w;
  run(&sc, &w);
  assert_different(&w, &sc,
                   "key 'bias' (plain): rank 1's copy differs from rank 0's "
                   "(xxh3 ");
  ck_assert_ptr_nonnull(strstr(w.rep[0].message, "and 1 more rank's too"));
  trainer_free(&w, &sc);
}
END_TEST

/* compare_replicas = no: the copies are not read, and the owner's is
 * published as it is (docs/operations.md). */
START_TEST(comparison_turned_off) {
  stop();
  char dir[256], conf[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(conf, sizeof conf, "%s/off.conf", dir);
  ck_assert_int_eq(sp_test_write_file(conf, "compare_replicas = no\n"), 0);
  const char *args[] = {"--config", conf, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group};
  struct world w;
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  /* A rank that does not own "norm" changes its copy: nobody notices. */
  sc.corrupt_key = "norm";
  sc.corrupt_ranks = 1u << ((trainer_owner_of(&w, &sc, "norm") + 1) % 4);
  trainer_free(&w, &sc);
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
  sp_test_rmdir(dir);
}
END_TEST

/* ---- faults ---- */

static struct tkey fault_keys[] = {
    K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}),
    K(.name = "b", .kind = REPLICATED, .dtype = "bfloat16", .es = 2, .ndim = 1,
      .shape = {16}),
};

static void assert_rank_lost(struct world *w, const struct scenario *sc) {
  char name[32];
  snprintf(name, sizeof name, "rank %u", sc->victim);
  for (uint32_t i = 0; i < sc->world; i++) {
    if (i == sc->victim)
      continue;
    ck_assert_msg(w->rep[i].export_rc == SP_ERANKLOST,
                  "rank %u: %s: %s (%s)", i, sp_err_name(w->rep[i].export_rc),
                  w->rep[i].message, w->rep[i].failure);
    ck_assert_msg(strstr(w->rep[i].message, name) != NULL,
                  "rank %u's message does not name %s: %s", i, name,
                  w->rep[i].message);
  }
}

static void next_job_is_served(void) {
  struct tkey keys[] = {
      K(.name = "x", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 1,
        .shape = {5}, .parts = {2, 3}),
  };
  struct scenario sc = {.world = 2, .nkeys = 1, .keys = keys};
  struct world w;
  run(&sc, &w);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}

/* Ranks 0-2 asked for the export and wait for rank 3, which dies. */
START_TEST(rank_killed_while_the_others_wait) {
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = fault_keys,
                        .fault = KILL_WAITING, .victim = 3};
  struct world w;
  trainer_start(&w, &sc, one_daemon());
  for (uint32_t i = 0; i < sc.world; i++)
    trainer_expect_progress(&w, i);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(kill(w.pid[3], SIGKILL), 0);
  for (uint32_t i = 0; i < 3; i++)
    trainer_read_report(&w, &sc, i);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  trainer_finish(&w, &sc);
  assert_rank_lost(&w, &sc);
  /* Well within the export's timeout (10 s): the close is noticed. */
  ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 10);
  trainer_free(&w, &sc);
  next_job_is_served();
}
END_TEST

/* ---- ranks that left before the others asked ---- */

/* Every rank but the victim failed its last export with rank_lost, one
 * message on every rank, naming the victim and holding `because`. */
static void assert_lost_before(struct world *w, const struct scenario *sc,
                               const char *because) {
  uint32_t first = sc->victim == 0 ? 1 : 0;
  for (uint32_t i = 0; i < sc->world; i++) {
    if (i == sc->victim)
      continue;
    ck_assert_msg(w->rep[i].export_rc == SP_ERANKLOST, "rank %u: %s: %s (%s)",
                  i, sp_err_name(w->rep[i].export_rc), w->rep[i].message,
                  w->rep[i].failure);
    ck_assert_msg(strstr(w->rep[i].message, because) != NULL,
                  "rank %u: \"%s\" does not say \"%s\"", i,
                  w->rep[i].message, because);
    ck_assert_str_eq(w->rep[i].message, w->rep[first].message);
  }
}

/* The victim is gone (its report read) and the daemon has seen it go;
 * then the others, waiting at the gate, ask.  Their export's timeout
 * (30 s) is longer than the test waits for them (TRAINER_WAIT_MS): only
 * an answer at once passes. */
static void others_ask_after_the_victim_left(struct world *w,
                                             const struct scenario *sc) {
  trainer_read_report(w, sc, sc->victim);
  trainer_wait_gate(w, sc, sc->victim);
  trainer_wait_joined(daemon_.socket, sc->world - 1);
  trainer_open_gate(w, sc, sc->victim);
  trainer_finish(w, sc);
}

/* Rank 2's registration is refused and it gives up before the others ask:
 * they hear rank_lost at once, with why. */
START_TEST(refused_rank_gone_before_the_others_ask) {
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = fault_keys,
                        .tweak = trainer_victim_out_of_bounds, .victim = 2,
                        .gate = true, .timeout_ms = 30000};
  struct world w;
  trainer_start(&w, &sc, one_daemon());
  others_ask_after_the_victim_left(&w, &sc);
  ck_assert_msg(strstr(w.rep[2].failure, "register: ") != NULL, "%s", w.rep[2].failure);
  assert_lost_before(&w, &sc,
                     "rank 2 disconnected from job ");
  assert_lost_before(&w, &sc,
                     "; rank 2's registration was refused: "
                     "view_out_of_bounds: tensor_add: ");
  trainer_free(&w, &sc);
  next_job_is_served();
}
END_TEST

/* After the first export, rank 1 leaves (or closes its connection): the
 * others' second export fails at once, naming it. */
START_TEST(rank_gone_between_exports) {
  static const enum fault how[2] = {LEAVE_AFTER_FIRST, CLOSE_AFTER_FIRST};
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = fault_keys,
                        .exports = 2, .fault = how[_i], .victim = 1,
                        .gate = true, .timeout_ms = 30000};
  struct world w;
  trainer_start(&w, &sc, one_daemon());
  others_ask_after_the_victim_left(&w, &sc);
  ck_assert_int_eq(w.rep[1].export_rc, 0);
  ck_assert_str_eq(w.rep[1].failure, "");
  assert_lost_before(&w, &sc,
                     _i == 0 ? "rank 1 left job " : "rank 1 disconnected from "
                                                    "job ");
  trainer_free(&w, &sc);
  next_job_is_served();
}
END_TEST

/* A rank that left and joined again is part of the next export: nobody
 * fails for its earlier departure. */
START_TEST(rank_back_between_exports) {
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = fault_keys,
                        .exports = 2, .fault = REJOIN_AFTER_FIRST,
                        .victim = 1, .gate = true};
  struct world w;
  trainer_start(&w, &sc, one_daemon());
  trainer_wait_gate(&w, &sc, UINT32_MAX);
  trainer_open_gate(&w, &sc, UINT32_MAX);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}
END_TEST

/* With the engine pausing after each round (the daemon's test seam), rank
 * 3 dies while data moves. */
START_TEST(rank_killed_mid_export) {
  enum { N = 64 };
  struct tkey keys[N];
  char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nkeys = N, .keys = keys, .max_keys = 4,
                        .fault = KILL_MOVING, .victim = 3};
  struct world w;
  run(&sc, &w);
  assert_rank_lost(&w, &sc);
  trainer_free(&w, &sc);
  next_job_is_served();
}
END_TEST

static void start_slow(void) {
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "50", 1);
  start();
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
}

/* ---- bad input: one rank, each error, nothing else affected ---- */

struct solo {
  sp_client *c;
  int fd;
  uint8_t *map;
};

#define SOLO_LEN 4096

static void solo_start(struct solo *s) {
  ck_assert_int_eq(sp_connect(daemon_.socket, &s->c), 0);
  sp_ticket t;
  ck_assert_int_eq(sp_job_create(s->c, 1, &t), 0);
  ck_assert_int_eq(sp_job_join(s->c, &t, 0, 1, "cpu"), 0);
  s->fd = memfd_create("solo", MFD_CLOEXEC);
  ck_assert_int_eq(ftruncate(s->fd, SOLO_LEN), 0);
  s->map = mmap(NULL, SOLO_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  ck_assert_ptr_ne(s->map, MAP_FAILED);
  for (int i = 0; i < SOLO_LEN; i++)
    s->map[i] = (uint8_t)i;
}

static void solo_stop(struct solo *s) {
  sp_close(s->c);
  munmap(s->map, SOLO_LEN);
  close(s->fd);
}

static sp_tensor_desc solo_tensor(const char *key, int64_t offset) {
  return (sp_tensor_desc){.key = key, .storage = 1, .dtype = "float32",
                          .ndim = 1, .shape = {16}, .stride = {1},
                          .offset = offset, .placement = SP_PLACEMENT_PLAIN,
                          .global_ndim = 1, .global_shape = {16}};
}

/* The solo rank still exports what it registered well. */
static void solo_exports(struct solo *s, size_t nkeys) {
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(s->c, NULL, &set), 0);
  ck_assert_uint_eq(set->ntensors, nkeys);
  ck_assert_int_eq(sp_release(s->c, set), 0);
}

START_TEST(view_outside_its_storage) {
  struct solo s;
  solo_start(&s);
  sp_storage_desc st = {.id = 1, .fd = s.fd, .length = SOLO_LEN,
                        .addr = s.map};
  ck_assert_int_eq(sp_register_storages(s.c, &st, 1), 0);
  /* 16 floats from element 1020 end 48 bytes past the storage. */
  sp_tensor_desc t[2] = {solo_tensor("ok", 0), solo_tensor("out", 1020)};
  ck_assert_int_eq(sp_register_tensors(s.c, t, 2), SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(sp_last_message(s.c), "out"));
  /* The frame was refused whole: "ok" registers now. */
  ck_assert_int_eq(sp_register_tensors(s.c, t, 1), 0);
  solo_exports(&s, 1);
  solo_stop(&s);
}
END_TEST

START_TEST(fd_too_small) {
  struct solo s;
  solo_start(&s);
  sp_storage_desc st = {.id = 1, .fd = s.fd, .length = SOLO_LEN + 1,
                        .addr = s.map};
  ck_assert_int_eq(sp_register_storages(s.c, &st, 1), SP_EBADFD);
  st.offset = 8;
  st.length = SOLO_LEN - 8;
  ck_assert_int_eq(sp_register_storages(s.c, &st, 1), 0);
  sp_tensor_desc t = solo_tensor("ok", 0);
  ck_assert_int_eq(sp_register_tensors(s.c, &t, 1), 0);
  solo_exports(&s, 1);
  solo_stop(&s);
}
END_TEST

START_TEST(key_registered_twice) {
  struct solo s;
  solo_start(&s);
  sp_storage_desc st = {.id = 1, .fd = s.fd, .length = SOLO_LEN,
                        .addr = s.map};
  ck_assert_int_eq(sp_register_storages(s.c, &st, 1), 0);
  sp_tensor_desc t[2] = {solo_tensor("k", 0), solo_tensor("k", 16)};
  /* Twice in one frame, then again in a later frame. */
  ck_assert_int_eq(sp_register_tensors(s.c, t, 2), SP_EDUPKEY);
  ck_assert_int_eq(sp_register_tensors(s.c, t, 1), 0);
  ck_assert_int_eq(sp_register_tensors(s.c, t + 1, 1), SP_EDUPKEY);
  /* The message names the key. */
  const char *msg = sp_last_message(s.c);
  ck_assert_msg(strstr(msg, "\"k\"") || strstr(msg, "'k'"), "message: %s",
                msg);
  solo_exports(&s, 1);
  solo_stop(&s);
}
END_TEST

/* A raw connection joined to a fresh job of one rank. */
static int raw_joined(sp_client *c, uint32_t world) {
  sp_ticket t;
  ck_assert_int_eq(sp_job_create(c, world, &t), 0);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "join", 2, 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, t.bytes, t.len);
  sp__pack_kv_u64(&mb.pk, "rank", 0);
  sp__pack_kv_u64(&mb.pk, "world", world);
  sp__pack_kv_str(&mb.pk, "device", "cpu");
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "join");
  sp_test_reply_free(&r);
  return sock;
}

START_TEST(export_asked_twice) {
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  /* World 2: the first export waits for a rank that never comes. */
  int sock = raw_joined(c, 2);
  ck_assert_int_eq(sp_test_send_op(sock, "export", 10, NULL, 0), 0);
  ck_assert_int_eq(sp_test_send_op(sock, "export", 11, NULL, 0), 0);
  struct sp_test_reply r;
  for (;;) {
    ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
    if (r.head.id == 11)
      break;
    /* the first request's progress, if any */
    ck_assert_uint_eq(r.head.id, 10);
    ck_assert_str_eq(r.head.op, "progress");
    sp_test_reply_free(&r);
  }
  ck_assert_str_eq(r.head.op, "error");
  ck_assert_int_eq(r.code, SP_EEXPORTING);
  sp_test_reply_free(&r);
  /* Nothing else affected: the connection still serves. */
  ck_assert_int_eq(sp_test_ping(sock, 12), 0);
  close(sock);
  sp_close(c);
}
END_TEST

START_TEST(release_of_an_unknown_export) {
  sp_client *c;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  int sock = raw_joined(c, 1);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "release", 20, 1);
  sp__pack_kv_u64(&mb.pk, "export_id", 987654321);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "error");
  ck_assert_uint_eq(r.head.id, 20);
  ck_assert_int_eq(r.code, SP_ENOEXPORT);
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_ping(sock, 21), 0);
  close(sock);
  sp_close(c);
}
END_TEST

int main(void) {
  Suite *s = suite_create("export");
  TCase *ok = tcase_create("export");
  tcase_add_checked_fixture(ok, start, stop);
  tcase_set_timeout(ok, 60);
  tcase_add_test(ok, mixed_model_exports_exactly);
  tcase_add_test(ok, same_job_exports_again);
  tcase_add_test(ok, more_than_4096_keys_cross_a_round);
  suite_add_tcase(s, ok);
  TCase *refuse = tcase_create("refusals");
  tcase_add_checked_fixture(refuse, start, stop);
  tcase_set_timeout(refuse, 60);
  tcase_add_loop_test(refuse, refusal_reaches_every_rank_alike, 0,
                      sizeof refusals / sizeof refusals[0]);
  tcase_add_test(refuse, replicated_copies_that_differ);
  tcase_add_test(refuse, plain_copies_that_change_between_exports);
  tcase_add_test(refuse, comparison_turned_off);
  suite_add_tcase(s, refuse);
  TCase *faults = tcase_create("faults");
  tcase_add_checked_fixture(faults, start, stop);
  tcase_set_timeout(faults, 60);
  tcase_add_test(faults, rank_killed_while_the_others_wait);
  suite_add_tcase(s, faults);
  TCase *gone = tcase_create("departures");
  tcase_add_checked_fixture(gone, start, stop);
  tcase_set_timeout(gone, 60);
  tcase_add_test(gone, refused_rank_gone_before_the_others_ask);
  tcase_add_loop_test(gone, rank_gone_between_exports, 0, 2);
  tcase_add_test(gone, rank_back_between_exports);
  suite_add_tcase(s, gone);
  TCase *slow = tcase_create("faults_mid_export");
  tcase_add_checked_fixture(slow, start_slow, stop);
  tcase_set_timeout(slow, 60);
  tcase_add_test(slow, rank_killed_mid_export);
  suite_add_tcase(s, slow);
  TCase *bad = tcase_create("bad_input");
  tcase_add_checked_fixture(bad, start, stop);
  tcase_set_timeout(bad, 60);
  tcase_add_test(bad, view_outside_its_storage);
  tcase_add_test(bad, fd_too_small);
  tcase_add_test(bad, key_registered_twice);
  tcase_add_test(bad, export_asked_twice);
  tcase_add_test(bad, release_of_an_unknown_export);
  suite_add_tcase(s, bad);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
