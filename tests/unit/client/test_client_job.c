/*
 * test_client_job.c - the job half of libshardport against a scripted fake
 * daemon: how create/join/leave, registration batches and export replies
 * are sent and read, and every export reply the library must refuse.
 *
 * The real daemon is exercised by tests/integration/export; this suite
 * covers what a correct daemon never sends and what is hard to provoke
 * from one (frame boundaries, descriptor counts, broken replies).
 */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/unit/client/fake_daemon.h"

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Memfds the fake creates carry this name, so that the test can find the
 * client's mappings and descriptors of them in /proc/self. */
#define SEG_NAME "sp-fake-seg"

/* ---- what the scripts saw ---- */

#define OPS_MAX 64
struct seen {
  int rc;       /* first failing helper's code, 0 if none */
  int variant;  /* which reply to send */
  char ops[OPS_MAX][32];
  size_t nops;  /* every request op after the hello, in order */
  uint64_t released; /* export_id of the release request, 0 if none */
  /* registration batches */
  size_t frames;
  size_t per_frame[64];
  size_t frame_bytes[64];
  size_t total;
  int fd_mismatch; /* storage fds whose content did not name their sid */
  int order_errors;
  int affine_ok;
  bool export_progress; /* the export request asked for progress */
  uint64_t max_keys, timeout_ms;
  size_t ngroups;
};

static void note(struct seen *s, int rc) {
  if (s->rc == 0 && rc < 0)
    s->rc = rc;
}

static void record(struct seen *s, const char *op) {
  if (s->nops < OPS_MAX)
    snprintf(s->ops[s->nops++], sizeof s->ops[0], "%s", op);
}

/* Counts lines of /proc/self/maps and entries of /proc/self/fd that name the
 * fake's segments. */
static int seg_mappings(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  int n = 0;
  while (f && fgets(line, sizeof line, f))
    if (strstr(line, SEG_NAME))
      n++;
  if (f)
    fclose(f);
  return n;
}

static int seg_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *de;
  int n = 0;
  while (d && (de = readdir(d))) {
    char path[300], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%s", de->d_name);
    ssize_t len = readlink(path, target, sizeof target - 1);
    if (len > 0) {
      target[len] = '\0';
      if (strstr(target, SEG_NAME))
        n++;
    }
  }
  if (d)
    closedir(d);
  return n;
}

/* Replies {"op":op,"id":id,"count":count}. */
static int send_count(int conn, const char *op, uint64_t id, uint64_t count) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, id, 1);
  sp__pack_kv_u64(&mb.pk, "count", count);
  return fake_send(conn, &mb, NULL, 0);
}

/* Serves requests after the hello until the client closes: op names are
 * recorded, each is answered by handler (or with its bare op). */
typedef int handler_fn(int conn, struct fake_request *req, struct seen *s);

static void serve(int conn, struct seen *s, handler_fn *handler) {
  note(s, fake_hello(conn));
  for (;;) {
    struct fake_request req;
    int rc = fake_recv(conn, &req);
    if (rc == SP_ECLOSED)
      return;
    note(s, rc);
    if (rc < 0)
      return;
    record(s, req.head.op);
    rc = handler ? handler(conn, &req, s) : 1;
    if (rc == 1)
      rc = fake_send_op(conn, req.head.op, req.head.id);
    note(s, rc);
    fake_request_free(&req);
  }
}

static sp_client *connect_to(struct fake_daemon *d) {
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d->socket, &c), 0);
  return c;
}

/* A memfd of len bytes whose byte i is (i * 7 + salt) & 0xff, sealed
 * against shrinking and growing as the daemon's pool segments are. */
static int pattern_memfd(const char *name, size_t len, unsigned salt) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  uint8_t *buf = malloc(len ? len : 1);
  for (size_t i = 0; i < len; i++)
    buf[i] = (uint8_t)(i * 7 + salt);
  ck_assert_int_eq(pwrite(fd, buf, len, 0), (ssize_t)len);
  free(buf);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

/* ---- create / join / leave ---- */

static int job_handler(int conn, struct fake_request *req, struct seen *s) {
  if (strcmp(req->head.op, "job_create") == 0) {
    uint64_t world = 0;
    sp__msg_get_u64(&req->map, "world", false, &world);
    if (world != 3)
      return SP_EBADMSG;
    struct sp_msgbuf mb;
    sp__msgbuf_begin(&mb, "job_create", req->head.id, 2);
    sp__pack_kv_str(&mb.pk, "job_id", "0123456789abcdef0123456789abcdef");
    uint8_t ticket[40];
    for (size_t i = 0; i < sizeof ticket; i++)
      ticket[i] = (uint8_t)(200 + i);
    sp__pack_str(&mb.pk, "ticket");
    /* variant 1: a ticket longer than SP_TICKET_MAX */
    if (s->variant == 1) {
      uint8_t big[SP_TICKET_MAX + 1] = {0};
      sp__pack_bin(&mb.pk, big, sizeof big);
    } else {
      sp__pack_bin(&mb.pk, ticket, sizeof ticket);
    }
    return fake_send(conn, &mb, NULL, 0);
  }
  if (strcmp(req->head.op, "join") == 0) {
    const uint8_t *t;
    size_t len;
    uint64_t rank, world;
    char device[32];
    if (sp__msg_get_bin(&req->map, "ticket", false, &t, &len) != 0 ||
        len != 40 || t[0] != 200 || t[39] != 239 ||
        sp__msg_get_u64(&req->map, "rank", false, &rank) != 0 || rank != 2 ||
        sp__msg_get_u64(&req->map, "world", false, &world) != 0 || world != 3 ||
        sp__msg_get_strbuf(&req->map, "device", false, device, sizeof device) !=
            0 ||
        strcmp(device, "cpu") != 0)
      return fake_send_error(conn, req->head.id, "bad_ticket", "fields");
    struct sp_msgbuf mb;
    sp__msgbuf_begin(&mb, "join", req->head.id, 1);
    sp__pack_kv_str(&mb.pk, "job_id", "0123456789abcdef0123456789abcdef");
    return fake_send(conn, &mb, NULL, 0);
  }
  if (strcmp(req->head.op, "leave") == 0 && s->variant == 2)
    return fake_send_error(conn, req->head.id, "bad_state",
                           "this connection is in no job");
  return 1;
}

