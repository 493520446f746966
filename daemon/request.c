/*
 * request.c - the job messages of docs/protocol.md ("Jobs") read from their
 * decoded maps into plain structs, with every bound the protocol states.
 *
 * This is the one place that reads these requests: job.c, registry.c and
 * export.c see only what passed here.  A field that is missing or has the
 * wrong type is bad_message; a value outside its bound is invalid_argument
 * (or the code the protocol names for it), always with a sentence that
 * names the field and, for an element of an array, its index.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/netaddr.h"
#include "daemon/request.h"
#include "proto/fail.h"
#include "proto/msg.h"
#include "proto/text.h"
#include "proto/wire.h"
#include "shardport.h"

/* An unsigned field at most max.  where prefixes the message ("" at the top
 * level, "tensors[3]: " inside an array). */
static int get_uint(const msgpack_object *map, const char *key, bool optional,
                    uint64_t max, uint64_t *out, const char *where, char *msg,
                    size_t msglen) {
  int rc = sp__msg_get_u64(map, key, optional, out);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "%s\"%s\" must be an unsigned integer", where, key);
  if (rc == 0 && *out > max)
    return sp__failf(msg, msglen, SP_EINVAL, "%s\"%s\" is %llu, more than %llu",
                     where, key, (unsigned long long)*out,
                     (unsigned long long)max);
  return rc;
}

/* An array of at most SP_MAX_DIMS unsigned values below 2^62. */
static int get_dims(const msgpack_object *map, const char *key, uint32_t *ndim,
                    int64_t *dims, const char *where, char *msg,
                    size_t msglen) {
  const msgpack_object_array *a;
  if (sp__msg_get_array(map, key, false, &a) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "%s\"%s\" must be an array of unsigned integers", where,
                     key);
  if (a->size > SP_MAX_DIMS)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%s\"%s\" has %u dims, more than %d", where, key, a->size,
                     SP_MAX_DIMS);
  for (uint32_t d = 0; d < a->size; d++) {
    if (a->ptr[d].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
      return sp__failf(msg, msglen, SP_EBADMSG,
                       "%s\"%s\"[%u] must be an unsigned integer", where, key,
                       d);
    if (a->ptr[d].via.u64 > REQ_MAX_VALUE)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "%s\"%s\"[%u] is %llu, not below 2^62", where, key, d,
                       (unsigned long long)a->ptr[d].via.u64);
    dims[d] = (int64_t)a->ptr[d].via.u64;
  }
  *ndim = a->size;
  return 0;
}

/* A key: 1 to REQ_MAX_KEY bytes of UTF-8 without NUL. */
static int check_key(const char *s, size_t len, const char *where, char *msg,
                     size_t msglen) {
  if (len == 0 || len > REQ_MAX_KEY)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sa key must have 1 to %u bytes, not %zu", where,
                     REQ_MAX_KEY, len);
  if (!sp__utf8_valid(s, len))
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sthe key is not UTF-8 without NUL bytes", where);
  return 0;
}

int request_parse_job_create(const msgpack_object *map,
                             struct req_job_create *out, char *msg,
                             size_t msglen) {
  uint64_t world, consumers;
  int rc =
      get_uint(map, "world", false, REQ_MAX_WORLD, &world, "", msg, msglen);
  if (rc != 0)
    return rc;
  if (world == 0)
    return sp__failf(msg, msglen, SP_EINVAL, "\"world\" must be at least 1");
  rc = get_uint(map, "consumers", true, REQ_MAX_CONSUMERS, &consumers, "", msg,
                msglen);
  if (rc < 0)
    return rc;
  out->world = (uint32_t)world;
  out->consumers = rc == 0 ? (uint32_t)consumers : 0;
  return 0;
}

int request_parse_device(const char *s, size_t len, uint32_t *type) {
  static const char cuda[] = "cuda:";
  if (len == 3 && memcmp(s, "cpu", 3) == 0) {
    *type = SP_DEVICE_CPU;
    return 0;
  }
  /* A GPU UUID as nvidia-smi prints it ("GPU-" and 36 characters); only
   * its characters are checked here, the CUDA backend resolves it. */
  if (len > sizeof cuda - 1 && len <= REQ_MAX_DEVICE &&
      memcmp(s, cuda, sizeof cuda - 1) == 0) {
    for (size_t i = sizeof cuda - 1; i < len; i++)
      if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z') ||
            (s[i] >= 'A' && s[i] <= 'Z') || s[i] == '-'))
        return SP_EINVAL;
    *type = SP_DEVICE_CUDA;
    return 0;
  }
  return SP_EINVAL;
}

/* join and consumer_join: the ticket, the member's number (field) among
 * count of them, and its device. */
