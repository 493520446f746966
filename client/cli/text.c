/*
 * text.c - turning what the daemon reports into text for people: the gist
 * of a reason, durations, user names and tables (byte counts are
 * sp_format_bytes, proto/units.c).
 *
 * Strings in a status reply come from another process; printed raw, an
 * escape sequence in one could rewrite the operator's terminal.  So every
 * daemon string goes through sp__text_sanitize (proto/text.c) before the
 * table shows it.
 */
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>

#include "client/cli/cli.h"

bool text_gist(const char *s, char *buf, size_t size) {
  /* Up to the first "; " or " (", and of that the first two ": "-parts. */
  size_t end = strlen(s);
  const char *semi = strstr(s, "; "), *paren = strstr(s, " (");
  if (semi != NULL && (size_t)(semi - s) < end)
    end = (size_t)(semi - s);
  if (paren != NULL && (size_t)(paren - s) < end)
    end = (size_t)(paren - s);
  const char *colon = strstr(s, ": ");
  if (colon != NULL && (size_t)(colon - s) < end) {
    const char *second = strstr(colon + 2, ": ");
    if (second != NULL && (size_t)(second - s) < end)
      end = (size_t)(second - s);
  }
  if (end >= size)
    end = size - 1;
  memcpy(buf, s, end);
  buf[end] = '\0';
  return s[end] != '\0';
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
    sp__text_sanitize(found->pw_name, buf, size);
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