static void script_job(int conn, void *arg) { serve(conn, arg, job_handler); }

START_TEST(create_join_leave) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_job, &s), 0);
  sp_client *c = connect_to(&d);
  sp_ticket t;
  memset(&t, 0xff, sizeof t);
  ck_assert_int_eq(sp_job_create(c, 3, &t), 0);
  ck_assert_uint_eq(t.len, 40);
  ck_assert_uint_eq(t.bytes[0], 200);
  /* Zero past len: the whole struct may be sent as it is. */
  for (size_t i = t.len; i < SP_TICKET_MAX; i++)
    ck_assert_uint_eq(t.bytes[i], 0);
  ck_assert_int_eq(sp_job_join(c, &t, 2, 3, "cpu"), 0);
  ck_assert_int_eq(sp_job_leave(c), 0);
  /* Refused before anything is sent. */
  ck_assert_int_eq(sp_job_create(c, 0, &t), SP_EINVAL);
  ck_assert_int_eq(sp_job_create(c, 65537, &t), SP_EINVAL);
  ck_assert_int_eq(sp_job_join(c, &t, 0, 3, NULL), SP_EINVAL);
  sp_ticket empty = {0};
  ck_assert_int_eq(sp_job_join(c, &empty, 0, 3, "cpu"), SP_EINVAL);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.nops, 3);
  ck_assert_str_eq(s.ops[0], "job_create");
  ck_assert_str_eq(s.ops[1], "join");
  ck_assert_str_eq(s.ops[2], "leave");
}
END_TEST

START_TEST(oversized_ticket_is_ebadmsg) {
  struct seen s = {.variant = 1};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_job, &s), 0);
  sp_client *c = connect_to(&d);
  sp_ticket t = {0};
  ck_assert_int_eq(sp_job_create(c, 3, &t), SP_EBADMSG);
  ck_assert_uint_eq(t.len, 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

START_TEST(leave_refused_carries_message) {
  struct seen s = {.variant = 2};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_job, &s), 0);
  sp_client *c = connect_to(&d);
  ck_assert_int_eq(sp_job_leave(c), SP_ESTATE);
  ck_assert_str_eq(sp_last_message(c), "this connection is in no job");
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* ---- registration batches ---- */

/* Checks each storage: its fd's bytes at offset hold the sid. */
static int storage_handler(int conn, struct fake_request *req,
                           struct seen *s) {
  if (strcmp(req->head.op, "storage_add") != 0)
    return 1;
  const msgpack_object_array *a;
  if (sp__msg_get_array(&req->map, "storages", false, &a) != 0 ||
      a->size != req->frame.nfds)
    return fake_send_error(conn, req->head.id, "bad_message", "fds");
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *o = &a->ptr[i];
    uint64_t sid, fd, offset, length, base;
    char kind[16];
    if (sp__msg_get_u64(o, "sid", false, &sid) != 0 ||
        sp__msg_get_u64(o, "fd", false, &fd) != 0 || fd >= a->size ||
        sp__msg_get_u64(o, "offset", false, &offset) != 0 ||
        sp__msg_get_u64(o, "length", false, &length) != 0 ||
        sp__msg_get_u64(o, "base", false, &base) != 0 ||
        sp__msg_get_strbuf(o, "kind", false, kind, sizeof kind) != 0 ||
        strcmp(kind, "memfd") != 0 || length != 64 || base == 0)
      return fake_send_error(conn, req->head.id, "bad_message", "storage");
    uint32_t got = 0;
    if (pread(req->frame.fds[fd], &got, sizeof got, (off_t)offset) !=
            (ssize_t)sizeof got ||
        got != sid)
      s->fd_mismatch++;
  }
  if (s->frames < 64)
    s->per_frame[s->frames] = a->size;
  s->frames++;
  s->total += a->size;
  return send_count(conn, "storage_add", req->head.id, a->size);
}

static void script_storages(int conn, void *arg) {
  serve(conn, arg, storage_handler);
}

