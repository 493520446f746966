/*
 * fake_nccl.h - what the two halves of the fake NCCL share: fake_nccl.c
 * (the API, groups, communicator set-up and teardown) and fake_nccl_engine.c
 * (the progress thread and the wire between ranks).
 *
 * Ranks of a communicator are connected pairwise by Unix stream sockets.
 * Every send and receive is matched in order per (peer, kind), with a
 * rendezvous: the sender announces a message (RTS: count, dtype, op) when
 * the group is launched; the receiver compares it with its own posted
 * receive, answers MISMATCH when they differ, or clear-to-send (CTS) once
 * its stream has reached the receive; the sender sends the payload (DATA)
 * once CTS has come and its own stream has reached the send.  So a mismatch
 * is found as soon as both sides have launched their groups, and a payload
 * is never written before its buffer is ready on either side.
 */
#ifndef SP_TESTS_FAKE_NCCL_H
#define SP_TESTS_FAKE_NCCL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#pragma GCC visibility push(hidden)

/* A FIFO of pointers; small, and searched linearly where needed. */
struct ptrq {
  void **v;
  size_t head, n, cap;
};
bool ptrq_push(struct ptrq *q, void *p);
void *ptrq_peek(const struct ptrq *q);
void *ptrq_pop(struct ptrq *q);
void *ptrq_at(const struct ptrq *q, size_t i);
void ptrq_remove_at(struct ptrq *q, size_t i);
void ptrq_free(struct ptrq *q);

enum xfer_kind { KIND_P2P = 0, KIND_COLL = 1, NKINDS = 2 };

enum frame_type {
  FRAME_RTS = 1,      /* sender: a message of count/dtype/op is coming */
  FRAME_CTS = 2,      /* receiver: send the payload of message seq */
  FRAME_DATA = 3,     /* sender: the payload of message seq */
  FRAME_MISMATCH = 4, /* receiver: message seq does not match my receive */
  FRAME_ABORT = 5,    /* this rank aborted its communicator */
  FRAME_BYE = 6,      /* this rank destroyed its communicator cleanly */
};

struct wire_hdr {
  uint32_t magic;
  uint8_t type;
  uint8_t kind;
  uint8_t dtype;
  uint8_t redop;
  uint64_t seq;
  uint64_t count;
};
#define WIRE_MAGIC 0x53504e43u /* "SPNC" */

struct nop;

/* One directed piece of an operation: a message to or from one peer. */
struct xfer {
  struct nop *op;
  int peer;
  bool is_send;
  enum xfer_kind kind;
  const void *sbuf;
  void *rbuf;
  size_t count, bytes;
  ncclDataType_t dtype;
  ncclRedOp_t redop;
  uint64_t seq;      /* the message's number on its (sender, receiver) wire */
  bool matched;      /* receive: an RTS was matched to it */
  bool cts;          /* send: CTS came; receive: CTS went */
  bool data_queued;  /* send: the payload is queued */
  bool done;
};

enum nop_type { NOP_SEND, NOP_RECV, NOP_ALLREDUCE };
enum nop_state { NOP_POSTED, NOP_ARMED, NOP_DONE, NOP_FAILED };

/* One NCCL call.  Owned by the launch that runs it on its stream. */
struct nop {
  struct fcomm *comm;
  enum nop_type type;
  int peer;
  const void *sbuf;
  void *rbuf;
  size_t count, bytes;
  ncclDataType_t dtype;
  ncclRedOp_t redop;
  cudaStream_t stream;
  enum nop_state state;
  bool hang;          /* fault injection: never reaches its stream */
  bool skew;          /* fault injection: its sends announce one element
                       * more than they carry (a mismatched message) */
  struct xfer *xfers;
  size_t nxfers, pending;
  void **contrib;     /* allreduce: each peer's contribution */
  int device;         /* its communicator's device, for spfake_kernels */
  bool in_flight;     /* counted by spfake_kernels until it finishes */
};

