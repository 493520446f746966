/*
 * fake_nccl.c - the fake NCCL's API: unique ids, communicator set-up (a
 * rendezvous that blocks until every rank has joined), groups, send,
 * receive and all-reduce, async errors, finalize, destroy and abort.  The
 * wire between ranks is fake_nccl_engine.c; docs/fakes.md is the contract.
 *
 * It needs the fake CUDA runtime (it is linked against it): buffers are
 * fake device memory and operations run on fake streams.
 *
 * Environment:
 *   SHARDPORT_FAKE_NCCL_TIMEOUT_MS  how long communicator set-up waits for
 *                                   the other ranks (default 30000), then
 *                                   fails with ncclSystemError.
 *   SHARDPORT_FAKE_NCCL_FAIL        fault injection, a comma-separated list
 *                                   of RANK:WHEN:ACTION, where RANK is the
 *                                   communicator rank, WHEN is "init" or the
 *                                   Nth group (1-based) that rank launches
 *                                   on a communicator, and ACTION is
 *                                   "error" (that launch fails with
 *                                   ncclSystemError), "exit" (the process
 *                                   exits with status 3 there, as a crash
 *                                   would), "hang" (that group's ops never
 *                                   run, as with a stuck GPU) or
 *                                   "mismatch" (its sends announce one
 *                                   element more than the receiver posted);
 *                                   a fourth
 *                                   field ":once" makes it fire once in
 *                                   the process (a communicator made
 *                                   later, after the abort, runs clean).
 *   SHARDPORT_FAKE_NCCL_MISMATCH    "hang": a mismatched send and receive
 *                                   hang until an abort, as on real NCCL;
 *                                   otherwise (the default) both ranks get
 *                                   ncclInvalidUsage.
 *   SHARDPORT_FAKE_NCCL_CONN_KB     device memory each connection takes
 *                                   when it is set up (default 4096).
 *   SHARDPORT_FAKE_NCCL_ABORT_MS    how long ncclCommAbort blocks before
 *                                   it ends the communicator (default 0).
 *   SHARDPORT_FAKE_NCCL_ISSUE_US    how long each call that issues work
 *                                   sleeps once it holds its device, to
 *                                   widen the window in which a second
 *                                   thread's call shows (default 0).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "fake_nccl.h"

/* nccl.h declares these two without a prototype. */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

#define MAX_RANKS 1024
#define MAX_FAULTS 16
static const char id_magic[8] = "SPFKNCCL";

struct hello {
  uint32_t magic;
  int32_t rank, nranks;
  uint32_t zero;   /* sent as 0: the struct has no padding to leak */
  uint64_t device; /* spfake_device_identity: which GPU of which machine */
};
_Static_assert(sizeof(struct hello) == 24, "struct hello has no padding");

enum fault_action {
  FAULT_NONE,
  FAULT_ERROR,
  FAULT_EXIT,
  FAULT_HANG,
  FAULT_MISMATCH
};

static struct {
  pthread_once_t once;
  unsigned long timeout_ms;
  bool mismatch_hangs; /* SHARDPORT_FAKE_NCCL_MISMATCH=hang */
  size_t conn_bytes;   /* SHARDPORT_FAKE_NCCL_CONN_KB, in bytes */
  unsigned abort_ms;   /* SHARDPORT_FAKE_NCCL_ABORT_MS */
  unsigned issue_us;   /* SHARDPORT_FAKE_NCCL_ISSUE_US */
  size_t n;
  struct {
    int rank;
    unsigned when;
    enum fault_action action;
    bool once;
    atomic_bool fired;
  } v[MAX_FAULTS];
} settings = {.once = PTHREAD_ONCE_INIT};

/* What the calling thread has issued since ncclGroupStart. */
static _Thread_local struct {
  int depth;
  ncclResult_t err;
  struct ptrq ops;   /* struct nop * */
  struct ptrq inits; /* struct fcomm * */
  uint32_t devices;  /* the devices this thread is issuing to (a bit each) */
} group;

/* Which thread is issuing work to each device now: NCCL's "Thread Safety"
 * forbids issuing in parallel to communicators of one device from several
 * threads, and a group's operations must all come from one thread.  A
 * thread holds a device from its first call on a communicator of that
 * device until its ncclGroupEnd (or the end of an ungrouped call). */
static struct {
  pthread_mutex_t lock;
  bool busy[FAKE_MAX_GPUS];
  pthread_t owner[FAKE_MAX_GPUS];
} issuing = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Atomic uint64_t next_comm_id = 1;

