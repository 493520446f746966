/*
 * fakewing.h - what the across-nodes wing (daemon/mesh/) runs on, faked
 * for its unit tests: links that record what the wing sends and deliver
 * what a test says another daemon sent (in nodelink.c's place), client
 * connections that record their error replies (in conn.c's place), and a
 * struct mesh_ops that records every call back into jobs and exports.
 * No processes and no network: a data link's socket is one end of a
 * socketpair, since the wing only keeps it for the exchanges.
 */
#ifndef SP_TESTS_FAKEWING_H
#define SP_TESTS_FAKEWING_H

#include "daemon/mesh/internal.h"

/* One frame the wing sent on a link: a message (decoded as the peer would
 * read it), or a blob's bytes. */
struct fake_sent {
  bool is_blob;
  struct nodemsg m;
  struct nodeblob *blob;
};

struct nodelink {
  struct nodelink *next;
  char peer[NODE_ADDR_MAX];
  const struct nodelink_ops *ops;
  void *arg;
  bool dialled, closed, closing, identified, awaiting;
  uint32_t expect_blobs;
  /* What the wing counts the link's bytes into (the fake counts none). */
  struct metrics_bytes *counts[NODELINK_COUNTERS];
  uint8_t handshake[PEERAUTH_NONCE_BYTES];
  void (*detach_fn)(void *arg, int sock);
  void *detach_arg;
  struct fake_sent *sent;
  size_t nsent, cap;
};

struct conn {
  struct conn *next;
  uint64_t id;
  struct job_member *member;
  size_t nerrors;
  uint64_t error_id;
  int error_code;
  char error[SP_ERRMSG_MAX + 1];
};

/* The daemon around the wing, and what the wing called back. */
struct fake {
  struct config cfg;
  struct backend_choice backend;
  struct server srv;
  uint64_t now;
  struct nodelink *links;
  struct conn *conns;
  uint64_t next_conn;
  struct job *jobs[8];
  size_t njobs;
  bool departed[16];
  char departed_reason[16][SP_ERRMSG_MAX + 1];
  int wakes, ends, terminates, admits, returned, answers;
  int terminate_code, answer_code;
  int starts, start_rc;
  /* The last step of a save's commit the root announced (commit). */
  uint32_t committed;
  struct mesh_export *mx;
  uint64_t start_id, start_bytes;
  uint32_t start_keys, start_timeout;
  int gos, publishes, fails, fail_asks;
  bool go_differ;
  int fail_code, fail_asks_code;
  char fail_msg[SP_ERRMSG_MAX + 1], fail_asks_msg[SP_ERRMSG_MAX + 1];
};
extern struct fake F;

/* A fresh daemon (node id 1, peer address 10.0.0.1:7000); and its end,
 * which frees every job, mesh, link and connection the test made. */
void fake_setup(void);
void fake_teardown(void);

/* A job of world ranks, rooted here (with its mesh) or not (no mesh yet);
 * its id, secret and hex are fixed by its index. */
struct job *fake_job(uint32_t world, bool root);
/* A rank joined on this daemon, with an empty CPU registry. */
struct job_member *fake_member(struct job *job, uint32_t rank);
/* The member asks for an export (0: the defaults). */
void fake_ask(struct job_member *m, uint32_t max_keys, uint32_t timeout_ms);
struct conn *fake_conn(void);

/* A link another daemon opened to this one, before its challenge. */
struct nodelink *fake_accept(void);
/* The links this daemon dialled to addr, the last first (nth 0), or
 * NULL past them. */
struct nodelink *fake_dialled(const char *addr, size_t nth);
/* What the peer sends on l, handled as nodelink.c would: a control frame
 * (the first frame of an accepted link goes to hello_first_frame), a blob. */
void fake_deliver(struct nodelink *l, const struct nodemsg *m);
void fake_deliver_blob(struct nodelink *l, const uint8_t *bytes, size_t len);
/* The link's handshake ends and its socket is handed over (sock, or -1). */
void fake_detach(struct nodelink *l, int sock);
/* The peer ends the link. */
void fake_close(struct nodelink *l, int code);
/* The last message of op the wing sent on l, or NULL; how many. */
const struct nodemsg *fake_last(const struct nodelink *l, enum nodemsg_op op);
size_t fake_count(const struct nodelink *l, enum nodemsg_op op);
/* The blobs sent on l after its last message of op, in order. */
const struct nodeblob *fake_blob_after(const struct nodelink *l,
                                       enum nodemsg_op op, size_t i);

#endif /* SP_TESTS_FAKEWING_H */
