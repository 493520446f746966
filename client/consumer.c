/*
 * consumer.c - the consumer's side of a job: sp_consumer_join and
 * sp_register_targets (docs/protocol.md, "Consumers").
 *
 * As for ranks, the daemon judges everything about a consumer's state and
 * its targets; the library refuses only what it cannot encode.  A
 * consumer's buffers are registered with sp_register_storages, whose table
 * serves a consumer as it serves a rank.
 */
#include <string.h>

#include "client/client.h"

SP_EXPORT int sp_consumer_join(sp_client *client, const sp_ticket *ticket,
                               uint32_t index, uint32_t nconsumers,
                               const char *device) {
  if (!client || !ticket || ticket->len == 0 || ticket->len > SP_TICKET_MAX ||
      !device)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "consumer_join", 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket->bytes, ticket->len);
  sp__pack_kv_u64(&mb.pk, "consumer", index);
  sp__pack_kv_u64(&mb.pk, "consumers", nconsumers);
  sp__pack_kv_str(&mb.pk, "device", device);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "consumer_join", &reply);
  if (rc < 0)
    return rc;
  client_reply_release(&reply);
  client->joined = true;
  client->consumer = true;
  client->rank = index;
  return 0;
}

static const char *part_name(sp_target_part part) {
  switch (part) {
  case SP_TARGET_WHOLE:
    return "whole";
  case SP_TARGET_SHARD:
    return "shard";
  case SP_TARGET_PIECES:
    return "pieces";
  }
  return NULL;
}

static bool check_piece(const sp_target_piece *p, uint32_t ndim) {
  return client_non_negative(p->start, ndim) &&
         client_non_negative(p->shape, ndim) &&
         client_non_negative(p->stride, ndim) && p->offset >= 0;
}

/* What the wire can carry; the daemon and the planner judge the rest. */
static bool check_target(const sp_target_desc *t) {
  if (!t->key || !t->dtype || !part_name(t->part) || t->ndim > SP_MAX_DIMS)
    return false;
  size_t klen = strlen(t->key);
  if (klen == 0 || klen > CLIENT_KEY_MAX ||
      !client_non_negative(t->global_shape, t->ndim))
    return false;
  if (t->part != SP_TARGET_PIECES)
    return t->npieces == 0 && client_non_negative(t->shape, t->ndim) &&
           client_non_negative(t->stride, t->ndim) && t->offset >= 0 &&
           (t->part != SP_TARGET_SHARD || t->dim < t->ndim);
  if (t->npieces == 0 || !t->pieces)
    return false;
  for (size_t i = 0; i < t->npieces; i++)
    if (!check_piece(&t->pieces[i], t->ndim))
      return false;
  return true;
}

static void pack_dims(msgpack_packer *pk, const char *key, const int64_t *v,
                      uint32_t n) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, n);
  for (uint32_t i = 0; i < n; i++)
    msgpack_pack_uint64(pk, (uint64_t)v[i]);
}

/* sid, shape, stride, offset: a view as tensor_add spells it. */
static void pack_view(msgpack_packer *pk, uint32_t sid, const int64_t *shape,
                      const int64_t *stride, int64_t offset, uint32_t ndim) {
  sp__pack_kv_u64(pk, "sid", sid);
  pack_dims(pk, "shape", shape, ndim);
  pack_dims(pk, "stride", stride, ndim);
  sp__pack_kv_u64(pk, "offset", (uint64_t)offset);
}

static void pack_target(msgpack_packer *pk, const void *arg, size_t i) {
  const sp_target_desc *t = &((const sp_target_desc *)arg)[i];
  bool pieces = t->part == SP_TARGET_PIECES;
  bool shard = t->part == SP_TARGET_SHARD;
  msgpack_pack_map(pk, pieces ? 5 : shard ? 9 : 8);
  sp__pack_kv_str(pk, "key", t->key);
  sp__pack_kv_str(pk, "dtype", t->dtype);
  pack_dims(pk, "global_shape", t->global_shape, t->ndim);
  sp__pack_kv_str(pk, "part", part_name(t->part));
  if (!pieces) {
    pack_view(pk, t->storage, t->shape, t->stride, t->offset, t->ndim);
    if (shard)
      sp__pack_kv_u64(pk, "dim", t->dim);
    return;
  }
  sp__pack_str(pk, "pieces");
  msgpack_pack_array(pk, t->npieces);
  for (size_t p = 0; p < t->npieces; p++) {
    const sp_target_piece *pc = &t->pieces[p];
    msgpack_pack_map(pk, 5);
    pack_dims(pk, "start", pc->start, t->ndim);
    pack_view(pk, pc->storage, pc->shape, pc->stride, pc->offset, t->ndim);
  }
}

/* Its place in the array, two per map pair, one per dim of each array. */
static uint64_t target_items(const void *arg, size_t i) {
  const sp_target_desc *t = &((const sp_target_desc *)arg)[i];
  if (t->part != SP_TARGET_PIECES)
    return 1 + 2 * 9 + 3 * (uint64_t)t->ndim;
  return 1 + 2 * 5 + t->ndim + t->npieces * (1 + 2 * 5 + 3 * (uint64_t)t->ndim);
}

SP_EXPORT int sp_register_targets(sp_client *client,
                                  const sp_target_desc *targets, size_t n) {
  if (!client || (n > 0 && !targets))
    return SP_EINVAL;
  for (size_t i = 0; i < n; i++)
    if (!check_target(&targets[i]))
      return SP_EINVAL;
  return client_send_batched(
      client, &(struct client_batch){.op = "target_add",
                                     .field = "targets",
                                     .n = n,
                                     .pack = pack_target,
                                     .items = target_items,
                                     .arg = targets});
}