static void settings_init(void) {
  long t = fake_env_long("SHARDPORT_FAKE_NCCL_TIMEOUT_MS", 30000);
  settings.timeout_ms = t <= 0 ? 30000 : (unsigned long)t;
  const char *m = getenv("SHARDPORT_FAKE_NCCL_MISMATCH");
  settings.mismatch_hangs = m != NULL && strcmp(m, "hang") == 0;
  long kb = fake_env_long("SHARDPORT_FAKE_NCCL_CONN_KB", 4096);
  settings.conn_bytes = kb < 0 ? (size_t)4096 << 10 : (size_t)kb << 10;
  long am = fake_env_long("SHARDPORT_FAKE_NCCL_ABORT_MS", 0);
  settings.abort_ms = am < 0 ? 0 : (unsigned)am;
  long iu = fake_env_long("SHARDPORT_FAKE_NCCL_ISSUE_US", 0);
  settings.issue_us = iu < 0 ? 0 : (unsigned)iu;
  const char *s = getenv("SHARDPORT_FAKE_NCCL_FAIL");
  while (s != NULL && *s != '\0' && settings.n < MAX_FAULTS) {
    char when[16], action[16];
    int rank, used = 0;
    if (sscanf(s, "%d:%15[^:]:%15[a-z]%n", &rank, when, action, &used) != 3)
      break;
    enum fault_action a = strcmp(action, "error") == 0  ? FAULT_ERROR
                          : strcmp(action, "exit") == 0 ? FAULT_EXIT
                          : strcmp(action, "hang") == 0 ? FAULT_HANG
                          : strcmp(action, "mismatch") == 0 ? FAULT_MISMATCH
                                                            : FAULT_NONE;
    unsigned w = strcmp(when, "init") == 0 ? 0 : (unsigned)strtoul(when, NULL, 10);
    s += used;
    bool once = strncmp(s, ":once", 5) == 0;
    if (once)
      s += 5;
    if (a != FAULT_NONE && (w > 0 || strcmp(when, "init") == 0)) {
      settings.v[settings.n].rank = rank;
      settings.v[settings.n].when = w;
      settings.v[settings.n].action = a;
      settings.v[settings.n].once = once;
      settings.n++;
    }
    if (*s == ',')
      s++;
  }
}

bool fake_nccl_mismatch_hangs(void) {
  pthread_once(&settings.once, settings_init);
  return settings.mismatch_hangs;
}

size_t fake_nccl_conn_bytes(void) {
  pthread_once(&settings.once, settings_init);
  return settings.conn_bytes;
}

/* The calling thread starts or goes on issuing work to c's device.  When
 * another thread is issuing to it at the same time the process ends with
 * a message: on real NCCL that is a race that corrupts or deadlocks
 * sometimes, and a fake that fails every time catches it in CI. */
static void hold_device(const struct fcomm *c, const char *call) {
  int d = c->device;
  if (d < 0 || d >= FAKE_MAX_GPUS || (group.devices & (1u << d)))
    return;
  pthread_mutex_lock(&issuing.lock);
  if (issuing.busy[d] && !pthread_equal(issuing.owner[d], pthread_self())) {
    fprintf(stderr,
            "fake NCCL: %s on a communicator of device %d while another "
            "thread is issuing NCCL work to that device: NCCL is not "
            "thread-safe there (docs/fakes.md)\n",
            call, d);
    abort();
  }
  issuing.busy[d] = true;
  issuing.owner[d] = pthread_self();
  pthread_mutex_unlock(&issuing.lock);
  group.devices |= 1u << d;
  if (settings.issue_us > 0)
    usleep(settings.issue_us);
}

/* The thread's group (or ungrouped call) is over: its devices are free. */
static void release_devices(void) {
  pthread_mutex_lock(&issuing.lock);
  for (int d = 0; d < FAKE_MAX_GPUS; d++)
    if (group.devices & (1u << d))
      issuing.busy[d] = false;
  pthread_mutex_unlock(&issuing.lock);
  group.devices = 0;
}

