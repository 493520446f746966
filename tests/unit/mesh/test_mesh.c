/*
 * test_mesh.c - the across-nodes wing's steps, driven with fake links and
 * a fake job and export (fakewing.h), without processes: the root's side
 * (hellos, joins, the gather and its options and deadline, the plan,
 * digests, go, moved, publish, a save's commit, a node lost) and a
 * member's (its join through the root, its asks, the plan it checks, its
 * data link, planned, go, moved, publish, its root lost).  docs/protocol.md ("Between
 * daemons") is what the messages are checked against.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "shardport.h"
#include "daemon/save.h"
#include "tests/unit/mesh/fakewing.h"

#define NODE1_ADDR "10.0.0.2:7000"
#define NODE1_ID 2u
#define ROOT_ADDR "10.0.0.5:7000"
#define ROOT_ID 5u

static const uint8_t node1_meta[] = "rank 1's registrations";
static int sv[2] = {-1, -1};

static void setup(void) {
  fake_setup();
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
}

static void teardown(void) {
  fake_teardown();
  close(sv[0]);
  close(sv[1]);
}

/* A socket for one stream of a data link: the wing takes it and closes it
 * with the mesh. */
static int give_socket(void) {
  int s = dup(sv[0]);
  ck_assert_int_ge(s, 0);
  return s;
}

static struct nodemsg msg_of(enum nodemsg_op op, uint64_t gather) {
  return (struct nodemsg){.op = op, .gather = gather};
}

/* ---- the root ---- */

/* Node 1's daemon opens a control link to the root of job and proves it
 * knows the job's secret; the root's answer proves it knows it too. */
static struct nodelink *node_says_hello(struct job *job,
                                        const uint8_t *secret) {
  struct nodelink *l = fake_accept();
  hello_accepted(&F.srv, l);
  const struct nodemsg *c = fake_last(l, NODEMSG_CHALLENGE);
  ck_assert_ptr_nonnull(c);
  ck_assert_uint_eq(c->version, NODE_PROTOCOL_VERSION);
  uint8_t listener_nonce[PEERAUTH_NONCE_BYTES];
  memcpy(listener_nonce, c->nonce, sizeof listener_nonce);
  struct nodemsg h = {.op = NODEMSG_HELLO,
                      .version = NODE_PROTOCOL_VERSION,
                      .node_id = NODE1_ID};
  memcpy(h.job, job->id, JOB_ID_BYTES);
  snprintf(h.addr, sizeof h.addr, "%s", NODE1_ADDR);
  memset(h.nonce, 0x5a, sizeof h.nonce);
  peerauth_proof(secret, PEERAUTH_DIALER, PEERAUTH_CONTROL, job->id,
                 listener_nonce, h.nonce, NULL, h.proof);
  fake_deliver(l, &h);
  const struct nodemsg *r = fake_last(l, NODEMSG_HELLO);
  if (r != NULL) {
    uint8_t want[PEERAUTH_PROOF_BYTES];
    peerauth_proof(job->secret, PEERAUTH_LISTENER, PEERAUTH_CONTROL, job->id,
                   listener_nonce, h.nonce, NULL, want);
    ck_assert(r->reply);
    ck_assert_uint_eq(r->node, 1);
    ck_assert_uint_eq(r->node_id, F.srv.node_id);
    ck_assert(peerauth_equal(want, r->proof));
  }
  return l;
}

static struct nodelink *node_joins_root(struct job *job) {
  struct nodelink *l = node_says_hello(job, job->secret);
  ck_assert_ptr_nonnull(fake_last(l, NODEMSG_HELLO));
  return l;
}

static void node_rank_joins(struct nodelink *l, uint32_t rank, uint64_t id) {
  struct nodemsg j = {.op = NODEMSG_JOIN, .id = id, .rank = rank,
                      .world = 2, .device_type = SP_DEVICE_CPU};
  fake_deliver(l, &j);
}

static void node_asks(struct nodelink *l, uint64_t gather, uint32_t rank,
                      uint32_t max_keys) {
  struct nodemsg a = {.op = NODEMSG_ASK, .gather = gather, .rank = rank,
                      .max_keys = max_keys};
  fake_deliver(l, &a);
  fake_deliver_blob(l, node1_meta, sizeof node1_meta);
}

/* A job of two ranks rooted here: rank 0 on the root's own node, rank 1
 * on node 1, whose control link is *ctl. */
static struct job *root_with_two_nodes(struct nodelink **ctl) {
  struct job *job = fake_job(2, true);
  *ctl = node_joins_root(job);
  node_rank_joins(*ctl, 1, 7);
  fake_member(job, 0);
  mesh_rank_joined(job, 0);
  return job;
}

/* Both ranks asked and every node has the plan: the root's own node has
 * started the export (fake_start). */
static struct job *root_export_started(struct nodelink **ctl) {
  struct job *job = root_with_two_nodes(ctl);
  fake_ask(job->members[0], 0, 0);
  mesh_asks(job);
  mesh_advance(job);
  node_asks(*ctl, 1, 1, 0);
  mesh_advance(job);
  ck_assert_int_eq(F.starts, 1);
  return job;
}

/* Node 1 dials a data link's stream to the root: its frame claims the
 * stream *claimed, its proof was made for *proven.  The link, with the
 * root's answer in it. */
