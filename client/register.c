/*
 * register.c - sp_register_storages and sp_register_tensors: a rank's
 * registrations in as many storage_add / tensor_add frames as the limits
 * need, and the table of storages that identity tensors point into.
 *
 * The daemon checks every storage and view (docs/protocol.md, "Jobs"); the
 * library refuses only what it cannot encode (negative numbers, too many
 * dims) and what would break its own table (a storage id used twice).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"
#include "client/cudart.h"
#include "proto/tensor.h"

/* Payload bytes one tensor_add frame may take: far under the 16 MiB frame
 * limit, so that a frame is never refused for its size, yet large enough
 * that a million keys take a few dozen frames.  Frames are also cut to stay
 * within the msgpack items a frame may hold (docs/protocol.md, "Limits").
 * One tensor alone larger than either budget (an affine placement of tens of
 * thousands of pieces) is refused as limit_exceeded. */
#define REGISTER_FRAME_BUDGET (4u << 20)
/* Items of the envelope around the tensors: op, id and tensors. */
#define REGISTER_ENVELOPE_ITEMS 32u


/* ---- the storage table ---- */

static size_t slot_of(uint32_t id, size_t cap) {
  /* Fibonacci hashing: ids are often small and consecutive. */
  return (size_t)(((uint64_t)id * UINT64_C(0x9E3779B97F4A7C15)) >> 32) &
         (cap - 1);
}

static void insert(struct client_storage *slots, size_t cap,
                   const struct client_storage *s) {
  size_t i = slot_of(s->id, cap);
  while (slots[i].used && slots[i].id != s->id)
    i = (i + 1) & (cap - 1);
  slots[i] = *s;
  slots[i].used = true;
}

int client_storages_reserve(struct client_storages *t, size_t n) {
  if (n > SIZE_MAX / 4 - t->count)
    return SP_ENOMEM;
  size_t want = (t->count + n) * 2;
  if (want <= t->cap)
    return 0;
  size_t cap = t->cap ? t->cap : 64;
  while (cap < want)
    cap *= 2;
  struct client_storage *slots = calloc(cap, sizeof *slots);
  if (!slots)
    return SP_ENOMEM;
  for (size_t i = 0; i < t->cap; i++)
    if (t->slots[i].used)
      insert(slots, cap, &t->slots[i]);
  free(t->slots);
  t->slots = slots;
  t->cap = cap;
  return 0;
}

void client_storages_add(struct client_storages *t,
                         const struct client_storage *s) {
  if (!client_storages_find(t, s->id))
    t->count++;
  insert(t->slots, t->cap, s);
}

const struct client_storage *client_storages_find(
    const struct client_storages *t, uint32_t id) {
  if (t->cap == 0)
    return NULL;
  for (size_t i = slot_of(id, t->cap); t->slots[i].used;
       i = (i + 1) & (t->cap - 1))
    if (t->slots[i].id == id)
      return &t->slots[i];
  return NULL;
}

void client_storages_clear(struct client_storages *t) {
  free(t->slots);
  memset(t, 0, sizeof *t);
}

/* ---- storages ---- */

static int cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

static bool needs_fd(sp_storage_kind kind) {
  return kind == SP_STORAGE_MEMFD || kind == SP_STORAGE_CUDA_FD;
}

/* Every id new to the table and to this call; every kind known, and the fd,
 * address and handle each kind needs present. */
static int check_storages(const sp_client *c, const sp_storage_desc *s,
                          size_t n) {
  uint32_t *ids = malloc(n * sizeof *ids);
  if (!ids)
    return SP_ENOMEM;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    if ((unsigned)s[i].kind > SP_STORAGE_CUDA_FD ||
        (needs_fd(s[i].kind) && s[i].fd < 0) ||
        (s[i].length > 0 && !s[i].addr) ||
        (s[i].kind == SP_STORAGE_CUDA_IPC &&
         (!s[i].handle || s[i].handle_len == 0)) ||
        client_storages_find(&c->storages, s[i].id))
      rc = SP_EINVAL;
    ids[i] = s[i].id;
  }
  if (rc == 0) {
    qsort(ids, n, sizeof *ids, cmp_u32);
    for (size_t i = 1; i < n && rc == 0; i++)
      if (ids[i] == ids[i - 1])
        rc = SP_EINVAL;
  }
  free(ids);
  return rc;
}

