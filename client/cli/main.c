/*
 * main.c - `shardport`: global options, the command table, exit statuses.
 *
 * Options may come before or after the command (`shardport --json status`
 * and `shardport status --json` are the same); `--` ends them.  The parser is
 * our own rather than getopt_long, whose reordering changes with
 * POSIXLY_CORRECT.  The program never calls setlocale, so numbers always
 * print with a '.' as JSON needs.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "build_config.h"
#include "client/cli/cli.h"

static const struct cli_command *const commands[] = {
    &cli_status_command,
    &cli_jobs_command,
    &cli_abort_command,
    &cli_ping_command,
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

/* The longest --watch interval: a day. */
#define WATCH_MAX_S 86400.0
/* A job id has 32 hex digits; a command takes it or a prefix of it. */
#define JOB_HEX_MAX 32

static void print_usage(FILE *out) {
  fputs("usage: shardport [--socket PATH] [--json] [--watch SECONDS] COMMAND "
        "[JOB]\n"
        "       shardport --help | --version\n"
        "\n"
        "commands:\n",
        out);
  for (size_t i = 0; i < NCOMMANDS; i++) {
    char name[32];
    snprintf(name, sizeof name, "%s%s%s", commands[i]->name,
             commands[i]->args[0] ? " " : "", commands[i]->args);
    fprintf(out, "  %-14s  %s\n", name, commands[i]->summary);
  }
  fputs("  help            show this help\n"
        "\n"
        "options (before or after the command):\n"
        "  -s, --socket PATH      the daemon's socket; default $SHARDPORT_SOCKET,\n"
        "                         /run/shardport/shardport.sock for root, else\n"
        "                         $XDG_RUNTIME_DIR/shardport.sock when it exists,\n"
        "                         else /run/shardport/shardport.sock\n"
        "  -j, --json             print one JSON object per snapshot (status, jobs,\n"
        "                         abort, ping)\n"
        "  -w, --watch SECONDS    redraw every SECONDS until interrupted (status,\n"
        "                         jobs)\n"
        "  -h, --help             show this help\n"
        "  -V, --version          show the version and the protocol version\n"
        "\n"
        "JOB is a job id as `shardport jobs` lists it, or any prefix of it that\n"
        "names one job.\n"
        "\n"
        "exit status: 0 ok, 1 error, 2 usage error, 3 daemon not running\n",
        out);
}

static int usage_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("shardport: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\nTry 'shardport --help'.\n", stderr);
  va_end(ap);
  return CLI_EXIT_USAGE;
}

int cli_report(const char *what, int code, const sp_client *client) {
  /* The daemon's message is at most 1024 bytes; escaping can quadruple it. */
  char safe_what[512], detail[4 * 1024 + 1];
  sp__text_sanitize(what, safe_what, sizeof safe_what);
  sp__text_sanitize(client ? sp_last_message(client) : "", detail,
                    sizeof detail);
  if (detail[0])
    fprintf(stderr, "shardport: %s: %s (%s)\n", safe_what, sp_strerror(code),
            detail);
  else
    fprintf(stderr, "shardport: %s: %s\n", safe_what, sp_strerror(code));
  return code == SP_ENODAEMON ? CLI_EXIT_NODAEMON : CLI_EXIT_ERROR;
}

/* What the command line asked for. */
struct cli_args {
  struct cli_options opts;
  const char *command;
  const char *watch_arg;
  bool help, version;
};

enum opt_id { OPT_SOCKET, OPT_JSON, OPT_WATCH, OPT_HELP, OPT_VERSION };

static const struct {
  const char *long_name;
  char short_name;
  bool takes_value;
  enum opt_id id;
} options[] = {
    {"socket", 's', true, OPT_SOCKET}, {"json", 'j', false, OPT_JSON},
    {"watch", 'w', true, OPT_WATCH},   {"help", 'h', false, OPT_HELP},
    {"version", 'V', false, OPT_VERSION},
};
#define NOPTIONS (sizeof options / sizeof options[0])

/* Finds the option arg names; *inline_value gets the text after '=' of a
 * "--name=value".  Returns its index or -1. */
static int find_option(const char *arg, const char **inline_value) {
  *inline_value = NULL;
  if (arg[1] != '-') {
    for (size_t i = 0; i < NOPTIONS; i++)
      if (arg[1] == options[i].short_name && arg[2] == '\0')
        return (int)i;
    return -1;
  }
  const char *name = arg + 2;
  size_t len = strcspn(name, "=");
  for (size_t i = 0; i < NOPTIONS; i++)
    if (strlen(options[i].long_name) == len &&
        strncmp(name, options[i].long_name, len) == 0) {
      if (name[len] == '=')
        *inline_value = name + len + 1;
      return (int)i;
    }
  return -1;
}