static struct nodelink *node_dials_stream(struct job *job,
                                          const struct peerauth_stream *proven,
                                          const struct peerauth_stream *claimed,
                                          uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                                          struct nodemsg *h) {
  struct nodelink *d = fake_accept();
  hello_accepted(&F.srv, d);
  const struct nodemsg *c = fake_last(d, NODEMSG_CHALLENGE);
  ck_assert_ptr_nonnull(c);
  memcpy(listener_nonce, c->nonce, PEERAUTH_NONCE_BYTES);
  *h = (struct nodemsg){.op = NODEMSG_DATA,
                        .version = NODE_PROTOCOL_VERSION,
                        .node = claimed->node,
                        .node_id = claimed->node_id,
                        .stream = claimed->stream,
                        .streams = claimed->streams,
                        .export_id = claimed->export_id};
  memcpy(h->job, job->id, JOB_ID_BYTES);
  memset(h->nonce, 0x6b, sizeof h->nonce);
  peerauth_proof(job->secret, PEERAUTH_DIALER, PEERAUTH_DATA, job->id,
                 listener_nonce, h->nonce, proven, h->proof);
  fake_deliver(d, h);
  return d;
}

static const struct peerauth_stream node1_stream0 = {
    .node = 1, .node_id = NODE1_ID, .stream = 0, .streams = 1, .export_id = 1};

/* Node 1's data link to the root: its handshake, then the socket. */
static void node_data_link_up(struct job *job) {
  uint8_t nonce[PEERAUTH_NONCE_BYTES];
  struct nodemsg h;
  struct nodelink *d =
      node_dials_stream(job, &node1_stream0, &node1_stream0, nonce, &h);
  const struct nodemsg *r = fake_last(d, NODEMSG_DATA);
  ck_assert_ptr_nonnull(r);
  ck_assert(r->reply);
  /* The root's answer proves the stream it accepted. */
  uint8_t want[PEERAUTH_PROOF_BYTES];
  peerauth_proof(job->secret, PEERAUTH_LISTENER, PEERAUTH_DATA, job->id, nonce,
                 h.nonce, &node1_stream0, want);
  ck_assert(peerauth_equal(want, r->proof));
  fake_detach(d, give_socket());
}

static void node_planned(struct nodelink *l, uint64_t digest) {
  struct nodemsg p = {.op = NODEMSG_PLANNED, .gather = 1, .digest = digest};
  fake_deliver(l, &p);
}

START_TEST(root_joins_a_node_and_its_rank) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  const struct nodemsg *j = fake_last(l, NODEMSG_JOIN);
  ck_assert_ptr_nonnull(j);
  ck_assert(j->reply);
  ck_assert_uint_eq(j->id, 7);
  ck_assert_int_eq(F.returned, 1);
  ck_assert(job->ever_joined);
  uint32_t node;
  bool asked;
  ck_assert(mesh_rank_where(job, 1, &node, &asked));
  ck_assert_uint_eq(node, 1);
  ck_assert(!asked);
  ck_assert_uint_eq(mesh_node_count(job), 2);
}
END_TEST

START_TEST(root_refuses_a_rank_joined_twice) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  node_rank_joins(l, 0, 8);
  const struct nodemsg *e = fake_last(l, NODEMSG_ERROR);
  ck_assert_ptr_nonnull(e);
  ck_assert_int_eq(e->code, SP_ERANK);
  char want[256];
  snprintf(want, sizeof want,
           "join: rank 0 of job %s has already joined on node 0 "
           "(10.0.0.1:7000)",
           job->hex);
  ck_assert_str_eq(e->message, want);
}
END_TEST

START_TEST(root_refuses_a_node_without_the_secret) {
  struct job *job = fake_job(2, true);
  uint8_t wrong[JOB_SECRET_BYTES];
  memcpy(wrong, job->secret, sizeof wrong);
  wrong[JOB_SECRET_BYTES - 1] ^= 1;
  struct nodelink *l = node_says_hello(job, wrong);
  ck_assert_uint_eq(fake_count(l, NODEMSG_HELLO), 0);
  const struct nodemsg *e = fake_last(l, NODEMSG_ERROR);
  ck_assert_ptr_nonnull(e);
  ck_assert_int_eq(e->code, SP_ETICKET);
  ck_assert_str_eq(e->message,
                   "no job of this id and secret on this daemon");
  ck_assert(l->closing);
  ck_assert_uint_eq(mesh_node_count(job), 1);
}
END_TEST

START_TEST(root_gathers_plans_and_publishes) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 0, 0);
  mesh_asks(job);
  mesh_advance(job);
  /* Rank 1 has not asked: no plan yet. */
  ck_assert_uint_eq(fake_count(l, NODEMSG_PLAN), 0);
  node_asks(l, 1, 1, 0);
  const struct nodemsg *p = fake_last(l, NODEMSG_PLAN);
  ck_assert_ptr_nonnull(p);
  ck_assert_uint_eq(p->gather, 1);
  ck_assert_uint_eq(p->export_id, 1);
  ck_assert_uint_eq(p->world, 2);
  ck_assert_uint_eq(p->max_keys, PLAN_DEFAULT_MAX_KEYS);
  ck_assert_uint_eq(p->max_bytes, F.cfg.max_bytes);
  ck_assert_uint_eq(p->timeout_ms, F.cfg.export_timeout_ms);
  ck_assert_uint_eq(p->nnodes, 2);
  ck_assert_uint_eq(p->nodes[0].node, 0);
  ck_assert_str_eq(p->nodes[0].addr, "10.0.0.1:7000");
  ck_assert_uint_eq(p->nodes[1].node, 1);
  ck_assert_str_eq(p->nodes[1].addr, NODE1_ADDR);
  ck_assert_uint_eq(p->rank_nodes[0], 0);
  ck_assert_uint_eq(p->rank_nodes[1], 1);
  /* Every rank's registrations follow, the same bytes to every node. */
  const struct nodeblob *b = fake_blob_after(l, NODEMSG_PLAN, 1);
  ck_assert_uint_eq(b->len, sizeof node1_meta);
  ck_assert_mem_eq(b->payload, node1_meta, sizeof node1_meta);
  ck_assert_int_eq(F.starts, 0);
  mesh_advance(job);
  ck_assert_int_eq(F.starts, 1);
  ck_assert_uint_eq(F.start_id, 1);
  ck_assert_uint_eq(F.start_keys, PLAN_DEFAULT_MAX_KEYS);
  struct replica_digests none = {0};
  mesh_planned(job, 0x1234, &none);
  node_planned(l, 0x1234);
  mesh_advance(job);
  /* The root's own node says planned only with its data links up. */
  ck_assert_uint_eq(fake_count(l, NODEMSG_GO), 0);
  node_data_link_up(job);
  mesh_advance(job);
  const struct nodemsg *go = fake_last(l, NODEMSG_GO);
  ck_assert_ptr_nonnull(go);
  ck_assert(!go->differ);
  /* The root's own node heard go in the same turn, from the inbox. */
  ck_assert_int_eq(F.gos, 1);
  ck_assert(!F.go_differ);
  mesh_moved(job);
  mesh_advance(job);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PUBLISH), 0);
  struct nodemsg moved = msg_of(NODEMSG_MOVED, 1);
  fake_deliver(l, &moved);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PUBLISH), 1);
  mesh_advance(job);
  ck_assert_int_eq(F.publishes, 1);
  ck_assert_int_eq(F.fails, 0);
}
END_TEST

