/*
 * job.c - `shardport status JOB`: one job in full, as rows for people or
 * as one JSON object (schema in docs/cli.md): its owner and age, its
 * phase and progress (the pool being prepared included), every rank with
 * its state, process and node, and its last finished exports.
 */
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

/* Wide enough for any sanitized daemon string we show in one cell; an
 * error is a whole daemon sentence, which escaping can quadruple. */
#define CELL 256
#define ERROR_CELL (4 * 1024 + 1)

static void row(FILE *out, const char *label, const char *value) {
  fprintf(out, "%-18s%s\n", label, value);
}

/* "0.4s", "12.5s", then as uptime is shown ("2m 3s"). */
static void seconds(double s, char *buf, size_t size) {
  if (s < 60)
    snprintf(buf, size, "%.1fs", s);
  else
    text_duration(s, buf, size);
}

static void rate(double bps, char *buf, size_t size) {
  char b[32];
  sp_format_bytes(bps < 1.8e19 ? (uint64_t)bps : UINT64_MAX, b, sizeof b);
  snprintf(buf, size, "%s/s", b);
}

static void print_head(FILE *out, const sp_job_detail *d) {
  const sp_job_status *job = &d->job;
  char a[CELL], b[CELL], c[CELL], line[4 * CELL];
  sp__text_sanitize(job->job_id, a, sizeof a);
  row(out, "job", a);
  text_user(d->owner_uid, a, sizeof a);
  snprintf(line, sizeof line, "%s (uid %u, pid %u)", a, d->owner_uid,
           d->owner_pid);
  row(out, "owner", line);
  text_duration(d->age_s, a, sizeof a);
  row(out, "age", a);
  sp__text_sanitize(job->phase, a, sizeof a);
  row(out, "phase", a);
  if (job->error) {
    char error[ERROR_CELL];
    sp__text_sanitize(job->error, error, sizeof error);
    row(out, "error", error);
  }
  snprintf(line, sizeof line, "%u of %u joined, %u asked", job->joined,
           job->world, job->asked);
  row(out, "ranks", line);
  if (job->export_id > 0) {
    sp_format_bytes(job->bytes_moved, a, sizeof a);
    sp_format_bytes(job->bytes_total, b, sizeof b);
    /* A rate while data moves, as in `status` (RATE). */
    c[0] = '\0';
    if (strcmp(job->phase, "moving") == 0) {
      char r[48];
      rate(job->rate_bps, r, sizeof r);
      snprintf(c, sizeof c, ", %s", r);
    }
    snprintf(line, sizeof line, "%llu: round %u of %u, %s of %s moved%s",
             (unsigned long long)job->export_id, job->round, job->rounds, a, b,
             c);
    row(out, "export", line);
  }
  if (job->bytes_to_prepare > 0 && strcmp(job->phase, "allocating") == 0) {
    sp_format_bytes(job->bytes_prepared, a, sizeof a);
    sp_format_bytes(job->bytes_to_prepare, b, sizeof b);
    snprintf(line, sizeof line, "%s of %s of the pool", a, b);
    row(out, "prepared", line);
  }
  if (job->bytes_to_write > 0 && strcmp(job->phase, "writing") == 0) {
    sp_format_bytes(job->bytes_written, a, sizeof a);
    sp_format_bytes(job->bytes_to_write, b, sizeof b);
    snprintf(line, sizeof line, "%s of %s of the checkpoint", a, b);
    row(out, "written", line);
  }
  snprintf(line, sizeof line, "%llu finished", (unsigned long long)d->exports);
  row(out, "exports", line);
  status_print_nodes(out, job);
  status_print_consumers(out, job);
}

static void print_ranks(FILE *out, const sp_job_detail *d) {
  enum { RANK, STATE, PID, NODE, NCOLS };
  static const char *const heads[NCOLS] = {"RANK", "STATE", "PID", "NODE"};
  char(*cells)[NCOLS][CELL] = calloc(d->nranks ? d->nranks : 1, sizeof *cells);
  if (!cells) {
    fprintf(out, "  (%zu ranks; out of memory formatting them)\n", d->nranks);
    return;
  }
  struct text_table t = {.ncols = NCOLS};
  text_table_measure(&t, heads);
  const char *cell[NCOLS];
  for (size_t r = 0; r < d->nranks; r++) {
    const sp_rank_info *rk = &d->ranks[r];
    snprintf(cells[r][RANK], CELL, "%zu", r);
    sp__text_sanitize(rk->state, cells[r][STATE], CELL);
    if (rk->pid > 0)
      snprintf(cells[r][PID], CELL, "%u", rk->pid);
    else
      snprintf(cells[r][PID], CELL, "-");
    if (rk->node >= 0)
      snprintf(cells[r][NODE], CELL, "%lld", (long long)rk->node);
    else
      snprintf(cells[r][NODE], CELL, "-");
    for (int c = 0; c < NCOLS; c++)
      cell[c] = cells[r][c];
    text_table_measure(&t, cell);
  }
  text_table_row(&t, out, "  ", heads);
  for (size_t r = 0; r < d->nranks; r++) {
    for (int c = 0; c < NCOLS; c++)
      cell[c] = cells[r][c];
    text_table_row(&t, out, "  ", cell);
  }
  free(cells);
}