static int parse_join(const msgpack_object *map, const char *field,
                      const char *count, struct req_join *out, char *msg,
                      size_t msglen) {
  uint64_t rank, world;
  const char *device;
  size_t device_len;
  int rc;
  if (sp__msg_get_bin(map, "ticket", false, &out->ticket, &out->ticket_len) !=
      0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"ticket\" must be a bin");
  if (out->ticket_len > SP_TICKET_MAX)
    return sp__failf(msg, msglen, SP_ETICKET,
                     "the ticket has %zu bytes, more than %d", out->ticket_len,
                     SP_TICKET_MAX);
  if ((rc = get_uint(map, field, false, UINT32_MAX, &rank, "", msg, msglen)) !=
          0 ||
      (rc = get_uint(map, count, false, UINT32_MAX, &world, "", msg,
                     msglen)) != 0)
    return rc;
  if (sp__msg_get_str(map, "device", false, &device, &device_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"device\" must be a string");
  if (request_parse_device(device, device_len, &out->device_type) != 0)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "device \"%.*s\" is not \"cpu\" or \"cuda:<GPU UUID>\"",
                     (int)(device_len < 80 ? device_len : 80), device);
  memcpy(out->device, device, device_len);
  out->device[device_len] = '\0';
  out->rank = (uint32_t)rank;
  out->world = (uint32_t)world;
  return 0;
}

int request_parse_join(const msgpack_object *map, struct req_join *out,
                       char *msg, size_t msglen) {
  return parse_join(map, "rank", "world", out, msg, msglen);
}

int request_parse_consumer_join(const msgpack_object *map,
                                struct req_join *out, char *msg,
                                size_t msglen) {
  return parse_join(map, "consumer", "consumers", out, msg, msglen);
}

static bool parse_ticket_v2(const msgpack_object *map, struct req_ticket *out) {
  const char *root;
  const uint8_t *nccl;
  size_t root_len, nccl_len;
  struct sockaddr_storage sa;
  socklen_t salen;
  if (sp__msg_get_str(map, "root", false, &root, &root_len) != 0 ||
      netaddr_parse(root, root_len, false, &sa, &salen) != 0)
    return false;
  memcpy(out->root, root, root_len);
  out->root[root_len] = '\0';
  int rc = sp__msg_get_bin(map, "nccl_id", true, &nccl, &nccl_len);
  if (rc < 0 || (rc == 0 && nccl_len != NODE_NCCL_ID_BYTES))
    return false;
  out->has_nccl_id = rc == 0;
  if (out->has_nccl_id)
    memcpy(out->nccl_id, nccl, NODE_NCCL_ID_BYTES);
  return true;
}

static bool parse_ticket_consumers(const msgpack_object *map,
                                   struct req_ticket *out) {
  uint64_t n;
  int rc = sp__msg_get_u64(map, "consumers", true, &n);
  if (rc < 0 || (rc == 0 && n > REQ_MAX_CONSUMERS))
    return false;
  out->consumers = rc == 0 ? (uint32_t)n : 0;
  return true;
}

int request_parse_ticket(const uint8_t *data, size_t len,
                         const struct sp_limits *limits,
                         struct req_ticket *out) {
  msgpack_zone zone;
  msgpack_object map;
  const uint8_t *job, *secret;
  size_t job_len, secret_len;
  uint64_t version, world;
  int rc = SP_ETICKET;
  memset(out, 0, sizeof *out);
  if (len == 0 || len > SP_TICKET_MAX ||
      !msgpack_zone_init(&zone, MSGPACK_ZONE_CHUNK_SIZE))
    return SP_ETICKET;
  /* The ticket came from a trainer, so it goes through the same bounded
   * decoder as a frame. */
  if (sp__wire_decode(data, len, limits, &zone, &map) == 0 &&
      sp__msg_get_u64(&map, "v", false, &version) == 0 &&
      (version == 1 || version == 2) &&
      sp__msg_get_bin(&map, "job", false, &job, &job_len) == 0 &&
      job_len == JOB_ID_BYTES &&
      sp__msg_get_bin(&map, "secret", false, &secret, &secret_len) == 0 &&
      secret_len == JOB_SECRET_BYTES &&
      sp__msg_get_u64(&map, "world", false, &world) == 0 &&
      world <= REQ_MAX_WORLD && (version == 1 || parse_ticket_v2(&map, out)) &&
      parse_ticket_consumers(&map, out)) {
    out->version = (uint32_t)version;
    memcpy(out->job, job, JOB_ID_BYTES);
    memcpy(out->secret, secret, JOB_SECRET_BYTES);
    out->world = (uint32_t)world;
    rc = 0;
  }
  msgpack_zone_destroy(&zone);
  return rc;
}

