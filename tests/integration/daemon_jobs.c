/*
 * daemon_jobs.c - jobs, registration, exports and their faults over raw
 * protocol frames (docs/protocol.md, "Jobs"), against a real shardportd.
 *
 * Each test plays every rank itself, one socket per rank, so that it can
 * send exactly the frames it means to (and break them).  Published tensors
 * are checked byte for byte against the unsharded original, read through
 * the shape, stride and offset the daemon publishes: the pool segment it
 * attaches for assembled tensors, the rank's own memfd for identity ones.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"

static struct sp_test_daemon daemon_;
static uint64_t next_id = 1;

static void start(void) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* Starts a daemon with config lines and environment settings of its own. */
static void start_with(const char *config, const char *env_name,
                       const char *env_value) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, config), 0);
  if (env_name != NULL)
    setenv(env_name, env_value, 1);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  if (env_name != NULL)
    unsetenv(env_name);
  sp_test_rmdir(dir);
}

/* ---- replies ----------------------------------------------------------- */

/* The next frame for request id; progress frames are counted and skipped. */
static int recv_for(int sock, uint64_t id, struct sp_test_reply *r,
                    int *progress, char *last_phase) {
  for (;;) {
    int rc = sp_test_recv(sock, r, SP_TEST_TIMEOUT_MS);
    if (rc != 0)
      return rc;
    ck_assert_uint_eq(r->head.id, id);
    if (strcmp(r->head.op, "progress") != 0)
      return 0;
    if (progress != NULL)
      (*progress)++;
    if (last_phase != NULL)
      ck_assert_int_eq(
          sp_msg_get_strbuf(&r->map, "phase", false, last_phase, 32), 0);
    sp_test_reply_free(r);
  }
}

/* Sends mb and returns the reply's error code (0 for success); the reply is
 * left in r when keep is set. */
static int call(int sock, struct sp_msgbuf *mb, uint64_t id, const int *fds,
                size_t nfds, struct sp_test_reply *r) {
  struct sp_test_reply local;
  struct sp_test_reply *out = r != NULL ? r : &local;
  ck_assert_int_eq(sp_test_send_msgbuf(sock, mb, fds, nfds), 0);
  ck_assert_int_eq(recv_for(sock, id, out, NULL, NULL), 0);
  int code = out->code;
  if (r == NULL)
    sp_test_reply_free(&local);
  return code;
}

static void expect_error(int sock, struct sp_msgbuf *mb, uint64_t id,
                         const int *fds, size_t nfds, int code,
                         const char *words) {
  struct sp_test_reply r;
  ck_assert_int_eq(call(sock, mb, id, fds, nfds, &r), code);
  if (words != NULL && strstr(r.message, words) == NULL)
    ck_abort_msg("error \"%s\" does not mention \"%s\"", r.message, words);
  sp_test_reply_free(&r);
}

/* ---- jobs -------------------------------------------------------------- */

struct ticket {
  uint8_t bytes[SP_TICKET_MAX];
  size_t len;
};

static struct ticket job_create(int sock, uint32_t world) {
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  struct ticket t;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "job_create", id, 1);
  sp_pack_kv_u64(&mb.pk, "world", world);
  ck_assert_int_eq(call(sock, &mb, id, NULL, 0, &r), 0);
  const uint8_t *p;
  ck_assert_int_eq(sp_msg_get_bin(&r.map, "ticket", false, &p, &t.len), 0);
  ck_assert_uint_le(t.len, SP_TICKET_MAX);
  memcpy(t.bytes, p, t.len);
  char hex[64];
  ck_assert_int_eq(sp_msg_get_strbuf(&r.map, "job_id", false, hex, sizeof hex),
                   0);
  ck_assert_uint_eq(strlen(hex), 32);
  sp_test_reply_free(&r);
  return t;
}

static int join(int sock, const struct ticket *t, uint32_t rank,
                uint32_t world) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_test_pack_join(&mb, id, t->bytes, t->len, rank, world, "cpu");
  return call(sock, &mb, id, NULL, 0, NULL);
}

/* ---- a rank's memory and registrations ----------------------------------
 *
 * Every key's whole tensor is a byte pattern of (key, element, byte), so a
 * published tensor can be checked without keeping the original. */

static uint8_t pattern(uint32_t key, uint64_t elem, uint32_t byte) {
  return (uint8_t)(key * 131u + elem * 7u + byte * 13u + 1u);
}

enum kind { SHARD0, REPLICATED, EXPERT, COLUMNS, TIED, TRANSPOSED, REPLICA };

struct mkey {
  const char *name;
  const char *dtype;
  uint32_t esz;
  enum kind kind;
  uint32_t ndim;
  int64_t shape[2];
  int64_t rows[2]; /* SHARD0: rows on ranks 0 and 1 */
  uint32_t expert; /* EXPERT: the rank holding it */
  int tie_of;      /* TIED: the key whose view it shares */
};

/* Two ranks of a small model: uneven, empty and zero-row shards, two (and
 * more) dtypes, replicated, expert, an affine column split, a tied weight,
 * a transposed (non-contiguous) replicated view and an affine replica. */
static const struct mkey model[] = {
    {"a.weight", "float32", 4, SHARD0, 2, {5, 3}, {2, 3}, 0, -1},
    {"b.bias", "bfloat16", 2, REPLICATED, 1, {7, 0}, {0, 0}, 0, -1},
    {"c.expert1", "int16", 2, EXPERT, 2, {4, 4}, {0, 0}, 1, -1},
    {"d.empty", "float32", 4, SHARD0, 2, {0, 4}, {0, 0}, 0, -1},
    {"e.tied", "float32", 4, TIED, 2, {5, 3}, {2, 3}, 0, 0},
    {"f.columns", "float32", 4, COLUMNS, 2, {4, 6}, {0, 0}, 0, -1},
    {"g.zero_rows", "bfloat16", 2, SHARD0, 2, {3, 2}, {3, 0}, 0, -1},
    {"h.transposed", "float64", 8, TRANSPOSED, 2, {3, 4}, {0, 0}, 0, -1},
    {"i.replica", "uint8", 1, REPLICA, 2, {2, 8}, {0, 0}, 0, -1},
    {"j.expert0", "float16", 2, EXPERT, 1, {9, 0}, {0, 0}, 0, -1},
};
#define NKEYS (sizeof model / sizeof model[0])

#define STORAGE_OFFSET 100 /* bytes into the memfd: not page aligned */
#define STORAGE_SID 7

struct rank {
  uint32_t rank;
  int sock;
  int memfd;
  uint8_t *map; /* the whole memfd, as the trainer maps it */
  size_t size;
  uint8_t *orig;
  uint64_t key_at[NKEYS]; /* byte offset of each key in the storage */
  bool holds[NKEYS];
};

static uint64_t numel(const struct mkey *k) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < k->ndim; d++)
    n *= (uint64_t)k->shape[d];
  return n;
}

/* Elements of key k that rank r holds. */
static uint64_t held_numel(const struct mkey *k, uint32_t r) {
  switch (k->kind) {
  case SHARD0:
  case TIED:
    return (uint64_t)k->rows[r] * (k->ndim > 1 ? (uint64_t)k->shape[1] : 1);
  case EXPERT:
    return k->expert == r ? numel(k) : 0;
  case COLUMNS:
    return numel(k) / 2;
  default:
    return numel(k);
  }
}

static uint64_t shard_start(const struct mkey *k, uint32_t r) {
  return r == 0 ? 0 : (uint64_t)k->rows[0] * (uint64_t)k->shape[1];
}

/* Writes rank r's holding of key i at base; local element e holds global
 * element g. */
