/*
 * bench_limits.c - memcpy and raw loopback TCP, measured in a benchmark's
 * own run (bench_limits.h).
 */
#include "tests/bench/bench_limits.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* What one send or recv asks for. */
#define CHUNK (4u << 20)

double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double bench_memcpy_bps(uint64_t bytes) {
  double best = 0;
  char *src = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *dst = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (src != MAP_FAILED && dst != MAP_FAILED) {
    memset(src, 1, bytes);
    memset(dst, 2, bytes);
    for (int rep = 0; rep < 3; rep++) {
      double t0 = bench_now_s();
      memcpy(dst, src, bytes);
      /* The copy's result is used: the compiler may not drop it. */
      __asm__ volatile("" : : "r"(dst) : "memory");
      double bps = (double)bytes / (bench_now_s() - t0);
      if (bps > best)
        best = bps;
    }
  }
  if (src != MAP_FAILED)
    munmap(src, bytes);
  if (dst != MAP_FAILED)
    munmap(dst, bytes);
  return best;
}

struct pump {
  int sock;
  uint64_t bytes;
  bool sending;
  char *buf;
};

static void *pump_main(void *arg) {
  struct pump *p = arg;
  uint64_t left = p->bytes;
  while (left > 0) {
    size_t n = left < CHUNK ? (size_t)left : CHUNK;
    ssize_t r = p->sending ? send(p->sock, p->buf, n, MSG_NOSIGNAL)
                           : recv(p->sock, p->buf, n, 0);
    if (r <= 0) {
      if (r < 0 && errno == EINTR)
        continue;
      break;
    }
    left -= (uint64_t)r;
  }
  return NULL;
}

/* A connected pair of TCP sockets on 127.0.0.1: 0, or -1 with none open. */
static int tcp_pair(int sv[2]) {
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  int lst = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lst < 0)
    return -1;
  sv[0] = sv[1] = -1;
  if (bind(lst, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      listen(lst, 1) == 0 &&
      getsockname(lst, (struct sockaddr *)&sa, &len) == 0 &&
      (sv[0] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) >= 0 &&
      connect(sv[0], (struct sockaddr *)&sa, sizeof sa) == 0)
    sv[1] = accept(lst, NULL, NULL);
  close(lst);
  if (sv[1] < 0) {
    if (sv[0] >= 0)
      close(sv[0]);
    return -1;
  }
  return 0;
}

double bench_tcp_seconds(uint64_t a, uint64_t b) {
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    int sv[2];
    if (tcp_pair(sv) != 0)
      return 0;
    struct pump p[4] = {
        {.sock = sv[0], .bytes = a, .sending = true},
        {.sock = sv[1], .bytes = a, .sending = false},
        {.sock = sv[1], .bytes = b, .sending = true},
        {.sock = sv[0], .bytes = b, .sending = false},
    };
    pthread_t th[4];
    int started = 0;
    bool ok = true;
    for (int i = 0; i < 4 && ok; i++) {
      p[i].buf = malloc(CHUNK);
      ok = p[i].buf != NULL;
      if (ok)
        memset(p[i].buf, i, CHUNK);
    }
    double t0 = bench_now_s();
    while (ok && started < 4) {
      ok = pthread_create(&th[started], NULL, pump_main, &p[started]) == 0;
      started += ok;
    }
    if (!ok) {
      /* The pumps that started end once their sockets are shut. */
      shutdown(sv[0], SHUT_RDWR);
      shutdown(sv[1], SHUT_RDWR);
    }
    for (int i = 0; i < started; i++)
      pthread_join(th[i], NULL);
    double s = bench_now_s() - t0;
    for (int i = 0; i < 4; i++)
      free(p[i].buf);
    close(sv[0]);
    close(sv[1]);
    if (!ok)
      return 0;
    if (best == 0 || s < best)
      best = s;
  }
  return best;
}