START_TEST(storages_go_in_frames_of_32_fds) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_storages, &s), 0);
  sp_client *c = connect_to(&d);
  enum { N = 70 };
  /* One memfd holds all storages at offsets 64 * i; each storage's first
   * word is its id, so the fake can tell a descriptor sent with the wrong
   * index. */
  int fd = memfd_create("storages", MFD_CLOEXEC);
  ck_assert_int_eq(ftruncate(fd, 64 * N), 0);
  uint8_t *map = mmap(NULL, 64 * N, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(map, MAP_FAILED);
  int fds[N];
  sp_storage_desc st[N];
  for (uint32_t i = 0; i < N; i++) {
    uint32_t sid = 1000 + i * 3;
    memcpy(map + 64 * i, &sid, sizeof sid);
    /* A descriptor of its own per storage, as a trainer's would be. */
    fds[i] = dup(fd);
    st[i] = (sp_storage_desc){.id = sid, .fd = fds[i], .offset = 64 * i,
                              .length = 64, .addr = map + 64 * i};
  }
  ck_assert_int_eq(sp_register_storages(c, st, N), 0);
  /* An id already registered, or given twice, is refused unsent. */
  ck_assert_int_eq(sp_register_storages(c, st + 5, 1), SP_EINVAL);
  sp_storage_desc twice[2] = {st[0], st[0]};
  twice[0].id = twice[1].id = 7;
  ck_assert_int_eq(sp_register_storages(c, twice, 2), SP_EINVAL);
  sp_storage_desc bad = st[0];
  bad.id = 8;
  bad.fd = -1;
  ck_assert_int_eq(sp_register_storages(c, &bad, 1), SP_EINVAL);
  bad.fd = fds[0];
  bad.addr = NULL;
  ck_assert_int_eq(sp_register_storages(c, &bad, 1), SP_EINVAL);
  ck_assert_int_eq(sp_register_storages(c, NULL, 0), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.frames, 3);
  ck_assert_uint_eq(s.per_frame[0], 32);
  ck_assert_uint_eq(s.per_frame[1], 32);
  ck_assert_uint_eq(s.per_frame[2], 6);
  ck_assert_uint_eq(s.total, N);
  ck_assert_int_eq(s.fd_mismatch, 0);
  ck_assert_uint_eq(s.nops, 3);
  /* The caller's descriptors stay open and the caller's. */
  for (int i = 0; i < N; i++)
    ck_assert_int_eq(close(fds[i]), 0);
  munmap(map, 64 * N);
  close(fd);
}
END_TEST

/* Checks that tensors arrive in order, every frame under the budget, and
 * the affine tensor (the last) with its pieces. */
static int tensor_handler(int conn, struct fake_request *req, struct seen *s) {
  if (strcmp(req->head.op, "tensor_add") != 0)
    return 1;
  const msgpack_object_array *a;
  if (sp__msg_get_array(&req->map, "tensors", false, &a) != 0)
    return fake_send_error(conn, req->head.id, "bad_message", "tensors");
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *o = &a->ptr[i];
    char key[1100], want[1100], placement[16], dtype[16];
    if (s->variant == 2)
      snprintf(want, sizeof want, "s.%06zu", s->total);
    else
      snprintf(want, sizeof want, "layer.%06zu.%0300d", s->total, 0);
    uint64_t sid, offset;
    const msgpack_object_array *shape, *stride, *gshape;
    if (sp__msg_get_strbuf(o, "key", false, key, sizeof key) != 0 ||
        sp__msg_get_strbuf(o, "placement", false, placement,
                           sizeof placement) != 0 ||
        sp__msg_get_strbuf(o, "dtype", false, dtype, sizeof dtype) != 0 ||
        sp__msg_get_u64(o, "sid", false, &sid) != 0 ||
        sp__msg_get_u64(o, "offset", false, &offset) != 0 ||
        sp__msg_get_array(o, "shape", false, &shape) != 0 ||
        sp__msg_get_array(o, "stride", false, &stride) != 0 ||
        sp__msg_get_array(o, "global_shape", false, &gshape) != 0)
      return fake_send_error(conn, req->head.id, "bad_message", "tensor");
    if (strcmp(placement, "affine") == 0) {
      const msgpack_object_array *pieces, *holders, *dst;
      uint64_t dst_offset;
      if (sp__msg_get_array(o, "pieces", false, &pieces) == 0 &&
          pieces->size == 2 &&
          sp__msg_get_array(&pieces->ptr[1], "holders", false, &holders) == 0 &&
          holders->size == 2 && holders->ptr[1].via.u64 == 3 &&
          sp__msg_get_array(&pieces->ptr[1], "dst_stride", false, &dst) == 0 &&
          dst->size == 2 && dst->ptr[0].via.u64 == 8 &&
          sp__msg_get_u64(&pieces->ptr[1], "dst_offset", false, &dst_offset) ==
              0 &&
          dst_offset == 4)
        s->affine_ok = 1;
    } else if (strcmp(key, want) != 0 || strcmp(placement, "shard0") != 0 ||
               strcmp(dtype, "bfloat16") != 0 || shape->size != 2 ||
               shape->ptr[0].via.u64 != s->total % 5 || sid != 9 ||
               offset != s->total) {
      s->order_errors++;
    }
    s->total++;
  }
  if (s->frames < 64) {
    s->per_frame[s->frames] = a->size;
    s->frame_bytes[s->frames] = req->frame.len;
  }
  s->frames++;
  return send_count(conn, "tensor_add", req->head.id,
                    s->variant == 1 ? a->size + 1 : a->size);
}

