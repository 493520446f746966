/*
 * text.c - UTF-8 sequences, and other processes' bytes made safe to show;
 * see text.h.
 *
 * The daemon quotes what peers sent (an op name, a key, a storage kind) in
 * error replies and log lines; an error reply's message is a msgpack str,
 * which strict decoders refuse unless it is UTF-8, and a control byte in a
 * log line could end it and forge another.  The CLI prints what the daemon
 * reports, where an escape sequence could rewrite the operator's terminal.
 * All three go through sp__text_sanitize.
 */
#include <string.h>

#include "proto/text.h"

size_t sp__utf8_len(const unsigned char *s, size_t n, uint32_t *cp) {
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

bool sp__utf8_valid(const char *s, size_t len) {
  const unsigned char *p = (const unsigned char *)s;
  while (len > 0) {
    uint32_t cp;
    size_t n = sp__utf8_len(p, len, &cp);
    if (n == 0 || cp == 0)
      return false;
    p += n;
    len -= n;
  }
  return true;
}

/* C0 controls, DEL and the C1 controls (U+0080..U+009F) all steer a
 * terminal. */
static int is_control(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f);
}

void sp__text_sanitize(const char *s, char *buf, size_t size) {
  static const char hex[] = "0123456789abcdef";
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s), out = 0;
  if (size == 0)
    return;
  while (n > 0) {
    uint32_t cp;
    size_t len = sp__utf8_len(p, n, &cp);
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
