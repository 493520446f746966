/*
 * test_export.c - exports end to end: a real shardportd and real trainer
 * processes, one forked process and one sp_client per rank.
 *
 * A scenario is a list of keys (how each rank holds each one) and options.
 * Each rank builds its holdings in one memfd storage from a deterministic
 * original (every element a hash of its key and flat index), registers,
 * exports, checks every owned tensor byte for byte against the original,
 * releases, checks its registered memory against a copy taken before, and
 * reports to the test process through a pipe: the export's code and
 * message, its own check failures, what it owned.  The test process forks
 * the ranks before anything connects, forwards rank 0's ticket to the
 * others, and asserts on the reports: every key owned by exactly one rank,
 * refusals identical on every rank, faults reaching every survivor.
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

#define MAXR 8
#define SID 1
/* How long the test process waits for a rank's next message. */
#define WAIT_MS 20000

/* ---- scenarios ---- */

enum kind { SHARD0 = 1, REPLICATED, PLAIN, EXPERT, AFFINE_COLS };

struct tkey {
  const char *name;
  enum kind kind;
  const char *dtype;
  uint32_t es;
  uint32_t ndim;
  int64_t shape[2];
  int64_t parts[MAXR]; /* SHARD0: rows per rank; AFFINE_COLS: columns */
  uint32_t expert;     /* EXPERT: the rank holding it */
  int tie;             /* > 0: shares key tie - 1's holding (tied weights) */
};

struct scenario;
/* Changes what rank registers, after its holdings are built: a refusal's
 * disagreement. */
typedef void tweak_fn(const struct scenario *sc, uint32_t rank,
                      sp_tensor_desc *t, size_t *n);

enum fault { NO_FAULT, KILL_WAITING, KILL_MOVING };

struct scenario {
  uint32_t world;
  size_t nkeys;
  struct tkey *keys;
  const char *const *group; /* one together-group, NULL-terminated */
  uint32_t max_keys;
  tweak_fn *tweak;
  enum fault fault;
  uint32_t victim;
  uint32_t exports; /* exports in the one job; 0 means 1 */
};

/* What a rank tells the test process. */
struct report {
  int export_rc;
  char message[SP_ERRMSG_MAX + 1];
  char failure[512]; /* the rank's own checks; "" when all passed */
  uint32_t max_rounds;
  uint32_t progress_frames;
};

static uint64_t mix(uint64_t x) {
  x += UINT64_C(0x9e3779b97f4a7c15);
  x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
  return x ^ (x >> 31);
}

static uint64_t seed_of(const char *s) {
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
  return mix(h);
}

/* Element i of the key's original, es bytes. */
static void element(const struct tkey *k, uint64_t i, uint8_t *out) {
  uint64_t v = mix(seed_of(k->name) + i);
  memcpy(out, &v, k->es);
}

static int64_t ncols(const struct tkey *k) {
  return k->ndim == 2 ? k->shape[1] : 1;
}

static int64_t before(const int64_t *parts, uint32_t rank) {
  int64_t s = 0;
  for (uint32_t r = 0; r < rank; r++)
    s += parts[r];
  return s;
}

static bool holds(const struct tkey *k, uint32_t rank) {
  return k->kind != EXPERT || k->expert == rank;
}

/* ---- one rank ---- */

struct holding {
  bool held;
  int64_t shape[2];
  uint64_t byte_off;
  uint64_t nbytes;
};

struct rank {
  const struct scenario *sc;
  uint32_t rank;
  int out_fd;
  struct holding *h; /* [nkeys] */
  int fd;
  uint8_t *storage;
  uint64_t len;
  uint8_t *copy;
  struct report rep;
  uint8_t *owned; /* [nkeys] */
};

__attribute__((format(printf, 2, 3))) static void failf(struct rank *r,
                                                        const char *fmt,
                                                        ...) {
  if (r->rep.failure[0])
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->rep.failure, sizeof r->rep.failure, fmt, ap);
  va_end(ap);
}

/* The rank's holding of key i: its shape, and the original's element at
 * each of its positions. */
static void holding_shape(const struct tkey *k, uint32_t rank, int64_t *shape) {
  shape[0] = k->shape[0];
  shape[1] = k->shape[1];
  if (k->kind == SHARD0)
    shape[0] = k->parts[rank];
  else if (k->kind == AFFINE_COLS)
    shape[1] = k->parts[rank];
}

