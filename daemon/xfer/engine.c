/*
 * engine.c - runs a plan's rounds: every move copied from its source rank's
 * read-only mapping into its owner's pool segment; see engine.h.
 *
 * The engine runs on its own thread so that the loop never waits on data
 * movement: it publishes the round and the bytes moved through atomics and
 * wakes the loop through the notify callback (a uv_async_send).
 *
 * Each round is cut into items that its copying threads take in turn: a
 * slice of whole dim-0 rows of one large move, a run of small whole moves
 * kept together, or, for a key with affine replicas, all of that key's
 * moves to its owner (replicas are compared with what an earlier holder
 * wrote, so they run in order on one thread, on the owner's node: moves
 * packed for another node are plain slices).  An item holds about a
 * quarter of the round's bytes per thread (between ENGINE_MIN_CHUNK and
 * ENGINE_CHUNK), so that every thread has work until the round's end and
 * a small move costs no more than its copy.  Threads look at the cancel
 * flag between items, so a lost rank stops an export within milliseconds.
 *
 * A fresh memfd page costs a fault and its zeroing on first write, more
 * than the copy into it, so the segments are made present in bulk by the
 * same threads (MADV_POPULATE_WRITE, or touching each page on kernels
 * without it): round 1's tensors before it starts, and each next round's
 * tensors as items after the current round's copies, so that threads done
 * with their copies prepare the next round while the others finish (across
 * nodes, before the exchange: it may receive into them ahead).  A
 * segment kept from its owner's earlier export (dst_warm) needs none of
 * that: its pages are present, every tensor is overwritten, and only the
 * bytes between and after the tensors are zeroed.
 *
 * Reading a trainer's mapping can fault: a trainer that truncates its memfd
 * after registering it turns the daemon's next read into SIGBUS.  Copying
 * threads work under the SIGBUS guard (thread.h), which turns that fault
 * into a failed export naming the rank and key instead of a dead daemon.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "daemon/xfer/copy.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/remote.h"
#include "daemon/xfer/replicas.h"
#include "daemon/xfer/thread.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* The most and the fewest bytes one item copies (or populates). */
#define ENGINE_CHUNK (32u << 20)
#define ENGINE_MIN_CHUNK (1u << 20)
#define ENGINE_ITEMS_PER_THREAD 4
#define ENGINE_MAX_THREADS 64

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

enum item_kind {
  ITEM_POPULATE, /* make addr[0..len) present */
  ITEM_GAPS,     /* zero a warm segment's bytes outside its tensors */
  ITEM_SLICE,    /* rows [row, row + rows) of one move */
  ITEM_MOVES,    /* nmoves whole moves */
  ITEM_REPLICAS  /* one key's nmoves moves to its owner, in order */
};

struct engine_item {
  enum item_kind kind;
  const struct plan_move *move; /* the slice's move, or a run's first */
  size_t nmoves;                /* ITEM_MOVES, ITEM_REPLICAS */
  int64_t row, rows;            /* ITEM_SLICE: dim-0 rows */
  uint8_t *addr;                /* ITEM_POPULATE */
  size_t len;
  uint32_t rank; /* ITEM_GAPS: the owner */
};

/* One copying thread's own state. */
struct worker {
  struct engine *e;
  const struct plan_move *current;
  uint8_t *seen; /* which elements of a replicated key are written */
  pthread_t thread;
};

