/*
 * notify.c - readiness, status and watchdog messages to the service manager.
 *
 * sd_notify does nothing when NOTIFY_SOCKET is unset, so a daemon started by
 * hand pays nothing; without libsystemd every call here is empty.
 */
#include <inttypes.h>
#include <stdio.h>
#include <time.h>

#include "build_config.h"
#include "daemon/notify.h"

#if SP_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>

void notify_ready(const char *status) {
  sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

void notify_status(const char *status) { sd_notifyf(0, "STATUS=%s", status); }

void notify_stopping(const char *status, uint64_t extend_usec) {
  if (extend_usec > 0)
    sd_notifyf(0, "STOPPING=1\nSTATUS=%s\nEXTEND_TIMEOUT_USEC=%" PRIu64,
               status, extend_usec);
  else
    sd_notifyf(0, "STOPPING=1\nSTATUS=%s", status);
}

/* systemd matches MONOTONIC_USEC against its own clock to tell this reload
 * from an earlier one (sd_notify(3)). */
void notify_reloading(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  sd_notifyf(0, "RELOADING=1\nSTATUS=reloading the configuration\n"
                "MONOTONIC_USEC=%" PRIu64,
             (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u);
}

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
void notify_stopping(const char *status, uint64_t extend_usec) {
  (void)status;
  (void)extend_usec;
}
void notify_reloading(void) {}
void notify_watchdog(void) {}
uint64_t notify_watchdog_usec(void) { return 0; }

#endif
