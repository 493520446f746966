/*
 * test_nodemsg.c - what daemons read from each other, read the way it is
 * read from clients: peer addresses, version 2 tickets, every message
 * between daemons (round trips and refusals of fields that are missing,
 * mistyped or out of bounds), and a rank's registrations as a `meta` map
 * rebuilt into a registry of the remote rank with the registration checks.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/mesh/nodelink.h"
#include "daemon/mesh/nodemsg.h"
#include "daemon/netaddr.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/wire.h"
#include "shardport.h"

/* ---- addresses ---- */

static int addr(const char *s, bool port_optional) {
  struct sockaddr_storage sa;
  socklen_t len;
  return netaddr_parse(s, strlen(s), port_optional, &sa, &len);
}

START_TEST(peer_addresses) {
  ck_assert_int_eq(addr("127.0.0.1:7070", false), 0);
  ck_assert_int_eq(addr("10.0.0.1:0", false), 0);
  ck_assert_int_eq(addr("[::1]:65535", false), 0);
  ck_assert_int_eq(addr("[fd00::1]", true), 0);
  ck_assert_int_eq(addr("10.0.0.1", true), 0);
  /* Names, missing or bad ports, junk: never resolved, refused. */
  const char *bad[] = {"localhost:7070", "10.0.0.1", "10.0.0.1:",
                       "10.0.0.1:65536", "10.0.0.1:123456", "10.0.0.1:7a",
                       ":7070", "[::1", "[::1]7070", "::1:7070",
                       "10.0.0.256:1", "", "[10.0.0.1]:1"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(addr(bad[i], false) == SP_EINVAL, "\"%s\" accepted", bad[i]);
  char longer[200];
  memset(longer, '1', sizeof longer - 1);
  longer[sizeof longer - 1] = '\0';
  ck_assert_int_eq(addr(longer, true), SP_EINVAL);
  /* A NUL inside is not a shorter address. */
  struct sockaddr_storage sa;
  socklen_t len;
  ck_assert_int_eq(netaddr_parse("1.2.3.4:5\0x", 11, false, &sa, &len),
                   SP_EINVAL);
  char text[NODE_ADDR_MAX];
  ck_assert_int_eq(addr("[::1]:80", false), 0);
  netaddr_parse("[::1]:80", 8, false, &sa, &len);
  netaddr_format((struct sockaddr *)&sa, text, sizeof text);
  ck_assert_str_eq(text, "[::1]:80");
}
END_TEST

/* ---- tickets ---- */

static int parse_ticket(void (*fill)(msgpack_packer *pk), struct req_ticket *t) {
  msgpack_sbuffer sb;
  msgpack_packer pk;
  msgpack_sbuffer_init(&sb);
  msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
  fill(&pk);
  struct sp_limits limits;
  sp__limits_default(&limits);
  int rc = request_parse_ticket((const uint8_t *)sb.data, sb.size, &limits, t);
  msgpack_sbuffer_destroy(&sb);
  return rc;
}

static const uint8_t id16[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                 14, 15, 16};

static void common(msgpack_packer *pk, uint64_t v, uint32_t n) {
  msgpack_pack_map(pk, n);
  sp__pack_kv_u64(pk, "v", v);
  sp__pack_str(pk, "job");
  sp__pack_bin(pk, id16, 16);
  sp__pack_str(pk, "secret");
  sp__pack_bin(pk, id16, 16);
  sp__pack_kv_u64(pk, "world", 4);
}

static void v1(msgpack_packer *pk) { common(pk, 1, 4); }
static void v2(msgpack_packer *pk) {
  common(pk, 2, 5);
  sp__pack_kv_str(pk, "root", "10.1.2.3:7070");
}
static void v2_nccl(msgpack_packer *pk) {
  uint8_t id[NODE_NCCL_ID_BYTES] = {7};
  common(pk, 2, 6);
  sp__pack_kv_str(pk, "root", "[fd00::2]:1");
  sp__pack_str(pk, "nccl_id");
  sp__pack_bin(pk, id, sizeof id);
}
static void v2_no_root(msgpack_packer *pk) { common(pk, 2, 4); }
static void v2_name_root(msgpack_packer *pk) {
  common(pk, 2, 5);
  sp__pack_kv_str(pk, "root", "rootnode:7070");
}
static void v2_short_nccl(msgpack_packer *pk) {
  common(pk, 2, 6);
  sp__pack_kv_str(pk, "root", "10.1.2.3:7070");
  sp__pack_str(pk, "nccl_id");
  sp__pack_bin(pk, id16, 16);
}
static void v3(msgpack_packer *pk) {
  common(pk, 3, 5);
  sp__pack_kv_str(pk, "root", "10.1.2.3:7070");
}

START_TEST(tickets_of_both_versions) {
  struct req_ticket t;
  ck_assert_int_eq(parse_ticket(v1, &t), 0);
  ck_assert_uint_eq(t.version, 1);
  ck_assert_str_eq(t.root, "");
  ck_assert_int_eq(parse_ticket(v2, &t), 0);
  ck_assert_uint_eq(t.version, 2);
  ck_assert_str_eq(t.root, "10.1.2.3:7070");
  ck_assert(!t.has_nccl_id);
  ck_assert_int_eq(parse_ticket(v2_nccl, &t), 0);
  ck_assert(t.has_nccl_id);
  ck_assert_uint_eq(t.nccl_id[0], 7);
  ck_assert_str_eq(t.root, "[fd00::2]:1");
  ck_assert_int_eq(parse_ticket(v2_no_root, &t), SP_ETICKET);
  ck_assert_int_eq(parse_ticket(v2_name_root, &t), SP_ETICKET);
  ck_assert_int_eq(parse_ticket(v2_short_nccl, &t), SP_ETICKET);
  ck_assert_int_eq(parse_ticket(v3, &t), SP_ETICKET);
}
END_TEST

/* ---- messages ---- */

struct decoded {
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
  uint8_t *buf;
};

static void decode(struct sp_msgbuf *mb, struct decoded *d) {
  struct sp_frame_tx tx;
  ck_assert_int_eq(sp__msgbuf_finish(mb, &tx), 0);
  d->buf = tx.buf;
  struct sp_limits limits;
  sp__limits_default(&limits);
  msgpack_zone_init(&d->zone, 4096);
  ck_assert_int_eq(sp__wire_decode(tx.buf + SP_FRAME_HEADER,
                                   tx.len - SP_FRAME_HEADER, &limits, &d->zone,
                                   &d->map),
                   0);
  ck_assert_int_eq(sp__msg_head(&d->map, &d->head), 0);
}

static void decoded_free(struct decoded *d) {
  msgpack_zone_destroy(&d->zone);
  free(d->buf);
}

/* Packs m and parses it back. */
static int round_trip(const struct nodemsg *m, struct nodemsg *out) {
  struct sp_msgbuf mb;
  struct decoded d;
  char msg[256];
  nodemsg_pack(m, &mb);
  decode(&mb, &d);
  int rc = nodemsg_parse(&d.head, &d.map, out, msg, sizeof msg);
  decoded_free(&d);
  return rc;
}

START_TEST(messages_round_trip) {
  struct nodemsg in, out;
  in = (struct nodemsg){.op = NODEMSG_CHALLENGE, .version = 2};
  memset(in.nonce, 0x5a, sizeof in.nonce);
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_int_eq(out.op, NODEMSG_CHALLENGE);
  ck_assert_uint_eq(out.version, 2);
  ck_assert_mem_eq(out.nonce, in.nonce, sizeof in.nonce);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_HELLO, .version = 2, .node_id = 99};
  memcpy(in.job, id16, 16);
  memset(in.nonce, 0x11, sizeof in.nonce);
  memset(in.proof, 0x22, sizeof in.proof);
  snprintf(in.addr, sizeof in.addr, "10.0.0.9:7070");
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_int_eq(out.op, NODEMSG_HELLO);
  ck_assert(!out.reply);
  ck_assert_str_eq(out.addr, "10.0.0.9:7070");
  ck_assert_uint_eq(out.node_id, 99);
  ck_assert_mem_eq(out.nonce, in.nonce, sizeof in.nonce);
  ck_assert_mem_eq(out.proof, in.proof, sizeof in.proof);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_HELLO, .reply = true, .node = 3,
                        .node_id = 5};
  memset(in.proof, 0x33, sizeof in.proof);
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(out.reply);
  ck_assert_uint_eq(out.node, 3);
  ck_assert_mem_eq(out.proof, in.proof, sizeof in.proof);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_DATA, .version = 5, .node = 3,
                        .node_id = 9, .stream = 7, .streams = 8,
                        .export_id = UINT64_MAX};
  memcpy(in.job, id16, sizeof in.job);
  memset(in.nonce, 0x55, sizeof in.nonce);
  memset(in.proof, 0x66, sizeof in.proof);
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(!out.reply);
  ck_assert_uint_eq(out.node, 3);
  ck_assert_uint_eq(out.stream, 7);
  ck_assert_uint_eq(out.streams, 8);
  ck_assert_uint_eq(out.export_id, UINT64_MAX);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_DATA, .reply = true};
  memset(in.proof, 0x44, sizeof in.proof);
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(out.reply);
  ck_assert_mem_eq(out.proof, in.proof, sizeof in.proof);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_ASK, .gather = 7, .rank = 2,
                        .max_keys = 4, .max_bytes = 1u << 20,
                        .timeout_ms = 2000};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.gather, 7);
  ck_assert_uint_eq(out.rank, 2);
  ck_assert_uint_eq(out.max_bytes, 1u << 20);
  ck_assert_uint_eq(out.timeout_ms, 2000);
  nodemsg_free(&out);

  /* A save's ask: what every rank must ask alike, and a refusal. */
  in.save = (struct req_save){.limit = 4096, .overwrite = true,
                              .directory = UINT64_MAX, .metadata = 5,
                              .refused = SP_EWRITE};
  snprintf(in.save.refusal, sizeof in.save.refusal, "save: cannot open");
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.save.limit, 4096);
  ck_assert(out.save.overwrite);
  ck_assert_uint_eq(out.save.directory, UINT64_MAX);
  ck_assert_uint_eq(out.save.metadata, 5);
  ck_assert_int_eq(out.save.refused, SP_EWRITE);
  ck_assert_str_eq(out.save.refusal, "save: cannot open");
  nodemsg_free(&out);

  struct nodemsg_node nodes[2] = {{.node = 0, .node_id = 1},
                                  {.node = 2, .node_id = 8}};
  snprintf(nodes[0].addr, NODE_ADDR_MAX, "10.0.0.1:1");
  snprintf(nodes[1].addr, NODE_ADDR_MAX, "[::1]:2");
  uint32_t rank_nodes[3] = {0, 2, 2};
  in = (struct nodemsg){.op = NODEMSG_PLAN, .gather = 1, .export_id = 4,
                        .max_keys = 4096, .timeout_ms = 100, .world = 3,
                        .nnodes = 2, .nodes = nodes, .rank_nodes = rank_nodes};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.world, 3);
  ck_assert_uint_eq(out.nnodes, 2);
  ck_assert_str_eq(out.nodes[1].addr, "[::1]:2");
  ck_assert_uint_eq(out.rank_nodes[1], 2);
  ck_assert_uint_eq(out.comm_gen, 0);
  nodemsg_free(&out);

  /* A new generation of the job's communicators and its NCCL id. */
  in.comm_gen = 3;
  for (size_t i = 0; i < sizeof in.nccl_id; i++)
    in.nccl_id[i] = (uint8_t)(i * 7 + 1);
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.comm_gen, 3);
  ck_assert_mem_eq(out.nccl_id, in.nccl_id, sizeof in.nccl_id);
  ck_assert_uint_eq(out.nnodes, 2);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_PLANNED, .gather = 1,
                        .digest = UINT64_MAX, .code = SP_ETILING};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.digest, UINT64_MAX);
  ck_assert_int_eq(out.code, SP_ETILING);
  nodemsg_free(&out);

  /* A node's digests of its replicated keys, over two bins (a control
   * frame's bins hold a mebibyte), in any byte order; and the root's
   * word that two nodes' differ. */
  size_t n = (1u << 17) + 3;
  uint64_t *digests = malloc(n * sizeof *digests);
  for (size_t i = 0; i < n; i++)
    digests[i] = 0x0102030405060708ull * (i + 1);
  in = (struct nodemsg){.op = NODEMSG_PLANNED, .gather = 1, .digest = 9,
                        .replica_rank = REQ_MAX_WORLD - 1, .nreplicas = n,
                        .replicas = digests};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_uint_eq(out.replica_rank, REQ_MAX_WORLD - 1);
  ck_assert_uint_eq(out.nreplicas, n);
  ck_assert_mem_eq(out.replicas, digests, n * sizeof *digests);
  ck_assert_int_eq(out.code, 0);
  nodemsg_free(&out);
  free(digests);
  in = (struct nodemsg){.op = NODEMSG_GO, .gather = 3, .differ = true,
                        .differ_key = 7, .differ_ranks = {0, 5},
                        .differ_digests = {UINT64_MAX, 1}};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(out.differ);
  ck_assert_uint_eq(out.differ_key, 7);
  ck_assert_uint_eq(out.differ_ranks[1], 5);
  ck_assert_uint_eq(out.differ_digests[0], UINT64_MAX);
  nodemsg_free(&out);
  in = (struct nodemsg){.op = NODEMSG_GO, .gather = 3};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(!out.differ);
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_FAIL, .gather = 2, .code = SP_ENODELOST};
  snprintf(in.message, sizeof in.message, "node 1 (x) was lost");
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_int_eq(out.code, SP_ENODELOST);
  ck_assert_str_eq(out.message, "node 1 (x) was lost");
  nodemsg_free(&out);

  in = (struct nodemsg){.op = NODEMSG_ABORT, .code = SP_EABORTED};
  snprintf(in.message, sizeof in.message, "job J was aborted by uid 0");
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_int_eq(out.op, NODEMSG_ABORT);
  ck_assert_int_eq(out.code, SP_EABORTED);
  ck_assert_str_eq(out.message, "job J was aborted by uid 0");
  nodemsg_free(&out);

  const enum nodemsg_op plain[] = {NODEMSG_GO, NODEMSG_MOVED, NODEMSG_PUBLISH,
                                   NODEMSG_BEAT, NODEMSG_BYE};
  for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
    in = (struct nodemsg){.op = plain[i], .gather = 11};
    ck_assert_int_eq(round_trip(&in, &out), 0);
    ck_assert_int_eq(out.op, plain[i]);
    nodemsg_free(&out);
  }
  in = (struct nodemsg){.op = NODEMSG_LEFT, .rank = 5, .disconnected = true};
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert(out.disconnected);
  ck_assert_str_eq(out.message, "");
  nodemsg_free(&out);
  /* With why the rank left, when its daemon knows. */
  snprintf(in.message, sizeof in.message,
           "rank 5's registration was refused: view_out_of_bounds: x");
  ck_assert_int_eq(round_trip(&in, &out), 0);
  ck_assert_str_eq(out.message,
                   "rank 5's registration was refused: view_out_of_bounds: x");
  nodemsg_free(&out);
}
END_TEST