static enum fault_action fault_at(int rank, unsigned when) {
  pthread_once(&settings.once, settings_init);
  for (size_t i = 0; i < settings.n; i++)
    if (settings.v[i].rank == rank && settings.v[i].when == when &&
        !(settings.v[i].once && atomic_exchange(&settings.v[i].fired, true)))
      return settings.v[i].action;
  return FAULT_NONE;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

ncclResult_t ncclGetVersion(int *version) {
  if (version == NULL)
    return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
  switch (result) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
  case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
  case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
  case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}

/* The id names a rendezvous: each rank listens on the abstract Unix socket
 * "spfake-nccl-<token>-<rank>".  As in real NCCL, the process that made the
 * id hosts its bootstrap root: ncclGetUniqueId starts a thread listening
 * on "spfake-nccl-root-<token>" that stays until every rank of the id has
 * checked in with it, for the life of the process when they never do
 * (PyTorch, "Do not create a ncclUniqueId and bcast it when using
 * ncclCommSplit", pytorch#129904: the id "will spawn a new thread and open
 * a new port until the NCCL ID is used.  If not used, thread is listening
 * to the port for the lifespan of the application").  A rank's set-up
 * checks in first and fails when the root is not there by its deadline. */
static socklen_t root_address(const char *token, struct sockaddr_un *a) {
  memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1,
                   "spfake-nccl-root-%.32s", token);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The root: counts the ranks that check in (each sends its hello) and ends
 * once all nranks of the first one's world have. */
static void *root_main(void *arg) {
  int lfd = (int)(intptr_t)arg;
  bool seen[MAX_RANKS] = {false};
  int nranks = 0, checked = 0;
  while (nranks == 0 || checked < nranks) {
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    if (poll(&p, 1, -1) <= 0)
      continue;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
      continue;
    struct hello h;
    if (recv(fd, &h, sizeof(h), MSG_WAITALL) == (ssize_t)sizeof(h) &&
        h.magic == WIRE_MAGIC && h.nranks > 0 && h.nranks <= MAX_RANKS &&
        (nranks == 0 || h.nranks == nranks) && h.rank >= 0 &&
        h.rank < h.nranks && !seen[h.rank]) {
      nranks = h.nranks;
      seen[h.rank] = true;
      checked++;
    }
    close(fd);
  }
  close(lfd);
  return NULL;
}

static ncclResult_t root_start(const char *token) {
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0)
    return ncclSystemError;
  struct sockaddr_un a;
  socklen_t alen = root_address(token, &a);
  pthread_t t;
  pthread_attr_t attr;
  if (bind(lfd, (struct sockaddr *)&a, alen) != 0 ||
      listen(lfd, MAX_RANKS) != 0 || pthread_attr_init(&attr) != 0) {
    close(lfd);
    return ncclSystemError;
  }
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &attr, root_main, (void *)(intptr_t)lfd);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    close(lfd);
    return ncclSystemError;
  }
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  unsigned char r[16];
  if (uniqueId == NULL)
    return ncclInvalidArgument;
  if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r))
    return ncclSystemError;
  memset(uniqueId, 0, sizeof(*uniqueId));
  memcpy(uniqueId->internal, id_magic, sizeof(id_magic));
  for (size_t i = 0; i < sizeof(r); i++)
    snprintf(uniqueId->internal + 8 + 2 * i, 3, "%02x", r[i]);
  return root_start(uniqueId->internal + 8);
}

static socklen_t rank_address(const struct fcomm *c, int rank,
                              struct sockaddr_un *a) {
  memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1,
                   "spfake-nccl-%s-%d", c->token, rank);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Moves len bytes over a non-blocking socket before the deadline. */
static bool io_all(int fd, void *buf, size_t len, bool out, uint64_t deadline,
                   const atomic_bool *abort_flag) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = out ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL)
                    : recv(fd, (char *)buf + done, len - done, 0);
    if (n > 0) {
      done += (size_t)n;
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      return false;
    if (now_ms() >= deadline || atomic_load(abort_flag))
      return false;
    struct pollfd p = {.fd = fd, .events = out ? POLLOUT : POLLIN};
    poll(&p, 1, 10);
  }
  return true;
}

/* NCCL refuses one GPU as two ranks of a communicator ("Using the same
 * CUDA device multiple times as different ranks of the same NCCL
 * communicator is not supported"): its set-up fails with
 * ncclInvalidUsage and warns "Duplicate GPU detected". */
static bool duplicate_device(const struct fcomm *c, const struct hello *peer) {
  if (peer->device != c->device_id)
    return false;
  fprintf(stderr,
          "fake NCCL: Duplicate GPU detected : rank %d and rank %d both on "
          "CUDA device %d\n",
          c->rank, (int)peer->rank, c->device);
  return true;
}

static ncclResult_t connect_lower(struct fcomm *c, int peer, uint64_t deadline) {
  struct sockaddr_un a;
  socklen_t alen = rank_address(c, peer, &a);
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
      return ncclSystemError;
    if (connect(fd, (struct sockaddr *)&a, alen) == 0) {
      struct hello mine = {WIRE_MAGIC, c->rank, c->nranks, 0, c->device_id},
                   theirs;
      if (!io_all(fd, &mine, sizeof(mine), true, deadline, &c->abort_flag) ||
          !io_all(fd, &theirs, sizeof(theirs), false, deadline, &c->abort_flag)) {
        close(fd);
        return ncclSystemError;
      }
      if (theirs.magic != WIRE_MAGIC || theirs.rank != peer ||
          theirs.nranks != c->nranks) {
        close(fd);
        return ncclInvalidUsage;
      }
      c->peers[peer].fd = fd;
      if (duplicate_device(c, &theirs))
        return ncclInvalidUsage;
      return ncclSuccess;
    }
    int err = errno;
    close(fd);
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN)
      return ncclSystemError;
    if (now_ms() >= deadline || atomic_load(&c->abort_flag))
      return ncclSystemError;
    usleep(5000);
  }
}

