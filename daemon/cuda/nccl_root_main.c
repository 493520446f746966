/*
 * nccl_root_main.c - shardport-nccl-root, the process that hosts the
 * bootstrap root of one NCCL unique id for shardportd (ncclroot.c).
 *
 * ncclGetUniqueId starts, in the calling process, a thread listening on a
 * socket that stays until every rank of the id has checked in, for the life
 * of the process when they never do (docs/gpu.md, "The NCCL bootstrap").
 * Here that process is this one: it writes the id's bytes to its standard
 * output and then waits until its standard input ends, which is when the
 * daemon is done with the id (it also kills it), so that the thread and the
 * socket go with it whatever became of the id.  Nothing of CUDA is loaded.
 */
#include <errno.h>
#include <stdio.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "proto/msg.h"

int main(void) {
  struct cuda_api api;
  char why[SP_ERRMSG_MAX + 1];
  if (cuda_api_load_nccl(&api, why, sizeof why) != 0) {
    fprintf(stderr, "shardport-nccl-root: %s\n", why);
    return 1;
  }
  ncclUniqueId uid;
  ncclResult_t res = api.ncclGetUniqueId(&uid);
  if (res != ncclSuccess) {
    fprintf(stderr, "shardport-nccl-root: ncclGetUniqueId: %s\n",
            api.ncclGetErrorString(res));
    return 1;
  }
  const char *p = uid.internal;
  size_t left = sizeof uid.internal;
  while (left > 0) {
    ssize_t n = write(STDOUT_FILENO, p, left);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return 1;
    p += n;
    left -= (size_t)n;
  }
  for (;;) {
    char byte;
    ssize_t n = read(STDIN_FILENO, &byte, 1);
    if (n == 0 || (n < 0 && errno != EINTR))
      return 0;
  }
}