/* Original flat index of the holding's element (row, col). */
static uint64_t source_index(const struct tkey *k, uint32_t rank, int64_t row,
                             int64_t col) {
  if (k->kind == SHARD0)
    return (uint64_t)((before(k->parts, rank) + row) * ncols(k) + col);
  if (k->kind == AFFINE_COLS)
    return (uint64_t)(row * k->shape[1] + before(k->parts, rank) + col);
  return (uint64_t)(row * ncols(k) + col);
}

static int build_storage(struct rank *r) {
  const struct scenario *sc = r->sc;
  r->h = calloc(sc->nkeys, sizeof *r->h);
  r->owned = calloc(sc->nkeys, 1);
  if (!r->h || !r->owned)
    return -1;
  uint64_t len = 0;
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    struct holding *h = &r->h[i];
    if (!holds(k, r->rank))
      continue;
    h->held = true;
    if (k->tie > 0) {
      *h = r->h[k->tie - 1];
      continue;
    }
    holding_shape(k, r->rank, h->shape);
    int64_t n = k->ndim == 0 ? 1 : h->shape[0] * (k->ndim == 2 ? h->shape[1] : 1);
    h->nbytes = (uint64_t)n * k->es;
    h->byte_off = (len + 63) / 64 * 64;
    len = h->byte_off + h->nbytes;
  }
  r->len = len + 64; /* a tail the rank never registers a view into */
  r->fd = memfd_create("sp-test-storage", MFD_CLOEXEC);
  if (r->fd < 0 || ftruncate(r->fd, (off_t)r->len) != 0)
    return -1;
  r->storage = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
  if (r->storage == MAP_FAILED)
    return -1;
  memset(r->storage, 0x5a, r->len);
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    const struct holding *h = &r->h[i];
    if (!h->held || k->tie > 0)
      continue;
    int64_t rows = k->ndim == 0 ? 1 : h->shape[0];
    int64_t cols = k->ndim == 2 ? h->shape[1] : 1;
    for (int64_t y = 0; y < rows; y++)
      for (int64_t x = 0; x < cols; x++)
        element(k, source_index(k, r->rank, y, x),
                r->storage + h->byte_off + (uint64_t)(y * cols + x) * k->es);
  }
  r->copy = malloc(r->len);
  if (!r->copy)
    return -1;
  memcpy(r->copy, r->storage, r->len);
  return 0;
}

static sp_placement placement_of(enum kind kind) {
  switch (kind) {
  case SHARD0:
    return SP_PLACEMENT_SHARD0;
  case REPLICATED:
    return SP_PLACEMENT_REPLICATED;
  case PLAIN:
    return SP_PLACEMENT_PLAIN;
  case EXPERT:
    return SP_PLACEMENT_EXPERT;
  case AFFINE_COLS:
    return SP_PLACEMENT_AFFINE;
  }
  return 0;
}

/* One piece per rank: its columns of the full tensor. */
static sp_piece *pieces_of(const struct tkey *k, uint32_t rank,
                           uint32_t *holder) {
  sp_piece *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  *holder = rank;
  int64_t w = k->parts[rank];
  *p = (sp_piece){.ndim = 2, .shape = {k->shape[0], w},
                  .src_stride = {w, 1}, .dst_offset = before(k->parts, rank),
                  .dst_stride = {k->shape[1], 1}, .nholders = 1,
                  .holders = holder};
  return p;
}

