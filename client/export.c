/*
 * export.c - sp_export and sp_release: ask for an export, follow its
 * progress, receive the rank's owned tensors and hand them to the caller as
 * pointers; give them back.
 *
 * The reply is read as the daemon's word, not trusted: every segment is
 * mapped once, its length taken from the file itself, which must be sealed
 * against shrinking; every identity
 * tensor must name a storage this rank registered, and every tensor's view
 * must lie inside the bytes it points into (sp__view_check) before a pointer
 * is formed.  A reply that breaks any of this fails the export with
 * SP_EBADMSG, its reason in sp_last_message, and the export is released.
 *
 * A rank on a GPU gets its segment as an IPC handle (cuda_segments in part
 * 0) instead of a descriptor: it is opened once, on this process's ordinal
 * of the GPU the daemon names by UUID, its allocation's extent checked,
 * and the daemon's completion event waited on before any pointer is handed
 * out (client/cudart.c).
 */
#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/client.h"
#include "client/cudart.h"
#include "proto/view.h"

/* Bounds on what one reply may declare, from docs/protocol.md: at most
 * 1,048,576 keys per rank, keys of at most 1,024 bytes. */
#define EXPORT_TENSORS_MAX (1u << 20)
#define EXPORT_KEY_MAX 1024
#define EXPORT_PARTS_MAX (1u << 20)
#define EXPORT_SEGMENTS_MAX (1u << 20)
/* The longest timeout_ms the protocol allows, which bounds the daemon's own
 * export_timeout: what the library allows the daemon when the caller names
 * no timeout. */
#define EXPORT_TIMEOUT_MAX_MS UINT64_C(86400000)
/* Shape and stride entries are below 2^62 on the wire. */
#define EXPORT_DIM_MAX (INT64_C(1) << 62)

struct segment {
  void *base; /* NULL for an empty segment */
  size_t len;
  bool cuda;  /* an opened IPC handle: base is a device address */
  int device_index;
  char device[CLIENT_CUDA_DEVICE_MAX]; /* "cpu" or "cuda:<GPU UUID>" */
};

struct client_export {
  sp_owned_set set; /* first: the caller holds a pointer to it */
  sp_client *client; /* NULL once detached: the daemon released it */
  struct client_export *next;
  struct segment *segments;
  size_t nsegments;
  size_t cap_tensors;
  /* A save: the checkpoint's file count and each tensor's file, in the
   * set's order (client/save.c). */
  bool save;
  uint32_t nfiles;
  uint64_t total_size;
  uint32_t *file;
};

/* The reply being assembled. */
struct export_rx {
  sp_client *c;
  struct client_export *e;
  bool have_id;
  uint64_t parts;     /* from part 0 */
  uint64_t next_part; /* the part expected next */
};

/* Records why the library refused the daemon's reply, for sp_last_message. */
__attribute__((format(printf, 2, 3))) static int refuse(sp_client *c,
                                                        const char *fmt, ...) {
  int n = snprintf(c->message, sizeof c->message, "bad export reply: ");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->message + n, sizeof c->message - (size_t)n, fmt, ap);
  va_end(ap);
  return SP_EBADMSG;
}

static void unmap_segments(struct client_export *e) {
  for (size_t i = 0; i < e->nsegments; i++) {
    if (!e->segments[i].base)
      continue;
    if (e->segments[i].cuda)
      client_cuda_close(e->segments[i].base);
    else
      munmap(e->segments[i].base, e->segments[i].len);
  }
  free(e->segments);
  e->segments = NULL;
  e->nsegments = 0;
}

static void free_export(struct client_export *e) {
  unmap_segments(e);
  free(e->file);
  for (size_t i = 0; i < e->set.ntensors; i++) {
    free((char *)(uintptr_t)e->set.tensors[i].key);
    free((char *)(uintptr_t)e->set.tensors[i].device);
  }
  free(e->set.tensors);
  free(e);
}

