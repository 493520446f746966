/*
 * worker.c - libuv's worker threads run below the event loop; see
 * worker.h.
 *
 * The workers decode large frames and give memory back (conn.c,
 * registry.c, pool.c) so that the loop stays free to answer every client.
 * On a machine with fewer cores than there are busy workers and a loop,
 * though, the kernel shares the cores among them all, and the loop then
 * waited its turn behind its own workers: eight clients registering at
 * once on two cores made one iteration of the loop take 54-105 ms where
 * one client's took 15.  So each worker, from its first job on, runs at a
 * lower priority (a nice value WORKER_NICE above the daemon's): a core is
 * then the loop's whenever it has something to do, and the workers have
 * the rest.  A thread's own nice value is its own on Linux (setpriority(2)
 * on its thread id), and raising it needs no privilege.
 */
#include <errno.h>
#include <stdbool.h>
#include <sys/resource.h>
#include <unistd.h>

#include "daemon/worker.h"

#define WORKER_NICE 10

void worker_background(void) {
  static _Thread_local bool lowered;
  if (lowered)
    return;
  lowered = true;
  errno = 0;
  int nice_now = getpriority(PRIO_PROCESS, (id_t)gettid());
  if (errno == 0)
    setpriority(PRIO_PROCESS, (id_t)gettid(), nice_now + WORKER_NICE);
}
