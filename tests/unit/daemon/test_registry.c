/*
 * test_registry.c - job requests parsed from crafted msgpack (every bound of
 * docs/protocol.md, "Jobs"), and the registry's checks against real memfds:
 * read-only mappings, whole-or-nothing frames, views inside their storage.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "daemon/idxset.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/msg.h"
#include "proto/wire.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

/* A message built with the proto packers, decoded as the daemon would. */
struct msg {
  struct sp_msgbuf mb;
  msgpack_zone zone;
  msgpack_object map;
};

static void msg_begin(struct msg *m, const char *op, uint32_t nfields) {
  sp__msgbuf_begin(&m->mb, op, 1, nfields);
}

/* Decoded with the default limits, or with max_items raised as a
 * daemon's configuration may (0: the default). */
static const msgpack_object *msg_decode_items(struct msg *m,
                                              uint32_t max_items) {
  struct sp_limits limits;
  sp__limits_default(&limits);
  if (max_items > 0)
    limits.max_items = max_items;
  msgpack_zone_init(&m->zone, 4096);
  ck_assert_int_eq(
      sp__wire_decode((const uint8_t *)m->mb.sbuf.data + SP_FRAME_HEADER,
                      m->mb.sbuf.size - SP_FRAME_HEADER, &limits, &m->zone,
                      &m->map),
      0);
  return &m->map;
}

static const msgpack_object *msg_decode(struct msg *m) {
  return msg_decode_items(m, 0);
}

static void msg_free(struct msg *m) {
  msgpack_zone_destroy(&m->zone);
  sp__msgbuf_discard(&m->mb);
}

static void pack_u64s(msgpack_packer *pk, const char *key, size_t n,
                      const uint64_t *v) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(pk, v[i]);
}

/* ---- requests ---------------------------------------------------------- */

static int parse_create(uint64_t world, bool present) {
  struct msg m;
  struct req_job_create req;
  char err[256];
  msg_begin(&m, "job_create", present ? 1 : 0);
  if (present)
    sp__pack_kv_u64(&m.mb.pk, "world", world);
  int rc = request_parse_job_create(msg_decode(&m), &req, err, sizeof err);
  if (rc == 0)
    ck_assert_uint_eq(req.world, world);
  msg_free(&m);
  return rc;
}

static int parse_create_consumers(uint64_t consumers) {
  struct msg m;
  struct req_job_create req;
  char err[256];
  msg_begin(&m, "job_create", 2);
  sp__pack_kv_u64(&m.mb.pk, "world", 2);
  sp__pack_kv_u64(&m.mb.pk, "consumers", consumers);
  int rc = request_parse_job_create(msg_decode(&m), &req, err, sizeof err);
  if (rc == 0)
    ck_assert_uint_eq(req.consumers, consumers);
  msg_free(&m);
  return rc;
}

START_TEST(job_create_consumers_bounds) {
  ck_assert_int_eq(parse_create_consumers(0), 0);
  ck_assert_int_eq(parse_create_consumers(4096), 0);
  ck_assert_int_eq(parse_create_consumers(4097), SP_EINVAL);
}
END_TEST

/* One target of key "w" [6, 4], of part, with npieces pieces of one row
 * each (pieces) or a view of shape (whole, shard). */
static int parse_target(const char *part, uint32_t npieces, uint32_t dim,
                        struct req_target **out) {
  struct msg m;
  size_t n;
  char err[256];
  bool pieces = strcmp(part, "pieces") == 0;
  msg_begin(&m, "target_add", 1);
  sp__pack_str(&m.mb.pk, "targets");
  msgpack_pack_array(&m.mb.pk, 1);
  msgpack_pack_map(&m.mb.pk, pieces ? 5 : strcmp(part, "shard") == 0 ? 9 : 8);
  sp__pack_kv_str(&m.mb.pk, "key", "w");
  sp__pack_kv_str(&m.mb.pk, "dtype", "float32");
  pack_u64s(&m.mb.pk, "global_shape", 2, (uint64_t[]){6, 4});
  sp__pack_kv_str(&m.mb.pk, "part", part);
  if (pieces) {
    sp__pack_str(&m.mb.pk, "pieces");
    msgpack_pack_array(&m.mb.pk, npieces);
    for (uint32_t p = 0; p < npieces; p++) {
      msgpack_pack_map(&m.mb.pk, 5);
      pack_u64s(&m.mb.pk, "start", 2, (uint64_t[]){p % 6, 0});
      sp__pack_kv_u64(&m.mb.pk, "sid", 3);
      pack_u64s(&m.mb.pk, "shape", 2, (uint64_t[]){1, 4});
      pack_u64s(&m.mb.pk, "stride", 2, (uint64_t[]){4, 1});
      sp__pack_kv_u64(&m.mb.pk, "offset", 4 * p);
    }
  } else {
    sp__pack_kv_u64(&m.mb.pk, "sid", 3);
    pack_u64s(&m.mb.pk, "shape", 2, (uint64_t[]){6, 2});
    pack_u64s(&m.mb.pk, "stride", 2, (uint64_t[]){2, 1});
    sp__pack_kv_u64(&m.mb.pk, "offset", 0);
    if (strcmp(part, "shard") == 0)
      sp__pack_kv_u64(&m.mb.pk, "dim", dim);
  }
  /* 65,536 pieces take more msgpack items than the default limits let one
   * frame hold: a daemon configured with more reaches the bound. */
  int rc = request_parse_targets(msg_decode_items(&m, 1u << 21), out, &n, err,
                                 sizeof err);
  if (rc == 0)
    ck_assert_uint_eq(n, 1);
  msg_free(&m);
  return rc;
}

START_TEST(target_bounds) {
  struct req_target *t;
  ck_assert_int_eq(parse_target("shard", 0, 1, &t), 0);
  ck_assert_int_eq(t[0].t.part, CONSUME_SHARD);
  ck_assert_uint_eq(t[0].t.dim, 1);
  ck_assert_uint_eq(t[0].sid, 3);
  ck_assert_str_eq(t[0].t.key, "w");
  request_targets_free(t, 1);
  /* A dim is below SP_MAX_DIMS; whether the key has it is the planner's. */
  ck_assert_int_eq(parse_target("shard", 0, 7, &t), 0);
  request_targets_free(t, 1);
  ck_assert_int_eq(parse_target("shard", 0, 8, &t), SP_EINVAL);
  ck_assert_int_eq(parse_target("whole", 0, 0, &t), 0);
  request_targets_free(t, 1);
  ck_assert_int_eq(parse_target("rows", 0, 0, &t), SP_EUNSUPPORTED);
  /* Pieces: 1 to 65,536. */
  ck_assert_int_eq(parse_target("pieces", 0, 0, &t), SP_EINVAL);
  ck_assert_int_eq(parse_target("pieces", 65536, 0, &t), 0);
  ck_assert_uint_eq(t[0].t.npieces, 65536);
  ck_assert_uint_eq(t[0].piece_sid[65535], 3);
  ck_assert_int_eq(t[0].t.pieces[65535].start[0], 65535 % 6);
  request_targets_free(t, 1);
  ck_assert_int_eq(parse_target("pieces", 65537, 0, &t), SP_EINVAL);
}
END_TEST

