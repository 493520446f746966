/*
 * pump.c - what the ranks of an export hear: progress frames while it
 * runs, then their replies, streamed; see pump.h and docs/protocol.md
 * ("export").
 *
 * A rank's reply lists every tensor it owns, which may need more than one
 * frame: it is cut into parts that each fit the client's frame limit, the
 * daemon's and half the reply queue (publish_parts), and a part is queued
 * only while the connection has room for a whole one.  So a rank that reads
 * slowly holds only its own reply back, and the daemon never holds more
 * than max_output of replies per connection.  Part 0 carries the rank's
 * segment: a duplicate of its memfd, or a GPU segment's handles.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/export.h"
#include "daemon/export_run.h"
#include "daemon/job.h"
#include "daemon/pool.h"
#include "daemon/publish.h"
#include "daemon/pump.h"
#include "daemon/save.h"
#include "daemon/server.h"
#include "proto/limits.h"
#include "proto/monotonic.h"
#include "shardport.h"

void pump_progress_frame(struct conn *c, uint64_t request_id,
                         enum job_phase phase, uint32_t round,
                         uint32_t rounds, uint64_t moved, uint64_t total) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "progress", request_id, 5);
  sp__pack_kv_str(&mb.pk, "phase", export_phase_name(phase));
  sp__pack_kv_u64(&mb.pk, "round", round);
  sp__pack_kv_u64(&mb.pk, "rounds", rounds);
  sp__pack_kv_u64(&mb.pk, "bytes_moved", moved);
  sp__pack_kv_u64(&mb.pk, "bytes_total", total);
  conn_send_msgbuf(c, &mb);
}

static void send_progress(struct export *ex, struct export_rank *er,
                          uint32_t round, uint64_t moved) {
  if (!er->progress || er->answered || er->m->conn == NULL)
    return;
  pump_progress_frame(er->m->conn, er->request_id, ex->phase, round,
                      export_rounds(ex), moved, ex->bytes_total);
  er->sent_round = round;
  er->sent_bytes = moved;
  er->sent_phase = ex->phase;
}

void pump_progress(struct export *ex) {
  uint32_t round = ex->phase == JOB_MOVING ? atomic_load(&ex->engine.round)
                   : ex->phase == JOB_PUBLISHING ? export_rounds(ex)
                                                 : 0;
  uint64_t moved =
      ex->phase >= JOB_MOVING ? atomic_load(&ex->engine.bytes_moved) : 0;
  for (uint32_t r = 0; r < ex->job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->sent_phase != ex->phase || er->sent_round != round ||
        er->sent_bytes != moved)
      send_progress(ex, er, round, moved);
  }
}

static void on_conn_drained(struct conn *c, void *arg) {
  (void)c;
  job_wake(arg);
}

/* The bytes of the tensors rank r owns: what it writes in a save, where
 * every key is written, tied ones too (docs/checkpoints.md). */
static uint64_t owned_bytes(const struct export *ex, uint32_t r) {
  uint64_t n = 0;
  for (size_t i = ex->layout->owned_first[r]; i < ex->layout->owned_first[r + 1];
       i++)
    n += ex->plan->keys[ex->layout->owned[i]].nbytes;
  return n;
}