static void fill(const struct mkey *k, uint32_t i, uint32_t r, uint8_t *base) {
  uint64_t n = held_numel(k, r);
  for (uint64_t e = 0; e < n; e++) {
    uint64_t g;
    switch (k->kind) {
    case SHARD0:
      g = shard_start(k, r) + e;
      break;
    case COLUMNS:
      g = (e / 3) * 6 + 3 * r + e % 3;
      break;
    case TRANSPOSED:
      /* storage element e = i + 3 j holds (i, j) of the (3, 4) tensor */
      g = (e % 3) * 4 + e / 3;
      break;
    default:
      g = e;
      break;
    }
    for (uint32_t b = 0; b < k->esz; b++)
      base[e * k->esz + b] = pattern(i, g, b);
  }
}

static void rank_open(struct rank *rk, uint32_t r) {
  memset(rk, 0, sizeof *rk);
  rk->rank = r;
  rk->sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(rk->sock, 0);
  uint64_t at = 0;
  for (size_t i = 0; i < NKEYS; i++) {
    const struct mkey *k = &model[i];
    if (k->kind == TIED) {
      rk->key_at[i] = rk->key_at[k->tie_of];
      rk->holds[i] = true;
      continue;
    }
    rk->holds[i] = k->kind != EXPERT || k->expert == r;
    rk->key_at[i] = at;
    at += (held_numel(k, r) * k->esz + 15) & ~(uint64_t)15;
  }
  rk->size = STORAGE_OFFSET + at + 64;
  rk->memfd = memfd_create("rank", MFD_CLOEXEC);
  ck_assert_int_ge(rk->memfd, 0);
  ck_assert_int_eq(ftruncate(rk->memfd, (off_t)rk->size), 0);
  rk->map =
      mmap(NULL, rk->size, PROT_READ | PROT_WRITE, MAP_SHARED, rk->memfd, 0);
  ck_assert_ptr_ne(rk->map, MAP_FAILED);
  for (size_t i = 0; i < NKEYS; i++)
    if (rk->holds[i] && model[i].kind != TIED)
      fill(&model[i], (uint32_t)i, r, rk->map + STORAGE_OFFSET + rk->key_at[i]);
  rk->orig = malloc(rk->size);
  memcpy(rk->orig, rk->map, rk->size);
}

static void rank_close(struct rank *rk) {
  if (rk->sock >= 0)
    close(rk->sock);
  munmap(rk->map, rk->size);
  close(rk->memfd);
  free(rk->orig);
}

static void pack_dims(msgpack_packer *pk, const char *name, uint32_t n,
                      const int64_t *v) {
  sp_pack_str(pk, name);
  msgpack_pack_array(pk, n);
  for (uint32_t d = 0; d < n; d++)
    msgpack_pack_uint64(pk, (uint64_t)v[d]);
}

static void register_storage(struct rank *rk) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "storage_add", id, 1);
  sp_pack_str(&mb.pk, "storages");
  msgpack_pack_array(&mb.pk, 1);
  msgpack_pack_map(&mb.pk, 6);
  sp_pack_kv_u64(&mb.pk, "sid", STORAGE_SID);
  sp_pack_kv_str(&mb.pk, "kind", "memfd");
  sp_pack_kv_u64(&mb.pk, "fd", 0);
  sp_pack_kv_u64(&mb.pk, "offset", STORAGE_OFFSET);
  sp_pack_kv_u64(&mb.pk, "length", rk->size - STORAGE_OFFSET);
  sp_pack_kv_u64(&mb.pk, "base", 0x7f0000000000ull + rk->rank * 0x1000000ull);
  ck_assert_int_eq(call(rk->sock, &mb, id, &rk->memfd, 1, NULL), 0);
}

/* One tensor map of the model for rank r. */
static void pack_model_tensor(msgpack_packer *pk, const struct rank *rk,
                              size_t i) {
  const struct mkey *k = &model[i];
  const struct mkey *v = k->kind == TIED ? &model[k->tie_of] : k;
  uint32_t r = rk->rank;
  int64_t shape[2] = {0, 0}, stride[2] = {0, 0};
  const char *placement;
  bool affine = k->kind == COLUMNS || k->kind == REPLICA;
  for (uint32_t d = 0; d < k->ndim; d++)
    shape[d] = k->shape[d];
  switch (v->kind) {
  case SHARD0:
    placement = "shard0";
    shape[0] = v->rows[r];
    break;
  case EXPERT:
    placement = "expert";
    break;
  case COLUMNS:
  case REPLICA:
    placement = "affine";
    shape[1] = v->kind == COLUMNS ? 3 : shape[1];
    break;
  default:
    placement = "replicated";
    break;
  }
  if (k->ndim == 2) {
    stride[0] = shape[1];
    stride[1] = 1;
  } else {
    stride[0] = 1;
  }
  if (k->kind == TRANSPOSED) {
    stride[0] = 1;
    stride[1] = 3;
  }
  msgpack_pack_map(pk, affine ? 9 : 8);
  sp_pack_kv_str(pk, "key", k->name);
  sp_pack_kv_u64(pk, "sid", STORAGE_SID);
  sp_pack_kv_str(pk, "dtype", k->dtype);
  pack_dims(pk, "shape", k->ndim, shape);
  pack_dims(pk, "stride", k->ndim, stride);
  sp_pack_kv_u64(pk, "offset", rk->key_at[i] / k->esz);
  sp_pack_kv_str(pk, "placement", placement);
  pack_dims(pk, "global_shape", k->ndim, k->shape);
  if (!affine)
    return;
  sp_pack_str(pk, "pieces");
  msgpack_pack_array(pk, 1);
  msgpack_pack_map(pk, 6);
  int64_t src_stride[2] = {shape[1], 1}, dst_stride[2] = {k->shape[1], 1};
  pack_dims(pk, "shape", 2, shape);
  pack_dims(pk, "src_stride", 2, src_stride);
  pack_dims(pk, "dst_stride", 2, dst_stride);
  sp_pack_kv_u64(pk, "src_offset", 0);
  sp_pack_kv_u64(pk, "dst_offset", k->kind == COLUMNS ? 3u * r : 0);
  sp_pack_str(pk, "holders");
  if (k->kind == COLUMNS) {
    msgpack_pack_array(pk, 1);
    msgpack_pack_uint32(pk, r);
  } else {
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint32(pk, 0);
    msgpack_pack_uint32(pk, 1);
  }
}

static void register_model(struct rank *rk, size_t skip) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  size_t n = 0;
  for (size_t i = 0; i < NKEYS; i++)
    n += rk->holds[i] && i != skip;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, (uint32_t)n);
  for (size_t i = 0; i < NKEYS; i++)
    if (rk->holds[i] && i != skip)
      pack_model_tensor(&mb.pk, rk, i);
  struct sp_test_reply r;
  ck_assert_int_eq(call(rk->sock, &mb, id, NULL, 0, &r), 0);
  uint64_t count;
  ck_assert_int_eq(sp_msg_get_u64(&r.map, "count", false, &count), 0);
  ck_assert_uint_eq(count, n);
  sp_test_reply_free(&r);
}

/* ---- exports ----------------------------------------------------------- */

static uint64_t send_export(int sock, bool progress, uint32_t timeout_ms,
                            uint32_t max_keys) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "export", id, 3);
  sp_pack_kv_bool(&mb.pk, "progress", progress);
  sp_pack_kv_u64(&mb.pk, "timeout_ms", timeout_ms);
  sp_pack_kv_u64(&mb.pk, "max_keys", max_keys);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  return id;
}

/* A rank's published tensors, gathered from every part. */
struct owned {
  char key[64];
  uint32_t ndim;
  int64_t shape[4], stride[4];
  bool identity;
  uint64_t sid, byte_offset;
};

