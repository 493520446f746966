/*
 * ncclroot.c - NCCL unique ids whose bootstrap root lives in a helper
 * process (shardport-nccl-root, nccl_root_main.c); see gpu.h.
 *
 * ncclGetUniqueId leaves a thread and a listening socket in the calling
 * process until every rank of the id has checked in, and NCCL offers no
 * call that ends them: a communicator generation that never completes (a
 * node that never joined, an export that failed first) would keep both in
 * shardportd for good, one pair per generation.  The helper hosts them
 * instead, and ending the helper (the end of its stdin, then SIGKILL) ends
 * them whatever became of the id.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/cuda/internal.h"
#include "proto/fail.h"
#include "shardport.h"

#ifndef SP_LIBEXECDIR
#define SP_LIBEXECDIR "/usr/local/libexec/shardport"
#endif

#define HELPER_NAME "shardport-nccl-root"
/* How long the helper may take to load NCCL and make the id. */
#define HELPER_ID_MS 10000

extern char **environ;

struct gpu_nccl_root {
  pid_t pid;
  int stdin_fd; /* the helper's stdin: closing it ends the helper */
};

/* SHARDPORT_NCCL_ROOT_HELPER, else the helper beside this executable (a
 * build tree), else the installed one. */
static void helper_path(char *out, size_t outlen) {
  const char *env = getenv("SHARDPORT_NCCL_ROOT_HELPER");
  if (env != NULL && env[0] != '\0') {
    snprintf(out, outlen, "%s", env);
    return;
  }
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL) {
      *slash = '\0';
      int len = snprintf(out, outlen, "%s/" HELPER_NAME, self);
      if (len > 0 && (size_t)len < outlen && access(out, X_OK) == 0)
        return;
    }
  }
  snprintf(out, outlen, "%s/" HELPER_NAME, SP_LIBEXECDIR);
}

/* Reads the id's bytes from the helper's stdout, bounded in time. */
static bool read_id(int fd, uint8_t id[GPU_NCCL_ID_BYTES]) {
  size_t got = 0;
  int waited = 0;
  while (got < GPU_NCCL_ID_BYTES && waited < HELPER_ID_MS) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 100);
    if (r < 0 && errno != EINTR)
      return false;
    if (r <= 0) {
      waited += 100;
      continue;
    }
    ssize_t n = read(fd, id + got, GPU_NCCL_ID_BYTES - got);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    got += (size_t)n;
  }
  return got == GPU_NCCL_ID_BYTES;
}

/* Ends the helper: the end of its stdin, then SIGKILL (it may be stuck in
 * NCCL), and waits for it. */
static void end_helper(pid_t pid, int stdin_fd) {
  close(stdin_fd);
  kill(pid, SIGKILL);
  while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
    ;
}

void gpu_nccl_root_end(struct gpu_nccl_root *root) {
  if (root == NULL)
    return;
  end_helper(root->pid, root->stdin_fd);
  free(root);
}

int gpu_comms_unique_id(struct gpu *gpu, uint8_t id[GPU_NCCL_ID_BYTES],
                        struct gpu_nccl_root **out, char *msg,
                        size_t msglen) {
  (void)gpu;
  *out = NULL;
  char path[PATH_MAX];
  helper_path(path, sizeof path);
  int in[2], from[2];
  if (pipe2(in, O_CLOEXEC) != 0)
    return sp__failf(msg, msglen, SP_EBACKEND, "pipe: %s", strerror(errno));
  if (pipe2(from, O_CLOEXEC) != 0) {
    int err = errno;
    close(in[0]);
    close(in[1]);
    return sp__failf(msg, msglen, SP_EBACKEND, "pipe: %s", strerror(err));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, from[1], STDOUT_FILENO);
  char *argv[] = {HELPER_NAME, NULL};
  pid_t pid;
  int err = posix_spawn(&pid, path, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(from[1]);
  if (err != 0) {
    close(in[1]);
    close(from[0]);
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "cannot start %s for the NCCL id: %s", path,
                     strerror(err));
  }
  bool made = read_id(from[0], id);
  close(from[0]);
  struct gpu_nccl_root *root = made ? malloc(sizeof *root) : NULL;
  if (root == NULL) {
    end_helper(pid, in[1]);
    if (made)
      return sp__failf(msg, msglen, SP_ENOMEM,
                       "out of memory keeping the NCCL id's root");
    return sp__failf(msg, msglen, SP_EBACKEND,
                     "%s made no NCCL id (its errors are in the log)", path);
  }
  *root = (struct gpu_nccl_root){.pid = pid, .stdin_fd = in[1]};
  *out = root;
  return 0;
}