static int register_all(struct rank *r, sp_client *c) {
  const struct scenario *sc = r->sc;
  sp_storage_desc st = {.id = SID, .fd = r->fd, .length = r->len,
                        .addr = r->storage};
  int rc = sp_register_storages(c, &st, 1);
  if (rc < 0)
    return rc;
  sp_tensor_desc *t = calloc(sc->nkeys + 1, sizeof *t);
  sp_piece **pieces = calloc(sc->nkeys, sizeof *pieces);
  uint32_t *holders = calloc(sc->nkeys, sizeof *holders);
  if (!t || !pieces || !holders)
    return SP_ENOMEM;
  size_t n = 0;
  for (size_t i = 0; i < sc->nkeys; i++) {
    const struct tkey *k = &sc->keys[i];
    const struct holding *h = &r->h[i];
    if (!h->held)
      continue;
    sp_tensor_desc *d = &t[n++];
    *d = (sp_tensor_desc){.key = k->name, .storage = SID, .dtype = k->dtype,
                          .ndim = k->ndim,
                          .offset = (int64_t)(h->byte_off / k->es),
                          .placement = placement_of(k->kind),
                          .global_ndim = k->ndim};
    for (uint32_t dd = 0; dd < k->ndim; dd++) {
      d->shape[dd] = h->shape[dd];
      d->global_shape[dd] = k->shape[dd];
    }
    if (k->ndim == 2) {
      d->stride[0] = h->shape[1];
      d->stride[1] = 1;
    } else if (k->ndim == 1) {
      d->stride[0] = 1;
    }
    if (k->kind == AFFINE_COLS) {
      pieces[i] = pieces_of(k, r->rank, &holders[i]);
      d->npieces = 1;
      d->pieces = pieces[i];
    }
  }
  if (sc->tweak)
    sc->tweak(sc, r->rank, t, &n);
  rc = sp_register_tensors(c, t, n);
  for (size_t i = 0; i < sc->nkeys; i++)
    free(pieces[i]);
  free(pieces);
  free(holders);
  free(t);
  return rc;
}

static const struct tkey *find(const struct scenario *sc, const char *name,
                               size_t *index) {
  for (size_t i = 0; i < sc->nkeys; i++)
    if (strcmp(sc->keys[i].name, name) == 0) {
      *index = i;
      return &sc->keys[i];
    }
  return NULL;
}

/* Every owned tensor is the original, byte for byte, and where it should
 * be: replicated, plain and expert keys in the rank's own storage. */
static void verify(struct rank *r, const sp_owned_set *set) {
  const struct scenario *sc = r->sc;
  for (size_t i = 0; i < set->ntensors; i++) {
    const sp_owned_tensor *t = &set->tensors[i];
    size_t idx;
    const struct tkey *k = find(sc, t->key, &idx);
    if (!k) {
      failf(r, "received unknown key \"%s\"", t->key);
      return;
    }
    if (r->owned[idx]) {
      failf(r, "received \"%s\" twice", t->key);
      return;
    }
    r->owned[idx] = 1;
    if (i > 0 && strcmp(set->tensors[i - 1].key, t->key) >= 0)
      failf(r, "set not sorted at \"%s\"", t->key);
    if (strcmp(t->dtype, k->dtype) != 0 || t->ndim != k->ndim)
      failf(r, "\"%s\": dtype %s ndim %u", t->key, t->dtype, t->ndim);
    for (uint32_t d = 0; d < k->ndim; d++)
      if (t->shape[d] != k->shape[d])
        failf(r, "\"%s\": dim %u is %lld", t->key, d, (long long)t->shape[d]);
    bool whole = k->kind == REPLICATED || k->kind == PLAIN ||
                 k->kind == EXPERT;
    const uint8_t *p = t->data;
    bool inside = p >= r->storage && p < r->storage + r->len;
    if (whole && (!t->identity || !inside))
      failf(r, "\"%s\" is not published as the rank's own storage", t->key);
    if (t->identity && !inside)
      failf(r, "\"%s\": identity outside the rank's storage", t->key);
    if (k->kind == EXPERT && k->expert != r->rank)
      failf(r, "expert \"%s\" of rank %u owned by rank %u", t->key, k->expert,
            r->rank);
    int64_t rows = k->ndim == 0 ? 1 : k->shape[0];
    int64_t cols = ncols(k);
    int64_t s0 = k->ndim >= 1 ? t->stride[0] : 0;
    int64_t s1 = k->ndim == 2 ? t->stride[1] : 0;
    /* A tied key holds its leader's bytes. */
    const struct tkey *orig = k->tie > 0 ? &sc->keys[k->tie - 1] : k;
    uint8_t want[8];
    for (int64_t y = 0; y < rows; y++)
      for (int64_t x = 0; x < cols; x++) {
        element(orig, (uint64_t)(y * cols + x), want);
        if (memcmp(p + (y * s0 + x * s1) * (int64_t)k->es, want, k->es) != 0) {
          failf(r, "\"%s\": element (%lld, %lld) differs from the original",
                t->key, (long long)y, (long long)x);
          y = rows;
          break;
        }
      }
  }
  /* Tied weights: both keys here (the test process checks they have one
   * owner), in one buffer. */
  for (size_t i = 0; i < set->ntensors; i++) {
    size_t idx, leader;
    const struct tkey *k = find(sc, set->tensors[i].key, &idx);
    if (!k || k->tie == 0)
      continue;
    for (size_t j = 0; j < set->ntensors; j++)
      if (find(sc, set->tensors[j].key, &leader) && leader == (size_t)k->tie - 1 &&
          set->tensors[j].data != set->tensors[i].data)
        failf(r, "tied \"%s\" and \"%s\" have two buffers",
              set->tensors[i].key, set->tensors[j].key);
  }
}

