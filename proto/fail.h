/*
 * fail.h - the one way a check refuses: a code for the caller and a
 * sentence for the person reading the error reply or the log.
 */
#ifndef SP_PROTO_FAIL_H
#define SP_PROTO_FAIL_H

#include <stddef.h>

/* Writes the printf-style sentence into msg (when msg is not NULL and
 * msglen is not 0, truncated to fit) and returns code. */
int sp__failf(char *msg, size_t msglen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif /* SP_PROTO_FAIL_H */