/* A message of op with the fields fill packs (nfields of them). */
static int parse_crafted(const char *op, uint32_t nfields,
                         void (*fill)(msgpack_packer *pk), char *why,
                         size_t len) {
  struct sp_msgbuf mb;
  struct decoded d;
  struct nodemsg out;
  sp__msgbuf_begin(&mb, op, 0, nfields);
  fill(&mb.pk);
  decode(&mb, &d);
  int rc = nodemsg_parse(&d.head, &d.map, &out, why, len);
  nodemsg_free(&out);
  decoded_free(&d);
  return rc;
}

static void hello_short_proof(msgpack_packer *pk) {
  uint8_t bytes[32] = {0};
  sp__pack_kv_u64(pk, "version", 2);
  sp__pack_str(pk, "job");
  sp__pack_bin(pk, id16, 16);
  sp__pack_str(pk, "nonce");
  sp__pack_bin(pk, bytes, 32);
  sp__pack_str(pk, "proof");
  sp__pack_bin(pk, bytes, 31);
  sp__pack_kv_str(pk, "addr", "10.0.0.1:1");
  sp__pack_kv_u64(pk, "node_id", 1);
}

static void hello_name_addr(msgpack_packer *pk) {
  uint8_t bytes[32] = {0};
  sp__pack_kv_u64(pk, "version", 2);
  sp__pack_str(pk, "job");
  sp__pack_bin(pk, id16, 16);
  sp__pack_str(pk, "nonce");
  sp__pack_bin(pk, bytes, 32);
  sp__pack_str(pk, "proof");
  sp__pack_bin(pk, bytes, 32);
  sp__pack_kv_str(pk, "addr", "evil.example:1");
  sp__pack_kv_u64(pk, "node_id", 1);
}