static int write_msg(int fd, char type, const void *buf, size_t len) {
  if (write(fd, &type, 1) != 1)
    return -1;
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_full(int fd, void *buf, size_t len, int timeout_ms) {
  uint8_t *p = buf;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (len > 0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int left = timeout_ms - (int)((t1.tv_sec - t0.tv_sec) * 1000 +
                                  (t1.tv_nsec - t0.tv_nsec) / 1000000);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (left <= 0 || poll(&pfd, 1, left) != 1)
      return SP_ETIMEOUT;
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return SP_ECLOSED;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

struct progress_ctx {
  struct rank *r;
  bool told;
};

static void on_progress(const sp_progress *p, void *arg) {
  struct progress_ctx *ctx = arg;
  struct rank *r = ctx->r;
  r->rep.progress_frames++;
  if (p->rounds > r->rep.max_rounds)
    r->rep.max_rounds = p->rounds;
  /* The test process learns that this rank's request reached the daemon. */
  if (!ctx->told) {
    ctx->told = true;
    write_msg(r->out_fd, 'P', NULL, 0);
  }
  if (r->sc->fault == KILL_MOVING && r->rank == r->sc->victim &&
      strcmp(p->phase, "moving") == 0)
    raise(SIGKILL);
}

static void rank_main(const struct scenario *sc, const char *socket,
                      uint32_t rank, int in_fd, int out_fd) {
  struct rank r = {.sc = sc, .rank = rank, .out_fd = out_fd, .fd = -1};
  sp_client *c = NULL;
  int rc;
  r.rep.export_rc = 1; /* not reached */
  if (build_storage(&r) < 0) {
    failf(&r, "building the storage: %s", strerror(errno));
    goto report;
  }
  if ((rc = sp_connect(socket, &c)) < 0) {
    failf(&r, "connect: %s", sp_strerror(rc));
    goto report;
  }
  sp_ticket ticket;
  if (rank == 0) {
    if ((rc = sp_job_create(c, sc->world, &ticket)) < 0) {
      failf(&r, "job_create: %s", sp_strerror(rc));
      goto report;
    }
    write_msg(out_fd, 'T', &ticket, sizeof ticket);
  } else if (read_full(in_fd, &ticket, sizeof ticket, WAIT_MS) < 0) {
    failf(&r, "no ticket");
    goto report;
  }
  if ((rc = sp_job_join(c, &ticket, rank, sc->world, "cpu")) < 0) {
    failf(&r, "join: %s: %s", sp_strerror(rc), sp_last_message(c));
    goto report;
  }
  if ((rc = register_all(&r, c)) < 0) {
    failf(&r, "register: %s: %s", sp_strerror(rc), sp_last_message(c));
    goto report;
  }
  if (sc->fault == KILL_WAITING && rank == sc->victim) {
    /* Registered; now waits to be killed. */
    char go;
    write_msg(out_fd, 'P', NULL, 0);
    read_full(in_fd, &go, 1, WAIT_MS);
    failf(&r, "the victim was not killed");
    goto report;
  }
  struct progress_ctx pc = {.r = &r};
  sp_export_opts eo = {.max_keys = sc->max_keys, .timeout_ms = 10000,
                       .progress = on_progress, .progress_arg = &pc};
  sp_group group = {0, sc->group};
  if (sc->group) {
    while (sc->group[group.nkeys])
      group.nkeys++;
    eo.ngroups = 1;
    eo.groups = &group;
  }
  /* Each export of the job is verified afresh; the job, its members and
   * registrations stay between them. */
  for (uint32_t e = 0; e < (sc->exports ? sc->exports : 1); e++) {
    sp_owned_set *set = NULL;
    memset(r.owned, 0, sc->nkeys);
    r.rep.export_rc = sp_export(c, &eo, &set);
    snprintf(r.rep.message, sizeof r.rep.message, "%s", sp_last_message(c));
    if (r.rep.export_rc < 0)
      goto report;
    verify(&r, set);
    if ((rc = sp_release(c, set)) < 0)
      failf(&r, "release: %s", sp_strerror(rc));
    if (memcmp(r.copy, r.storage, r.len) != 0)
      failf(&r, "registered memory changed during the export");
  }
  if ((rc = sp_job_leave(c)) < 0)
    failf(&r, "leave: %s", sp_strerror(rc));
report:
  /* The test process reads nkeys bytes of ownership after the report. */
  if (!r.owned)
    r.owned = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  write_msg(out_fd, 'R', &r.rep, sizeof r.rep);
  write_msg(out_fd, 'O', r.owned, r.owned ? sc->nkeys : 0);
  sp_close(c);
  _exit(0);
}

/* ---- the test process ---- */

struct world {
  pid_t pid[MAXR];
  int in[MAXR];  /* the test's write end of each rank's input */
  int out[MAXR]; /* the test's read end of each rank's output */
  struct report rep[MAXR];
  uint8_t *owned[MAXR];
  bool reported[MAXR];
};

static void world_start(struct world *w, const struct scenario *sc,
                        const char *socket) {
  memset(w, 0, sizeof *w);
  for (uint32_t i = 0; i < sc->world; i++) {
    int in[2], out[2];
    ck_assert_int_eq(pipe2(in, O_CLOEXEC), 0);
    ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
      close(in[1]);
      close(out[0]);
      for (uint32_t j = 0; j < i; j++) {
        close(w->in[j]);
        close(w->out[j]);
      }
      rank_main(sc, socket, i, in[0], out[1]);
    }
    close(in[0]);
    close(out[1]);
    w->pid[i] = pid;
    w->in[i] = in[1];
    w->out[i] = out[0];
  }
  char type;
  sp_ticket ticket;
  ck_assert_int_eq(read_full(w->out[0], &type, 1, WAIT_MS), 0);
  ck_assert_msg(type == 'T', "rank 0 sent '%c' before a ticket", type);
  ck_assert_int_eq(read_full(w->out[0], &ticket, sizeof ticket, WAIT_MS), 0);
  for (uint32_t i = 1; i < sc->world; i++)
    ck_assert_int_eq(write(w->in[i], &ticket, sizeof ticket),
                     (ssize_t)sizeof ticket);
}

/* The next message of rank i is 'P': its export request reached the
 * daemon (or, for a victim waiting to be killed, it registered). */
static void expect_progress(struct world *w, uint32_t i) {
  char type;
  ck_assert_int_eq(read_full(w->out[i], &type, 1, WAIT_MS), 0);
  ck_assert_msg(type == 'P', "rank %u sent '%c', not progress", i, type);
}

static void read_report(struct world *w, const struct scenario *sc,
                        uint32_t i) {
  char type;
  for (;;) {
    int rc = read_full(w->out[i], &type, 1, WAIT_MS);
    ck_assert_msg(rc == 0, "rank %u sent no report: %s", i, sp_strerror(rc));
    if (type != 'P')
      break;
  }
  ck_assert_int_eq(type, 'R');
  ck_assert_int_eq(read_full(w->out[i], &w->rep[i], sizeof w->rep[i], WAIT_MS),
                   0);
  w->owned[i] = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  ck_assert_int_eq(read_full(w->out[i], &type, 1, WAIT_MS), 0);
  ck_assert_int_eq(type, 'O');
  ck_assert_int_eq(read_full(w->out[i], w->owned[i], sc->nkeys, WAIT_MS), 0);
  w->reported[i] = true;
}

static void world_finish(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++) {
    if (!w->reported[i] && w->pid[i] > 0 &&
        !(sc->fault != NO_FAULT && i == sc->victim))
      read_report(w, sc, i);
    close(w->in[i]);
    close(w->out[i]);
    if (w->pid[i] > 0) {
      int st = sp_test_wait(w->pid[i], WAIT_MS);
      if (st == SP_ETIMEOUT) {
        kill(w->pid[i], SIGKILL);
        sp_test_wait(w->pid[i], WAIT_MS);
      }
    }
  }
}

static void world_free(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++)
    free(w->owned[i]);
}