struct published {
  uint64_t export_id;
  int segment_fd; /* -1 when none came */
  uint8_t *segment;
  size_t segment_size;
  size_t n;
  struct owned *t;
};

static void get_dims(const msgpack_object *o, const char *name, uint32_t *n,
                     int64_t *v) {
  const msgpack_object_array *a;
  ck_assert_int_eq(sp_msg_get_array(o, name, false, &a), 0);
  ck_assert_uint_le(a->size, 4);
  *n = a->size;
  for (uint32_t d = 0; d < a->size; d++)
    v[d] = (int64_t)a->ptr[d].via.u64;
}

/* Reads the reply to export request id: 0 and every part in *out, or the
 * error's code with its message in msg. */
static int read_export(int sock, uint64_t id, struct published *out, char *msg,
                       size_t msglen, int *nprogress) {
  memset(out, 0, sizeof *out);
  out->segment_fd = -1;
  uint64_t parts = 1;
  for (uint64_t p = 0; p < parts; p++) {
    struct sp_test_reply r;
    ck_assert_int_eq(recv_for(sock, id, &r, nprogress, NULL), 0);
    if (r.code != 0) {
      ck_assert_uint_eq(p, 0);
      size_t n = strlen(r.message) < msglen ? strlen(r.message) : msglen - 1;
      memcpy(msg, r.message, n);
      msg[n] = '\0';
      int code = r.code;
      sp_test_reply_free(&r);
      return code;
    }
    ck_assert_str_eq(r.head.op, "export");
    uint64_t part, export_id;
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "part", false, &part), 0);
    ck_assert_uint_eq(part, p);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "parts", false, &parts), 0);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "export_id", false, &export_id), 0);
    if (p == 0) {
      uint64_t segments;
      out->export_id = export_id;
      ck_assert_int_eq(sp_msg_get_u64(&r.map, "segments", false, &segments), 0);
      ck_assert_uint_eq(r.frame.nfds, segments);
      if (segments == 1) {
        out->segment_fd = r.frame.fds[0];
        r.frame.fds[0] = -1;
        struct stat st;
        ck_assert_int_eq(fstat(out->segment_fd, &st), 0);
        out->segment_size = (size_t)st.st_size;
        out->segment = mmap(NULL, out->segment_size, PROT_READ, MAP_SHARED,
                            out->segment_fd, 0);
        ck_assert_ptr_ne(out->segment, MAP_FAILED);
        /* The pool's segment is sealed: nobody can make the daemon fault
         * on it by truncating it. */
        int seals = fcntl(out->segment_fd, F_GET_SEALS);
        ck_assert_int_ne(seals & F_SEAL_SHRINK, 0);
      }
    } else {
      ck_assert_uint_eq(export_id, out->export_id);
      ck_assert_uint_eq(r.frame.nfds, 0);
    }
    const msgpack_object_array *t;
    ck_assert_int_eq(sp_msg_get_array(&r.map, "tensors", false, &t), 0);
    out->t = realloc(out->t, (out->n + t->size + 1) * sizeof *out->t);
    for (uint32_t i = 0; i < t->size; i++) {
      const msgpack_object *o = &t->ptr[i];
      struct owned *w = &out->t[out->n++];
      memset(w, 0, sizeof *w);
      ck_assert_int_eq(
          sp_msg_get_strbuf(o, "key", false, w->key, sizeof w->key), 0);
      uint32_t nstride;
      get_dims(o, "shape", &w->ndim, w->shape);
      get_dims(o, "stride", &nstride, w->stride);
      ck_assert_uint_eq(nstride, w->ndim);
      ck_assert_int_eq(sp_msg_get_u64(o, "byte_offset", false, &w->byte_offset),
                       0);
      uint64_t segment;
      int has_segment = sp_msg_get_u64(o, "segment", true, &segment);
      int has_sid = sp_msg_get_u64(o, "sid", true, &w->sid);
      ck_assert_int_ne(has_segment, has_sid);
      w->identity = has_sid == 0;
      if (!w->identity) {
        ck_assert_uint_eq(segment, 0);
        ck_assert_uint_eq(w->byte_offset % 256, 0);
      }
    }
    sp_test_reply_free(&r);
  }
  return 0;
}

static void published_free(struct published *p) {
  if (p->segment != NULL)
    munmap(p->segment, p->segment_size);
  if (p->segment_fd >= 0)
    close(p->segment_fd);
  free(p->t);
  memset(p, 0, sizeof *p);
}

/* Every element of w, read through its stride, equals the original. */
static void check_tensor(const struct rank *rk, const struct published *p,
                         const struct owned *w) {
  size_t i = 0;
  while (i < NKEYS && strcmp(model[i].name, w->key) != 0)
    i++;
  ck_assert_uint_lt(i, NKEYS);
  const struct mkey *k = &model[i];
  uint32_t pat_key = k->kind == TIED ? (uint32_t)k->tie_of : (uint32_t)i;
  ck_assert_uint_eq(w->ndim, k->ndim);
  for (uint32_t d = 0; d < k->ndim; d++)
    ck_assert_int_eq(w->shape[d], k->shape[d]);
  const uint8_t *base;
  if (w->identity) {
    ck_assert_uint_eq(w->sid, STORAGE_SID);
    base = rk->map + STORAGE_OFFSET + w->byte_offset;
  } else {
    ck_assert_ptr_nonnull(p->segment);
    ck_assert_uint_le(w->byte_offset + numel(k) * k->esz, p->segment_size);
    base = p->segment + w->byte_offset;
  }
  uint64_t n = numel(k);
  for (uint64_t g = 0; g < n; g++) {
    int64_t at = 0;
    uint64_t rest = g;
    for (uint32_t d = k->ndim; d-- > 0;) {
      at += (int64_t)(rest % (uint64_t)k->shape[d]) * w->stride[d];
      rest /= (uint64_t)k->shape[d];
    }
    for (uint32_t b = 0; b < k->esz; b++)
      ck_assert_uint_eq(base[(uint64_t)at * k->esz + b],
                        pattern(pat_key, g, b));
  }
}

static const struct owned *find_owned(const struct published *p,
                                      const char *key) {
  for (size_t i = 0; i < p->n; i++)
    if (strcmp(p->t[i].key, key) == 0)
      return &p->t[i];
  return NULL;
}

/* Both ranks' publications together hold every key exactly once, each
 * equal to the original; tied keys share one buffer. */
static void check_model(struct rank *rk, struct published *pub) {
  for (size_t i = 0; i < NKEYS; i++) {
    const struct owned *w0 = find_owned(&pub[0], model[i].name);
    const struct owned *w1 = find_owned(&pub[1], model[i].name);
    if ((w0 == NULL) == (w1 == NULL))
      ck_abort_msg("key %s is owned by %s", model[i].name,
                   w0 == NULL ? "no rank" : "both ranks");
    uint32_t owner = w0 != NULL ? 0 : 1;
    const struct owned *w = w0 != NULL ? w0 : w1;
    check_tensor(&rk[owner], &pub[owner], w);
    if (model[i].kind == EXPERT)
      ck_assert_uint_eq(owner, model[i].expert);
    if (model[i].kind == EXPERT || model[i].kind == REPLICATED ||
        model[i].kind == TRANSPOSED)
      ck_assert(w->identity);
    if (model[i].kind == COLUMNS || model[i].kind == REPLICA)
      ck_assert(!w->identity);
    if (model[i].kind == TIED) {
      const struct owned *lead =
          find_owned(&pub[owner], model[model[i].tie_of].name);
      ck_assert_ptr_nonnull(lead);
      ck_assert_uint_eq(lead->byte_offset, w->byte_offset);
      ck_assert_int_eq(lead->identity, w->identity);
    }
  }
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_mem_eq(rk[r].map, rk[r].orig, rk[r].size);
}

