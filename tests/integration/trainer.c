/*
 * trainer.c - trainer processes for export tests; see trainer.h.
 */
#include "tests/integration/trainer.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/integration/harness.h"
#include "tests/integration/model.h"
#include "tests/integration/rankpipe.h"

#define SID 1

static int64_t ncols(const struct tkey *k) {
  return k->ndim == 2 ? k->shape[1] : 1;
}

static bool holds(const struct tkey *k, uint32_t rank) {
  return k->kind != EXPERT || k->expert == rank;
}

/* ---- one rank ---- */

struct holding {
  bool held;
  int64_t shape[2];
  int64_t row_stride; /* elements from one row to the next */
  uint64_t byte_off;
  uint64_t nbytes;
};

struct rank {
  const struct scenario *sc;
  uint32_t rank;
  int in_fd, out_fd;
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

/* The block of an AFFINE_PAIRS key that rank holds. */
static uint32_t pair_block(const struct scenario *sc, uint32_t rank) {
  return rank % (sc->world / 2);
}

/* The rank's holding of key i: its shape. */
static void holding_shape(const struct scenario *sc, const struct tkey *k,
                          uint32_t rank, int64_t *shape) {
  shape[0] = k->shape[0];
  shape[1] = k->shape[1];
  if (k->kind == AFFINE_MAP)
    shape[0] = k->layout->numel[rank];
  else if (k->kind == SHARD0)
    shape[0] = k->parts[rank];
  else if (k->kind == AFFINE_COLS)
    shape[1] = k->parts[rank];
  else if (k->kind == AFFINE_PAIRS)
    shape[0] = k->parts[pair_block(sc, rank)];
}

/* Original flat index of the holding's element (row, col). */
static uint64_t source_index(const struct scenario *sc, const struct tkey *k,
                             uint32_t rank, int64_t row, int64_t col) {
  if (k->kind == SHARD0)
    return (uint64_t)((model_rows_before(k->parts, rank) + row) * ncols(k) + col);
  if (k->kind == AFFINE_COLS)
    return (uint64_t)(row * k->shape[1] + model_rows_before(k->parts, rank) + col);
  if (k->kind == AFFINE_PAIRS)
    return (uint64_t)((model_rows_before(k->parts, pair_block(sc, rank)) + row) *
                          ncols(k) +
                      col);
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
    holding_shape(sc, k, r->rank, h->shape);
    int64_t cols = k->ndim == 2 && k->kind != AFFINE_MAP ? h->shape[1] : 1;
    h->row_stride = cols + (k->kind == SHARD0 && k->ndim == 2 ? k->pad : 0);
    int64_t n = k->ndim == 0 ? 1 : h->shape[0] * h->row_stride;
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
    if (k->kind == AFFINE_MAP) {
      tlayout_fill(k->layout, r->rank, k->name, k->es,
                   r->storage + h->byte_off);
      continue;
    }
    int64_t rows = k->ndim == 0 ? 1 : h->shape[0];
    int64_t cols = k->ndim == 2 ? h->shape[1] : 1;
    for (int64_t y = 0; y < rows; y++)
      for (int64_t x = 0; x < cols; x++)
        model_element(k->name, source_index(sc, k, r->rank, y, x), k->es,
                      r->storage + h->byte_off +
                          (uint64_t)(y * h->row_stride + x) * k->es);
    if (k->kind == AFFINE_PAIRS && sc->corrupt == r->rank + 1 && rows > 0)
      r->storage[h->byte_off] ^= 0xff;
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
  case AFFINE_PAIRS:
  case AFFINE_MAP:
    return SP_PLACEMENT_AFFINE;
  }
  return 0;
}

/* One piece per rank: its columns of the full tensor, or its block of rows
 * (held by a pair of ranks). */