/* A storage's kind and what only CUDA storages carry: the IPC handle
 * (decoded from a raw cudaIpcMemHandle_t or PyTorch's bytes) and the GPU
 * it lives on. */
static int parse_storage_kind(const msgpack_object *o, struct req_storage *s,
                              const char *where, char *msg, size_t msglen) {
  const char *kind, *device;
  size_t kind_len, device_len;
  if (sp__msg_get_str(o, "kind", false, &kind, &kind_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"kind\" must be a string",
                     where);
  if (kind_len == 5 && memcmp(kind, "memfd", 5) == 0)
    s->kind = REQ_STORAGE_MEMFD;
  else if (kind_len == 8 && memcmp(kind, "cuda_ipc", 8) == 0)
    s->kind = REQ_STORAGE_CUDA_IPC;
  else if (kind_len == 7 && memcmp(kind, "cuda_fd", 7) == 0)
    s->kind = REQ_STORAGE_CUDA_FD;
  else
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%skind \"%.*s\" is not \"memfd\", \"cuda_ipc\" or "
                     "\"cuda_fd\"",
                     where, (int)(kind_len < 32 ? kind_len : 32), kind);
  if (s->kind == REQ_STORAGE_MEMFD)
    return 0;
  if (s->kind == REQ_STORAGE_CUDA_IPC) {
    const uint8_t *handle;
    size_t handle_len;
    char why[256];
    if (sp__msg_get_bin(o, "handle", false, &handle, &handle_len) != 0)
      return sp__failf(msg, msglen, SP_EBADMSG, "%s\"handle\" must be a bin",
                       where);
    if (gpu_handle_decode(handle, handle_len, s->handle, why, sizeof why) != 0)
      return sp__failf(msg, msglen, SP_EINVAL, "%s%s", where, why);
  }
  int rc = sp__msg_get_str(o, "device", true, &device, &device_len);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"device\" must be a string",
                     where);
  if (rc == 0) {
    uint32_t type;
    if (request_parse_device(device, device_len, &type) != 0 ||
        type != SP_DEVICE_CUDA)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "%sdevice \"%.*s\" is not \"cuda:<GPU UUID>\"", where,
                       (int)(device_len < 80 ? device_len : 80), device);
    memcpy(s->device, device, device_len);
    s->device[device_len] = '\0';
  }
  return 0;
}

int request_parse_storages(const msgpack_object *map, size_t nfds,
                           struct req_storage **out, size_t *n, char *msg,
                           size_t msglen) {
  const msgpack_object_array *a;
  *out = NULL;
  *n = 0;
  if (sp__msg_get_array(map, "storages", false, &a) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"storages\" must be an array of storage maps");
  if (a->size > REQ_MAX_PER_RANK)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "%u storages in one frame, more than %u", a->size,
                     REQ_MAX_PER_RANK);
  struct req_storage *s = calloc(a->size > 0 ? a->size : 1, sizeof *s);
  if (s == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  int rc = 0;
  for (uint32_t i = 0; i < a->size && rc == 0; i++) {
    const msgpack_object *o = &a->ptr[i];
    char where[48];
    uint64_t sid, fd = 0;
    snprintf(where, sizeof where, "storages[%u]: ", i);
    if (o->type != MSGPACK_OBJECT_MAP) {
      rc = sp__failf(msg, msglen, SP_EBADMSG, "%snot a map", where);
      break;
    }
    if ((rc = parse_storage_kind(o, &s[i], where, msg, msglen)) != 0 ||
        (rc = get_uint(o, "sid", false, UINT32_MAX, &sid, where, msg,
                       msglen)) != 0 ||
        (s[i].kind != REQ_STORAGE_CUDA_IPC &&
         (rc = get_uint(o, "fd", false, UINT32_MAX, &fd, where, msg,
                        msglen)) != 0) ||
        (rc = get_uint(o, "offset", false, REQ_MAX_VALUE, &s[i].offset, where,
                       msg, msglen)) != 0 ||
        (rc = get_uint(o, "length", false, REQ_MAX_VALUE, &s[i].length, where,
                       msg, msglen)) != 0 ||
        (rc = get_uint(o, "base", false, UINT64_MAX, &s[i].base, where, msg,
                       msglen)) != 0)
      break;
    if (s[i].kind != REQ_STORAGE_CUDA_IPC && fd >= nfds) {
      rc = sp__failf(msg, msglen, SP_EBADFD,
                     "%sfd index %llu, but the frame carries %zu descriptors",
                     where, (unsigned long long)fd, nfds);
      break;
    }
    if (s[i].offset + s[i].length > REQ_MAX_VALUE) {
      rc = sp__failf(msg, msglen, SP_EINVAL,
                     "%soffset + length is not below 2^62", where);
      break;
    }
    s[i].sid = (uint32_t)sid;
    s[i].fd = (uint32_t)fd;
  }
  if (rc != 0) {
    free(s);
    return rc;
  }
  *out = s;
  *n = a->size;
  return 0;
}

