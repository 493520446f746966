/*
 * text.c - turning what the daemon reports into text for people: byte
 * counts, durations and user names.
 *
 * Strings in a status reply come from another process; printed raw, an
 * escape sequence in one could rewrite the operator's terminal.  So every
 * daemon string goes through sp_text_sanitize (proto/text.c) before the
 * table shows it.
 */
#include <math.h>
#include <pwd.h>
#include <stdio.h>
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

void text_user(uint32_t uid, char *buf, size_t size) {
  struct passwd pw, *found = NULL;
  char scratch[1024];
  if (getpwuid_r((uid_t)uid, &pw, scratch, sizeof scratch, &found) == 0 &&
      found != NULL) {
    sp_text_sanitize(found->pw_name, buf, size);
    return;
  }
  snprintf(buf, size, "%u", uid);
}

void text_table_measure(struct text_table *t, const char *const *row) {
  for (size_t c = 0; c < t->ncols; c++) {
    size_t len = strlen(row[c]);
    if (len > t->width[c])
      t->width[c] = len;
  }
}

void text_table_row(const struct text_table *t, FILE *out, const char *indent,
                    const char *const *row) {
  /* The last cell written is not padded, and empty cells at the end are
   * not written: no trailing blanks. */
  size_t n = t->ncols;
  while (n > 1 && row[n - 1][0] == '\0')
    n--;
  fputs(indent, out);
  for (size_t c = 0; c < n; c++) {
    if (c + 1 < n)
      fprintf(out, "%-*s  ", (int)t->width[c], row[c]);
    else
      fputs(row[c], out);
  }
  fputc('\n', out);
}