START_TEST(job_create_bounds) {
  ck_assert_int_eq(parse_create(1, true), 0);
  ck_assert_int_eq(parse_create(65536, true), 0);
  ck_assert_int_eq(parse_create(0, true), SP_EINVAL);
  ck_assert_int_eq(parse_create(65537, true), SP_EINVAL);
  ck_assert_int_eq(parse_create(0, false), SP_EBADMSG);
}
END_TEST

static int parse_join(size_t ticket_len, const char *device,
                      struct req_join *out) {
  struct msg m;
  char err[256];
  uint8_t ticket[600] = {0};
  msg_begin(&m, "join", 4);
  sp__pack_str(&m.mb.pk, "ticket");
  sp__pack_bin(&m.mb.pk, ticket, ticket_len);
  sp__pack_kv_u64(&m.mb.pk, "rank", 1);
  sp__pack_kv_u64(&m.mb.pk, "world", 2);
  sp__pack_kv_str(&m.mb.pk, "device", device);
  int rc = request_parse_join(msg_decode(&m), out, err, sizeof err);
  msg_free(&m);
  return rc;
}

START_TEST(join_bounds) {
  struct req_join j;
  ck_assert_int_eq(parse_join(64, "cpu", &j), 0);
  ck_assert_uint_eq(j.device_type, SP_DEVICE_CPU);
  ck_assert_int_eq(
      parse_join(64, "cuda:GPU-6f1c2a3e-1b2c-4d5e-8f90-123456789abc", &j), 0);
  ck_assert_uint_eq(j.device_type, SP_DEVICE_CUDA);
  ck_assert_str_eq(j.device, "cuda:GPU-6f1c2a3e-1b2c-4d5e-8f90-123456789abc");
  ck_assert_int_eq(parse_join(64, "cuda:", &j), SP_EINVAL);
  ck_assert_int_eq(parse_join(64, "cpu ", &j), SP_EINVAL);
  ck_assert_int_eq(parse_join(64, "cuda:GPU/0", &j), SP_EINVAL);
  ck_assert_int_eq(parse_join(512, "cpu", &j), 0);
  ck_assert_int_eq(parse_join(513, "cpu", &j), SP_ETICKET);
}
END_TEST

/* A ticket with the given fields, as job.c packs them. */
static size_t make_ticket(uint8_t *buf, uint64_t v, size_t job_len,
                          size_t secret_len, uint64_t world) {
  msgpack_sbuffer sb;
  msgpack_packer pk;
  uint8_t bytes[32] = {0};
  msgpack_sbuffer_init(&sb);
  msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, 4);
  sp__pack_kv_u64(&pk, "v", v);
  sp__pack_str(&pk, "job");
  sp__pack_bin(&pk, bytes, job_len);
  sp__pack_str(&pk, "secret");
  sp__pack_bin(&pk, bytes, secret_len);
  sp__pack_kv_u64(&pk, "world", world);
  memcpy(buf, sb.data, sb.size);
  size_t n = sb.size;
  msgpack_sbuffer_destroy(&sb);
  return n;
}

START_TEST(ticket_decoding) {
  struct sp_limits limits;
  struct req_ticket t;
  uint8_t buf[256];
  sp__limits_default(&limits);
  size_t n = make_ticket(buf, 1, 16, 16, 8);
  ck_assert_int_eq(request_parse_ticket(buf, n, &limits, &t), 0);
  ck_assert_uint_eq(t.world, 8);
  n = make_ticket(buf, 2, 16, 16, 8);
  ck_assert_int_eq(request_parse_ticket(buf, n, &limits, &t), SP_ETICKET);
  n = make_ticket(buf, 1, 15, 16, 8);
  ck_assert_int_eq(request_parse_ticket(buf, n, &limits, &t), SP_ETICKET);
  n = make_ticket(buf, 1, 16, 17, 8);
  ck_assert_int_eq(request_parse_ticket(buf, n, &limits, &t), SP_ETICKET);
  n = make_ticket(buf, 1, 16, 16, 8);
  buf[n] = 0xc0; /* trailing bytes */
  ck_assert_int_eq(request_parse_ticket(buf, n + 1, &limits, &t), SP_ETICKET);
  /* An array that claims four billion elements is refused unallocated. */
  static const uint8_t huge[] = {0xdd, 0xff, 0, 0, 0};
  ck_assert_int_eq(request_parse_ticket(huge, sizeof huge, &limits, &t),
                   SP_ETICKET);
  ck_assert_int_eq(request_parse_ticket(buf, 0, &limits, &t), SP_ETICKET);
}
END_TEST

struct storage_fields {
  uint64_t sid, fd, offset, length;
  const char *kind;
};

static int parse_storage(struct storage_fields f, size_t nfds) {
  struct msg m;
  struct req_storage *s;
  size_t n;
  char err[256];
  msg_begin(&m, "storage_add", 1);
  sp__pack_str(&m.mb.pk, "storages");
  msgpack_pack_array(&m.mb.pk, 1);
  msgpack_pack_map(&m.mb.pk, 6);
  sp__pack_kv_u64(&m.mb.pk, "sid", f.sid);
  sp__pack_kv_str(&m.mb.pk, "kind", f.kind);
  sp__pack_kv_u64(&m.mb.pk, "fd", f.fd);
  sp__pack_kv_u64(&m.mb.pk, "offset", f.offset);
  sp__pack_kv_u64(&m.mb.pk, "length", f.length);
  sp__pack_kv_u64(&m.mb.pk, "base", 0x1000);
  int rc =
      request_parse_storages(msg_decode(&m), nfds, &s, &n, err, sizeof err);
  if (rc == 0) {
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(s[0].sid, f.sid);
    free(s);
  }
  msg_free(&m);
  return rc;
}

START_TEST(storage_bounds) {
  const uint64_t big = UINT64_C(1) << 62;
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 0, 0, 8, "memfd"}, 1), 0);
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 0, 0, 8, "dmabuf"}, 1),
      SP_EINVAL);
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 1, 0, 8, "memfd"}, 1),
      SP_EBADFD);
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 0, 0, 8, "memfd"}, 0),
      SP_EBADFD);
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 0, big, 8, "memfd"}, 1),
      SP_EINVAL);
  ck_assert_int_eq(
      parse_storage((struct storage_fields){1, 0, big - 8, 8, "memfd"}, 1),
      SP_EINVAL);
  ck_assert_int_eq(
      parse_storage(
          (struct storage_fields){UINT64_C(1) << 32, 0, 0, 8, "memfd"}, 1),
      SP_EINVAL);
}
END_TEST

/* One tensor map with overridable pieces of it. */
struct tensor_fields {
  const char *key;
  size_t key_len; /* 0: strlen */
  const char *dtype;
  const char *placement;
  size_t ndim, nstride;
  uint64_t dim; /* every shape entry */
  bool pieces;
  size_t piece_ndim, piece_holders;
  uint64_t holder;
};