static int release(int sock, uint64_t export_id) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "release", id, 1);
  sp_pack_kv_u64(&mb.pk, "export_id", export_id);
  return call(sock, &mb, id, NULL, 0, NULL);
}

/* The status reply's job map, and its pool_used. */
static void status_job(int sock, char *phase, size_t len, uint64_t *pool_used,
                       uint64_t *round, uint64_t *rounds, char *error,
                       size_t errlen) {
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "status", id, 0);
  ck_assert_int_eq(call(sock, &mb, id, NULL, 0, &r), 0);
  ck_assert_int_eq(sp_msg_get_u64(&r.map, "pool_used", false, pool_used), 0);
  const msgpack_object_array *jobs;
  ck_assert_int_eq(sp_msg_get_array(&r.map, "jobs", false, &jobs), 0);
  phase[0] = '\0';
  if (jobs->size > 0) {
    const msgpack_object *j = &jobs->ptr[0];
    ck_assert_int_eq(sp_msg_get_strbuf(j, "phase", false, phase, len), 0);
    if (round != NULL)
      ck_assert_int_eq(sp_msg_get_u64(j, "round", false, round), 0);
    if (rounds != NULL)
      ck_assert_int_eq(sp_msg_get_u64(j, "rounds", false, rounds), 0);
    if (error != NULL) {
      error[0] = '\0';
      sp_msg_get_strbuf(j, "error", true, error, errlen);
    }
  }
  sp_test_reply_free(&r);
}

static void two_ranks(struct rank *rk, size_t skip1) {
  rank_open(&rk[0], 0);
  rank_open(&rk[1], 1);
  struct ticket t = job_create(rk[0].sock, 2);
  ck_assert_int_eq(join(rk[0].sock, &t, 0, 2), 0);
  ck_assert_int_eq(join(rk[1].sock, &t, 1, 2), 0);
  for (uint32_t r = 0; r < 2; r++) {
    register_storage(&rk[r]);
    register_model(&rk[r], r == 1 ? skip1 : NKEYS);
  }
}

/* Waits until the daemon's pool_used, pool_held and pool_warm are want,
 * want_held and want_kept. */
static void wait_pool(int sock, uint64_t want, uint64_t want_held,
                      uint64_t want_kept) {
  uint64_t used = UINT64_MAX, held = UINT64_MAX, kept = UINT64_MAX;
  for (int i = 0;
       i < 200 && (used != want || held != want_held || kept != want_kept);
       i++) {
    if (i > 0)
      usleep(10000);
    struct sp_msgbuf mb;
    struct sp_test_reply r;
    uint64_t id = next_id++;
    sp_msgbuf_begin(&mb, "status", id, 0);
    ck_assert_int_eq(call(sock, &mb, id, NULL, 0, &r), 0);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "pool_used", false, &used), 0);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "pool_held", false, &held), 0);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "pool_warm", false, &kept), 0);
    sp_test_reply_free(&r);
  }
  ck_assert_uint_eq(used, want);
  ck_assert_uint_eq(held, want_held);
  ck_assert_uint_eq(kept, want_kept);
}

static void leave(int sock) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "leave", id, 0);
  ck_assert_int_eq(call(sock, &mb, id, NULL, 0, NULL), 0);
}

/* ---- tests ------------------------------------------------------------- */

START_TEST(export_two_ranks) {
  struct rank rk[2];
  struct published pub[2];
  char msg[1024], phase[32];
  int progress = 0;
  uint64_t used;
  two_ranks(rk, NKEYS);
  /* Twice: the second export reuses the job's members and plan. */
  for (int round = 0; round < 2; round++) {
    uint64_t id0 = send_export(rk[0].sock, true, 10000, 0);
    uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
    ck_assert_int_eq(
        read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, &progress), 0);
    ck_assert_int_eq(
        read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL), 0);
    ck_assert_int_ge(progress, 2);
    ck_assert_uint_eq(pub[0].export_id, pub[1].export_id);
    check_model(rk, pub);
    status_job(rk[0].sock, phase, sizeof phase, &used, NULL, NULL, NULL, 0);
    ck_assert_str_eq(phase, "published");
    ck_assert_uint_gt(used, 0);
    size_t sizes[2] = {pub[0].segment_size, pub[1].segment_size};
    for (uint32_t r = 0; r < 2; r++) {
      ck_assert_int_eq(release(rk[r].sock, pub[r].export_id), 0);
      ck_assert_int_eq(release(rk[r].sock, pub[r].export_id), SP_ENOEXPORT);
      published_free(&pub[r]);
    }
    /* Released segments are kept for their ranks' next export, and
     * counted while kept. */
    wait_pool(rk[0].sock, sizes[0] + sizes[1], 0, sizes[0] + sizes[1]);
    if (round == 1) {
      /* A rank that leaves takes its kept segment with it. */
      leave(rk[1].sock);
      wait_pool(rk[0].sock, sizes[0], 0, sizes[0]);
    }
  }
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* Pool memory comes back when a rank's connection closes unreleased, once
 * the rank no longer maps it either. */
START_TEST(close_returns_pool_memory) {
  struct rank rk[2];
  struct published pub[2];
  char msg[1024], phase[32];
  uint64_t used;
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   0);
  ck_assert_int_eq(read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL),
                   0);
  close(rk[0].sock);
  close(rk[1].sock);
  rk[0].sock = rk[1].sock = -1;
  /* The published memory stays readable for as long as it is mapped, and
   * counted for as long: the ranks' pages are the daemon's. */
  check_model(rk, pub);
  int sock = sp_test_connect_hello(daemon_.socket);
  uint64_t mapped = pub[0].segment_size + pub[1].segment_size;
  wait_pool(sock, mapped, mapped, 0);
  status_job(sock, phase, sizeof phase, &used, NULL, NULL, NULL, 0);
  ck_assert_str_eq(phase, "");
  published_free(&pub[0]);
  published_free(&pub[1]);
  wait_pool(sock, 0, 0, 0);
  close(sock);
  rank_close(&rk[0]);
  rank_close(&rk[1]);
}
END_TEST

/* A rank that keeps its segment after release (a duplicate of the
 * descriptor, or a mapping alone) keeps its pages: pool_used counts them,
 * as pool_held, until the last of them is closed, and not a moment
 * longer. */
START_TEST(kept_segment_counted_until_closed) {
  struct rank rk[2];
  struct published pub[2];
  char msg[1024];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   0);
  ck_assert_int_eq(read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL),
                   0);
  ck_assert_uint_gt(pub[0].segment_size, 0);
  ck_assert_uint_gt(pub[1].segment_size, 0);
  size_t size0 = pub[0].segment_size, size1 = pub[1].segment_size;
  /* Rank 0 keeps a copy of its descriptor, rank 1 its mapping alone. */
  int kept_fd = dup(pub[0].segment_fd);
  ck_assert_int_ge(kept_fd, 0);
  void *kept_map = pub[1].segment;
  pub[1].segment = NULL;
  for (uint32_t r = 0; r < 2; r++) {
    ck_assert_int_eq(release(rk[r].sock, pub[r].export_id), 0);
    published_free(&pub[r]);
  }
  /* Kept for the ranks until they leave; then held while they map them. */
  wait_pool(rk[0].sock, size0 + size1, 0, size0 + size1);
  int sock = sp_test_connect_hello(daemon_.socket);
  leave(rk[0].sock);
  leave(rk[1].sock);
  wait_pool(sock, size0 + size1, size0 + size1, 0);
  ck_assert_int_eq(munmap(kept_map, size1), 0);
  wait_pool(sock, size0, size0, 0);
  close(kept_fd);
  wait_pool(sock, 0, 0, 0);
  close(sock);
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* Another open and close of the segment's file by the rank (here through
 * /proc, as any process holding it may) is not the close of the rank's
 * descriptor: a segment the rank still maps stays counted. */
