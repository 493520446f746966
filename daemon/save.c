/*
 * save.c - a save's files, its writers' progress and its commit; see
 * save.h and docs/checkpoints.md.
 *
 * Each local rank of the save goes
 *   published -> writing -> reported step 1 -> answered 1 -> ... -> answered 3
 * and the save itself gathers one step at a time: step s is reached on
 * this node when every local rank of the export has reported it; on one
 * daemon that commits it at once, across nodes the root commits it once
 * every node reached it (daemon/mesh/coord.c).  A rank is answered no more after its
 * step 3 reply or its error.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/conn.h"
#include "daemon/mesh/mesh.h"
#include "daemon/export.h"
#include "daemon/job.h"
#include "daemon/plan/files.h"
#include "daemon/save.h"
#include "proto/dtype.h"
#include "proto/fail.h"
#include "proto/monotonic.h"
#include "proto/text.h"
#include "shardport.h"

struct save_rank {
  bool local;     /* a rank of the export on this daemon */
  bool in;        /* its publication is complete: it writes */
  bool answered;  /* it has its error or its last reply */
  bool gone;      /* its connection closed */
  uint64_t request_id; /* what its next word from the daemon answers */
  uint32_t reported;   /* the last step it reported */
  uint64_t bytes_written, bytes_to_write;
};

struct save {
  struct job *job;
  uint64_t export_id;
  const struct plan *plan;
  uint32_t *file;
  uint32_t nfiles;
  uint64_t total_size;
  /* The step being gathered, 1 .. SAVE_STEPS; SAVE_STEPS + 1 once the
   * last is committed. */
  uint32_t step;
  /* This node reached step (reported to the root across nodes). */
  bool reached;
  struct save_rank *ranks; /* [world] */
  /* Rank 0's weight map, while it streams: the next part to send. */
  bool streaming;
  size_t map_part, map_parts;
  uint64_t progress_ms;
};

int save_new(struct job *job, uint64_t export_id, const struct plan *plan,
             uint64_t limit, struct save **out, char *msg, size_t msglen) {
  *out = NULL;
  for (size_t k = 0; k < plan->nkeys; k++)
    if (sp__dtype_safetensors_name(plan->keys[k].dtype) == NULL)
      return sp__failf(msg, msglen, SP_EDTYPE,
                      "save: key \"%.512s\" is %s, which safetensors has no "
                      "dtype for; convert it before saving",
                      plan->keys[k].name, sp__dtype_name(plan->keys[k].dtype));
  /* A tensor of that name would be a second "__metadata__" in the
   * file's header, which loaders refuse or read as the metadata. */
  if (plan_find_key(plan, SAVE_RESERVED_KEY) != PLAN_NONE)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "save: a key is named \"" SAVE_RESERVED_KEY "\", the "
                     "name safetensors keeps for a file's metadata; rename "
                     "it before saving");
  struct save *s = calloc(1, sizeof *s);
  size_t n = plan->nkeys > 0 ? plan->nkeys : 1;
  uint32_t *owner = malloc(n * sizeof *owner);
  uint64_t *bytes = malloc(n * sizeof *bytes);
  if (s != NULL) {
    s->file = malloc(n * sizeof *s->file);
    s->ranks = calloc(job->world, sizeof *s->ranks);
  }
  int rc = s != NULL && s->file != NULL && s->ranks != NULL && owner != NULL &&
                   bytes != NULL
               ? 0
               : SP_ENOMEM;
  for (size_t k = 0; rc == 0 && k < plan->nkeys; k++) {
    owner[k] = plan->keys[k].owner;
    bytes[k] = plan->keys[k].nbytes;
    s->total_size += bytes[k];
  }
  if (rc == 0)
    rc = plan_files_number(plan->nkeys, owner, bytes, plan->world, limit,
                           s->file, &s->nfiles);
  free(owner);
  free(bytes);
  if (rc != 0) {
    save_free(s);
    return sp__failf(msg, msglen, SP_ENOMEM,
                    "out of memory numbering the checkpoint's files");
  }
  s->job = job;
  s->export_id = export_id;
  s->plan = plan;
  s->step = 1;
  s->progress_ms = monotonic_ms();
  for (uint32_t r = 0; r < job->world; r++)
    s->ranks[r].local = job->members[r] != NULL && job->members[r]->in_export;
  s->map_parts = (plan->nkeys + SAVE_MAP_PART_KEYS - 1) / SAVE_MAP_PART_KEYS;
  if (s->map_parts == 0)
    s->map_parts = 1;
  *out = s;
  return 0;
}

void save_free(struct save *s) {
  if (s == NULL)
    return;
  free(s->file);
  free(s->ranks);
  free(s);
}

struct save_files save_files(const struct save *s) {
  return (struct save_files){
      .file = s->file, .nfiles = s->nfiles, .total_size = s->total_size};
}

static struct conn *rank_conn(const struct save *s, uint32_t r) {
  const struct job_member *m = s->job->members[r];
  return s->ranks[r].gone || m == NULL ? NULL : m->conn;
}