/* Every rank exported, passed its checks, and every key has one owner. */
static void assert_exported(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++) {
    ck_assert_msg(w->rep[i].failure[0] == '\0', "rank %u: %s", i,
                  w->rep[i].failure);
    ck_assert_msg(w->rep[i].export_rc == 0, "rank %u: export: %s: %s", i,
                  sp_strerror(w->rep[i].export_rc), w->rep[i].message);
  }
  for (size_t k = 0; k < sc->nkeys; k++) {
    int owners = 0;
    for (uint32_t i = 0; i < sc->world; i++)
      owners += w->owned[i][k];
    ck_assert_msg(owners == 1, "\"%s\" has %d owners", sc->keys[k].name,
                  owners);
  }
}

static uint32_t owner_of(const struct world *w, const struct scenario *sc,
                         const char *name) {
  for (size_t k = 0; k < sc->nkeys; k++)
    if (strcmp(sc->keys[k].name, name) == 0)
      for (uint32_t i = 0; i < sc->world; i++)
        if (w->owned[i][k])
          return i;
  return UINT32_MAX;
}

static struct sp_test_daemon daemon_;

static void start(void) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

static void run(const struct scenario *sc, struct world *w) {
  world_start(w, sc, daemon_.socket);
  world_finish(w, sc);
}