/* The first failure of a run is its result; the others stop. */
static int engine_fail(struct engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int engine_fail(struct engine *e, int code, const char *fmt, ...) {
  pthread_mutex_lock(&e->fail_lock);
  if (e->rc == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->rc = code;
  }
  atomic_store(&e->failed, true);
  /* The exchange with other nodes watches cancel: it stops too. */
  atomic_store(&e->cancel, true);
  pthread_mutex_unlock(&e->fail_lock);
  return code;
}

static bool stopped(struct engine *e) {
  return atomic_load_explicit(&e->failed, memory_order_relaxed) ||
         atomic_load_explicit(&e->cancel, memory_order_relaxed);
}

/* Where a move's elements are read: the source rank's storage, or for a
 * move that arrived from another node, staging (remote.c: sv is then the
 * contiguous box). */
static const uint8_t *move_source(const struct engine *e,
                                  const struct plan_move *m, struct sp_view *sv,
                                  size_t esz) {
  if (e->remote != NULL) {
    const uint8_t *staged = remote_source(e->remote, m, sv);
    if (staged != NULL)
      return staged;
  }
  return e->src[m->src][m->storage].data + (size_t)sv->offset * esz;
}

/* Where a slice's first element is written: the owner's tensor, or for a
 * move packed to go to another node, staging (dr is then the contiguous
 * box). */
static uint8_t *move_dest(const struct engine *e, const struct plan_move *m,
                          struct plan_region *dr, size_t esz) {
  if (e->remote != NULL) {
    uint8_t *staged = remote_dest(e->remote, m, dr);
    if (staged != NULL)
      return staged;
  }
  return e->dst[m->dst] + e->key_offset[m->key] + (size_t)dr->offset * esz;
}

/* Copies count toward progress; bytes between nodes count as the exchange
 * moves them (remote.c), not when they are packed or unpacked. */
static void count_bytes(struct engine *e, const struct plan_move *m,
                        uint64_t n) {
  if (e->remote == NULL || e->plan->node[m->src] == e->plan->node[m->dst])
    atomic_fetch_add_explicit(&e->bytes_moved, n, memory_order_relaxed);
}

static uint8_t *key_base(const struct engine *e, const struct plan_move *m) {
  return e->dst[m->dst] + e->key_offset[m->key];
}

/* A replica writes the elements nobody wrote yet and compares the others:
 * replicas must agree byte for byte, and the first holder's bytes stand. */
static int copy_replica(struct worker *w, const struct plan_move *m,
                        const struct plan_move *first) {
  struct engine *e = w->e;
  const struct plan_key *key = &e->plan->keys[m->key];
  size_t esz = sp__dtype_size(key->dtype);
  struct sp_view sv;
  struct plan_region dr;
  plan_moves_regions(e->plan, m, &sv, &dr);
  const uint8_t *src = move_source(e, m, &sv, esz);
  int64_t t;
  if (!replicas_merge(key_base(e, m), w->seen, esz, src, sv.ndim, sv.shape,
                      sv.stride, &dr, &t)) {
    uint32_t earlier = m->src;
    for (const struct plan_move *p = first; p < m; p++) {
      struct sp_view pv;
      struct plan_region pr;
      if (!(p->flags & PLAN_MOVE_REPLICA))
        continue;
      plan_moves_regions(e->plan, p, &pv, &pr);
      if (replicas_region_contains(&pr, t)) {
        earlier = p->src;
        break;
      }
    }
    char msg[SP_ERRMSG_MAX + 1];
    return engine_fail(
        e, replicas_disagree(key, t, earlier, m->src, msg, sizeof msg), "%s",
        msg);
  }
  count_bytes(e, m, m->nbytes);
  return 0;
}

/* Rows [row, row + rows) of a single holder's box. */
static void copy_slice(struct worker *w, const struct plan_move *m, int64_t row,
                       int64_t rows) {
  struct engine *e = w->e;
  const struct plan_key *key = &e->plan->keys[m->key];
  size_t esz = sp__dtype_size(key->dtype);
  struct sp_view sv;
  struct plan_region dr;
  plan_moves_regions(e->plan, m, &sv, &dr);
  const uint8_t *src = move_source(e, m, &sv, esz);
  uint8_t *dst = move_dest(e, m, &dr, esz);
  if (sv.ndim == 0) {
    memcpy(dst, src, esz);
    count_bytes(e, m, esz);
    return;
  }
  struct xfer_box box = {.ndim = (int)sv.ndim, .elem_size = esz};
  for (uint32_t d = 0; d < sv.ndim; d++) {
    box.shape[d] = sv.shape[d];
    box.src_stride[d] = sv.stride[d];
    box.dst_stride[d] = dr.stride[d];
  }
  box.shape[0] = rows;
  uint64_t n = xfer_copy(dst + (size_t)(row * dr.stride[0]) * esz,
                         src + (size_t)(row * sv.stride[0]) * esz, &box);
  count_bytes(e, m, n);
}

static int64_t move_rows(const struct plan_move *m, const struct plan *plan) {
  struct sp_view sv;
  struct plan_region dr;
  plan_moves_regions(plan, m, &sv, &dr);
  return sv.ndim > 0 ? sv.shape[0] : 1;
}

static int run_replicas(struct worker *w, const struct engine_item *it) {
  const struct plan_key *key = &w->e->plan->keys[it->move->key];
  uint64_t numel = key->nbytes / sp__dtype_size(key->dtype);
  w->seen = calloc((size_t)(numel / 8 + 1), 1);
  if (w->seen == NULL)
    return engine_fail(w->e, SP_ENOMEM,
                       "out of memory for the replica record of key '%s'",
                       key->name);
  int rc = 0;
  for (size_t k = 0; k < it->nmoves && rc == 0 && !stopped(w->e); k++) {
    const struct plan_move *m = it->move + k;
    w->current = m;
    if (m->flags & PLAN_MOVE_REPLICA)
      rc = copy_replica(w, m, it->move);
    else
      copy_slice(w, m, 0, move_rows(m, w->e->plan));
  }
  free(w->seen);
  w->seen = NULL;
  return rc;
}

/* Says what a SIGBUS during the current move hit: the owner's segment (the
 * pool's memory ran out) or the source rank's storage. */
static void report_fault(struct worker *w, const void *fault) {
  struct engine *e = w->e;
  const struct plan_move *m = w->current;
  const uint8_t *addr = fault;
  if (m == NULL) {
    engine_fail(e, SP_EPOOL, "the pool's memory ran out while populating it");
    return;
  }
  const struct plan_key *key = &e->plan->keys[m->key];
  if (addr >= e->dst[m->dst] && addr < e->dst[m->dst] + e->dst_size[m->dst]) {
    engine_fail(e, SP_EPOOL,
                "the pool's memory ran out while assembling key '%s' for "
                "rank %u",
                key->name, m->dst);
    return;
  }
  if (e->src[m->src] == NULL) {
    /* Staging and the pool are the daemon's own: only the pool can run
     * out under a write. */
    engine_fail(e, SP_EPOOL,
                "the pool's memory ran out while assembling key '%s' for "
                "rank %u",
                key->name, m->dst);
    return;
  }
  engine_fail(e, SP_EBADFD,
              "rank %u's storage sid %u could not be read for key '%s' (was "
              "its file truncated after it was registered?)",
              m->src, e->src[m->src][m->storage].sid, key->name);
}

/* Kernels before 5.14 refuse MADV_POPULATE_WRITE (EINVAL): pages are then
 * touched one by one, once per page, by writing the zero they hold (only
 * fresh segments are populated, and only the whole pages of a range, so
 * that no page a copy may be writing is touched). */
static atomic_bool populate_unsupported;

static void populate(uint8_t *addr, size_t len) {
  if (!atomic_load_explicit(&populate_unsupported, memory_order_relaxed)) {
    if (madvise(addr, len, MADV_POPULATE_WRITE) == 0 || errno != EINVAL)
      return;
    atomic_store(&populate_unsupported, true);
  }
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < len; off += page)
    ((volatile uint8_t *)addr)[off] = 0;
}

