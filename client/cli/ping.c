/*
 * ping.c - `shardport ping`: one round trip to the daemon.
 */
#include "client/cli/cli.h"

static int ping_exec(sp_client *client, const struct cli_options *opts,
                     FILE *out) {
  uint64_t rtt_ns;
  int rc = sp_ping(client, &rtt_ns);
  if (rc < 0)
    return rc;
  if (opts->json) {
    fputs("{\"socket\":", out);
    json_string(out, opts->socket);
    fprintf(out, ",\"rtt_ns\":%llu}\n", (unsigned long long)rtt_ns);
  } else {
    char socket[256];
    sp__text_sanitize(opts->socket, socket, sizeof socket);
    fprintf(out, "pong from %s: rtt %.3f ms\n", socket, (double)rtt_ns / 1e6);
  }
  return 0;
}

const struct cli_command cli_ping_command = {
    .name = "ping",
    .args = "",
    .summary = "measure one round trip to the daemon",
    .flags = CLI_TAKES_JSON,
    .exec = ping_exec,
};