static ncclResult_t accept_higher(struct fcomm *c, int lfd, uint64_t deadline) {
  int missing = c->nranks - 1 - c->rank;
  while (missing > 0) {
    if (now_ms() >= deadline || atomic_load(&c->abort_flag))
      return ncclSystemError;
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    if (poll(&p, 1, 10) <= 0)
      continue;
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
      continue;
    struct hello mine = {WIRE_MAGIC, c->rank, c->nranks, 0, c->device_id},
                 theirs;
    if (!io_all(fd, &theirs, sizeof(theirs), false, deadline, &c->abort_flag) ||
        !io_all(fd, &mine, sizeof(mine), true, deadline, &c->abort_flag)) {
      close(fd);
      continue;
    }
    if (theirs.magic != WIRE_MAGIC || theirs.nranks != c->nranks ||
        theirs.rank <= c->rank || theirs.rank >= c->nranks ||
        c->peers[theirs.rank].fd >= 0) {
      close(fd);
      return ncclInvalidUsage;
    }
    c->peers[theirs.rank].fd = fd;
    if (duplicate_device(c, &theirs))
      return ncclInvalidUsage;
    missing--;
  }
  return ncclSuccess;
}

/* Tells the id's bootstrap root that this rank is here, retrying until
 * the deadline while it does not listen (yet). */
static ncclResult_t check_in(struct fcomm *c, uint64_t deadline) {
  struct sockaddr_un a;
  socklen_t alen = root_address(c->token, &a);
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
      return ncclSystemError;
    if (connect(fd, (struct sockaddr *)&a, alen) == 0) {
      struct hello mine = {WIRE_MAGIC, c->rank, c->nranks, 0, c->device_id};
      bool sent = io_all(fd, &mine, sizeof(mine), true, deadline,
                         &c->abort_flag);
      close(fd);
      return sent ? ncclSuccess : ncclSystemError;
    }
    int err = errno;
    close(fd);
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN)
      return ncclSystemError;
    if (now_ms() >= deadline || atomic_load(&c->abort_flag))
      return ncclSystemError;
    usleep(5000);
  }
}

/* Connects this rank with every other one: listen, connect to each lower
 * rank, accept each higher one.  Returns only when all have joined, or at
 * the deadline. */
static ncclResult_t rendezvous(struct fcomm *c) {
  uint64_t deadline = now_ms() + c->timeout_ms;
  enum fault_action fault = fault_at(c->rank, 0);
  if (fault == FAULT_EXIT)
    _exit(3);
  if (fault == FAULT_ERROR)
    return ncclSystemError;
  if (fault == FAULT_HANG) {
    while (now_ms() < deadline && !atomic_load(&c->abort_flag))
      usleep(5000);
    return ncclSystemError;
  }
  ncclResult_t checked = check_in(c, deadline);
  if (checked != ncclSuccess)
    return checked;
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_un a;
  socklen_t alen = rank_address(c, c->rank, &a);
  if (lfd < 0)
    return ncclSystemError;
  if (bind(lfd, (struct sockaddr *)&a, alen) != 0 ||
      listen(lfd, c->nranks) != 0) {
    /* Another process already holds this rank of this id. */
    ncclResult_t res = errno == EADDRINUSE ? ncclInvalidUsage : ncclSystemError;
    close(lfd);
    return res;
  }
  ncclResult_t res = ncclSuccess;
  for (int p = 0; p < c->rank && res == ncclSuccess; p++)
    res = connect_lower(c, p, deadline);
  if (res == ncclSuccess)
    res = accept_higher(c, lfd, deadline);
  close(lfd);
  if (res != ncclSuccess)
    for (int p = 0; p < c->nranks; p++)
      if (c->peers[p].fd >= 0) {
        close(c->peers[p].fd);
        c->peers[p].fd = -1;
      }
  return res;
}

/* Ends set-up: the communicator joins the engine or keeps the error. */
static ncclResult_t finish_init(struct fcomm *c, ncclResult_t res) {
  pthread_mutex_lock(&engine_lock);
  c->initializing = false;
  if (res == ncclSuccess && !engine_register(c))
    res = ncclSystemError;
  if (res != ncclSuccess)
    engine_fail(c, res);
  pthread_mutex_unlock(&engine_lock);
  return res;
}