static struct tensor_fields good_tensor(void) {
  return (struct tensor_fields){.key = "w",
                                .dtype = "float32",
                                .placement = "shard0",
                                .ndim = 2,
                                .nstride = 2,
                                .dim = 3,
                                .piece_ndim = 2,
                                .piece_holders = 1};
}

static int parse_tensor(struct tensor_fields f, struct req_tensor **out,
                        char *err, size_t errlen) {
  struct msg m;
  size_t n;
  uint64_t dims[10], strides[10];
  for (int i = 0; i < 10; i++) {
    dims[i] = f.dim;
    strides[i] = 1;
  }
  msg_begin(&m, "tensor_add", 1);
  sp__pack_str(&m.mb.pk, "tensors");
  msgpack_pack_array(&m.mb.pk, 1);
  msgpack_pack_map(&m.mb.pk, f.pieces ? 9 : 8);
  sp__pack_str(&m.mb.pk, "key");
  sp__pack_strn(&m.mb.pk, f.key, f.key_len ? f.key_len : strlen(f.key));
  sp__pack_kv_u64(&m.mb.pk, "sid", 1);
  sp__pack_kv_str(&m.mb.pk, "dtype", f.dtype);
  pack_u64s(&m.mb.pk, "shape", f.ndim, dims);
  pack_u64s(&m.mb.pk, "stride", f.nstride, strides);
  sp__pack_kv_u64(&m.mb.pk, "offset", 0);
  sp__pack_kv_str(&m.mb.pk, "placement", f.placement);
  pack_u64s(&m.mb.pk, "global_shape", f.ndim, dims);
  if (f.pieces) {
    uint64_t holders[3] = {f.holder, f.holder + 1, f.holder + 2};
    sp__pack_str(&m.mb.pk, "pieces");
    msgpack_pack_array(&m.mb.pk, 2);
    for (int p = 0; p < 2; p++) {
      msgpack_pack_map(&m.mb.pk, 6);
      pack_u64s(&m.mb.pk, "shape", f.piece_ndim, dims);
      pack_u64s(&m.mb.pk, "src_stride", 2, strides);
      pack_u64s(&m.mb.pk, "dst_stride", 2, strides);
      sp__pack_kv_u64(&m.mb.pk, "src_offset", 0);
      sp__pack_kv_u64(&m.mb.pk, "dst_offset", 5);
      pack_u64s(&m.mb.pk, "holders", f.piece_holders, holders);
    }
  }
  int rc = request_parse_tensors(msg_decode(&m), out, &n, err, errlen);
  msg_free(&m);
  return rc;
}

static int tensor_code(struct tensor_fields f) {
  struct req_tensor *t = NULL;
  char err[256];
  int rc = parse_tensor(f, &t, err, sizeof err);
  request_tensors_free(t, 1);
  return rc;
}

START_TEST(tensor_bounds) {
  struct tensor_fields f = good_tensor();
  ck_assert_int_eq(tensor_code(f), 0);
  f.ndim = f.nstride = 8;
  ck_assert_int_eq(tensor_code(f), 0);
  f.ndim = f.nstride = 9;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f = good_tensor();
  f.nstride = 1;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f = good_tensor();
  f.dim = UINT64_C(1) << 62;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.dim = (UINT64_C(1) << 62) - 1;
  ck_assert_int_eq(tensor_code(f), 0);
  f = good_tensor();
  f.dtype = "float33";
  ck_assert_int_eq(tensor_code(f), SP_EDTYPE);
  f.dtype = "torch.bfloat16";
  ck_assert_int_eq(tensor_code(f), 0);
  f = good_tensor();
  f.placement = "sharded";
  ck_assert_int_eq(tensor_code(f), SP_EUNSUPPORTED);

  /* Keys: 1 to 1024 bytes of UTF-8 without NUL. */
  char key[1100];
  memset(key, 'k', sizeof key);
  f = good_tensor();
  f.key = key;
  f.key_len = 1024;
  ck_assert_int_eq(tensor_code(f), 0);
  f.key_len = 1025;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.key = "";
  f.key_len = 0;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  static const char *bad[] = {"\xc0\x80",         "a\0b",     "\xed\xa0\x80",
                              "\xf4\x90\x80\x80", "\xe2\x82", "\xff"};
  static const size_t bad_len[] = {2, 3, 3, 4, 2, 1};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    f.key = bad[i];
    f.key_len = bad_len[i];
    ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  }
  f.key = "layer.\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
  f.key_len = 0;
  ck_assert_int_eq(tensor_code(f), 0);

  /* Pieces: affine only, matching dims, 1 to 65536 holders below 65536. */
  f = good_tensor();
  f.pieces = true;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.placement = "affine";
  ck_assert_int_eq(tensor_code(f), 0);
  f.piece_ndim = 3;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.piece_ndim = 2;
  f.piece_holders = 0;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.piece_holders = 3;
  f.holder = 65534;
  ck_assert_int_eq(tensor_code(f), SP_EINVAL);
  f.holder = 4;
  struct req_tensor *t;
  char err[256];
  ck_assert_int_eq(parse_tensor(f, &t, err, sizeof err), 0);
  ck_assert_uint_eq(t[0].npieces, 2);
  ck_assert_uint_eq(t[0].pieces[1].nholders, 3);
  ck_assert_uint_eq(t[0].pieces[1].holders[2], 6);
  ck_assert_int_eq(t[0].pieces[1].dst_offset, 5);
  request_tensors_free(t, 1);
}
END_TEST