static void challenge_short_nonce(msgpack_packer *pk) {
  uint8_t bytes[32] = {0};
  sp__pack_kv_u64(pk, "version", 2);
  sp__pack_str(pk, "nonce");
  sp__pack_bin(pk, bytes, 16);
}

static void ask_big_rank(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "rank", REQ_MAX_WORLD);
  sp__pack_kv_u64(pk, "max_keys", 0);
  sp__pack_kv_u64(pk, "max_bytes", 0);
  sp__pack_kv_u64(pk, "timeout_ms", 0);
}

static void ask_long_timeout(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "rank", 0);
  sp__pack_kv_u64(pk, "max_keys", 0);
  sp__pack_kv_u64(pk, "max_bytes", 0);
  sp__pack_kv_u64(pk, "timeout_ms", REQ_MAX_TIMEOUT_MS + 1);
}

/* A save's ask without the options every rank must ask alike. */
static void ask_save_bare(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "rank", 0);
  sp__pack_kv_u64(pk, "max_keys", 0);
  sp__pack_kv_u64(pk, "max_bytes", 0);
  sp__pack_kv_u64(pk, "timeout_ms", 0);
  sp__pack_kv_u64(pk, "save", 4096);
}

static void plan_head(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "export_id", 1);
  sp__pack_kv_u64(pk, "max_keys", 1);
  sp__pack_kv_u64(pk, "max_bytes", 1);
  sp__pack_kv_u64(pk, "timeout_ms", 1);
}

