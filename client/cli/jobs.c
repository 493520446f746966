/*
 * jobs.c - `shardport jobs`: every job of the daemon, oldest first, as a
 * table or as one JSON object (schema in docs/cli.md).
 */
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

/* Wide enough for any sanitized daemon string we show in one cell. */
#define CELL 256

enum { ID, USER, PHASE, RANKS, ASKED, EXPORTS, AGE, NODE, NCOLS };

static int oldest_first(const void *a, const void *b) {
  const sp_job_entry *x = a, *y = b;
  if (x->age_s != y->age_s)
    return x->age_s > y->age_s ? -1 : 1;
  return strcmp(x->job_id, y->job_id);
}

static void cells_of(const sp_job_entry *job, char (*cell)[CELL]) {
  sp__text_sanitize(job->job_id, cell[ID], CELL);
  text_user(job->owner_uid, cell[USER], CELL);
  sp__text_sanitize(job->phase, cell[PHASE], CELL);
  snprintf(cell[RANKS], CELL, "%u/%u", job->joined, job->world);
  snprintf(cell[ASKED], CELL, "%u", job->asked);
  snprintf(cell[EXPORTS], CELL, "%llu", (unsigned long long)job->exports);
  text_duration(job->age_s, cell[AGE], CELL);
  if (job->node_count > 0)
    snprintf(cell[NODE], CELL, "%u of %u", job->node, job->node_count);
  else
    snprintf(cell[NODE], CELL, "-");
}

static void print_table(FILE *out, const sp_job_list *list) {
  if (list->njobs == 0) {
    fputs("no jobs\n", out);
    return;
  }
  static const char *const heads[NCOLS] = {
      "JOB", "USER", "PHASE", "RANKS", "ASKED", "EXPORTS", "AGE", "NODE"};
  char(*cells)[NCOLS][CELL] = calloc(list->njobs, sizeof *cells);
  if (!cells) {
    fprintf(out, "(%zu jobs; out of memory formatting them)\n", list->njobs);
    return;
  }
  struct text_table t = {.ncols = NCOLS};
  text_table_measure(&t, heads);
  const char *row[NCOLS];
  for (size_t j = 0; j < list->njobs; j++) {
    cells_of(&list->jobs[j], cells[j]);
    for (int c = 0; c < NCOLS; c++)
      row[c] = cells[j][c];
    text_table_measure(&t, row);
  }
  text_table_row(&t, out, "", heads);
  for (size_t j = 0; j < list->njobs; j++) {
    for (int c = 0; c < NCOLS; c++)
      row[c] = cells[j][c];
    text_table_row(&t, out, "", row);
  }
  free(cells);
}

static void print_json(FILE *out, const sp_job_list *list,
                       const struct cli_options *opts) {
  fputs("{\"socket\":", out);
  json_string(out, opts->socket);
  fputs(",\"jobs\":[", out);
  for (size_t j = 0; j < list->njobs; j++) {
    const sp_job_entry *job = &list->jobs[j];
    fputs(j ? ",{\"job_id\":" : "{\"job_id\":", out);
    json_string(out, job->job_id);
    json_str_field(out, "phase", job->phase);
    json_u64(out, "owner_uid", job->owner_uid);
    json_u64(out, "owner_pid", job->owner_pid);
    json_double_field(out, "age_s", job->age_s);
    json_u64(out, "exports", job->exports);
    json_u64(out, "world", job->world);
    json_u64(out, "joined", job->joined);
    json_u64(out, "asked", job->asked);
    json_u64(out, "export_id", job->export_id);
    json_u64(out, "node", job->node);
    json_u64(out, "node_count", job->node_count);
    fputc('}', out);
  }
  fputs("]}\n", out);
}

static int jobs_exec(sp_client *client, const struct cli_options *opts,
                     FILE *out) {
  sp_job_list *list;
  int rc = sp_jobs(client, &list);
  if (rc < 0)
    return rc;
  if (list->njobs > 1)
    qsort(list->jobs, list->njobs, sizeof *list->jobs, oldest_first);
  if (opts->json)
    print_json(out, list, opts);
  else
    print_table(out, list);
  sp_job_list_free(list);
  return 0;
}

const struct cli_command cli_jobs_command = {
    .name = "jobs",
    .args = "",
    .summary = "list the daemon's jobs, oldest first",
    .flags = CLI_TAKES_JSON | CLI_TAKES_WATCH,
    .exec = jobs_exec,
};