/* ---- the mixed model ---- */

#define K(...) ((struct tkey){__VA_ARGS__})

static struct tkey mixed_keys[] = {
    /* uneven rows, a rank with none */
    K(.name = "emb", .kind = SHARD0, .dtype = "bfloat16", .es = 2, .ndim = 2,
      .shape = {10, 6}, .parts = {3, 0, 5, 2}),
    /* no elements at all */
    K(.name = "empty", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {0, 5}, .parts = {0, 0, 0, 0}),
    K(.name = "w.f32", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {7, 3}, .parts = {1, 2, 3, 1}),
    /* every row on one rank: identity when that rank owns it */
    K(.name = "w.i16", .kind = SHARD0, .dtype = "int16", .es = 2, .ndim = 1,
      .shape = {9}, .parts = {0, 0, 9, 0}),
    K(.name = "norm", .kind = REPLICATED, .dtype = "float32", .es = 4,
      .ndim = 1, .shape = {6}),
    K(.name = "bias", .kind = PLAIN, .dtype = "bfloat16", .es = 2, .ndim = 1,
      .shape = {5}),
    K(.name = "expert.0", .kind = EXPERT, .dtype = "bfloat16", .es = 2,
      .ndim = 2, .shape = {4, 6}, .expert = 2),
    K(.name = "expert.1", .kind = EXPERT, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {3, 3}, .expert = 1),
    /* a column split: each rank holds columns as one affine piece */
    K(.name = "cols", .kind = AFFINE_COLS, .dtype = "float32", .es = 4,
      .ndim = 2, .shape = {4, 10}, .parts = {3, 2, 4, 1}),
    K(.name = "tied.a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}),
    K(.name = "tied.b", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}, .tie = 9 + 1),
    K(.name = "grp.x", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {6, 2}, .parts = {2, 1, 1, 2}),
    K(.name = "grp.y", .kind = REPLICATED, .dtype = "bfloat16", .es = 2,
      .ndim = 2, .shape = {5, 3}),
    K(.name = "scalar", .kind = PLAIN, .dtype = "float32", .es = 4, .ndim = 0),
};

static const char *const mixed_group[] = {"grp.x", "grp.y", NULL};

START_TEST(mixed_model_exports_exactly) {
  struct scenario sc = {.world = 4,
                        .nkeys = sizeof mixed_keys / sizeof mixed_keys[0],
                        .keys = mixed_keys, .group = mixed_group};
  struct world w;
  run(&sc, &w);
  assert_exported(&w, &sc);
  /* Tied weights and a together-group each land on one owner. */
  ck_assert_uint_eq(owner_of(&w, &sc, "tied.a"), owner_of(&w, &sc, "tied.b"));
  ck_assert_uint_eq(owner_of(&w, &sc, "grp.x"), owner_of(&w, &sc, "grp.y"));
  /* Experts stay where they are. */
  ck_assert_uint_eq(owner_of(&w, &sc, "expert.0"), 2);
  ck_assert_uint_eq(owner_of(&w, &sc, "expert.1"), 1);
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].progress_frames, 1);
  world_free(&w, &sc);
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
  assert_exported(&w, &sc);
  world_free(&w, &sc);
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
  assert_exported(&w, &sc);
  /* Default max_keys is 4096: at least two rounds. */
  for (uint32_t i = 0; i < sc.world; i++)
    ck_assert_uint_ge(w.rep[i].max_rounds, 2);
  world_free(&w, &sc);
  free(keys);
  free(names);
}
END_TEST