static void unlink_export(struct client_export *e) {
  for (struct client_export **p = &e->client->exports; *p; p = &(*p)->next)
    if (*p == e) {
      *p = e->next;
      break;
    }
  e->next = NULL;
}

void client_exports_detach(sp_client *c) {
  while (c->exports) {
    struct client_export *e = c->exports;
    c->exports = e->next;
    e->next = NULL;
    e->client = NULL;
    unmap_segments(e);
    /* A pointer used after this fails at once instead of reading memory
     * the daemon may have given to another export. */
    for (size_t i = 0; i < e->set.ntensors; i++)
      e->set.tensors[i].data = NULL;
  }
}

/* ---- the request ---- */

static int check_opts(const sp_export_opts *o) {
  if (o->ngroups > 0 && !o->groups)
    return SP_EINVAL;
  for (size_t i = 0; i < o->ngroups; i++) {
    if (o->groups[i].nkeys == 0 || !o->groups[i].keys)
      return SP_EINVAL;
    for (size_t k = 0; k < o->groups[i].nkeys; k++)
      if (!o->groups[i].keys[k])
        return SP_EINVAL;
  }
  return 0;
}

/* Progress frames are always asked for: besides feeding the callback, each
 * one shows the export is alive, and the wait for the next frame starts
 * again from it. */
static uint64_t begin_request(sp_client *c, struct sp_msgbuf *mb,
                              const sp_export_opts *o,
                              const struct client_save_ask *save) {
  uint32_t n = 1 + (o->ngroups > 0) + (o->max_keys > 0) + (o->max_bytes > 0) +
               (o->timeout_ms > 0) + (save != NULL);
  uint64_t id = client_begin(c, mb, "export", n);
  msgpack_packer *pk = &mb->pk;
  sp__pack_kv_bool(pk, "progress", true);
  if (save != NULL) {
    sp__pack_str(pk, "save");
    msgpack_pack_map(pk, save->refused < 0 ? 6 : 4);
    sp__pack_kv_u64(pk, "max_shard_bytes", save->limit);
    sp__pack_kv_bool(pk, "overwrite", save->overwrite);
    sp__pack_kv_u64(pk, "directory", save->directory);
    sp__pack_kv_u64(pk, "metadata", save->metadata);
    if (save->refused < 0) {
      sp__pack_kv_str(pk, "error", sp_err_name(save->refused));
      sp__pack_kv_str(pk, "message", save->refusal);
    }
  }
  if (o->ngroups > 0) {
    sp__pack_str(pk, "groups");
    msgpack_pack_array(pk, o->ngroups);
    for (size_t i = 0; i < o->ngroups; i++) {
      msgpack_pack_array(pk, o->groups[i].nkeys);
      for (size_t k = 0; k < o->groups[i].nkeys; k++)
        sp__pack_str(pk, o->groups[i].keys[k]);
    }
  }
  if (o->max_keys > 0)
    sp__pack_kv_u64(pk, "max_keys", o->max_keys);
  if (o->max_bytes > 0)
    sp__pack_kv_u64(pk, "max_bytes", o->max_bytes);
  if (o->timeout_ms > 0)
    sp__pack_kv_u64(pk, "timeout_ms", o->timeout_ms);
  return id;
}

/* ---- progress frames ---- */

static int get_u32(const msgpack_object *map, const char *key, uint32_t *out) {
  uint64_t v;
  int rc = sp__msg_get_u64(map, key, false, &v);
  if (rc == 0 && v > UINT32_MAX)
    rc = SP_EBADMSG;
  if (rc == 0)
    *out = (uint32_t)v;
  return rc;
}

