/*
 * loadprobe.h - what one client's large registration costs the others.
 *
 * A prober is a second client that pings the daemon back to back from its
 * own thread and keeps when each ping was sent and how long its answer
 * took; the latencies of the pings that overlap a window of interest are
 * then compared with those of an idle window of the same run.  The frames
 * are the largest ordinary registrations: tens of thousands of storages
 * over one memfd, and one tensor per storage.
 */
#ifndef SP_TEST_LOADPROBE_H
#define SP_TEST_LOADPROBE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/msg.h"

struct sp_ping {
  uint64_t sent_ns, took_ns;
};

struct sp_prober {
  pthread_t thread;
  atomic_bool stop;
  atomic_bool started;
  char socket[300];
  struct sp_ping *pings;
  size_t npings, cap;
  int failed; /* a transport error, or 0 */
};

/* Latencies of the pings that overlapped a window, in nanoseconds. */
struct sp_ping_stats {
  size_t count;
  uint64_t p50_ns, p99_ns, max_ns;
};

uint64_t sp_now_ns(void);

/* Connects a second client to socket and starts pinging; returns once the
 * first answer came back. */
void sp_prober_start(struct sp_prober *p, const char *socket);
/* Stops pinging; returns 0, or the transport error that stopped it. */
int sp_prober_stop(struct sp_prober *p);
/* The pings that were in flight at any time in [from_ns, to_ns]; valid
 * after sp_prober_stop. */
struct sp_ping_stats sp_prober_window(const struct sp_prober *p,
                                      uint64_t from_ns, uint64_t to_ns);
void sp_prober_free(struct sp_prober *p);

/* storage_add of n storages of length bytes, sids first to first + n - 1,
 * the i-th at offset i * length of the frame's descriptor 0. */
void sp_pack_many_storages(struct sp_msgbuf *mb, uint64_t id, uint32_t first,
                           size_t n, uint64_t length);
/* tensor_add of n replicated float32 vectors of length / 4 elements, key
 * "t<sid>", each filling storage sid first + i. */
void sp_pack_many_tensors(struct sp_msgbuf *mb, uint64_t id, uint32_t first,
                          size_t n, uint64_t length);

#endif
