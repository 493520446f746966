/*
 * child.c - child processes for the fakes' suites (see child.h).
 */
#include "child.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* environ with the changes of env applied; the strings are borrowed. */
static char **changed_environment(char *const env[]) {
  size_t n = 0, m = 0;
  while (environ[n] != NULL)
    n++;
  while (env != NULL && env[m] != NULL)
    m++;
  char **out = calloc(n + m + 1, sizeof(*out));
  if (out == NULL)
    return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    bool keep = true;
    for (size_t j = 0; j < m && keep; j++) {
      size_t len = strcspn(env[j], "=");
      keep = !(strncmp(environ[i], env[j], len) == 0 && environ[i][len] == '=');
    }
    if (keep)
      out[k++] = environ[i];
  }
  for (size_t j = 0; j < m; j++)
    if (strchr(env[j], '=') != NULL)
      out[k++] = env[j];
  return out;
}

int child_start(struct child *ch, char *const argv[], char *const env[],
                int pass_fd) {
  memset(ch, 0, sizeof(*ch));
  ch->pid = -1;
  ch->out = -1;
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0)
    return -errno;
  char **envp = changed_environment(env);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], STDOUT_FILENO);
  if (pass_fd >= 0)
    posix_spawn_file_actions_adddup2(&fa, pass_fd, 3);
  int rc = envp == NULL ? ENOMEM
                        : posix_spawn(&ch->pid, argv[0], &fa, NULL, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  free(envp);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    ch->pid = -1;
    return -rc;
  }
  ch->out = pipefd[0];
  return 0;
}

int peer_start(struct child *ch, const char *const args[], char *const env[],
               int pass_fd) {
  const char *argv[32];
  size_t n = 0;
  const char *peer = getenv("FAKEPEER");
  argv[n++] = peer != NULL ? peer : "fakepeer";
  for (size_t i = 0; args[i] != NULL && n < 31; i++)
    argv[n++] = args[i];
  argv[n] = NULL;
  return child_start(ch, (char *const *)argv, env, pass_fd);
}

int peer_run(const char *const args[], char *const env[], int pass_fd,
             int timeout_ms, char *out, size_t n) {
  struct child ch;
  int rc = peer_start(&ch, args, env, pass_fd);
  if (rc != 0) {
    snprintf(out, n, "cannot start fakepeer: %s", strerror(-rc));
    return -1;
  }
  return child_finish(&ch, timeout_ms, out, n);
}

/* Reads what is there, waiting at most timeout_ms; false at EOF. */
static bool fill(struct child *ch, int timeout_ms) {
  if (ch->out < 0)
    return false;
  struct pollfd p = {.fd = ch->out, .events = POLLIN};
  if (poll(&p, 1, timeout_ms) <= 0)
    return true;
  if (ch->len == sizeof(ch->buf))
    ch->len = 0; /* a runaway child: drop what it said */
  ssize_t n = read(ch->out, ch->buf + ch->len, sizeof(ch->buf) - ch->len);
  if (n <= 0) {
    close(ch->out);
    ch->out = -1;
    return false;
  }
  ch->len += (size_t)n;
  return true;
}

int child_line(struct child *ch, char *line, size_t n, int timeout_ms) {
  long deadline = now_ms() + timeout_ms;
  for (;;) {
    char *nl = memchr(ch->buf, '\n', ch->len);
    if (nl != NULL) {
      size_t len = (size_t)(nl - ch->buf);
      snprintf(line, n, "%.*s", (int)len, ch->buf);
      memmove(ch->buf, nl + 1, ch->len - len - 1);
      ch->len -= len + 1;
      return 0;
    }
    long left = deadline - now_ms();
    if (left <= 0 || !fill(ch, (int)left))
      return -1;
  }
}

void child_kill(struct child *ch, int sig) {
  if (ch->pid > 0)
    kill(ch->pid, sig);
}

int child_finish(struct child *ch, int timeout_ms, char *out, size_t n) {
  long deadline = now_ms() + timeout_ms;
  int status = 0;
  bool timed_out = false;
  while (ch->out >= 0) {
    long left = deadline - now_ms();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    fill(ch, (int)(left < 100 ? left : 100));
  }
  for (;;) {
    pid_t r = waitpid(ch->pid, &status, WNOHANG);
    if (r == ch->pid)
      break;
    if (r < 0)
      return -1;
    if (now_ms() >= deadline) {
      timed_out = true;
      kill(ch->pid, SIGKILL);
      waitpid(ch->pid, &status, 0);
      break;
    }
    usleep(2000);
  }
  if (out != NULL && n > 0)
    snprintf(out, n, "%.*s", (int)ch->len, ch->buf);
  if (ch->out >= 0)
    close(ch->out);
  ch->out = -1;
  ch->pid = -1;
  if (timed_out)
    return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void hex_encode(const void *bytes, size_t n, char *out) {
  const unsigned char *b = bytes;
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", b[i]);
  out[2 * n] = '\0';
}

int hex_decode(const char *hex, void *bytes, size_t n) {
  unsigned char *b = bytes;
  if (strlen(hex) != 2 * n)
    return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1)
      return -1;
    b[i] = (unsigned char)v;
  }
  return 0;
}