/* One piece map into p, its holders into holders (at most REQ_MAX_WORLD). */
static int parse_piece(const msgpack_object *o, struct affine_piece *p,
                       uint32_t *holders, const char *where, char *msg,
                       size_t msglen) {
  const msgpack_object_array *h;
  uint32_t nd_src, nd_dst;
  uint64_t v;
  int rc;
  if (o->type != MSGPACK_OBJECT_MAP)
    return sp__failf(msg, msglen, SP_EBADMSG, "%snot a map", where);
  if ((rc = get_dims(o, "shape", &p->ndim, p->shape, where, msg, msglen)) !=
          0 ||
      (rc = get_dims(o, "src_stride", &nd_src, p->src_stride, where, msg,
                     msglen)) != 0 ||
      (rc = get_dims(o, "dst_stride", &nd_dst, p->dst_stride, where, msg,
                     msglen)) != 0)
    return rc;
  if (nd_src != p->ndim || nd_dst != p->ndim)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sshape, src_stride and dst_stride have %u, %u and %u "
                     "dims",
                     where, p->ndim, nd_src, nd_dst);
  if ((rc = get_uint(o, "src_offset", false, REQ_MAX_VALUE, &v, where, msg,
                     msglen)) != 0)
    return rc;
  p->src_offset = (int64_t)v;
  if ((rc = get_uint(o, "dst_offset", false, REQ_MAX_VALUE, &v, where, msg,
                     msglen)) != 0)
    return rc;
  p->dst_offset = (int64_t)v;
  if (sp__msg_get_array(o, "holders", false, &h) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "%s\"holders\" must be an array of ranks", where);
  if (h->size == 0 || h->size > REQ_MAX_WORLD)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sa piece has 1 to %u holders, not %u", where,
                     REQ_MAX_WORLD, h->size);
  for (uint32_t k = 0; k < h->size; k++) {
    if (h->ptr[k].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        h->ptr[k].via.u64 >= REQ_MAX_WORLD)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "%sholders[%u] is not a rank below %u", where, k,
                       REQ_MAX_WORLD);
    holders[k] = (uint32_t)h->ptr[k].via.u64;
  }
  p->nholders = h->size;
  p->holders = holders;
  return 0;
}

/* The pieces of an affine tensor in one allocation: pieces, then holders. */
static int parse_pieces(const msgpack_object_array *a, struct req_tensor *t,
                        const char *where, char *msg, size_t msglen) {
  size_t nholders = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object_array *h;
    if (a->ptr[i].type == MSGPACK_OBJECT_MAP &&
        sp__msg_get_array(&a->ptr[i], "holders", false, &h) == 0)
      nholders += h->size;
  }
  /* Both counts are bounded by the frame, which the wire check bounded. */
  size_t bytes = (size_t)a->size * sizeof(struct affine_piece) +
                 nholders * sizeof(uint32_t);
  uint8_t *block = malloc(bytes > 0 ? bytes : 1);
  if (block == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  struct affine_piece *pieces = (struct affine_piece *)block;
  uint32_t *holders =
      (uint32_t *)(block + (size_t)a->size * sizeof(struct affine_piece));
  memset(pieces, 0, (size_t)a->size * sizeof *pieces);
  size_t at = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    char pwhere[96];
    snprintf(pwhere, sizeof pwhere, "%spieces[%u]: ", where, i);
    int rc =
        parse_piece(&a->ptr[i], &pieces[i], holders + at, pwhere, msg, msglen);
    if (rc != 0) {
      free(block);
      return rc;
    }
    at += pieces[i].nholders;
  }
  t->pieces = pieces;
  t->npieces = a->size;
  return 0;
}