static sp_piece *pieces_of(const struct scenario *sc, const struct tkey *k,
                           uint32_t rank, uint32_t *holders) {
  sp_piece *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  if (k->kind == AFFINE_COLS) {
    int64_t w = k->parts[rank];
    holders[0] = rank;
    *p = (sp_piece){.ndim = 2, .shape = {k->shape[0], w},
                    .src_stride = {w, 1},
                    .dst_offset = model_rows_before(k->parts, rank),
                    .dst_stride = {k->shape[1], 1}, .nholders = 1,
                    .holders = holders};
    return p;
  }
  uint32_t b = pair_block(sc, rank);
  holders[0] = b;
  holders[1] = b + sc->world / 2;
  *p = (sp_piece){.ndim = 2, .shape = {k->parts[b], k->shape[1]},
                  .src_stride = {k->shape[1], 1},
                  .dst_offset = model_rows_before(k->parts, b) * k->shape[1],
                  .dst_stride = {k->shape[1], 1}, .nholders = 2,
                  .holders = holders};
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
  uint32_t(*holders)[2] = calloc(sc->nkeys, sizeof *holders);
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
      d->stride[0] = h->row_stride;
      d->stride[1] = 1;
    } else if (k->ndim == 1) {
      d->stride[0] = 1;
    }
    if (k->kind == AFFINE_COLS || k->kind == AFFINE_PAIRS) {
      pieces[i] = pieces_of(sc, k, r->rank, holders[i]);
      d->npieces = 1;
      d->pieces = pieces[i];
    } else if (k->kind == AFFINE_MAP) {
      /* The shard is one run of elements; the pieces say what it holds. */
      d->ndim = 1;
      d->shape[1] = d->stride[1] = 0;
      d->npieces = k->layout->npieces[r->rank];
      d->pieces = k->layout->pieces[r->rank];
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
        model_element(orig->name, (uint64_t)(y * cols + x), orig->es, want);
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
      if (find(sc, set->tensors[j].key, &leader) &&
          leader == (size_t)k->tie - 1 &&
          set->tensors[j].data != set->tensors[i].data)
        failf(r, "tied \"%s\" and \"%s\" have two buffers",
              set->tensors[i].key, set->tensors[j].key);
  }
}

/* Changes the first byte of this rank's copy of sc->corrupt_key when the
 * scenario says so, in the registered memory (the daemon sees it at the
 * next export) and in the copy the rank checks it against. */
static void corrupt_key(struct rank *r) {
  const struct scenario *sc = r->sc;
  size_t i;
  if (sc->corrupt_key == NULL || !(sc->corrupt_ranks & (1u << r->rank)) ||
      find(sc, sc->corrupt_key, &i) == NULL || !r->h[i].held ||
      r->h[i].nbytes == 0)
    return;
  r->storage[r->h[i].byte_off] ^= 0x5a;
  r->copy[r->h[i].byte_off] ^= 0x5a;
}

struct progress_ctx {
  struct rank *r;
  bool told, told_moving;
};

static void on_progress(const sp_progress *p, void *arg) {
  struct progress_ctx *ctx = arg;
  struct rank *r = ctx->r;
  r->rep.progress_frames++;
  if (p->rounds > r->rep.max_rounds)
    r->rep.max_rounds = p->rounds;
  /* The test process learns that this rank's request reached the daemon,
   * and when data moves. */
  if (!ctx->told) {
    ctx->told = true;
    rankpipe_write(r->out_fd, 'P', NULL, 0);
  }
  if (!ctx->told_moving && strcmp(p->phase, "moving") == 0) {
    ctx->told_moving = true;
    rankpipe_write(r->out_fd, 'M', NULL, 0);
  }
  if (r->sc->fault == KILL_MOVING && r->rank == r->sc->victim &&
      strcmp(p->phase, "moving") == 0)
    raise(SIGKILL);
}

/* Joins the job again as the same rank on c (after its daemon has seen
 * it go: until then the root answers that the rank is joined) and
 * registers anew. */