static int on_progress(sp_client *c, const msgpack_object *map,
                       const sp_export_opts *o) {
  char phase[SP_OP_MAX + 1];
  sp_progress p = {.phase = phase};
  int rc = sp__msg_get_strbuf(map, "phase", false, phase, sizeof phase);
  if (rc == 0)
    rc = get_u32(map, "round", &p.round);
  if (rc == 0)
    rc = get_u32(map, "rounds", &p.rounds);
  if (rc == 0)
    rc = sp__msg_get_u64(map, "bytes_moved", false, &p.bytes_moved);
  if (rc == 0)
    rc = sp__msg_get_u64(map, "bytes_total", false, &p.bytes_total);
  if (rc < 0)
    return refuse(c, "a progress frame lacks a field or has a bad one");
  if (o->progress)
    o->progress(&p, o->progress_arg);
  return 0;
}

/* ---- reply parts ---- */

/* Maps each descriptor of the frame once, read-write and shared: the owned
 * tensors are the rank's to use.  A segment must be a memfd sealed against
 * shrinking (docs/protocol.md, "export"), so that its length, read here
 * once, stays true.  The descriptors are closed once mapped. */
static int take_segments(struct export_rx *rx, struct sp_frame *frame,
                         uint64_t count) {
  struct client_export *e = rx->e;
  if (count != frame->nfds)
    return refuse(rx->c, "part %llu announces %llu segments but carries %zu "
                  "descriptors", (unsigned long long)rx->next_part,
                  (unsigned long long)count, frame->nfds);
  if (count == 0)
    return 0;
  if (e->nsegments + count > EXPORT_SEGMENTS_MAX)
    return refuse(rx->c, "too many segments");
  struct segment *s =
      realloc(e->segments, (e->nsegments + count) * sizeof *s);
  if (!s)
    return SP_ENOMEM;
  e->segments = s;
  for (size_t i = 0; i < count; i++) {
    int fd = frame->fds[i];
    frame->fds[i] = -1;
    struct stat st;
    struct segment seg = {NULL, 0, false, -1, "cpu"};
    int rc = 0;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
        (uint64_t)st.st_size > SIZE_MAX) {
      rc = refuse(rx->c, "segment %zu is not a memory file", e->nsegments);
    } else if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
      /* A segment that could shrink under the mapping would turn the
       * rank's next read of it into SIGBUS. */
      rc = refuse(rx->c, "segment %zu is not sealed against shrinking",
                  e->nsegments);
    } else {
      seg.len = (size_t)st.st_size;
      if (seg.len > 0) {
        seg.base = mmap(NULL, seg.len, PROT_READ | PROT_WRITE, MAP_SHARED,
                        fd, 0);
        if (seg.base == MAP_FAILED) {
          seg.base = NULL;
          rc = errno == ENOMEM
                   ? SP_ENOMEM
                   : refuse(rx->c, "segment %zu cannot be mapped read-write",
                            e->nsegments);
        }
      }
      if (rc == 0)
        e->segments[e->nsegments++] = seg;
    }
    close(fd);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* Opens each device segment of part 0 once: {"device", "handle", "event",
 * "size"} per segment, no descriptors. */
static int take_cuda_segments(struct export_rx *rx, struct sp_frame *frame,
                              const msgpack_object_array *list,
                              uint64_t count) {
  struct client_export *e = rx->e;
  if (list->size != count || frame->nfds != 0)
    return refuse(rx->c, "part 0 announces %llu segments but lists %u "
                  "device segments and carries %zu descriptors",
                  (unsigned long long)count, list->size, frame->nfds);
  if (count == 0)
    return 0;
  if (e->nsegments + count > EXPORT_SEGMENTS_MAX)
    return refuse(rx->c, "too many segments");
  struct segment *s =
      realloc(e->segments, (e->nsegments + count) * sizeof *s);
  if (!s)
    return SP_ENOMEM;
  e->segments = s;
  for (uint32_t i = 0; i < list->size; i++) {
    const msgpack_object *o = &list->ptr[i];
    struct segment seg = {NULL, 0, true, -1, ""};
    const uint8_t *handle, *event;
    size_t handle_len, event_len;
    uint64_t size;
    if (o->type != MSGPACK_OBJECT_MAP ||
        sp__msg_get_strbuf(o, "device", false, seg.device, sizeof seg.device) !=
            0 ||
        sp__msg_get_bin(o, "handle", false, &handle, &handle_len) != 0 ||
        sp__msg_get_bin(o, "event", false, &event, &event_len) != 0 ||
        sp__msg_get_u64(o, "size", false, &size) != 0 ||
        handle_len != CLIENT_CUDA_HANDLE_BYTES ||
        event_len != CLIENT_CUDA_HANDLE_BYTES || size == 0 || size > SIZE_MAX)
      return refuse(rx->c, "device segment %u is not a device, a 64-byte "
                    "handle and event and a size", i);
    int rc = client_cuda_ordinal(rx->c, seg.device, &seg.device_index);
    if (rc == 0)
      rc = client_cuda_open(rx->c, seg.device_index, handle, event, size,
                            &seg.base);
    if (rc < 0)
      return rc;
    seg.len = (size_t)size;
    e->segments[e->nsegments++] = seg;
  }
  return 0;
}