START_TEST(reopened_segment_counted_until_closed) {
  struct rank rk[2];
  struct published pub[2];
  char msg[1024], path[64];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   0);
  ck_assert_int_eq(read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL),
                   0);
  size_t size0 = pub[0].segment_size;
  ck_assert_uint_gt(size0, 0);
  int kept_fd = dup(pub[0].segment_fd);
  ck_assert_int_ge(kept_fd, 0);
  snprintf(path, sizeof path, "/proc/self/fd/%d", kept_fd);
  int other = open(path, O_RDONLY | O_CLOEXEC);
  ck_assert_int_ge(other, 0);
  close(other);
  for (uint32_t r = 0; r < 2; r++) {
    ck_assert_int_eq(release(rk[r].sock, pub[r].export_id), 0);
    published_free(&pub[r]);
  }
  int sock = sp_test_connect_hello(daemon_.socket);
  leave(rk[0].sock);
  leave(rk[1].sock);
  wait_pool(sock, size0, size0, 0);
  close(kept_fd);
  wait_pool(sock, 0, 0, 0);
  close(sock);
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

static ino_t segment_inode(const struct published *p) {
  struct stat st;
  ck_assert_int_ge(p->segment_fd, 0);
  ck_assert_int_eq(fstat(p->segment_fd, &st), 0);
  return st.st_ino;
}

/* Fills the whole of a published segment, tensors and the bytes between
 * and after them, with a byte no tensor of the model holds there: what a
 * trainer may do with the read-write descriptor it was given. */
static void scribble(const struct published *p) {
  uint8_t *w = mmap(NULL, p->segment_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                    p->segment_fd, 0);
  ck_assert_ptr_ne(w, MAP_FAILED);
  memset(w, 0xAB, p->segment_size);
  munmap(w, p->segment_size);
}

/* Every byte of p's segment that none of its tensors covers is zero. */
static void check_gaps_zero(const struct published *p) {
  uint8_t *covered = calloc(p->segment_size, 1);
  ck_assert_ptr_nonnull(covered);
  for (size_t i = 0; i < p->n; i++) {
    const struct owned *w = &p->t[i];
    if (w->identity)
      continue;
    size_t k = 0;
    while (k < NKEYS && strcmp(model[k].name, w->key) != 0)
      k++;
    ck_assert_uint_lt(k, NKEYS);
    uint64_t nbytes = numel(&model[k]) * model[k].esz;
    ck_assert_uint_le(w->byte_offset + nbytes, p->segment_size);
    memset(covered + w->byte_offset, 1, (size_t)nbytes);
  }
  size_t gaps = 0;
  for (size_t b = 0; b < p->segment_size; b++)
    if (!covered[b]) {
      gaps++;
      ck_assert_msg(p->segment[b] == 0, "byte %zu of the segment is 0x%02x",
                    b, p->segment[b]);
    }
  /* The model leaves padding between its tensors: the check saw some. */
  ck_assert_uint_gt(gaps, 0);
  free(covered);
}

/* The warm pool: a released segment comes back to the same rank of the
 * same job, with every tensor rewritten and every other byte zeroed, and
 * never to another rank, even one that needs a segment of that size
 * while the other's is kept (docs/operations.md, "The warm pool"). */
START_TEST(released_segment_reused_by_its_rank_only) {
  struct rank rk[2];
  struct published first[2], second[2], third[2];
  char msg[1024];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &first[0], msg, sizeof msg, NULL), 0);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &first[1], msg, sizeof msg, NULL), 0);
  ino_t ino0 = segment_inode(&first[0]), ino1 = segment_inode(&first[1]);
  size_t size0 = first[0].segment_size, size1 = first[1].segment_size;
  /* Rank 1 spoils its segment and releases it; rank 0 keeps its own. */
  scribble(&first[1]);
  ck_assert_int_eq(release(rk[1].sock, first[1].export_id), 0);
  published_free(&first[1]);
  wait_pool(rk[0].sock, size0 + size1, 0, size1);

  id0 = send_export(rk[0].sock, false, 10000, 0);
  id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &second[0], msg, sizeof msg, NULL), 0);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &second[1], msg, sizeof msg, NULL), 0);
  /* Rank 0 needed a segment while only rank 1's was kept: a new one. */
  ck_assert_uint_ne(segment_inode(&second[0]), ino0);
  ck_assert_uint_ne(segment_inode(&second[0]), ino1);
  ck_assert_uint_eq(segment_inode(&second[1]), ino1);
  check_model(rk, second);
  check_gaps_zero(&second[1]);
  wait_pool(rk[0].sock, 2 * size0 + size1, 0, 0);

  /* Everything released: each rank gets one of its own back. */
  ino_t ino0b = segment_inode(&second[0]);
  scribble(&first[0]);
  scribble(&second[0]);
  ck_assert_int_eq(release(rk[0].sock, first[0].export_id), 0);
  ck_assert_int_eq(release(rk[0].sock, second[0].export_id), 0);
  ck_assert_int_eq(release(rk[1].sock, second[1].export_id), 0);
  for (uint32_t r = 0; r < 2; r++) {
    published_free(&first[r]);
    published_free(&second[r]);
  }
  wait_pool(rk[0].sock, 2 * size0 + size1, 0, 2 * size0 + size1);
  id0 = send_export(rk[0].sock, false, 10000, 0);
  id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &third[0], msg, sizeof msg, NULL), 0);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &third[1], msg, sizeof msg, NULL), 0);
  ino_t ino0c = segment_inode(&third[0]);
  ck_assert(ino0c == ino0 || ino0c == ino0b);
  ck_assert_uint_eq(segment_inode(&third[1]), ino1);
  check_model(rk, third);
  check_gaps_zero(&third[0]);
  check_gaps_zero(&third[1]);
  wait_pool(rk[0].sock, 2 * size0 + size1, 0, size0);
  for (uint32_t r = 0; r < 2; r++)
    published_free(&third[r]);
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

static void pack_one_storage(struct sp_msgbuf *mb, uint64_t id, uint32_t sid,
                             uint64_t fd, uint64_t offset, uint64_t length,
                             uint64_t base) {
  sp_msgbuf_begin(mb, "storage_add", id, 1);
  sp_pack_str(&mb->pk, "storages");
  msgpack_pack_array(&mb->pk, 1);
  msgpack_pack_map(&mb->pk, 6);
  sp_pack_kv_u64(&mb->pk, "sid", sid);
  sp_pack_kv_str(&mb->pk, "kind", "memfd");
  sp_pack_kv_u64(&mb->pk, "fd", fd);
  sp_pack_kv_u64(&mb->pk, "offset", offset);
  sp_pack_kv_u64(&mb->pk, "length", length);
  sp_pack_kv_u64(&mb->pk, "base", base);
}

/* A float32 row-major tensor map with the given key, storage, view. */
static void pack_plain(msgpack_packer *pk, const char *key, uint32_t sid,
                       int64_t rows, int64_t cols, uint64_t offset) {
  int64_t shape[2] = {rows, cols}, stride[2] = {cols, 1};
  msgpack_pack_map(pk, 8);
  sp_pack_kv_str(pk, "key", key);
  sp_pack_kv_u64(pk, "sid", sid);
  sp_pack_kv_str(pk, "dtype", "float32");
  pack_dims(pk, "shape", 2, shape);
  pack_dims(pk, "stride", 2, stride);
  sp_pack_kv_u64(pk, "offset", offset);
  sp_pack_kv_str(pk, "placement", "replicated");
  pack_dims(pk, "global_shape", 2, shape);
}

