/*
 * rankpipe.c - the frames between a test process and its rank processes;
 * see rankpipe.h.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <unistd.h>

#include "proto/monotonic.h"
#include "shardport.h"
#include "tests/integration/rankpipe.h"

int rankpipe_write(int fd, char type, const void *buf, size_t len) {
  if (write(fd, &type, 1) != 1)
    return -1;
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int rankpipe_read(int fd, void *buf, size_t len, int timeout_ms) {
  uint8_t *p = buf;
  uint64_t t0 = monotonic_ms();
  while (len > 0) {
    int left = timeout_ms - (int)(monotonic_ms() - t0);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (left <= 0 || poll(&pfd, 1, left) != 1)
      return SP_ETIMEOUT;
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return SP_ECLOSED;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}