/* Zeroes the bytes of rank's warm segment that no tensor of this export
 * covers: between the tensors (laid out in key order, publish.h) and after
 * the last one. */
static void zero_gaps(struct engine *e, uint32_t rank) {
  const struct plan *plan = e->plan;
  uint8_t *base = e->dst[rank];
  uint64_t at = 0;
  for (size_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    if (key->owner != rank ||
        (key->kind != PLAN_KEY_MOVE && key->kind != PLAN_KEY_EMPTY))
      continue;
    uint64_t off = e->key_offset[k];
    if (off > at)
      memset(base + at, 0, (size_t)(off - at));
    if (off + key->nbytes > at)
      at = off + key->nbytes;
  }
  if (e->dst_size[rank] > at)
    memset(base + at, 0, (size_t)(e->dst_size[rank] - at));
}

/* A copy ended: the round's last so far, unless another thread's ended
 * later. */
static void note_copy_end(struct engine *e) {
  uint64_t now = monotonic_ns();
  uint64_t seen = atomic_load_explicit(&e->copies_end_ns, memory_order_relaxed);
  while (seen < now && !atomic_compare_exchange_weak(&e->copies_end_ns, &seen,
                                                     now))
    ;
}

/* Takes the round's items until none is left or the run stops. */
static void take_items(void *arg) {
  struct worker *w = arg;
  struct engine *e = w->e;
  while (!stopped(e)) {
    size_t i = atomic_fetch_add(&e->next_item, 1);
    if (i >= e->nitems)
      break;
    const struct engine_item *it = &e->items[i];
    switch (it->kind) {
    case ITEM_POPULATE:
      w->current = NULL;
      populate(it->addr, it->len);
      atomic_fetch_add_explicit(&e->bytes_prepared, it->len,
                                memory_order_relaxed);
      break;
    case ITEM_GAPS:
      w->current = NULL;
      zero_gaps(e, it->rank);
      atomic_fetch_add_explicit(&e->bytes_prepared, e->dst_size[it->rank],
                                memory_order_relaxed);
      break;
    case ITEM_SLICE:
      w->current = it->move;
      copy_slice(w, it->move, it->row, it->rows);
      break;
    case ITEM_MOVES:
      for (size_t k = 0; k < it->nmoves; k++) {
        w->current = it->move + k;
        copy_slice(w, it->move + k, 0, move_rows(it->move + k, e->plan));
      }
      break;
    case ITEM_REPLICAS:
      run_replicas(w, it);
      break;
    }
    if (it->kind != ITEM_POPULATE && it->kind != ITEM_GAPS && e->remote != NULL)
      note_copy_end(e);
  }
}