static void *init_thread(void *arg) {
  struct fcomm *c = arg;
  finish_init(c, rendezvous(c));
  return NULL;
}

static void comm_free(struct fcomm *c) {
  if (c->conn_bytes > 0)
    spfake_device_uncharge(c->device, c->conn_bytes);
  for (int p = 0; c->peers != NULL && p < c->nranks; p++)
    if (c->peers[p].fd >= 0)
      close(c->peers[p].fd);
  free(c->peers);
  free(c);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks,
                                    ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  pthread_once(&settings.once, settings_init);
  if (comm == NULL || nranks < 1 || nranks > MAX_RANKS || rank < 0 ||
      rank >= nranks || memcmp(commId.internal, id_magic, sizeof(id_magic)) != 0)
    return ncclInvalidArgument;
  int device;
  if (cudaGetDevice(&device) != cudaSuccess)
    return ncclUnhandledCudaError;
  struct fcomm *c = calloc(1, sizeof(*c));
  if (c == NULL || (c->peers = calloc((size_t)nranks, sizeof(*c->peers))) == NULL) {
    free(c);
    return ncclSystemError;
  }
  c->id = atomic_fetch_add(&next_comm_id, 1);
  c->rank = rank;
  c->nranks = nranks;
  c->device = device;
  if (!spfake_device_identity(device, &c->device_id)) {
    comm_free(c);
    return ncclUnhandledCudaError;
  }
  c->blocking = config == NULL || config->blocking != 0;
  c->timeout_ms = settings.timeout_ms;
  c->initializing = true;
  memcpy(c->token, commId.internal + 8, 32);
  for (int p = 0; p < nranks; p++)
    c->peers[p].fd = -1;
  atomic_init(&c->abort_flag, false);

  hold_device(c, "ncclCommInitRankConfig");
  if (group.depth > 0) {
    /* Set up at ncclGroupEnd, together with the group's other ranks. */
    if (!ptrq_push(&group.inits, c)) {
      comm_free(c);
      return ncclSystemError;
    }
    *comm = (ncclComm_t)c;
    return ncclSuccess;
  }
  release_devices();
  if (c->blocking) {
    ncclResult_t res = finish_init(c, rendezvous(c));
    if (res != ncclSuccess) {
      comm_free(c);
      *comm = NULL;
      return res;
    }
    *comm = (ncclComm_t)c;
    return ncclSuccess;
  }
  if (pthread_create(&c->init_thread, NULL, init_thread, c) != 0) {
    comm_free(c);
    return ncclSystemError;
  }
  c->has_init_thread = true;
  *comm = (ncclComm_t)c;
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  struct fcomm *c = (struct fcomm *)comm;
  if (c == NULL || asyncError == NULL)
    return ncclInvalidArgument;
  pthread_mutex_lock(&engine_lock);
  if (c->finalize_pending && c->ops.n == 0)
    c->finalize_pending = false;
  *asyncError = c->error != ncclSuccess ? c->error
                : c->initializing || c->launch_pending || c->finalize_pending
                    ? ncclInProgress
                    : ncclSuccess;
  pthread_mutex_unlock(&engine_lock);
  return ncclSuccess;
}

/* Blocking: waits until every issued op has finished (or the communicator
 * failed).  Non-blocking: returns ncclInProgress; the async error turns to
 * ncclSuccess once they have. */
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  struct fcomm *c = (struct fcomm *)comm;
  if (c == NULL)
    return ncclInvalidArgument;
  bool ungrouped = group.depth == 0;
  hold_device(c, "ncclCommFinalize");
  if (ungrouped)
    release_devices();
  pthread_mutex_lock(&engine_lock);
  ncclResult_t res = c->initializing ? ncclInvalidUsage : c->error;
  if (res == ncclSuccess && !c->blocking) {
    c->finalize_pending = true;
    res = ncclInProgress;
  }
  while (res == ncclSuccess && c->error == ncclSuccess && c->ops.n > 0)
    pthread_cond_wait(&engine_cond, &engine_lock);
  if (res == ncclSuccess)
    res = c->error;
  pthread_mutex_unlock(&engine_lock);
  return res;
}

/* Both end the communicator at once: unfinished ops fail and their streams
 * move on.  Peers hear BYE (destroy) or ABORT (abort); an ABORT, or a BYE
 * while they still expect messages, fails them with ncclRemoteError. */
