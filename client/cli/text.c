/*
 * text.c - turning what the daemon reports into text for people: byte
 * counts and durations.
 *
 * Strings in a status reply come from another process; printed raw, an
 * escape sequence in one could rewrite the operator's terminal.  So every
 * daemon string goes through sp_text_sanitize (proto/text.c) before the
 * table shows it.
 */
#include <math.h>
#include <string.h>

#include "client/cli/cli.h"

void text_bytes(uint64_t bytes, char *buf, size_t size) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB",
                                      "EiB"};
  if (bytes < 1024) {
    snprintf(buf, size, "%llu B", (unsigned long long)bytes);
    return;
  }
  double v = (double)bytes / 1024;
  size_t u = 0;
  /* Move up a unit when the value would print as "1024.0". */
  while (v >= 1023.95 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024;
    u++;
  }
  snprintf(buf, size, "%.1f %s", v, units[u]);
}

void text_duration(double seconds, char *buf, size_t size) {
  if (!isfinite(seconds) || seconds < 0)
    seconds = 0;
  /* Two hundred million years is past any uptime and still fits. */
  if (seconds > 1e16)
    seconds = 1e16;
  unsigned long long s = (unsigned long long)seconds;
  unsigned long long d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60;
  s %= 60;
  if (d > 0)
    snprintf(buf, size, "%llud %lluh %llum %llus", d, h, m, s);
  else if (h > 0)
    snprintf(buf, size, "%lluh %llum %llus", h, m, s);
  else if (m > 0)
    snprintf(buf, size, "%llum %llus", m, s);
  else
    snprintf(buf, size, "%llus", s);
}