static int join_again(struct rank *r, sp_client *c, const sp_ticket *ticket) {
  int rc;
  for (int tries = 0; tries < 500; tries++) {
    rc = sp_job_join(c, ticket, r->rank, r->sc->world, "cpu");
    if (rc != SP_ERANK)
      break;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  if (rc < 0)
    return rc;
  rc = register_all(r, c);
  return rc < 0 ? rc : 0;
}

/* The victim's part after its first export (enum fault): 1 when it is
 * done with the job (it reports, then closes), 0 to go on (on *c, which a
 * rank that joins elsewhere replaces), or a code. */
static int part_after_first(struct rank *r, sp_client **c,
                            const sp_ticket *ticket) {
  const struct scenario *sc = r->sc;
  sp_client *other;
  int rc;
  switch (sc->fault) {
  case CLOSE_AFTER_FIRST:
    return 1;
  case LEAVE_AFTER_FIRST:
    rc = sp_job_leave(*c);
    return rc < 0 ? rc : 1;
  case REJOIN_AFTER_FIRST:
    if ((rc = sp_job_leave(*c)) < 0)
      return rc;
    return join_again(r, *c, ticket);
  case REJOIN_ELSEWHERE_AFTER_FIRST:
    if ((rc = sp_job_leave(*c)) < 0)
      return rc;
    if ((rc = sp_connect(sc->rejoin_socket, &other)) < 0)
      return rc;
    sp_close(*c);
    *c = other;
    return join_again(r, *c, ticket);
  default:
    return 0;
  }
}

static void rank_main(const struct scenario *sc, const char *socket,
                      uint32_t rank, int in_fd, int out_fd) {
  struct rank r = {.sc = sc, .rank = rank, .in_fd = in_fd, .out_fd = out_fd,
                   .fd = -1};
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
  if (rank == 0 && sc->ticket != NULL) {
    ticket = *sc->ticket;
    rankpipe_write(out_fd, 'T', &ticket, sizeof ticket);
  } else if (rank == 0) {
    if ((rc = sp_job_create(c, sc->world, &ticket)) < 0) {
      failf(&r, "job_create: %s", sp_strerror(rc));
      goto report;
    }
    rankpipe_write(out_fd, 'T', &ticket, sizeof ticket);
  } else if (rankpipe_read(in_fd, &ticket, sizeof ticket, TRAINER_WAIT_MS) < 0) {
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
    rankpipe_write(out_fd, 'P', NULL, 0);
    rankpipe_read(in_fd, &go, 1, TRAINER_WAIT_MS);
    failf(&r, "the victim was not killed");
    goto report;
  }
  struct progress_ctx pc = {.r = &r};
  sp_export_opts eo = {.max_keys = sc->max_keys,
                       .timeout_ms = sc->timeout_ms ? sc->timeout_ms : 10000,
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
  uint32_t nexports = sc->exports ? sc->exports : 1;
  for (uint32_t e = 0; e < nexports; e++) {
    if (e == sc->corrupt_export)
      corrupt_key(&r);
    sp_owned_set *set = NULL;
    if (sc->gate && e + 1 == nexports) {
      char go;
      rankpipe_write(out_fd, 'G', NULL, 0);
      rankpipe_read(in_fd, &go, 1, TRAINER_WAIT_MS);
    }
    memset(r.owned, 0, sc->nkeys);
    r.rep.export_rc = sp_export(c, &eo, &set);
    snprintf(r.rep.message, sizeof r.rep.message, "%s", sp_last_message(c));
    if (r.rep.export_rc < 0 && sc->on_after_failure && r.rep.first_rc == 0 &&
        e + 1 < nexports) {
      r.rep.first_rc = r.rep.export_rc;
      snprintf(r.rep.first_message, sizeof r.rep.first_message, "%s",
               r.rep.message);
      continue;
    }
    if (r.rep.export_rc < 0)
      goto report;
    verify(&r, set);
    if ((rc = sp_release(c, set)) < 0)
      failf(&r, "release: %s", sp_strerror(rc));
    if (memcmp(r.copy, r.storage, r.len) != 0)
      failf(&r, "registered memory changed during the export");
    if (e == 0 && nexports > 1 && rank == sc->victim &&
        (rc = part_after_first(&r, &c, &ticket)) != 0) {
      if (rc < 0)
        failf(&r, "after the first export: %s: %s", sp_strerror(rc),
              sp_last_message(c));
      goto report;
    }
  }
  if (sc->hold) {
    char go;
    rankpipe_write(out_fd, 'H', NULL, 0);
    rankpipe_read(in_fd, &go, 1, TRAINER_WAIT_MS);
  }
  if ((rc = sp_job_leave(c)) < 0)
    failf(&r, "leave: %s", sp_strerror(rc));
report:
  /* The test process reads nkeys bytes of ownership after the report. */
  if (!r.owned)
    r.owned = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  rankpipe_write(out_fd, 'R', &r.rep, sizeof r.rep);
  rankpipe_write(out_fd, 'O', r.owned, r.owned ? sc->nkeys : 0);
  sp_close(c);
  _exit(0);
}

/* ---- the test process ---- */

void trainer_start(struct world *w, const struct scenario *sc,
                   const char *const *sockets) {
  memset(w, 0, sizeof *w);
  ck_assert_uint_le(sc->world, TRAINER_MAXR);
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
      rank_main(sc, sockets[i], i, in[0], out[1]);
    }
    close(in[0]);
    close(out[1]);
    w->pid[i] = pid;
    w->in[i] = in[1];
    w->out[i] = out[0];
  }
  char type;
  sp_ticket ticket;
  ck_assert_int_eq(rankpipe_read(w->out[0], &type, 1, TRAINER_WAIT_MS), 0);
  ck_assert_msg(type == 'T', "rank 0 sent '%c' before a ticket", type);
  ck_assert_int_eq(rankpipe_read(w->out[0], &ticket, sizeof ticket,
                             TRAINER_WAIT_MS),
                   0);
  for (uint32_t i = 1; i < sc->world; i++)
    ck_assert_int_eq(write(w->in[i], &ticket, sizeof ticket),
                     (ssize_t)sizeof ticket);
}