/* A save (docs/checkpoints.md): the plan carries the ranks' one limit,
 * and after publish the root holds the commit, one step at a time: it
 * tells every node a step only once every node's ranks reported it. */
START_TEST(root_holds_a_saves_commit) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 0, 0);
  job->members[0]->ask.save.limit = 4096;
  mesh_asks(job);
  mesh_advance(job);
  struct nodemsg a = {.op = NODEMSG_ASK, .gather = 1, .rank = 1,
                      .save = {.limit = 4096}};
  fake_deliver(l, &a);
  fake_deliver_blob(l, node1_meta, sizeof node1_meta);
  const struct nodemsg *p = fake_last(l, NODEMSG_PLAN);
  ck_assert_ptr_nonnull(p);
  ck_assert_uint_eq(p->save_limit, 4096);
  mesh_advance(job);
  ck_assert_int_eq(F.starts, 1);
  struct replica_digests none = {0};
  mesh_planned(job, 0x77, &none);
  node_planned(l, 0x77);
  node_data_link_up(job);
  mesh_advance(job);
  ck_assert_int_eq(F.gos, 1);
  mesh_moved(job);
  struct nodemsg moved = msg_of(NODEMSG_MOVED, 1);
  fake_deliver(l, &moved);
  mesh_advance(job);
  ck_assert_int_eq(F.publishes, 1);
  for (uint32_t step = 1; step <= SAVE_STEPS; step++) {
    mesh_saved(job, step);
    mesh_advance(job);
    /* The root's own node reported; node 1 has not. */
    ck_assert_uint_eq(fake_count(l, NODEMSG_COMMIT), step - 1);
    ck_assert_uint_eq(F.committed, step - 1);
    struct nodemsg saved = {.op = NODEMSG_SAVED, .gather = 1, .step = step};
    fake_deliver(l, &saved);
    const struct nodemsg *c = fake_last(l, NODEMSG_COMMIT);
    ck_assert_uint_eq(fake_count(l, NODEMSG_COMMIT), step);
    ck_assert_uint_eq(c->step, step);
    mesh_advance(job);
    ck_assert_uint_eq(F.committed, step);
  }
  ck_assert_int_eq(F.fails, 0);
}
END_TEST

/* Ranks that disagree on whether to save fail the gather everywhere. */
START_TEST(root_fails_a_gather_of_a_save_and_an_export) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 0, 0);
  job->members[0]->ask.save.limit = 4096;
  mesh_asks(job);
  mesh_advance(job);
  node_asks(l, 1, 1, 0);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PLAN), 0);
  const struct nodemsg *f = fake_last(l, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(f->code, SP_EINVAL);
  ck_assert_str_eq(f->message, "ranks disagree on what to do: rank 0 asked "
                               "for a save, rank 1 for an export");
}
END_TEST

/* Node 1's rank asks for a save with save (its limit 4096 like rank 0's);
 * the root's answer: the gather's failure, which every node hears. */
static const struct nodemsg *save_gather_failure(const struct req_save *save,
                                                 const struct req_save *theirs) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 0, 0);
  job->members[0]->ask.save = *save;
  mesh_asks(job);
  mesh_advance(job);
  struct nodemsg a = {.op = NODEMSG_ASK, .gather = 1, .rank = 1,
                      .save = *theirs};
  fake_deliver(l, &a);
  fake_deliver_blob(l, node1_meta, sizeof node1_meta);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PLAN), 0);
  const struct nodemsg *f = fake_last(l, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  return f;
}

/* What ranks on different nodes must pass alike travels with their asks
 * and is compared by the root: the directory, the metadata, overwrite. */
START_TEST(root_fails_a_save_whose_ranks_disagree_across_nodes) {
  struct req_save mine = {.limit = 4096, .directory = 11, .metadata = 22};
  struct req_save theirs = mine;
  theirs.directory = 12;
  const struct nodemsg *f = save_gather_failure(&mine, &theirs);
  ck_assert_int_eq(f->code, SP_EINVAL);
  ck_assert_str_eq(f->message, "ranks disagree on the save's directory: "
                               "ranks 0 and 1 name different ones (after "
                               "following symbolic links and their own "
                               "working directories)");
}
END_TEST

START_TEST(root_fails_a_save_whose_ranks_pass_other_metadata) {
  struct req_save mine = {.limit = 4096, .directory = 11, .metadata = 22};
  struct req_save theirs = mine;
  theirs.metadata = 23;
  const struct nodemsg *f = save_gather_failure(&mine, &theirs);
  ck_assert_int_eq(f->code, SP_EINVAL);
  ck_assert_str_eq(f->message, "ranks disagree on the save's metadata: "
                               "ranks 0 and 1 passed different strings");
}
END_TEST

