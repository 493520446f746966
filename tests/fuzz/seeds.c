/*
 * seeds.c - writes the fuzz targets' seed corpora: the messages the test
 * suites send (tests/integration/daemon_jobs.c's requests, the model of
 * tests/unit/daemon/test_nodemsg.c's messages between daemons and `meta`,
 * both ticket versions, the configuration docs/operations.md shows), made
 * by the daemon's own packers where it has them.
 *
 *   fuzz-seeds DIR      writes DIR/request, DIR/nodemsg, DIR/ticket and
 *                       DIR/config (the directories must exist)
 *
 * The committed tests/fuzz/corpus is its output; run it again when a
 * message changes (docs/benchmarks.md, "Fuzzing").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "build_config.h"
#include "daemon/config.h"
#include "daemon/mesh/nodelink.h"
#include "daemon/mesh/nodemsg.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/msg.h"
#include "shardport.h"

static const char *dir;

static void write_seed(const char *corpus, const char *name, const void *data,
                       size_t len) {
  char path[512];
  FILE *f;

  snprintf(path, sizeof path, "%s/%s/%s", dir, corpus, name);
  f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
    fprintf(stderr, "fuzz-seeds: cannot write %s\n", path);
    exit(1);
  }
}

/* The payload of a finished message, without its frame header. */
static void write_msgbuf(const char *corpus, const char *name,
                         struct sp_msgbuf *mb) {
  struct sp_frame_tx tx;

  if (sp__msgbuf_finish(mb, &tx) != 0) {
    fprintf(stderr, "fuzz-seeds: cannot pack %s\n", name);
    exit(1);
  }
  write_seed(corpus, name, tx.buf + SP_FRAME_HEADER, tx.len - SP_FRAME_HEADER);
  free(tx.buf);
}

static const uint8_t id16[16] = {1, 2,  3,  4,  5,  6,  7,  8,
                                 9, 10, 11, 12, 13, 14, 15, 16};

static void pack_ticket(msgpack_sbuffer *sb, bool v2) {
  msgpack_packer pk;
  uint8_t nccl[NODE_NCCL_ID_BYTES];

  for (size_t i = 0; i < sizeof nccl; i++)
    nccl[i] = (uint8_t)(i * 7 + 1);
  msgpack_sbuffer_init(sb);
  msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, v2 ? 6 : 4);
  sp__pack_kv_u64(&pk, "v", v2 ? 2 : 1);
  if (v2)
    sp__pack_kv_str(&pk, "root", "10.0.0.1:7070");
  sp__pack_str(&pk, "job");
  sp__pack_bin(&pk, id16, JOB_ID_BYTES);
  sp__pack_str(&pk, "secret");
  sp__pack_bin(&pk, id16, JOB_SECRET_BYTES);
  sp__pack_kv_u64(&pk, "world", 4);
  if (v2) {
    sp__pack_str(&pk, "nccl_id");
    sp__pack_bin(&pk, nccl, sizeof nccl);
  }
}

static void tickets(void) {
  msgpack_sbuffer sb;

  pack_ticket(&sb, false);
  write_seed("ticket", "v1", sb.data, sb.size);
  msgpack_sbuffer_destroy(&sb);
  pack_ticket(&sb, true);
  write_seed("ticket", "v2", sb.data, sb.size);
  msgpack_sbuffer_destroy(&sb);
}

static void pack_dims(msgpack_packer *pk, const char *name, uint32_t n,
                      const int64_t *v) {
  sp__pack_str(pk, name);
  msgpack_pack_array(pk, n);
  for (uint32_t d = 0; d < n; d++)
    msgpack_pack_uint64(pk, (uint64_t)v[d]);
}