static void pack_node(msgpack_packer *pk, uint64_t node, const char *a) {
  msgpack_pack_map(pk, 3);
  sp__pack_kv_u64(pk, "node", node);
  sp__pack_kv_u64(pk, "node_id", 1);
  sp__pack_kv_str(pk, "addr", a);
}

static void plan_unlisted_node(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_str(pk, "nodes");
  msgpack_pack_array(pk, 1);
  pack_node(pk, 0, "10.0.0.1:1");
  sp__pack_str(pk, "rank_nodes");
  msgpack_pack_array(pk, 2);
  msgpack_pack_uint32(pk, 0);
  msgpack_pack_uint32(pk, 1);
}

static void plan_nodes_twice(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_str(pk, "nodes");
  msgpack_pack_array(pk, 2);
  pack_node(pk, 1, "10.0.0.1:1");
  pack_node(pk, 1, "10.0.0.2:1");
  sp__pack_str(pk, "rank_nodes");
  msgpack_pack_array(pk, 1);
  msgpack_pack_uint32(pk, 1);
}

static void plan_no_ranks(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_str(pk, "nodes");
  msgpack_pack_array(pk, 1);
  pack_node(pk, 0, "10.0.0.1:1");
  sp__pack_str(pk, "rank_nodes");
  msgpack_pack_array(pk, 0);
}

