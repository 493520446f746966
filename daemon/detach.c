/*
 * detach.c - `shardportd --detach`: serve in the background, but only once
 * serving, so that a shell script that starts the daemon learns whether it
 * started (a bare `&` hides a refused socket directory until the first
 * client fails).
 *
 * The process forks before anything else is started (the CUDA runtime
 * must never see a fork).  The parent waits on a pipe: the child writes one
 * byte when it listens (detach_ready), and the parent prints the child's
 * pid and exits 0; a child that exits first closes the pipe, and the
 * parent exits with its status, after the child's own error on stderr.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/detach.h"

/* The child's end of the pipe until it is ready; -1 otherwise. */
static int ready_fd = -1;

static void parent_wait(pid_t child, int fd) {
  char byte;
  ssize_t n;
  do
    n = read(fd, &byte, 1);
  while (n < 0 && errno == EINTR);
  if (n == 1) {
    printf("%d\n", (int)child);
    exit(fflush(stdout) == 0 ? 0 : 1);
  }
  int status;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR)
      exit(1);
  exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

int detach_start(void) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid > 0) {
    close(fds[1]);
    parent_wait(pid, fds[0]);
  }
  close(fds[0]);
  ready_fd = fds[1];
  /* Its own session: the terminal's signals (Ctrl-C in the shell that
   * started it) are not its.  stdout goes nowhere, so that a command
   * substitution around the parent ends when the parent does; stderr stays
   * the log. */
  setsid();
  int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null >= 0) {
    dup2(null, STDIN_FILENO);
    dup2(null, STDOUT_FILENO);
    if (null > STDERR_FILENO)
      close(null);
  }
  return 0;
}

void detach_ready(void) {
  if (ready_fd < 0)
    return;
  ssize_t w = write(ready_fd, "", 1);
  (void)w;
  close(ready_fd);
  ready_fd = -1;
}