START_TEST(export_options) {
  struct msg m;
  struct req_export a, b;
  char err[256];
  msg_begin(&m, "export", 4);
  sp__pack_kv_u64(&m.mb.pk, "max_keys", 100);
  sp__pack_kv_u64(&m.mb.pk, "timeout_ms", 5000);
  sp__pack_kv_bool(&m.mb.pk, "progress", true);
  sp__pack_str(&m.mb.pk, "groups");
  msgpack_pack_array(&m.mb.pk, 2);
  msgpack_pack_array(&m.mb.pk, 2);
  sp__pack_str(&m.mb.pk, "q");
  sp__pack_str(&m.mb.pk, "k");
  msgpack_pack_array(&m.mb.pk, 1);
  sp__pack_str(&m.mb.pk, "v");
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   0);
  ck_assert_uint_eq(a.max_keys, 100);
  ck_assert_uint_eq(a.max_bytes, 0);
  ck_assert(a.progress);
  ck_assert_uint_eq(a.groups.ngroups, 2);
  ck_assert_uint_eq(a.groups.groups[0].nkeys, 2);
  ck_assert_str_eq(a.groups.groups[0].keys[1], "k");
  ck_assert_str_eq(a.groups.groups[1].keys[0], "v");
  msg_free(&m);
  /* Groups [q], [k, v] hold the same names but are a different list. */
  msg_begin(&m, "export", 1);
  sp__pack_str(&m.mb.pk, "groups");
  msgpack_pack_array(&m.mb.pk, 2);
  msgpack_pack_array(&m.mb.pk, 1);
  sp__pack_str(&m.mb.pk, "q");
  msgpack_pack_array(&m.mb.pk, 2);
  sp__pack_str(&m.mb.pk, "k");
  sp__pack_str(&m.mb.pk, "v");
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &b, err, sizeof err),
                   0);
  ck_assert(a.groups.blob_len != b.groups.blob_len ||
            memcmp(a.groups.blob, b.groups.blob, a.groups.blob_len) != 0);
  request_groups_free(&a.groups);
  request_groups_free(&b.groups);
  msg_free(&m);

  msg_begin(&m, "export", 1);
  sp__pack_kv_u64(&m.mb.pk, "timeout_ms", 86400001);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EINVAL);
  msg_free(&m);
  msg_begin(&m, "export", 1);
  sp__pack_kv_u64(&m.mb.pk, "max_keys", UINT64_C(1) << 32);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EINVAL);
  msg_free(&m);
  msg_begin(&m, "export", 1);
  sp__pack_str(&m.mb.pk, "groups");
  msgpack_pack_array(&m.mb.pk, 1);
  sp__pack_str(&m.mb.pk, "q");
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EBADMSG);
  msg_free(&m);
  msg_begin(&m, "export", 1);
  sp__pack_kv_u64(&m.mb.pk, "progress", 1);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EBADMSG);
  msg_free(&m);
}
END_TEST

/* A save's options: the limit, overwrite and the digests, all needed; a
 * rank's refusal with its code, its words bounded and made text. */
static void pack_save(struct msg *m, uint32_t n) {
  msg_begin(m, "export", 1);
  sp__pack_str(&m->mb.pk, "save");
  msgpack_pack_map(&m->mb.pk, n);
  sp__pack_kv_u64(&m->mb.pk, "max_shard_bytes", 4096);
  if (n < 4)
    return;
  sp__pack_kv_bool(&m->mb.pk, "overwrite", true);
  sp__pack_kv_u64(&m->mb.pk, "directory", 7);
  sp__pack_kv_u64(&m->mb.pk, "metadata", 8);
}

START_TEST(export_save_options) {
  struct msg m;
  struct req_export a;
  char err[256];
  pack_save(&m, 4);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   0);
  ck_assert_uint_eq(a.save.limit, 4096);
  ck_assert(a.save.overwrite);
  ck_assert_uint_eq(a.save.directory, 7);
  ck_assert_uint_eq(a.save.metadata, 8);
  ck_assert_int_eq(a.save.refused, 0);
  msg_free(&m);
  pack_save(&m, 1);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EBADMSG);
  ck_assert_ptr_nonnull(strstr(err, "overwrite"));
  msg_free(&m);
  char words[2000];
  memset(words, 'w', sizeof words - 1);
  words[0] = '\x1b';
  words[sizeof words - 1] = '\0';
  pack_save(&m, 6);
  sp__pack_kv_str(&m.mb.pk, "error", "write_failed");
  sp__pack_kv_str(&m.mb.pk, "message", words);
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   0);
  ck_assert_int_eq(a.save.refused, SP_EWRITE);
  ck_assert_int_eq(strncmp(a.save.refusal, "\\x1bwww", 7), 0);
  ck_assert_uint_ge(strlen(a.save.refusal), REQ_MAX_REFUSAL - 8);
  ck_assert_uint_le(strlen(a.save.refusal), REQ_MAX_REFUSAL);
  msg_free(&m);
  pack_save(&m, 5);
  sp__pack_kv_str(&m.mb.pk, "error", "write_failed");
  ck_assert_int_eq(request_parse_export(msg_decode(&m), &a, err, sizeof err),
                   SP_EBADMSG);
  msg_free(&m);
}
END_TEST

/* ---- the registry over memfds ------------------------------------------ */

/* The permissions /proc/self/maps shows for the mapping holding p. */
static void maps_perms(const void *p, char *perms) {
  FILE *f = fopen("/proc/self/maps", "re");
  char line[512];
  uintptr_t a = (uintptr_t)p;
  perms[0] = '\0';
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long lo, hi;
    char pr[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, pr) == 3 && a >= lo && a < hi) {
      strcpy(perms, pr);
      break;
    }
  }
  fclose(f);
}

/* Mappings of this test's memfds (named "reg"), so that allocator and
 * sanitizer mappings do not count. */
static int count_maps(void) {
  FILE *f = fopen("/proc/self/maps", "re");
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f) != NULL)
    n += strstr(line, "/memfd:reg") != NULL;
  fclose(f);
  return n;
}

START_TEST(storages_map_read_only) {
  struct registry reg;
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  int fd = tmodel_memfd("reg", 3 * 4096);
  uint8_t *w = mmap(NULL, 3 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  for (int i = 0; i < 3 * 4096; i++)
    w[i] = (uint8_t)(i * 7);
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  /* An offset that is not page aligned, and an empty storage. */
  struct req_storage s[2] = {
      {.sid = 3, .fd = 0, .offset = 4100, .length = 5000, .base = 0x5000},
      {.sid = 4, .fd = 0, .offset = 0, .length = 0, .base = 0x5000}};
  ck_assert_int_eq(registry_add_storages(&reg, s, 2, &frame, err, sizeof err),
                   0);
  ck_assert_uint_eq(reg.nstorages, 2);
  uint32_t i3 = registry_find_sid(&reg, 3);
  ck_assert_uint_eq(i3, 0);
  ck_assert_uint_eq(registry_find_sid(&reg, 4), 1);
  ck_assert_uint_eq(registry_find_sid(&reg, 5), IDXSET_NONE);
  ck_assert_mem_eq(reg.info[i3].data, w + 4100, 5000);
  ck_assert_uint_eq(reg.storages[i3].nbytes, 5000);
  ck_assert_uint_eq(reg.storages[i3].base, 0x5000);
  char perms[8];
  maps_perms(reg.info[i3].data, perms);
  ck_assert_str_eq(perms, "r--s");
  ck_assert_ptr_null(reg.info[1].data);
  int before = count_maps();
  registry_free(&reg);
  ck_assert_int_eq(count_maps(), before - 1);
  munmap(w, 3 * 4096);
  close(fd);
}
END_TEST

START_TEST(storage_frames_whole_or_nothing) {
  struct registry reg;
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  int big = tmodel_memfd("reg", 8192), small = tmodel_memfd("reg", 100);
  struct sp_frame frame = {.nfds = 2};
  frame.fds[0] = big;
  frame.fds[1] = small;
  int maps = count_maps();
  /* The third does not fit its file: none is registered or left mapped. */
  struct req_storage s[3] = {
      {.sid = 1, .fd = 0, .offset = 0, .length = 4096, .base = 0x1000},
      {.sid = 2, .fd = 0, .offset = 4096, .length = 4096, .base = 0x2000},
      {.sid = 3, .fd = 1, .offset = 50, .length = 51, .base = 0x3000}};
  ck_assert_int_eq(registry_add_storages(&reg, s, 3, &frame, err, sizeof err),
                   SP_EBADFD);
  ck_assert_ptr_nonnull(strstr(err, "sid 3"));
  ck_assert_uint_eq(reg.nstorages, 0);
  ck_assert_int_eq(count_maps(), maps);
  /* Repeated sids and bases, in the frame or against the registry. */
  s[2].length = 50;
  s[1].sid = 1;
  ck_assert_int_eq(registry_add_storages(&reg, s, 3, &frame, err, sizeof err),
                   SP_EINVAL);
  s[1].sid = 2;
  s[1].base = 0x1000;
  ck_assert_int_eq(registry_add_storages(&reg, s, 3, &frame, err, sizeof err),
                   SP_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "base address"));
  s[1].base = 0x2000;
  ck_assert_int_eq(registry_add_storages(&reg, s, 3, &frame, err, sizeof err),
                   0);
  ck_assert_uint_eq(reg.nstorages, 3);
  struct req_storage again = {
      .sid = 9, .fd = 0, .offset = 0, .length = 8, .base = 0x3000};
  ck_assert_int_eq(
      registry_add_storages(&reg, &again, 1, &frame, err, sizeof err),
      SP_EINVAL);
  again.sid = 2;
  again.base = 0x9000;
  ck_assert_int_eq(
      registry_add_storages(&reg, &again, 1, &frame, err, sizeof err),
      SP_EINVAL);
  ck_assert_uint_eq(reg.nstorages, 3);
  registry_free(&reg);
  close(big);
  close(small);
}
END_TEST