START_TEST(root_fails_a_save_whose_ranks_disagree_on_overwrite) {
  struct req_save mine = {.limit = 4096, .directory = 11, .metadata = 22};
  struct req_save theirs = mine;
  theirs.overwrite = true;
  const struct nodemsg *f = save_gather_failure(&mine, &theirs);
  ck_assert_int_eq(f->code, SP_EINVAL);
  ck_assert_str_eq(f->message, "ranks disagree on the save's overwrite: "
                               "rank 0 asked false, rank 1 true");
}
END_TEST

/* A rank that cannot take part says why in its ask; every node hears its
 * code and words, naming it. */
START_TEST(root_fails_a_save_a_rank_of_another_node_refused) {
  struct req_save mine = {.limit = 4096, .directory = 11, .metadata = 22};
  struct req_save theirs = {.limit = 4096, .refused = SP_EWRITE};
  snprintf(theirs.refusal, sizeof theirs.refusal,
           "save: cannot make directory /x: Permission denied");
  const struct nodemsg *f = save_gather_failure(&mine, &theirs);
  ck_assert_int_eq(f->code, SP_EWRITE);
  ck_assert_str_eq(f->message, "the save was refused by rank 1: save: cannot "
                               "make directory /x: Permission denied");
}
END_TEST

START_TEST(root_fails_different_plans_everywhere) {
  struct nodelink *l;
  struct job *job = root_export_started(&l);
  struct replica_digests none = {0};
  node_data_link_up(job);
  mesh_planned(job, 0x1234, &none);
  mesh_advance(job);
  node_planned(l, 0x9999);
  ck_assert_uint_eq(fake_count(l, NODEMSG_GO), 0);
  const struct nodemsg *f = fake_last(l, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(f->code, SP_EDIGEST);
  char want[256];
  snprintf(want, sizeof want,
           "daemons computed different plans for export 1 of job %s: node 0 "
           "0000000000001234 node 1 0000000000009999",
           job->hex);
  ck_assert_str_eq(f->message, want);
  mesh_advance(job);
  ck_assert_int_eq(F.fails, 1);
  ck_assert_int_eq(F.fail_code, SP_EDIGEST);
  ck_assert_str_eq(F.fail_msg, want);
  ck_assert_int_eq(F.gos, 0);
}
END_TEST

START_TEST(root_fails_a_gather_whose_ranks_disagree) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 10, 0);
  mesh_asks(job);
  mesh_advance(job);
  node_asks(l, 1, 1, 20);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PLAN), 0);
  const struct nodemsg *f = fake_last(l, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(f->code, SP_EINVAL);
  ck_assert_uint_eq(f->gather, 1);
  char want[256];
  snprintf(want, sizeof want,
           "ranks disagree on the export options: rank 0 asked max_keys 10 "
           "and max_bytes %llu, rank 1 asked 20 and %llu",
           (unsigned long long)F.cfg.max_bytes,
           (unsigned long long)F.cfg.max_bytes);
  ck_assert_str_eq(f->message, want);
  mesh_advance(job);
  ck_assert_int_eq(F.fail_asks, 1);
  ck_assert_int_eq(F.fail_asks_code, SP_EINVAL);
  ck_assert_str_eq(F.fail_asks_msg, want);
  ck_assert_int_eq(F.starts, 0);
  /* The next gather is a new one: an ask of the old one is stale. */
  node_asks(l, 1, 1, 10);
  ck_assert_uint_eq(fake_count(l, NODEMSG_PLAN), 0);
}
END_TEST

START_TEST(root_times_a_gather_out_at_its_deadline) {
  struct nodelink *l;
  struct job *job = root_with_two_nodes(&l);
  fake_ask(job->members[0], 0, 500);
  mesh_asks(job);
  mesh_advance(job);
  F.now = 1499;
  mesh_tick(job);
  ck_assert_uint_eq(fake_count(l, NODEMSG_FAIL), 0);
  F.now = 1500;
  mesh_tick(job);
  const struct nodemsg *f = fake_last(l, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(f->code, SP_ETIMEOUT);
  char want[256];
  snprintf(want, sizeof want,
           "the export of job %s timed out waiting for rank(s) 1 to ask for "
           "it",
           job->hex);
  ck_assert_str_eq(f->message, want);
  mesh_advance(job);
  ck_assert_int_eq(F.fail_asks, 1);
  ck_assert_int_eq(F.fail_asks_code, SP_ETIMEOUT);
  ck_assert_str_eq(F.fail_asks_msg, want);
}
END_TEST

START_TEST(root_names_ranks_that_never_joined) {
  struct job *job = fake_job(3, true);
  fake_member(job, 0);
  mesh_rank_joined(job, 0);
  fake_ask(job->members[0], 0, 100);
  mesh_asks(job);
  mesh_advance(job);
  F.now += 100;
  mesh_tick(job);
  mesh_advance(job);
  char want[256];
  snprintf(want, sizeof want,
           "the export of job %s timed out waiting for rank(s) 1 (not "
           "joined), 2 (not joined) to ask for it",
           job->hex);
  ck_assert_int_eq(F.fail_asks_code, SP_ETIMEOUT);
  ck_assert_str_eq(F.fail_asks_msg, want);
}
END_TEST

START_TEST(root_fails_the_export_of_a_lost_node) {
  struct nodelink *l;
  struct job *job = root_export_started(&l);
  fake_close(l, SP_ECLOSED);
  char reason[256];
  snprintf(reason, sizeof reason, "node 1 (%s) was lost: %s", NODE1_ADDR,
           sp_strerror(SP_ECLOSED));
  ck_assert(F.departed[1]);
  ck_assert_str_eq(F.departed_reason[1], reason);
  ck_assert_int_eq(F.fails, 0);
  mesh_advance(job);
  char want[256];
  snprintf(want, sizeof want, "node 1 (%s) was lost during export 1 of job %s",
           NODE1_ADDR, job->hex);
  ck_assert_int_eq(F.fails, 1);
  ck_assert_int_eq(F.fail_code, SP_ENODELOST);
  ck_assert_str_eq(F.fail_msg, want);
  ck_assert_uint_eq(mesh_node_count(job), 1);
  uint32_t node;
  bool asked;
  ck_assert(!mesh_rank_where(job, 1, &node, &asked));
}
END_TEST

/* A data link's handshake proven for one stream and relabelled on the way
 * as another (its index, the count, another run of the dialling daemon:
 * its node_id, or another session: the export it was dialled for) opens
 * nothing: the root refuses it as it refuses a wrong secret, and the
 * stream it was proven for still opens. */
START_TEST(root_refuses_a_stream_claiming_another) {
  struct nodelink *l;
  struct job *job = root_export_started(&l);
  const struct peerauth_stream proven = {
      .node = 1, .node_id = NODE1_ID, .stream = 0, .streams = 2,
      .export_id = 1};
  struct peerauth_stream claims[4] = {proven, proven, proven, proven};
  claims[0].stream = 1;
  claims[1].streams = 1;
  claims[2].node_id = NODE1_ID + 1;
  claims[3].export_id = 2;
  uint8_t nonce[PEERAUTH_NONCE_BYTES];
  struct nodemsg h;
  for (size_t i = 0; i < sizeof claims / sizeof claims[0]; i++) {
    struct nodelink *d = node_dials_stream(job, &proven, &claims[i], nonce, &h);
    ck_assert_msg(fake_count(d, NODEMSG_DATA) == 0, "claim %zu accepted", i);
    const struct nodemsg *e = fake_last(d, NODEMSG_ERROR);
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->code, SP_ETICKET);
    ck_assert_int_eq(F.fails, 0);
  }
  struct nodelink *d = node_dials_stream(job, &proven, &proven, nonce, &h);
  const struct nodemsg *r = fake_last(d, NODEMSG_DATA);
  ck_assert_ptr_nonnull(r);
  uint8_t want[PEERAUTH_PROOF_BYTES];
  peerauth_proof(job->secret, PEERAUTH_LISTENER, PEERAUTH_DATA, job->id, nonce,
                 h.nonce, &proven, want);
  ck_assert(peerauth_equal(want, r->proof));
  fake_detach(d, give_socket());
}
END_TEST

