/*
 * abort.c - `shardport abort JOB`: end a job for good.  Its ranks' running
 * or waiting export fails with `aborted`, naming who aborted it, and their
 * connections end; only the job's owner and root may.
 */
#include "client/cli/cli.h"

static int abort_exec(sp_client *client, const struct cli_options *opts,
                      FILE *out) {
  char job_id[64];
  int rc = sp_job_abort(client, opts->job, job_id, sizeof job_id);
  if (rc < 0)
    return rc;
  if (opts->json) {
    fputs("{\"socket\":", out);
    json_string(out, opts->socket);
    json_str_field(out, "job_id", job_id);
    fputs("}\n", out);
  } else {
    char safe[256];
    sp__text_sanitize(job_id, safe, sizeof safe);
    fprintf(out, "aborted job %s\n", safe);
  }
  return 0;
}

const struct cli_command cli_abort_command = {
    .name = "abort",
    .args = "JOB",
    .summary = "abort a job: its ranks' exports fail and their connections "
               "end (the job's owner or root)",
    .flags = CLI_TAKES_JSON | CLI_NEEDS_JOB,
    .exec = abort_exec,
};
