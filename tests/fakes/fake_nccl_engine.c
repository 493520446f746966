/*
 * fake_nccl_engine.c - the fake NCCL's progress thread: the rendezvous
 * protocol of fake_nccl.h on each pair socket, matching, local (self)
 * messages, and the all-reduce arithmetic.
 *
 * One thread per process polls every communicator's sockets.  All state is
 * under engine_lock; socket I/O is non-blocking, so the lock is held only
 * for short stretches.  A communicator with an error stops reading and
 * starting payloads, but still writes the frames it has queued (a MISMATCH
 * must reach the peer); its ops stay unfinished, and so their streams stay
 * blocked, until the communicator is aborted or destroyed, as with real
 * NCCL, whose kernels spin until ncclCommAbort.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fake.h"
#include "fake_nccl.h"

pthread_mutex_t engine_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t engine_cond = PTHREAD_COND_INITIALIZER;

static struct ptrq comms; /* registered communicators */
static int wake_fd = -1;
static pthread_once_t engine_once = PTHREAD_ONCE_INIT;

bool ptrq_push(struct ptrq *q, void *p) {
  if (q->head + q->n == q->cap) {
    if (q->head > 0) {
      memmove(q->v, q->v + q->head, q->n * sizeof(*q->v));
      q->head = 0;
    }
    if (q->n == q->cap) {
      size_t cap = q->cap ? q->cap * 2 : 8;
      void **v = realloc(q->v, cap * sizeof(*v));
      if (v == NULL)
        return false;
      q->v = v;
      q->cap = cap;
    }
  }
  q->v[q->head + q->n++] = p;
  return true;
}

void *ptrq_peek(const struct ptrq *q) { return q->n ? q->v[q->head] : NULL; }
void *ptrq_at(const struct ptrq *q, size_t i) { return q->v[q->head + i]; }

void *ptrq_pop(struct ptrq *q) {
  if (q->n == 0)
    return NULL;
  void *p = q->v[q->head++];
  if (--q->n == 0)
    q->head = 0;
  return p;
}

void ptrq_remove_at(struct ptrq *q, size_t i) {
  memmove(q->v + q->head + i, q->v + q->head + i + 1,
          (q->n - i - 1) * sizeof(*q->v));
  if (--q->n == 0)
    q->head = 0;
}

void ptrq_free(struct ptrq *q) {
  free(q->v);
  *q = (struct ptrq){0};
}

