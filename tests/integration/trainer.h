/*
 * trainer.h - trainer processes for export tests: one forked process and
 * one sp_client per rank, each on the daemon its scenario names.
 *
 * A scenario is a list of keys (how each rank holds each one) and options.
 * Each rank builds its holdings in one memfd storage from a deterministic
 * original (every element a hash of its key and flat index), registers,
 * exports, checks every owned tensor byte for byte against the original,
 * releases, checks its registered memory against a copy taken before, and
 * reports to the test process through a pipe: the export's code and
 * message, its own check failures, what it owned.  The test process forks
 * the ranks before anything connects, forwards rank 0's ticket to the
 * others, and asserts on the reports.  Used by the export suite (one
 * daemon) and the nodes suite (ranks spread over several daemons).
 *
 * The helpers assert with Check, so they are called from inside tests.
 */
#ifndef SP_TEST_TRAINER_H
#define SP_TEST_TRAINER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/msg.h"
#include "shardport.h"
#include "tests/integration/tlayout.h"

#define TRAINER_MAXR 8
/* How long the test process waits for a rank's next message. */
#define TRAINER_WAIT_MS 20000

enum kind {
  SHARD0 = 1,
  REPLICATED,
  PLAIN,
  EXPERT,
  AFFINE_COLS, /* parts[r]: rank r's columns, one affine piece */
  /* Rows in world/2 blocks (parts[b]: block b's rows); ranks r and
   * r + world/2 both hold block r % (world/2): replicas of one piece. */
  AFFINE_PAIRS,
  AFFINE_MAP, /* the pieces .layout gives each rank (tlayout.h) */
};

struct tkey {
  const char *name;
  enum kind kind;
  const char *dtype;
  uint32_t es;
  uint32_t ndim;
  int64_t shape[2];
  int64_t parts[TRAINER_MAXR]; /* SHARD0: rows per rank; see enum kind */
  uint32_t expert;             /* EXPERT: the rank holding it */
  int tie; /* > 0: shares key tie - 1's holding (tied weights) */
  /* SHARD0 and 2-D: elements between rows beyond the columns, so the
   * rank's view is not contiguous. */
  int64_t pad;
  /* AFFINE_MAP: a layout of 2 dims, the key's shape; each rank registers
   * its shard as one dim of the layout's numel elements. */
  const struct tlayout *layout;
};

#define K(...) ((struct tkey){__VA_ARGS__})

struct scenario;
/* Changes what rank registers, after its holdings are built: a refusal's
 * disagreement. */
typedef void tweak_fn(const struct scenario *sc, uint32_t rank,
                      sp_tensor_desc *t, size_t *n);

/* KILL_*: the victim is killed while the others wait, or once data moves.
 * *_AFTER_FIRST (with two exports or more): after its first export the
 * victim leaves the job, closes its connection without leaving, or leaves
 * and joins again as the same rank (registering anew) to go on, on its
 * daemon or on the one at rejoin_socket. */
enum fault {
  NO_FAULT,
  KILL_WAITING,
  KILL_MOVING,
  LEAVE_AFTER_FIRST,
  CLOSE_AFTER_FIRST,
  REJOIN_AFTER_FIRST,
  REJOIN_ELSEWHERE_AFTER_FIRST,
};

struct scenario {
  uint32_t world;
  size_t nkeys;
  struct tkey *keys;
  const char *const *group; /* one together-group, NULL-terminated */
  uint32_t max_keys;
  uint32_t timeout_ms; /* the export's; 0 means 10 s */
  tweak_fn *tweak;
  enum fault fault;
  uint32_t victim;
  const char *rejoin_socket; /* REJOIN_ELSEWHERE_AFTER_FIRST */
  uint32_t exports; /* exports in the one job; 0 means 1 */
  /* After its exports, a rank waits for trainer_release() before it
   * leaves, so that the test can look at the job. */
  bool hold;
  /* Before its last export, each rank that gets there waits for
   * trainer_open_gate(), so that the test decides when they ask. */
  bool gate;
  /* 1 + a rank whose replica data differs from the original's. */
  uint32_t corrupt;
  /* A key whose copy differs from the original's on the ranks in
   * corrupt_ranks (a bit per rank, each changed alike), from export
   * number corrupt_export (0-based: 0 is from the start) on. */
  const char *corrupt_key;
  uint32_t corrupt_ranks;
  uint32_t corrupt_export;
  /* An export that fails does not end the rank's exports: it goes on to
   * the next one of the job (with exports of 2 or more), and reports the
   * first failure in first_rc and first_message. */
  bool on_after_failure;
  /* A job created elsewhere: rank 0 joins it instead of creating one. */
  const sp_ticket *ticket;
};

/* What a rank tells the test process. */
struct report {
  int export_rc;
  char message[SP_ERRMSG_MAX + 1];
  char failure[512]; /* the rank's own checks; "" when all passed */
  /* With on_after_failure: the first export that failed (0: none). */
  int first_rc;
  char first_message[SP_ERRMSG_MAX + 1];
  uint32_t max_rounds;
  uint32_t progress_frames;
};

struct world {
  pid_t pid[TRAINER_MAXR];
  int in[TRAINER_MAXR];  /* the test's write end of each rank's input */
  int out[TRAINER_MAXR]; /* the test's read end of each rank's output */
  struct report rep[TRAINER_MAXR];
  uint8_t *owned[TRAINER_MAXR];
  bool reported[TRAINER_MAXR];
  bool moving[TRAINER_MAXR]; /* the rank saw the export move data */
};

