/*
 * detach.h - --detach: the daemon forks into the background once ready
 * (detach.c).
 */
#ifndef SP_DAEMON_DETACH_H
#define SP_DAEMON_DETACH_H

#include "daemon/layer.h"

/* `--detach`: forks; the parent exits once the child is ready (printing
 * its pid) or with the child's status when it exits first.  Returns 0 in
 * the child (in a session of its own, stdin and stdout on /dev/null), or
 * -1 when it cannot fork.  Call before anything starts threads or CUDA. */
int detach_start(void);
/* Tells a waiting parent the daemon serves; a no-op when not detached. */
void detach_ready(void);

#endif /* SP_DAEMON_DETACH_H */
