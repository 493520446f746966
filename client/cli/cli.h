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
};

/* Which global options a command accepts besides --socket. */
#define CLI_TAKES_JSON 0x1u
#define CLI_TAKES_WATCH 0x2u

struct cli_command {
  const char *name;
  const char *summary;
  unsigned flags;
  /* Prints one snapshot to out.  Returns 0 or the SP_E* code of the call
   * that failed; the caller reports it. */
  int (*exec)(sp_client *client, const struct cli_options *opts, FILE *out);
};

/* status.c, ping.c */
extern const struct cli_command cli_status_command;
extern const struct cli_command cli_ping_command;

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

/* text.c */
/* Bytes in the valid UTF-8 sequence at s (n > 0 bytes available), 0 when
 * it is not one; *cp receives the code point. */
size_t text_utf8_len(const unsigned char *s, size_t n, uint32_t *cp);
/* s made safe for a terminal: control characters and invalid UTF-8 become
 * \xNN escapes; truncated to fit size (always terminated). */
void text_sanitize(const char *s, char *buf, size_t size);
/* The gist of a long reason: its first two clauses ("a: b: c; d (e)"
 * gives "a: b"), at most size - 1 bytes.  True when anything was left
 * out. */
bool text_gist(const char *s, char *buf, size_t size);
/* "0s", "59s", "1m 0s", "2h 3m 4s", "5d 2h 3m 4s". */
void text_duration(double seconds, char *buf, size_t size);

/* json.c */
/* s as a JSON string: quotes, backslash and control characters escaped,
 * valid UTF-8 passed through, each byte of invalid UTF-8 as U+FFFD. */
void json_string(FILE *out, const char *s);
/* A finite double as the shortest text that reads back to the same value;
 * JSON has no NaN or infinity, so those print as null. */
void json_double(FILE *out, double v);

#endif /* SP_CLI_H */