/* The items under the SIGBUS guard: a fault ends this thread's part of the
 * round with the run failed. */
static void work(struct worker *w) {
  const void *fault = NULL;
  w->current = NULL;
  w->seen = NULL;
  if (xfer_guarded(take_items, w, &fault) == 0)
    return;
  free(w->seen);
  w->seen = NULL;
  report_fault(w, fault);
}

static void *worker_main(void *arg) {
  work(arg);
  return NULL;
}

/* Runs the items on e->threads threads, this one included.  alongside,
 * when set, runs on this thread first (the exchange with other nodes),
 * while at least one helper copies. */
static void run_items(struct engine *e, struct worker *workers,
                      void (*alongside)(struct engine *e)) {
  uint32_t helpers = 0;
  uint32_t want = e->threads - 1;
  if (alongside != NULL && want == 0)
    want = 1;
  size_t enough = alongside != NULL ? 0 : 1;
  atomic_store(&e->next_item, 0);
  for (uint32_t t = 1; t <= want && e->nitems > enough; t++) {
    workers[t] = (struct worker){.e = e};
    if (xfer_spawn(&workers[t].thread, worker_main, &workers[t]) != 0)
      break;
    helpers++;
  }
  workers[0] = (struct worker){.e = e};
  if (alongside != NULL)
    alongside(e);
  work(&workers[0]);
  for (uint32_t t = 1; t <= helpers; t++)
    pthread_join(workers[t].thread, NULL);
}

/* Appends items to e->items (counting only when it is NULL). */
static void add_item(struct engine *e, struct engine_item item) {
  if (e->items != NULL)
    e->items[e->nitems] = item;
  e->nitems++;
}

/* What a step's moves do: assemble owners' tensors on this node, or pack
 * moves for owners on other nodes into staging (remote.c).  Replicas are
 * compared where they are assembled, on the owner's node, never where they
 * are packed: a node that does not hold the owner has no tensor to compare
 * them with (docs/planner.md). */
