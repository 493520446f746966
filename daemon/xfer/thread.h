/*
 * thread.h - the movers' threads: started with the asynchronous signals
 * blocked, and reading trainers' mappings under a SIGBUS guard.
 *
 * Reading a trainer's mapping can fault: a trainer that truncates its
 * memfd after registering it turns the daemon's next read into SIGBUS.
 * xfer_guarded turns that fault into an error its caller reports (naming
 * the rank and key) instead of a dead daemon; a SIGBUS anywhere else keeps
 * its old effect.
 */
#ifndef SP_DAEMON_XFER_THREAD_H
#define SP_DAEMON_XFER_THREAD_H

#include <pthread.h>

#include "daemon/xfer/layer.h"

/* pthread_create with the asynchronous signals blocked in the thread (they
 * are the loop's); 0 or SP_ENOMEM. */
int xfer_spawn(pthread_t *thread, void *(*fn)(void *), void *arg);
/* Runs fn(arg) on this thread under the SIGBUS guard: a read of a mapping
 * that faults ends fn early and returns -1 with the address in *fault.  0
 * when fn returned. */
int xfer_guarded(void (*fn)(void *arg), void *arg, const void **fault);

#endif /* SP_DAEMON_XFER_THREAD_H */