static ncclResult_t comm_end(struct fcomm *c, enum frame_type say) {
  if (c == NULL)
    return ncclInvalidArgument;
  atomic_store(&c->abort_flag, true);
  if (c->has_init_thread)
    pthread_join(c->init_thread, NULL);
  pthread_mutex_lock(&engine_lock);
  if (c->registered)
    engine_unregister(c, say);
  pthread_mutex_unlock(&engine_lock);
  comm_free(c);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  struct fcomm *c = (struct fcomm *)comm;
  if (c != NULL && group.depth == 0) {
    hold_device(c, "ncclCommDestroy");
    release_devices();
  }
  return comm_end(c, FRAME_BYE);
}

/* Abort is what a watchdog calls on a hung communicator, from any thread,
 * so it is not held to the one-thread rule.  It may block
 * (SHARDPORT_FAKE_NCCL_ABORT_MS), and it tells no peer. */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm != NULL && settings.abort_ms > 0)
    usleep((useconds_t)settings.abort_ms * 1000);
  return comm_end((struct fcomm *)comm, FRAME_ABORT);
}

ncclResult_t ncclGroupStart(void) {
  group.depth++;
  return ncclSuccess;
}

/* Frees an op and what it owns.  Never dereferences op->comm: a finished
 * op may outlive its communicator. */
static void nop_free(struct nop *op) {
  if (op->type == NOP_ALLREDUCE)
    for (size_t i = 0; i < op->nxfers; i++)
      if (!op->xfers[i].is_send)
        free(op->xfers[i].rbuf);
  free(op->contrib);
  free(op->xfers);
  free(op);
}

static void launch_free(struct launch *l) {
  for (size_t i = 0; i < l->n; i++)
    nop_free(l->ops[i]);
  free(l->ops);
  free(l);
}

static bool op_finished(const struct nop *op) {
  return op->state == NOP_DONE || op->state == NOP_FAILED;
}

/* Runs on the ops' stream: arms them, and holds the stream until they have
 * finished, as the NCCL kernel holds a real stream. */
static void launch_run(void *arg) {
  struct launch *l = arg;
  pthread_mutex_lock(&engine_lock);
  for (size_t i = 0; i < l->n; i++)
    if (l->ops[i]->state == NOP_POSTED && !l->ops[i]->hang)
      engine_arm(l->ops[i]);
  engine_wake();
  for (size_t i = 0; i < l->n; i++)
    while (!op_finished(l->ops[i]))
      pthread_cond_wait(&engine_cond, &engine_lock);
  pthread_mutex_unlock(&engine_lock);
  launch_free(l);
}

/* Applies fault injection and counts the launch for each communicator the
 * ops use; ops of a communicator that must not launch are marked failed. */
static ncclResult_t launch_faults(struct nop **ops, size_t n) {
  ncclResult_t res = ncclSuccess;
  for (size_t i = 0; i < n; i++) {
    struct fcomm *c = ops[i]->comm;
    bool first = true;
    for (size_t j = 0; j < i && first; j++)
      first = ops[j]->comm != c;
    if (first) {
      c->groups++;
      enum fault_action a = fault_at(c->rank, c->groups);
      if (a == FAULT_EXIT)
        _exit(3);
      if (a == FAULT_ERROR)
        engine_fail(c, ncclSystemError);
      for (size_t j = i; j < n && (a == FAULT_HANG || a == FAULT_MISMATCH); j++)
        if (ops[j]->comm == c) {
          ops[j]->hang = a == FAULT_HANG;
          ops[j]->skew = a == FAULT_MISMATCH;
        }
    }
    if (c->error != ncclSuccess || !c->registered) {
      ops[i]->state = NOP_FAILED;
      if (res == ncclSuccess)
        res = c->error != ncclSuccess ? c->error : ncclInvalidUsage;
    }
  }
  return res;
}

/* Hands the group's ops to their streams, one launch per stream, and makes
 * their messages known to the peers.  The engine lock is held throughout,
 * so no launch can run before all the group's ops are posted. */