static void pack_storages(msgpack_packer *pk) {
  uint8_t handle[64];

  memset(handle, 0x5a, sizeof handle);
  sp__pack_str(pk, "storages");
  msgpack_pack_array(pk, 2);
  msgpack_pack_map(pk, 6);
  sp__pack_kv_u64(pk, "sid", 7);
  sp__pack_kv_str(pk, "kind", "memfd");
  sp__pack_kv_u64(pk, "fd", 0);
  sp__pack_kv_u64(pk, "offset", 100);
  sp__pack_kv_u64(pk, "length", 4096);
  sp__pack_kv_u64(pk, "base", 0x7f0000000000ull);
  msgpack_pack_map(pk, 7);
  sp__pack_kv_u64(pk, "sid", 8);
  sp__pack_kv_str(pk, "kind", "cuda_ipc");
  sp__pack_str(pk, "handle");
  sp__pack_bin(pk, handle, sizeof handle);
  sp__pack_kv_u64(pk, "offset", 512);
  sp__pack_kv_u64(pk, "length", 1 << 20);
  sp__pack_kv_u64(pk, "base", 0x7f0001000000ull);
  sp__pack_kv_str(pk, "device",
                  "cuda:GPU-6a2c4e18-0000-1111-2222-333344445555");
}

/* One tensor map as daemon_jobs.c's model sends it. */
static void pack_tensor(msgpack_packer *pk, const char *key, const char *dtype,
                        const char *placement, uint32_t ndim,
                        const int64_t *shape, const int64_t *stride,
                        const int64_t *global, uint64_t offset, bool piece) {
  static const int64_t src_stride[2] = {3, 1}, dst_stride[2] = {6, 1};
  msgpack_pack_map(pk, piece ? 9 : 8);
  sp__pack_kv_str(pk, "key", key);
  sp__pack_kv_u64(pk, "sid", 7);
  sp__pack_kv_str(pk, "dtype", dtype);
  pack_dims(pk, "shape", ndim, shape);
  pack_dims(pk, "stride", ndim, stride);
  sp__pack_kv_u64(pk, "offset", offset);
  sp__pack_kv_str(pk, "placement", placement);
  pack_dims(pk, "global_shape", ndim, global);
  if (!piece)
    return;
  sp__pack_str(pk, "pieces");
  msgpack_pack_array(pk, 1);
  msgpack_pack_map(pk, 6);
  pack_dims(pk, "shape", 2, shape);
  pack_dims(pk, "src_stride", 2, src_stride);
  pack_dims(pk, "dst_stride", 2, dst_stride);
  sp__pack_kv_u64(pk, "src_offset", 0);
  sp__pack_kv_u64(pk, "dst_offset", 3);
  sp__pack_str(pk, "holders");
  msgpack_pack_array(pk, 2);
  msgpack_pack_uint32(pk, 0);
  msgpack_pack_uint32(pk, 1);
}

static void pack_tensors(msgpack_packer *pk) {
  static const int64_t rows[2] = {2, 3}, whole[2] = {5, 3}, s53[2] = {3, 1};
  static const int64_t cols[2] = {4, 3}, full[2] = {4, 6}, s43[2] = {3, 1};
  static const int64_t tr[2] = {3, 4}, trs[2] = {1, 3};
  sp__pack_str(pk, "tensors");
  msgpack_pack_array(pk, 4);
  pack_tensor(pk, "a.weight", "float32", "shard0", 2, rows, s53, whole, 0,
              false);
  pack_tensor(pk, "c.expert1", "int16", "expert", 2, whole, s53, whole, 16,
              false);
  pack_tensor(pk, "f.columns", "float32", "affine", 2, cols, s43, full, 32,
              true);
  pack_tensor(pk, "h.transposed", "float64", "replicated", 2, tr, trs, tr, 64,
              false);
}