static int add_plain(int sock, const char *key, uint32_t sid, int64_t rows,
                     int64_t cols, uint64_t offset, const char *words,
                     int code) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 1);
  pack_plain(&mb.pk, key, sid, rows, cols, offset);
  expect_error(sock, &mb, id, NULL, 0, code, words);
  return 0;
}

START_TEST(registration_refusals) {
  int sock = sp_test_connect_hello(daemon_.socket);
  struct sp_msgbuf mb;
  uint64_t id;
  /* Nothing registers before a join. */
  add_plain(sock, "w", 1, 1, 1, 0, "join", SP_ESTATE);
  struct ticket t = job_create(sock, 1);
  ck_assert_int_eq(join(sock, &t, 0, 1), 0);

  int fd = memfd_create("s", MFD_CLOEXEC);
  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  /* A file shorter than offset + length is refused. */
  id = next_id++;
  pack_one_storage(&mb, id, 1, 0, 100, 4000, 0x1000);
  expect_error(sock, &mb, id, &fd, 1, SP_EBADFD, "fewer than");
  /* So is an fd index the frame does not carry, and a pipe. */
  id = next_id++;
  pack_one_storage(&mb, id, 1, 1, 0, 16, 0x1000);
  expect_error(sock, &mb, id, &fd, 1, SP_EBADFD, "fd index");
  int pipefd[2];
  ck_assert_int_eq(pipe(pipefd), 0);
  id = next_id++;
  pack_one_storage(&mb, id, 1, 0, 0, 16, 0x1000);
  expect_error(sock, &mb, id, pipefd, 1, SP_EBADFD, "not a memfd");
  close(pipefd[0]);
  close(pipefd[1]);
  /* A good one, then the same sid and the same base again. */
  id = next_id++;
  pack_one_storage(&mb, id, 1, 0, 0, 4096, 0x1000);
  ck_assert_int_eq(call(sock, &mb, id, &fd, 1, NULL), 0);
  id = next_id++;
  pack_one_storage(&mb, id, 1, 0, 0, 16, 0x9000);
  expect_error(sock, &mb, id, &fd, 1, SP_EINVAL, "twice");
  id = next_id++;
  pack_one_storage(&mb, id, 2, 0, 0, 16, 0x1000);
  expect_error(sock, &mb, id, &fd, 1, SP_EINVAL, "base address");

  /* Views: outside the storage, unknown storage, bad dtype, bad key. */
  add_plain(sock, "w", 1, 32, 33, 0, "sid 1", SP_EOUTOFBOUNDS);
  add_plain(sock, "w", 1, 1, 4, 1022, "sid 1", SP_EOUTOFBOUNDS);
  add_plain(sock, "w", 5, 1, 4, 0, "sid 5", SP_ENOSTORAGE);
  add_plain(sock, "", 1, 1, 4, 0, "1 to 1024", SP_EINVAL);
  add_plain(sock, "\xc3\x28", 1, 1, 4, 0, "UTF-8", SP_EINVAL);

  /* A frame with a good tensor and a duplicate registers neither... */
  id = next_id++;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 3);
  pack_plain(&mb.pk, "x", 1, 2, 2, 0);
  pack_plain(&mb.pk, "y", 1, 2, 2, 4);
  pack_plain(&mb.pk, "x", 1, 2, 2, 8);
  expect_error(sock, &mb, id, NULL, 0, SP_EDUPKEY, "'x'");
  /* ... nor one with a bad view in its last tensor. */
  id = next_id++;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 2);
  pack_plain(&mb.pk, "x", 1, 2, 2, 0);
  pack_plain(&mb.pk, "y", 1, 2, 2, 5000);
  expect_error(sock, &mb, id, NULL, 0, SP_EOUTOFBOUNDS, "tensors[1]");
  /* So both still register, once. */
  id = next_id++;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 2);
  pack_plain(&mb.pk, "x", 1, 2, 2, 0);
  pack_plain(&mb.pk, "y", 1, 2, 2, 4);
  ck_assert_int_eq(call(sock, &mb, id, NULL, 0, NULL), 0);
  add_plain(sock, "y", 1, 2, 2, 0, "registered twice", SP_EDUPKEY);
  close(fd);

  /* The daemon's own fds: the refused frames left none open. */
  ck_assert_int_eq(sp_test_ping(sock, 4242), 0);
  close(sock);
}
END_TEST

START_TEST(join_refusals) {
  int a = sp_test_connect_hello(daemon_.socket);
  int b = sp_test_connect_hello(daemon_.socket);
  struct ticket t = job_create(a, 2);
  struct sp_msgbuf mb;
  uint64_t id;

  struct ticket bad = t;
  bad.bytes[bad.len - 3] ^= 0x55; /* inside the secret or world */
  id = next_id++;
  sp_test_pack_join(&mb, id, bad.bytes, bad.len, 0, 2, "cpu");
  expect_error(a, &mb, id, NULL, 0, SP_ETICKET, NULL);
  struct ticket junk = {.len = 5, .bytes = {0xdd, 0xff, 0, 0, 0}};
  id = next_id++;
  sp_test_pack_join(&mb, id, junk.bytes, junk.len, 0, 2, "cpu");
  expect_error(a, &mb, id, NULL, 0, SP_ETICKET, "not a shardport");
  id = next_id++;
  sp_test_pack_join(&mb, id, t.bytes, t.len, 2, 2, "cpu");
  expect_error(a, &mb, id, NULL, 0, SP_ERANK, "below the world");
  id = next_id++;
  sp_test_pack_join(&mb, id, t.bytes, t.len, 0, 3, "cpu");
  expect_error(a, &mb, id, NULL, 0, SP_ERANK, "world 3");
  id = next_id++;
  sp_test_pack_join(&mb, id, t.bytes, t.len, 0, 2, "gpu0");
  expect_error(a, &mb, id, NULL, 0, SP_EINVAL, "device");

  ck_assert_int_eq(join(a, &t, 0, 2), 0);
  ck_assert_int_eq(join(a, &t, 1, 2), SP_ESTATE);
  ck_assert_int_eq(join(b, &t, 0, 2), SP_ERANK);
  ck_assert_int_eq(join(b, &t, 1, 2), 0);
  /* A rank that left frees its place. */
  id = next_id++;
  sp_msgbuf_begin(&mb, "leave", id, 0);
  ck_assert_int_eq(call(b, &mb, id, NULL, 0, NULL), 0);
  id = next_id++;
  sp_msgbuf_begin(&mb, "leave", id, 0);
  expect_error(b, &mb, id, NULL, 0, SP_ESTATE, "not in a job");
  int rc = SP_ERANK;
  for (int i = 0; i < 100 && rc == SP_ERANK; i++) {
    rc = join(b, &t, 1, 2);
    if (rc == SP_ERANK)
      usleep(10000);
  }
  ck_assert_int_eq(rc, 0);
  close(a);
  close(b);
}
END_TEST

START_TEST(export_twice_and_unknown_release) {
  struct rank rk[2];
  struct published pub[2];
  char msg[1024];
  two_ranks(rk, NKEYS);
  ck_assert_int_eq(release(rk[0].sock, 12345), SP_ENOEXPORT);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  /* Asked twice: the second is refused, the first goes on. */
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "export", id, 0);
  expect_error(rk[0].sock, &mb, id, NULL, 0, SP_EEXPORTING, "already asked");
  /* A rank that asked may not register more until its export is over:
   * across nodes its registrations already went to the root. */
  add_plain(rk[0].sock, "late", 0, 1, 1, 0, "asked", SP_EEXPORTING);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   0);
  ck_assert_int_eq(read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL),
                   0);
  check_model(rk, pub);
  for (uint32_t r = 0; r < 2; r++) {
    published_free(&pub[r]);
    rank_close(&rk[r]);
  }
}
END_TEST

