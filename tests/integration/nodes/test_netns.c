/*
 * test_netns.c - a link cut between two daemons.
 *
 * Each daemon runs in a network namespace of its own, the two joined by a
 * veth pair (10.213.7.1 and .2); trainers reach them through their Unix
 * sockets, which live in the file system, not the network.  While an
 * export moves data the link goes down (`ip link set down`): no connection
 * closes, nothing more arrives.  The ranks on both sides must fail with
 * node_lost naming the node across the cut within the export's timeout,
 * both daemons must free the export's memory, and a job on each side alone
 * must still run.
 *
 * A second case puts IPv6 addresses of two /64s on the pair: one machine
 * cycling the addresses of its /64 must count as one host at
 * peer_handshakes (daemon/mesh/peerhost.c), so that its flood drops its own
 * links, not another daemon's handshake.
 *
 * Needs root and `ip netns`; where either is missing it says so on stdout
 * and stderr and exits 77, which meson reports as a skipped test.
 */
#include <arpa/inet.h>
#include <check.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/trainer.h"

#define SKIP 77

static char ns[2][32], veth[2][16];
static char wrapper_dir[256];
static struct sp_test_daemon daemons[2];

/* Runs a command quietly: its exit status, or -1. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int sh(const char *fmt, ...) {
  char cmd[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  char quiet[600];
  snprintf(quiet, sizeof quiet, "%s >/dev/null 2>&1", cmd);
  int st = system(quiet);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void teardown_net(void) {
  for (int i = 0; i < 2; i++)
    if (ns[i][0] != '\0')
      sh("ip netns del %s", ns[i]);
  if (wrapper_dir[0] != '\0')
    sp_test_rmdir(wrapper_dir);
}

/* Two namespaces and a veth pair between them; 0, or why not. */
static const char *setup_net(void) {
  if (geteuid() != 0)
    return "not root";
  if (sh("ip -V") != 0)
    return "no `ip` command";
  int id = (int)(getpid() % 100000);
  for (int i = 0; i < 2; i++) {
    snprintf(ns[i], sizeof ns[i], "sp-test-%d-%c", id, 'a' + i);
    snprintf(veth[i], sizeof veth[i], "spv%d%c", id, 'a' + i);
    if (sh("ip netns add %s", ns[i]) != 0) {
      ns[i][0] = '\0';
      return "`ip netns add` failed (no CAP_SYS_ADMIN, or no network "
             "namespaces in this kernel or container)";
    }
  }
  if (sh("ip link add %s type veth peer name %s", veth[0], veth[1]) != 0)
    return "`ip link add ... type veth` failed";
  for (int i = 0; i < 2; i++)
    if (sh("ip link set %s netns %s", veth[i], ns[i]) != 0 ||
        sh("ip -n %s addr add 10.213.7.%d/24 dev %s", ns[i], i + 1,
           veth[i]) != 0 ||
        sh("ip -n %s link set %s up", ns[i], veth[i]) != 0 ||
        sh("ip -n %s link set lo up", ns[i]) != 0)
      return "configuring the veth pair failed";
  if (sh("ip netns exec %s ping -c 1 -W 2 10.213.7.2", ns[0]) != 0 &&
      sh("ip netns exec %s true", ns[0]) != 0)
    return "`ip netns exec` does not work here";
  return NULL;
}

/* $SHARDPORTD run inside namespace i, listening on listen with these
 * configuration lines: a wrapper the harness execs. */
static void start_daemon_on(int i, const char *listen, const char *conf) {
  char wrapper[300], script[600], path[300];
  snprintf(wrapper, sizeof wrapper, "%s/shardportd-%d", wrapper_dir, i);
  snprintf(script, sizeof script,
           "#!/bin/sh\nexec ip netns exec %s \"$SHARDPORTD_REAL\" \"$@\"\n",
           ns[i]);
  ck_assert_int_eq(sp_test_write_file(wrapper, script), 0);
  ck_assert_int_eq(chmod(wrapper, 0755), 0);
  snprintf(path, sizeof path, "%s/shardportd-%d.conf", wrapper_dir, i);
  ck_assert_int_eq(sp_test_write_file(path, conf), 0);
  const char *args[] = {"--config", path, "--peer-listen", listen, NULL};
  setenv("SHARDPORTD", wrapper, 1);
  setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", "150", 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemons[i], args), 0);
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
  setenv("SHARDPORTD", getenv("SHARDPORTD_REAL"), 1);
}

