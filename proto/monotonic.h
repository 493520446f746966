/*
 * monotonic.h - the one clock of deadlines and intervals: milliseconds of
 * CLOCK_MONOTONIC, which no change of the wall clock moves.  The daemon's
 * timeouts, its engines' deadlines, its rate limits and the library's
 * request deadlines all read it (libuv's uv_hrtime reads the same clock,
 * in nanoseconds, where the loop measures itself).
 */
#ifndef SP_PROTO_MONOTONIC_H
#define SP_PROTO_MONOTONIC_H

#include <stdint.h>

uint64_t monotonic_ms(void);
/* The same clock in nanoseconds, to order events of different threads. */
uint64_t monotonic_ns(void);

#endif /* SP_PROTO_MONOTONIC_H */
