/*
 * stage.c - the large frames of every connection, staged daemon-wide; see
 * stage.h and docs/operations.md, "Large frames".
 *
 * A large frame is decoded on a worker and registered in steps on the loop
 * (conn.c).  Per connection that is one frame at a time, but the daemon
 * serves max_clients connections, and a decoded registration takes about
 * twelve times the bytes of its frame until it is served: 32 clients
 * sending one 6 MiB frame each took the daemon from 7 MiB to 2.4 GiB.  And
 * the steps of every connection came back to the loop together, each
 * through the thread pool, so that one iteration of the loop ran as many
 * steps as connections were registering, and held the others for seconds.
 *
 * So the frames share two things here.  Their bytes: frames are taken in,
 * to be decoded and served, while the bytes of those taken in stay within
 * max_staged_bytes, in the order they arrived; the others wait as they
 * came, undecoded, their connections not read.  A frame larger than the
 * bound is taken in alone, so that every frame max_frame allows is served.
 * And the loop: the turns of the frames taken in wait in one queue, and
 * the loop serves one of them per iteration (an idle handle, which makes
 * the loop poll without waiting in between, so every other client is
 * served between two turns).
 *
 * And the CPUs: frames are decoded on workers at most one fewer at once
 * than the CPUs the daemon may run on (at least one), so that the loop
 * keeps a CPU of its own.  Decoding a frame takes a worker's whole CPU;
 * with as many decoding as the thread pool has threads, 32 clients sending
 * one 6 MiB frame each on two CPUs left the loop waiting for a CPU
 * nearly nine seconds of ten, and a status answer took up to 372 ms
 * (docs/benchmarks.md, "Many clients' large frames at once").
 */
#include <stdlib.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/server.h"
#include "daemon/stage.h"
#include "shardport.h"

struct stage {
  uv_idle_t idle;
  bool idle_on;
  bool closed;
  uint64_t bytes; /* of the frames taken in, until given back */
  unsigned decoding, max_decoding; /* frames taken in, not yet decoded */
  struct stage_item *waiting, *waiting_tail;
  struct stage_item *queued, *queued_tail;
};

static void push(struct stage_item **head, struct stage_item **tail,
                 struct stage_item *it) {
  it->next = NULL;
  it->prev = *tail;
  if (*tail != NULL)
    (*tail)->next = it;
  else
    *head = it;
  *tail = it;
}

static void unlink_item(struct stage_item **head, struct stage_item **tail,
                        struct stage_item *it) {
  if (it->prev != NULL)
    it->prev->next = it->next;
  else
    *head = it->next;
  if (it->next != NULL)
    it->next->prev = it->prev;
  else
    *tail = it->prev;
  it->prev = it->next = NULL;
}

int stage_init(struct server *srv) {
  struct stage *st = calloc(1, sizeof *st);
  if (st == NULL)
    return SP_ENOMEM;
  int rc = uv_idle_init(srv->loop, &st->idle);
  if (rc != 0) {
    free(st);
    log_msg(LOG_LEVEL_ERROR, "uv_idle_init: %s", uv_strerror(rc));
    return SP_EINTERNAL;
  }
  st->idle.data = srv;
  uint32_t cpus = server_cpus();
  st->max_decoding = cpus > 2 ? cpus - 1 : 1;
  srv->stage = st;
  return 0;
}

/* Whether a frame of bytes may be taken in now.  The bound may have been
 * lowered by a reload below what is taken in already. */
static bool fits(const struct server *srv, uint64_t bytes) {
  const struct stage *st = srv->stage;
  uint64_t cap = srv->cfg->max_staged_bytes;
  if (st->closed)
    return true;
  return st->decoding < st->max_decoding &&
         (st->bytes == 0 || (st->bytes <= cap && bytes <= cap - st->bytes));
}

static void take(struct server *srv, struct stage_item *it) {
  srv->stage->bytes += it->bytes;
  srv->stage->decoding++;
  it->where = STAGE_TAKEN;
  it->decoding = true;
}

/* Takes in the waiting items, in the order they came, while they fit. */
static void take_waiting(struct server *srv) {
  struct stage *st = srv->stage;
  while (st->waiting != NULL && fits(srv, st->waiting->bytes)) {
    struct stage_item *next = st->waiting;
    unlink_item(&st->waiting, &st->waiting_tail, next);
    take(srv, next);
    next->go(next);
  }
}

static void end_decoding(struct stage *st, struct stage_item *it) {
  if (it->decoding) {
    it->decoding = false;
    st->decoding--;
  }
}

bool stage_take(struct server *srv, struct stage_item *it, uint64_t bytes) {
  struct stage *st = srv->stage;
  it->bytes = bytes;
  if (st->waiting == NULL && fits(srv, bytes)) {
    take(srv, it);
    return true;
  }
  push(&st->waiting, &st->waiting_tail, it);
  it->where = STAGE_WAITING;
  return false;
}

static void on_idle(uv_idle_t *idle) {
  struct server *srv = idle->data;
  struct stage *st = srv->stage;
  struct stage_item *it = st->queued;
  if (it != NULL) {
    unlink_item(&st->queued, &st->queued_tail, it);
    it->where = STAGE_TAKEN;
    it->go(it);
  }
  if (st->queued == NULL && st->idle_on) {
    uv_idle_stop(&st->idle);
    st->idle_on = false;
  }
}

void stage_queue(struct server *srv, struct stage_item *it) {
  struct stage *st = srv->stage;
  if (st->closed) {
    it->go(it);
    return;
  }
  push(&st->queued, &st->queued_tail, it);
  it->where = STAGE_QUEUED;
  if (!st->idle_on) {
    uv_idle_start(&st->idle, on_idle);
    st->idle_on = true;
  }
}

void stage_remove(struct server *srv, struct stage_item *it) {
  struct stage *st = srv->stage;
  if (it->where == STAGE_WAITING)
    unlink_item(&st->waiting, &st->waiting_tail, it);
  else if (it->where == STAGE_QUEUED)
    unlink_item(&st->queued, &st->queued_tail, it);
  else
    return;
  it->where = it->where == STAGE_WAITING ? STAGE_NONE : STAGE_TAKEN;
}

void stage_decoded(struct server *srv, struct stage_item *it) {
  end_decoding(srv->stage, it);
  take_waiting(srv);
}

void stage_give_back(struct server *srv, struct stage_item *it) {
  struct stage *st = srv->stage;
  if (it->where != STAGE_TAKEN)
    return;
  st->bytes -= it->bytes;
  end_decoding(st, it);
  it->where = STAGE_NONE;
  take_waiting(srv);
}

void stage_bound_changed(struct server *srv) { take_waiting(srv); }

void stage_close(struct server *srv) {
  struct stage *st = srv->stage;
  if (st == NULL || st->closed)
    return;
  /* Every connection is ending: each staged frame hears it from its go
   * and is dropped, the waiting taken in first so that none is left.
   * Frames still on a worker come back to a closed stage, which takes
   * them in and calls them at once (they are dropped too). */
  st->closed = true;
  while (st->queued != NULL) {
    struct stage_item *it = st->queued;
    unlink_item(&st->queued, &st->queued_tail, it);
    it->where = STAGE_TAKEN;
    it->go(it);
  }
  while (st->waiting != NULL) {
    struct stage_item *it = st->waiting;
    unlink_item(&st->waiting, &st->waiting_tail, it);
    take(srv, it);
    it->go(it);
  }
  st->idle_on = false;
  uv_close((uv_handle_t *)&st->idle, NULL);
}

void stage_free(struct server *srv) {
  free(srv->stage);
  srv->stage = NULL;
}
