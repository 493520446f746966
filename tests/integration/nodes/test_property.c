/*
 * test_property.c - the corrupted-map property of seed 003
 * (docs/planner.md, "Affine layouts") through two real daemons.
 *
 * The planner's property suite (tests/unit/plan/test_property.c) checks it
 * on oracle_rebuild; here the same random layouts (tgen.h: replicas cut at
 * other boundaries, strided sources, interleaved columns, ...) go through
 * two shardportd daemons on loopback, with each layout's ranks spread over
 * both at random (each daemon holding at least one).  For each layout a
 * fresh job of its ranks, one forked process per rank:
 *
 *   1. every rank registers its shard (built from the true map) as key "p"
 *      and exports: the owner checks "p" against the original, byte for
 *      byte (a valid layout must export exactly);
 *   2. once every rank has its reply, each registers key "c": the same
 *      shard through a corrupted map (one offset or stride of one piece
 *      changed), and exports again.  Either every rank is refused alike (a
 *      rank whose registration is refused leaves, and the others hear
 *      rank_lost at once), or the owner of "c" holds the original.
 *
 * Counted and printed: layouts, those with strided sources and with
 * replicas, true maps exact, corrupted maps refused, exact and wrong, and
 * crashes (a daemon that died).  Wrong, crashed and failed true maps must
 * be 0, and no export may wait for its timeout.  SP_TEST_LAYOUTS sets how
 * many layouts (default below).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/model.h"
#include "tests/unit/plan/oracle.h"
#include "tests/unit/plan/tgen.h"
#include "tests/unit/plan/tjob.h"

#define LAYOUTS_DEFAULT 1200
#define SID 1
#define WAIT_MS 20000
/* Longer than the test waits for a rank: an export that waits for its
 * timeout fails the test instead of passing slowly. */
#define EXPORT_TIMEOUT_MS 30000

static struct sp_test_daemon daemons[2];

static const char *const dtype_of[9] = {
    [1] = "uint8", [2] = "int16", [4] = "int32", [8] = "int64"};

/* What one rank of one layout did, in memory shared with the test. */
struct outcome {
  bool done;
  int rc1, rc2, reg_rc; /* export 1, export 2, registering "c" */
  bool owned_p, p_exact, owned_c, c_exact;
  char message[SP_ERRMSG_MAX + 1]; /* export 2's, or the refusal's */
  char failure[SP_ERRMSG_MAX + 64];
};

/* One layout as the ranks hold it: the true map, the corrupted one, each
 * rank's daemon, and the key's element size. */
struct trial {
  struct tgen_layout truth, bad;
  sp_piece true_pieces[TGEN_MAX_RANKS][TGEN_MAX_PIECES];
  sp_piece bad_pieces[TGEN_MAX_RANKS][TGEN_MAX_PIECES];
  uint32_t node[TGEN_MAX_RANKS];
  size_t es;
};

static void to_sp_pieces(const struct tgen_layout *l, uint32_t rank,
                         sp_piece *out) {
  for (size_t i = 0; i < l->npieces[rank]; i++) {
    const struct affine_piece *p = &l->pieces[rank][i];
    out[i] = (sp_piece){.ndim = p->ndim, .src_offset = p->src_offset,
                        .dst_offset = p->dst_offset,
                        .nholders = p->nholders, .holders = p->holders};
    memcpy(out[i].shape, p->shape, sizeof p->shape);
    memcpy(out[i].src_stride, p->src_stride, sizeof p->src_stride);
    memcpy(out[i].dst_stride, p->dst_stride, sizeof p->dst_stride);
  }
}

/* Whether a piece reads its source as something else than one run. */
static bool strided(const struct affine_piece *p) {
  int64_t expect = 1;
  for (uint32_t d = p->ndim; d-- > 0;) {
    if (p->shape[d] != 1 && p->src_stride[d] != expect)
      return true;
    expect *= p->shape[d];
  }
  return false;
}

/* ---- one rank ---- */

static int register_key(sp_client *c, const struct trial *t, uint32_t rank,
                        const char *key, const sp_piece *pieces) {
  const struct tgen_layout *l = &t->truth;
  sp_tensor_desc d = {.key = key, .storage = SID, .dtype = dtype_of[t->es],
                      .ndim = 1, .shape = {(int64_t)l->shard_numel[rank]},
                      .stride = {1}, .placement = SP_PLACEMENT_AFFINE,
                      .global_ndim = l->ndim,
                      .npieces = l->npieces[rank], .pieces = pieces};
  memcpy(d.global_shape, l->shape, l->ndim * sizeof l->shape[0]);
  return sp_register_tensors(c, &d, 1);
}