/* A refusal decided from the gathered metadata reaches every rank with the
 * same code and message, and the job serves the next export. */
START_TEST(refusal_reaches_every_rank) {
  struct rank rk[2];
  struct published pub[2];
  char msg[2][1024];
  two_ranks(rk, 0); /* rank 1 does not register a.weight */
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &pub[0], msg[0], sizeof msg[0], NULL),
      SP_EKEYSET);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &pub[1], msg[1], sizeof msg[1], NULL),
      SP_EKEYSET);
  ck_assert_str_eq(msg[0], msg[1]);
  ck_assert_ptr_nonnull(strstr(msg[0], "a.weight"));
  char phase[32], error[1100];
  uint64_t used;
  status_job(rk[0].sock, phase, sizeof phase, &used, NULL, NULL, error,
             sizeof error);
  ck_assert_str_eq(phase, "failed");
  ck_assert_ptr_nonnull(strstr(error, "key_set_mismatch"));
  ck_assert_uint_eq(used, 0);
  /* Fixed, the same job exports. */
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "tensor_add", id, 1);
  sp_pack_str(&mb.pk, "tensors");
  msgpack_pack_array(&mb.pk, 1);
  pack_model_tensor(&mb.pk, &rk[1], 0);
  ck_assert_int_eq(call(rk[1].sock, &mb, id, NULL, 0, NULL), 0);
  id0 = send_export(rk[0].sock, false, 10000, 0);
  id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &pub[0], msg[0], sizeof msg[0], NULL), 0);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &pub[1], msg[1], sizeof msg[1], NULL), 0);
  check_model(rk, pub);
  for (uint32_t r = 0; r < 2; r++) {
    published_free(&pub[r]);
    rank_close(&rk[r]);
  }
}
END_TEST

/* Replicas are compared, not overwritten: when a rank's copy differs, the
 * export fails on both with different_data naming the key. */
START_TEST(different_replicas_refused) {
  struct rank rk[2];
  struct published pub[2];
  char msg[2][1024];
  two_ranks(rk, NKEYS);
  size_t i = 0;
  while (strcmp(model[i].name, "i.replica") != 0)
    i++;
  rk[1].map[STORAGE_OFFSET + rk[1].key_at[i] + 5] ^= 0xff;
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(
      read_export(rk[0].sock, id0, &pub[0], msg[0], sizeof msg[0], NULL),
      SP_EDIFFERENT);
  ck_assert_int_eq(
      read_export(rk[1].sock, id1, &pub[1], msg[1], sizeof msg[1], NULL),
      SP_EDIFFERENT);
  ck_assert_str_eq(msg[0], msg[1]);
  ck_assert_ptr_nonnull(strstr(msg[0], "'i.replica'"));
  ck_assert_ptr_nonnull(strstr(msg[0], "[0, 5]"));
  ck_assert_ptr_nonnull(strstr(msg[0], "rank 0 and rank 1"));
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* A trainer that truncates its registered memfd fails the export with a
 * clear error; the daemon survives the fault and serves on. */
START_TEST(truncated_storage_fails_cleanly) {
  struct rank rk[2];
  struct published pub[2];
  char msg[2][1024];
  two_ranks(rk, NKEYS);
  munmap(rk[1].map, rk[1].size);
  ck_assert_int_eq(ftruncate(rk[1].memfd, 0), 0);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 0);
  int c0 = read_export(rk[0].sock, id0, &pub[0], msg[0], sizeof msg[0], NULL);
  int c1 = read_export(rk[1].sock, id1, &pub[1], msg[1], sizeof msg[1], NULL);
  ck_assert_int_eq(c0, SP_EBADFD);
  ck_assert_int_eq(c1, SP_EBADFD);
  ck_assert_str_eq(msg[0], msg[1]);
  ck_assert_ptr_nonnull(strstr(msg[0], "rank 1"));
  ck_assert_ptr_nonnull(strstr(msg[0], "truncated"));
  ck_assert_int_eq(sp_test_ping(rk[0].sock, 777), 0);
  rk[1].map =
      mmap(NULL, rk[1].size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

START_TEST(gather_timeout) {
  struct rank rk[2];
  struct published pub;
  char msg[1024];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 300, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub, msg, sizeof msg, NULL),
                   SP_ETIMEOUT);
  ck_assert_ptr_nonnull(strstr(msg, "rank(s) 1"));
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* A rank that leaves while the others wait fails their export at once. */
START_TEST(leave_while_waiting) {
  struct rank rk[2];
  struct published pub;
  char msg[1024];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, false, 10000, 0);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_msgbuf_begin(&mb, "leave", id, 0);
  ck_assert_int_eq(call(rk[1].sock, &mb, id, NULL, 0, NULL), 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub, msg, sizeof msg, NULL),
                   SP_ERANKLOST);
  ck_assert_ptr_nonnull(strstr(msg, "rank 1 left"));
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* Reads progress frames until one says the export is in its first round. */
static void wait_moving(int sock) {
  for (;;) {
    struct sp_test_reply r;
    char phase[32];
    uint64_t round = 0;
    ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
    ck_assert_str_eq(r.head.op, "progress");
    ck_assert_int_eq(
        sp_msg_get_strbuf(&r.map, "phase", false, phase, sizeof phase), 0);
    ck_assert_int_eq(sp_msg_get_u64(&r.map, "round", false, &round), 0);
    sp_test_reply_free(&r);
    if (strcmp(phase, "moving") == 0 && round >= 1)
      return;
  }
}

/* With the engine slowed down by the test seam: status answers while the
 * export moves, and a rank that disconnects mid-export fails it on the
 * other rank with rank_lost naming it; the daemon then serves a new job. */
START_TEST(rank_lost_mid_export) {
  start_with("", "SHARDPORTD_TEST_ROUND_DELAY_MS", "200");
  struct rank rk[2];
  struct published pub[2];
  char msg[1024], phase[32];
  two_ranks(rk, NKEYS);
  uint64_t id0 = send_export(rk[0].sock, true, 10000, 1);
  uint64_t id1 = send_export(rk[1].sock, false, 10000, 1);
  wait_moving(rk[0].sock);
  int watcher = sp_test_connect_hello(daemon_.socket);
  uint64_t used, round, rounds;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  status_job(watcher, phase, sizeof phase, &used, &round, &rounds, NULL, 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  ck_assert_str_eq(phase, "moving");
  ck_assert_uint_ge(round, 1);
  ck_assert_uint_gt(rounds, 2);
  ck_assert_uint_gt(used, 0);
  /* Not a timing assertion: a status that waited on the engine would take
   * a whole round (200 ms). */
  fprintf(stderr, "status during an export: %.3f ms\n",
          (double)(t1.tv_sec - t0.tv_sec) * 1e3 +
              (double)(t1.tv_nsec - t0.tv_nsec) / 1e6);
  close(rk[1].sock);
  rk[1].sock = -1;
  (void)id1;
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   SP_ERANKLOST);
  ck_assert_ptr_nonnull(strstr(msg, "rank 1 disconnected"));
  for (int i = 0; i < 300; i++) {
    status_job(watcher, phase, sizeof phase, &used, NULL, NULL, NULL, 0);
    if (used == 0)
      break;
    usleep(10000);
  }
  ck_assert_uint_eq(used, 0);
  ck_assert_str_eq(phase, "failed");
  rank_close(&rk[0]);
  rank_close(&rk[1]);

  /* A new job on the same daemon exports as usual. */
  two_ranks(rk, NKEYS);
  id0 = send_export(rk[0].sock, false, 10000, 0);
  id1 = send_export(rk[1].sock, false, 10000, 0);
  ck_assert_int_eq(read_export(rk[0].sock, id0, &pub[0], msg, sizeof msg, NULL),
                   0);
  ck_assert_int_eq(read_export(rk[1].sock, id1, &pub[1], msg, sizeof msg, NULL),
                   0);
  check_model(rk, pub);
  for (uint32_t r = 0; r < 2; r++) {
    published_free(&pub[r]);
    rank_close(&rk[r]);
  }
  close(watcher);
  stop();
}
END_TEST