static void start_daemon(int i) {
  char listen[32];
  snprintf(listen, sizeof listen, "10.213.7.%d:0", i + 1);
  start_daemon_on(i, listen, "");
}

static void start(void) {
  start_daemon(0);
  start_daemon(1);
}

static void stop(void) {
  for (int i = 0; i < 2; i++)
    if (daemons[i].pid > 0)
      ck_assert_int_eq(sp_test_daemon_stop(&daemons[i]), 0);
}

static struct tkey keys[48];
static char names[48][8];

static void assert_lost(const struct world *w, uint32_t rank,
                        uint32_t node) {
  char name[32];
  snprintf(name, sizeof name, "node %u (10.213.7.%u:", node, node + 1);
  ck_assert_msg(w->rep[rank].export_rc == SP_ENODELOST, "rank %u: %s: %s",
                rank, sp_err_name(w->rep[rank].export_rc),
                w->rep[rank].message);
  ck_assert_msg(strstr(w->rep[rank].message, name) != NULL,
                "rank %u's message does not name %s: %s", rank, name,
                w->rep[rank].message);
}

static void assert_pool_free(int i) {
  sp_client *c;
  sp_status_info *st = NULL;
  for (int tries = 0; tries < 200; tries++) {
    ck_assert_int_eq(sp_connect(daemons[i].socket, &c), 0);
    ck_assert_int_eq(sp_status(c, &st), 0);
    sp_close(c);
    bool idle = st->pool_used == 0 && st->njobs == 0;
    sp_status_free(st);
    if (idle)
      return;
    struct timespec ts = {0, 25 * 1000000L};
    nanosleep(&ts, NULL);
  }
  ck_assert_msg(0, "daemon %d did not free the failed export", i);
}

START_TEST(link_cut_mid_round) {
  for (int i = 0; i < 48; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 4096}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4, .nkeys = 48, .keys = keys,
                        .max_keys = 4, .timeout_ms = 2000};
  const char *sockets[4] = {daemons[0].socket, daemons[0].socket,
                            daemons[1].socket, daemons[1].socket};
  struct world w;
  trainer_start(&w, &sc, sockets);
  trainer_wait_moving(&w, 0);
  ck_assert_int_eq(sh("ip -n %s link set %s down", ns[0], veth[0]), 0);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  trainer_finish(&w, &sc);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  /* Each side names the other: from either, the other is what was lost. */
  assert_lost(&w, 0, 1);
  assert_lost(&w, 1, 1);
  assert_lost(&w, 2, 0);
  assert_lost(&w, 3, 0);
  /* The timeout (2 s) and the grace before a silent root is given up,
   * plus a round's pause: well under ten seconds. */
  ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 10);
  trainer_free(&w, &sc);
  assert_pool_free(0);
  assert_pool_free(1);
  /* Each side still serves a job of its own. */
  for (int i = 0; i < 2; i++) {
    struct tkey small[] = {K(.name = "x", .kind = SHARD0, .dtype = "float32",
                             .es = 4, .ndim = 1, .shape = {5},
                             .parts = {2, 3})};
    struct scenario one = {.world = 2, .nkeys = 1, .keys = small};
    const char *both[2] = {daemons[i].socket, daemons[i].socket};
    trainer_start(&w, &one, both);
    trainer_finish(&w, &one);
    trainer_assert_exported(&w, &one);
    trainer_free(&w, &one);
  }
}
END_TEST

/* ---- hosts by IPv6 prefix ---- */

/* A TCP connection from source to [fd53::1]:port, connected, then
 * non-blocking. */
static int dial6(const char *source, uint16_t port) {
  int s = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in6 from = {.sin6_family = AF_INET6};
  struct sockaddr_in6 to = {.sin6_family = AF_INET6, .sin6_port = htons(port)};
  if (s < 0 || inet_pton(AF_INET6, source, &from.sin6_addr) != 1 ||
      inet_pton(AF_INET6, "fd53::1", &to.sin6_addr) != 1 ||
      bind(s, (struct sockaddr *)&from, sizeof from) != 0 ||
      connect(s, (struct sockaddr *)&to, sizeof to) != 0) {
    if (s >= 0)
      close(s);
    return -1;
  }
  /* The harness reads with deadlines from non-blocking sockets. */
  fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
  return s;
}