size_t fake_nccl_type_size(ncclDataType_t dtype) {
  switch (dtype) {
  case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2:
    return 1;
  case ncclFloat16: case ncclBfloat16:
    return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32:
    return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

void engine_wake(void) {
  uint64_t one = 1;
  if (wake_fd >= 0 && write(wake_fd, &one, sizeof(one)) < 0) {
    /* The counter is full, so the thread is awake already. */
  }
}

void engine_fail(struct fcomm *c, ncclResult_t err) {
  if (c->error == ncclSuccess)
    c->error = err;
  pthread_cond_broadcast(&engine_cond);
}

static void queue_frame(struct fcomm *c, int peer, enum frame_type type,
                        const struct xfer *x, uint64_t seq) {
  struct frame *f = calloc(1, sizeof(*f));
  if (f == NULL) {
    engine_fail(c, ncclSystemError);
    return;
  }
  f->hdr = (struct wire_hdr){.magic = WIRE_MAGIC, .type = (uint8_t)type,
                             .seq = seq};
  if (x != NULL) {
    f->hdr.kind = (uint8_t)x->kind;
    f->hdr.dtype = (uint8_t)x->dtype;
    f->hdr.redop = (uint8_t)x->redop;
    f->hdr.count = x->count + (type == FRAME_RTS && x->op->skew);
  }
  if (type == FRAME_DATA) {
    f->payload = x->sbuf;
    f->len = x->bytes;
    f->x = (struct xfer *)x;
  }
  if (!ptrq_push(&c->peers[peer].out, f)) {
    free(f);
    engine_fail(c, ncclSystemError);
  }
}

/* Element-wise acc = acc (op) in, for the types the fake reduces. */
#define REDUCE_AS(type)                                                        \
  do {                                                                         \
    type *a = acc;                                                             \
    const type *b = in;                                                        \
    for (size_t i = 0; i < count; i++)                                         \
      switch (op) {                                                            \
      case ncclSum: case ncclAvg: a[i] = (type)(a[i] + b[i]); break;           \
      case ncclProd: a[i] = (type)(a[i] * b[i]); break;                        \
      case ncclMax: a[i] = a[i] > b[i] ? a[i] : b[i]; break;                   \
      default: a[i] = a[i] < b[i] ? a[i] : b[i]; break;                        \
      }                                                                        \
  } while (0)

static void reduce(void *acc, const void *in, size_t count,
                   ncclDataType_t dtype, ncclRedOp_t op) {
  switch (dtype) {
  case ncclInt8: REDUCE_AS(int8_t); break;
  case ncclUint8: REDUCE_AS(uint8_t); break;
  case ncclInt32: REDUCE_AS(int32_t); break;
  case ncclUint32: REDUCE_AS(uint32_t); break;
  case ncclInt64: REDUCE_AS(int64_t); break;
  case ncclUint64: REDUCE_AS(uint64_t); break;
  case ncclFloat32: REDUCE_AS(float); break;
  case ncclFloat64: REDUCE_AS(double); break;
  default: break; /* refused when the op was issued */
  }
}

#define DIVIDE_AS(type)                                                        \
  do {                                                                         \
    type *a = acc;                                                             \
    for (size_t i = 0; i < count; i++)                                         \
      a[i] = (type)(a[i] / (type)n);                                           \
  } while (0)

static void divide(void *acc, size_t count, ncclDataType_t dtype, int n) {
  switch (dtype) {
  case ncclInt8: DIVIDE_AS(int8_t); break;
  case ncclUint8: DIVIDE_AS(uint8_t); break;
  case ncclInt32: DIVIDE_AS(int32_t); break;
  case ncclUint32: DIVIDE_AS(uint32_t); break;
  case ncclInt64: DIVIDE_AS(int64_t); break;
  case ncclUint64: DIVIDE_AS(uint64_t); break;
  case ncclFloat32: DIVIDE_AS(float); break;
  case ncclFloat64: DIVIDE_AS(double); break;
  default: break;
  }
}

/* Every rank folds the contributions in rank order, so all ranks get the
 * same bits. */
static void allreduce_finish(struct nop *op) {
  struct fcomm *c = op->comm;
  if (op->bytes == 0)
    return;
  void *acc = malloc(op->bytes);
  if (acc == NULL) {
    engine_fail(c, ncclSystemError);
    return;
  }
  for (int r = 0; r < c->nranks; r++) {
    const void *in = r == c->rank ? op->sbuf : op->contrib[r];
    if (r == 0)
      memcpy(acc, in, op->bytes);
    else
      reduce(acc, in, op->count, op->dtype, op->redop);
  }
  if (op->redop == ncclAvg)
    divide(acc, op->count, op->dtype, c->nranks);
  memcpy(op->rbuf, acc, op->bytes);
  free(acc);
}

static void op_finish(struct nop *op, enum nop_state state) {
  struct fcomm *c = op->comm;
  if (op->in_flight) {
    op->in_flight = false;
    spfake_kernels(op->device, -1);
  }
  if (state == NOP_DONE && op->type == NOP_ALLREDUCE)
    allreduce_finish(op);
  op->state = state;
  for (size_t i = 0; i < c->ops.n; i++)
    if (ptrq_at(&c->ops, i) == op) {
      ptrq_remove_at(&c->ops, i);
      break;
    }
  pthread_cond_broadcast(&engine_cond);
}

static void xfer_done(struct xfer *x) {
  x->done = true;
  if (--x->op->pending == 0 && x->op->state == NOP_ARMED)
    op_finish(x->op, NOP_DONE);
}

static bool same_message(const struct xfer *x, uint64_t count, uint8_t dtype,
                         uint8_t redop) {
  return x->count == count && (uint8_t)x->dtype == dtype &&
         (x->kind == KIND_P2P || (uint8_t)x->redop == redop);
}

static void send_cts(struct fcomm *c, struct xfer *x) {
  x->cts = true;
  if (!ptrq_push(&c->peers[x->peer].awaiting, x)) {
    engine_fail(c, ncclSystemError);
    return;
  }
  queue_frame(c, x->peer, FRAME_CTS, x, x->seq);
}

/* Pairs announcements with posted receives, in order, per kind. */
static void match_peer(struct fcomm *c, int peer, enum xfer_kind kind) {
  struct fpeer *p = &c->peers[peer];
  while (c->error == ncclSuccess && p->rts[kind].n > 0 && p->recvs[kind].n > 0) {
    struct rts *r = ptrq_peek(&p->rts[kind]);
    struct xfer *x = ptrq_peek(&p->recvs[kind]);
    if (!same_message(x, r->count, r->dtype, r->redop)) {
      /* Real NCCL checks nothing: the pair waits for data that never fits
       * until the communicator is aborted. */
      if (fake_nccl_mismatch_hangs())
        return;
      queue_frame(c, peer, FRAME_MISMATCH, NULL, r->seq);
      engine_fail(c, ncclInvalidUsage);
      return;
    }
    ptrq_pop(&p->rts[kind]);
    ptrq_pop(&p->recvs[kind]);
    x->seq = r->seq;
    x->matched = true;
    free(r);
    if (x->op->state == NOP_ARMED)
      send_cts(c, x);
  }
}

/* Messages of a rank to itself: matched in order, copied once both ends'
 * streams have reached them. */
static void match_self(struct fcomm *c) {
  for (int k = 0; k < NKINDS; k++) {
    while (c->error == ncclSuccess && c->self_sends[k].n > 0 &&
           c->self_recvs[k].n > 0) {
      struct xfer *s = ptrq_peek(&c->self_sends[k]);
      struct xfer *r = ptrq_peek(&c->self_recvs[k]);
      if (!same_message(r, s->count, (uint8_t)s->dtype, (uint8_t)s->redop)) {
        engine_fail(c, ncclInvalidUsage);
        return;
      }
      if (s->op->state != NOP_ARMED || r->op->state != NOP_ARMED)
        break;
      ptrq_pop(&c->self_sends[k]);
      ptrq_pop(&c->self_recvs[k]);
      if (s->bytes > 0)
        memcpy(r->rbuf, s->sbuf, s->bytes);
      xfer_done(s);
      xfer_done(r);
    }
  }
}

/* NCCL sets up a connection lazily, at the first operation that needs it,
 * and allocates its buffers on the device then: a send and a receive
 * connection per peer, and the collectives' connections once per
 * communicator.  A device without the memory fails the communicator as a
 * CUDA allocation failure would. */
static void connect_lazily(struct fcomm *c, const struct xfer *x) {
  bool *done = x->kind == KIND_COLL ? &c->coll_conn
                                    : &c->peers[x->peer].conn[x->is_send];
  if (*done || x->peer == c->rank)
    return;
  size_t bytes = fake_nccl_conn_bytes();
  if (spfake_device_charge(c->device, bytes) != cudaSuccess) {
    engine_fail(c, ncclUnhandledCudaError);
    return;
  }
  *done = true;
  c->conn_bytes += bytes;
}

void engine_post(struct nop *op) {
  struct fcomm *c = op->comm;
  op->device = c->device;
  op->in_flight = true;
  spfake_kernels(op->device, 1);
  for (size_t i = 0; i < op->nxfers; i++) {
    struct xfer *x = &op->xfers[i];
    struct fpeer *p = &c->peers[x->peer];
    bool ok;
    /* A peer that aborted tells nobody: what waits for it waits on. */
    if (p->closed && !p->aborted)
      engine_fail(c, ncclRemoteError);
    connect_lazily(c, x);
    if (x->peer == c->rank) {
      ok = ptrq_push(x->is_send ? &c->self_sends[x->kind] : &c->self_recvs[x->kind], x);
    } else if (x->is_send) {
      x->seq = p->next_seq++;
      ok = ptrq_push(&p->sends, x);
      if (ok)
        queue_frame(c, x->peer, FRAME_RTS, x, x->seq);
    } else {
      ok = ptrq_push(&p->recvs[x->kind], x);
      if (ok)
        match_peer(c, x->peer, x->kind);
    }
    if (!ok)
      engine_fail(c, ncclSystemError);
  }
  match_self(c);
}

void engine_arm(struct nop *op) {
  struct fcomm *c = op->comm;
  op->state = NOP_ARMED;
  if (op->pending == 0) {
    op_finish(op, NOP_DONE);
    return;
  }
  for (size_t i = 0; i < op->nxfers; i++) {
    struct xfer *x = &op->xfers[i];
    if (x->peer == c->rank || x->done || c->error != ncclSuccess)
      continue;
    if (x->is_send && x->cts && !x->data_queued) {
      x->data_queued = true;
      queue_frame(c, x->peer, FRAME_DATA, x, x->seq);
    } else if (!x->is_send && x->matched && !x->cts) {
      send_cts(c, x);
    }
  }
  match_self(c);
}

static struct xfer *take_by_seq(struct ptrq *q, uint64_t seq) {
  for (size_t i = 0; i < q->n; i++) {
    struct xfer *x = ptrq_at(q, i);
    if (x->seq == seq) {
      ptrq_remove_at(q, i);
      return x;
    }
  }
  return NULL;
}

static void on_frame(struct fcomm *c, int peer, const struct wire_hdr *h) {
  struct fpeer *p = &c->peers[peer];
  if (h->magic != WIRE_MAGIC || h->kind >= NKINDS) {
    engine_fail(c, ncclInternalError);
    return;
  }
  switch (h->type) {
  case FRAME_RTS: {
    struct rts *r = malloc(sizeof(*r));
    if (r == NULL || !ptrq_push(&p->rts[h->kind], r)) {
      free(r);
      engine_fail(c, ncclSystemError);
      return;
    }
    *r = (struct rts){.seq = h->seq, .count = h->count, .dtype = h->dtype,
                      .redop = h->redop};
    match_peer(c, peer, h->kind);
    break;
  }
  case FRAME_CTS: {
    struct xfer *x = NULL;
    for (size_t i = 0; i < p->sends.n && x == NULL; i++)
      if (((struct xfer *)ptrq_at(&p->sends, i))->seq == h->seq)
        x = ptrq_at(&p->sends, i);
    if (x == NULL || x->cts) {
      engine_fail(c, ncclInternalError);
      return;
    }
    x->cts = true;
    if (x->op->state == NOP_ARMED) {
      x->data_queued = true;
      queue_frame(c, peer, FRAME_DATA, x, x->seq);
    }
    break;
  }
  case FRAME_DATA: {
    struct xfer *x = take_by_seq(&p->awaiting, h->seq);
    if (x == NULL || h->count != x->count) {
      engine_fail(c, ncclInternalError);
      return;
    }
    p->in_x = x;
    p->in_payload_off = 0;
    break;
  }
  case FRAME_MISMATCH:
    engine_fail(c, ncclInvalidUsage);
    break;
  case FRAME_ABORT:
    /* ncclCommAbort does not tell the peers: their operations with this
     * rank wait until they abort themselves (docs/fakes.md). */
    p->closed = true;
    p->aborted = true;
    break;
  case FRAME_BYE:
    p->closed = true;
    break;
  default:
    engine_fail(c, ncclInternalError);
  }
}

/* A peer's socket closed or broke.  After a BYE that is the clean end of
 * an idle peer; otherwise the peer died (docs/fakes.md: the fake reports it
 * at once, even with nothing pending). */
static void peer_lost(struct fcomm *c, int peer) {
  struct fpeer *p = &c->peers[peer];
  bool busy = p->sends.n > 0 || p->awaiting.n > 0 || p->in_x != NULL;
  for (int k = 0; k < NKINDS; k++)
    busy = busy || p->recvs[k].n > 0;
  if (!p->aborted && (!p->closed || busy))
    engine_fail(c, ncclRemoteError);
  close(p->fd);
  p->fd = -1;
  p->closed = true;
}

static void read_peer(struct fcomm *c, int peer) {
  struct fpeer *p = &c->peers[peer];
  while (c->error == ncclSuccess && p->fd >= 0) {
    ssize_t n;
    if (p->in_x != NULL) {
      struct xfer *x = p->in_x;
      size_t want = x->bytes - p->in_payload_off;
      n = want == 0 ? 0 : recv(p->fd, (char *)x->rbuf + p->in_payload_off, want,
                               MSG_DONTWAIT);
      if (want == 0 || n > 0) {
        p->in_payload_off += (size_t)(want == 0 ? 0 : n);
        if (p->in_payload_off == x->bytes) {
          p->in_x = NULL;
          xfer_done(x);
        }
        continue;
      }
    } else {
      n = recv(p->fd, p->in + p->in_off, sizeof(p->in) - p->in_off, MSG_DONTWAIT);
      if (n > 0) {
        p->in_off += (size_t)n;
        if (p->in_off == sizeof(p->in)) {
          struct wire_hdr h;
          memcpy(&h, p->in, sizeof(h));
          p->in_off = 0;
          on_frame(c, peer, &h);
        }
        continue;
      }
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
      return;
    peer_lost(c, peer);
    return;
  }
}

static void write_peer(struct fcomm *c, int peer) {
  struct fpeer *p = &c->peers[peer];
  while (p->fd >= 0 && p->out.n > 0) {
    struct frame *f = ptrq_peek(&p->out);
    const size_t hl = sizeof(f->hdr);
    struct iovec iov[2];
    int iovcnt = 0;
    if (f->off < hl)
      iov[iovcnt++] = (struct iovec){(char *)&f->hdr + f->off, hl - f->off};
    if (f->len > 0) {
      size_t done = f->off > hl ? f->off - hl : 0;
      iov[iovcnt++] = (struct iovec){(char *)f->payload + done, f->len - done};
    }
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
    ssize_t n = sendmsg(p->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
        return;
      peer_lost(c, peer);
      return;
    }
    f->off += (size_t)n;
    if (f->off < hl + f->len)
      continue;
    ptrq_pop(&p->out);
    if (f->x != NULL) {
      for (size_t i = 0; i < p->sends.n; i++)
        if (ptrq_at(&p->sends, i) == f->x) {
          ptrq_remove_at(&p->sends, i);
          break;
        }
      xfer_done(f->x);
    }
    free(f);
  }
}

struct poll_slot {
  struct fcomm *c;
  uint64_t id;
  int peer;
};

static bool still_registered(struct fcomm *c, uint64_t id) {
  for (size_t i = 0; i < comms.n; i++)
    if (ptrq_at(&comms, i) == c)
      return c->id == id;
  return false;
}

static void *engine_main(void *arg) {
  (void)arg;
  struct pollfd *fds = NULL;
  struct poll_slot *slots = NULL;
  size_t cap = 0;
  for (;;) {
    pthread_mutex_lock(&engine_lock);
    size_t want = 1;
    for (size_t i = 0; i < comms.n; i++)
      want += (size_t)((struct fcomm *)ptrq_at(&comms, i))->nranks;
    if (want > cap) {
      struct pollfd *nf = realloc(fds, want * sizeof(*nf));
      struct poll_slot *ns = nf ? realloc(slots, want * sizeof(*ns)) : NULL;
      if (nf != NULL)
        fds = nf;
      if (ns != NULL) {
        slots = ns;
        cap = want;
      }
    }
    size_t n = 0;
    if (cap > 0)
      fds[n++] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
    for (size_t i = 0; i < comms.n && cap > 0; i++) {
      struct fcomm *c = ptrq_at(&comms, i);
      c->launch_pending = false; /* the launch has been taken up */
      for (int r = 0; r < c->nranks && n < cap; r++) {
        struct fpeer *p = &c->peers[r];
        if (p->fd < 0)
          continue;
        short ev = (short)((c->error == ncclSuccess ? POLLIN : 0) |
                           (p->out.n > 0 ? POLLOUT : 0));
        if (ev == 0)
          continue;
        slots[n] = (struct poll_slot){c, c->id, r};
        fds[n++] = (struct pollfd){.fd = p->fd, .events = ev};
      }
    }
    pthread_cond_broadcast(&engine_cond);
    pthread_mutex_unlock(&engine_lock);

    if (n == 0) {
      usleep(10000);
      continue;
    }
    if (poll(fds, n, 100) <= 0)
      continue;

    pthread_mutex_lock(&engine_lock);
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      if (read(wake_fd, &v, sizeof(v)) < 0) {
        /* Nothing to drain. */
      }
    }
    for (size_t i = 1; i < n; i++) {
      if (fds[i].revents == 0 || !still_registered(slots[i].c, slots[i].id))
        continue;
      struct fcomm *c = slots[i].c;
      if (c->peers[slots[i].peer].fd != fds[i].fd)
        continue;
      if (fds[i].revents & POLLOUT)
        write_peer(c, slots[i].peer);
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        if (c->error == ncclSuccess)
          read_peer(c, slots[i].peer);
        else if (!(fds[i].revents & POLLOUT))
          peer_lost(c, slots[i].peer);
      }
    }
    pthread_mutex_unlock(&engine_lock);
  }
  return NULL;
}

static void engine_start(void) {
  wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  if (wake_fd < 0 || pthread_create(&thread, &attr, engine_main, NULL) != 0) {
    if (wake_fd >= 0)
      close(wake_fd);
    wake_fd = -1;
  }
  pthread_attr_destroy(&attr);
}

bool engine_register(struct fcomm *c) {
  pthread_once(&engine_once, engine_start);
  if (wake_fd < 0 || !ptrq_push(&comms, c))
    return false;
  c->registered = true;
  engine_wake();
  return true;
}

/* Flushes what is queued for the peer and then writes one control frame,
 * as far as the socket takes them without waiting: teardown does not wait
 * for a slow peer, which then learns from the closed socket instead.  The
 * queued frames go first, so that a MISMATCH is not overtaken by the ABORT
 * that follows it. */
static void say_now(struct fcomm *c, int peer, enum frame_type type) {
  struct fpeer *p = &c->peers[peer];
  write_peer(c, peer);
  if (p->fd < 0 || p->out.n > 0)
    return;
  struct wire_hdr h = {.magic = WIRE_MAGIC, .type = (uint8_t)type};
  if (send(p->fd, &h, sizeof(h), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    /* The peer learns from the closed socket instead. */
  }
}

void engine_unregister(struct fcomm *c, enum frame_type say) {
  for (size_t i = 0; i < comms.n; i++)
    if (ptrq_at(&comms, i) == c) {
      ptrq_remove_at(&comms, i);
      break;
    }
  c->registered = false;
  while (c->ops.n > 0)
    op_finish(ptrq_peek(&c->ops), NOP_FAILED);
  for (int r = 0; c->peers != NULL && r < c->nranks; r++) {
    struct fpeer *p = &c->peers[r];
    if (say != 0)
      say_now(c, r, say);
    if (p->fd >= 0)
      close(p->fd);
    p->fd = -1;
    for (struct frame *f; (f = ptrq_pop(&p->out)) != NULL;)
      free(f);
    for (int k = 0; k < NKINDS; k++) {
      for (struct rts *r2; (r2 = ptrq_pop(&p->rts[k])) != NULL;)
        free(r2);
      ptrq_free(&p->rts[k]);
      ptrq_free(&p->recvs[k]);
    }
    ptrq_free(&p->out);
    ptrq_free(&p->sends);
    ptrq_free(&p->awaiting);
    p->in_x = NULL;
  }
  for (int k = 0; k < NKINDS; k++) {
    ptrq_free(&c->self_sends[k]);
    ptrq_free(&c->self_recvs[k]);
  }
  ptrq_free(&c->ops);
  pthread_cond_broadcast(&engine_cond);
  engine_wake();
}