static void requests(void) {
  static const int64_t none[1] = {0};
  struct sp_msgbuf mb;
  msgpack_sbuffer ticket;
  const char *plain[] = {"ping", "status", "leave"};

  sp__msgbuf_begin(&mb, "hello", 1, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION);
  sp__pack_kv_str(&mb.pk, "client", "fuzz-seeds");
  write_msgbuf("request", "hello", &mb);
  for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
    sp__msgbuf_begin(&mb, plain[i], 2 + i, 0);
    write_msgbuf("request", plain[i], &mb);
  }
  sp__msgbuf_begin(&mb, "job_create", 5, 1);
  sp__pack_kv_u64(&mb.pk, "world", 4);
  write_msgbuf("request", "job_create", &mb);
  for (int v2 = 0; v2 < 2; v2++) {
    pack_ticket(&ticket, v2);
    sp__msgbuf_begin(&mb, "join", 6, 4);
    sp__pack_str(&mb.pk, "ticket");
    sp__pack_bin(&mb.pk, ticket.data, ticket.size);
    sp__pack_kv_u64(&mb.pk, "rank", 1);
    sp__pack_kv_u64(&mb.pk, "world", 4);
    sp__pack_kv_str(&mb.pk, "device",
                    v2 ? "cuda:GPU-6a2c4e18-0000-1111-2222-333344445555"
                       : "cpu");
    write_msgbuf("request", v2 ? "join_v2_cuda" : "join", &mb);
    msgpack_sbuffer_destroy(&ticket);
  }
  sp__msgbuf_begin(&mb, "storage_add", 7, 1);
  pack_storages(&mb.pk);
  write_msgbuf("request", "storage_add", &mb);
  sp__msgbuf_begin(&mb, "tensor_add", 8, 1);
  pack_tensors(&mb.pk);
  write_msgbuf("request", "tensor_add", &mb);
  /* Both in one map: what the registry checks once both are known. */
  sp__msgbuf_begin(&mb, "tensor_add", 9, 2);
  pack_storages(&mb.pk);
  pack_tensors(&mb.pk);
  write_msgbuf("request", "storages_and_tensors", &mb);
  sp__msgbuf_begin(&mb, "tensor_add", 10, 1);
  sp__pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 1);
  pack_tensor(&mb.pk, "d.empty", "bfloat16", "plain", 1, none, none, none, 0,
              false);
  write_msgbuf("request", "tensor_add_empty", &mb);
  /* A consumer's targets: whole, a column shard, a fused piece. */
  sp__msgbuf_begin(&mb, "target_add", 12, 1);
  sp__pack_str(&mb.pk, "targets");
  msgpack_pack_array(&mb.pk, 3);
  for (int part = 0; part < 3; part++) {
    static const char *const parts[] = {"whole", "shard", "pieces"};
    msgpack_pack_map(&mb.pk, part == 2 ? 5 : part == 1 ? 9 : 8);
    sp__pack_kv_str(&mb.pk, "key", part == 2 ? "q" : "w");
    sp__pack_kv_str(&mb.pk, "dtype", "float32");
    sp__pack_str(&mb.pk, "global_shape");
    msgpack_pack_array(&mb.pk, 2);
    msgpack_pack_uint64(&mb.pk, 6);
    msgpack_pack_uint64(&mb.pk, 4);
    sp__pack_kv_str(&mb.pk, "part", parts[part]);
    if (part == 2) {
      sp__pack_str(&mb.pk, "pieces");
      msgpack_pack_array(&mb.pk, 1);
      msgpack_pack_map(&mb.pk, 5);
    }
    if (part == 2) {
      sp__pack_str(&mb.pk, "start");
      msgpack_pack_array(&mb.pk, 2);
      msgpack_pack_uint64(&mb.pk, 3);
      msgpack_pack_uint64(&mb.pk, 0);
    }
    sp__pack_kv_u64(&mb.pk, "sid", 1);
    sp__pack_str(&mb.pk, "shape");
    msgpack_pack_array(&mb.pk, 2);
    msgpack_pack_uint64(&mb.pk, part == 2 ? 3 : 6);
    msgpack_pack_uint64(&mb.pk, part == 1 ? 2 : 4);
    sp__pack_str(&mb.pk, "stride");
    msgpack_pack_array(&mb.pk, 2);
    msgpack_pack_uint64(&mb.pk, part == 1 ? 2 : 4);
    msgpack_pack_uint64(&mb.pk, 1);
    sp__pack_kv_u64(&mb.pk, "offset", 0);
    if (part == 1)
      sp__pack_kv_u64(&mb.pk, "dim", 1);
  }
  write_msgbuf("request", "target_add", &mb);
  sp__msgbuf_begin(&mb, "export", 11, 5);
  sp__pack_kv_u64(&mb.pk, "max_keys", 4);
  sp__pack_kv_u64(&mb.pk, "max_bytes", 1 << 20);
  sp__pack_kv_u64(&mb.pk, "timeout_ms", 10000);
  sp__pack_kv_bool(&mb.pk, "progress", true);
  sp__pack_str(&mb.pk, "groups");
  msgpack_pack_array(&mb.pk, 1);
  msgpack_pack_array(&mb.pk, 2);
  sp__pack_str(&mb.pk, "a.weight");
  sp__pack_str(&mb.pk, "f.columns");
  write_msgbuf("request", "export", &mb);
  sp__msgbuf_begin(&mb, "export", 13, 2);
  sp__pack_kv_bool(&mb.pk, "progress", true);
  sp__pack_str(&mb.pk, "save");
  msgpack_pack_map(&mb.pk, 1);
  sp__pack_kv_u64(&mb.pk, "max_shard_bytes", 5ull << 30);
  write_msgbuf("request", "export_save", &mb);
  sp__msgbuf_begin(&mb, "release", 12, 1);
  sp__pack_kv_u64(&mb.pk, "export_id", 3);
  write_msgbuf("request", "release", &mb);
}