enum cut_kind { CUT_ASSEMBLE, CUT_PACK };

/* A round's moves as items: when assembling, a key's run of moves to one
 * owner (sorted by owner, key, source, piece) is one item when it holds
 * replicas; a move larger than the chunk is cut into slices of whole rows;
 * consecutive smaller ones are kept together up to the chunk. */
static void cut_moves(struct engine *e, enum cut_kind kind,
                      const struct plan_move *moves, size_t n) {
  uint64_t chunk = e->chunk;
  size_t run = 0;         /* small moves gathered: moves[i - run .. i) */
  uint64_t run_bytes = 0;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    bool replicas = false;
    while (j < n && moves[j].key == moves[i].key &&
           moves[j].dst == moves[i].dst) {
      replicas = replicas || (moves[j].flags & PLAN_MOVE_REPLICA);
      j++;
    }
    if (replicas && kind == CUT_ASSEMBLE) {
      if (run > 0)
        add_item(e, (struct engine_item){.kind = ITEM_MOVES,
                                         .move = &moves[i - run],
                                         .nmoves = run});
      run = 0;
      run_bytes = 0;
      add_item(e, (struct engine_item){.kind = ITEM_REPLICAS,
                                       .move = &moves[i],
                                       .nmoves = j - i});
      i = j;
      continue;
    }
    for (; i < j; i++) {
      if (moves[i].nbytes <= chunk) {
        if (run > 0 && run_bytes + moves[i].nbytes > chunk) {
          add_item(e, (struct engine_item){.kind = ITEM_MOVES,
                                           .move = &moves[i - run],
                                           .nmoves = run});
          run = 0;
          run_bytes = 0;
        }
        run++;
        run_bytes += moves[i].nbytes;
        continue;
      }
      if (run > 0)
        add_item(e, (struct engine_item){.kind = ITEM_MOVES,
                                         .move = &moves[i - run],
                                         .nmoves = run});
      run = 0;
      run_bytes = 0;
      int64_t rows = move_rows(&moves[i], e->plan);
      uint64_t row_bytes = moves[i].nbytes / (uint64_t)rows;
      int64_t per = row_bytes > 0 && row_bytes < chunk
                        ? (int64_t)(chunk / row_bytes)
                        : 1;
      for (int64_t r = 0; r < rows; r += per)
        add_item(e,
                 (struct engine_item){.kind = ITEM_SLICE,
                                      .move = &moves[i],
                                      .row = r,
                                      .rows = rows - r < per ? rows - r : per});
    }
  }
  if (run > 0)
    add_item(e, (struct engine_item){.kind = ITEM_MOVES,
                                     .move = &moves[n - run],
                                     .nmoves = run});
}

/* A range of a fresh segment to make present, as items of at most a chunk,
 * reduced to the whole pages inside it (a page at its edge may hold a
 * tensor of another round, which a copy may be writing). */
static void add_populate(struct engine *e, uint8_t *addr, uint64_t len) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t from = ((uintptr_t)addr + page - 1) & ~(page - 1);
  uintptr_t to = ((uintptr_t)addr + len) & ~(page - 1);
  for (uintptr_t at = from; at < to; at += e->chunk) {
    uintptr_t n = to - at < e->chunk ? to - at : e->chunk;
    add_item(e, (struct engine_item){
                    .kind = ITEM_POPULATE, .addr = (uint8_t *)at, .len = n});
  }
}

/* The tensors round (0-based) assembles in this node's fresh segments,
 * made present; tensors of one owner that touch (no padding between them,
 * so no other round's tensor either) are one range. */