/* Forks the ranks, rank r on the daemon at sockets[r], and hands rank 0's
 * ticket to the others. */
void trainer_start(struct world *w, const struct scenario *sc,
                   const char *const *sockets);
/* The next message of rank i is 'P': its export request reached the
 * daemon (or, for a victim waiting to be killed, it registered). */
void trainer_expect_progress(struct world *w, uint32_t i);
/* Waits until rank i saw its export move data (phase "moving"). */
void trainer_wait_moving(struct world *w, uint32_t i);
/* With hold: waits until every rank finished its exports, then lets them
 * leave (the reports follow). */
void trainer_wait_held(struct world *w, const struct scenario *sc);
void trainer_release(struct world *w, const struct scenario *sc);
/* With gate: waits until every rank but skip stands before its last
 * export; then lets them ask. */
void trainer_wait_gate(struct world *w, const struct scenario *sc,
                       uint32_t skip);
void trainer_open_gate(struct world *w, const struct scenario *sc,
                       uint32_t skip);
/* Waits until the daemon at socket, holding one job, counts `joined` of
 * its ranks in it: it has seen the others go. */
void trainer_wait_joined(const char *socket, uint32_t joined);
void trainer_read_report(struct world *w, const struct scenario *sc,
                         uint32_t i);
/* Reads every report not read yet (but a killed victim's) and reaps the
 * ranks. */
void trainer_finish(struct world *w, const struct scenario *sc);
void trainer_free(struct world *w, const struct scenario *sc);
/* Every rank exported, passed its checks, and every key has one owner. */
void trainer_assert_exported(struct world *w, const struct scenario *sc);
uint32_t trainer_owner_of(const struct world *w, const struct scenario *sc,
                          const char *name);

/* The desc of key in t[0..n), or NULL: for tweaks. */
sp_tensor_desc *trainer_desc(sp_tensor_desc *t, size_t n, const char *key);

/* The mixed model both the one-node and the across-nodes suites export, for
 * four ranks: every placement, dtypes of 2 and 4 bytes, uneven and empty
 * shards, tied weights and a together-group (TRAINER_MIXED_GROUP). */
#define TRAINER_MIXED_KEYS \
    /* uneven rows, a rank with none */ \
    K(.name = "emb", .kind = SHARD0, .dtype = "bfloat16", .es = 2, .ndim = 2, \
      .shape = {10, 6}, .parts = {3, 0, 5, 2}), \
    /* no elements at all */ \
    K(.name = "empty", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {0, 5}, .parts = {0, 0, 0, 0}), \
    K(.name = "w.f32", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {7, 3}, .parts = {1, 2, 3, 1}), \
    /* every row on one rank: identity when that rank owns it */ \
    K(.name = "w.i16", .kind = SHARD0, .dtype = "int16", .es = 2, .ndim = 1, \
      .shape = {9}, .parts = {0, 0, 9, 0}), \
    K(.name = "norm", .kind = REPLICATED, .dtype = "float32", .es = 4, \
      .ndim = 1, .shape = {6}), \
    K(.name = "bias", .kind = PLAIN, .dtype = "bfloat16", .es = 2, .ndim = 1, \
      .shape = {5}), \
    K(.name = "expert.0", .kind = EXPERT, .dtype = "bfloat16", .es = 2, \
      .ndim = 2, .shape = {4, 6}, .expert = 2), \
    K(.name = "expert.1", .kind = EXPERT, .dtype = "float32", .es = 4, \
      .ndim = 2, .shape = {3, 3}, .expert = 1), \
    /* a column split: each rank holds columns as one affine piece */ \
    K(.name = "cols", .kind = AFFINE_COLS, .dtype = "float32", .es = 4, \
      .ndim = 2, .shape = {4, 10}, .parts = {3, 2, 4, 1}), \
    K(.name = "tied.a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {8, 4}, .parts = {2, 2, 2, 2}), \
    K(.name = "tied.b", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {8, 4}, .parts = {2, 2, 2, 2}, .tie = 9 + 1), \
    K(.name = "grp.x", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {6, 2}, .parts = {2, 1, 1, 2}), \
    K(.name = "grp.y", .kind = REPLICATED, .dtype = "bfloat16", .es = 2, \
      .ndim = 2, .shape = {5, 3}), \
    K(.name = "scalar", .kind = PLAIN, .dtype = "float32", .es = 4, .ndim = 0)

#define TRAINER_MIXED_GROUP {"grp.x", "grp.y", NULL}

/* The small model the refusal tests of four ranks corrupt, one tweak at a
 * time: a dim-0 key "a", a replicated "b" and an expert "e" on rank 0. */
#define TRAINER_REFUSAL_KEYS \
    K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {8, 4}, .parts = {2, 2, 2, 2}), \
    K(.name = "b", .kind = REPLICATED, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {8, 4}), \
    K(.name = "e", .kind = EXPERT, .dtype = "float32", .es = 4, .ndim = 2, \
      .shape = {8, 4}, .expert = 0)

/* A tweak: rank 3 does not register "b", so the ranks' key sets differ. */
void trainer_drop_b_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n);
/* A tweak: the victim's view of "a" starts past its storage's end, so the
 * daemon refuses its registration (view_out_of_bounds) and the victim
 * gives up: it reports and closes its connection. */
void trainer_victim_out_of_bounds(const struct scenario *sc, uint32_t rank,
                                  sp_tensor_desc *t, size_t *n);

#endif /* SP_TEST_TRAINER_H */