static void script_tensors(int conn, void *arg) {
  serve(conn, arg, tensor_handler);
}

START_TEST(tensors_go_in_frames_under_the_budget) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_tensors, &s), 0);
  sp_client *c = connect_to(&d);
  /* Keys of about 310 bytes: 30,000 of them make about 10 MiB of
   * metadata, which must not go in one frame. */
  enum { N = 30000 };
  sp_tensor_desc *t = calloc(N + 1, sizeof *t);
  char **keys = calloc(N, sizeof *keys);
  for (size_t i = 0; i < N; i++) {
    keys[i] = malloc(320);
    snprintf(keys[i], 320, "layer.%06zu.%0300d", i, 0);
    t[i] = (sp_tensor_desc){.key = keys[i], .storage = 9, .dtype = "bfloat16",
                            .ndim = 2, .shape = {(int64_t)(i % 5), 4},
                            .stride = {4, 1}, .offset = (int64_t)i,
                            .placement = SP_PLACEMENT_SHARD0,
                            .global_ndim = 2, .global_shape = {20, 4}};
  }
  uint32_t holders[2] = {1, 3};
  sp_piece pieces[2] = {
      {.ndim = 2, .shape = {2, 4}, .src_stride = {4, 1}, .dst_stride = {8, 1},
       .nholders = 2, .holders = holders},
      {.ndim = 2, .shape = {2, 4}, .src_offset = 8, .src_stride = {4, 1},
       .dst_offset = 4, .dst_stride = {8, 1}, .nholders = 2,
       .holders = holders},
  };
  t[N] = (sp_tensor_desc){.key = "cols", .storage = 9, .dtype = "float32",
                          .ndim = 2, .shape = {4, 4}, .stride = {4, 1},
                          .placement = SP_PLACEMENT_AFFINE, .global_ndim = 2,
                          .global_shape = {2, 8}, .npieces = 2,
                          .pieces = pieces};
  ck_assert_int_eq(sp_register_tensors(c, t, N + 1), 0);

  /* What the wire cannot carry is refused unsent. */
  sp_tensor_desc bad = t[0];
  bad.shape[0] = -1;
  ck_assert_int_eq(sp_register_tensors(c, &bad, 1), SP_EINVAL);
  bad = t[0];
  bad.ndim = SP_MAX_DIMS + 1;
  ck_assert_int_eq(sp_register_tensors(c, &bad, 1), SP_EINVAL);
  bad = t[0];
  bad.npieces = 2;
  bad.pieces = pieces;
  ck_assert_int_eq(sp_register_tensors(c, &bad, 1), SP_EINVAL);
  bad = t[0];
  bad.key = "";
  ck_assert_int_eq(sp_register_tensors(c, &bad, 1), SP_EINVAL);
  bad = t[0];
  bad.placement = (sp_placement)42;
  ck_assert_int_eq(sp_register_tensors(c, &bad, 1), SP_EINVAL);

  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.total, N + 1);
  ck_assert_uint_ge(s.frames, 3);
  for (size_t i = 0; i < s.frames; i++)
    ck_assert_uint_le(s.frame_bytes[i], (4u << 20) + 64);
  ck_assert_int_eq(s.order_errors, 0);
  ck_assert_int_eq(s.affine_ok, 1);
  for (size_t i = 0; i < N; i++)
    free(keys[i]);
  free(keys);
  free(t);
}
END_TEST

/* Short keys: 60,000 tensors are 3.6 MB, under the byte budget, but about
 * 1.2 million msgpack items, which no single frame may hold. */
START_TEST(tensors_go_in_frames_under_the_item_limit) {
  struct seen s = {.variant = 2};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_tensors, &s), 0);
  sp_client *c = connect_to(&d);
  enum { N = 60000 };
  sp_tensor_desc *t = calloc(N, sizeof *t);
  char (*keys)[16] = calloc(N, sizeof *keys);
  for (size_t i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "s.%06zu", i);
    t[i] = (sp_tensor_desc){.key = keys[i], .storage = 9, .dtype = "bfloat16",
                            .ndim = 2, .shape = {(int64_t)(i % 5), 4},
                            .stride = {4, 1}, .offset = (int64_t)i,
                            .placement = SP_PLACEMENT_SHARD0,
                            .global_ndim = 2, .global_shape = {20, 4}};
  }
  ck_assert_int_eq(sp_register_tensors(c, t, N), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  /* The fake reads each frame with the protocol's default limits: one
   * over them would have failed its read. */
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.total, N);
  ck_assert_uint_ge(s.frames, 3);
  ck_assert_int_eq(s.order_errors, 0);
  free(keys);
  free(t);
}
END_TEST

START_TEST(tensor_count_mismatch_is_ebadmsg) {
  struct seen s = {.variant = 1};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_tensors, &s), 0);
  sp_client *c = connect_to(&d);
  sp_tensor_desc t = {.key = "layer.000000.0", .storage = 9,
                      .dtype = "bfloat16", .placement = SP_PLACEMENT_PLAIN};
  ck_assert_int_eq(sp_register_tensors(c, &t, 1), SP_EBADMSG);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* ---- exports ---- */

/* The rank's one registered storage for identity tensors. */
#define STORAGE_ID 7
#define STORAGE_LEN 4096
#define EXPORT_ID 42
#define SEG0_LEN 8192
#define SEG1_LEN 100