static void plan_tail(msgpack_packer *pk) {
  sp__pack_str(pk, "nodes");
  msgpack_pack_array(pk, 1);
  pack_node(pk, 0, "10.0.0.1:1");
  sp__pack_str(pk, "rank_nodes");
  msgpack_pack_array(pk, 1);
  msgpack_pack_uint32(pk, 0);
}

static const uint8_t id128[128];

/* peer_data naming stream crafted_stream of crafted_streams, dialled for
 * export 1, or without its export_id (crafted_no_export). */
static uint64_t crafted_stream, crafted_streams;
static bool crafted_no_export;

static void data_streams(msgpack_packer *pk) {
  uint8_t bytes[32] = {0};
  sp__pack_kv_u64(pk, "version", 5);
  sp__pack_str(pk, "job");
  sp__pack_bin(pk, bytes, 16);
  sp__pack_str(pk, "nonce");
  sp__pack_bin(pk, bytes, 32);
  sp__pack_str(pk, "proof");
  sp__pack_bin(pk, bytes, 32);
  sp__pack_kv_u64(pk, "node_id", 1);
  sp__pack_kv_u64(pk, "node", 1);
  sp__pack_kv_u64(pk, "streams", crafted_streams);
  sp__pack_kv_u64(pk, "stream", crafted_stream);
  if (!crafted_no_export)
    sp__pack_kv_u64(pk, "export_id", 1);
}

static int parse_streams_of(uint64_t stream, uint64_t streams, char *why,
                            size_t len) {
  crafted_stream = stream;
  crafted_streams = streams;
  return parse_crafted("peer_data", crafted_no_export ? 8 : 9, data_streams,
                       why, len);
}

static void plan_gen_zero(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_kv_u64(pk, "comm_gen", 0);
  sp__pack_str(pk, "nccl_id");
  sp__pack_bin(pk, id128, sizeof id128);
  plan_tail(pk);
}

static void plan_gen_without_id(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_kv_u64(pk, "comm_gen", 1);
  plan_tail(pk);
}

static void plan_id_without_gen(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_str(pk, "nccl_id");
  sp__pack_bin(pk, id128, sizeof id128);
  plan_tail(pk);
}

static void plan_short_id(msgpack_packer *pk) {
  plan_head(pk);
  sp__pack_kv_u64(pk, "comm_gen", 1);
  sp__pack_str(pk, "nccl_id");
  sp__pack_bin(pk, id128, 16);
  plan_tail(pk);
}

static void fail_no_message(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_str(pk, "code", "node_lost");
}

static void fail_nul_message(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_str(pk, "code", "node_lost");
  sp__pack_str(pk, "message");
  sp__pack_strn(pk, "a\0b", 3);
}

static void nothing(msgpack_packer *pk) { (void)pk; }

/* planned with replica_rank crafted_rank, crafted_bins bins of
 * crafted_bin_bytes each, and one more of crafted_tail_bytes when not 0. */
static uint64_t crafted_rank;
static size_t crafted_bins, crafted_bin_bytes, crafted_tail_bytes;

static void planned_replicas(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "digest", 1);
  sp__pack_kv_u64(pk, "replica_rank", crafted_rank);
  sp__pack_str(pk, "replicas");
  msgpack_pack_array(pk, (uint32_t)(crafted_bins + (crafted_tail_bytes > 0)));
  uint8_t *zeros = calloc(1, crafted_bin_bytes + crafted_tail_bytes + 1);
  for (size_t i = 0; i < crafted_bins; i++)
    sp__pack_bin(pk, zeros, crafted_bin_bytes);
  if (crafted_tail_bytes > 0)
    sp__pack_bin(pk, zeros, crafted_tail_bytes);
  free(zeros);
}

static int parse_replicas_of(uint64_t rank, size_t bins, size_t bin_bytes,
                             size_t tail_bytes, char *why, size_t len) {
  crafted_rank = rank;
  crafted_bins = bins;
  crafted_bin_bytes = bin_bytes;
  crafted_tail_bytes = tail_bytes;
  return parse_crafted("planned", 4, planned_replicas, why, len);
}

static void planned_digests_without_rank(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "digest", 1);
  sp__pack_str(pk, "replicas");
  msgpack_pack_array(pk, 1);
  sp__pack_bin(pk, id128, 8);
}

