/*
 * notify.c - readiness, status and watchdog messages to the service manager.
 *
 * sd_notify does nothing when NOTIFY_SOCKET is unset, so a daemon started by
 * hand pays nothing; without libsystemd every call here is empty.
 */
#include <stdio.h>

#include "config.h"
#include "daemon/daemon.h"

#if SP_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>

void notify_ready(const char *status) {
  sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

void notify_status(const char *status) { sd_notifyf(0, "STATUS=%s", status); }

void notify_stopping(void) { sd_notify(0, "STOPPING=1\nSTATUS=stopping"); }

void notify_watchdog(void) { sd_notify(0, "WATCHDOG=1"); }

uint64_t notify_watchdog_usec(void) {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0)
    return 0;
  return usec;
}

#else

void notify_ready(const char *status) { (void)status; }
void notify_status(const char *status) { (void)status; }
void notify_stopping(void) {}
void notify_watchdog(void) {}
uint64_t notify_watchdog_usec(void) { return 0; }

#endif