/* Which reply the export script sends. */
enum variant {
  GOOD,
  SILENT_THEN_GOOD, /* progress every 100 ms for 0.8 s, then the reply */
  SILENT,           /* no answer at all */
  REFUSED,          /* an error reply */
  /* every variant from here is refused by the library */
  BAD_SEGMENT_INDEX,
  BAD_EMPTY_OFFSET_OVERFLOW,
  BAD_VIEW_PAST_SEGMENT,
  BAD_UNKNOWN_SID,
  BAD_PAST_STORAGE,
  BAD_SEGMENT_COUNT,
  BAD_PART_ORDER,
  BAD_DUPLICATE_KEY,
  BAD_DTYPE,
  BAD_ZERO_STRIDE,
  BAD_SEGMENT_AND_SID,
  BAD_TOO_MANY_DIMS,
  BAD_NO_EXPORT_ID,
  BAD_OTHER_OP,
  BAD_PROGRESS_FD,
  BAD_PROGRESS_FIELD,
  BAD_UNSEALED,
  VARIANTS
};

/* Whether the variant is refused after the reply's export id was read, so
 * that the library must release it. */
static bool releases(int v) {
  return v >= BAD_SEGMENT_INDEX && v != BAD_NO_EXPORT_ID &&
         v != BAD_PROGRESS_FD && v != BAD_PROGRESS_FIELD;
}

static void pack_dims(msgpack_packer *pk, const char *key, int n,
                      const uint64_t *v) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, (size_t)n);
  for (int i = 0; i < n; i++)
    msgpack_pack_uint64(pk, v[i]);
}

/* An owned tensor: seg >= 0 names a segment, else sid. */
static void pack_owned(msgpack_packer *pk, const char *key, const char *dtype,
                       int ndim, const uint64_t *shape, const uint64_t *stride,
                       int64_t seg, uint64_t sid, uint64_t byte_offset,
                       bool both) {
  msgpack_pack_map(pk, both ? 7 : 6);
  sp__pack_kv_str(pk, "key", key);
  sp__pack_kv_str(pk, "dtype", dtype);
  pack_dims(pk, "shape", ndim, shape);
  pack_dims(pk, "stride", ndim, stride);
  if (seg >= 0 || both)
    sp__pack_kv_u64(pk, "segment", seg >= 0 ? (uint64_t)seg : 0);
  if (seg < 0 || both)
    sp__pack_kv_u64(pk, "sid", sid);
  sp__pack_kv_u64(pk, "byte_offset", byte_offset);
}

static int send_progress(int conn, uint64_t id, const char *phase,
                         uint32_t round, const int *fds, size_t nfds,
                         bool bad) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "progress", id, 5);
  sp__pack_kv_str(&mb.pk, "phase", phase);
  sp__pack_kv_u64(&mb.pk, "round", round);
  sp__pack_kv_u64(&mb.pk, "rounds", 2);
  if (bad)
    sp__pack_kv_str(&mb.pk, "bytes_moved", "lots");
  else
    sp__pack_kv_u64(&mb.pk, "bytes_moved", round * 1000u);
  sp__pack_kv_u64(&mb.pk, "bytes_total", 2000);
  return fake_send(conn, &mb, fds, nfds);
}

/* Part 0: two segments, "w.b" and the tied pair; part 1: the identity
 * tensor "emb", an empty tensor at the very end of segment 1, and the
 * rank's own empty view whose offset lies past its storage's end (as
 * PyTorch leaves an empty slice's).  Each variant breaks one thing. */