/* Once an export ended without publishing, a stream dialled for it (its
 * session) is refused, proven or not: it may be a dial that was late, and
 * its pair's bytes of that export may lie in it; one dialled for a later
 * export opens. */
START_TEST(root_refuses_a_stream_of_an_export_that_failed) {
  struct nodelink *l;
  struct job *job = root_export_started(&l);
  node_data_link_up(job);
  mesh_export_free(F.mx);
  F.mx = NULL;
  uint8_t nonce[PEERAUTH_NONCE_BYTES];
  struct nodemsg h;
  struct nodelink *d =
      node_dials_stream(job, &node1_stream0, &node1_stream0, nonce, &h);
  ck_assert_uint_eq(fake_count(d, NODEMSG_DATA), 0);
  const struct nodemsg *e = fake_last(d, NODEMSG_ERROR);
  ck_assert_ptr_nonnull(e);
  ck_assert_int_eq(e->code, SP_ESTATE);
  ck_assert_ptr_nonnull(strstr(e->message, "did not publish"));
  struct peerauth_stream next = node1_stream0;
  next.export_id = 2;
  d = node_dials_stream(job, &next, &next, nonce, &h);
  ck_assert_ptr_nonnull(fake_last(d, NODEMSG_DATA));
  fake_detach(d, give_socket());
}
END_TEST

/* ---- a member ---- */

static void member_ticket(struct req_ticket *t) {
  *t = (struct req_ticket){.version = 2, .world = 2};
  for (int i = 0; i < JOB_ID_BYTES; i++)
    t->job[i] = (uint8_t)(0x70 + i);
  for (int i = 0; i < JOB_SECRET_BYTES; i++)
    t->secret[i] = (uint8_t)(0x30 + i);
  snprintf(t->root, sizeof t->root, "%s", ROOT_ADDR);
}

/* A rank of this daemon joins a job rooted at ROOT_ADDR: the shadow, the
 * link to the root and its handshake (root_proof_ok: whether the root's
 * proof holds).  The join waits for the root's word. */
static struct job *member_says_hello(struct conn *c, bool root_proof_ok,
                                     struct nodelink **root) {
  struct req_ticket t;
  member_ticket(&t);
  struct sp_msg_head head = {.id = 9};
  snprintf(head.op, sizeof head.op, "join");
  struct job *job;
  ck_assert_int_eq(mesh_shadow_job(c, &head, &t, &job), 0);
  ck_assert_ptr_nonnull(job);
  struct req_join req = {.rank = 1, .world = 2,
                         .device_type = SP_DEVICE_CPU};
  ck_assert_int_eq(mesh_join(job, c, &head, &req, 0), 1);
  struct nodelink *r = fake_dialled(ROOT_ADDR, 0);
  ck_assert_ptr_nonnull(r);
  struct nodemsg ch = {.op = NODEMSG_CHALLENGE,
                       .version = NODE_PROTOCOL_VERSION};
  memset(ch.nonce, 0x33, sizeof ch.nonce);
  fake_deliver(r, &ch);
  const struct nodemsg *h = fake_last(r, NODEMSG_HELLO);
  ck_assert_ptr_nonnull(h);
  ck_assert(!h->reply);
  ck_assert_mem_eq(h->job, t.job, JOB_ID_BYTES);
  ck_assert_str_eq(h->addr, F.srv.peer_address);
  uint8_t want[PEERAUTH_PROOF_BYTES];
  peerauth_proof(t.secret, PEERAUTH_DIALER, PEERAUTH_CONTROL, t.job,
                 ch.nonce, h->nonce, NULL, want);
  ck_assert(peerauth_equal(want, h->proof));
  struct nodemsg reply = {.op = NODEMSG_HELLO, .reply = true, .node = 1,
                          .node_id = ROOT_ID};
  peerauth_proof(t.secret, PEERAUTH_LISTENER, PEERAUTH_CONTROL, t.job,
                 ch.nonce, h->nonce, NULL, reply.proof);
  if (!root_proof_ok)
    reply.proof[0] ^= 1;
  fake_deliver(r, &reply);
  *root = r;
  return job;
}