static void node_message(const char *name, const struct nodemsg *m) {
  struct sp_msgbuf mb;

  nodemsg_pack(m, &mb);
  write_msgbuf("nodemsg", name, &mb);
}

/* test_nodemsg.c's sample rank: three storages, a dim-0 shard, an affine
 * piece held by two ranks, an expert, and one together-group. */
static void meta(void) {
  static uint32_t holders[2] = {0, 1};
  static const char *names[] = {"w", "aff"};
  struct plan_group group = {.nkeys = 2, .keys = names};
  struct req_groups groups = {.ngroups = 1, .groups = &group};
  struct req_storage s[3] = {{.sid = 10, .base = 0x1000, .length = 4096},
                             {.sid = 11, .base = 0x9000, .length = 64},
                             {.sid = 12}};
  struct sp_device dev[3] = {{.type = SP_DEVICE_CPU},
                             {.type = SP_DEVICE_CPU},
                             {.type = SP_DEVICE_CPU}};
  struct affine_piece *piece = calloc(1, sizeof *piece);
  struct req_tensor t[3] = {
      {.key = "w",
       .key_len = 1,
       .sid = 10,
       .placement = PLAN_SHARD0,
       .view = {.dtype = SP_DTYPE_FLOAT32,
                .ndim = 2,
                .shape = {4, 8},
                .stride = {9, 1},
                .offset = 3},
       .ndim = 2,
       .shape = {16, 8}},
      {.key = "aff",
       .key_len = 3,
       .sid = 11,
       .placement = PLAN_AFFINE,
       .view =
           {.dtype = SP_DTYPE_BFLOAT16, .ndim = 1, .shape = {6}, .stride = {1}},
       .ndim = 2,
       .shape = {4, 8},
       .npieces = 1,
       .pieces = piece},
      {.key = "e",
       .key_len = 1,
       .sid = 10,
       .placement = PLAN_EXPERT,
       .view = {.dtype = SP_DTYPE_INT16, .ndim = 0}},
  };
  struct registry reg;
  struct sp_msgbuf mb;
  char msg[SP_ERRMSG_MAX + 1];

  if (piece == NULL) {
    fprintf(stderr, "fuzz-seeds: out of memory\n");
    exit(1);
  }
  *piece = (struct affine_piece){.ndim = 2,
                                 .shape = {2, 3},
                                 .src_stride = {3, 1},
                                 .dst_offset = 4,
                                 .dst_stride = {8, 1},
                                 .nholders = 2,
                                 .holders = holders};
  registry_init(&reg, SP_DEVICE_CPU);
  if (registry_add_remote_storages(&reg, s, dev, 3, msg, sizeof msg) != 0 ||
      registry_add_tensors(&reg, t, 3, msg, sizeof msg) != 0) {
    fprintf(stderr, "fuzz-seeds: the sample rank is refused: %s\n", msg);
    exit(1);
  }
  nodemsg_pack_meta(0, &reg, &groups, &mb);
  write_msgbuf("nodemsg", "meta", &mb);
  registry_free(&reg);
}