static ncclResult_t launch(struct nop **ops, size_t n) {
  pthread_mutex_lock(&engine_lock);
  ncclResult_t res = launch_faults(ops, n);
  bool nonblocking = false;
  bool *taken = calloc(n, sizeof(*taken));
  for (size_t i = 0; taken != NULL && i < n; i++) {
    if (taken[i])
      continue;
    struct launch *l = calloc(1, sizeof(*l));
    if (l == NULL || (l->ops = calloc(n, sizeof(*l->ops))) == NULL) {
      free(l);
      res = ncclSystemError;
      break;
    }
    for (size_t j = i; j < n; j++)
      if (!taken[j] && ops[j]->stream == ops[i]->stream) {
        taken[j] = true;
        l->ops[l->n++] = ops[j];
      }
    if (spfake_stream_enqueue(ops[i]->stream, launch_run, l) != cudaSuccess) {
      res = ncclUnhandledCudaError;
      launch_free(l);
      continue;
    }
    for (size_t j = 0; j < l->n; j++) {
      struct nop *op = l->ops[j];
      if (op->state == NOP_FAILED)
        continue;
      if (!ptrq_push(&op->comm->ops, op)) {
        op->state = NOP_FAILED;
        engine_fail(op->comm, ncclSystemError);
        continue;
      }
      engine_post(op);
      if (!op->comm->blocking) {
        op->comm->launch_pending = true;
        nonblocking = true;
      }
    }
  }
  for (size_t i = 0; i < n; i++)
    if (taken == NULL || !taken[i]) {
      nop_free(ops[i]);
      res = ncclSystemError;
    }
  free(taken);
  pthread_mutex_unlock(&engine_lock);
  engine_wake();
  if (res != ncclSuccess)
    return res;
  return nonblocking ? ncclInProgress : ncclSuccess;
}

/* Starts the set-up of every communicator created in the group, each on
 * its own thread, so that ranks of one communicator held by this process
 * can meet; waits for the blocking ones. */
static ncclResult_t start_inits(struct fcomm **inits, size_t n) {
  ncclResult_t res = ncclSuccess;
  bool nonblocking = false;
  for (size_t i = 0; i < n; i++) {
    if (pthread_create(&inits[i]->init_thread, NULL, init_thread, inits[i]) != 0) {
      finish_init(inits[i], ncclSystemError);
      res = ncclSystemError;
      continue;
    }
    inits[i]->has_init_thread = true;
  }
  for (size_t i = 0; i < n; i++) {
    struct fcomm *c = inits[i];
    if (!c->blocking) {
      nonblocking = true;
      continue;
    }
    if (c->has_init_thread) {
      pthread_join(c->init_thread, NULL);
      c->has_init_thread = false;
    }
    pthread_mutex_lock(&engine_lock);
    if (res == ncclSuccess)
      res = c->error;
    pthread_mutex_unlock(&engine_lock);
  }
  if (res != ncclSuccess)
    return res;
  return nonblocking ? ncclInProgress : ncclSuccess;
}

/* An error wins over ncclInProgress, which wins over ncclSuccess. */
static ncclResult_t combine(ncclResult_t a, ncclResult_t b) {
  if (a != ncclSuccess && a != ncclInProgress)
    return a;
  if (b != ncclSuccess && b != ncclInProgress)
    return b;
  return a == ncclInProgress || b == ncclInProgress ? ncclInProgress : ncclSuccess;
}

/* A failed group leaves the communicators it created allocated, with the
 * error as their async error: abort them, as with real NCCL. */
ncclResult_t ncclGroupEnd(void) {
  if (group.depth == 0)
    return ncclInvalidUsage;
  if (--group.depth > 0)
    return ncclSuccess;
  ncclResult_t res = group.err;
  struct ptrq ops = group.ops, inits = group.inits;
  group.err = ncclSuccess;
  group.ops = (struct ptrq){0};
  group.inits = (struct ptrq){0};

  if (res == ncclSuccess && inits.n > 0)
    res = start_inits((struct fcomm **)inits.v + inits.head, inits.n);
  else
    for (size_t i = 0; i < inits.n; i++)
      finish_init(ptrq_at(&inits, i), res);
  if (ops.n > 0 && (res == ncclSuccess || res == ncclInProgress))
    res = combine(res, launch((struct nop **)ops.v + ops.head, ops.n));
  else
    for (size_t i = 0; i < ops.n; i++)
      nop_free(ptrq_at(&ops, i));
  ptrq_free(&ops);
  ptrq_free(&inits);
  release_devices();
  return res;
}

/* An op refused when issued inside a group fails the whole group, as with
 * real NCCL. */
static ncclResult_t refuse(ncclResult_t res) {
  if (group.depth > 0 && group.err == ncclSuccess)
    group.err = res;
  return res;
}

/* Checks an op's arguments and queues it in the calling thread's group; an
 * op outside any group is a group of its own. */