/* What one storage goes on the wire as: for SP_STORAGE_CUDA the IPC handle
 * and offset the runtime gives, and for every CUDA kind the GPU. */
struct wire_storage {
  const char *kind;
  const void *handle;
  size_t handle_len;
  uint64_t offset;
  uint8_t own_handle[CLIENT_CUDA_HANDLE_BYTES];
  struct client_storage rec; /* what the table keeps once accepted */
};

static int resolve_storage(sp_client *c, const sp_storage_desc *d,
                           struct wire_storage *w) {
  memset(w, 0, sizeof *w);
  w->rec.id = d->id;
  w->rec.length = d->length;
  w->rec.addr = d->addr;
  w->rec.device_index = -1;
  w->offset = d->offset;
  w->handle = d->handle;
  w->handle_len = d->handle_len;
  int rc = 0;
  switch (d->kind) {
  case SP_STORAGE_MEMFD:
    w->kind = "memfd";
    return 0;
  case SP_STORAGE_CUDA:
    w->kind = "cuda_ipc";
    w->handle = w->own_handle;
    w->handle_len = sizeof w->own_handle;
    w->offset = 0;
    /* An empty storage has no memory to name: the daemon opens nothing. */
    if (d->length == 0)
      return 0;
    rc = client_cuda_describe(c, d->addr, w->own_handle, &w->offset,
                              w->rec.device);
    break;
  case SP_STORAGE_CUDA_IPC:
  case SP_STORAGE_CUDA_FD:
    w->kind = d->kind == SP_STORAGE_CUDA_IPC ? "cuda_ipc" : "cuda_fd";
    if (d->device) {
      if (strlen(d->device) >= sizeof w->rec.device)
        return SP_EINVAL;
      snprintf(w->rec.device, sizeof w->rec.device, "%s", d->device);
    } else if (d->length > 0) {
      rc = client_cuda_device_of(c, d->addr, w->rec.device);
    }
    break;
  }
  if (rc == 0 && w->rec.device[0])
    rc = client_cuda_ordinal(c, w->rec.device, &w->rec.device_index);
  return rc;
}

/* Sends one storage_add frame for s[0..n) and records them once accepted. */
static int add_storage_frame(sp_client *c, const sp_storage_desc *s,
                             size_t n) {
  int fds[SP_FDS_MAX];
  size_t nfds = 0;
  struct wire_storage *w = malloc(n * sizeof *w);
  if (!w)
    return SP_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    int rc = resolve_storage(c, &s[i], &w[i]);
    if (rc < 0) {
      free(w);
      return rc;
    }
  }
  struct sp_msgbuf mb;
  uint64_t id = client_begin(c, &mb, "storage_add", 1);
  sp__pack_str(&mb.pk, "storages");
  msgpack_pack_array(&mb.pk, n);
  for (size_t i = 0; i < n; i++) {
    bool fd = needs_fd(s[i].kind), handle = w[i].handle_len > 0,
         device = w[i].rec.device[0] != '\0';
    msgpack_pack_map(&mb.pk, 5 + fd + handle + device);
    sp__pack_kv_u64(&mb.pk, "sid", s[i].id);
    sp__pack_kv_str(&mb.pk, "kind", w[i].kind);
    if (fd) {
      sp__pack_kv_u64(&mb.pk, "fd", nfds);
      fds[nfds++] = s[i].fd;
    }
    if (handle) {
      sp__pack_str(&mb.pk, "handle");
      sp__pack_bin(&mb.pk, w[i].handle, w[i].handle_len);
    }
    if (device)
      sp__pack_kv_str(&mb.pk, "device", w[i].rec.device);
    sp__pack_kv_u64(&mb.pk, "offset", w[i].offset);
    sp__pack_kv_u64(&mb.pk, "length", s[i].length);
    sp__pack_kv_u64(&mb.pk, "base", (uint64_t)(uintptr_t)s[i].addr);
  }
  struct client_reply reply;
  int rc = client_call_fds(c, &mb, id, "storage_add", fds, nfds, &reply);
  if (rc == 0) {
    uint64_t count;
    rc = sp__msg_get_u64(&reply.map, "count", false, &count);
    client_reply_release(&reply);
    if (rc == 0 && count != n)
      rc = SP_EBADMSG;
  }
  if (rc == 0)
    for (size_t i = 0; i < n; i++)
      client_storages_add(&c->storages, &w[i].rec);
  free(w);
  return rc < 0 ? rc : 0;
}