static void node_messages(void) {
  static const enum nodemsg_op plain[] = {
      NODEMSG_GO, NODEMSG_MOVED, NODEMSG_PUBLISH, NODEMSG_BEAT, NODEMSG_BYE};
  struct nodemsg_node nodes[2] = {{.node = 0, .node_id = 1},
                                  {.node = 2, .node_id = 8}};
  uint32_t rank_nodes[3] = {0, 2, 2};
  struct nodemsg m;

  m = (struct nodemsg){.op = NODEMSG_CHALLENGE};
  memset(m.nonce, 0x5a, sizeof m.nonce);
  node_message("challenge", &m);
  m = (struct nodemsg){
      .op = NODEMSG_HELLO, .version = NODE_PROTOCOL_VERSION, .node_id = 99};
  memcpy(m.job, id16, sizeof m.job);
  memset(m.nonce, 0xa5, sizeof m.nonce);
  memset(m.proof, 0x3c, sizeof m.proof);
  snprintf(m.addr, sizeof m.addr, "10.0.0.9:7070");
  node_message("hello", &m);
  m = (struct nodemsg){
      .op = NODEMSG_HELLO, .reply = true, .node = 3, .node_id = 5};
  node_message("hello_reply", &m);
  /* A data link's streams at their edges: the only one of one, the last
   * of the most, dialled for the first and the last export. */
  m = (struct nodemsg){.op = NODEMSG_DATA,
                       .version = NODE_PROTOCOL_VERSION,
                       .node = 1,
                       .node_id = 99,
                       .stream = 0,
                       .streams = 1,
                       .export_id = 1};
  memcpy(m.job, id16, sizeof m.job);
  memset(m.nonce, 0xa5, sizeof m.nonce);
  memset(m.proof, 0x3c, sizeof m.proof);
  node_message("data", &m);
  m.node = NODE_MAX_NODES - 1;
  m.stream = CONFIG_MAX_PEER_STREAMS - 1;
  m.streams = CONFIG_MAX_PEER_STREAMS;
  m.export_id = UINT64_MAX;
  node_message("data_last_stream", &m);
  m = (struct nodemsg){.op = NODEMSG_DATA, .reply = true};
  memset(m.proof, 0x3c, sizeof m.proof);
  node_message("data_reply", &m);
  m = (struct nodemsg){.op = NODEMSG_ASK,
                       .gather = 7,
                       .rank = 2,
                       .max_keys = 4,
                       .max_bytes = 1u << 20,
                       .timeout_ms = 2000};
  node_message("ask", &m);
  m.save = (struct req_save){.limit = 1u << 30, .overwrite = true,
                             .directory = 0x1234, .metadata = 0x5678};
  node_message("ask_save", &m);
  m.save.refused = SP_EWRITE;
  snprintf(m.save.refusal, sizeof m.save.refusal, "save: cannot open");
  node_message("ask_save_refused", &m);
  m = (struct nodemsg){.op = NODEMSG_SAVED, .gather = 7, .step = 2};
  node_message("saved", &m);
  m = (struct nodemsg){.op = NODEMSG_COMMIT, .gather = 7, .step = 3};
  node_message("commit", &m);
  snprintf(nodes[0].addr, NODE_ADDR_MAX, "10.0.0.1:1");
  snprintf(nodes[1].addr, NODE_ADDR_MAX, "[::1]:2");
  m = (struct nodemsg){.op = NODEMSG_PLAN,
                       .gather = 1,
                       .export_id = 4,
                       .max_keys = 4096,
                       .timeout_ms = 100,
                       .world = 3,
                       .nnodes = 2,
                       .nodes = nodes,
                       .rank_nodes = rank_nodes};
  node_message("plan", &m);
  m.comm_gen = 3;
  for (size_t i = 0; i < sizeof m.nccl_id; i++)
    m.nccl_id[i] = (uint8_t)(i * 7 + 1);
  node_message("plan_nccl", &m);
  m = (struct nodemsg){.op = NODEMSG_PLANNED,
                       .gather = 1,
                       .digest = UINT64_MAX,
                       .code = SP_ETILING};
  node_message("planned", &m);
  m = (struct nodemsg){.op = NODEMSG_FAIL, .gather = 2, .code = SP_ENODELOST};
  snprintf(m.message, sizeof m.message, "node 1 (x) was lost");
  node_message("fail", &m);
  m = (struct nodemsg){.op = NODEMSG_ABORT, .code = SP_EABORTED};
  snprintf(m.message, sizeof m.message, "job J was aborted by uid 0");
  node_message("abort", &m);
  for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
    char name[32];
    m = (struct nodemsg){.op = plain[i], .gather = 11};
    snprintf(name, sizeof name, "%s", nodemsg_op_name(plain[i]));
    node_message(name, &m);
  }
  m = (struct nodemsg){.op = NODEMSG_LEFT, .rank = 5, .disconnected = true};
  node_message("left", &m);
  meta();
}