/* Whether the owned tensor is the original of "p", element for element. */
static bool is_original(const struct trial *t, const sp_owned_tensor *o) {
  const struct tgen_layout *l = &t->truth;
  uint8_t want[8];
  for (uint64_t i = 0; i < l->numel; i++) {
    uint64_t rest = i;
    int64_t at = 0;
    for (uint32_t d = l->ndim; d-- > 0;) {
      at += (int64_t)(rest % (uint64_t)l->shape[d]) * o->stride[d];
      rest /= (uint64_t)l->shape[d];
    }
    model_element("p", i, t->es, want);
    if (memcmp((const uint8_t *)o->data + at * (int64_t)t->es, want, t->es))
      return false;
  }
  return true;
}

static int export_and_check(sp_client *c, const struct trial *t,
                            const char *key, bool *owned, bool *exact) {
  sp_export_opts opts = {.timeout_ms = EXPORT_TIMEOUT_MS};
  sp_owned_set *set = NULL;
  int rc = sp_export(c, &opts, &set);
  if (rc < 0)
    return rc;
  for (size_t i = 0; i < set->ntensors; i++)
    if (strcmp(set->tensors[i].key, key) == 0) {
      *owned = true;
      *exact = is_original(t, &set->tensors[i]);
    }
  sp_release(c, set);
  return 0;
}

static void rank_main(const struct trial *t, uint32_t rank,
                      const sp_ticket *ticket, int in_fd, int out_fd,
                      struct outcome *o) {
  const struct tgen_layout *l = &t->truth;
  sp_client *c = NULL;
  o->rc1 = o->rc2 = o->reg_rc = 1; /* not reached */
  uint64_t len = l->shard_numel[rank] * t->es + 64;
  int fd = memfd_create("sp-property", MFD_CLOEXEC);
  uint8_t *shard = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)len) == 0)
    shard = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (shard == MAP_FAILED) {
    snprintf(o->failure, sizeof o->failure, "no storage: %s",
             strerror(errno));
    goto out;
  }
  /* The shard from the true map; what no piece reads stays 0x5a. */
  memset(shard, 0x5a, len);
  uint8_t *full = malloc(l->numel * t->es);
  for (uint64_t i = 0; full != NULL && i < l->numel; i++)
    model_element("p", i, t->es, full + i * t->es);
  char why[256];
  if (full == NULL ||
      oracle_extract(&l->map, rank, t->es, full, shard, why, sizeof why) != 0) {
    snprintf(o->failure, sizeof o->failure, "no shard: %s", why);
    free(full);
    goto out;
  }
  free(full);
  int rc;
  sp_storage_desc st = {.id = SID, .fd = fd, .length = len, .addr = shard};
  if ((rc = sp_connect(daemons[t->node[rank]].socket, &c)) < 0 ||
      (rc = sp_job_join(c, ticket, rank, l->nranks, "cpu")) < 0 ||
      (rc = sp_register_storages(c, &st, 1)) < 0 ||
      (rc = register_key(c, t, rank, "p", t->true_pieces[rank])) < 0) {
    snprintf(o->failure, sizeof o->failure, "setting up: %s: %s",
             sp_strerror(rc), c != NULL ? sp_last_message(c) : "");
    goto out;
  }
  o->rc1 = export_and_check(c, t, "p", &o->owned_p, &o->p_exact);
  /* Registering again waits for every rank's reply to the first export. */
  char go = 0;
  struct pollfd pfd = {.fd = in_fd, .events = POLLIN};
  if (write(out_fd, "a", 1) != 1 || poll(&pfd, 1, WAIT_MS) != 1 ||
      read(in_fd, &go, 1) != 1 || o->rc1 != 0)
    goto out;
  o->reg_rc = register_key(c, t, rank, "c", t->bad_pieces[rank]);
  if (o->reg_rc < 0) {
    /* Refused: the rank gives up, as a trainer would. */
    snprintf(o->message, sizeof o->message, "%s", sp_last_message(c));
    goto out;
  }
  o->rc2 = export_and_check(c, t, "c", &o->owned_c, &o->c_exact);
  snprintf(o->message, sizeof o->message, "%s", sp_last_message(c));
  sp_job_leave(c);
out:
  o->done = true;
  sp_close(c);
  _exit(0);
}

/* ---- the test ---- */

static void start_daemon(int i) {
  static const char *const args[] = {"--peer-listen", "127.0.0.1:0",
                                     "--log-level", "warn", NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemons[i], args), 0);
}