static struct job *member_joined(struct conn *c, struct nodelink **root) {
  struct job *job = member_says_hello(c, true, root);
  const struct nodemsg *j = fake_last(*root, NODEMSG_JOIN);
  ck_assert_ptr_nonnull(j);
  ck_assert_uint_eq(j->rank, 1);
  ck_assert_uint_eq(j->world, 2);
  ck_assert((*root)->awaiting);
  struct nodemsg ok = {.op = NODEMSG_JOIN, .id = j->id, .reply = true};
  fake_deliver(*root, &ok);
  ck_assert_int_eq(F.admits, 1);
  ck_assert_ptr_nonnull(job->members[1]);
  ck_assert(!(*root)->awaiting);
  return job;
}

/* The root's plan of gather and export_id for the member's job: ranks 0
 * (the root's) and 1 (this node's), and their registrations, rank 1's as
 * given. */
static void root_sends_plan_of(struct nodelink *r, const struct nodeblob *meta1,
                               uint64_t gather, uint64_t export_id) {
  struct nodemsg_node nodes[2] = {{.node = 0, .node_id = ROOT_ID},
                                  {.node = 1, .node_id = 1}};
  snprintf(nodes[0].addr, sizeof nodes[0].addr, "%s", ROOT_ADDR);
  snprintf(nodes[1].addr, sizeof nodes[1].addr, "%s", F.srv.peer_address);
  uint32_t rank_nodes[2] = {0, 1};
  struct nodemsg p = {.op = NODEMSG_PLAN,
                      .gather = gather,
                      .export_id = export_id,
                      .world = 2,
                      .max_keys = 64,
                      .max_bytes = 1 << 20,
                      .timeout_ms = 3000,
                      .nnodes = 2,
                      .nodes = nodes,
                      .rank_nodes = rank_nodes};
  fake_deliver(r, &p);
  ck_assert_uint_eq(r->expect_blobs, 2);
  static const uint8_t meta0[] = "rank 0's registrations";
  fake_deliver_blob(r, meta0, sizeof meta0);
  fake_deliver_blob(r, meta1->payload, meta1->len);
}

static void root_sends_plan(struct nodelink *r, const struct nodeblob *meta1) {
  root_sends_plan_of(r, meta1, 1, 1);
}

/* The member's rank asks in gather; the ask and its registrations go to
 * the root. */
static const struct nodeblob *member_asks_in(struct job *job,
                                             struct nodelink *r,
                                             uint64_t gather) {
  size_t asks = fake_count(r, NODEMSG_ASK);
  fake_ask(job->members[1], 64, 3000);
  mesh_asks(job);
  ck_assert_uint_eq(fake_count(r, NODEMSG_ASK), asks + 1);
  const struct nodemsg *a = fake_last(r, NODEMSG_ASK);
  ck_assert_ptr_nonnull(a);
  ck_assert_uint_eq(a->gather, gather);
  ck_assert_uint_eq(a->rank, 1);
  ck_assert_uint_eq(a->max_keys, 64);
  ck_assert_uint_eq(a->timeout_ms, 3000);
  return fake_blob_after(r, NODEMSG_ASK, 0);
}

static const struct nodeblob *member_asks(struct job *job,
                                          struct nodelink *r) {
  return member_asks_in(job, r, 1);
}

/* The member's newest dials, one per stream, answered by the root: each
 * names export_id as its session and is proven for it. */
static void root_answers_streams(struct job *job, uint64_t export_id) {
  uint32_t streams = F.cfg.peer_streams;
  bool seen[REMOTE_STREAMS_MAX] = {false};
  for (uint32_t i = 0; i < streams; i++) {
    struct nodelink *d = fake_dialled(ROOT_ADDR, i);
    ck_assert_ptr_nonnull(d);
    struct nodemsg ch = {.op = NODEMSG_CHALLENGE,
                         .version = NODE_PROTOCOL_VERSION};
    memset(ch.nonce, 0x44 + (int)i, sizeof ch.nonce);
    fake_deliver(d, &ch);
    const struct nodemsg *h = fake_last(d, NODEMSG_DATA);
    ck_assert_ptr_nonnull(h);
    ck_assert_uint_eq(h->export_id, export_id);
    ck_assert(!seen[h->stream]);
    seen[h->stream] = true;
    struct peerauth_stream st = {.node = 1, .node_id = h->node_id,
                                 .stream = h->stream, .streams = streams,
                                 .export_id = export_id};
    uint8_t want[PEERAUTH_PROOF_BYTES];
    peerauth_proof(job->secret, PEERAUTH_DIALER, PEERAUTH_DATA, job->id,
                   ch.nonce, h->nonce, &st, want);
    ck_assert(peerauth_equal(want, h->proof));
    struct nodemsg reply = {.op = NODEMSG_DATA, .reply = true};
    peerauth_proof(job->secret, PEERAUTH_LISTENER, PEERAUTH_DATA, job->id,
                   ch.nonce, h->nonce, &st, reply.proof);
    fake_deliver(d, &reply);
    fake_detach(d, give_socket());
  }
}

START_TEST(member_joins_through_its_root) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  ck_assert_ptr_eq(c->member, job->members[1]);
  ck_assert_uint_eq(c->nerrors, 0);
  ck_assert_uint_eq(mesh_self(job), 1);
  ck_assert(!mesh_is_root(job->mesh));
}
END_TEST

