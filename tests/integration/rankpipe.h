/*
 * rankpipe.h - the frames between a test process and the rank processes
 * it forks (trainer.c, gpu_fake/rank.c): a type byte, then its payload,
 * over a pipe; the reader knows each type's payload size.
 */
#ifndef SP_TEST_RANKPIPE_H
#define SP_TEST_RANKPIPE_H

#include <stddef.h>

/* Writes the type byte and len bytes of buf: 0, or -1 when the pipe
 * failed. */
int rankpipe_write(int fd, char type, const void *buf, size_t len);
/* Reads exactly len bytes within timeout_ms: 0, SP_ETIMEOUT, or
 * SP_ECLOSED when the writer ended first. */
int rankpipe_read(int fd, void *buf, size_t len, int timeout_ms);

#endif /* SP_TEST_RANKPIPE_H */
