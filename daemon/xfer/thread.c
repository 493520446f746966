/*
 * thread.c - the movers' threads and their SIGBUS guard; see thread.h.
 *
 * The guard is a SIGBUS handler with a thread-local sigjmp_buf, armed only
 * while a guarded function runs on that thread, so a fault in a read of a
 * trainer's mapping jumps back to xfer_guarded.
 */
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

#include "daemon/xfer/thread.h"
#include "shardport.h"

static _Thread_local sigjmp_buf *fault_jump;
static _Thread_local void *volatile fault_addr;
static struct sigaction previous_sigbus;
static pthread_once_t sigbus_once = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *info, void *uc) {
  if (fault_jump != NULL) {
    fault_addr = info->si_addr;
    siglongjmp(*fault_jump, 1);
  }
  /* Not a guarded read: behave as if this handler were not there. */
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(sig, info, uc);
  } else if (previous_sigbus.sa_handler != SIG_IGN &&
             previous_sigbus.sa_handler != SIG_DFL) {
    previous_sigbus.sa_handler(sig);
  } else {
    /* Returning re-runs the faulting access, which now kills. */
    sigaction(SIGBUS, &previous_sigbus, NULL);
  }
}

static void install_sigbus(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &previous_sigbus);
}

int xfer_guarded(void (*fn)(void *arg), void *arg, const void **fault) {
  pthread_once(&sigbus_once, install_sigbus);
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    /* Back from the handler, which ran with SIGBUS blocked. */
    sigset_t set;
    fault_jump = NULL;
    sigemptyset(&set);
    sigaddset(&set, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    *fault = (const void *)fault_addr;
    return -1;
  }
  fault_jump = &jump;
  fn(arg);
  fault_jump = NULL;
  return 0;
}

int xfer_spawn(pthread_t *thread, void *(*fn)(void *), void *arg) {
  /* Workers take no asynchronous signals: those are the loop's.  Faults
   * stay deliverable (a blocked SIGBUS from a fault would kill). */
  sigset_t all, old;
  sigfillset(&all);
  sigdelset(&all, SIGBUS);
  sigdelset(&all, SIGSEGV);
  sigdelset(&all, SIGFPE);
  sigdelset(&all, SIGILL);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(thread, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return rc == 0 ? 0 : SP_ENOMEM;
}
