/*
 * scrape.h - what the scale simulation reads from each daemon's Prometheus
 * endpoint (docs/operations.md, "Metrics"): one blocking HTTP GET of
 * /metrics on loopback, and the few series the simulation reports.
 */
#ifndef SP_TEST_SCRAPE_H
#define SP_TEST_SCRAPE_H

#include <stdint.h>

/* The counters of one daemon at one moment. */
struct scrape {
  uint64_t control_sent, control_received; /* node-protocol frame bytes */
  uint64_t published;                      /* exports that published */
  double planning_s;                       /* planning histogram's sum */
  double duration_s;                       /* export duration's sum */
};

/* A loopback TCP port free at the moment of the call, for a daemon's
 * --metrics-listen: 0 when none could be found. */
uint16_t scrape_free_port(void);

/* GET http://127.0.0.1:port/metrics into *out: 0, or -1 when the daemon
 * did not answer within timeout_ms or a series is missing. */
int scrape_metrics(uint16_t port, int timeout_ms, struct scrape *out);

#endif /* SP_TEST_SCRAPE_H */
