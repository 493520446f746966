/*
 * text.h - bytes from another process made safe to show: as a msgpack str
 * (which must be UTF-8), in a log line, on a terminal.
 */
#ifndef SP_PROTO_TEXT_H
#define SP_PROTO_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bytes in the well-formed UTF-8 sequence at s (n > 0 bytes available), 0
 * when it is not one; *cp receives the code point. */
size_t sp__utf8_len(const unsigned char *s, size_t n, uint32_t *cp);
/* The len bytes at s are UTF-8 without NUL bytes, overlong forms or
 * surrogates: what a key or a checkpoint's string may be. */
bool sp__utf8_valid(const char *s, size_t len);

/* s made safe to show: control characters (C0, DEL, C1) and bytes that are
 * not well-formed UTF-8 become \xNN escapes, so the result is valid UTF-8
 * that cannot end a line or steer a terminal; truncated to fit size at a
 * character or escape boundary (always terminated when size > 0). */
void sp__text_sanitize(const char *s, char *buf, size_t size);

#endif /* SP_PROTO_TEXT_H */