static int parse_tensor(const msgpack_object *o, uint32_t i,
                        struct req_tensor *t, char *msg, size_t msglen) {
  char where[64];
  const char *dtype, *placement;
  size_t dtype_len, placement_len;
  const msgpack_object_array *pieces;
  uint64_t sid, offset;
  uint32_t nstride;
  int rc;
  snprintf(where, sizeof where, "tensors[%u]: ", i);
  if (o->type != MSGPACK_OBJECT_MAP)
    return sp__failf(msg, msglen, SP_EBADMSG, "%snot a map", where);
  if (sp__msg_get_str(o, "key", false, &t->key, &t->key_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"key\" must be a string",
                     where);
  if ((rc = check_key(t->key, t->key_len, where, msg, msglen)) != 0)
    return rc;
  /* From here on messages name the key as well. */
  snprintf(where, sizeof where, "tensors[%u] ('%.*s'): ", i,
           (int)(t->key_len < 24 ? t->key_len : 24), t->key);
  if ((rc = get_uint(o, "sid", false, UINT32_MAX, &sid, where, msg, msglen)) !=
          0 ||
      (rc = get_uint(o, "offset", false, REQ_MAX_VALUE, &offset, where, msg,
                     msglen)) != 0)
    return rc;
  t->sid = (uint32_t)sid;
  t->view.offset = (int64_t)offset;
  if (sp__msg_get_str(o, "dtype", false, &dtype, &dtype_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"dtype\" must be a string",
                     where);
  if (sp__dtype_from_name(dtype, dtype_len, &t->view.dtype) != 0)
    return sp__failf(msg, msglen, SP_EDTYPE, "%sunknown dtype \"%.*s\"", where,
                     (int)(dtype_len < 32 ? dtype_len : 32), dtype);
  if ((rc = get_dims(o, "shape", &t->view.ndim, t->view.shape, where, msg,
                     msglen)) != 0 ||
      (rc = get_dims(o, "stride", &nstride, t->view.stride, where, msg,
                     msglen)) != 0 ||
      (rc = get_dims(o, "global_shape", &t->ndim, t->shape, where, msg,
                     msglen)) != 0)
    return rc;
  if (nstride != t->view.ndim)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sshape has %u dims but stride has %u", where,
                     t->view.ndim, nstride);
  if (sp__msg_get_str(o, "placement", false, &placement, &placement_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "%s\"placement\" must be a string", where);
  if (plan_layout_placement_from_name(placement, placement_len,
                                      &t->placement) != 0)
    return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                     "%splacement \"%.*s\" is not shard0, replicated, plain, "
                     "expert or affine",
                     where, (int)(placement_len < 32 ? placement_len : 32),
                     placement);
  rc = sp__msg_get_array(o, "pieces", true, &pieces);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "%s\"pieces\" must be an array of piece maps", where);
  if (rc == 0 && t->placement != PLAN_AFFINE && pieces->size > 0)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sonly an affine tensor has pieces", where);
  if (rc == 0 && t->placement == PLAN_AFFINE)
    return parse_pieces(pieces, t, where, msg, msglen);
  return 0;
}

int request_parse_tensors(const msgpack_object *map, struct req_tensor **out,
                          size_t *n, char *msg, size_t msglen) {
  const msgpack_object_array *a;
  *out = NULL;
  *n = 0;
  if (sp__msg_get_array(map, "tensors", false, &a) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"tensors\" must be an array of tensor maps");
  if (a->size > REQ_MAX_PER_RANK)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "%u tensors in one frame, more than %u", a->size,
                     REQ_MAX_PER_RANK);
  struct req_tensor *t = calloc(a->size > 0 ? a->size : 1, sizeof *t);
  if (t == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < a->size; i++) {
    int rc = parse_tensor(&a->ptr[i], i, &t[i], msg, msglen);
    if (rc != 0) {
      request_tensors_free(t, a->size);
      return rc;
    }
  }
  *out = t;
  *n = a->size;
  return 0;
}

void request_tensors_free(struct req_tensor *t, size_t n) {
  if (t == NULL)
    return;
  /* The pieces and their holders are one block (parse_pieces). */
  for (size_t i = 0; i < n; i++)
    free(t[i].pieces);
  free(t);
}

/* Groups become one blob of names, each NUL-terminated and each group
 * ended by an empty name: compared byte for byte to reuse a cached plan,
 * and pointed into by the plan_group arrays. */
static int parse_groups(const msgpack_object_array *a, struct req_groups *g,
                        char *msg, size_t msglen) {
  size_t nnames = 0, bytes = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *grp = &a->ptr[i];
    if (grp->type != MSGPACK_OBJECT_ARRAY)
      return sp__failf(msg, msglen, SP_EBADMSG,
                       "groups[%u] must be an array of keys", i);
    for (uint32_t j = 0; j < grp->via.array.size; j++) {
      const msgpack_object *k = &grp->via.array.ptr[j];
      char where[48];
      snprintf(where, sizeof where, "groups[%u][%u]: ", i, j);
      if (k->type != MSGPACK_OBJECT_STR)
        return sp__failf(msg, msglen, SP_EBADMSG, "%snot a string", where);
      int rc = check_key(k->via.str.ptr, k->via.str.size, where, msg, msglen);
      if (rc != 0)
        return rc;
      bytes += k->via.str.size + 1;
    }
    nnames += grp->via.array.size;
    bytes += 1;
  }
  g->blob = malloc(bytes > 0 ? bytes : 1);
  g->names = malloc((nnames > 0 ? nnames : 1) * sizeof *g->names);
  g->groups = calloc(a->size > 0 ? a->size : 1, sizeof *g->groups);
  if (g->blob == NULL || g->names == NULL || g->groups == NULL) {
    request_groups_free(g);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  size_t at = 0, name = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object_array *grp = &a->ptr[i].via.array;
    g->groups[i].keys = g->names + name;
    g->groups[i].nkeys = grp->size;
    for (uint32_t j = 0; j < grp->size; j++) {
      const msgpack_object_str *k = &grp->ptr[j].via.str;
      g->names[name++] = g->blob + at;
      memcpy(g->blob + at, k->ptr, k->size);
      at += k->size;
      g->blob[at++] = '\0';
    }
    g->blob[at++] = '\0';
  }
  g->ngroups = a->size;
  g->blob_len = bytes;
  return 0;
}