/* Reads the listener's challenge, the first frame on every link. */
static bool got_challenge(int sock) {
  struct sp_test_reply r;
  if (sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS) != 0)
    return false;
  bool ok = strcmp(r.head.op, "peer_challenge") == 0;
  sp_test_reply_free(&r);
  return ok;
}

/* In namespace 1: another daemon's link from fd53:0:0:3::1, then four
 * from the attacker's /64, fd53:0:0:2::10 to ::13, at peer_handshakes = 4.
 * The exit status says what happened: 0 when the attacker's oldest link
 * was dropped and the other daemon's kept, 1 when the other daemon's was
 * dropped, 2 when a link could not be made. */
static int flood_from_one_prefix(uint16_t port) {
  char path[128];
  snprintf(path, sizeof path, "/run/netns/%s", ns[1]);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0)
    return 2;
  int other = dial6("fd53:0:0:3::1", port);
  if (other < 0 || !got_challenge(other))
    return 2;
  int s[4];
  for (int i = 0; i < 4; i++) {
    char source[32];
    snprintf(source, sizeof source, "fd53:0:0:2::%d", 10 + i);
    if ((s[i] = dial6(source, port)) < 0 || !got_challenge(s[i]))
      return 2;
  }
  if (sp_test_wait_closed(other, 300) != SP_ETIMEOUT)
    return 1;
  return sp_test_wait_closed(s[0], SP_TEST_TIMEOUT_MS) == 0 ? 0 : 2;
}

START_TEST(ipv6_prefix_is_one_host) {
  /* The link-cut case leaves the pair down. */
  ck_assert_int_eq(sh("ip -n %s link set %s up", ns[0], veth[0]), 0);
  ck_assert_int_eq(sh("ip -n %s -6 addr add fd53::1/48 dev %s nodad", ns[0],
                      veth[0]),
                   0);
  ck_assert_int_eq(sh("ip -n %s -6 addr add fd53:0:0:3::1/48 dev %s nodad",
                      ns[1], veth[1]),
                   0);
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(sh("ip -n %s -6 addr add fd53:0:0:2::%d/48 dev %s nodad",
                        ns[1], 10 + i, veth[1]),
                     0);
  start_daemon_on(0, "[fd53::1]:0", "peer_handshakes = 4\n");
  sp_client *c;
  sp_status_info *st = NULL;
  ck_assert_int_eq(sp_connect(daemons[0].socket, &c), 0);
  ck_assert_int_eq(sp_status(c, &st), 0);
  sp_close(c);
  const char *colon = strrchr(st->peer_address, ':');
  ck_assert_ptr_nonnull(colon);
  uint16_t port = (uint16_t)atoi(colon + 1);
  sp_status_free(st);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(flood_from_one_prefix(port));
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status));
  ck_assert_msg(WEXITSTATUS(status) != 1,
                "four links from one /64 dropped another host's handshake");
  ck_assert_msg(WEXITSTATUS(status) == 0, "a link could not be made");
}
END_TEST

int main(void) {
  const char *why = setup_net();
  if (why != NULL) {
    printf("nodes-netns: SKIPPED: these tests need network "
           "namespaces: %s\n", why);
    fprintf(stderr, "nodes-netns: SKIPPED: these tests need network "
            "namespaces: %s\n", why);
    teardown_net();
    return SKIP;
  }
  setenv("SHARDPORTD_REAL", sp_test_daemon_path(), 1);
  if (sp_test_mkdtemp(wrapper_dir, sizeof wrapper_dir) != 0) {
    teardown_net();
    return 1;
  }
  Suite *s = suite_create("nodes-netns");
  TCase *tc = tcase_create("link");
  tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, 90);
  tcase_add_test(tc, link_cut_mid_round);
  suite_add_tcase(s, tc);
  tc = tcase_create("hosts");
  tcase_add_checked_fixture(tc, NULL, stop);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, ipv6_prefix_is_one_host);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  teardown_net();
  return failed == 0 ? 0 : 1;
}