static int send_export(int conn, uint64_t id, int v) {
  int seg[2] = {pattern_memfd(SEG_NAME, SEG0_LEN, 1),
                pattern_memfd(SEG_NAME, SEG1_LEN, 2)};
  if (v == BAD_UNSEALED) {
    /* A segment that could shrink under the rank's mapping. */
    close(seg[1]);
    seg[1] = memfd_create(SEG_NAME, MFD_CLOEXEC);
    if (seg[1] < 0 || ftruncate(seg[1], SEG1_LEN) != 0)
      return SP_EIO;
  }
  static const uint64_t s4[] = {4}, s1[] = {1}, s23[] = {2, 3},
                        st23[] = {3, 1}, s8[] = {8}, s0[] = {0}, z2[] = {2},
                        z0[] = {0}, nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  int rc = 0;
  {
    struct sp_msgbuf mb;
    bool no_id = v == BAD_NO_EXPORT_ID;
    sp__msgbuf_begin(&mb, "export", id, no_id ? 4 : 5);
    if (!no_id)
      sp__pack_kv_u64(&mb.pk, "export_id", EXPORT_ID);
    sp__pack_kv_u64(&mb.pk, "part", 0);
    sp__pack_kv_u64(&mb.pk, "parts", 2);
    sp__pack_kv_u64(&mb.pk, "segments", v == BAD_SEGMENT_COUNT ? 3 : 2);
    sp__pack_str(&mb.pk, "tensors");
    msgpack_pack_array(&mb.pk, 3);
    msgpack_packer *pk = &mb.pk;
    if (v == BAD_SEGMENT_INDEX)
      pack_owned(pk, "w.b", "float32", 1, s4, s1, 5, 0, 64, false);
    else if (v == BAD_DTYPE)
      pack_owned(pk, "w.b", "float33", 1, s4, s1, 0, 0, 64, false);
    else if (v == BAD_ZERO_STRIDE)
      pack_owned(pk, "w.b", "float32", 1, z2, z0, 0, 0, 64, false);
    else if (v == BAD_TOO_MANY_DIMS)
      pack_owned(pk, "w.b", "float32", 9, nine, nine, 0, 0, 64, false);
    else if (v == BAD_SEGMENT_AND_SID)
      pack_owned(pk, "w.b", "float32", 1, s4, s1, 0, STORAGE_ID, 64, true);
    else
      pack_owned(pk, "w.b", "float32", 1, s4, s1, 0, 0, 64, false);
    pack_owned(pk, "tied.b", "bfloat16", 2, s23, st23, 1, 0, 0, false);
    pack_owned(pk, "tied.a", "bfloat16", 2, s23, st23, 1, 0, 0, false);
    rc = fake_send(conn, &mb, seg, 2);
  }
  close(seg[0]);
  close(seg[1]);
  if (rc < 0)
    return rc;
  if (v == BAD_OTHER_OP)
    return fake_send_op(conn, "ping", id);

  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "export", id, 4);
  sp__pack_kv_u64(&mb.pk, "export_id", EXPORT_ID);
  sp__pack_kv_u64(&mb.pk, "part", v == BAD_PART_ORDER ? 2 : 1);
  sp__pack_kv_u64(&mb.pk, "parts", 2);
  sp__pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 3);
  msgpack_packer *pk = &mb.pk;
  if (v == BAD_UNKNOWN_SID)
    pack_owned(pk, "emb", "float32", 1, s8, s1, -1, 9, 128, false);
  else if (v == BAD_PAST_STORAGE)
    pack_owned(pk, "emb", "float32", 1, s8, s1, -1, STORAGE_ID,
               STORAGE_LEN - 16, false);
  else
    pack_owned(pk, "emb", "float32", 1, s8, s1, -1, STORAGE_ID, 128, false);
  if (v == BAD_EMPTY_OFFSET_OVERFLOW)
    pack_owned(pk, "empty", "float32", 1, s0, s1, 1, 0,
               (uint64_t)INT64_MAX + 1, false);
  else if (v == BAD_VIEW_PAST_SEGMENT)
    pack_owned(pk, "empty", "float32", 1, s4, s1, 1, 0, SEG1_LEN - 12, false);
  else if (v == BAD_DUPLICATE_KEY)
    pack_owned(pk, "w.b", "float32", 1, s0, s1, 1, 0, SEG1_LEN, false);
  else
    pack_owned(pk, "empty", "float32", 1, s0, s1, 1, 0, SEG1_LEN, false);
  pack_owned(pk, "empty.own", "float32", 1, s0, s1, -1, STORAGE_ID,
             STORAGE_LEN + 256, false);
  return fake_send(conn, &mb, NULL, 0);
}

static int export_handler(int conn, struct fake_request *req, struct seen *s) {
  uint64_t id = req->head.id;
  if (strcmp(req->head.op, "storage_add") == 0)
    return send_count(conn, "storage_add", id, req->frame.nfds);
  if (strcmp(req->head.op, "release") == 0) {
    sp__msg_get_u64(&req->map, "export_id", false, &s->released);
    if (s->released != EXPORT_ID)
      return fake_send_error(conn, id, "no_such_export", "no such export");
    return 1;
  }
  if (strcmp(req->head.op, "export") != 0)
    return 1;
  bool progress = false;
  sp__msg_get_bool(&req->map, "progress", false, &progress);
  s->export_progress = progress;
  sp__msg_get_u64(&req->map, "max_keys", true, &s->max_keys);
  sp__msg_get_u64(&req->map, "timeout_ms", true, &s->timeout_ms);
  const msgpack_object_array *groups;
  if (sp__msg_get_array(&req->map, "groups", true, &groups) == 0)
    s->ngroups = groups->size;
  int v = s->variant;
  int rc;
  switch (v) {
  case SILENT:
    return 0;
  case REFUSED:
    return fake_send_error(conn, id, "key_set_mismatch",
                           "ranks disagree on the set of keys: \"x\" is held "
                           "by rank 0 but not by rank 1");
  case SILENT_THEN_GOOD:
    for (int i = 0; i < 8; i++) {
      struct timespec ts = {0, 100 * 1000 * 1000};
      nanosleep(&ts, NULL);
      if ((rc = send_progress(conn, id, "waiting", 0, NULL, 0, false)) < 0)
        return rc;
    }
    break;
  case BAD_PROGRESS_FD: {
    int fd = pattern_memfd(SEG_NAME, 16, 3);
    rc = send_progress(conn, id, "waiting", 0, &fd, 1, false);
    close(fd);
    return rc;
  }
  case BAD_PROGRESS_FIELD:
    return send_progress(conn, id, "waiting", 0, NULL, 0, true);
  default:
    break;
  }
  if ((rc = send_progress(conn, id, "planning", 0, NULL, 0, false)) < 0 ||
      (rc = send_progress(conn, id, "moving", 1, NULL, 0, false)) < 0)
    return rc;
  return send_export(conn, id, v);
}