void request_groups_free(struct req_groups *g) {
  free(g->blob);
  free(g->names);
  free(g->groups);
  memset(g, 0, sizeof *g);
}

/* The export's "save" map: the options every rank must ask alike, and the
 * rank's refusal, "error" (a code's wire name) and "message" together. */
static int parse_save(const msgpack_object *save, struct req_save *out,
                      char *msg, size_t msglen) {
  uint64_t v;
  int rc;
  if ((rc = get_uint(save, "max_shard_bytes", false, UINT64_MAX, &v,
                     "save: ", msg, msglen)) < 0)
    return rc;
  if (v == 0)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "save: \"max_shard_bytes\" must be 1 or more");
  out->limit = v;
  if (sp__msg_get_bool(save, "overwrite", false, &out->overwrite) != 0 ||
      sp__msg_get_u64(save, "directory", false, &out->directory) != 0 ||
      sp__msg_get_u64(save, "metadata", false, &out->metadata) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "save: needs \"overwrite\" (bool), \"directory\" and "
                     "\"metadata\" (uints, the digests)");
  const char *code_name, *why;
  size_t code_len, why_len;
  int has_error = sp__msg_get_str(save, "error", true, &code_name, &code_len);
  int has_why = sp__msg_get_str(save, "message", true, &why, &why_len);
  if (has_error < 0 || has_why < 0 || (has_error == 0) != (has_why == 0))
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "save: \"error\" (a code's wire name) and \"message\" "
                     "(str) come together");
  if (has_error != 0)
    return 0;
  out->refused = sp__error_from_name(code_name, code_len);
  if (out->refused == SP_EINTERNAL)
    out->refused = SP_EINVAL;
  char text[REQ_MAX_REFUSAL + 1];
  snprintf(text, sizeof text, "%.*s",
           (int)(why_len < REQ_MAX_REFUSAL ? why_len : REQ_MAX_REFUSAL), why);
  sp__text_sanitize(text, out->refusal, sizeof out->refusal);
  return 0;
}

int request_parse_export(const msgpack_object *map, struct req_export *out,
                         char *msg, size_t msglen) {
  uint64_t v;
  const msgpack_object_array *groups;
  int rc;
  memset(out, 0, sizeof *out);
  if ((rc = get_uint(map, "max_keys", true, UINT32_MAX, &v, "", msg, msglen)) <
      0)
    return rc;
  out->max_keys = rc == 0 ? (uint32_t)v : 0;
  if ((rc = get_uint(map, "max_bytes", true, UINT64_MAX, &v, "", msg, msglen)) <
      0)
    return rc;
  out->max_bytes = rc == 0 ? v : 0;
  if ((rc = get_uint(map, "timeout_ms", true, REQ_MAX_TIMEOUT_MS, &v, "", msg,
                     msglen)) < 0)
    return rc;
  out->timeout_ms = rc == 0 ? (uint32_t)v : 0;
  rc = sp__msg_get_bool(map, "progress", true, &out->progress);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"progress\" must be a bool");
  if (rc == 1)
    out->progress = false;
  const msgpack_object *save;
  rc = sp__msg_get_map(map, "save", true, &save);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                    "\"save\" must be a map of the save's options");
  if (rc == 0 && (rc = parse_save(save, &out->save, msg, msglen)) < 0)
    return rc;
  rc = sp__msg_get_array(map, "groups", true, &groups);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"groups\" must be an array of arrays of keys");
  if (rc == 0)
    return parse_groups(groups, &out->groups, msg, msglen);
  return 0;
}

int request_parse_release(const msgpack_object *map, uint64_t *export_id,
                          char *msg, size_t msglen) {
  return get_uint(map, "export_id", false, UINT64_MAX, export_id, "", msg,
                  msglen);
}