static void configs(void) {
  /* docs/operations.md's --print-config output, and the other forms each
   * kind of value takes. */
  static const char printed[] = "socket = /run/shardport/shardport.sock\n"
                                "socket_group = none\n"
                                "allowed_uids = 0\n"
                                "allowed_gid = 0\n"
                                "log_level = info\n"
                                "max_frame = 16777216\n"
                                "max_depth = 16\n"
                                "max_items = 262144\n"
                                "max_string = 1048576\n"
                                "max_fds = 32\n"
                                "max_clients = 1024\n"
                                "max_output = 33554432\n"
                                "backend = auto\n"
                                "watchdog = yes\n"
                                "pool_capacity = 0\n"
                                "gpu_pool_capacity = 0\n"
                                "max_bytes = 1073741824\n"
                                "export_timeout = 1m\n"
                                "job_timeout = 5m\n"
                                "max_jobs = 256\n"
                                "engine_threads = 0\n"
                                "peer_listen = none\n"
                                "peer_advertise = none\n";
  static const char forms[] =
      "# sizes with suffixes, durations in every unit, names\n"
      "max_frame = 16M   # a comment after a value\n"
      "max_output = 64k\n"
      "pool_capacity = 2G\n"
      "export_timeout = 250ms\n"
      "job_timeout = 30s\n"
      "allowed_uids = root, 0 1000\n"
      "allowed_gid = root\n"
      "socket_group = 0\n"
      "log_level = debug\n"
      "watchdog = no\n"
      "backend = host\n"
      "\n"
      "   peer_listen = [::1]:7070\n"
      "peer_advertise = 10.0.0.2\n";
  write_seed("config", "printed", printed, sizeof printed - 1);
  write_seed("config", "forms", forms, sizeof forms - 1);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: fuzz-seeds DIR\n");
    return 2;
  }
  dir = argv[1];
  requests();
  node_messages();
  tickets();
  configs();
  return 0;
}