/* The next message of rank i that is not a progress note ('P', 'M'), or
 * that note itself when want is one. */
static char next_msg(struct world *w, uint32_t i, char want) {
  char type;
  for (;;) {
    int rc = rankpipe_read(w->out[i], &type, 1, TRAINER_WAIT_MS);
    ck_assert_msg(rc == 0, "rank %u sent nothing: %s", i, sp_strerror(rc));
    if (type == 'M')
      w->moving[i] = true;
    if (type == want || (type != 'P' && type != 'M'))
      return type;
  }
}

void trainer_expect_progress(struct world *w, uint32_t i) {
  char type;
  ck_assert_int_eq(rankpipe_read(w->out[i], &type, 1, TRAINER_WAIT_MS), 0);
  ck_assert_msg(type == 'P', "rank %u sent '%c', not progress", i, type);
}

void trainer_wait_moving(struct world *w, uint32_t i) {
  if (w->moving[i])
    return;
  char type = next_msg(w, i, 'M');
  ck_assert_msg(type == 'M', "rank %u sent '%c' before moving", i, type);
}

void trainer_wait_held(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++) {
    char type = next_msg(w, i, 'H');
    ck_assert_msg(type == 'H', "rank %u sent '%c', not held", i, type);
  }
}

void trainer_release(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++)
    ck_assert_int_eq(write(w->in[i], "g", 1), 1);
}

void trainer_wait_gate(struct world *w, const struct scenario *sc,
                       uint32_t skip) {
  for (uint32_t i = 0; i < sc->world; i++) {
    if (i == skip)
      continue;
    char type = next_msg(w, i, 'G');
    ck_assert_msg(type == 'G', "rank %u sent '%c', not at the gate", i, type);
  }
}