START_TEST(member_refuses_a_root_without_the_secret) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  member_says_hello(c, false, &r);
  ck_assert_uint_eq(fake_count(r, NODEMSG_JOIN), 0);
  ck_assert_uint_eq(c->nerrors, 1);
  ck_assert_int_eq(c->error_code, SP_ETICKET);
  ck_assert_str_eq(c->error,
                   "join: the job's root daemon " ROOT_ADDR
                   " refused: it did not prove it knows the job's secret");
  ck_assert(r->closed);
  ck_assert_int_eq(F.ends, 1);
  ck_assert_int_eq(F.admits, 0);
}
END_TEST

START_TEST(member_exports_in_the_roots_steps) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  const struct nodeblob *meta1 = member_asks(job, r);
  root_sends_plan(r, meta1);
  ck_assert_int_eq(F.starts, 1);
  ck_assert_uint_eq(F.start_id, 1);
  ck_assert_uint_eq(F.start_keys, 64);
  ck_assert_uint_eq(F.start_bytes, 1 << 20);
  ck_assert_uint_eq(F.start_timeout, 3000);
  /* The higher node dials the lower: this node dials the root's, once a
   * stream (peer_streams), each proven on its own. */
  uint32_t streams = F.cfg.peer_streams;
  ck_assert_uint_ge(streams, 2);
  ck_assert_ptr_eq(fake_dialled(ROOT_ADDR, streams), r);
  struct replica_digests none = {0};
  mesh_planned(job, 77, &none);
  bool seen[REMOTE_STREAMS_MAX] = {false};
  for (uint32_t i = 0; i < streams; i++) {
    /* Planned waits for every stream. */
    ck_assert_uint_eq(fake_count(r, NODEMSG_PLANNED), 0);
    struct nodelink *d = fake_dialled(ROOT_ADDR, i);
    struct nodemsg ch = {.op = NODEMSG_CHALLENGE,
                         .version = NODE_PROTOCOL_VERSION};
    memset(ch.nonce, 0x44 + (int)i, sizeof ch.nonce);
    fake_deliver(d, &ch);
    const struct nodemsg *h = fake_last(d, NODEMSG_DATA);
    ck_assert_ptr_nonnull(h);
    ck_assert_uint_eq(h->node, 1);
    ck_assert_uint_eq(h->streams, streams);
    ck_assert_uint_lt(h->stream, streams);
    ck_assert(!seen[h->stream]);
    seen[h->stream] = true;
    uint8_t want[PEERAUTH_PROOF_BYTES];
    ck_assert_uint_eq(h->export_id, 1);
    struct peerauth_stream st = {.node = 1, .node_id = h->node_id,
                                 .stream = h->stream, .streams = streams,
                                 .export_id = 1};
    peerauth_proof(job->secret, PEERAUTH_DIALER, PEERAUTH_DATA, job->id,
                   ch.nonce, h->nonce, &st, want);
    ck_assert(peerauth_equal(want, h->proof));
    struct nodemsg reply = {.op = NODEMSG_DATA, .reply = true};
    peerauth_proof(job->secret, PEERAUTH_LISTENER, PEERAUTH_DATA, job->id,
                   ch.nonce, h->nonce, &st, reply.proof);
    fake_deliver(d, &reply);
    fake_detach(d, give_socket());
  }
  const struct nodemsg *p = fake_last(r, NODEMSG_PLANNED);
  ck_assert_ptr_nonnull(p);
  ck_assert_uint_eq(p->gather, 1);
  ck_assert_uint_eq(p->digest, 77);
  struct nodemsg go = msg_of(NODEMSG_GO, 1);
  fake_deliver(r, &go);
  ck_assert_int_eq(F.gos, 1);
  ck_assert(!F.go_differ);
  mesh_moved(job);
  const struct nodemsg *m = fake_last(r, NODEMSG_MOVED);
  ck_assert_ptr_nonnull(m);
  ck_assert_uint_eq(m->gather, 1);
  struct nodemsg publish = msg_of(NODEMSG_PUBLISH, 1);
  fake_deliver(r, &publish);
  ck_assert_int_eq(F.publishes, 1);
  ck_assert_int_eq(F.fails, 0);
}
END_TEST

/* An export that moved and failed may have left bytes in any stream of
 * the link: the next export dials every stream again, as a session of its
 * own, though the old sockets still look alive; one that published keeps
 * them. */
START_TEST(member_dials_its_streams_again_after_a_failed_export) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  uint32_t streams = F.cfg.peer_streams;
  root_sends_plan(r, member_asks(job, r));
  struct replica_digests none = {0};
  mesh_planned(job, 77, &none);
  ck_assert_ptr_eq(fake_dialled(ROOT_ADDR, streams), r);
  root_answers_streams(job, 1);
  ck_assert_uint_eq(fake_count(r, NODEMSG_PLANNED), 1);
  struct nodemsg go = msg_of(NODEMSG_GO, 1);
  fake_deliver(r, &go);
  struct nodemsg fail = {.op = NODEMSG_FAIL, .gather = 1,
                         .code = SP_ENODELOST};
  snprintf(fail.message, sizeof fail.message, "a stream was cut");
  fake_deliver(r, &fail);
  ck_assert_int_eq(F.fails, 1);
  /* The export is over (export.c frees it once its threads are done). */
  mesh_export_free(F.mx);
  F.mx = NULL;
  root_sends_plan_of(r, member_asks_in(job, r, 2), 2, 2);
  ck_assert_int_eq(F.starts, 2);
  /* Every stream dialled anew (the newest links come first). */
  ck_assert_ptr_eq(fake_dialled(ROOT_ADDR, 2 * streams), r);
  mesh_planned(job, 78, &none);
  ck_assert_uint_eq(fake_count(r, NODEMSG_PLANNED), 1);
  root_answers_streams(job, 2);
  ck_assert_uint_eq(fake_count(r, NODEMSG_PLANNED), 2);
  /* This one publishes: the next export dials nothing. */
  go = msg_of(NODEMSG_GO, 2);
  fake_deliver(r, &go);
  mesh_moved(job);
  struct nodemsg publish = msg_of(NODEMSG_PUBLISH, 2);
  fake_deliver(r, &publish);
  ck_assert_int_eq(F.publishes, 1);
  mesh_export_free(F.mx);
  F.mx = NULL;
  root_sends_plan_of(r, member_asks_in(job, r, 3), 3, 3);
  ck_assert_int_eq(F.starts, 3);
  ck_assert_ptr_eq(fake_dialled(ROOT_ADDR, 2 * streams), r);
  mesh_planned(job, 79, &none);
  ck_assert_uint_eq(fake_count(r, NODEMSG_PLANNED), 3);
}
END_TEST