static void cut_populate(struct engine *e, size_t round) {
  if (round >= e->plan->nrounds)
    return;
  const struct plan *plan = e->plan;
  const struct plan_round *rd = &plan->rounds[round];
  uint32_t owner = PLAN_NONE;
  uint64_t from = 0, to = 0;
  for (size_t i = 0; i <= rd->nkeys; i++) {
    const struct plan_key *key =
        i < rd->nkeys ? &plan->keys[plan->transfer[rd->first + i]] : NULL;
    uint64_t off = key != NULL ? e->key_offset[key - plan->keys] : 0;
    if (key != NULL && key->owner == owner && off == to) {
      to = off + key->nbytes;
      continue;
    }
    if (owner != PLAN_NONE && to > from)
      add_populate(e, e->dst[owner] + from, to - from);
    owner = PLAN_NONE;
    if (key == NULL || e->dst[key->owner] == NULL ||
        (e->dst_warm != NULL && e->dst_warm[key->owner]))
      continue;
    owner = key->owner;
    from = off;
    to = off + key->nbytes;
  }
}

/* Before round 1: round 1's tensors made present in fresh segments, and
 * warm segments' bytes outside their tensors zeroed. */
static void cut_prepare(struct engine *e) {
  for (uint32_t r = 0; r < e->plan->world; r++)
    if (e->dst[r] != NULL && e->dst_warm != NULL && e->dst_warm[r])
      add_item(e, (struct engine_item){.kind = ITEM_GAPS, .rank = r});
  cut_populate(e, 0);
}

/* The bytes one item holds in a round of bytes: about
 * ENGINE_ITEMS_PER_THREAD items per thread, within the chunk bounds. */
static uint64_t chunk_for(const struct engine *e, uint64_t bytes) {
  uint64_t c = bytes / ((uint64_t)e->threads * ENGINE_ITEMS_PER_THREAD);
  return c < ENGINE_MIN_CHUNK ? ENGINE_MIN_CHUNK
         : c > ENGINE_CHUNK   ? ENGINE_CHUNK
                              : c;
}

/* Builds the items of one step: preparing the segments (round < 0), or
 * copying the moves a[0..na) and b[0..nb) of a round, followed by making
 * the next round's tensors present when ahead is set. */
static int cut(struct engine *e, long round, enum cut_kind kind,
               const struct plan_move *a, size_t na, const struct plan_move *b,
               size_t nb, bool ahead) {
  uint64_t bytes = 0;
  if (round >= 0)
    bytes = e->plan->rounds[round].nbytes;
  else
    for (uint32_t r = 0; r < e->plan->world; r++)
      bytes += e->dst_size[r];
  e->chunk = chunk_for(e, bytes);
  for (int pass = 0; pass < 2; pass++) {
    e->nitems = 0;
    if (round < 0) {
      cut_prepare(e);
    } else {
      cut_moves(e, kind, a, na);
      cut_moves(e, kind, b, nb);
      if (ahead)
        cut_populate(e, (size_t)round + 1);
    }
    if (pass == 0) {
      e->items = malloc((e->nitems > 0 ? e->nitems : 1) * sizeof *e->items);
      if (e->items == NULL)
        return engine_fail(e, SP_ENOMEM, "out of memory cutting round %ld",
                           round + 1);
    }
  }
  if (round < 0) {
    /* Progress counts the segments whole: what no item of this step
     * prepares (later rounds' tensors, padding) counts as prepared now. */
    uint64_t later = bytes;
    for (size_t i = 0; i < e->nitems; i++)
      later -= e->items[i].kind == ITEM_GAPS ? e->dst_size[e->items[i].rank]
                                              : e->items[i].len;
    atomic_fetch_add_explicit(&e->bytes_prepared, later, memory_order_relaxed);
  }
  return 0;
}

static void exchange(struct engine *e) {
  char msg[SP_ERRMSG_MAX + 1];
  int rc = remote_exchange(e->remote, &e->cancel, &e->bytes_moved,
                           &e->lost_node, msg, sizeof msg);
  if (rc < 0)
    engine_fail(e, rc, "%s", msg);
}

/* A round of a job across nodes (remote.c): the moves packed for other
 * nodes first, then this node's local copies on the helpers while this
 * thread exchanges with the other nodes, then what waited for the
 * exchange (unpacking, and keys whose replicas crossed nodes). */