static int parse_args(int argc, char **argv, struct cli_args *a) {
  bool options_done = false;
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (options_done || arg[0] != '-' || arg[1] == '\0') {
      if (a->command && a->opts.job)
        return usage_error("unexpected argument '%s'", arg);
      if (a->command)
        a->opts.job = arg;
      else
        a->command = arg;
      continue;
    }
    if (strcmp(arg, "--") == 0) {
      options_done = true;
      continue;
    }
    const char *value;
    int o = find_option(arg, &value);
    if (o < 0)
      return usage_error("unknown option '%s'", arg);
    if (options[o].takes_value && !value) {
      if (i + 1 >= argc)
        return usage_error("option '%s' needs a value", arg);
      value = argv[++i];
    } else if (!options[o].takes_value && value) {
      return usage_error("option '%s' takes no value", arg);
    }
    switch (options[o].id) {
    case OPT_SOCKET:
      a->opts.socket = value;
      a->opts.socket_given = true;
      break;
    case OPT_JSON:
      a->opts.json = true;
      break;
    case OPT_WATCH:
      a->watch_arg = value;
      break;
    case OPT_HELP:
      a->help = true;
      break;
    case OPT_VERSION:
      a->version = true;
      break;
    }
  }
  return CLI_EXIT_OK;
}

static const struct cli_command *find_command(const char *name) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (strcmp(commands[i]->name, name) == 0)
      return commands[i];
  return NULL;
}

static bool is_job_ref(const char *s) {
  size_t len = strlen(s);
  return len >= 1 && len <= JOB_HEX_MAX &&
         strspn(s, "0123456789abcdefABCDEF") == len;
}

/* Checks the parsed options against the command.  Returns an exit status. */
static int check_args(struct cli_args *a, const struct cli_command *cmd) {
  if (a->opts.job && !(cmd->flags & (CLI_TAKES_JOB | CLI_NEEDS_JOB)))
    return usage_error("unexpected argument '%s'", a->opts.job);
  if (!a->opts.job && (cmd->flags & CLI_NEEDS_JOB))
    return usage_error("'%s' needs a JOB (a job id, or a prefix of one)",
                       cmd->name);
  if (a->opts.job && !is_job_ref(a->opts.job))
    return usage_error("'%s' is not a job id (1 to %d hex digits)",
                       a->opts.job, JOB_HEX_MAX);
  if (a->opts.json && !(cmd->flags & CLI_TAKES_JSON))
    return usage_error("'%s' does not take --json", cmd->name);
  if (!a->watch_arg)
    return CLI_EXIT_OK;
  if (!(cmd->flags & CLI_TAKES_WATCH))
    return usage_error("'%s' does not take --watch", cmd->name);
  char *end;
  errno = 0;
  double s = strtod(a->watch_arg, &end);
  if (errno != 0 || end == a->watch_arg || *end != '\0' || !isfinite(s) ||
      s <= 0 || s > WATCH_MAX_S)
    return usage_error("--watch needs seconds between 0 and 86400, not '%s'",
                       a->watch_arg);
  a->opts.watch_s = s;
  return CLI_EXIT_OK;
}

int cli_connect(const struct cli_options *opts, sp_client **client,
                char *why, size_t whylen) {
  /* The library resolves a default path itself, so that its explanation
   * says where the path came from. */
  return sp_connect_explain(opts->socket_given ? opts->socket : NULL, client,
                            why, whylen);
}

int cli_report_connect(int code, const char *why) {
  char safe[4 * CLI_WHY_MAX + 1];
  sp__text_sanitize(why, safe, sizeof safe);
  fprintf(stderr, "shardport: %s\n", safe);
  return code == SP_ENODAEMON ? CLI_EXIT_NODAEMON : CLI_EXIT_ERROR;
}

/* Connects, runs the command once or under --watch, closes. */
static int run(const struct cli_command *cmd, const struct cli_options *opts) {
  if (opts->watch_s > 0)
    return watch_run(cmd, opts);
  sp_client *client;
  char why[CLI_WHY_MAX];
  int rc = cli_connect(opts, &client, why, sizeof why);
  if (rc < 0)
    return cli_report_connect(rc, why);
  rc = cmd->exec(client, opts, stdout);
  int status = rc < 0 ? cli_report(cmd->name, rc, client) : CLI_EXIT_OK;
  sp_close(client);
  return status;
}

int main(int argc, char **argv) {
  struct cli_args a = {0};
  int status = parse_args(argc, argv, &a);
  if (status != CLI_EXIT_OK)
    return status;
  if (a.help || (a.command && strcmp(a.command, "help") == 0)) {
    print_usage(stdout);
    return CLI_EXIT_OK;
  }
  if (a.version) {
    printf("shardport %s (protocol %d)\n", SP_VERSION, SP_PROTOCOL_VERSION);
    return CLI_EXIT_OK;
  }
  if (!a.command)
    return usage_error("no command given");
  const struct cli_command *cmd = find_command(a.command);
  if (!cmd)
    return usage_error("unknown command '%s'", a.command);
  status = check_args(&a, cmd);
  if (status != CLI_EXIT_OK)
    return status;

  /* The path the output names (status --json, ping). */
  char default_socket[4096];
  if (!a.opts.socket) {
    sp_default_socket_path(default_socket, sizeof default_socket);
    a.opts.socket = default_socket;
  }

  status = run(cmd, &a.opts);
  if (fflush(stdout) != 0 || ferror(stdout)) {
    fprintf(stderr, "shardport: writing output: %s\n", strerror(errno));
    return CLI_EXIT_ERROR;
  }
  return status;
}