static ncclResult_t issue(struct nop *op) {
  struct fcomm *c = op->comm;
  ncclResult_t res = ncclSuccess;
  pthread_mutex_lock(&engine_lock);
  if (c->initializing)
    res = ncclInvalidUsage;
  else if (c->error != ncclSuccess)
    res = c->error;
  pthread_mutex_unlock(&engine_lock);
  if (res == ncclSuccess && op->type != NOP_RECV && op->bytes > 0 &&
      spfake_check_device_range(op->sbuf, op->bytes, false) != cudaSuccess)
    res = ncclInvalidArgument;
  if (res == ncclSuccess && op->type != NOP_SEND && op->bytes > 0 &&
      spfake_check_device_range(op->rbuf, op->bytes, true) != cudaSuccess)
    res = ncclInvalidArgument;
  if (res != ncclSuccess) {
    nop_free(op);
    return refuse(res);
  }
  bool implicit = group.depth == 0;
  hold_device(c, op->type == NOP_SEND   ? "ncclSend"
                 : op->type == NOP_RECV ? "ncclRecv"
                                        : "ncclAllReduce");
  if (implicit)
    ncclGroupStart();
  if (!ptrq_push(&group.ops, op)) {
    nop_free(op);
    group.err = ncclSystemError;
  }
  return implicit ? ncclGroupEnd() : ncclSuccess;
}

/* A new op with its xfers, or NULL with *res set. */
static struct nop *nop_new(struct fcomm *c, enum nop_type type, int peer,
                           const void *sbuf, void *rbuf, size_t count,
                           ncclDataType_t dtype, ncclRedOp_t redop,
                           cudaStream_t stream, ncclResult_t *res) {
  size_t esize = fake_nccl_type_size(dtype);
  *res = ncclInvalidArgument;
  if (c == NULL || esize == 0 || count > SIZE_MAX / esize ||
      (type != NOP_ALLREDUCE && (peer < 0 || peer >= c->nranks)))
    return NULL;
  *res = ncclSystemError;
  size_t nx = type == NOP_ALLREDUCE ? 2 * (size_t)(c->nranks - 1) : 1;
  struct nop *op = calloc(1, sizeof(*op));
  struct xfer *xfers = calloc(nx ? nx : 1, sizeof(*xfers));
  void **contrib = type == NOP_ALLREDUCE
                       ? calloc((size_t)c->nranks, sizeof(*contrib)) : NULL;
  if (op == NULL || xfers == NULL || (type == NOP_ALLREDUCE && contrib == NULL)) {
    free(op);
    free(xfers);
    free(contrib);
    return NULL;
  }
  *op = (struct nop){.comm = c, .type = type, .peer = peer, .sbuf = sbuf,
                     .rbuf = rbuf, .count = count, .bytes = count * esize,
                     .dtype = dtype, .redop = redop, .stream = stream,
                     .state = NOP_POSTED, .xfers = xfers, .contrib = contrib};
  const struct xfer base = {.op = op, .peer = peer, .kind = KIND_P2P,
                            .count = count, .bytes = op->bytes, .dtype = dtype,
                            .redop = redop};
  if (type == NOP_SEND) {
    xfers[op->nxfers] = base;
    xfers[op->nxfers].is_send = true;
    xfers[op->nxfers++].sbuf = sbuf;
  } else if (type == NOP_RECV) {
    xfers[op->nxfers] = base;
    xfers[op->nxfers++].rbuf = rbuf;
  }
  for (int r = 0; type == NOP_ALLREDUCE && r < c->nranks; r++) {
    if (r == c->rank)
      continue;
    if ((contrib[r] = malloc(op->bytes ? op->bytes : 1)) == NULL) {
      nop_free(op);
      return NULL;
    }
    struct xfer s = base, v = base;
    s.peer = v.peer = r;
    s.kind = v.kind = KIND_COLL;
    s.is_send = true;
    s.sbuf = sbuf;
    v.rbuf = contrib[r];
    xfers[op->nxfers++] = s;
    xfers[op->nxfers++] = v;
  }
  op->pending = op->nxfers;
  *res = ncclSuccess;
  return op;
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                      int peer, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t res;
  struct nop *op = nop_new((struct fcomm *)comm, NOP_SEND, peer, sendbuff, NULL,
                           count, datatype, ncclSum, stream, &res);
  return op != NULL ? issue(op) : refuse(res);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype,
                      int peer, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t res;
  struct nop *op = nop_new((struct fcomm *)comm, NOP_RECV, peer, NULL, recvbuff,
                           count, datatype, ncclSum, stream, &res);
  return op != NULL ? issue(op) : refuse(res);
}

/* Reduces the eight integer and floating types; half, bfloat16 and fp8
 * reductions are refused (docs/fakes.md). */
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  if ((unsigned)op >= (unsigned)ncclNumOps || datatype == ncclFloat16 ||
      datatype == ncclBfloat16 || datatype == ncclFloat8e4m3 ||
      datatype == ncclFloat8e5m2)
    return refuse(ncclInvalidArgument);
  ncclResult_t res;
  struct nop *n = nop_new((struct fcomm *)comm, NOP_ALLREDUCE, 0, sendbuff,
                          recvbuff, count, datatype, op, stream, &res);
  return n != NULL ? issue(n) : refuse(res);
}