void save_rank_published(struct save *s, uint32_t r, uint64_t request_id,
                         uint64_t bytes_to_write) {
  struct save_rank *sr = &s->ranks[r];
  sr->in = true;
  sr->request_id = request_id;
  sr->bytes_to_write = bytes_to_write;
  s->progress_ms = monotonic_ms();
}

void save_fail(struct save *s, int code, const char *message) {
  if (s == NULL)
    return;
  s->streaming = false;
  for (uint32_t r = 0; r < s->job->world; r++) {
    struct save_rank *sr = &s->ranks[r];
    if (!sr->in || sr->answered)
      continue;
    sr->answered = true;
    struct conn *c = rank_conn(s, r);
    if (c != NULL)
      conn_send_error(c, sr->request_id, code, "%s", message);
  }
}

void save_rank_gone(struct save *s, uint32_t r) {
  if (s != NULL)
    s->ranks[r].gone = true;
}

bool save_committed(const struct save *s) {
  return s != NULL && s->step > SAVE_STEPS;
}

uint64_t save_progress_ms(const struct save *s) {
  /* A node whose ranks all reported the step waits for the other nodes'
   * ranks, which their own daemons watch (and the root hears from every
   * node while it waits): waiting is not a stall here. */
  return s->reached ? monotonic_ms() : s->progress_ms;
}

void save_bytes(const struct save *s, uint64_t *written, uint64_t *to_write) {
  *written = *to_write = 0;
  for (uint32_t r = 0; r < s->job->world; r++) {
    *written += s->ranks[r].bytes_written;
    *to_write += s->ranks[r].bytes_to_write;
  }
}

/* {"op":"save_step","id":N,"step":S}, and for rank 0 at step 2 one part of
 * the weight map: every key of the plan, in name order, with its file. */
static int send_step(struct save *s, uint32_t r, uint32_t step, bool map) {
  struct conn *c = rank_conn(s, r);
  if (c == NULL)
    return 0;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "save_step", s->ranks[r].request_id, map ? 7 : 1);
  sp__pack_kv_u64(&mb.pk, "step", step);
  if (map) {
    size_t first = s->map_part * SAVE_MAP_PART_KEYS;
    size_t end = first + SAVE_MAP_PART_KEYS;
    if (end > s->plan->nkeys)
      end = s->plan->nkeys;
    sp__pack_kv_u64(&mb.pk, "part", s->map_part);
    sp__pack_kv_u64(&mb.pk, "parts", s->map_parts);
    sp__pack_kv_u64(&mb.pk, "files", s->nfiles);
    sp__pack_kv_u64(&mb.pk, "total_size", s->total_size);
    sp__pack_str(&mb.pk, "keys");
    msgpack_pack_array(&mb.pk, (uint32_t)(end - first));
    for (size_t k = first; k < end; k++)
      sp__pack_str(&mb.pk, s->plan->keys[k].name);
    sp__pack_str(&mb.pk, "key_files");
    msgpack_pack_array(&mb.pk, (uint32_t)(end - first));
    for (size_t k = first; k < end; k++)
      msgpack_pack_uint32(&mb.pk, s->file[k]);
  }
  return conn_send_msgbuf(c, &mb);
}

static void on_drained(struct conn *c, void *arg) {
  (void)c;
  job_wake(arg);
}

/* Room for one part of the weight map: SAVE_MAP_PART_KEYS keys of at most
 * 1,024 bytes each and their framing. */
#define SAVE_MAP_PART_ROOM ((uint64_t)SAVE_MAP_PART_KEYS * 1040u + 4096u)

bool save_pump(struct save *s) {
  if (s->streaming) {
    struct conn *c = rank_conn(s, 0);
    while (c != NULL && s->map_part < s->map_parts &&
           conn_output_room(c) >= SAVE_MAP_PART_ROOM) {
      send_step(s, 0, 2, true);
      s->map_part++;
    }
    if (c == NULL || s->map_part == s->map_parts) {
      s->streaming = false;
      if (c != NULL)
        conn_on_drained(c, NULL, NULL);
    } else {
      conn_on_drained(c, on_drained, s->job);
    }
  }
  return s->step > SAVE_STEPS && !s->streaming;
}

static void commit(struct save *s, uint32_t step) {
  if (step != s->step || !s->reached)
    return;
  for (uint32_t r = 0; r < s->job->world; r++) {
    struct save_rank *sr = &s->ranks[r];
    if (!sr->local || sr->answered)
      continue;
    if (step == 2 && r == 0) {
      s->streaming = true;
      s->map_part = 0;
    } else {
      send_step(s, r, step, false);
    }
    if (step == SAVE_STEPS)
      sr->answered = true;
  }
  s->step++;
  s->reached = false;
  s->progress_ms = monotonic_ms();
  job_wake(s->job);
}

void save_commit(struct job *job, uint32_t step) {
  struct save *s = export_save(job);
  if (s != NULL)
    commit(s, step);
}