/* An array of at most SP_MAX_DIMS entries, each below 2^62. */
static int get_dims(const msgpack_object *map, const char *key,
                    uint32_t *ndim, int64_t *out) {
  const msgpack_object_array *a;
  int rc = sp__msg_get_array(map, key, false, &a);
  if (rc < 0 || a->size > SP_MAX_DIMS)
    return SP_EBADMSG;
  for (uint32_t i = 0; i < a->size; i++) {
    if (a->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        a->ptr[i].via.u64 >= (uint64_t)EXPORT_DIM_MAX)
      return SP_EBADMSG;
    out[i] = (int64_t)a->ptr[i].via.u64;
  }
  *ndim = a->size;
  return 0;
}

/* The bytes a tensor points into: a segment of this export, or (identity)
 * a storage this rank registered. */
static int region_of(struct export_rx *rx, const msgpack_object *o,
                     const char *key, struct segment *region, int *identity) {
  uint64_t segment, sid;
  int has_segment = sp__msg_get_u64(o, "segment", true, &segment);
  int has_sid = sp__msg_get_u64(o, "sid", true, &sid);
  if (has_segment < 0 || has_sid < 0 || (has_segment == 0) == (has_sid == 0))
    return refuse(rx->c, "tensor \"%s\" needs exactly one of segment and sid",
                  key);
  if (has_segment == 0) {
    if (segment >= rx->e->nsegments)
      return refuse(rx->c, "tensor \"%s\" names segment %llu of %zu", key,
                    (unsigned long long)segment, rx->e->nsegments);
    *region = rx->e->segments[segment];
    *identity = 0;
    return 0;
  }
  const struct client_storage *s =
      sid <= UINT32_MAX ? client_storages_find(&rx->c->storages, (uint32_t)sid)
                        : NULL;
  if (!s)
    return refuse(rx->c, "tensor \"%s\" names storage %llu, which this rank "
                  "did not register", key, (unsigned long long)sid);
  region->base = (void *)(uintptr_t)s->addr;
  region->len = s->length;
  region->cuda = s->device[0] != '\0';
  region->device_index = s->device_index;
  snprintf(region->device, sizeof region->device, "%s",
           region->cuda ? s->device : "cpu");
  *identity = 1;
  return 0;
}

