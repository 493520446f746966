/*
 * status.c - `shardport status`: the daemon, its backends, pool and jobs, as
 * a table for people or as one JSON object (schema in docs/cli.md).
 */
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

/* Wide enough for any sanitized daemon string we show in one cell. */
#define CELL 256

static void row(FILE *out, const char *label, const char *value) {
  fprintf(out, "%-18s%s\n", label, value);
}

/* A job across nodes: its plan's digest, and one line per daemon. */
void status_print_nodes(FILE *out, const sp_job_status *job) {
  if (job->nnodes == 0)
    return;
  char digest[CELL];
  sp__text_sanitize(job->plan_digest ? job->plan_digest : "", digest,
                    sizeof digest);
  fprintf(out, "    nodes: %zu, this daemon is node %u; plan %s\n",
          job->nnodes, job->node, digest[0] ? digest : "(none yet)");
  size_t aw = strlen("ADDRESS");
  for (size_t n = 0; n < job->nnodes; n++) {
    char addr[CELL];
    sp__text_sanitize(job->nodes[n].address, addr, sizeof addr);
    if (strlen(addr) > aw)
      aw = strlen(addr);
  }
  fprintf(out, "    %-6s%-*s  %-11s%-12s%s\n", "NODE", (int)aw, "ADDRESS",
          "CONNECTED", "SENT", "RECEIVED");
  for (size_t n = 0; n < job->nnodes; n++) {
    const sp_node_status *nd = &job->nodes[n];
    char addr[CELL], sent[32], received[32];
    sp__text_sanitize(nd->address, addr, sizeof addr);
    sp_format_bytes(nd->bytes_sent, sent, sizeof sent);
    sp_format_bytes(nd->bytes_received, received, sizeof received);
    if (nd->self)
      fprintf(out, "    %-6u%-*s  %s\n", nd->node, (int)aw, addr,
              "this daemon");
    else
      fprintf(out, "    %-6u%-*s  %-11s%-12s%s\n", nd->node, (int)aw, addr,
              nd->connected ? "yes" : "no", sent, received);
  }
}

/* A job with consumers: its pushes, and one line per consumer beside the
 * ranks of the job's row. */
void status_print_consumers(FILE *out, const sp_job_status *job) {
  if (job->nconsumers == 0)
    return;
  fprintf(out,
          "    consumers: %u; pushes: %llu, plans built for them: %llu\n",
          job->nconsumers, (unsigned long long)job->pushes,
          (unsigned long long)job->push_plans);
  fprintf(out, "    %-10s%-11s%-6s%-14s%s\n", "CONSUMER", "STATE", "NODE",
          "RECEIVED", "DEVICE");
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    const sp_consumer_status *k = &job->consumers[i];
    char state[CELL], device[CELL], received[32], node[24] = "-";
    sp__text_sanitize(k->state, state, sizeof state);
    sp__text_sanitize(k->device, device, sizeof device);
    sp_format_bytes(k->bytes_received, received, sizeof received);
    if (k->node >= 0)
      snprintf(node, sizeof node, "%lld", (long long)k->node);
    fprintf(out, "    %-10u%-11s%-6s%-14s%s\n", k->index, state, node,
            received, device[0] ? device : "-");
  }
}

/* What a job's row cannot say: the pool being prepared before round 1
 * (a big first export spends most of its time there), and the ranks that
 * asked while the others have not. */
static void print_progress_notes(FILE *out, const sp_job_status *job) {
  if (job->bytes_to_prepare > 0 && strcmp(job->phase, "allocating") == 0) {
    char done[32], total[32];
    sp_format_bytes(job->bytes_prepared, done, sizeof done);
    sp_format_bytes(job->bytes_to_prepare, total, sizeof total);
    fprintf(out, "    preparing the pool: %s of %s\n", done, total);
  }
  if (job->bytes_to_write > 0 && strcmp(job->phase, "writing") == 0) {
    char done[32], total[32];
    sp_format_bytes(job->bytes_written, done, sizeof done);
    sp_format_bytes(job->bytes_to_write, total, sizeof total);
    fprintf(out, "    writing the checkpoint: %s of %s\n", done, total);
  }
  if (job->asked > 0 && strcmp(job->phase, "waiting") == 0)
    fprintf(out, "    asked: %u of %u ranks (`shardport status JOB` shows "
            "which)\n",
            job->asked, job->world);
}