SP_EXPORT int sp_register_storages(sp_client *client,
                                   const sp_storage_desc *storages, size_t n) {
  if (!client || (n > 0 && !storages))
    return SP_EINVAL;
  if (n == 0)
    return 0;
  int rc = check_storages(client, storages, n);
  if (rc == 0)
    rc = client_storages_reserve(&client->storages, n);
  size_t per_frame = client->rx.limits.max_fds;
  for (size_t i = 0; i < n && rc == 0; i += per_frame)
    rc = add_storage_frame(client, storages + i,
                           n - i < per_frame ? n - i : per_frame);
  return rc;
}

/* ---- tensors ---- */

static const char *placement_name(sp_placement p) {
  switch (p) {
  case SP_PLACEMENT_SHARD0:
    return "shard0";
  case SP_PLACEMENT_REPLICATED:
    return "replicated";
  case SP_PLACEMENT_PLAIN:
    return "plain";
  case SP_PLACEMENT_EXPERT:
    return "expert";
  case SP_PLACEMENT_AFFINE:
    return "affine";
  }
  return NULL;
}

bool client_non_negative(const int64_t *v, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (v[i] < 0)
      return false;
  return true;
}

static int check_piece(const sp_piece *p) {
  if (p->ndim > SP_MAX_DIMS || !client_non_negative(p->shape, p->ndim) ||
      !client_non_negative(p->src_stride, p->ndim) ||
      !client_non_negative(p->dst_stride, p->ndim) || p->src_offset < 0 ||
      p->dst_offset < 0 || (p->nholders > 0 && !p->holders))
    return SP_EINVAL;
  return 0;
}

/* What the wire can carry; the daemon judges the rest. */
static int check_tensor(const sp_tensor_desc *t) {
  if (!t->key || !t->dtype || !placement_name(t->placement))
    return SP_EINVAL;
  size_t klen = strlen(t->key);
  if (klen == 0 || klen > CLIENT_KEY_MAX)
    return SP_EINVAL;
  if (t->ndim > SP_MAX_DIMS || t->global_ndim > SP_MAX_DIMS ||
      !client_non_negative(t->shape, t->ndim) || !client_non_negative(t->stride, t->ndim) ||
      t->offset < 0 || !client_non_negative(t->global_shape, t->global_ndim))
    return SP_EINVAL;
  if (t->placement != SP_PLACEMENT_AFFINE && t->npieces > 0)
    return SP_EINVAL;
  if (t->npieces > 0 && !t->pieces)
    return SP_EINVAL;
  for (size_t i = 0; i < t->npieces; i++)
    if (check_piece(&t->pieces[i]) < 0)
      return SP_EINVAL;
  return 0;
}

/* The msgpack items the tensor adds to a frame, as the wire check counts
 * them: its place in the tensors array, two per map pair, one per array
 * element. */
static uint64_t tensor_items(const sp_tensor_desc *t) {
  bool affine = t->placement == SP_PLACEMENT_AFFINE;
  uint64_t n = 1 + 2 * (affine ? 9u : 8u) + 2 * (uint64_t)t->ndim +
               t->global_ndim;
  if (affine) {
    n += t->npieces;
    for (size_t i = 0; i < t->npieces; i++)
      n += 2 * 6 + 3 * (uint64_t)t->pieces[i].ndim + t->pieces[i].nholders;
  }
  return n;
}

static void piece_wire(const void *pieces, size_t i,
                       struct sp_piece_wire *out) {
  const sp_piece *p = &((const sp_piece *)pieces)[i];
  *out = (struct sp_piece_wire){.ndim = p->ndim,
                                .shape = p->shape,
                                .src_stride = p->src_stride,
                                .dst_stride = p->dst_stride,
                                .src_offset = p->src_offset,
                                .dst_offset = p->dst_offset,
                                .nholders = p->nholders,
                                .holders = p->holders};
}

static void pack_tensor(msgpack_packer *pk, const sp_tensor_desc *t) {
  sp__tensor_pack(pk, &(struct sp_tensor_wire){
                          .key = t->key,
                          .sid = t->storage,
                          .dtype = t->dtype,
                          .ndim = t->ndim,
                          .shape = t->shape,
                          .stride = t->stride,
                          .offset = t->offset,
                          .placement = placement_name(t->placement),
                          .global_ndim = t->global_ndim,
                          .global_shape = t->global_shape,
                          .affine = t->placement == SP_PLACEMENT_AFFINE,
                          .npieces = t->npieces,
                          .piece = piece_wire,
                          .pieces = t->pieces});
}