static int parse_tensor(struct export_rx *rx, const msgpack_object *o,
                        sp_owned_tensor *t) {
  if (o->type != MSGPACK_OBJECT_MAP)
    return refuse(rx->c, "a tensor is not a map");
  char key[EXPORT_KEY_MAX + 1];
  if (sp__msg_get_strbuf(o, "key", false, key, sizeof key) != 0 || !key[0])
    return refuse(rx->c, "a tensor has no usable key");
  const char *dname;
  size_t dlen;
  struct sp_view v = {.offset = 0};
  if (sp__msg_get_str(o, "dtype", false, &dname, &dlen) != 0 ||
      sp__dtype_from_name(dname, dlen, &v.dtype) != 0)
    return refuse(rx->c, "tensor \"%s\" has no known dtype", key);
  uint32_t nstride;
  if (get_dims(o, "shape", &v.ndim, v.shape) < 0 ||
      get_dims(o, "stride", &nstride, v.stride) < 0 || nstride != v.ndim)
    return refuse(rx->c, "tensor \"%s\" has a bad shape or stride", key);
  uint64_t byte_offset;
  if (sp__msg_get_u64(o, "byte_offset", false, &byte_offset) != 0)
    return refuse(rx->c, "tensor \"%s\" has no byte_offset", key);
  struct segment region = {NULL, 0, false, -1, "cpu"};
  int rc = region_of(rx, o, key, &region, &t->identity);
  if (rc < 0)
    return rc;

  /* The view, from the tensor's first byte, must fit in what is left of
   * its region: nothing the caller reads through data lies outside.  An
   * empty view reads nothing, so it may start anywhere (PyTorch leaves an
   * empty slice's offset past its storage's end, and a rank's own view
   * comes back as it registered it), as long as its address does not
   * wrap. */
  char why[256];
  uint64_t numel = 0;
  bool empty = sp__view_numel(v.ndim, v.shape, &numel) == 0 && numel == 0;
  if (empty && byte_offset > (uint64_t)INT64_MAX)
    return refuse(rx->c, "empty tensor \"%s\" starts at byte %llu, past "
                  "what an address holds", key,
                  (unsigned long long)byte_offset);
  if (!empty && byte_offset > region.len)
    return refuse(rx->c, "tensor \"%s\" starts past the end of its %s", key,
                  t->identity ? "storage" : "segment");
  uint64_t room = byte_offset <= region.len ? region.len - byte_offset : 0;
  if (sp__view_check(&v, room, why, sizeof why) != 0)
    return refuse(rx->c, "tensor \"%s\": %s", key, why);

  t->key = strdup(key);
  if (!t->key)
    return SP_ENOMEM;
  t->dtype = sp__dtype_name(v.dtype);
  t->ndim = v.ndim;
  memcpy(t->shape, v.shape, sizeof t->shape);
  memcpy(t->stride, v.stride, sizeof t->stride);
  t->data = region.base ? (void *)((uintptr_t)region.base + byte_offset)
                        : NULL;
  t->device_index = region.device_index;
  t->device = strdup(region.device);
  if (!t->device) {
    free((char *)(uintptr_t)t->key);
    t->key = NULL;
    return SP_ENOMEM;
  }
  return 0;
}