static struct req_tensor tensor(const char *key, uint32_t sid, int64_t rows,
                                int64_t cols, int64_t offset) {
  struct req_tensor t;
  memset(&t, 0, sizeof t);
  t.key = key;
  t.key_len = strlen(key);
  t.sid = sid;
  t.view = (struct sp_view){.dtype = SP_DTYPE_FLOAT32,
                            .ndim = 2,
                            .shape = {rows, cols},
                            .stride = {cols, 1},
                            .offset = offset};
  t.placement = PLAN_REPLICATED;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  return t;
}

/* A frame registered in steps (registration.c): the registry reads as
 * before until the last step; a refusal in a late step, or a batch dropped
 * halfway, leaves it so; what a dropped batch took is freed (ASan and
 * valgrind see a leak). */
enum { BATCH_N = 64, BATCH_BUDGET = 5 };

static int step_all(struct registry *reg, struct reg_batch *b,
                    const struct sp_frame *frame, size_t before, char *err,
                    size_t errlen, int *steps) {
  int rc;
  *steps = 0;
  while ((rc = registry_batch_step(reg, b, frame, BATCH_BUDGET, err,
                                   errlen)) == 1) {
    ck_assert_uint_eq(reg->nstorages + reg->nkeys, before);
    (*steps)++;
  }
  return rc;
}

START_TEST(frames_registered_in_steps) {
  struct registry reg;
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  int fd = tmodel_memfd("reg", BATCH_N * 64);
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  struct req_storage s[BATCH_N];
  for (uint32_t i = 0; i < BATCH_N; i++)
    s[i] = (struct req_storage){.sid = i + 1, .fd = 0, .offset = i * 64,
                                .length = 64, .base = 0x10000 + i * 64};
  /* Dropped halfway through its indexing: nothing counted; the daemon
   * adds nothing more to such a registry (its rank is gone), and what the
   * batch took is freed with it or with the registry. */
  struct reg_batch *b;
  ck_assert_int_eq(registry_batch_storages(s, BATCH_N, &b, err, sizeof err),
                   0);
  for (int i = 0; i < (BATCH_N / BATCH_BUDGET) + 3; i++)
    ck_assert_int_eq(
        registry_batch_step(&reg, b, &frame, BATCH_BUDGET, err, sizeof err),
        1);
  registry_batch_free(b);
  ck_assert_uint_eq(reg.nstorages, 0);
  registry_free(&reg);
  registry_init(&reg, SP_DEVICE_CPU);
  /* Stepped to its end: checked in 13 steps, indexed in 13 more (the last
   * check leaves budget for the first entries). */
  int steps;
  ck_assert_int_eq(registry_batch_storages(s, BATCH_N, &b, err, sizeof err),
                   0);
  ck_assert_int_eq(step_all(&reg, b, &frame, 0, err, sizeof err, &steps), 0);
  registry_batch_free(b);
  ck_assert_int_eq(steps, 2 * BATCH_N / BATCH_BUDGET);
  ck_assert_uint_eq(reg.nstorages, BATCH_N);
  for (uint32_t i = 0; i < BATCH_N; i++)
    ck_assert_uint_eq(registry_find_sid(&reg, i + 1), i);
  /* Tensors: the last one's view is past its storage, refused in the last
   * check step; then the same keys, fixed, register. */
  struct req_tensor t[BATCH_N];
  char keys[BATCH_N][8];
  for (uint32_t i = 0; i < BATCH_N; i++) {
    snprintf(keys[i], sizeof keys[i], "k%u", i);
    t[i] = tensor(keys[i], i + 1, 4, 4, 0);
  }
  t[BATCH_N - 1].view.shape[0] = 5;
  ck_assert_int_eq(registry_batch_tensors(t, BATCH_N, &b, err, sizeof err), 0);
  ck_assert_int_eq(step_all(&reg, b, NULL, BATCH_N, err, sizeof err, &steps),
                   SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(err, "tensors[63]"));
  registry_batch_free(b);
  ck_assert_int_eq(steps, BATCH_N / BATCH_BUDGET);
  ck_assert_uint_eq(reg.nkeys, 0);
  t[BATCH_N - 1].view.shape[0] = 4;
  ck_assert_int_eq(registry_add_tensors(&reg, t, BATCH_N, err, sizeof err), 0);
  ck_assert_uint_eq(reg.nkeys, BATCH_N);
  registry_free(&reg);
  close(fd);
}
END_TEST

/* Writes byte pattern (page + index) into pages [from, to) of fd. */
static void fill_pages(int fd, size_t from, size_t to) {
  uint8_t page[4096];
  for (size_t p = from; p < to; p++) {
    for (size_t i = 0; i < sizeof page; i++)
      page[i] = (uint8_t)(p * 31 + i);
    ck_assert_int_eq(pwrite(fd, page, sizeof page, (off_t)(p * 4096)),
                     (ssize_t)sizeof page);
  }
}

static void check_page(const struct registry *reg, uint32_t sid, size_t p) {
  uint32_t i = registry_find_sid(reg, sid);
  ck_assert_uint_ne(i, IDXSET_NONE);
  for (size_t k = 0; k < 4096; k += 1021)
    ck_assert_uint_eq(reg->info[i].data[k], (uint8_t)(p * 31 + k));
}

