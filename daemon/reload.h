/*
 * reload.h - SIGHUP: the configuration read again, applied where it may
 * change live (reload.c).
 */
#ifndef SP_DAEMON_RELOAD_H
#define SP_DAEMON_RELOAD_H

#include "daemon/layer.h"

struct server;

/* SIGHUP: reads the configuration again from srv->origin and applies the
 * keys that may change live; logs which keys changed, which took effect
 * and which need a restart.  A configuration that does not load changes
 * nothing. */
void reload_run(struct server *srv);

#endif /* SP_DAEMON_RELOAD_H */
