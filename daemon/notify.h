/*
 * notify.h - sd_notify: readiness, status, stopping, the watchdog (notify.c).
 */
#ifndef SP_DAEMON_NOTIFY_H
#define SP_DAEMON_NOTIFY_H

#include <stdint.h>

#include "daemon/layer.h"

/* Thin sd_notify glue; every call is a no-op without systemd or when the
 * daemon was not started by a service manager. */
void notify_ready(const char *status);
void notify_status(const char *status);
/* STOPPING=1 with a status line, and how long the stop may still take
 * (EXTEND_TIMEOUT_USEC), so that a drain longer than the unit's
 * TimeoutStopSec is not cut short. */
void notify_stopping(const char *status, uint64_t extend_usec);
/* RELOADING=1 (with MONOTONIC_USEC) as a reload starts; notify_ready when
 * it is done. */
void notify_reloading(void);
void notify_watchdog(void);
/* The watchdog interval systemd asked for in microseconds, or 0. */
uint64_t notify_watchdog_usec(void);

#endif /* SP_DAEMON_NOTIFY_H */