static int on_part(struct export_rx *rx, struct client_reply *reply) {
  const msgpack_object *map = &reply->map;
  struct client_export *e = rx->e;
  uint64_t export_id, part, parts, segments = 0;
  const msgpack_object_array *tensors;
  const msgpack_object_array *cuda_segments = NULL;
  if (sp__msg_get_u64(map, "export_id", false, &export_id) != 0 ||
      sp__msg_get_u64(map, "part", false, &part) != 0 ||
      sp__msg_get_u64(map, "parts", false, &parts) != 0 ||
      sp__msg_get_array(map, "tensors", false, &tensors) != 0 ||
      sp__msg_get_u64(map, "segments", part > 0, &segments) < 0 ||
      sp__msg_get_array(map, "cuda_segments", true, &cuda_segments) < 0)
    return refuse(rx->c, "a part lacks a field or has a bad one");
  if (part != rx->next_part || parts == 0 || parts > EXPORT_PARTS_MAX ||
      (rx->have_id && (export_id != e->set.export_id || parts != rx->parts)))
    return refuse(rx->c, "part %llu of %llu of export %llu does not follow "
                  "part %llu", (unsigned long long)part,
                  (unsigned long long)parts, (unsigned long long)export_id,
                  (unsigned long long)rx->next_part);
  if (!rx->have_id) {
    rx->have_id = true;
    e->set.export_id = export_id;
    rx->parts = parts;
    if (e->save) {
      uint64_t files;
      if (sp__msg_get_u64(map, "files", false, &files) != 0 ||
          files > UINT32_MAX ||
          sp__msg_get_u64(map, "total_size", false, &e->total_size) != 0)
        return refuse(rx->c, "a save's part 0 does not say how many files "
                      "and bytes the checkpoint has");
      e->nfiles = (uint32_t)files;
    }
  }
  if (part > 0 && cuda_segments)
    return refuse(rx->c, "part %llu lists device segments",
                  (unsigned long long)part);
  int rc = cuda_segments
               ? take_cuda_segments(rx, &reply->frame, cuda_segments, segments)
               : take_segments(rx, &reply->frame, segments);
  if (rc < 0)
    return rc;

  size_t n = e->set.ntensors;
  if (tensors->size > EXPORT_TENSORS_MAX - n)
    return refuse(rx->c, "more than %u tensors", EXPORT_TENSORS_MAX);
  if (n + tensors->size > e->cap_tensors) {
    size_t cap = e->cap_tensors ? e->cap_tensors : 64;
    while (cap < n + tensors->size)
      cap *= 2;
    sp_owned_tensor *t = realloc(e->set.tensors, cap * sizeof *t);
    if (!t)
      return SP_ENOMEM;
    e->set.tensors = t;
    if (e->save) {
      uint32_t *f = realloc(e->file, cap * sizeof *f);
      if (!f)
        return SP_ENOMEM;
      e->file = f;
    }
    e->cap_tensors = cap;
  }
  for (uint32_t i = 0; i < tensors->size; i++) {
    sp_owned_tensor *t = &e->set.tensors[e->set.ntensors];
    memset(t, 0, sizeof *t);
    rc = parse_tensor(rx, &tensors->ptr[i], t);
    if (rc < 0)
      return rc;
    e->set.ntensors++;
    if (e->save) {
      uint64_t file;
      if (sp__msg_get_u64(&tensors->ptr[i], "file", false, &file) != 0 ||
          file >= e->nfiles)
        return refuse(rx->c, "tensor \"%s\" of a save names no file of the "
                      "checkpoint's %" PRIu32, t->key, e->nfiles);
      e->file[e->set.ntensors - 1] = (uint32_t)file;
    }
  }
  rx->next_part++;
  return 0;
}

/* A tensor and its file, sorted together. */
struct sorted_tensor {
  sp_owned_tensor t;
  uint32_t file;
};

static int cmp_key(const void *a, const void *b) {
  return strcmp(((const struct sorted_tensor *)a)->t.key,
                ((const struct sorted_tensor *)b)->t.key);
}

/* Sorts the set by key (a save's files with their tensors); a key listed
 * twice is the daemon's mistake. */
static int finish_set(struct export_rx *rx) {
  struct client_export *e = rx->e;
  sp_owned_set *s = &e->set;
  if (s->ntensors > 1) {
    struct sorted_tensor *all = malloc(s->ntensors * sizeof *all);
    if (!all)
      return SP_ENOMEM;
    for (size_t i = 0; i < s->ntensors; i++)
      all[i] = (struct sorted_tensor){s->tensors[i], e->save ? e->file[i] : 0};
    qsort(all, s->ntensors, sizeof *all, cmp_key);
    for (size_t i = 0; i < s->ntensors; i++) {
      s->tensors[i] = all[i].t;
      if (e->save)
        e->file[i] = all[i].file;
    }
    free(all);
  }
  for (size_t i = 1; i < s->ntensors; i++)
    if (strcmp(s->tensors[i].key, s->tensors[i - 1].key) == 0)
      return refuse(rx->c, "tensor \"%s\" is listed twice", s->tensors[i].key);
  return 0;
}