static void run_remote_round(struct engine *e, size_t round,
                             struct worker *workers) {
  struct remote_round rr;
  char msg[SP_ERRMSG_MAX + 1];
  int rc = remote_round(e->remote, round, &rr, msg, sizeof msg);
  if (rc != 0) {
    engine_fail(e, rc, "%s", msg);
    return;
  }
  const struct plan_move *lists[3] = {rr.pack, rr.early, rr.late};
  size_t counts[3] = {rr.npack, rr.nearly, rr.nlate};
  atomic_store(&e->copies_end_ns, 0);
  for (int step = 0; step < 3 && !stopped(e); step++) {
    /* The next round's tensors are made present before the exchange,
     * which may receive into them ahead (remote.c). */
    if (cut(e, (long)round, step == 0 ? CUT_PACK : CUT_ASSEMBLE, lists[step],
            counts[step], NULL, 0, step == 0) != 0)
      return;
    run_items(e, workers, step == 1 ? exchange : NULL);
    free(e->items);
    e->items = NULL;
  }
  uint64_t ahead = remote_ahead_began_ns(e->remote);
  if (!stopped(e) && ahead != 0 && ahead < atomic_load(&e->copies_end_ns))
    e->rounds_overlapped++;
}

static void pause_ms(struct engine *e, uint32_t ms) {
  for (uint32_t waited = 0; waited < ms && !stopped(e); waited += 10) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

int engine_run(struct engine *e) {
  struct worker workers[ENGINE_MAX_THREADS];
  if (e->threads == 0)
    e->threads = 1;
  if (e->threads > ENGINE_MAX_THREADS)
    e->threads = ENGINE_MAX_THREADS;
  e->rc = 0;
  e->msg[0] = '\0';
  e->lost_node = PLAN_NONE;
  e->rounds_overlapped = 0;
  atomic_store(&e->failed, false);
  pthread_mutex_init(&e->fail_lock, NULL);
  for (long r = -1; r < (long)e->plan->nrounds && !stopped(e); r++) {
    if (r >= 0) {
      atomic_store(&e->round, (uint32_t)(r + 1));
      if (e->notify != NULL)
        e->notify(e->notify_arg);
    }
    e->items = NULL;
    if (r >= 0 && e->remote != NULL) {
      run_remote_round(e, (size_t)r, workers);
    } else {
      /* On one daemon every rank is local; moves the planner lists as
       * remote (ranks it was told sit on other nodes) are copied the same
       * way. */
      const struct plan_round *rd = r >= 0 ? &e->plan->rounds[r] : NULL;
      if (cut(e, r, CUT_ASSEMBLE, rd != NULL ? rd->local : NULL,
              rd != NULL ? rd->nlocal : 0, rd != NULL ? rd->moves : NULL,
              rd != NULL ? rd->nmoves : 0, true) != 0)
        break;
      run_items(e, workers, NULL);
    }
    free(e->items);
    e->items = NULL;
    /* The test seam pauses after the pool is prepared too, so that tests
     * can watch that phase (status: allocating). */
    pause_ms(e, e->round_delay_ms);
  }
  if (e->rc == 0 && atomic_load(&e->cancel))
    engine_fail(e, SP_EBUSY, "the export was canceled");
  pthread_mutex_destroy(&e->fail_lock);
  return e->rc;
}

static void *engine_main(void *arg) {
  struct engine *e = arg;
  if (e->run != NULL)
    e->run(e);
  else
    engine_run(e);
  atomic_store(&e->done, true);
  if (e->notify != NULL)
    e->notify(e->notify_arg);
  return NULL;
}

int engine_start(struct engine *e) {
  atomic_store(&e->done, false);
  atomic_store(&e->round, 0);
  atomic_store(&e->bytes_moved, 0);
  atomic_store(&e->bytes_prepared, 0);
  return xfer_spawn(&e->thread, engine_main, e);
}

void engine_join(struct engine *e) { pthread_join(e->thread, NULL); }
