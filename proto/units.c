/*
 * units.c - how shardport writes a size, the same everywhere a person
 * reads one: the CLI's status, the daemon's log, the demo's summary and the
 * Python package's progress line.  Binary units with one decimal, so that
 * one export's figure reads the same in all of them.
 */
#include <stdio.h>

#include "shardport.h"

SP_EXPORT const char *sp_format_bytes(uint64_t bytes, char *buf,
                                      size_t size) {
  static const char *const units[] = {"KiB", "MiB", "GiB",
                                      "TiB", "PiB", "EiB"};
  if (buf == NULL || size == 0)
    return buf;
  if (bytes < 1024) {
    snprintf(buf, size, "%llu B", (unsigned long long)bytes);
    return buf;
  }
  double v = (double)bytes / 1024;
  size_t u = 0;
  /* Move up a unit when the value would print as "1024.0". */
  while (v >= 1023.95 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024;
    u++;
  }
  snprintf(buf, size, "%.1f %s", v, units[u]);
  return buf;
}