/* The jobs as a table whose columns fit their widest cell. */
static void print_jobs(FILE *out, const sp_status_info *st) {
  enum { ID, PHASE, RANKS, ROUND, MOVED, RATE, NCOLS };
  static const char *const heads[NCOLS] = {"JOB",   "PHASE",         "RANKS",
                                           "ROUND", "MOVED OF TOTAL", "RATE"};
  size_t width[NCOLS];
  for (int c = 0; c < NCOLS; c++)
    width[c] = strlen(heads[c]);

  char(*cells)[NCOLS][CELL] = calloc(st->njobs, sizeof *cells);
  if (!cells) {
    fprintf(out, "  (%zu jobs; out of memory formatting them)\n", st->njobs);
    return;
  }
  for (size_t j = 0; j < st->njobs; j++) {
    const sp_job_status *job = &st->jobs[j];
    char moved[32], total[32], rate[32];
    sp__text_sanitize(job->job_id, cells[j][ID], CELL);
    sp__text_sanitize(job->phase, cells[j][PHASE], CELL);
    snprintf(cells[j][RANKS], CELL, "%u/%u", job->joined, job->world);
    snprintf(cells[j][ROUND], CELL, "%u of %u", job->round, job->rounds);
    sp_format_bytes(job->bytes_moved, moved, sizeof moved);
    sp_format_bytes(job->bytes_total, total, sizeof total);
    snprintf(cells[j][MOVED], CELL, "%s of %s", moved, total);
    /* A rate is shown while data moves; the export's own figure is in
     * the daemon's log once it published. */
    sp_format_bytes(job->rate_bps < 1.8e19 ? (uint64_t)job->rate_bps
                                           : UINT64_MAX,
                    rate, sizeof rate);
    if (strcmp(job->phase, "moving") == 0)
      snprintf(cells[j][RATE], CELL, "%s/s", rate);
    else
      snprintf(cells[j][RATE], CELL, "-");
    for (int c = 0; c < NCOLS; c++)
      if (strlen(cells[j][c]) > width[c])
        width[c] = strlen(cells[j][c]);
  }

  /* The last column is not padded: no trailing blanks. */
  for (int c = 0; c < NCOLS; c++)
    fprintf(out, "  %-*s", c < NCOLS - 1 ? (int)width[c] : 0, heads[c]);
  fputc('\n', out);
  for (size_t j = 0; j < st->njobs; j++) {
    for (int c = 0; c < NCOLS; c++)
      fprintf(out, "  %-*s", c < NCOLS - 1 ? (int)width[c] : 0, cells[j][c]);
    fputc('\n', out);
    if (st->jobs[j].error) {
      char error[CELL];
      sp__text_sanitize(st->jobs[j].error, error, sizeof error);
      fprintf(out, "    error: %s\n", error);
    }
    print_progress_notes(out, &st->jobs[j]);
    status_print_nodes(out, &st->jobs[j]);
    status_print_consumers(out, &st->jobs[j]);
  }
  free(cells);
}

static void print_table(FILE *out, const sp_status_info *st) {
  char a[CELL], b[CELL], line[2 * CELL + 64];

  sp__text_sanitize(st->daemon_version, a, sizeof a);
  row(out, "daemon version", a);
  snprintf(line, sizeof line, "%u", st->protocol_version);
  row(out, "protocol version", line);
  sp__text_sanitize(st->backends_built, a, sizeof a);
  row(out, "backends built", a[0] ? a : "none");
  sp__text_sanitize(st->backend_active, a, sizeof a);
  sp__text_sanitize(st->backend_reason, b, sizeof b);
  /* The reason's gist; --json has all of it. */
  char gist[CELL];
  bool cut = text_gist(b, gist, sizeof gist);
  snprintf(line, sizeof line, !b[0] ? "%s" : cut ? "%s (%s; --json has more)"
                                                 : "%s (%s)",
           a, gist);
  row(out, "backend active", line);
  text_duration(st->uptime_s, a, sizeof a);
  row(out, "uptime", a);
  snprintf(line, sizeof line, "%u", st->clients);
  row(out, "clients", line);
  sp_format_bytes(st->pool_used, a, sizeof a);
  sp_format_bytes(st->pool_capacity, b, sizeof b);
  if (st->pool_capacity > 0)
    snprintf(line, sizeof line, "%s used of %s (%.1f%%)", a, b,
             100.0 * (double)st->pool_used / (double)st->pool_capacity);
  else
    snprintf(line, sizeof line, "%s used of %s", a, b);
  row(out, "pool", line);
  snprintf(line, sizeof line, "%.1f ms at most per loop iteration since the "
           "last status", (double)st->loop_max_busy_us / 1000.0);
  row(out, "loop busy", line);
  if (st->peer_address) {
    sp__text_sanitize(st->peer_address, a, sizeof a);
    row(out, "peer address", a);
  }
  if (st->draining)
    row(out, "state", "stopping: no new jobs or exports while the running "
                      "ones finish");
  if (st->njobs == 0) {
    row(out, "jobs", "no jobs");
    return;
  }
  snprintf(line, sizeof line, "%zu", st->njobs);
  row(out, "jobs", line);
  print_jobs(out, st);
}

