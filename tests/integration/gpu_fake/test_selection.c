/*
 * test_selection.c - which backend a daemon serves and why: the CUDA one
 * on the fake GPUs, the host one (or a clear refusal) without them.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/world.h"

START_TEST(status_says_cuda_and_why) {
  char want[32];
  snprintf(want, sizeof want, "%d GPU%s", world_test_gpus(),
           world_test_gpus() == 1 ? "" : "s");
  sp_client *c;
  ck_assert_int_eq(sp_connect(world_node0.socket, &c), 0);
  sp_status_info *st;
  ck_assert_int_eq(sp_status(c, &st), 0);
  ck_assert_str_eq(st->backend_active, "cuda");
  ck_assert_msg(strstr(st->backend_reason, want) != NULL, "reason: %s",
                st->backend_reason);
  ck_assert_msg(strstr(st->backends_built, "cuda") != NULL, "built: %s",
                st->backends_built);
  sp_status_free(st);
  sp_close(c);
}
END_TEST

/* Runs shardportd with args and the fake runtime showing ngpus GPUs: its
 * exit status, stderr in out. */
static int run_check(const char *ngpus, const char *backend, char *out,
                     size_t n) {
  char dir[256];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  char log[300], sock[300];
  snprintf(log, sizeof log, "%s/log", dir);
  snprintf(sock, sizeof sock, "%s/s.sock", dir);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    setenv("SHARDPORT_FAKE_GPUS", ngpus, 1);
    execl(sp_test_daemon_path(), "shardportd", "-n", "--config", "/dev/null",
          "--socket", sock, "--backend", backend, (char *)NULL);
    _exit(127);
  }
  int st = sp_test_wait(pid, WAIT_MS);
  FILE *f = fopen(log, "r");
  size_t got = f ? fread(out, 1, n - 1, f) : 0;
  out[got] = '\0';
  if (f)
    fclose(f);
  sp_test_rmdir(dir);
  return st;
}

START_TEST(no_gpu_means_host_or_a_clear_refusal) {
  char out[2048];
  /* auto on a machine without a driver: the host backend, and the reason
   * names the driver. */
  ck_assert_int_eq(run_check("0", "auto", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "backend host") && strstr(out, "error 35"), "%s",
                out);
  /* cuda insists: exit 1 with the reason. */
  ck_assert_int_eq(run_check("0", "cuda", out, sizeof out), 1);
  ck_assert_msg(strstr(out, "backend cuda is not available") &&
                    strstr(out, "NVIDIA driver"),
                "%s", out);
  /* auto with GPUs picks them. */
  ck_assert_int_eq(run_check("2", "auto", out, sizeof out), 0);
  ck_assert_msg(strstr(out, "backend cuda") && strstr(out, "2 GPUs"), "%s",
                out);
}
END_TEST

void test_selection_add(const struct gpu_cases *c) {
  tcase_add_test(c->export, status_says_cuda_and_why);
  tcase_add_test(c->selection, no_gpu_means_host_or_a_clear_refusal);
}
