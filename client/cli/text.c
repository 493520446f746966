/*
 * text.c - turning what the daemon reports into text for people: UTF-8
 * checks, terminal-safe strings, byte counts and durations.
 *
 * Strings in a status reply come from another process; printed raw, an
 * escape sequence in one could rewrite the operator's terminal.  So every
 * daemon string goes through text_sanitize before the table shows it.
 */
#include <math.h>
#include <string.h>

#include "client/cli/cli.h"

size_t text_utf8_len(const unsigned char *s, size_t n, uint32_t *cp) {
  unsigned char b = s[0];
  size_t len;
  uint32_t min;
  if (b < 0x80) {
    *cp = b;
    return 1;
  }
  if (b >= 0xc2 && b <= 0xdf) {
    len = 2;
    min = 0x80;
    *cp = b & 0x1fu;
  } else if (b >= 0xe0 && b <= 0xef) {
    len = 3;
    min = 0x800;
    *cp = b & 0x0fu;
  } else if (b >= 0xf0 && b <= 0xf4) {
    len = 4;
    min = 0x10000;
    *cp = b & 0x07u;
  } else {
    return 0; /* a continuation byte, an overlong lead (c0, c1) or f5..ff */
  }
  if (n < len)
    return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xc0) != 0x80)
      return 0;
    *cp = *cp << 6 | (s[i] & 0x3fu);
  }
  /* Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not
   * UTF-8. */
  if (*cp < min || (*cp >= 0xd800 && *cp <= 0xdfff) || *cp > 0x10ffff)
    return 0;
  return len;
}

/* C0 controls, DEL and the C1 controls (U+0080..U+009F) all steer a
 * terminal. */
static int is_control(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f);
}

void text_sanitize(const char *s, char *buf, size_t size) {
  static const char hex[] = "0123456789abcdef";
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s), out = 0;
  if (size == 0)
    return;
  while (n > 0) {
    uint32_t cp;
    size_t len = text_utf8_len(p, n, &cp);
    if (len > 0 && !is_control(cp)) {
      if (out + len >= size)
        break;
      memcpy(buf + out, p, len);
      out += len;
    } else {
      /* Escape one byte at a time, so that a C1 control's two bytes and an
       * invalid byte both show what was sent. */
      len = len > 0 ? len : 1;
      if (out + 4 * len >= size)
        break;
      for (size_t i = 0; i < len; i++) {
        buf[out++] = '\\';
        buf[out++] = 'x';
        buf[out++] = hex[p[i] >> 4];
        buf[out++] = hex[p[i] & 0xf];
      }
    }
    p += len;
    n -= len;
  }
  buf[out] = '\0';
}

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