/* The ops of one group that run on one stream. */
struct launch {
  struct nop **ops;
  size_t n;
};

struct rts {
  uint64_t seq, count;
  uint8_t dtype, redop;
};

struct frame {
  struct wire_hdr hdr;
  const void *payload;
  size_t len, off;    /* payload bytes; bytes of header + payload written */
  struct xfer *x;     /* DATA: the send that completes when written */
};

struct fpeer {
  int fd;                    /* -1 for this rank itself */
  bool closed;               /* the peer said BYE or ABORT */
  bool aborted;              /* it said ABORT: nothing more comes, and
                              * nothing tells this rank (docs/fakes.md) */
  bool conn[2];              /* a receive (0) and a send (1) connection
                              * to this peer are set up, their buffers
                              * taken from the device */
  uint64_t next_seq;         /* number of the next message to this peer */
  struct ptrq out;           /* frames to write, in order */
  struct ptrq sends;         /* send xfers announced, not yet done */
  struct ptrq recvs[NKINDS]; /* receive xfers not yet matched */
  struct ptrq rts[NKINDS];   /* announcements not yet matched */
  struct ptrq awaiting;      /* receive xfers cleared, awaiting DATA */
  unsigned char in[sizeof(struct wire_hdr)];
  size_t in_off;
  struct xfer *in_x;         /* receiving this DATA payload */
  size_t in_payload_off;
};

struct fcomm {
  uint64_t id;
  int rank, nranks, device;
  uint64_t device_id;     /* spfake_device_identity of device */
  bool blocking;
  char token[48];
  unsigned long timeout_ms;

  /* All below under the engine lock. */
  bool initializing;
  bool registered;        /* in the engine's list */
  ncclResult_t error;     /* the first error, or ncclSuccess */
  bool launch_pending;    /* non-blocking launch not yet taken up */
  bool finalize_pending;  /* non-blocking ncclCommFinalize */
  unsigned groups;        /* launches so far, for fault injection */
  struct fpeer *peers;
  struct ptrq self_sends[NKINDS], self_recvs[NKINDS];
  struct ptrq ops;        /* posted ops not yet finished */
  bool coll_conn;         /* the collectives' connections are set up */
  size_t conn_bytes;      /* device memory those connections took */

  pthread_t init_thread;
  bool has_init_thread;
  atomic_bool abort_flag;
};

/* The engine (fake_nccl_engine.c).  engine_lock guards every comm's state
 * after its set-up; engine_cond is broadcast whenever an op finishes or a
 * communicator's state changes. */
extern pthread_mutex_t engine_lock;
extern pthread_cond_t engine_cond;

/* Adds a connected communicator to the progress thread.  Lock held. */
bool engine_register(struct fcomm *c);
/* Removes it, fails its ops, closes its sockets (after an ABORT or BYE
 * frame when say is that frame type, 0 for none).  Lock held. */
void engine_unregister(struct fcomm *c, enum frame_type say);
/* Makes an op's messages known to the peers.  Lock held. */
void engine_post(struct nop *op);
/* The op's stream has reached it.  Lock held. */
void engine_arm(struct nop *op);
/* Records the communicator's first error.  Lock held. */
void engine_fail(struct fcomm *c, ncclResult_t err);
/* Wakes the progress thread to look at new work. */
void engine_wake(void);

size_t fake_nccl_type_size(ncclDataType_t dtype);

/* Device memory one connection takes when it is set up, at the first
 * send, receive or collective that needs it (SHARDPORT_FAKE_NCCL_CONN_KB,
 * fake_nccl.c). */
size_t fake_nccl_conn_bytes(void);

/* SHARDPORT_FAKE_NCCL_MISMATCH=hang: a mismatched send and receive are
 * left unmatched, hanging until an abort, as on real NCCL; otherwise both
 * ranks get ncclInvalidUsage (fake_nccl.c). */
bool fake_nccl_mismatch_hangs(void);

#pragma GCC visibility pop

#endif