static uint64_t crafted_differ_rank;
static uint32_t crafted_differ_n;

static void go_differ(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "differ_key", 0);
  sp__pack_str(pk, "differ_ranks");
  msgpack_pack_array(pk, crafted_differ_n);
  for (uint32_t i = 0; i < crafted_differ_n; i++)
    msgpack_pack_uint64(pk, crafted_differ_rank);
  sp__pack_str(pk, "differ_digests");
  msgpack_pack_array(pk, 2);
  msgpack_pack_uint64(pk, 1);
  msgpack_pack_uint64(pk, 2);
}

static void go_differ_key_alone(msgpack_packer *pk) {
  sp__pack_kv_u64(pk, "gather", 1);
  sp__pack_kv_u64(pk, "differ_key", 0);
}

/* The bounds of a node's digests and of the root's word that two differ,
 * each at its edge. */
START_TEST(replica_digests_bounded) {
  char why[256];
  enum { PER_BIN = 1u << 17 };
  /* REQ_MAX_PER_RANK digests in full bins pass; one more does not.  (A
   * bin past a control frame's string limit, a mebibyte, never reaches
   * the parser: the wire decoder refuses it.) */
  ck_assert_int_eq(parse_replicas_of(0, REQ_MAX_PER_RANK / PER_BIN,
                                     8 * PER_BIN, 0, why, sizeof why),
                   0);
  ck_assert_int_eq(parse_replicas_of(0, REQ_MAX_PER_RANK / PER_BIN,
                                     8 * PER_BIN, 8, why, sizeof why),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "more than"));
  ck_assert_int_eq(parse_replicas_of(0, 1, 8 * PER_BIN, 0, why, sizeof why),
                   0);
  /* Not whole digests, none at all. */
  ck_assert_int_eq(parse_replicas_of(0, 1, 12, 0, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_int_eq(parse_replicas_of(0, 1, 0, 0, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_int_eq(parse_replicas_of(0, 0, 8, 0, why, sizeof why),
                   SP_EBADMSG);
  /* The rank: the last one of the biggest world, and one past it. */
  ck_assert_int_eq(parse_replicas_of(REQ_MAX_WORLD - 1, 1, 8, 0, why,
                                     sizeof why),
                   0);
  ck_assert_int_eq(parse_replicas_of(REQ_MAX_WORLD, 1, 8, 0, why,
                                     sizeof why),
                   SP_EINVAL);
  ck_assert_int_eq(parse_crafted("planned", 3, planned_digests_without_rank,
                                 why, sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "replica_rank"));
  crafted_differ_n = 2;
  crafted_differ_rank = REQ_MAX_WORLD - 1;
  ck_assert_int_eq(parse_crafted("go", 4, go_differ, why, sizeof why), 0);
  crafted_differ_rank = REQ_MAX_WORLD;
  ck_assert_int_eq(parse_crafted("go", 4, go_differ, why, sizeof why),
                   SP_EINVAL);
  crafted_differ_n = 3;
  crafted_differ_rank = 0;
  ck_assert_int_eq(parse_crafted("go", 4, go_differ, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_int_eq(parse_crafted("go", 2, go_differ_key_alone, why,
                                 sizeof why),
                   SP_EBADMSG);
}
END_TEST

/* A data link's stream is one of 1 to 8, below their count. */
START_TEST(data_streams_bounded) {
  char why[256];
  ck_assert_int_eq(parse_streams_of(0, 1, why, sizeof why), 0);
  ck_assert_int_eq(parse_streams_of(7, 8, why, sizeof why), 0);
  ck_assert_int_eq(parse_streams_of(0, 9, why, sizeof why), SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "streams"));
  ck_assert_int_eq(parse_streams_of(0, 0, why, sizeof why), SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "not a stream"));
  ck_assert_int_eq(parse_streams_of(2, 2, why, sizeof why), SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "stream 2 of 2"));
  ck_assert_int_eq(parse_streams_of(8, 8, why, sizeof why), SP_EINVAL);
  /* The session a stream was dialled for is part of it. */
  crafted_no_export = true;
  ck_assert_int_lt(parse_streams_of(0, 1, why, sizeof why), 0);
  ck_assert_ptr_nonnull(strstr(why, "export_id"));
  crafted_no_export = false;
}
END_TEST

START_TEST(messages_refused) {
  char why[256];
  ck_assert_int_eq(parse_crafted("peer_hello", 6, hello_short_proof, why,
                                 sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "proof"));
  ck_assert_int_eq(parse_crafted("peer_challenge", 2, challenge_short_nonce,
                                 why, sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "nonce"));
  ck_assert_int_eq(parse_crafted("peer_hello", 6, hello_name_addr, why,
                                 sizeof why),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "addr"));
  ck_assert_int_eq(parse_crafted("ask", 5, ask_big_rank, why, sizeof why),
                   SP_EINVAL);
  ck_assert_int_eq(parse_crafted("ask", 5, ask_long_timeout, why, sizeof why),
                   SP_EINVAL);
  ck_assert_int_eq(parse_crafted("ask", 6, ask_save_bare, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "save_overwrite"));
  ck_assert_int_eq(parse_crafted("plan", 7, plan_unlisted_node, why,
                                 sizeof why),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "not listed"));
  ck_assert_int_eq(parse_crafted("plan", 7, plan_nodes_twice, why,
                                 sizeof why),
                   SP_EINVAL);
  ck_assert_int_eq(parse_crafted("plan", 7, plan_no_ranks, why, sizeof why),
                   SP_EINVAL);
  ck_assert_int_eq(parse_crafted("plan", 9, plan_gen_zero, why, sizeof why),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "comm_gen"));
  ck_assert_int_eq(parse_crafted("plan", 8, plan_gen_without_id, why,
                                 sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "nccl_id"));
  ck_assert_int_eq(parse_crafted("plan", 8, plan_id_without_gen, why,
                                 sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "comm_gen"));
  ck_assert_int_eq(parse_crafted("plan", 9, plan_short_id, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(why, "nccl_id"));
  ck_assert_int_eq(parse_crafted("fail", 2, fail_no_message, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_int_eq(parse_crafted("go", 0, nothing, why, sizeof why),
                   SP_EBADMSG);
  ck_assert_int_eq(parse_crafted("frobnicate", 0, nothing, why, sizeof why),
                   SP_EUNKNOWNOP);
  /* A NUL in a message becomes text a trainer can show. */
  struct sp_msgbuf mb;
  struct decoded d;
  struct nodemsg out;
  sp__msgbuf_begin(&mb, "fail", 0, 3);
  fail_nul_message(&mb.pk);
  decode(&mb, &d);
  ck_assert_int_eq(nodemsg_parse(&d.head, &d.map, &out, why, sizeof why), 0);
  ck_assert_uint_eq(strlen(out.message), 3);
  nodemsg_free(&out);
  decoded_free(&d);
}
END_TEST

/* ---- a rank's registrations ---- */

static struct req_storage storage(uint32_t sid, uint64_t base, uint64_t len) {
  return (struct req_storage){.sid = sid, .base = base, .length = len};
}

/* A rank of three storages and keys of every placement, registered the
 * way a remote rank's are. */
static void sample_rank(struct registry *reg, struct req_groups *groups) {
  struct req_storage s[3] = {storage(10, 0x1000, 4096),
                             storage(11, 0x9000, 64), storage(12, 0, 0)};
  struct sp_device dev[3] = {{.type = SP_DEVICE_CPU},
                             {.type = SP_DEVICE_CPU},
                             {.type = SP_DEVICE_CPU}};
  char msg[256];
  registry_init(reg, SP_DEVICE_CPU);
  ck_assert_int_eq(registry_add_remote_storages(reg, s, dev, 3, msg,
                                                sizeof msg),
                   0);
  static uint32_t holders[2] = {0, 1};
  struct affine_piece *piece = calloc(1, sizeof *piece + sizeof holders);
  *piece = (struct affine_piece){.ndim = 2, .shape = {2, 3},
                                 .src_stride = {3, 1}, .dst_offset = 4,
                                 .dst_stride = {8, 1}, .nholders = 2,
                                 .holders = holders};
  struct req_tensor t[3] = {
      {.key = "w", .key_len = 1, .sid = 10, .placement = PLAN_SHARD0,
       .view = {.dtype = SP_DTYPE_FLOAT32, .ndim = 2, .shape = {4, 8},
                .stride = {9, 1}, .offset = 3},
       .ndim = 2, .shape = {16, 8}},
      {.key = "aff", .key_len = 3, .sid = 11, .placement = PLAN_AFFINE,
       .view = {.dtype = SP_DTYPE_BFLOAT16, .ndim = 1, .shape = {6},
                .stride = {1}},
       .ndim = 2, .shape = {4, 8}, .npieces = 1, .pieces = piece},
      {.key = "e", .key_len = 1, .sid = 10, .placement = PLAN_EXPERT,
       .view = {.dtype = SP_DTYPE_INT16, .ndim = 0}, .ndim = 0},
  };
  ck_assert_int_eq(registry_add_tensors(reg, t, 3, msg, sizeof msg), 0);
  static const char *names[] = {"w", "aff"};
  static struct plan_group group = {.nkeys = 2, .keys = names};
  *groups = (struct req_groups){.ngroups = 1, .groups = &group};
}

static void pack_meta(uint32_t rank, const struct registry *reg,
                      const struct req_groups *groups, struct sp_frame_tx *tx) {
  struct sp_msgbuf mb;
  nodemsg_pack_meta(rank, reg, groups, &mb);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, tx), 0);
}

