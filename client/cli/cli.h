/*
 * cli.h - what the files of the `shardport` command share, one section per
 * file.  Every command is a table entry (name, usage, exec) in its own file,
 * like tmux's cmd-*.c.
 */
#ifndef SP_CLI_H
#define SP_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/text.h"
#include "shardport.h"

/* Exit statuses, documented in docs/cli.md. */
#define CLI_EXIT_OK 0
#define CLI_EXIT_ERROR 1
#define CLI_EXIT_USAGE 2
#define CLI_EXIT_NODAEMON 3

/* The global options, parsed once by main.c. */
struct cli_options {
  const char *socket; /* --socket, or the default path */
  bool socket_given;  /* --socket was given */
  bool json;          /* --json */
  double watch_s;     /* --watch; 0 prints once */
  const char *job;    /* the JOB argument (1 to 32 hex digits), or NULL */
};

/* Which global options a command accepts besides --socket, and whether it
 * takes a JOB argument (may, or must). */
#define CLI_TAKES_JSON 0x1u
#define CLI_TAKES_WATCH 0x2u
#define CLI_TAKES_JOB 0x4u
#define CLI_NEEDS_JOB 0x8u

struct cli_command {
  const char *name;
  const char *args; /* how the usage shows its argument: "", "[JOB]", "JOB" */
  const char *summary;
  unsigned flags;
  /* Prints one snapshot to out.  Returns 0 or the SP_E* code of the call
   * that failed; the caller reports it. */
  int (*exec)(sp_client *client, const struct cli_options *opts, FILE *out);
};

/* status.c, ping.c, jobs.c, abort.c */
extern const struct cli_command cli_status_command;
extern const struct cli_command cli_ping_command;
extern const struct cli_command cli_jobs_command;
extern const struct cli_command cli_abort_command;

/* status.c: a job object's fields in `status --json` (docs/cli.md), without
 * its braces, so that `status JOB --json` writes the same ones and more. */
void status_json_job_fields(FILE *out, const sp_job_status *job);
/* A job across nodes: its plan digest and one line per daemon, indented
 * under the job; nothing for a job on one daemon. */
void status_print_nodes(FILE *out, const sp_job_status *job);
void status_print_consumers(FILE *out, const sp_job_status *job);

/* job.c: `status JOB`, one job in full, as a table or one JSON object. */
int job_show_exec(sp_client *client, const struct cli_options *opts,
                  FILE *out);

/* main.c: prints "shardport: <what>: <text>" (and the daemon's own message
 * when client holds one) to stderr; returns the exit status for code. */
int cli_report(const char *what, int code, const sp_client *client);
/* The longest explanation of a failed connection. */
#define CLI_WHY_MAX 2048
/* Connects to the daemon opts names: 0, or a code with the library's
 * explanation in why (sp_connect_explain). */
int cli_connect(const struct cli_options *opts, sp_client **client, char *why,
                size_t whylen);
/* Prints "shardport: <why>"; returns the exit status for code. */
int cli_report_connect(int code, const char *why);

/* watch.c: connects and runs cmd every opts->watch_s seconds until SIGINT
 * or SIGTERM; redraws in place when stdout is a terminal, under a line
 * with the time; while the daemon is away (restarting) it says so and
 * connects again at the next tick.  Returns an exit status. */
int watch_run(const struct cli_command *cmd, const struct cli_options *opts);

/* text.c (terminal-safe strings are proto/text.h's sp__text_sanitize, byte
 * counts shardport.h's sp_format_bytes) */
/* The gist of a long reason: its first two clauses ("a: b: c; d (e)"
 * gives "a: b"), at most size - 1 bytes.  True when anything was left
 * out. */
bool text_gist(const char *s, char *buf, size_t size);
/* "0s", "59s", "1m 0s", "2h 3m 4s", "5d 2h 3m 4s". */
void text_duration(double seconds, char *buf, size_t size);
/* A user by name ("alice"), or by number when it has none here ("1234"). */
void text_user(uint32_t uid, char *buf, size_t size);
/* A table whose columns fit their widest cell: measure the head and every
 * row, then print them, each row one line after indent. */
#define TEXT_TABLE_MAX_COLS 12
struct text_table {
  size_t ncols;
  size_t width[TEXT_TABLE_MAX_COLS];
};
void text_table_measure(struct text_table *t, const char *const *row);
void text_table_row(const struct text_table *t, FILE *out, const char *indent,
                    const char *const *row);

/* json.c */
/* s as a JSON string: quotes, backslash and control characters escaped,
 * valid UTF-8 passed through, each byte of invalid UTF-8 as U+FFFD. */
void json_string(FILE *out, const char *s);
/* A finite double as the shortest text that reads back to the same value;
 * JSON has no NaN or infinity, so those print as null. */
void json_double(FILE *out, double v);
/* ,"key":v for an unsigned integer, a string (null when NULL) and a
 * double, after the first field of an object. */
void json_u64(FILE *out, const char *key, uint64_t v);
void json_str_field(FILE *out, const char *key, const char *v);
void json_double_field(FILE *out, const char *key, double v);

#endif /* SP_CLI_H */