START_TEST(member_refuses_registrations_it_did_not_send) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  const struct nodeblob *sent = member_asks(job, r);
  /* As long as what the node sent, one byte the root's choosing. */
  uint8_t *forged = malloc(sent->len);
  ck_assert_ptr_nonnull(forged);
  memcpy(forged, sent->payload, sent->len);
  forged[sent->len - 1] ^= 1;
  struct nodeblob fake = {.payload = forged, .len = sent->len};
  root_sends_plan(r, &fake);
  free(forged);
  ck_assert_int_eq(F.starts, 0);
  const struct nodemsg *f = fake_last(r, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(f->code, SP_EBADMSG);
  ck_assert_str_eq(f->message, "the root relayed registrations of rank 1 "
                               "that its node did not send");
  ck_assert_int_eq(F.fail_asks, 1);
  ck_assert_int_eq(F.fail_asks_code, SP_EBADMSG);
}
END_TEST

START_TEST(member_fails_on_the_roots_word) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  root_sends_plan(r, member_asks(job, r));
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = 1, .code = SP_EDIGEST};
  snprintf(f.message, sizeof f.message, "the plans differ");
  fake_deliver(r, &f);
  ck_assert_int_eq(F.fails, 1);
  ck_assert_int_eq(F.fail_code, SP_EDIGEST);
  ck_assert_str_eq(F.fail_msg, "the plans differ");
  /* A failure found here goes to the root. */
  mesh_failed(job, SP_EIO, "a copy failed");
  const struct nodemsg *up = fake_last(r, NODEMSG_FAIL);
  ck_assert_ptr_nonnull(up);
  ck_assert_int_eq(up->code, SP_EIO);
  ck_assert_str_eq(up->message, "a copy failed");
}
END_TEST

START_TEST(member_loses_its_root) {
  struct conn *c = fake_conn();
  struct nodelink *r;
  struct job *job = member_joined(c, &r);
  root_sends_plan(r, member_asks(job, r));
  fake_close(r, SP_ECLOSED);
  char want[256];
  snprintf(want, sizeof want,
           "node 0 (" ROOT_ADDR ") was lost during export 1 of job %s",
           job->hex);
  ck_assert_int_eq(F.fails, 1);
  ck_assert_int_eq(F.fail_code, SP_ENODELOST);
  ck_assert_str_eq(F.fail_msg, want);
  /* The job cannot export again: a later join hears why. */
  struct conn *late = fake_conn();
  struct sp_msg_head head = {.id = 11};
  struct req_join req = {.rank = 0, .world = 2};
  ck_assert_int_eq(mesh_join(job, late, &head, &req, 0), 1);
  ck_assert_int_eq(late->error_code, SP_ENODELOST);
  char join_msg[300];
  snprintf(join_msg, sizeof join_msg, "join: %s", want);
  ck_assert_str_eq(late->error, join_msg);
}
END_TEST

static Suite *mesh_suite(void) {
  Suite *s = suite_create("mesh");
  TCase *root = tcase_create("root");
  tcase_add_checked_fixture(root, setup, teardown);
  tcase_add_test(root, root_joins_a_node_and_its_rank);
  tcase_add_test(root, root_refuses_a_rank_joined_twice);
  tcase_add_test(root, root_refuses_a_node_without_the_secret);
  tcase_add_test(root, root_holds_a_saves_commit);
  tcase_add_test(root, root_fails_a_gather_of_a_save_and_an_export);
  tcase_add_test(root, root_fails_a_save_whose_ranks_disagree_across_nodes);
  tcase_add_test(root, root_fails_a_save_whose_ranks_pass_other_metadata);
  tcase_add_test(root, root_fails_a_save_whose_ranks_disagree_on_overwrite);
  tcase_add_test(root, root_fails_a_save_a_rank_of_another_node_refused);
  tcase_add_test(root, root_gathers_plans_and_publishes);
  tcase_add_test(root, root_fails_different_plans_everywhere);
  tcase_add_test(root, root_fails_a_gather_whose_ranks_disagree);
  tcase_add_test(root, root_times_a_gather_out_at_its_deadline);
  tcase_add_test(root, root_names_ranks_that_never_joined);
  tcase_add_test(root, root_fails_the_export_of_a_lost_node);
  tcase_add_test(root, root_refuses_a_stream_claiming_another);
  tcase_add_test(root, root_refuses_a_stream_of_an_export_that_failed);
  suite_add_tcase(s, root);
  TCase *member = tcase_create("member");
  tcase_add_checked_fixture(member, setup, teardown);
  tcase_add_test(member, member_joins_through_its_root);
  tcase_add_test(member, member_refuses_a_root_without_the_secret);
  tcase_add_test(member, member_exports_in_the_roots_steps);
  tcase_add_test(member, member_dials_its_streams_again_after_a_failed_export);
  tcase_add_test(member, member_refuses_registrations_it_did_not_send);
  tcase_add_test(member, member_fails_on_the_roots_word);
  tcase_add_test(member, member_loses_its_root);
  suite_add_tcase(s, member);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(mesh_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