void pump_run(struct export *ex) {
  struct job *job = ex->job;
  for (uint32_t r = 0; r < job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->answered)
      continue;
    struct conn *c = er->m->conn;
    if (c == NULL) {
      er->answered = true;
      continue;
    }
    while (er->next_part < er->nparts &&
           conn_output_room(c) >= ex->part_limit) {
      size_t p = er->next_part;
      size_t end = p + 1 < er->nparts ? er->part_first[p + 1]
                                      : ex->layout->owned_first[r + 1];
      struct sp_msgbuf mb;
      struct publish_device dev = {
          .device = er->device_segment ? gpu_device_name(
                                             export_gpu(ex),
                                             er->device_info.device)
                                       : NULL,
          .handle = er->device_info.handle,
          .event = er->device_info.event,
          .size = er->device_info.size};
      struct save_files files =
          ex->save != NULL ? save_files(ex->save) : (struct save_files){0};
      publish_pack(ex->plan, ex->layout, &er->m->reg, r, er->request_id, ex->id,
                   p, er->nparts, er->part_first[p], end,
                   er->device_segment ? &dev : NULL,
                   ex->save != NULL ? &files : NULL, &mb);
      /* A reply that cannot be built would leave the rank waiting: its
       * connection closes instead, which it sees at once. */
      struct sp_frame_tx *tx = calloc(1, sizeof *tx);
      if (tx == NULL) {
        sp__msgbuf_discard(&mb);
        conn_close(c);
        break;
      }
      if (sp__msgbuf_finish(&mb, tx) != 0) {
        free(tx);
        conn_close(c);
        break;
      }
      if (p == 0 && er->segment_fd >= 0) {
        /* The frame takes the duplicate and closes it once written. */
        tx->fds[0] = er->segment_fd;
        tx->nfds = 1;
        er->segment_fd = -1;
      }
      er->next_part++;
      ex->progress_ms = monotonic_ms();
      if (conn_send(c, tx) != 0)
        break;
    }
    if (er->m->conn == NULL || er->next_part == er->nparts) {
      er->answered = true;
      if (ex->save != NULL)
        /* A save's owner goes on to write: it stays in the export. */
        save_rank_published(ex->save, r, er->request_id,
                            owned_bytes(ex, r));
      else
        er->m->in_export = false;
      if (er->m->conn != NULL)
        conn_on_drained(er->m->conn, NULL, NULL);
    } else {
      conn_on_drained(c, on_conn_drained, job);
    }
  }
}

int pump_start(struct export *ex, char *msg, size_t msglen) {
  struct job *job = ex->job;
  const struct config *cfg = job->srv->cfg;
  /* A part must fit the client's frame limit (the protocol's default), the
   * daemon's own, and half the reply queue, so that a queue at most half
   * full always has room for one. */
  uint64_t limit = SP_LIMITS_DEFAULT_MAX_FRAME;
  if (cfg->limits.max_frame < limit)
    limit = cfg->limits.max_frame;
  if (cfg->max_output / 2 < limit)
    limit = cfg->max_output / 2;
  uint32_t items = cfg->limits.max_items < SP_LIMITS_DEFAULT_MAX_ITEMS
                       ? cfg->limits.max_items
                       : SP_LIMITS_DEFAULT_MAX_ITEMS;
  ex->part_limit = limit;
  for (uint32_t r = 0; r < job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->answered)
      continue;
    struct job_published *pub = calloc(1, sizeof *pub);
    if (er->segment != NULL && er->segment->dev != NULL) {
      er->device_segment = true;
      er->device_info = *gpu_segment_info(er->segment->dev);
    }
    if (pub == NULL ||
        publish_parts(ex->plan, ex->layout, r, limit, items, &er->part_first,
                      &er->nparts) != 0) {
      free(pub);
      snprintf(msg, msglen, "out of memory publishing");
      return SP_ENOMEM;
    }
    /* The rank's own description of its segment, so that the pool can
     * tell when the rank has closed it everywhere (pool.h). */
    char why[256];
    if (er->segment != NULL && !er->device_segment &&
        (er->segment_fd = pool_segment_share(job->srv->pool, er->segment,
                                             why, sizeof why)) < 0) {
      int code = er->segment_fd;
      er->segment_fd = -1;
      free(pub);
      snprintf(msg, msglen, "publishing: %s", why);
      return code;
    }
    /* From here the rank holds the export until it releases it. */
    pub->export_id = ex->id;
    pub->segment = er->segment;
    er->segment = NULL;
    pub->next = er->m->published;
    er->m->published = pub;
  }
  return 0;
}