/* Reads frames until the last part, an error reply or a failure. */
static int receive(struct export_rx *rx, uint64_t id, uint64_t wait_ms,
                   const sp_export_opts *o) {
  for (;;) {
    struct client_reply reply;
    struct sp_msg_head head;
    int rc = client_next(rx->c, id, wait_ms, &reply, &head);
    if (rc < 0)
      return rc;
    if (strcmp(head.op, "progress") == 0)
      rc = reply.frame.nfds > 0
               ? refuse(rx->c, "a progress frame carries descriptors")
               : on_progress(rx->c, &reply.map, o);
    else if (strcmp(head.op, "export") == 0)
      rc = on_part(rx, &reply);
    else
      rc = refuse(rx->c, "unexpected \"%s\" frame", head.op);
    client_reply_release(&reply);
    if (rc < 0)
      return rc;
    if (rx->have_id && rx->next_part == rx->parts)
      return finish_set(rx);
  }
}

static int send_release(sp_client *c, uint64_t export_id) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(c, &mb, "release", 1);
  sp__pack_kv_u64(&mb.pk, "export_id", export_id);
  struct client_reply reply;
  int rc = client_call(c, &mb, id, "release", &reply);
  if (rc == 0)
    client_reply_release(&reply);
  return rc;
}

int client_export_run(sp_client *client, const sp_export_opts *opts,
                      const struct client_save_ask *save,
                      sp_owned_set **out, uint64_t *request_id) {
  static const sp_export_opts defaults;
  if (!opts)
    opts = &defaults;
  if (!client || !out || check_opts(opts) < 0)
    return SP_EINVAL;
  struct client_export *e = calloc(1, sizeof *e);
  if (!e)
    return SP_ENOMEM;
  e->save = save != NULL;
  struct export_rx rx = {.c = client, .e = e};

  struct sp_msgbuf mb;
  uint64_t id = begin_request(client, &mb, opts, save);
  if (request_id)
    *request_id = id;
  int rc = client_start(client, &mb, id);
  if (rc == 0) {
    /* The daemon waits up to timeout_ms for the other ranks and for
     * progress, and then answers timeout; the library waits that long plus
     * its own timeout for each frame.  With no timeout_ms the daemon's
     * export_timeout applies, which the library cannot know: it allows the
     * longest the protocol permits, so that the daemon's answer, not a
     * guess, ends the wait (a daemon that dies closes the socket). */
    uint64_t daemon_ms =
        opts->timeout_ms ? opts->timeout_ms : EXPORT_TIMEOUT_MAX_MS;
    uint64_t wait_ms =
        client->timeout_ms == 0 ? 0 : client->timeout_ms + daemon_ms;
    rc = receive(&rx, id, wait_ms, opts);
  }
  if (rc < 0) {
    uint64_t export_id = e->set.export_id;
    free_export(e);
    if (rx.have_id && !client->broken) {
      /* The daemon published what the library refused: give it back, and
       * keep the reason of the failure for sp_last_message. */
      char why[sizeof client->message];
      memcpy(why, client->message, sizeof why);
      send_release(client, export_id);
      memcpy(client->message, why, sizeof why);
    }
    return rc;
  }
  e->client = client;
  e->next = client->exports;
  client->exports = e;
  *out = &e->set;
  return 0;
}

SP_EXPORT int sp_export(sp_client *client, const sp_export_opts *opts,
                        sp_owned_set **out) {
  return client_export_run(client, opts, NULL, out, NULL);
}

uint32_t client_export_files(const sp_owned_set *set, const uint32_t **file,
                             uint64_t *total_size) {
  const struct client_export *e = (const struct client_export *)set;
  *file = e->file;
  *total_size = e->total_size;
  return e->nfiles;
}

SP_EXPORT int sp_release(sp_client *client, sp_owned_set *set) {
  if (!set)
    return 0;
  struct client_export *e = (struct client_export *)set;
  /* A detached set belongs to no connection any more (its client may be
   * closed and freed): only its memory is left to free. */
  if (!e->client) {
    free_export(e);
    return 0;
  }
  if (client != e->client)
    return SP_EINVAL;
  unlink_export(e);
  /* Unmapped before the daemon is told, so that no byte of the segments is
   * reachable here once the daemon may reuse them. */
  unmap_segments(e);
  int rc = send_release(client, set->export_id);
  free_export(e);
  return rc;
}