/* A job id or a prefix of one: 1 to 32 hex digits, kept in lowercase. */
static int get_job_ref(const msgpack_object *map, const char *key,
                       bool optional, char out[2 * JOB_ID_BYTES + 1],
                       char *msg, size_t msglen) {
  const char *s;
  size_t len;
  int rc = sp__msg_get_str(map, key, optional, &s, &len);
  if (rc < 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"%s\" must be a string", key);
  if (rc == 1) {
    out[0] = '\0';
    return 0;
  }
  if (len == 0 || len > 2 * JOB_ID_BYTES)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "\"%s\" must be a job id of 1 to %d hex digits, not %zu "
                     "bytes",
                     key, 2 * JOB_ID_BYTES, len);
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (c >= 'A' && c <= 'F')
      c = (char)(c - 'A' + 'a');
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
      return sp__failf(msg, msglen, SP_EINVAL,
                       "\"%s\" must be a job id of hex digits; byte %zu is not "
                       "one",
                       key, i);
    out[i] = c;
  }
  out[len] = '\0';
  return 0;
}

int request_parse_job_ref(const msgpack_object *map,
                          char out[2 * JOB_ID_BYTES + 1], char *msg,
                          size_t msglen) {
  return get_job_ref(map, "job", false, out, msg, msglen);
}

int request_parse_jobs(const msgpack_object *map,
                       char after[2 * JOB_ID_BYTES + 1], char *msg,
                       size_t msglen) {
  int rc = get_job_ref(map, "after", true, after, msg, msglen);
  if (rc == 0 && after[0] != '\0' && strlen(after) != 2 * JOB_ID_BYTES)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "\"after\" must be a whole job id of %d hex digits",
                     2 * JOB_ID_BYTES);
  return rc;
}

/* ---- consumers (docs/protocol.md, "Consumers") ---- */

/* sid, shape, stride and offset of a target's view, in the key's dtype. */
static int parse_target_view(const msgpack_object *o, enum sp_dtype dtype,
                             uint32_t *sid, struct sp_view *view,
                             const char *where, char *msg, size_t msglen) {
  uint64_t v, offset;
  uint32_t nstride;
  int rc;
  if ((rc = get_uint(o, "sid", false, UINT32_MAX, &v, where, msg, msglen)) !=
          0 ||
      (rc = get_uint(o, "offset", false, REQ_MAX_VALUE, &offset, where, msg,
                     msglen)) != 0 ||
      (rc = get_dims(o, "shape", &view->ndim, view->shape, where, msg,
                     msglen)) != 0 ||
      (rc = get_dims(o, "stride", &nstride, view->stride, where, msg,
                     msglen)) != 0)
    return rc;
  if (nstride != view->ndim)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%sshape has %u dims but stride has %u", where,
                     view->ndim, nstride);
  *sid = (uint32_t)v;
  view->dtype = dtype;
  view->offset = (int64_t)offset;
  return 0;
}

static int parse_target_pieces(const msgpack_object_array *a,
                               struct req_target *t, const char *where,
                               char *msg, size_t msglen) {
  if (a->size == 0 || a->size > REQ_MAX_TARGET_PIECES)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%s%u pieces; a target has 1 to %u", where, a->size,
                     REQ_MAX_TARGET_PIECES);
  /* One block: the pieces, then their sids. */
  t->pieces = calloc(a->size, sizeof *t->pieces + sizeof *t->piece_sid);
  if (t->pieces == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  t->piece_sid = (uint32_t *)(t->pieces + a->size);
  t->t.pieces = t->pieces;
  t->t.npieces = a->size;
  for (uint32_t p = 0; p < a->size; p++) {
    char pw[96];
    uint32_t nstart;
    snprintf(pw, sizeof pw, "%spieces[%u]: ", where, p);
    const msgpack_object *o = &a->ptr[p];
    if (o->type != MSGPACK_OBJECT_MAP)
      return sp__failf(msg, msglen, SP_EBADMSG, "%snot a map", pw);
    int rc = get_dims(o, "start", &nstart, t->pieces[p].start, pw, msg,
                      msglen);
    if (rc == 0)
      rc = parse_target_view(o, t->t.dtype, &t->piece_sid[p],
                             &t->pieces[p].dst, pw, msg, msglen);
    if (rc != 0)
      return rc;
    if (nstart != t->t.ndim || t->pieces[p].dst.ndim != t->t.ndim)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "%s\"start\" and \"shape\" must have the key's %u dims",
                       pw, t->t.ndim);
  }
  return 0;
}