/* A thousand one-page storages in one memfd, over frames that each bring
 * their own descriptors of it: one mapping.  The file grows, and a storage
 * near the end of the new part gets a mapping that takes the old one in;
 * the storages before it read on through the new one. */
START_TEST(storages_share_mappings) {
  enum { PAGES = 1000 };
  struct registry reg;
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  int fd = tmodel_memfd("reg", PAGES * 4096);
  fill_pages(fd, 0, PAGES);
  int maps = count_maps();
  struct req_storage *s = calloc(PAGES, sizeof *s);
  ck_assert_ptr_nonnull(s);
  for (uint32_t p = 0; p < PAGES; p++)
    s[p] = (struct req_storage){.sid = p,
                                .fd = p % 2,
                                .offset = (uint64_t)p * 4096,
                                .length = 4096,
                                .base = 0x100000 + (uint64_t)p * 4096};
  for (uint32_t first = 0; first < PAGES; first += 100) {
    struct sp_frame frame = {.nfds = 2};
    frame.fds[0] = dup(fd);
    frame.fds[1] = dup(fd);
    ck_assert_int_eq(
        registry_add_storages(&reg, s + first, 100, &frame, err, sizeof err),
        0);
    close(frame.fds[0]);
    close(frame.fds[1]);
  }
  ck_assert_int_eq(count_maps(), maps + 1);
  ck_assert_uint_eq(reg.nstorages, PAGES);
  check_page(&reg, 0, 0);
  check_page(&reg, PAGES - 1, PAGES - 1);

  ck_assert_int_eq(ftruncate(fd, (PAGES + 8) * 4096), 0);
  fill_pages(fd, PAGES, PAGES + 8);
  struct req_storage grown[2] = {
      /* Inside the old mapping: shares it. */
      {.sid = PAGES, .fd = 0, .offset = 10, .length = 20, .base = 0x10},
      /* Past it, near enough to join it: replaces it. */
      {.sid = PAGES + 1, .fd = 0, .offset = (PAGES + 4) * 4096,
       .length = 4096, .base = 0x20}};
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  ck_assert_int_eq(registry_add_storages(&reg, grown, 1, &frame, err,
                                         sizeof err),
                   0);
  ck_assert_int_eq(count_maps(), maps + 1);
  ck_assert_int_eq(registry_add_storages(&reg, grown + 1, 1, &frame, err,
                                         sizeof err),
                   0);
  ck_assert_int_eq(count_maps(), maps + 1);
  ck_assert_uint_eq(reg.nmaps, 1);
  check_page(&reg, PAGES + 1, PAGES + 4);
  check_page(&reg, 7, 7);
  char perms[8];
  maps_perms(reg.info[registry_find_sid(&reg, PAGES + 1)].data, perms);
  ck_assert_str_eq(perms, "r--s");

  /* Another memfd is another file, whatever its descriptor's number. */
  int other = tmodel_memfd("reg", 4096);
  struct req_storage third = {
      .sid = PAGES + 2, .fd = 0, .offset = 0, .length = 1, .base = 0x30};
  frame.fds[0] = other;
  ck_assert_int_eq(
      registry_add_storages(&reg, &third, 1, &frame, err, sizeof err), 0);
  ck_assert_int_eq(count_maps(), maps + 2);
  registry_free(&reg);
  ck_assert_int_eq(count_maps(), maps);
  free(s);
  close(fd);
  close(other);
}
END_TEST

/* This process's address space, from /proc/self/status, in KiB. */
static long vm_size_kb(void) {
  FILE *f = fopen("/proc/self/status", "re");
  char line[256];
  long kb = -1;
  ck_assert_ptr_nonnull(f);
  while (fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "VmSize:", 7) == 0)
      kb = strtol(line + 7, NULL, 10);
  fclose(f);
  ck_assert_int_ge(kb, 0);
  return kb;
}

/* Registers one-page storages at these pages of fd in one frame. */
static int add_pages(struct registry *reg, int fd, uint32_t first_sid,
                     const uint64_t *pages, size_t n) {
  struct req_storage s[8];
  char err[256];
  ck_assert_uint_le(n, 8);
  for (size_t i = 0; i < n; i++)
    s[i] = (struct req_storage){.sid = first_sid + (uint32_t)i,
                                .fd = 0,
                                .offset = pages[i] * 4096,
                                .length = 4096,
                                .base = 0x100000 + pages[i] * 4096};
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  return registry_add_storages(reg, s, n, &frame, err, sizeof err);
}

/* A sparse file of 16 TiB with a storage in its first page and one in its
 * last: the daemon maps the pages around them, not the 16 TiB between
 * them. */
START_TEST(sparse_file_maps_storage_pages) {
  const uint64_t last = (UINT64_C(16) << 40) / 4096 - 1;
  struct registry reg;
  registry_init(&reg, SP_DEVICE_CPU);
  int fd = tmodel_memfd("reg", 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)((last + 1) * 4096)), 0);
  long before = vm_size_kb();
  uint64_t pages[2] = {0, last};
  ck_assert_int_eq(add_pages(&reg, fd, 0, pages, 2), 0);
  long grown = vm_size_kb() - before;
  ck_assert_uint_eq(reg.nmaps, 2);
  /* The first page's run widened to two pages; the last ends the file. */
  ck_assert_uint_eq(reg.used.mapped_bytes, 3 * 4096);
  ck_assert_msg(grown < 1024, "VmSize grew by %ld KiB", grown);
  registry_free(&reg);
  close(fd);
}
END_TEST

/* Two one-page storages share a mapping while the pages between them are
 * no more than the pages they cover (two), and not past that. */
START_TEST(runs_join_at_their_edge) {
  int fd = tmodel_memfd("reg", 64 * 4096);
  int maps = count_maps();
  struct registry reg;
  registry_init(&reg, SP_DEVICE_CPU);
  uint64_t joined[2] = {0, 3};
  ck_assert_int_eq(add_pages(&reg, fd, 0, joined, 2), 0);
  ck_assert_uint_eq(reg.nmaps, 1);
  ck_assert_uint_eq(reg.used.mapped_bytes, 4 * 4096);
  ck_assert_int_eq(count_maps(), maps + 1);
  registry_free(&reg);
  registry_init(&reg, SP_DEVICE_CPU);
  uint64_t apart[2] = {0, 4};
  ck_assert_int_eq(add_pages(&reg, fd, 0, apart, 2), 0);
  ck_assert_uint_eq(reg.nmaps, 2);
  ck_assert_uint_eq(reg.used.mapped_bytes, 4 * 4096);
  ck_assert_int_eq(count_maps(), maps + 2);
  registry_free(&reg);
  ck_assert_int_eq(count_maps(), maps);
  close(fd);
}
END_TEST

/* One-page storages on every other page of a memfd, one frame each: a
 * trainer's allocator with gaps.  Each frame's run takes the mapping
 * before it in, so the file stays one mapping of at most twice the pages
 * registered, and every storage reads its own page through it. */