static void print_history(FILE *out, const sp_job_detail *d) {
  if (d->nhistory == 0) {
    row(out, "history", "no export finished yet");
    return;
  }
  char line[CELL];
  snprintf(line, sizeof line, "the last %zu of %llu, newest first",
           d->nhistory, (unsigned long long)d->exports);
  row(out, "history", line);
  enum { EXPORT, OUTCOME, ENDED, TOOK, MOVED, RATE, ERROR, NCOLS };
  static const char *const heads[NCOLS] = {"EXPORT", "OUTCOME", "ENDED",
                                           "TOOK",   "MOVED",   "RATE",
                                           "ERROR"};
  struct text_table t = {.ncols = NCOLS};
  text_table_measure(&t, heads);
  /* Two passes over the same cells: measure, then print. */
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      text_table_row(&t, out, "  ", heads);
    for (size_t i = 0; i < d->nhistory; i++) {
      const sp_export_record *e = &d->history[i];
      char id[CELL], ended[CELL], took[CELL], moved[CELL], rt[CELL];
      char error[ERROR_CELL];
      if (e->export_id > 0)
        snprintf(id, sizeof id, "%llu", (unsigned long long)e->export_id);
      else
        snprintf(id, sizeof id, "-");
      char ago[64];
      text_duration(e->age_s, ago, sizeof ago);
      snprintf(ended, sizeof ended, "%s ago", ago);
      seconds(e->duration_s, took, sizeof took);
      sp_format_bytes(e->bytes_moved, moved, sizeof moved);
      rate(e->rate_bps, rt, sizeof rt);
      sp__text_sanitize(e->error ? e->error : "", error, sizeof error);
      const char *cell[NCOLS] = {id,    e->failed ? "failed" : "published",
                                 ended, took,
                                 moved, rt,
                                 error};
      if (pass == 0)
        text_table_measure(&t, cell);
      else
        text_table_row(&t, out, "  ", cell);
    }
  }
}

static void print_json(FILE *out, const sp_job_detail *d,
                       const struct cli_options *opts) {
  fputs("{\"socket\":", out);
  json_string(out, opts->socket);
  fputs(",\"job\":{", out);
  status_json_job_fields(out, &d->job);
  json_u64(out, "owner_uid", d->owner_uid);
  json_u64(out, "owner_pid", d->owner_pid);
  json_double_field(out, "age_s", d->age_s);
  json_u64(out, "exports", d->exports);
  fputs(",\"ranks\":[", out);
  for (size_t r = 0; r < d->nranks; r++) {
    const sp_rank_info *rk = &d->ranks[r];
    fprintf(out, "%s{\"rank\":%zu", r ? "," : "", r);
    json_str_field(out, "state", rk->state);
    if (rk->pid > 0)
      json_u64(out, "pid", rk->pid);
    else
      fputs(",\"pid\":null", out);
    if (rk->node >= 0)
      json_u64(out, "node", (uint64_t)rk->node);
    else
      fputs(",\"node\":null", out);
    fputc('}', out);
  }
  fputs("],\"history\":[", out);
  for (size_t i = 0; i < d->nhistory; i++) {
    const sp_export_record *e = &d->history[i];
    fprintf(out, "%s{\"export_id\":%llu", i ? "," : "",
            (unsigned long long)e->export_id);
    json_str_field(out, "outcome", e->failed ? "failed" : "published");
    json_str_field(out, "error", e->error);
    json_double_field(out, "age_s", e->age_s);
    json_double_field(out, "duration_s", e->duration_s);
    json_u64(out, "rounds", e->rounds);
    json_u64(out, "bytes_moved", e->bytes_moved);
    json_u64(out, "bytes_total", e->bytes_total);
    json_double_field(out, "rate_bps", e->rate_bps);
    fputc('}', out);
  }
  fputs("]}}\n", out);
}

int job_show_exec(sp_client *client, const struct cli_options *opts,
                  FILE *out) {
  sp_job_detail *d;
  int rc = sp_job_show(client, opts->job, &d);
  if (rc < 0)
    return rc;
  if (opts->json) {
    print_json(out, d, opts);
  } else {
    print_head(out, d);
    print_ranks(out, d);
    print_history(out, d);
  }
  sp_job_detail_free(d);
  return 0;
}