START_TEST(meta_rebuilds_the_registry) {
  struct registry reg, back;
  struct req_groups groups, gback;
  struct sp_frame_tx tx;
  char msg[512];
  sample_rank(&reg, &groups);
  pack_meta(3, &reg, &groups, &tx);
  ck_assert_int_eq(nodemsg_parse_meta(tx.buf + SP_FRAME_HEADER,
                                      tx.len - SP_FRAME_HEADER, 3, &back,
                                      &gback, msg, sizeof msg),
                   0);
  ck_assert_uint_eq(back.nstorages, reg.nstorages);
  for (size_t i = 0; i < reg.nstorages; i++) {
    ck_assert_uint_eq(back.info[i].sid, reg.info[i].sid);
    ck_assert_ptr_null(back.info[i].data);
    ck_assert_uint_eq(back.storages[i].base, reg.storages[i].base);
    ck_assert_uint_eq(back.storages[i].nbytes, reg.storages[i].nbytes);
  }
  ck_assert_uint_eq(back.nkeys, reg.nkeys);
  for (size_t i = 0; i < reg.nkeys; i++) {
    const struct plan_key_in *a = &reg.keys[i], *b = &back.keys[i];
    ck_assert_str_eq(a->name, b->name);
    ck_assert_int_eq(a->placement, b->placement);
    ck_assert_uint_eq(a->storage, b->storage);
    ck_assert_uint_eq(a->nbytes, b->nbytes);
    ck_assert_uint_eq(a->ndim, b->ndim);
    ck_assert_mem_eq(&a->view, &b->view, sizeof a->view);
    ck_assert_uint_eq(a->npieces, b->npieces);
    for (size_t p = 0; p < a->npieces; p++) {
      ck_assert_int_eq(a->pieces[p].dst_offset, b->pieces[p].dst_offset);
      ck_assert_uint_eq(a->pieces[p].nholders, b->pieces[p].nholders);
      ck_assert_uint_eq(b->pieces[p].holders[1], 1);
    }
  }
  ck_assert_uint_eq(gback.ngroups, 1);
  ck_assert_str_eq(gback.groups[0].keys[1], "aff");
  /* Another rank's bytes are refused for this rank. */
  struct registry other;
  struct req_groups gother;
  ck_assert_int_eq(nodemsg_parse_meta(tx.buf + SP_FRAME_HEADER,
                                      tx.len - SP_FRAME_HEADER, 2, &other,
                                      &gother, msg, sizeof msg),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(msg, "rank 3"));
  /* Cut short or with a byte flipped anywhere: refused or rebuilt, never
   * anything else (and nothing leaks: ASan and valgrind runs say). */
  for (size_t cut = 0; cut < tx.len - SP_FRAME_HEADER; cut += 7) {
    int rc = nodemsg_parse_meta(tx.buf + SP_FRAME_HEADER, cut, 3, &other,
                                &gother, msg, sizeof msg);
    ck_assert_int_ne(rc, 0);
  }
  for (size_t at = SP_FRAME_HEADER; at < tx.len; at++) {
    uint8_t keep = tx.buf[at];
    tx.buf[at] ^= 0x5c;
    if (nodemsg_parse_meta(tx.buf + SP_FRAME_HEADER, tx.len - SP_FRAME_HEADER,
                           3, &other, &gother, msg, sizeof msg) == 0) {
      registry_free(&other);
      request_groups_free(&gother);
    }
    tx.buf[at] = keep;
  }
  free(tx.buf);
  registry_free(&back);
  request_groups_free(&gback);
  registry_free(&reg);
}
END_TEST

