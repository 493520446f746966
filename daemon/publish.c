/*
 * publish.c - where each owned tensor lives after an export, and the export
 * reply that tells its owner; see publish.h.
 *
 * Layout: each owner rank gets one pool segment per export holding all of
 * its assembled tensors, each at an offset aligned to PUBLISH_ALIGN (so any
 * dtype, and vectorised or device copies, see aligned data).  Keys are laid
 * out in name order, so the layout is a pure function of the plan.
 *   MOVE      its own aligned region, assembled in place by the engine;
 *   EMPTY     a zero-size region at an aligned offset: the owner creates it;
 *   ALIAS     whatever its tie leader got (tied weights share one buffer);
 *   IDENTITY  no pool memory: the owner's own storage is published.
 * A rank with no region gets no segment; a rank whose regions are all empty
 * gets a segment of one byte, so that it still has something to map.
 *
 * Reply: a rank's owned keys in name order, cut into parts that each fit a
 * frame (docs/protocol.md, "export").  Only keys the plan gives to that
 * rank are ever listed.  A save's reply also names each tensor's file and,
 * in part 0, how many files the checkpoint has.
 */
#include <stdlib.h>
#include <string.h>

#include "daemon/publish.h"
#include "daemon/registry.h"
#include "proto/tensor.h"
#include "daemon/save.h"
#include "shardport.h"

void publish_layout_free(struct publish_layout *l) {
  free(l->offset);
  free(l->seg_size);
  free(l->owned_first);
  free(l->owned);
  memset(l, 0, sizeof *l);
}

static uint64_t align_up(uint64_t v) {
  return (v + PUBLISH_ALIGN - 1) & ~(uint64_t)(PUBLISH_ALIGN - 1);
}

int publish_layout_build(const struct plan *plan, struct publish_layout *out) {
  uint32_t world = plan->world;
  size_t nkeys = plan->nkeys;
  memset(out, 0, sizeof *out);
  out->world = world;
  out->nkeys = nkeys;
  out->offset = malloc((nkeys > 0 ? nkeys : 1) * sizeof *out->offset);
  out->seg_size = calloc(world, sizeof *out->seg_size);
  out->owned_first = calloc((size_t)world + 1, sizeof *out->owned_first);
  out->owned = malloc((nkeys > 0 ? nkeys : 1) * sizeof *out->owned);
  bool *has_region = calloc(world, sizeof *has_region);
  if (out->offset == NULL || out->seg_size == NULL ||
      out->owned_first == NULL || out->owned == NULL || has_region == NULL) {
    free(has_region);
    publish_layout_free(out);
    return SP_ENOMEM;
  }
  for (size_t k = 0; k < nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    out->offset[k] = PUBLISH_IDENTITY;
    if (key->kind != PLAN_KEY_MOVE && key->kind != PLAN_KEY_EMPTY)
      continue;
    uint64_t at = align_up(out->seg_size[key->owner]);
    out->offset[k] = at;
    out->seg_size[key->owner] = at + key->nbytes;
    has_region[key->owner] = true;
  }
  /* Aliases point at their leader, which may come after them by name. */
  for (size_t k = 0; k < nkeys; k++)
    if (plan->keys[k].kind == PLAN_KEY_ALIAS)
      out->offset[k] = out->offset[plan->keys[k].alias_of];
  for (uint32_t r = 0; r < world; r++)
    if (has_region[r] && out->seg_size[r] == 0)
      out->seg_size[r] = 1;
  free(has_region);
  /* Owned keys per rank, by a counting sort that keeps name order. */
  for (size_t k = 0; k < nkeys; k++)
    out->owned_first[plan->keys[k].owner + 1]++;
  for (uint32_t r = 0; r < world; r++)
    out->owned_first[r + 1] += out->owned_first[r];
  size_t *at = malloc((size_t)world * sizeof *at);
  if (at == NULL) {
    publish_layout_free(out);
    return SP_ENOMEM;
  }
  memcpy(at, out->owned_first, (size_t)world * sizeof *at);
  for (size_t k = 0; k < nkeys; k++)
    out->owned[at[plan->keys[k].owner]++] = (uint32_t)k;
  free(at);
  return 0;
}

/* The key whose storage or region k is published as: its tie leader for an
 * alias, else itself. */
static const struct plan_key *published_as(const struct plan *plan,
                                           const struct plan_key *key) {
  return key->kind == PLAN_KEY_ALIAS ? &plan->keys[key->alias_of] : key;
}

/* An upper bound of one tensor map's packed size: each field name, a str
 * header of at most 5 bytes, an integer of at most 9. */
static uint64_t tensor_bound(const struct plan_key *key) {
  return 144 + strlen(key->name) + 18u * key->ndim;
}

/* The msgpack items one tensor map adds to a frame as the wire check
 * counts them: its place in the tensors array, its six pairs (seven in a
 * save; two items each), and the shape and stride entries. */
static uint64_t tensor_items(const struct plan_key *key) {
  return 1 + 2 * 7 + 2u * key->ndim;
}

