/*
 * bench_limits.h - the limits a benchmark measures in its own run, so that
 * its figures are ratios against this machine at this moment rather than
 * wall-clock numbers (docs/benchmarks.md).
 *
 * Each returns the best of three: the limit is what the machine can do,
 * and on a shared machine the best repetition is the one least disturbed.
 */
#ifndef SP_TESTS_BENCH_BENCH_LIMITS_H
#define SP_TESTS_BENCH_BENCH_LIMITS_H

#include <stdint.h>

/* CLOCK_MONOTONIC in seconds. */
double bench_now_s(void);

/* Single-thread memcpy bandwidth over bytes, in bytes per second, between
 * two buffers of that size touched beforehand; 0 when they could not be
 * mapped. */
double bench_memcpy_bps(uint64_t bytes);

/* Seconds raw loopback TCP (one socket pair on 127.0.0.1) takes to move a
 * bytes from side 0 to side 1 and b bytes back at once, one thread per
 * direction and side, as two daemons move them; 0 when the pair could not
 * be made. */
double bench_tcp_seconds(uint64_t a, uint64_t b);

#endif