static bool daemon_died(int i) {
  int st;
  if (waitpid(daemons[i].pid, &st, WNOHANG) != daemons[i].pid)
    return false;
  fprintf(stderr, "daemon %d died: %s %d\n", i,
          WIFSIGNALED(st) ? "signal" : "exit status",
          WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
  daemons[i].pid = -1;
  sp_test_daemon_stop(&daemons[i]);
  start_daemon(i);
  return true;
}

struct counts {
  unsigned layouts, strided, replicas, true_exact, true_failed;
  unsigned refused, exact, wrong, timed_out, crashed;
};

/* Runs the ranks of one layout; false when something hung. */
static bool run_ranks(const struct trial *t, const sp_ticket *ticket,
                      struct outcome *out) {
  uint32_t n = t->truth.nranks;
  pid_t pid[TGEN_MAX_RANKS];
  int in[TGEN_MAX_RANKS][2], back[TGEN_MAX_RANKS][2];
  memset(out, 0, n * sizeof *out);
  for (uint32_t r = 0; r < n; r++) {
    ck_assert_int_eq(pipe2(in[r], O_CLOEXEC), 0);
    ck_assert_int_eq(pipe2(back[r], O_CLOEXEC), 0);
    pid[r] = fork();
    ck_assert_int_ge(pid[r], 0);
    if (pid[r] == 0)
      rank_main(t, r, ticket, in[r][0], back[r][1], &out[r]);
    close(in[r][0]);
    close(back[r][1]);
  }
  /* Every rank got its first reply (or ended): they may register again. */
  bool hung = false;
  for (uint32_t r = 0; r < n; r++) {
    struct pollfd pfd = {.fd = back[r][0], .events = POLLIN};
    char a;
    hung = hung || poll(&pfd, 1, WAIT_MS) != 1 ||
           (read(back[r][0], &a, 1) < 0);
  }
  for (uint32_t r = 0; r < n; r++) {
    ck_assert_int_eq(write(in[r][1], "g", 1), 1);
    close(in[r][1]);
    close(back[r][0]);
  }
  for (uint32_t r = 0; r < n; r++)
    if (sp_test_wait(pid[r], WAIT_MS) == SP_ETIMEOUT) {
      hung = true;
      kill(pid[r], SIGKILL);
      sp_test_wait(pid[r], WAIT_MS);
    }
  return !hung;
}

/* How the corrupted map fared, from every rank's outcome. */
static void judge(const struct trial *t, const struct outcome *out,
                  struct counts *k, unsigned index) {
  uint32_t n = t->truth.nranks;
  bool all_ok = true, any_ok = false, alike = true, refused_reg = false;
  int code = 0;
  const char *message = NULL;
  for (uint32_t r = 0; r < n; r++) {
    const struct outcome *o = &out[r];
    if (o->reg_rc < 0) {
      refused_reg = true;
      continue;
    }
    all_ok = all_ok && o->rc2 == 0;
    any_ok = any_ok || o->rc2 == 0;
    k->timed_out += o->rc2 == SP_ETIMEOUT;
    if (o->rc2 < 0 && message == NULL) {
      code = o->rc2;
      message = o->message;
    } else if (o->rc2 < 0) {
      alike = alike && o->rc2 == code && strcmp(o->message, message) == 0;
    }
  }
  bool owner_exact = false, owned = false;
  for (uint32_t r = 0; r < n; r++) {
    owned = owned || out[r].owned_c;
    owner_exact = owner_exact || (out[r].owned_c && out[r].c_exact);
  }
  if (!any_ok && alike) {
    k->refused++;
  } else if (all_ok && !refused_reg && owned && owner_exact) {
    k->exact++;
  } else {
    k->wrong++;
    fprintf(stderr, "layout %u: corrupted map: %s\n", index,
            all_ok ? "the owner's tensor is not the original"
                   : "ranks disagree on the outcome");
    for (uint32_t r = 0; r < n; r++)
      fprintf(stderr, "  rank %u (node %u): register %d, export %d: %s\n", r,
              t->node[r], out[r].reg_rc, out[r].rc2, out[r].message);
  }
}

/* Every layout's job has ended on both daemons once its ranks left. */
static void assert_no_job_left(void) {
  for (int i = 0; i < 2; i++) {
    size_t jobs = 1;
    for (int tries = 0; tries < WAIT_MS / 10 && jobs != 0; tries++) {
      sp_client *c;
      sp_status_info *st;
      ck_assert_int_eq(sp_connect(daemons[i].socket, &c), 0);
      ck_assert_int_eq(sp_status(c, &st), 0);
      jobs = st->njobs;
      sp_status_free(st);
      sp_close(c);
      if (jobs != 0)
        usleep(10000);
    }
    ck_assert_msg(jobs == 0, "daemon %d still holds %zu job(s)", i, jobs);
  }
}

START_TEST(corrupted_maps_through_two_daemons) {
  const char *env = getenv("SP_TEST_LAYOUTS");
  unsigned layouts = env != NULL && atoi(env) > 0 ? (unsigned)atoi(env)
                                                  : LAYOUTS_DEFAULT;
  static struct trial t;
  struct outcome *out =
      mmap(NULL, TGEN_MAX_RANKS * sizeof *out, PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(out, MAP_FAILED);
  struct counts k = {0};
  uint64_t seed = 0x5eed5eedu;
  sp_client *creator;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &creator), 0);

  for (unsigned i = 0; i < layouts; i++) {
    t.es = (size_t)1 << (tjob_rand(&seed) % 4);
    tgen_generate(&t.truth, &seed);
    tgen_copy(&t.bad, &t.truth);
    tgen_corrupt(&t.bad, &seed);
    uint32_t n = t.truth.nranks, on[2] = {0, 0};
    bool any_strided = false, any_replica = false;
    for (uint32_t r = 0; r < n; r++) {
      t.node[r] = (uint32_t)(tjob_rand(&seed) % 2);
      on[t.node[r]]++;
      to_sp_pieces(&t.truth, r, t.true_pieces[r]);
      to_sp_pieces(&t.bad, r, t.bad_pieces[r]);
      for (size_t p = 0; p < t.truth.npieces[r]; p++) {
        any_strided = any_strided || strided(&t.truth.pieces[r][p]);
        any_replica = any_replica || t.truth.pieces[r][p].nholders > 1;
      }
    }
    /* Both daemons take part. */
    if (on[0] == 0 || on[1] == 0)
      t.node[n - 1] ^= 1;
    k.layouts++;
    k.strided += any_strided;
    k.replicas += any_replica;

    sp_ticket ticket;
    int rc = sp_job_create(creator, n, &ticket);
    if (rc == SP_ECLOSED || rc == SP_ENODAEMON) {
      sp_close(creator);
      ck_assert(daemon_died(0));
      ck_assert_int_eq(sp_connect(daemons[0].socket, &creator), 0);
      rc = sp_job_create(creator, n, &ticket);
    }
    ck_assert_int_eq(rc, 0);
    bool finished = run_ranks(&t, &ticket, out);
    bool crashed = false;
    for (int d = 0; d < 2; d++)
      crashed = daemon_died(d) || crashed;
    if (crashed) {
      k.crashed++;
      fprintf(stderr, "layout %u: a daemon died\n", i);
      sp_close(creator);
      ck_assert_int_eq(sp_connect(daemons[0].socket, &creator), 0);
      continue;
    }
    ck_assert_msg(finished, "layout %u: a rank hung", i);
    bool true_ok = true, p_exact = false;
    for (uint32_t r = 0; r < n; r++) {
      true_ok = true_ok && out[r].done && out[r].rc1 == 0;
      p_exact = p_exact || (out[r].owned_p && out[r].p_exact);
      if (out[r].failure[0] != '\0')
        fprintf(stderr, "layout %u: rank %u: %s\n", i, r, out[r].failure);
    }
    if (true_ok && p_exact) {
      k.true_exact++;
    } else {
      k.true_failed++;
      fprintf(stderr, "layout %u: the true map did not export exactly\n", i);
      continue;
    }
    judge(&t, out, &k, i);
  }
  sp_close(creator);
  printf("affine property across nodes: %u layouts (%u with strided sources, "
         "%u with replicas), true maps exact %u, corrupted maps refused %u, "
         "exact %u, wrong %u, crashed %u\n",
         k.layouts, k.strided, k.replicas, k.true_exact, k.refused, k.exact,
         k.wrong, k.crashed);
  fflush(stdout);
  munmap(out, TGEN_MAX_RANKS * sizeof *out);
  ck_assert_uint_eq(k.crashed, 0);
  ck_assert_uint_eq(k.true_failed, 0);
  ck_assert_uint_eq(k.wrong, 0);
  ck_assert_uint_eq(k.timed_out, 0);
  ck_assert_uint_eq(k.refused + k.exact, k.layouts);
  assert_no_job_left();
}
END_TEST

static void start_both(void) {
  start_daemon(0);
  start_daemon(1);
}

static void stop_both(void) {
  for (int i = 0; i < 2; i++)
    ck_assert_int_eq(sp_test_daemon_stop(&daemons[i]), 0);
}

int main(void) {
  Suite *s = suite_create("nodes-property");
  TCase *tc = tcase_create("property");
  tcase_add_checked_fixture(tc, start_both, stop_both);
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, corrupted_maps_through_two_daemons);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