/* A view that reaches past its storage is refused on the receiving daemon
 * too, with the registration's own message. */
START_TEST(meta_checks_views_again) {
  struct registry reg, back;
  struct req_groups groups, gback;
  struct sp_frame_tx tx;
  char msg[512];
  sample_rank(&reg, &groups);
  /* Shrink a storage behind the registry's back, as a hostile peer would
   * describe it. */
  reg.storages[0].nbytes = 64;
  pack_meta(0, &reg, &groups, &tx);
  ck_assert_int_eq(nodemsg_parse_meta(tx.buf + SP_FRAME_HEADER,
                                      tx.len - SP_FRAME_HEADER, 0, &back,
                                      &gback, msg, sizeof msg),
                   SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(msg, "'w'"));
  free(tx.buf);
  registry_free(&reg);
}
END_TEST

int main(void) {
  Suite *s = suite_create("nodemsg");
  TCase *tc = tcase_create("nodemsg");
  tcase_add_test(tc, peer_addresses);
  tcase_add_test(tc, tickets_of_both_versions);
  tcase_add_test(tc, messages_round_trip);
  tcase_add_test(tc, replica_digests_bounded);
  tcase_add_test(tc, messages_refused);
  tcase_add_test(tc, data_streams_bounded);
  tcase_add_test(tc, meta_rebuilds_the_registry);
  tcase_add_test(tc, meta_checks_views_again);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
