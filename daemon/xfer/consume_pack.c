/*
 * consume_pack.c - one bucket of a push packed from a trainer's storage or
 * unpacked into a consumer's buffers, one strided box copy per move.
 */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "daemon/xfer/consume_pack.h"
#include "daemon/xfer/copy.h"
#include "daemon/xfer/thread.h"
#include "proto/dtype.h"
#include "shardport.h"

struct bucket_work {
  const struct consume_plan *plan;
  const struct consume_round *round;
  const struct consume_bucket *bucket;
  bool pack;
  const struct xfer_storage *src;
  uint8_t *out;
  const uint8_t *in;
  uint8_t *const *dst;
};

/* One move between its view (in a storage) and its contiguous place in the
 * bucket. */
static void carry(const struct bucket_work *w, const struct consume_move *m) {
  size_t esz = sp__dtype_size(m->from.dtype);
  const struct sp_view *v = w->pack ? &m->from : &m->to;
  struct xfer_box box = {.ndim = (int)v->ndim, .elem_size = esz};
  int64_t dense = 1;
  for (uint32_t d = v->ndim; d-- > 0;) {
    box.shape[d] = v->shape[d];
    box.src_stride[d] = w->pack ? v->stride[d] : dense;
    box.dst_stride[d] = w->pack ? dense : v->stride[d];
    dense *= v->shape[d];
  }
  if (w->pack) {
    const uint8_t *from = w->src[m->src_storage].data + (size_t)v->offset * esz;
    uint8_t *to = w->out + m->bucket_offset;
    if (v->ndim == 0)
      memcpy(to, from, esz);
    else
      xfer_copy(to, from, &box);
  } else {
    const uint8_t *from = w->in + m->bucket_offset;
    uint8_t *to = w->dst[m->dst_storage] + (size_t)v->offset * esz;
    if (v->ndim == 0)
      memcpy(to, from, esz);
    else
      xfer_copy(to, from, &box);
  }
}

static void carry_bucket(void *arg) {
  const struct bucket_work *w = arg;
  for (size_t i = 0; i < w->bucket->nmoves; i++)
    carry(w, &w->round->moves[w->bucket->first + i]);
}

/* Runs the bucket under the guard; a fault is named by the side that
 * holds the memory: the trainer's when packing, the consumer's when
 * unpacking (staging is the daemon's own). */
static int run(const struct bucket_work *w, char *msg, size_t msglen) {
  const void *fault;
  if (xfer_guarded(carry_bucket, (void *)w, &fault) == 0)
    return 0;
  const struct consume_move *first = &w->round->moves[w->bucket->first];
  const char *key = w->plan->keys[first->key].name;
  if (w->pack)
    snprintf(msg, msglen,
             "rank %u's storage could not be read for key '%s' or a key "
             "after it in its bucket to consumer %u (was its file truncated "
             "after it was registered?)",
             w->bucket->src, key, w->bucket->dst);
  else
    snprintf(msg, msglen,
             "consumer %u's buffers could not be written for key '%s' or a "
             "key after it in its bucket from rank %u (was a file truncated "
             "after it was registered?)",
             w->bucket->dst, key, w->bucket->src);
  return SP_EBADFD;
}

int consume_pack(const struct consume_plan *plan, size_t round, size_t bucket,
                 const struct xfer_storage *src, uint8_t *out, char *msg,
                 size_t msglen) {
  const struct consume_round *r = &plan->rounds[round];
  struct bucket_work w = {.plan = plan,
                          .round = r,
                          .bucket = &r->buckets[bucket],
                          .pack = true,
                          .src = src,
                          .out = out};
  return run(&w, msg, msglen);
}

int consume_unpack(const struct consume_plan *plan, size_t round, size_t bucket,
                   const uint8_t *in, uint8_t *const *dst, char *msg,
                   size_t msglen) {
  const struct consume_round *r = &plan->rounds[round];
  struct bucket_work w = {.plan = plan,
                          .round = r,
                          .bucket = &r->buckets[bucket],
                          .pack = false,
                          .in = in,
                          .dst = dst};
  return run(&w, msg, msglen);
}