START_TEST(every_other_page_one_frame_each) {
  enum { STORAGES = 2000 };
  int fd = tmodel_memfd("reg", 4 * STORAGES * 4096);
  fill_pages(fd, 0, 2 * STORAGES);
  int maps = count_maps();
  struct registry reg;
  registry_init(&reg, SP_DEVICE_CPU);
  for (uint32_t i = 0; i < STORAGES; i++) {
    uint64_t page = 2 * (uint64_t)i;
    ck_assert_int_eq(add_pages(&reg, fd, i, &page, 1), 0);
  }
  ck_assert_uint_eq(reg.nmaps, 1);
  ck_assert_int_eq(count_maps(), maps + 1);
  ck_assert_uint_le(reg.used.mapped_bytes, 2 * STORAGES * 4096);
  for (uint32_t i = 0; i < STORAGES; i += 7)
    check_page(&reg, i, 2 * i);
  registry_free(&reg);
  close(fd);
}
END_TEST

/* Two descriptors of one file in a frame while the trainer resizes it:
 * every storage registered lies inside the mapping it points into, whatever
 * size each descriptor's fstat saw. */
struct resizer {
  int fd;
  atomic_bool stop;
};

/* Holds each size for about 5 microseconds, a good part of the time a
 * frame of FIRST storages takes between its two fstats. */
static void hold(void) {
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  do
    clock_gettime(CLOCK_MONOTONIC, &b);
  while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) <
         5000);
}

static void *resize_main(void *arg) {
  struct resizer *r = arg;
  while (!atomic_load(&r->stop)) {
    ck_assert_int_eq(ftruncate(r->fd, 2 * 4096), 0);
    hold();
    ck_assert_int_eq(ftruncate(r->fd, 64 * 4096), 0);
    hold();
  }
  return NULL;
}

static bool inside_a_mapping(const struct registry *reg, uint32_t idx) {
  const uint8_t *lo = reg->info[idx].data;
  const uint8_t *hi = lo + reg->storages[idx].nbytes;
  for (size_t m = 0; m < reg->nmaps; m++) {
    const uint8_t *a = reg->maps[m].addr;
    if (lo >= a && hi <= a + reg->maps[m].len)
      return true;
  }
  return false;
}

START_TEST(storages_inside_mappings_while_resized) {
  enum { FIRST = 1000, TRIES = 3000 };
  static struct req_storage s[FIRST + 1];
  for (uint32_t i = 0; i < FIRST; i++)
    s[i] = (struct req_storage){
        .sid = i, .fd = 0, .offset = 0, .length = 1, .base = 0x1000 + i};
  /* The last on the other descriptor, near the end of the larger size. */
  s[FIRST] = (struct req_storage){.sid = FIRST, .fd = 1,
                                  .offset = 63 * 4096, .length = 4096,
                                  .base = 0x100000};
  struct resizer r = {.fd = tmodel_memfd("reg", 2 * 4096)};
  pthread_t thread;
  ck_assert_int_eq(pthread_create(&thread, NULL, resize_main, &r), 0);
  int registered = 0;
  for (int t = 0; t < TRIES; t++) {
    struct registry reg;
    char err[256];
    registry_init(&reg, SP_DEVICE_CPU);
    struct sp_frame frame = {.nfds = 2};
    frame.fds[0] = r.fd;
    frame.fds[1] = dup(r.fd);
    if (registry_add_storages(&reg, s, FIRST + 1, &frame, err, sizeof err) ==
        0) {
      registered++;
      for (uint32_t i = 0; i <= FIRST; i++)
        ck_assert_msg(inside_a_mapping(&reg, i),
                      "try %d: storage %u lies outside every mapping", t, i);
    }
    close(frame.fds[1]);
    registry_free(&reg);
  }
  atomic_store(&r.stop, true);
  pthread_join(thread, NULL);
  close(r.fd);
  /* Not vacuous: some frames were taken. */
  ck_assert_int_gt(registered, 0);
}
END_TEST

/* The quota a registry is given sees what each frame would take (a file
 * already mapped costs no mapping), and a refusal keeps nothing. */
struct quota_probe {
  struct reg_usage asked, charged;
  bool refuse;
};

static int probe_admit(void *arg, const struct registry *reg,
                       const struct reg_usage *more, char *msg,
                       size_t msglen) {
  (void)reg;
  struct quota_probe *q = arg;
  q->asked = *more;
  if (q->refuse)
    snprintf(msg, msglen, "refused");
  return q->refuse ? SP_ELIMIT : 0;
}

static void probe_charge(void *arg, const struct reg_usage *more) {
  struct quota_probe *q = arg;
  q->charged.mappings += more->mappings;
  q->charged.mapped_bytes += more->mapped_bytes;
  q->charged.registrations += more->registrations;
  q->charged.bytes += more->bytes;
}

static void probe_release(void *arg, const struct reg_usage *less) {
  struct quota_probe *q = arg;
  q->charged.mappings -= less->mappings;
  q->charged.mapped_bytes -= less->mapped_bytes;
}

static const struct reg_quota_ops probe_ops = {probe_admit, probe_charge,
                                               probe_release};

START_TEST(quota_sees_each_frame) {
  struct registry reg;
  struct quota_probe q = {.refuse = true};
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  reg.quota = &probe_ops;
  reg.quota_arg = &q;
  int fd = tmodel_memfd("reg", 8192);
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  struct req_storage s[2] = {
      {.sid = 1, .fd = 0, .offset = 0, .length = 4096, .base = 0x1000},
      {.sid = 2, .fd = 0, .offset = 4096, .length = 4096, .base = 0x2000}};
  int maps = count_maps();
  ck_assert_int_eq(registry_add_storages(&reg, s, 2, &frame, err, sizeof err),
                   SP_ELIMIT);
  ck_assert_str_eq(err, "refused");
  ck_assert_uint_eq(q.asked.mappings, 1);
  ck_assert_uint_eq(q.asked.registrations, 2);
  ck_assert_uint_gt(q.asked.bytes, 0);
  ck_assert_uint_eq(reg.nstorages, 0);
  ck_assert_int_eq(count_maps(), maps);
  ck_assert_uint_eq(q.charged.registrations, 0);

  q.refuse = false;
  ck_assert_int_eq(registry_add_storages(&reg, s, 1, &frame, err, sizeof err),
                   0);
  ck_assert_int_eq(registry_add_storages(&reg, s + 1, 1, &frame, err,
                                         sizeof err),
                   0);
  ck_assert_uint_eq(q.asked.mappings, 0);
  ck_assert_uint_eq(q.charged.mappings, 1);
  ck_assert_uint_eq(q.charged.registrations, 2);
  ck_assert_uint_eq(reg.used.mappings, 1);
  ck_assert_uint_eq(reg.used.registrations, 2);
  ck_assert_uint_eq(reg.used.bytes, q.charged.bytes);

  /* A tensor costs its key's bytes beside its entry. */
  struct req_tensor t = tensor("k", 1, 1, 1, 0);
  ck_assert_int_eq(registry_add_tensors(&reg, &t, 1, err, sizeof err), 0);
  uint64_t short_key = q.asked.bytes;
  t = tensor("kkkkkkkkkk", 1, 1, 1, 0);
  q.refuse = true;
  ck_assert_int_eq(registry_add_tensors(&reg, &t, 1, err, sizeof err),
                   SP_ELIMIT);
  ck_assert_uint_eq(q.asked.bytes, short_key + 9);
  ck_assert_uint_eq(reg.nkeys, 1);
  ck_assert_uint_eq(reg.used.registrations, 3);
  registry_free(&reg);
  close(fd);
}
END_TEST