/* SIGTERM while an export moves: the daemon stops its engine, frees the
 * job and exits cleanly (under valgrind too: no leak, no error). */
START_TEST(shutdown_mid_export) {
  start_with("", "SHARDPORTD_TEST_ROUND_DELAY_MS", "300");
  struct rank rk[2];
  two_ranks(rk, NKEYS);
  send_export(rk[0].sock, true, 10000, 1);
  send_export(rk[1].sock, false, 10000, 1);
  wait_moving(rk[0].sock);
  stop();
  for (uint32_t r = 0; r < 2; r++)
    rank_close(&rk[r]);
}
END_TEST

/* More keys than one round holds and more tensors than one reply frame:
 * with a small max_output the reply comes in several parts, streamed as the
 * rank reads them. */
START_TEST(many_keys_in_parts) {
  start_with("max_output = 64k\n", NULL, NULL);
  enum { N = 5000 };
  int sock[2];
  int fd[2];
  struct ticket t;
  for (uint32_t r = 0; r < 2; r++) {
    sock[r] = sp_test_connect_hello(daemon_.socket);
    ck_assert_int_ge(sock[r], 0);
    if (r == 0)
      t = job_create(sock[0], 2);
    ck_assert_int_eq(join(sock[r], &t, r, 2), 0);
    fd[r] = memfd_create("many", MFD_CLOEXEC);
    ck_assert_int_eq(ftruncate(fd[r], N * 4), 0);
    uint32_t *p =
        mmap(NULL, N * 4, PROT_READ | PROT_WRITE, MAP_SHARED, fd[r], 0);
    for (uint32_t i = 0; i < N; i++)
      p[i] = i * 2 + r;
    munmap(p, N * 4);
    struct sp_msgbuf mb;
    uint64_t id = next_id++;
    pack_one_storage(&mb, id, 1, 0, 0, N * 4, 0x10000 + r);
    ck_assert_int_eq(call(sock[r], &mb, id, &fd[r], 1, NULL), 0);
    /* Key i: two rows, one on each rank. */
    id = next_id++;
    sp_msgbuf_begin(&mb, "tensor_add", id, 1);
    sp_pack_str(&mb.pk, "tensors");
    msgpack_pack_array(&mb.pk, N);
    for (uint32_t i = 0; i < N; i++) {
      char key[64];
      int64_t shape[1] = {1}, stride[1] = {1}, global[1] = {2};
      snprintf(key, sizeof key, "layers.%05u.a_fairly_long_parameter_name", i);
      msgpack_pack_map(&mb.pk, 8);
      sp_pack_kv_str(&mb.pk, "key", key);
      sp_pack_kv_u64(&mb.pk, "sid", 1);
      sp_pack_kv_str(&mb.pk, "dtype", "int32");
      pack_dims(&mb.pk, "shape", 1, shape);
      pack_dims(&mb.pk, "stride", 1, stride);
      sp_pack_kv_u64(&mb.pk, "offset", i);
      sp_pack_kv_str(&mb.pk, "placement", "shard0");
      pack_dims(&mb.pk, "global_shape", 1, global);
    }
    ck_assert_int_eq(call(sock[r], &mb, id, NULL, 0, NULL), 0);
  }
  uint64_t id[2];
  for (uint32_t r = 0; r < 2; r++)
    id[r] = send_export(sock[r], false, 10000, 0);
  size_t total = 0;
  for (uint32_t r = 0; r < 2; r++) {
    uint64_t parts = 1;
    uint8_t *seg = NULL;
    size_t seg_size = 0;
    for (uint64_t p = 0; p < parts; p++) {
      struct sp_test_reply rep;
      ck_assert_int_eq(recv_for(sock[r], id[r], &rep, NULL, NULL), 0);
      ck_assert_int_eq(rep.code, 0);
      ck_assert_int_eq(sp_msg_get_u64(&rep.map, "parts", false, &parts), 0);
      if (p == 0 && rep.frame.nfds == 1) {
        struct stat st;
        fstat(rep.frame.fds[0], &st);
        seg_size = (size_t)st.st_size;
        seg = mmap(NULL, seg_size, PROT_READ, MAP_SHARED, rep.frame.fds[0], 0);
        ck_assert_ptr_ne(seg, MAP_FAILED);
      }
      const msgpack_object_array *a;
      ck_assert_int_eq(sp_msg_get_array(&rep.map, "tensors", false, &a), 0);
      for (uint32_t k = 0; k < a->size; k++) {
        char key[64];
        uint64_t off;
        unsigned idx;
        ck_assert_int_eq(
            sp_msg_get_strbuf(&a->ptr[k], "key", false, key, sizeof key), 0);
        ck_assert_int_eq(sscanf(key, "layers.%05u.", &idx), 1);
        ck_assert_int_eq(sp_msg_get_u64(&a->ptr[k], "byte_offset", false, &off),
                         0);
        const uint32_t *v = (const uint32_t *)(seg + off);
        ck_assert_uint_eq(v[0], idx * 2);
        ck_assert_uint_eq(v[1], idx * 2 + 1);
      }
      total += a->size;
      sp_test_reply_free(&rep);
    }
    ck_assert_uint_gt(parts, 1);
    if (seg != NULL)
      munmap(seg, seg_size);
  }
  ck_assert_uint_eq(total, N);
  char phase[32];
  uint64_t used, rounds;
  status_job(sock[0], phase, sizeof phase, &used, NULL, &rounds, NULL, 0);
  ck_assert_uint_eq(rounds, 2); /* 5000 keys, 4096 per round */
  for (uint32_t r = 0; r < 2; r++) {
    close(sock[r]);
    close(fd[r]);
  }
  stop();
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-jobs");
  TCase *tc = tcase_create("jobs");
  tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, export_two_ranks);
  tcase_add_test(tc, close_returns_pool_memory);
  tcase_add_test(tc, kept_segment_counted_until_closed);
  tcase_add_test(tc, reopened_segment_counted_until_closed);
  tcase_add_test(tc, released_segment_reused_by_its_rank_only);
  tcase_add_test(tc, registration_refusals);
  tcase_add_test(tc, join_refusals);
  tcase_add_test(tc, export_twice_and_unknown_release);
  tcase_add_test(tc, refusal_reaches_every_rank);
  tcase_add_test(tc, different_replicas_refused);
  tcase_add_test(tc, truncated_storage_fails_cleanly);
  tcase_add_test(tc, gather_timeout);
  tcase_add_test(tc, leave_while_waiting);
  suite_add_tcase(s, tc);
  /* These start their own daemon (a test seam, a configuration). */
  TCase *own = tcase_create("own-daemon");
  tcase_set_timeout(own, 30);
  tcase_add_test(own, rank_lost_mid_export);
  tcase_add_test(own, many_keys_in_parts);
  tcase_add_test(own, shutdown_mid_export);
  suite_add_tcase(s, own);
  return s;
}

/* argv[1], when given, names the one test case to run. */
int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  SRunner *sr = srunner_create(suite());
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