/* Every local rank of the export reported the step being gathered. */
static void maybe_reached(struct save *s) {
  if (s->reached || s->step > SAVE_STEPS)
    return;
  for (uint32_t r = 0; r < s->job->world; r++)
    if (s->ranks[r].local && s->ranks[r].reported < s->step)
      return;
  s->reached = true;
  if (s->job->mesh != NULL)
    mesh_saved(s->job, s->step);
  else
    commit(s, s->step);
}

/* The save of the running export export_id that c's rank is writing, or
 * NULL. */
static struct save *find(struct conn *c, uint64_t export_id, uint32_t *rank) {
  struct job_member *m = conn_member(c);
  struct save *s = m != NULL ? export_save(m->job) : NULL;
  if (s == NULL || s->export_id != export_id || !s->ranks[m->rank].in ||
      s->ranks[m->rank].answered)
    return NULL;
  *rank = m->rank;
  return s;
}

/* A step reported for a save that is not running: the save failed
 * before the report arrived (its error crossed it on the wire), and the
 * rank hears that failure again, or the report is wrong. */
static int refuse_step(struct conn *c, const struct sp_msg_head *head,
                       uint64_t export_id) {
  const struct job_member *m = conn_member(c);
  if (m != NULL && m->job->running == NULL &&
      m->job->last_phase == JOB_FAILED &&
      m->job->next_export_id == export_id + 1) {
    /* job->error is "<code>: <message>" (export.c). */
    const char *e = m->job->error;
    const char *sep = strstr(e, ": ");
    if (sep != NULL)
      return conn_send_error(c, head->id,
                             sp__error_from_name(e, (size_t)(sep - e)), "%s",
                             sep + 2);
  }
  return conn_send_error(c, head->id, SP_ENOEXPORT,
                         "save_step: export %" PRIu64 " is no save this "
                         "connection's rank is writing",
                         export_id);
}

int save_op_step(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  uint64_t export_id, step, written = 0;
  if (sp__msg_get_u64(map, "export_id", false, &export_id) != 0 ||
      sp__msg_get_u64(map, "step", false, &step) != 0 ||
      sp__msg_get_u64(map, "bytes_written", true, &written) < 0)
    return conn_send_error(c, head->id, SP_EBADMSG,
                           "save_step: needs \"export_id\" and \"step\" "
                           "(uints), and \"bytes_written\" may be a uint");
  const char *code_name = NULL, *why = NULL;
  size_t code_len = 0, why_len = 0;
  int has_error = sp__msg_get_str(map, "error", true, &code_name, &code_len);
  int has_why = sp__msg_get_str(map, "message", true, &why, &why_len);
  if (has_error < 0 || has_why < 0 || (has_error == 0) != (has_why == 0))
    return conn_send_error(c, head->id, SP_EBADMSG,
                           "save_step: \"error\" (a code's wire name) and "
                           "\"message\" (str) come together");
  uint32_t r;
  struct save *s = find(c, export_id, &r);
  if (s == NULL)
    return refuse_step(c, head, export_id);
  struct save_rank *sr = &s->ranks[r];
  if (step != (uint64_t)sr->reported + 1 || step != s->step)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "save_step: rank %" PRIu32 " reported step %" PRIu64
                           " while the save gathers step %" PRIu32
                           " and it reported %" PRIu32 " last",
                           r, step, s->step, sr->reported);
  sr->request_id = head->id;
  s->progress_ms = monotonic_ms();
  if (written <= sr->bytes_to_write)
    sr->bytes_written = written;
  if (has_error == 0) {
    /* The rank's own words go to every rank; the daemon only bounds them
     * and says whose they are. */
    int code = sp__error_from_name(code_name, code_len);
    if (code == SP_EINTERNAL)
      code = SP_EWRITE;
    char text[SP_ERRMSG_MAX + 1], clean[SP_ERRMSG_MAX + 1];
    snprintf(text, sizeof text, "save of export %" PRIu64 " of job %s: rank %"
             PRIu32 ": %.*s", export_id, s->job->hex, r,
             (int)(why_len < 800 ? why_len : 800), why);
    sp__text_sanitize(text, clean, sizeof clean);
    export_fail_running(s->job, code, clean);
    return 0;
  }
  sr->reported = (uint32_t)step;
  maybe_reached(s);
  return 0;
}

int save_op_progress(struct conn *c, const struct sp_msg_head *head,
                     const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  uint64_t export_id, written;
  if (sp__msg_get_u64(map, "export_id", false, &export_id) != 0 ||
      sp__msg_get_u64(map, "bytes_written", false, &written) != 0)
    return 0;
  (void)head;
  /* A notification: never a reply, not even an error, so that a writing
   * rank never waits and never reads an answer it did not ask for (a
   * report that crossed the save's failure is dropped). */
  uint32_t r;
  struct save *s = find(c, export_id, &r);
  if (s == NULL)
    return 0;
  struct save_rank *sr = &s->ranks[r];
  if (written <= sr->bytes_to_write && written != sr->bytes_written) {
    sr->bytes_written = written;
    s->progress_ms = monotonic_ms();
  }
  return 0;
}