int publish_parts(const struct plan *plan, const struct publish_layout *l,
                  uint32_t rank, uint64_t frame_limit, uint32_t max_items,
                  size_t **first, size_t *nparts) {
  size_t begin = l->owned_first[rank], end = l->owned_first[rank + 1];
  /* The envelope and the part's own fields; the rest is for tensors. */
  uint64_t budget = frame_limit > 512 ? frame_limit - 512 : 0;
  uint64_t item_budget = 2 * (uint64_t)max_items - 32;
  size_t cap = 4, n = 0;
  size_t *f = malloc(cap * sizeof *f);
  if (f == NULL)
    return SP_ENOMEM;
  f[n++] = begin;
  uint64_t used = 0, items_used = 0;
  size_t count = 0;
  for (size_t i = begin; i < end; i++) {
    const struct plan_key *key = &plan->keys[l->owned[i]];
    uint64_t b = tensor_bound(key), it = tensor_items(key);
    if (count > 0 && (used + b > budget || items_used + it > item_budget ||
                      count == max_items)) {
      if (n == cap) {
        size_t *g = realloc(f, 2 * cap * sizeof *g);
        if (g == NULL) {
          free(f);
          return SP_ENOMEM;
        }
        f = g;
        cap *= 2;
      }
      f[n++] = i;
      used = items_used = 0;
      count = 0;
    }
    used += b;
    items_used += it;
    count++;
  }
  *first = f;
  *nparts = n;
  return 0;
}

static void pack_tensor(msgpack_packer *pk, const struct plan *plan,
                        const struct publish_layout *l,
                        const struct registry *owner,
                        const struct save_files *files, uint32_t k) {
  const struct plan_key *key = &plan->keys[k];
  const struct plan_key *as = published_as(plan, key);
  msgpack_pack_map(pk, files != NULL ? 7 : 6);
  sp__pack_kv_str(pk, "key", key->name);
  if (files != NULL)
    sp__pack_kv_u64(pk, "file", files->file[k]);
  sp__pack_kv_str(pk, "dtype", sp__dtype_name(key->dtype));
  sp__pack_kv_dims(pk, "shape", key->shape, key->ndim);
  if (as->kind == PLAN_KEY_IDENTITY) {
    /* The owner's own view, strides and all, in its own storage. */
    struct plan_key_in held;
    plan_key_holding(plan, (uint32_t)(as - plan->keys), &held);
    sp__pack_kv_dims(pk, "stride", held.view.stride, held.view.ndim);
    sp__pack_kv_u64(pk, "sid", owner->info[held.storage].sid);
    sp__pack_kv_u64(pk, "byte_offset",
                    (uint64_t)held.view.offset * sp__dtype_size(key->dtype));
    return;
  }
  int64_t stride[SP_MAX_DIMS];
  int64_t s = 1;
  for (uint32_t d = key->ndim; d-- > 0;) {
    stride[d] = s;
    s *= key->shape[d] > 0 ? key->shape[d] : 1;
  }
  sp__pack_kv_dims(pk, "stride", stride, key->ndim);
  sp__pack_kv_u64(pk, "segment", 0);
  sp__pack_kv_u64(pk, "byte_offset", l->offset[k]);
}

/* {"device": .., "handle": <bin>, "event": <bin>, "size": N}. */
static void pack_device_segment(msgpack_packer *pk,
                                const struct publish_device *dev) {
  msgpack_pack_map(pk, 4);
  sp__pack_kv_str(pk, "device", dev->device);
  sp__pack_str(pk, "handle");
  sp__pack_bin(pk, dev->handle, GPU_IPC_HANDLE_BYTES);
  sp__pack_str(pk, "event");
  sp__pack_bin(pk, dev->event, GPU_IPC_HANDLE_BYTES);
  sp__pack_kv_u64(pk, "size", dev->size);
}

void publish_pack(const struct plan *plan, const struct publish_layout *l,
                  const struct registry *owner, uint32_t rank,
                  uint64_t request_id, uint64_t export_id, size_t part,
                  size_t nparts, size_t first, size_t end,
                  const struct publish_device *dev,
                  const struct save_files *files, struct sp_msgbuf *mb) {
  bool segment_list = part == 0;
  bool device_list = segment_list && dev != NULL;
  bool file_count = segment_list && files != NULL;
  sp__msgbuf_begin(mb, "export", request_id,
                  4 + (segment_list ? 1 : 0) + (device_list ? 1 : 0) +
                      (file_count ? 2 : 0));
  sp__pack_kv_u64(&mb->pk, "export_id", export_id);
  sp__pack_kv_u64(&mb->pk, "part", part);
  sp__pack_kv_u64(&mb->pk, "parts", nparts);
  if (segment_list)
    sp__pack_kv_u64(&mb->pk, "segments", l->seg_size[rank] > 0 ? 1 : 0);
  if (device_list) {
    /* A device segment travels as its IPC handle, not as a descriptor. */
    sp__pack_str(&mb->pk, "cuda_segments");
    msgpack_pack_array(&mb->pk, 1);
    pack_device_segment(&mb->pk, dev);
  }
  if (file_count) {
    sp__pack_kv_u64(&mb->pk, "files", files->nfiles);
    sp__pack_kv_u64(&mb->pk, "total_size", files->total_size);
  }
  sp__pack_str(&mb->pk, "tensors");
  msgpack_pack_array(&mb->pk, (uint32_t)(end - first));
  for (size_t i = first; i < end; i++)
    pack_tensor(&mb->pk, plan, l, owner, files, l->owned[i]);
}