static void script_export(int conn, void *arg) {
  serve(conn, arg, export_handler);
}

/* The client side: one registered storage, then an export. */
struct rank {
  sp_client *c;
  int fd;
  uint8_t *storage;
};

static void rank_setup(struct rank *r, struct fake_daemon *d) {
  r->c = connect_to(d);
  r->fd = pattern_memfd("storage", STORAGE_LEN, 5);
  r->storage = mmap(NULL, STORAGE_LEN, PROT_READ, MAP_SHARED, r->fd, 0);
  ck_assert_ptr_ne(r->storage, MAP_FAILED);
  sp_storage_desc st = {.id = STORAGE_ID, .fd = r->fd, .length = STORAGE_LEN,
                        .addr = r->storage};
  ck_assert_int_eq(sp_register_storages(r->c, &st, 1), 0);
}

static void rank_teardown(struct rank *r) {
  munmap(r->storage, STORAGE_LEN);
  close(r->fd);
}

struct progress_log {
  int calls;
  char phases[8][16];
  uint32_t last_round;
};

static void on_progress(const sp_progress *p, void *arg) {
  struct progress_log *log = arg;
  if (log->calls < 8)
    snprintf(log->phases[log->calls], sizeof log->phases[0], "%s", p->phase);
  log->calls++;
  log->last_round = p->round;
  ck_assert_uint_eq(p->rounds, 2);
  ck_assert_uint_eq(p->bytes_total, 2000);
}

static uint8_t pattern(size_t i, unsigned salt) {
  return (uint8_t)(i * 7 + salt);
}

START_TEST(export_maps_and_checks_the_reply) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  struct progress_log log = {0};
  const char *gkeys[2] = {"tied.a", "tied.b"};
  sp_group group = {2, gkeys};
  sp_export_opts opts = {.ngroups = 1, .groups = &group, .max_keys = 100,
                         .timeout_ms = 5000, .progress = on_progress,
                         .progress_arg = &log};
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, &opts, &set), 0);
  ck_assert_ptr_nonnull(set);
  ck_assert_uint_eq(set->export_id, EXPORT_ID);
  ck_assert_uint_eq(set->ntensors, 6);
  const char *order[6] = {"emb", "empty", "empty.own", "tied.a", "tied.b",
                          "w.b"};
  for (int i = 0; i < 6; i++)
    ck_assert_str_eq(set->tensors[i].key, order[i]);

  const sp_owned_tensor *emb = &set->tensors[0], *own = &set->tensors[2],
                        *ta = &set->tensors[3], *tb = &set->tensors[4],
                        *wb = &set->tensors[5];
  /* Identity: a pointer into the rank's own storage. */
  ck_assert_int_eq(emb->identity, 1);
  ck_assert_ptr_eq(emb->data, r.storage + 128);
  ck_assert_str_eq(emb->dtype, "float32");
  /* Pool tensors: the segment's bytes, mapped read-write and shared. */
  ck_assert_int_eq(wb->identity, 0);
  ck_assert_uint_eq(wb->ndim, 1);
  ck_assert_int_eq(wb->shape[0], 4);
  const uint8_t *p = wb->data;
  for (size_t i = 0; i < 16; i++)
    ck_assert_uint_eq(p[i], pattern(64 + i, 1));
  ((uint8_t *)wb->data)[0] = 0xee;
  /* Tied weights: one buffer. */
  ck_assert_ptr_eq(ta->data, tb->data);
  ck_assert_str_eq(ta->dtype, "bfloat16");
  ck_assert_int_eq(ta->stride[0], 3);
  ck_assert_uint_eq(((const uint8_t *)ta->data)[5], pattern(5, 2));
  ck_assert_int_eq(set->tensors[1].shape[0], 0);
  /* An empty view of the rank's own storage, past its end: accepted, at
   * the address PyTorch's data_ptr() would give. */
  ck_assert_int_eq(own->identity, 1);
  ck_assert_int_eq(own->shape[0], 0);
  ck_assert(own->data == (void *)((uintptr_t)r.storage + STORAGE_LEN + 256));

  ck_assert_int_eq(log.calls, 2);
  ck_assert_str_eq(log.phases[0], "planning");
  ck_assert_str_eq(log.phases[1], "moving");
  ck_assert_uint_eq(log.last_round, 1);
  /* Each segment mapped once; no descriptor kept. */
  ck_assert_int_eq(seg_mappings(), 2);
  ck_assert_int_eq(seg_fds(), 0);

  ck_assert_int_eq(sp_release(r.c, set), 0);
  ck_assert_int_eq(seg_mappings(), 0);
  ck_assert_int_eq(sp_release(r.c, NULL), 0);
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.released, EXPORT_ID);
  ck_assert(s.export_progress);
  ck_assert_uint_eq(s.max_keys, 100);
  ck_assert_uint_eq(s.timeout_ms, 5000);
  ck_assert_uint_eq(s.ngroups, 1);
  ck_assert_int_eq(seg_fds(), 0);
}
END_TEST