/* A buffer that remembers a failed allocation: msgpack's packer drops the
 * write callback's result. */
struct packbuf {
  msgpack_sbuffer sb;
  bool failed;
};

static int packbuf_write(void *data, const char *buf, size_t len) {
  struct packbuf *b = data;
  if (msgpack_sbuffer_write(&b->sb, buf, len) != 0)
    b->failed = true;
  return 0;
}

/* Sends one frame of b->op whose array holds the count items already
 * packed in body. */
static int add_batch_frame(sp_client *c, const struct client_batch *b,
                           const msgpack_sbuffer *body, size_t count) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(c, &mb, b->op, 1);
  sp__pack_str(&mb.pk, b->field);
  msgpack_pack_array(&mb.pk, count);
  if (msgpack_sbuffer_write(&mb.sbuf, body->data, body->size) != 0) {
    sp__msgbuf_discard(&mb);
    return SP_ENOMEM;
  }
  struct client_reply reply;
  int rc = client_call(c, &mb, id, b->op, &reply);
  if (rc < 0)
    return rc;
  uint64_t got;
  rc = sp__msg_get_u64(&reply.map, "count", false, &got);
  client_reply_release(&reply);
  if (rc == 0 && got != count)
    rc = SP_EBADMSG;
  return rc;
}

int client_send_batched(sp_client *client, const struct client_batch *b) {
  /* Each item is packed alone first, so that its size is known before it
   * joins the frame being filled. */
  struct packbuf body = {0}, one = {0};
  msgpack_sbuffer_init(&body.sb);
  msgpack_sbuffer_init(&one.sb);
  msgpack_packer pk;
  msgpack_packer_init(&pk, &one, packbuf_write);
  uint64_t item_budget =
      2 * (uint64_t)client->rx.limits.max_items - REGISTER_ENVELOPE_ITEMS;
  size_t count = 0;
  uint64_t items = 0;
  int rc = 0;
  for (size_t i = 0; i < b->n && rc == 0; i++) {
    msgpack_sbuffer_clear(&one.sb);
    b->pack(&pk, b->arg, i);
    uint64_t it = b->items(b->arg, i);
    if (one.failed) {
      rc = SP_ENOMEM;
    } else if (one.sb.size > REGISTER_FRAME_BUDGET || it > item_budget) {
      rc = SP_ELIMIT;
    } else {
      if (body.sb.size + one.sb.size > REGISTER_FRAME_BUDGET ||
          items + it > item_budget || count == client->rx.limits.max_items) {
        rc = add_batch_frame(client, b, &body.sb, count);
        msgpack_sbuffer_clear(&body.sb);
        count = 0;
        items = 0;
      }
      if (rc == 0) {
        packbuf_write(&body, one.sb.data, one.sb.size);
        rc = body.failed ? SP_ENOMEM : 0;
        count++;
        items += it;
      }
    }
  }
  if (rc == 0 && count > 0)
    rc = add_batch_frame(client, b, &body.sb, count);
  msgpack_sbuffer_destroy(&body.sb);
  msgpack_sbuffer_destroy(&one.sb);
  return rc;
}

static void pack_tensor_at(msgpack_packer *pk, const void *arg, size_t i) {
  pack_tensor(pk, &((const sp_tensor_desc *)arg)[i]);
}

static uint64_t tensor_items_at(const void *arg, size_t i) {
  return tensor_items(&((const sp_tensor_desc *)arg)[i]);
}

SP_EXPORT int sp_register_tensors(sp_client *client,
                                  const sp_tensor_desc *tensors, size_t n) {
  if (!client || (n > 0 && !tensors))
    return SP_EINVAL;
  for (size_t i = 0; i < n; i++)
    if (check_tensor(&tensors[i]) < 0)
      return SP_EINVAL;
  return client_send_batched(
      client, &(struct client_batch){.op = "tensor_add",
                                     .field = "tensors",
                                     .n = n,
                                     .pack = pack_tensor_at,
                                     .items = tensor_items_at,
                                     .arg = tensors});
}