START_TEST(tensors_checked_against_storages) {
  struct registry reg;
  char err[256];
  registry_init(&reg, SP_DEVICE_CPU);
  int fd = tmodel_memfd("reg", 4096);
  struct sp_frame frame = {.nfds = 1};
  frame.fds[0] = fd;
  /* 103 bytes: 25 whole float32 elements, the tail is never part of a view. */
  struct req_storage s = {
      .sid = 1, .fd = 0, .offset = 0, .length = 103, .base = 0x1000};
  ck_assert_int_eq(registry_add_storages(&reg, &s, 1, &frame, err, sizeof err),
                   0);
  struct req_tensor t[3];
  t[0] = tensor("a", 1, 5, 5, 0);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err), 0);
  t[0] = tensor("b", 1, 2, 13, 0);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err),
                   SP_EOUTOFBOUNDS);
  ck_assert_ptr_nonnull(strstr(err, "'b'"));
  ck_assert_ptr_nonnull(strstr(err, "sid 1"));
  t[0] = tensor("b", 1, 1, 1, 25);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err),
                   SP_EOUTOFBOUNDS);
  t[0] = tensor("b", 2, 1, 1, 0);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err),
                   SP_ENOSTORAGE);
  t[0] = tensor("b", 1, 2, 2, 0);
  t[0].view.stride[1] = 0;
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err),
                   SP_EZEROSTRIDE);
  t[0] = tensor("b", 1, 2, 2, 0);
  t[0].view.stride[0] = 1;
  ck_assert_int_eq(registry_add_tensors(&reg, t, 1, err, sizeof err),
                   SP_ESELFOVERLAP);
  ck_assert_uint_eq(reg.nkeys, 1);

  /* A duplicate in the frame, or of a registered key, refuses the frame. */
  t[0] = tensor("b", 1, 1, 1, 0);
  t[1] = tensor("c", 1, 1, 1, 1);
  t[2] = tensor("b", 1, 1, 1, 2);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 3, err, sizeof err),
                   SP_EDUPKEY);
  t[2] = tensor("a", 1, 1, 1, 2);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 3, err, sizeof err),
                   SP_EDUPKEY);
  ck_assert_ptr_nonnull(strstr(err, "'a'"));
  /* A bad view last refuses the good ones before it. */
  t[2] = tensor("d", 1, 1, 1, 99);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 3, err, sizeof err),
                   SP_EOUTOFBOUNDS);
  ck_assert_uint_eq(reg.nkeys, 1);
  t[2] = tensor("d", 1, 1, 1, 24);
  ck_assert_int_eq(registry_add_tensors(&reg, t, 3, err, sizeof err), 0);
  ck_assert_uint_eq(reg.nkeys, 4);
  ck_assert_str_eq(reg.keys[3].name, "d");
  ck_assert_uint_eq(reg.keys[3].nbytes, 4);
  ck_assert_uint_eq(reg.keys[3].device_type, SP_DEVICE_CPU);

  struct plan_input_store *store = plan_input_store_new(4);
  ck_assert_int_eq(registry_plan_rank(&reg, 3, 0, NULL, store, err, sizeof err),
                   0);
  const struct plan_input *in = plan_input_of(store);
  ck_assert_uint_eq(in->nranks, 1);
  ck_assert_uint_eq(in->ranks[0].rank, 3);
  ck_assert_uint_eq(in->ranks[0].nentries, 4);
  ck_assert_uint_eq(in->ranks[0].nstorages, 1);
  plan_input_store_free(store);
  registry_free(&reg);
  close(fd);
}
END_TEST

static uint64_t set_values[5000];

static bool match_value(const void *ctx, uint32_t idx) {
  return set_values[idx] == *(const uint64_t *)ctx;
}

START_TEST(idxset_grows_and_finds) {
  struct idxset s;
  idxset_init(&s);
  ck_assert_uint_eq(idxset_find(&s, 1, match_value, &set_values[0]),
                    IDXSET_NONE);
  for (uint32_t i = 0; i < 5000; i++) {
    set_values[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull;
    ck_assert_int_eq(idxset_reserve(&s, 1), 0);
    idxset_insert(&s, idxset_hash_u64(set_values[i]), i);
  }
  ck_assert_uint_eq(s.count, 5000);
  ck_assert_uint_ge(s.mask + 1, 10000);
  for (uint32_t i = 0; i < 5000; i++)
    ck_assert_uint_eq(idxset_find(&s, idxset_hash_u64(set_values[i]),
                                  match_value, &set_values[i]),
                      i);
  uint64_t absent = 12345;
  ck_assert_uint_eq(
      idxset_find(&s, idxset_hash_u64(absent), match_value, &absent),
      IDXSET_NONE);
  /* Equal strings hash equal; the hash looks at every byte. */
  ck_assert_uint_eq(idxset_hash_bytes("layer.0", 7),
                    idxset_hash_bytes("layer.0", 7));
  ck_assert_uint_ne(idxset_hash_bytes("layer.0", 7),
                    idxset_hash_bytes("layer.1", 7));
  idxset_free(&s);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-registry");
  TCase *tc = tcase_create("requests");
  tcase_add_test(tc, job_create_bounds);
  tcase_add_test(tc, job_create_consumers_bounds);
  tcase_add_test(tc, target_bounds);
  tcase_add_test(tc, join_bounds);
  tcase_add_test(tc, ticket_decoding);
  tcase_add_test(tc, storage_bounds);
  tcase_add_test(tc, tensor_bounds);
  tcase_add_test(tc, export_options);
  tcase_add_test(tc, export_save_options);
  suite_add_tcase(s, tc);
  tc = tcase_create("registry");
  /* storages_inside_mappings_while_resized takes a few seconds under load
   * (its tries race a resizing thread). */
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, storages_map_read_only);
  tcase_add_test(tc, storage_frames_whole_or_nothing);
  tcase_add_test(tc, tensors_checked_against_storages);
  tcase_add_test(tc, storages_share_mappings);
  tcase_add_test(tc, frames_registered_in_steps);
  tcase_add_test(tc, sparse_file_maps_storage_pages);
  tcase_add_test(tc, runs_join_at_their_edge);
  tcase_add_test(tc, every_other_page_one_frame_each);
  tcase_add_test(tc, storages_inside_mappings_while_resized);
  tcase_add_test(tc, quota_sees_each_frame);
  tcase_add_test(tc, idxset_grows_and_finds);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
