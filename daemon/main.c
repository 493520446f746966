/*
 * main.c - shardportd's command line.
 *
 * Settings come from, lowest first: the built-in defaults, the
 * configuration file, SHARDPORT_SOCKET (socket only), then the flags.
 * Exit codes (docs/operations.md): 0 clean exit, 1 bad configuration,
 * 2 bad command line, 3 could not start serving.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "build_config.h"
#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/detach.h"
#include "daemon/listen.h"
#include "daemon/log.h"
#include "daemon/server.h"

#define EXIT_CONFIG 1
#define EXIT_USAGE 2
#define EXIT_SERVE 3


static void usage(FILE *out) {
  fprintf(out,
          "usage: shardportd [options]\n"
          "\n"
          "  -s, --socket PATH        listen on PATH (default: $SHARDPORT_SOCKET,\n"
          "                           /run/shardport/shardport.sock as root,\n"
          "                           else $XDG_RUNTIME_DIR/shardport.sock)\n"
          "  -c, --config FILE        configuration file (default: %s)\n"
          "  -d, --detach             serve in the background once listening;\n"
          "                           print the daemon's pid, or exit with its\n"
          "                           error when it cannot start\n"
          "  -l, --log-level LEVEL    error, warn, info or debug\n"
          "  -b, --backend NAME       auto, host or cuda\n"
          "      --peer-listen ADDR:PORT\n"
          "                           listen for other daemons (jobs across\n"
          "                           nodes); port 0 takes any free port\n"
          "      --peer-advertise ADDR[:PORT]\n"
          "                           the address other daemons dial\n"
          "      --metrics-listen ADDR:PORT\n"
          "                           serve Prometheus metrics at\n"
          "                           http://ADDR:PORT/metrics (default: off)\n"
          "  -n, --check              check the configuration and the socket's\n"
          "                           directory, and exit\n"
          "      --print-config       print every setting and exit\n"
          "  -V, --version            print the version and exit\n"
          "  -h, --help               print this help and exit\n",
          SP_CONFIG_FILE);
}

enum { OPT_PRINT_CONFIG = 256, OPT_PEER_LISTEN, OPT_PEER_ADVERTISE,
       OPT_METRICS_LISTEN };

static const struct option long_options[] = {
    {"socket", required_argument, NULL, 's'},
    {"config", required_argument, NULL, 'c'},
    {"detach", no_argument, NULL, 'd'},
    {"log-level", required_argument, NULL, 'l'},
    {"backend", required_argument, NULL, 'b'},
    {"check", no_argument, NULL, 'n'},
    {"print-config", no_argument, NULL, OPT_PRINT_CONFIG},
    {"peer-listen", required_argument, NULL, OPT_PEER_LISTEN},
    {"peer-advertise", required_argument, NULL, OPT_PEER_ADVERTISE},
    {"metrics-listen", required_argument, NULL, OPT_METRICS_LISTEN},
    {"version", no_argument, NULL, 'V'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* A flag that overrides a configuration key, applied after the file. */
static void add_flag(struct config_origin *o, const char *key,
                     const char *value) {
  for (size_t i = 0; i < o->nflags; i++)
    if (strcmp(o->flags[i].key, key) == 0) {
      o->flags[i].value = value;
      return;
    }
  o->flags[o->nflags++] = (struct config_flag){key, value};
}

int main(int argc, char **argv) {
  log_init(LOG_LEVEL_INFO);
  const char *config_path = NULL;
  struct config_origin origin = {.nflags = 0};
  bool check = false, print = false, detach = false;
  int opt;
  while ((opt = getopt_long(argc, argv, "s:c:dl:b:nVh", long_options, NULL)) !=
         -1) {
    switch (opt) {
    case 's':
      add_flag(&origin, "socket", optarg);
      break;
    case 'c':
      config_path = optarg;
      break;
    case 'd':
      detach = true;
      break;
    case 'l':
      add_flag(&origin, "log_level", optarg);
      break;
    case 'b':
      add_flag(&origin, "backend", optarg);
      break;
    case 'n':
      check = true;
      break;
    case OPT_PRINT_CONFIG:
      print = true;
      break;
    case OPT_PEER_LISTEN:
      add_flag(&origin, "peer_listen", optarg);
      break;
    case OPT_PEER_ADVERTISE:
      add_flag(&origin, "peer_advertise", optarg);
      break;
    case OPT_METRICS_LISTEN:
      add_flag(&origin, "metrics_listen", optarg);
      break;
    case 'V':
      printf("shardportd %s (protocol %d)\n", SP_VERSION, SP_PROTOCOL_VERSION);
      return 0;
    case 'h':
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return EXIT_USAGE;
    }
  }
  if (optind != argc) {
    fprintf(stderr, "shardportd: unexpected argument \"%s\"\n", argv[optind]);
    usage(stderr);
    return EXIT_USAGE;
  }

  struct config cfg;
  char err[512];
  origin.path = config_path != NULL ? config_path : SP_CONFIG_FILE;
  origin.must_exist = config_path != NULL;
  int built = config_build(&origin, &cfg, err, sizeof(err));
  if (built == CONFIG_EFLAG) {
    fprintf(stderr, "shardportd: %s\n", err);
    return EXIT_USAGE;
  }
  if (built != 0) {
    log_msg(LOG_LEVEL_ERROR, "%s", err);
    return EXIT_CONFIG;
  }
  /* Before the backend: the CUDA runtime must never see a fork. */
  if (detach && !print && !check && detach_start() != 0) {
    log_msg(LOG_LEVEL_ERROR, "--detach: cannot fork: %s", strerror(errno));
    return EXIT_SERVE;
  }
  struct backend_choice backend;
  if (backend_select(cfg.backend, &backend, err, sizeof(err)) != 0) {
    log_msg(LOG_LEVEL_ERROR, "%s", err);
    return EXIT_CONFIG;
  }
  if (print)
    config_print(&cfg, stdout);
  if (check) {
    /* What starting would refuse (socket activation aside, which -n
     * cannot see): the socket's directory. */
    if (listen_check(&cfg, err, sizeof(err)) != 0) {
      log_msg(LOG_LEVEL_ERROR, "%s", err);
      backend_release(&backend);
      return EXIT_SERVE;
    }
    char file[PATH_MAX + 64];
    config_describe_file(&cfg, file, sizeof file);
    fprintf(stderr,
            "shardportd: configuration OK (file %s; socket %s; backend %s: "
            "%s)\n",
            file, cfg.socket, backend.active, backend.reason);
  }
  if (print || check) {
    backend_release(&backend);
    return 0;
  }

  log_set_level(cfg.log_level);
  /* Replies are written with MSG_NOSIGNAL; this covers every other write to
   * a peer that went away.  SIGHUP reloads the configuration (server.c). */
  signal(SIGPIPE, SIG_IGN);
  int rc = server_run(&origin, &cfg, &backend);
  backend_release(&backend);
  return rc == 0 ? 0 : EXIT_SERVE;
}
