/*
 * json.c - the little JSON the CLI writes: strings and doubles (integers
 * print with %llu where they are used).
 *
 * The output must be valid JSON (RFC 8259) whatever bytes the daemon sent,
 * so a string is walked as UTF-8: valid sequences pass through, every byte
 * that is not part of one becomes U+FFFD, and the characters JSON forbids
 * raw (quote, backslash, U+0000..U+001F) are escaped.  U+2028 and U+2029 are
 * escaped too, so that the output is also a valid JavaScript literal.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli/cli.h"

void json_string(FILE *out, const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  putc('"', out);
  while (n > 0) {
    uint32_t cp;
    size_t len = sp__utf8_len(p, n, &cp);
    if (len == 0) {
      fputs("\\ufffd", out);
      len = 1;
    } else if (cp == '"') {
      fputs("\\\"", out);
    } else if (cp == '\\') {
      fputs("\\\\", out);
    } else if (cp == '\n') {
      fputs("\\n", out);
    } else if (cp == '\r') {
      fputs("\\r", out);
    } else if (cp == '\t') {
      fputs("\\t", out);
    } else if (cp == '\b') {
      fputs("\\b", out);
    } else if (cp == '\f') {
      fputs("\\f", out);
    } else if (cp < 0x20 || cp == 0x2028 || cp == 0x2029) {
      fprintf(out, "\\u%04x", (unsigned)cp);
    } else {
      fwrite(p, 1, len, out);
    }
    p += len;
    n -= len;
  }
  putc('"', out);
}

void json_double(FILE *out, double v) {
  if (!isfinite(v)) {
    fputs("null", out);
    return;
  }
  /* %.17g always reads back exactly; %.15g is shorter and usually does. */
  char buf[32];
  snprintf(buf, sizeof buf, "%.15g", v);
  if (strtod(buf, NULL) != v)
    snprintf(buf, sizeof buf, "%.17g", v);
  fputs(buf, out);
}

void json_u64(FILE *out, const char *key, uint64_t v) {
  fprintf(out, ",\"%s\":%llu", key, (unsigned long long)v);
}

void json_str_field(FILE *out, const char *key, const char *v) {
  fprintf(out, ",\"%s\":", key);
  if (v)
    json_string(out, v);
  else
    fputs("null", out);
}

void json_double_field(FILE *out, const char *key, double v) {
  fprintf(out, ",\"%s\":", key);
  json_double(out, v);
}