void trainer_open_gate(struct world *w, const struct scenario *sc,
                       uint32_t skip) {
  for (uint32_t i = 0; i < sc->world; i++)
    if (i != skip)
      ck_assert_int_eq(write(w->in[i], "g", 1), 1);
}

void trainer_wait_joined(const char *socket, uint32_t joined) {
  uint32_t now = UINT32_MAX;
  for (int tries = 0; tries < TRAINER_WAIT_MS / 10 && now != joined;
       tries++) {
    sp_client *c;
    sp_status_info *st;
    ck_assert_int_eq(sp_connect(socket, &c), 0);
    ck_assert_int_eq(sp_status(c, &st), 0);
    ck_assert_uint_eq(st->njobs, 1);
    now = st->jobs[0].joined;
    sp_status_free(st);
    sp_close(c);
    if (now != joined) {
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  ck_assert_msg(now == joined, "the daemon counts %u joined ranks, not %u",
                now, joined);
}

void trainer_read_report(struct world *w, const struct scenario *sc,
                         uint32_t i) {
  char type = next_msg(w, i, 'R');
  ck_assert_int_eq(type, 'R');
  ck_assert_int_eq(rankpipe_read(w->out[i], &w->rep[i], sizeof w->rep[i],
                             TRAINER_WAIT_MS),
                   0);
  w->owned[i] = calloc(sc->nkeys ? sc->nkeys : 1, 1);
  ck_assert_int_eq(rankpipe_read(w->out[i], &type, 1, TRAINER_WAIT_MS), 0);
  ck_assert_int_eq(type, 'O');
  ck_assert_int_eq(rankpipe_read(w->out[i], w->owned[i], sc->nkeys,
                             TRAINER_WAIT_MS),
                   0);
  w->reported[i] = true;
}

void trainer_finish(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++) {
    bool killed = (sc->fault == KILL_WAITING || sc->fault == KILL_MOVING) &&
                  i == sc->victim;
    if (!w->reported[i] && w->pid[i] > 0 && !killed)
      trainer_read_report(w, sc, i);
    close(w->in[i]);
    close(w->out[i]);
    if (w->pid[i] > 0) {
      int st = sp_test_wait(w->pid[i], TRAINER_WAIT_MS);
      if (st == SP_ETIMEOUT) {
        kill(w->pid[i], SIGKILL);
        sp_test_wait(w->pid[i], TRAINER_WAIT_MS);
      }
    }
  }
}

void trainer_free(struct world *w, const struct scenario *sc) {
  for (uint32_t i = 0; i < sc->world; i++)
    free(w->owned[i]);
}

void trainer_assert_exported(struct world *w, const struct scenario *sc) {
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

uint32_t trainer_owner_of(const struct world *w, const struct scenario *sc,
                          const char *name) {
  for (size_t k = 0; k < sc->nkeys; k++)
    if (strcmp(sc->keys[k].name, name) == 0)
      for (uint32_t i = 0; i < sc->world; i++)
        if (w->owned[i][k])
          return i;
  return UINT32_MAX;
}

sp_tensor_desc *trainer_desc(sp_tensor_desc *t, size_t n, const char *key) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(t[i].key, key) == 0)
      return &t[i];
  return NULL;
}

void trainer_victim_out_of_bounds(const struct scenario *sc, uint32_t rank,
                                  sp_tensor_desc *t, size_t *n) {
  if (rank == sc->victim)
    trainer_desc(t, *n, "a")->offset += 1 << 20;
}

void trainer_drop_b_on_3(const struct scenario *sc, uint32_t rank,
                         sp_tensor_desc *t, size_t *n) {
  (void)sc;
  if (rank != 3)
    return;
  sp_tensor_desc *b = trainer_desc(t, *n, "b");
  *b = t[--*n];
}