/* ---- refusals ---- */

static struct tkey refusal_keys[] = {
    K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .parts = {2, 2, 2, 2}),
    K(.name = "b", .kind = REPLICATED, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}),
    K(.name = "e", .kind = EXPERT, .dtype = "float32", .es = 4, .ndim = 2,
      .shape = {8, 4}, .expert = 0),
};

static sp_tensor_desc *desc(sp_tensor_desc *t, size_t n, const char *key) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].key, key) == 0)
      return &t[i];
  return NULL;
}

static void drop_b_on_3(const struct scenario *sc, uint32_t rank,
                        sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank != 3)
    return;
  sp_tensor_desc *b = desc(t, *n, "b");
  *b = t[--*n];
}

static void int32_b_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank == 3)
    desc(t, *n, "b")->dtype = "int32";
}

static void short_a_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank == 3)
    desc(t, *n, "a")->shape[0] = 1;
}

/* Rank 1 also claims expert "e", pointing at its copy of "b". */
static void expert_on_1_too(const struct scenario *sc, uint32_t rank,
                            sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank != 1)
    return;
  t[*n] = *desc(t, *n, "b");
  t[*n].key = "e";
  t[*n].placement = SP_PLACEMENT_EXPERT;
  ++*n;
}

static const struct {
  tweak_fn *tweak;
  int code;
} refusals[] = {
    {drop_b_on_3, SP_EKEYSET},
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
  world_free(&w, &sc);

  /* The daemon serves the next job. */
  struct tkey keys[2] = {refusal_keys[0], refusal_keys[1]};
  keys[0].parts[0] = keys[0].parts[1] = 4;
  struct scenario good = {.world = 2, .nkeys = 2, .keys = keys};
  run(&good, &w);
  assert_exported(&w, &good);
  world_free(&w, &good);
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
  assert_exported(&w, &sc);
  world_free(&w, &sc);
}

/* Ranks 0-2 asked for the export and wait for rank 3, which dies. */
START_TEST(rank_killed_while_the_others_wait) {
  struct scenario sc = {.world = 4, .nkeys = 2, .keys = fault_keys,
                        .fault = KILL_WAITING, .victim = 3};
  struct world w;
  world_start(&w, &sc, daemon_.socket);
  for (uint32_t i = 0; i < sc.world; i++)
    expect_progress(&w, i);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ck_assert_int_eq(kill(w.pid[3], SIGKILL), 0);
  for (uint32_t i = 0; i < 3; i++)
    read_report(&w, &sc, i);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  world_finish(&w, &sc);
  assert_rank_lost(&w, &sc);
  /* Well within the export's timeout (10 s): the close is noticed. */
  ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 10);
  world_free(&w, &sc);
  next_job_is_served();
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
  world_free(&w, &sc);
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
  sp_msgbuf_begin(&mb, "join", 2, 4);
  sp_pack_str(&mb.pk, "ticket");
  sp_pack_bin(&mb.pk, t.bytes, t.len);
  sp_pack_kv_u64(&mb.pk, "rank", 0);
  sp_pack_kv_u64(&mb.pk, "world", world);
  sp_pack_kv_str(&mb.pk, "device", "cpu");
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
  sp_msgbuf_begin(&mb, "release", 20, 1);
  sp_pack_kv_u64(&mb.pk, "export_id", 987654321);
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
  suite_add_tcase(s, refuse);
  TCase *faults = tcase_create("faults");
  tcase_add_checked_fixture(faults, start, stop);
  tcase_set_timeout(faults, 60);
  tcase_add_test(faults, rank_killed_while_the_others_wait);
  suite_add_tcase(s, faults);
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