START_TEST(bad_export_reply_is_refused_and_released) {
  int v = BAD_SEGMENT_INDEX + _i;
  struct seen s = {.variant = v};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, NULL, &set), SP_EBADMSG);
  ck_assert_ptr_null(set);
  ck_assert_msg(strncmp(sp_last_message(r.c), "bad export reply: ", 18) == 0,
                "message \"%s\"", sp_last_message(r.c));
  /* Nothing of the refused reply stays mapped or open. */
  ck_assert_int_eq(seg_mappings(), 0);
  /* The client stays usable. */
  ck_assert_int_eq(sp_ping(r.c, NULL), 0);
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_int_eq(seg_fds(), 0);
  ck_assert_uint_eq(s.released, releases(v) ? EXPORT_ID : 0);
}
END_TEST

START_TEST(refusal_reaches_the_caller) {
  struct seen s = {.variant = REFUSED};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, NULL, &set), SP_EKEYSET);
  ck_assert_ptr_null(set);
  ck_assert_ptr_nonnull(strstr(sp_last_message(r.c), "rank 1"));
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.released, 0);
}
END_TEST

START_TEST(progress_keeps_a_slow_export_alive) {
  struct seen s = {.variant = SILENT_THEN_GOOD};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  /* 0.8 s of progress frames 0.1 s apart, each frame awaited at most
   * 0.3 s + 0.1 s: the wait starts again at every frame. */
  ck_assert_int_eq(sp_set_timeout(r.c, 300), 0);
  sp_export_opts opts = {.timeout_ms = 100};
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, &opts, &set), 0);
  ck_assert_uint_eq(set->ntensors, 6);
  ck_assert_int_eq(sp_release(r.c, set), 0);
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

START_TEST(silent_daemon_times_out) {
  struct seen s = {.variant = SILENT};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  /* The daemon would answer after 100 ms; the library gives it 200 ms
   * more, then gives up on its own. */
  ck_assert_int_eq(sp_set_timeout(r.c, 200), 0);
  sp_export_opts opts = {.timeout_ms = 100};
  sp_owned_set *set = NULL;
  int64_t t0 = now_ms();
  ck_assert_int_eq(sp_export(r.c, &opts, &set), SP_ETIMEOUT);
  ck_assert_int_ge(now_ms() - t0, 300);
  ck_assert_ptr_null(set);
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* Leaving unmaps every live set; its sp_release then sends nothing. */
START_TEST(leave_detaches_live_exports) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, NULL, &set), 0);
  ck_assert_int_eq(seg_mappings(), 2);
  ck_assert_int_eq(sp_job_leave(r.c), 0);
  ck_assert_int_eq(seg_mappings(), 0);
  for (size_t i = 0; i < set->ntensors; i++)
    ck_assert_ptr_null(set->tensors[i].data);
  ck_assert_int_eq(sp_release(r.c, set), 0);
  /* Storages were forgotten too: the same id registers again. */
  sp_storage_desc st = {.id = STORAGE_ID, .fd = r.fd, .length = STORAGE_LEN,
                        .addr = r.storage};
  ck_assert_int_eq(sp_register_storages(r.c, &st, 1), 0);
  sp_close(r.c);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.released, 0);
  ck_assert_str_eq(s.ops[s.nops - 2], "leave");
}
END_TEST

/* A set outliving its client is unmapped at sp_close and freed later. */
START_TEST(close_detaches_live_exports) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_export, &s), 0);
  struct rank r;
  rank_setup(&r, &d);
  sp_owned_set *set = NULL;
  ck_assert_int_eq(sp_export(r.c, NULL, &set), 0);
  /* A set is released only through the client that exported it. */
  struct fake_daemon d2;
  struct seen s2 = {0};
  ck_assert_int_eq(fake_daemon_start(&d2, script_export, &s2), 0);
  sp_client *c2 = connect_to(&d2);
  ck_assert_int_eq(sp_release(c2, set), SP_EINVAL);
  sp_close(c2);
  fake_daemon_stop(&d2);
  sp_close(r.c);
  ck_assert_int_eq(seg_mappings(), 0);
  ck_assert_int_eq(sp_release(NULL, set), 0);
  fake_daemon_stop(&d);
  rank_teardown(&r);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.released, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("client_job");
  TCase *job = tcase_create("job");
  tcase_add_test(job, create_join_leave);
  tcase_add_test(job, oversized_ticket_is_ebadmsg);
  tcase_add_test(job, leave_refused_carries_message);
  suite_add_tcase(s, job);
  TCase *reg = tcase_create("register");
  tcase_set_timeout(reg, 30);
  tcase_add_test(reg, storages_go_in_frames_of_32_fds);
  tcase_add_test(reg, tensors_go_in_frames_under_the_budget);
  tcase_add_test(reg, tensors_go_in_frames_under_the_item_limit);
  tcase_add_test(reg, tensor_count_mismatch_is_ebadmsg);
  suite_add_tcase(s, reg);
  TCase *exp = tcase_create("export");
  tcase_add_test(exp, export_maps_and_checks_the_reply);
  tcase_add_loop_test(exp, bad_export_reply_is_refused_and_released, 0,
                      VARIANTS - BAD_SEGMENT_INDEX);
  tcase_add_test(exp, refusal_reaches_the_caller);
  tcase_add_test(exp, progress_keeps_a_slow_export_alive);
  tcase_add_test(exp, silent_daemon_times_out);
  tcase_add_test(exp, leave_detaches_live_exports);
  tcase_add_test(exp, close_detaches_live_exports);
  suite_add_tcase(s, exp);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