/* backends_built is comma-separated in the library's struct and an array in
 * the JSON, as on the wire. */
static void json_backends(FILE *out, const char *list) {
  fputc('[', out);
  const char *p = list;
  while (*p) {
    size_t len = strcspn(p, ",");
    char name[CELL];
    snprintf(name, sizeof name, "%.*s", (int)(len < CELL ? len : CELL - 1), p);
    if (p != list)
      fputc(',', out);
    json_string(out, name);
    p += len;
    if (*p == ',')
      p++;
  }
  fputc(']', out);
}

void status_json_job_fields(FILE *out, const sp_job_status *job) {
  fputs("\"job_id\":", out);
  json_string(out, job->job_id);
  json_str_field(out, "phase", job->phase);
  json_str_field(out, "error", job->error);
  json_u64(out, "world", job->world);
  json_u64(out, "joined", job->joined);
  json_u64(out, "round", job->round);
  json_u64(out, "rounds", job->rounds);
  json_u64(out, "bytes_moved", job->bytes_moved);
  json_u64(out, "bytes_total", job->bytes_total);
  json_double_field(out, "rate_bps", job->rate_bps);
  json_str_field(out, "plan_digest", job->plan_digest);
  json_u64(out, "asked", job->asked);
  json_u64(out, "export_id", job->export_id);
  json_u64(out, "bytes_prepared", job->bytes_prepared);
  json_u64(out, "bytes_to_prepare", job->bytes_to_prepare);
  json_u64(out, "bytes_written", job->bytes_written);
  json_u64(out, "bytes_to_write", job->bytes_to_write);
  json_u64(out, "node", job->node);
  fputs(",\"nodes\":[", out);
  for (size_t n = 0; n < job->nnodes; n++) {
    const sp_node_status *nd = &job->nodes[n];
    fprintf(out, "%s{\"node\":%u", n ? "," : "", nd->node);
    json_str_field(out, "address", nd->address);
    fprintf(out, ",\"self\":%s,\"connected\":%s", nd->self ? "true" : "false",
            nd->connected ? "true" : "false");
    json_u64(out, "bytes_sent", nd->bytes_sent);
    json_u64(out, "bytes_received", nd->bytes_received);
    fputc('}', out);
  }
  fputc(']', out);
  json_u64(out, "pushes", job->pushes);
  json_u64(out, "push_plans", job->push_plans);
  fputs(",\"consumers\":[", out);
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    const sp_consumer_status *k = &job->consumers[i];
    fprintf(out, "%s{\"index\":%u", i ? "," : "", k->index);
    json_str_field(out, "state", k->state);
    if (k->node >= 0)
      json_u64(out, "node", (uint64_t)k->node);
    json_str_field(out, "device", k->device);
    json_u64(out, "bytes_received", k->bytes_received);
    fputc('}', out);
  }
  fputc(']', out);
}

static void print_json(FILE *out, const sp_status_info *st,
                       const struct cli_options *opts) {
  fputs("{\"socket\":", out);
  json_string(out, opts->socket);
  json_str_field(out, "daemon_version", st->daemon_version);
  json_u64(out, "protocol_version", st->protocol_version);
  fputs(",\"backends_built\":", out);
  json_backends(out, st->backends_built);
  json_str_field(out, "backend_active", st->backend_active);
  json_str_field(out, "backend_reason", st->backend_reason);
  fputs(",\"uptime_s\":", out);
  json_double(out, st->uptime_s);
  json_u64(out, "clients", st->clients);
  json_u64(out, "pool_used", st->pool_used);
  json_u64(out, "pool_capacity", st->pool_capacity);
  fputs(",\"jobs\":[", out);
  for (size_t j = 0; j < st->njobs; j++) {
    fputs(j ? ",{" : "{", out);
    status_json_job_fields(out, &st->jobs[j]);
    fputc('}', out);
  }
  fputs("]", out);
  json_str_field(out, "peer_address", st->peer_address);
  fprintf(out, ",\"draining\":%s", st->draining ? "true" : "false");
  json_u64(out, "loop_max_busy_us", st->loop_max_busy_us);
  fputs("}\n", out);
}

static int status_exec(sp_client *client, const struct cli_options *opts,
                       FILE *out) {
  if (opts->job)
    return job_show_exec(client, opts, out);
  sp_status_info *st;
  int rc = sp_status(client, &st);
  if (rc < 0)
    return rc;
  if (opts->json)
    print_json(out, st, opts);
  else
    print_table(out, st);
  sp_status_free(st);
  return 0;
}

const struct cli_command cli_status_command = {
    .name = "status",
    .args = "[JOB]",
    .summary = "show the daemon, its backends, memory pool and jobs; or one "
               "job in full",
    .flags = CLI_TAKES_JSON | CLI_TAKES_WATCH | CLI_TAKES_JOB,
    .exec = status_exec,
};