static int parse_target(const msgpack_object *o, uint32_t i,
                        struct req_target *t, char *msg, size_t msglen) {
  char where[64];
  const char *key, *dtype, *part;
  size_t key_len, dtype_len, part_len;
  int rc;
  snprintf(where, sizeof where, "targets[%u]: ", i);
  if (o->type != MSGPACK_OBJECT_MAP)
    return sp__failf(msg, msglen, SP_EBADMSG, "%snot a map", where);
  if (sp__msg_get_str(o, "key", false, &key, &key_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"key\" must be a string",
                     where);
  if ((rc = check_key(key, key_len, where, msg, msglen)) != 0)
    return rc;
  snprintf(where, sizeof where, "targets[%u] ('%.*s'): ", i,
           (int)(key_len < 24 ? key_len : 24), key);
  if ((t->key = strndup(key, key_len)) == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  t->t.key = t->key;
  if (sp__msg_get_str(o, "dtype", false, &dtype, &dtype_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"dtype\" must be a string",
                     where);
  if (sp__dtype_from_name(dtype, dtype_len, &t->t.dtype) != 0)
    return sp__failf(msg, msglen, SP_EDTYPE, "%sunknown dtype \"%.*s\"",
                     where, (int)(dtype_len < 32 ? dtype_len : 32), dtype);
  if ((rc = get_dims(o, "global_shape", &t->t.ndim, t->t.shape, where, msg,
                     msglen)) != 0)
    return rc;
  if (sp__msg_get_str(o, "part", false, &part, &part_len) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "%s\"part\" must be a string",
                     where);
  if (part_len == 5 && memcmp(part, "whole", 5) == 0)
    t->t.part = CONSUME_WHOLE;
  else if (part_len == 5 && memcmp(part, "shard", 5) == 0)
    t->t.part = CONSUME_SHARD;
  else if (part_len == 6 && memcmp(part, "pieces", 6) == 0)
    t->t.part = CONSUME_PIECES;
  else
    return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                     "%spart \"%.*s\" is not whole, shard or pieces", where,
                     (int)(part_len < 32 ? part_len : 32), part);
  if (t->t.part == CONSUME_PIECES) {
    const msgpack_object_array *pieces;
    if (sp__msg_get_array(o, "pieces", false, &pieces) != 0)
      return sp__failf(msg, msglen, SP_EBADMSG,
                       "%s\"pieces\" must be an array of piece maps", where);
    return parse_target_pieces(pieces, t, where, msg, msglen);
  }
  if ((rc = parse_target_view(o, t->t.dtype, &t->sid, &t->t.view, where, msg,
                              msglen)) != 0)
    return rc;
  if (t->t.part == CONSUME_SHARD) {
    uint64_t dim;
    if ((rc = get_uint(o, "dim", false, SP_MAX_DIMS - 1, &dim, where, msg,
                       msglen)) != 0)
      return rc;
    t->t.dim = (uint32_t)dim;
  }
  return 0;
}

int request_parse_targets(const msgpack_object *map, struct req_target **out,
                          size_t *n, char *msg, size_t msglen) {
  const msgpack_object_array *a;
  *out = NULL;
  *n = 0;
  if (sp__msg_get_array(map, "targets", false, &a) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"targets\" must be an array of target maps");
  if (a->size > REQ_MAX_PER_RANK)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "%u targets in one frame, more than %u", a->size,
                     REQ_MAX_PER_RANK);
  struct req_target *t = calloc(a->size > 0 ? a->size : 1, sizeof *t);
  if (t == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < a->size; i++) {
    int rc = parse_target(&a->ptr[i], i, &t[i], msg, msglen);
    if (rc != 0) {
      request_targets_free(t, a->size);
      return rc;
    }
  }
  *out = t;
  *n = a->size;
  return 0;
}

void request_targets_free(struct req_target *t, size_t n) {
  if (t == NULL)
    return;
  for (size_t i = 0; i < n; i++) {
    free(t[i].key);
    free(t[i].pieces);
  }
  free(t);
}

int request_parse_push(const msgpack_object *map, struct req_push *out,
                       char *msg, size_t msglen) {
  uint64_t v;
  int rc;
  memset(out, 0, sizeof *out);
  if ((rc = get_uint(map, "max_keys", true, UINT32_MAX, &v, "", msg, msglen)) <
      0)
    return rc;
  out->max_keys = rc == 0 ? (uint32_t)v : 0;
  if ((rc = get_uint(map, "max_bytes", true, UINT64_MAX, &v, "", msg, msglen)) <
      0)
    return rc;
  out->max_bytes = rc == 0 ? v : 0;
  if ((rc = get_uint(map, "timeout_ms", true, REQ_MAX_TIMEOUT_MS, &v, "", msg,
                     msglen)) < 0)
    return rc;
  out->timeout_ms = rc == 0 ? (uint32_t)v : 0;
  return 0;
}
