/*
 * daemon_attacks.c - clients that try to stall, starve or exhaust the
 * daemon, each beside a client that keeps asking for status and beside
 * other users' jobs:
 *   - storage ids crafted to collide in the daemon's hash tables;
 *   - tens of thousands of storages over one memfd, and a memfd per
 *     storage past the mapping bounds;
 *   - one user taking every job, or registering until the node's memory
 *     is gone;
 *   - bytes that are not UTF-8 where the daemon quotes a peer.
 * Costs are compared with an ordinary request of the same size measured in
 * the same run, never with fixed times (docs/operations.md, "Quotas").
 * The quota tests become another user, so the suite needs root and says it
 * skipped otherwise.
 */
#include <check.h>
#include <fcntl.h>
#include <grp.h>
#include <iconv.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/trainer.h"
#include "tests/unkeyed_hash.h"

#define NOBODY 65534
/* The slack every comparison with an ordinary run allows: what a shared,
 * busy machine may add to one measurement. */
#define NOISE_NS (50 * UINT64_C(1000000))

static struct sp_test_daemon daemon_;
static uint64_t next_id = 1;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Starts a daemon with these configuration lines; its socket and directory
 * are opened to everyone, so that another user's client reaches it (the
 * allowed uids still decide who is served).  The daemon logs at debug
 * level; with log_path, its stderr goes there. */
static void start_with(const char *conf, const char *log_path) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, conf), 0);
  const char *args[] = {"--config", path, "--log-level", "debug", NULL};
  int saved = -1;
  /* The resident-set bound below would count a sanitizer's quarantine as
   * growth. */
  sp_test_small_quarantine();
  if (log_path != NULL) {
    int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ck_assert_int_ge(fd, 0);
    saved = dup(STDERR_FILENO);
    ck_assert_int_eq(dup2(fd, STDERR_FILENO), STDERR_FILENO);
    close(fd);
  }
  int rc = sp_test_daemon_start(&daemon_, args);
  if (log_path != NULL) {
    dup2(saved, STDERR_FILENO);
    close(saved);
  }
  ck_assert_int_eq(rc, 0);
  sp_test_rmdir(dir);
  ck_assert_int_eq(chmod(daemon_.dir, 0755), 0);
  ck_assert_int_eq(chmod(daemon_.socket, 0666), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
  daemon_.pid = 0;
}

/* ---- status, and a client that keeps asking for it ------------------- */

/* The first map of the status reply's users array with this uid, copied
 * as numbers: all zero when the user holds nothing. */
struct user_use {
  uint64_t clients, jobs, ranks, registrations, registration_bytes, mappings,
      mapped_bytes;
};

static struct user_use user_status(uid_t uid) {
  struct user_use u = {0};
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_send_op(sock, "status", 1, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  const msgpack_object_array *users;
  ck_assert_int_eq(sp__msg_get_array(&r.map, "users", false, &users), 0);
  for (uint32_t i = 0; i < users->size; i++) {
    const msgpack_object *m = &users->ptr[i];
    uint64_t id;
    ck_assert_int_eq(sp__msg_get_u64(m, "uid", false, &id), 0);
    if (id != uid)
      continue;
    ck_assert_int_eq(sp__msg_get_u64(m, "clients", false, &u.clients), 0);
    ck_assert_int_eq(sp__msg_get_u64(m, "jobs", false, &u.jobs), 0);
    ck_assert_int_eq(sp__msg_get_u64(m, "ranks", false, &u.ranks), 0);
    ck_assert_int_eq(
        sp__msg_get_u64(m, "registrations", false, &u.registrations), 0);
    ck_assert_int_eq(
        sp__msg_get_u64(m, "registration_bytes", false, &u.registration_bytes),
        0);
    ck_assert_int_eq(sp__msg_get_u64(m, "mappings", false, &u.mappings), 0);
    ck_assert_int_eq(sp__msg_get_u64(m, "mapped_bytes", false, &u.mapped_bytes),
                     0);
  }
  sp_test_reply_free(&r);
  close(sock);
  /* This connection counted too. */
  if (uid == geteuid() && u.clients > 0)
    u.clients--;
  return u;
}

/* A thread that asks for status over and over, and keeps the longest wait
 * for an answer. */
struct poller {
  pthread_t thread;
  atomic_bool stop;
  atomic_bool started;
  uint64_t max_ns;
  uint32_t answers;
  int failed; /* a transport error, or 0 */
};

static void *poll_status(void *arg) {
  struct poller *p = arg;
  int sock = sp_test_connect_hello(daemon_.socket);
  if (sock < 0) {
    p->failed = sock;
    atomic_store(&p->started, true);
    return NULL;
  }
  for (uint64_t id = 1; !atomic_load(&p->stop); id++) {
    uint64_t t0 = now_ns();
    struct sp_test_reply r;
    int rc = sp_test_send_op(sock, "status", id, NULL, 0);
    if (rc == 0)
      rc = sp_test_recv(sock, &r, 120000);
    if (rc != 0) {
      p->failed = rc;
      break;
    }
    sp_test_reply_free(&r);
    uint64_t took = now_ns() - t0;
    if (took > p->max_ns)
      p->max_ns = took;
    p->answers++;
    atomic_store(&p->started, true);
  }
  atomic_store(&p->started, true);
  close(sock);
  return NULL;
}

static void poller_start(struct poller *p) {
  memset(p, 0, sizeof *p);
  ck_assert_int_eq(pthread_create(&p->thread, NULL, poll_status, p), 0);
  while (!atomic_load(&p->started))
    usleep(1000);
}

static void poller_stop(struct poller *p) {
  atomic_store(&p->stop, true);
  pthread_join(p->thread, NULL);
  ck_assert_msg(p->failed == 0, "status poller: %s", sp_err_name(p->failed));
}

/* One request timed, while the poller runs: how long its reply took, and
 * the longest status answer meanwhile. */
struct timing {
  uint64_t reply_ns;
  uint64_t status_ns;
};

static struct timing timed_call(int sock, struct sp_msgbuf *mb, uint64_t id,
                                const int *fds, size_t nfds, int *code) {
  struct poller p;
  struct timing t;
  poller_start(&p);
  uint64_t t0 = now_ns();
  ck_assert_int_eq(sp_test_send_msgbuf(sock, mb, fds, nfds), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, 120000), 0);
  t.reply_ns = now_ns() - t0;
  ck_assert_uint_eq(r.head.id, id);
  *code = r.code;
  sp_test_reply_free(&r);
  poller_stop(&p);
  t.status_ns = p.max_ns;
  return t;
}

/* The attack costs the daemon no more than the ordinary request: its reply
 * and the status answers beside it take at most twice as long, plus
 * noise. */
static void assert_as_ordinary(const char *what, struct timing attack,
                               struct timing ordinary) {
  printf("%s: reply %.1f ms, status %.1f ms at worst; ordinary: %.1f ms, "
         "%.1f ms\n",
         what, attack.reply_ns / 1e6, attack.status_ns / 1e6,
         ordinary.reply_ns / 1e6, ordinary.status_ns / 1e6);
  ck_assert_msg(attack.reply_ns <= 2 * ordinary.reply_ns + NOISE_NS &&
                    attack.status_ns <= 2 * ordinary.status_ns + NOISE_NS,
                "%s: reply %.1f ms and status %.1f ms at worst, against %.1f "
                "ms and %.1f ms for an ordinary request",
                what, attack.reply_ns / 1e6, attack.status_ns / 1e6,
                ordinary.reply_ns / 1e6, ordinary.status_ns / 1e6);
}

/* ---- ranks ------------------------------------------------------------- */

static sp_client *client(void) {
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  return c;
}

/* A raw connection joined as the one rank of a new job of creator's. */
static int raw_rank(sp_client *creator) {
  int sock = sp_test_raw_rank(daemon_.socket, creator, next_id++);
  ck_assert_int_ge(sock, 0);
  return sock;
}

static int memfd_of(const char *name, size_t size) {
  int fd = sp_test_memfd(name, size);
  ck_assert_int_ge(fd, 0);
  return fd;
}

/* storage_add of n storages of length bytes each, all in the frame's
 * descriptor fd (index), the i-th at offset i * length. */
static void pack_storages(struct sp_msgbuf *mb, uint64_t id,
                          const uint32_t *sids, size_t n, uint64_t length,
                          uint32_t fd) {
  sp__msgbuf_begin(mb, "storage_add", id, 1);
  sp__pack_str(&mb->pk, "storages");
  msgpack_pack_array(&mb->pk, n);
  for (size_t i = 0; i < n; i++) {
    msgpack_pack_map(&mb->pk, 6);
    sp__pack_kv_u64(&mb->pk, "sid", sids[i]);
    sp__pack_kv_str(&mb->pk, "kind", "memfd");
    sp__pack_kv_u64(&mb->pk, "fd", fd);
    sp__pack_kv_u64(&mb->pk, "offset", i * length);
    sp__pack_kv_u64(&mb->pk, "length", length);
    sp__pack_kv_u64(&mb->pk, "base", 0x10000000 + i * (length + 1));
  }
}

/* One storage in each of the frame's descriptors. */
static int add_one_per_fd(int sock, uint32_t first_sid, const int *fds,
                          size_t nfds, char *message, size_t size) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "storage_add", id, 1);
  sp__pack_str(&mb.pk, "storages");
  msgpack_pack_array(&mb.pk, nfds);
  for (size_t i = 0; i < nfds; i++) {
    msgpack_pack_map(&mb.pk, 6);
    sp__pack_kv_u64(&mb.pk, "sid", first_sid + i);
    sp__pack_kv_str(&mb.pk, "kind", "memfd");
    sp__pack_kv_u64(&mb.pk, "fd", i);
    sp__pack_kv_u64(&mb.pk, "offset", 0);
    sp__pack_kv_u64(&mb.pk, "length", 64);
    sp__pack_kv_u64(&mb.pk, "base", 0x20000000 + 4096 * (first_sid + i));
  }
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, fds, nfds), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  int code = r.code;
  if (message != NULL)
    snprintf(message, size, "%s", r.message);
  sp_test_reply_free(&r);
  return code;
}

/* ---- 1. hash flooding --------------------------------------------------- */

/* Storages per frame: a frame the configuration below allows.  Under the
 * old hash the crafted ones cost about N * N / 2 probes (seconds), the
 * ordinary ones about 1.5 * N. */
#define FLOOD_N 60000u
#define FLOOD_CONF "max_items = 1048576\n"

/* Sids whose old home slots in the table of FLOOD_N storages all fall in a
 * window eight times narrower than their count: one run of slots that
 * every insertion walks to its end.  The table doubles from 16 slots until
 * the storages fill at most half of it. */
static void crafted_sids(uint32_t *sids) {
  size_t cap = 16;
  while (cap < 2 * FLOOD_N)
    cap *= 2;
  size_t found = 0;
  for (uint64_t sid = 0; found < FLOOD_N && sid <= UINT32_MAX; sid++)
    if (unkeyed_home(unkeyed_u64(sid), cap) < FLOOD_N / 8)
      sids[found++] = (uint32_t)sid;
  ck_assert_uint_eq(found, FLOOD_N);
}

/* Each kind of flood runs this many times, alternating, and is judged by
 * its fastest run: one run is one sample of a shared machine, while the
 * old hash's cost (seconds) shows in every run. */
#define FLOOD_TRIES 3

static struct timing fastest(struct timing a, struct timing b) {
  return (struct timing){
      .reply_ns = a.reply_ns < b.reply_ns ? a.reply_ns : b.reply_ns,
      .status_ns = a.status_ns < b.status_ns ? a.status_ns : b.status_ns};
}

/* Empty storages need no memory, only a descriptor to name: the cheapest
 * way to fill the daemon's tables. */
static struct timing flood(sp_client *creator, const uint32_t *sids) {
  int sock = raw_rank(creator);
  int fd = memfd_of("flood", 0);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  pack_storages(&mb, id, sids, FLOOD_N, 0, 0);
  int code;
  struct timing t = timed_call(sock, &mb, id, &fd, 1, &code);
  ck_assert_msg(code == 0, "storage_add: %s", sp_err_name(code));
  close(fd);
  close(sock);
  return t;
}

START_TEST(colliding_sids_cost_as_sequential) {
  start_with(FLOOD_CONF, NULL);
  uint32_t *crafted = malloc(FLOOD_N * sizeof *crafted);
  uint32_t *sequential = malloc(FLOOD_N * sizeof *sequential);
  ck_assert_ptr_nonnull(crafted);
  ck_assert_ptr_nonnull(sequential);
  crafted_sids(crafted);
  for (uint32_t i = 0; i < FLOOD_N; i++)
    sequential[i] = i;
  sp_client *creator = client();
  struct timing ordinary = flood(creator, sequential);
  struct timing attack = flood(creator, crafted);
  for (int i = 1; i < FLOOD_TRIES; i++) {
    ordinary = fastest(ordinary, flood(creator, sequential));
    attack = fastest(attack, flood(creator, crafted));
  }
  assert_as_ordinary("crafted storage ids", attack, ordinary);
  sp_close(creator);
  free(crafted);
  free(sequential);
}
END_TEST

/* ---- 6. mappings -------------------------------------------------------- */

/* Mappings of the daemon's whose file is a memfd of this name. */
/* The daemon's mappings of memfds of this name: how many, and their bytes
 * in *bytes when not NULL. */
static int daemon_maps_sized(const char *memfd_name, uint64_t *bytes) {
  char path[64], line[512], needle[64];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)daemon_.pid);
  snprintf(needle, sizeof needle, "/memfd:%s ", memfd_name);
  FILE *f = fopen(path, "re");
  ck_assert_ptr_nonnull(f);
  int n = 0;
  uint64_t sum = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    if (strstr(line, needle) == NULL)
      continue;
    unsigned long long from, to;
    ck_assert_int_eq(sscanf(line, "%llx-%llx", &from, &to), 2);
    sum += to - from;
    n++;
  }
  fclose(f);
  if (bytes != NULL)
    *bytes = sum;
  return n;
}

static int daemon_maps_of(const char *memfd_name) {
  return daemon_maps_sized(memfd_name, NULL);
}

/* A two-rank export of a small model, as a trainer runs one. */
static void legitimate_job_exports(void) {
  struct tkey keys[] = {
      K(.name = "w", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
        .shape = {64, 16}, .parts = {40, 24}),
      K(.name = "b", .kind = REPLICATED, .dtype = "bfloat16", .es = 2,
        .ndim = 1, .shape = {16})};
  struct scenario sc = {.world = 2, .nkeys = 2, .keys = keys};
  const char *sockets[TRAINER_MAXR] = {daemon_.socket, daemon_.socket};
  struct world w;
  trainer_start(&w, &sc, sockets);
  trainer_finish(&w, &sc);
  trainer_assert_exported(&w, &sc);
  trainer_free(&w, &sc);
}

/* 65,536 one-page storages over one memfd, in frames of 8,192: more than
 * vm.max_map_count's default if each had its own mapping.  One mapping
 * holds them all, status answers as beside frames of as many empty
 * storages (which map nothing), and another job exports beside them. */
START_TEST(one_memfd_many_storages) {
  enum { PAGES = 65536, FRAME = 8192 };
  start_with("", NULL);
  sp_client *creator = client();
  int sock = raw_rank(creator);
  int fd = memfd_of("attack", (size_t)PAGES * 4096);
  uint32_t *sids = malloc(FRAME * sizeof *sids);
  ck_assert_ptr_nonnull(sids);
  struct timing worst = {0};
  for (uint32_t first = 0; first < PAGES; first += FRAME) {
    for (uint32_t i = 0; i < FRAME; i++)
      sids[i] = first + i;
    struct sp_msgbuf mb;
    uint64_t id = next_id++;
    sp__msgbuf_begin(&mb, "storage_add", id, 1);
    sp__pack_str(&mb.pk, "storages");
    msgpack_pack_array(&mb.pk, FRAME);
    for (uint32_t i = 0; i < FRAME; i++) {
      msgpack_pack_map(&mb.pk, 6);
      sp__pack_kv_u64(&mb.pk, "sid", sids[i]);
      sp__pack_kv_str(&mb.pk, "kind", "memfd");
      sp__pack_kv_u64(&mb.pk, "fd", 0);
      sp__pack_kv_u64(&mb.pk, "offset", (uint64_t)(first + i) * 4096);
      sp__pack_kv_u64(&mb.pk, "length", 4096);
      sp__pack_kv_u64(&mb.pk, "base",
                      0x100000000 + (uint64_t)(first + i) * 4096);
    }
    int code;
    struct timing t = timed_call(sock, &mb, id, &fd, 1, &code);
    ck_assert_msg(code == 0, "storages %u..: %s", first, sp_err_name(code));
    if (t.status_ns > worst.status_ns)
      worst = t;
  }
  ck_assert_int_eq(daemon_maps_of("attack"), 1);
  ck_assert_uint_eq(user_status(geteuid()).mappings, 1);

  /* The same frames of empty storages, which need no mapping. */
  int empty = memfd_of("ordinary", 0);
  int other = raw_rank(creator);
  struct timing ordinary = {0};
  for (uint32_t first = 0; first < PAGES; first += FRAME) {
    for (uint32_t i = 0; i < FRAME; i++)
      sids[i] = first + i;
    struct sp_msgbuf mb;
    uint64_t id = next_id++;
    pack_storages(&mb, id, sids, FRAME, 0, 0);
    int code;
    struct timing t = timed_call(other, &mb, id, &empty, 1, &code);
    ck_assert_int_eq(code, 0);
    if (t.status_ns > ordinary.status_ns)
      ordinary = t;
  }
  printf("one memfd: status %.1f ms at worst beside one-page storages, "
         "%.1f ms beside empty ones\n",
         worst.status_ns / 1e6, ordinary.status_ns / 1e6);
  ck_assert_msg(worst.status_ns <= 2 * ordinary.status_ns + NOISE_NS,
                "status took %.1f ms beside frames of 8,192 one-page "
                "storages, %.1f ms beside frames of as many empty ones",
                worst.status_ns / 1e6, ordinary.status_ns / 1e6);
  legitimate_job_exports();
  close(other);
  close(empty);
  free(sids);
  close(fd);
  close(sock);
  sp_close(creator);
}
END_TEST

/* max_client_mappings and max_user_mappings at their edges: a file a rank
 * maps already costs nothing more, another file one more mapping. */
START_TEST(mapping_bounds) {
  start_with("max_client_mappings = 4\nmax_user_mappings = 6\n", NULL);
  sp_client *creator = client();
  int a = raw_rank(creator), b = raw_rank(creator);
  int fds[8];
  for (int i = 0; i < 8; i++)
    fds[i] = memfd_of("bound", 4096);
  char msg[SP_ERRMSG_MAX + 1];
  /* Four files on rank a: its limit, kept. */
  ck_assert_int_eq(add_one_per_fd(a, 0, fds, 4, msg, sizeof msg), 0);
  ck_assert_uint_eq(user_status(geteuid()).mappings, 4);
  /* A fifth is refused, and names the bound. */
  ck_assert_int_eq(add_one_per_fd(a, 10, fds + 4, 1, msg, sizeof msg),
                   SP_ELIMIT);
  ck_assert_ptr_nonnull(strstr(msg, "max_client_mappings"));
  /* A file it maps already, by a new descriptor, costs nothing. */
  int again = dup(fds[2]);
  ck_assert_int_eq(add_one_per_fd(a, 20, &again, 1, msg, sizeof msg), 0);
  close(again);
  /* Rank b takes the user to its bound of six, and no further. */
  ck_assert_int_eq(add_one_per_fd(b, 0, fds + 4, 2, msg, sizeof msg), 0);
  ck_assert_int_eq(add_one_per_fd(b, 10, fds + 6, 1, msg, sizeof msg),
                   SP_ELIMIT);
  ck_assert_ptr_nonnull(strstr(msg, "max_user_mappings"));
  ck_assert_uint_eq(user_status(geteuid()).mappings, 6);
  /* Rank a's mappings go with it. */
  close(a);
  for (int tries = 0; user_status(geteuid()).mappings != 2; tries++) {
    ck_assert_int_lt(tries, 500);
    usleep(10000);
  }
  ck_assert_int_eq(add_one_per_fd(b, 10, fds + 6, 2, msg, sizeof msg), 0);
  for (int i = 0; i < 8; i++)
    close(fds[i]);
  close(b);
  sp_close(creator);
}
END_TEST

/* One storage_add frame of n storages of length bytes in the frame's one
 * descriptor, the i-th at offset first + i * stride. */
static int add_spaced(int sock, int fd, uint32_t first_sid, size_t n,
                      uint64_t first, uint64_t stride, uint64_t length) {
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "storage_add", id, 1);
  sp__pack_str(&mb.pk, "storages");
  msgpack_pack_array(&mb.pk, n);
  for (size_t i = 0; i < n; i++) {
    msgpack_pack_map(&mb.pk, 6);
    sp__pack_kv_u64(&mb.pk, "sid", first_sid + i);
    sp__pack_kv_str(&mb.pk, "kind", "memfd");
    sp__pack_kv_u64(&mb.pk, "fd", 0);
    sp__pack_kv_u64(&mb.pk, "offset", first + i * stride);
    sp__pack_kv_u64(&mb.pk, "length", length);
    sp__pack_kv_u64(&mb.pk, "base", (uint64_t)(first_sid + i + 1) << 32);
  }
  int code;
  timed_call(sock, &mb, id, &fd, 1, &code);
  return code;
}

/* 64 one-page storages 256 GiB apart in a sparse memfd of 16 TiB: the
 * daemon maps the pages around them, not the file, and its address space
 * (VmSize) grows by far less than the gaps between them. */
START_TEST(sparse_file_maps_storage_pages) {
  enum { STORAGES = 64 };
  const uint64_t stride = UINT64_C(256) << 30;
  start_with("", NULL);
  sp_client *creator = client();
  int sock = raw_rank(creator);
  int fd = memfd_of("sparse", (size_t)(STORAGES * stride));
  long vm_before = sp_test_vm_kb(daemon_.pid, "VmSize");
  long rss_before = sp_test_rss_kb(daemon_.pid);
  ck_assert_int_eq(add_spaced(sock, fd, 0, STORAGES, 0, stride, 4096), 0);
  long vm_grown = sp_test_vm_kb(daemon_.pid, "VmSize") - vm_before;
  long rss_grown = sp_test_rss_kb(daemon_.pid) - rss_before;
  printf("sparse memfd of %llu GiB, %d one-page storages: VmSize grew by "
         "%ld KiB, VmRSS by %ld KiB\n",
         (unsigned long long)(STORAGES * stride >> 30), STORAGES, vm_grown,
         rss_grown);
  ck_assert_msg(vm_grown < 64 * 1024,
                "VmSize grew by %ld KiB for %d pages of storage", vm_grown,
                STORAGES);
  /* Each page's run is widened to two pages (registry.c). */
  ck_assert_uint_eq(user_status(geteuid()).mapped_bytes,
                    2 * STORAGES * 4096);
  legitimate_job_exports();
  close(fd);
  close(sock);
  sp_close(creator);
}
END_TEST

/* max_user_mapped_bytes at its edge: whole files of 768 KiB and 256 KiB
 * take a user to 1 MiB exactly; one more page is refused, names the
 * bound, and maps nothing. */
START_TEST(mapped_bytes_bound) {
  start_with("max_user_mapped_bytes = 1M\n", NULL);
  sp_client *creator = client();
  int sock = raw_rank(creator);
  int big = memfd_of("mapped", 768 << 10), rest = memfd_of("mapped", 256 << 10);
  int page = memfd_of("mapped", 4096);
  ck_assert_int_eq(add_spaced(sock, big, 0, 1, 0, 0, 768 << 10), 0);
  ck_assert_int_eq(add_spaced(sock, rest, 1, 1, 0, 0, 256 << 10), 0);
  ck_assert_uint_eq(user_status(geteuid()).mapped_bytes, 1 << 20);
  int before = daemon_maps_of("mapped");
  char msg[SP_ERRMSG_MAX + 1];
  ck_assert_int_eq(add_one_per_fd(sock, 2, &page, 1, msg, sizeof msg),
                   SP_ELIMIT);
  ck_assert_ptr_nonnull(strstr(msg, "max_user_mapped_bytes"));
  ck_assert_int_eq(daemon_maps_of("mapped"), before);
  ck_assert_uint_eq(user_status(geteuid()).mapped_bytes, 1 << 20);
  close(big);
  close(rest);
  close(page);
  close(sock);
  sp_close(creator);
}
END_TEST

/* 32,768 one-page storages on every other page of the first 256 MiB of a
 * memfd of 1 GiB, in frames of 8,192: accepted, one mapping, and the
 * daemon maps no more than twice the pages registered, not the file. */
START_TEST(every_other_page_accepted) {
  enum { STORAGES = 32768, FRAME = 8192 };
  start_with("", NULL);
  sp_client *creator = client();
  int sock = raw_rank(creator);
  int fd = memfd_of("alternate", (size_t)1 << 30);
  for (uint32_t first = 0; first < STORAGES; first += FRAME)
    ck_assert_int_eq(add_spaced(sock, fd, first, FRAME,
                                (uint64_t)first * 2 * 4096, 2 * 4096, 4096),
                     0);
  /* The memfd's mappings themselves: the daemon's whole address space
   * also holds its worker threads' stacks and malloc arenas. */
  uint64_t mapped;
  ck_assert_int_eq(daemon_maps_sized("alternate", &mapped), 1);
  printf("every other page: %d storages, %llu KiB of the memfd mapped\n",
         STORAGES, (unsigned long long)(mapped >> 10));
  ck_assert_msg(mapped < (uint64_t)512 << 20,
                "%llu KiB of the memfd mapped for %d one-page storages",
                (unsigned long long)(mapped >> 10), STORAGES);
  struct user_use u = user_status(geteuid());
  ck_assert_uint_eq(u.mappings, 1);
  ck_assert_uint_le(u.mapped_bytes, (uint64_t)2 * STORAGES * 4096);
  close(fd);
  close(sock);
  sp_close(creator);
}
END_TEST

/* ---- 7. per-user quotas ------------------------------------------------- */

/* In a child that becomes NOBODY: a job of one rank, one storage and one
 * tensor, exported; the export's code (0 when it published), or 100 when
 * the child could not become NOBODY. */
static int export_as_nobody(void) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
      _exit(100);
    sp_client *c = NULL;
    sp_ticket t;
    int fd = memfd_create("nobody", MFD_CLOEXEC);
    float v[4] = {1, 2, 3, 4};
    if (fd < 0 || write(fd, v, sizeof v) != (ssize_t)sizeof v)
      _exit(101);
    void *addr = mmap(NULL, sizeof v, PROT_READ, MAP_SHARED, fd, 0);
    sp_storage_desc s = {
        .id = 1, .fd = fd, .offset = 0, .length = sizeof v, .addr = addr};
    sp_tensor_desc td = {.key = "v",
                         .storage = 1,
                         .dtype = "float32",
                         .ndim = 1,
                         .shape = {4},
                         .stride = {1},
                         .placement = SP_PLACEMENT_REPLICATED,
                         .global_ndim = 1,
                         .global_shape = {4}};
    sp_owned_set *owned = NULL;
    int rc = sp_connect(daemon_.socket, &c);
    if (rc == 0)
      rc = sp_job_create(c, 1, &t);
    if (rc == 0)
      rc = sp_job_join(c, &t, 0, 1, "cpu");
    if (rc == 0)
      rc = sp_register_storages(c, &s, 1);
    if (rc == 0)
      rc = sp_register_tensors(c, &td, 1);
    if (rc == 0)
      rc = sp_export(c, NULL, &owned);
    if (rc == 0)
      rc = sp_release(c, owned);
    sp_close(c);
    _exit(rc == 0 ? 0 : -rc);
  }
  return sp_test_wait(pid, 4 * SP_TEST_TIMEOUT_MS);
}

#define QUOTA_USERS "allowed_uids = 0, 65534\n"

/* A user at max_user_jobs gets no more; another user's jobs go on. */
START_TEST(user_jobs_bounded) {
  start_with(QUOTA_USERS "max_jobs = 8\nmax_user_jobs = 3\n", NULL);
  sp_client *c = client();
  sp_ticket t;
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(sp_job_create(c, 2, &t), 0);
  ck_assert_int_eq(sp_job_create(c, 2, &t), SP_ELIMIT);
  ck_assert_ptr_nonnull(strstr(sp_last_message(c), "max_user_jobs"));
  ck_assert_uint_eq(user_status(geteuid()).jobs, 3);
  /* The creator leaves; its jobs still count until they end. */
  sp_close(c);
  c = client();
  ck_assert_int_eq(sp_job_create(c, 2, &t), SP_ELIMIT);
  ck_assert_int_eq(export_as_nobody(), 0);
  sp_close(c);
}
END_TEST

/* A tensor of one float32 element in storage 1, under key. */
static sp_tensor_desc one_element(const char *key) {
  return (sp_tensor_desc){.key = key,
                          .storage = 1,
                          .dtype = "float32",
                          .ndim = 1,
                          .shape = {1},
                          .stride = {1},
                          .placement = SP_PLACEMENT_REPLICATED,
                          .global_ndim = 1,
                          .global_shape = {1}};
}

/* A library rank of a new job, with storage 1 (4 bytes) registered. */
static sp_client *rank_with_storage(int fd, const void *addr) {
  sp_client *c = client();
  sp_ticket t;
  ck_assert_int_eq(sp_job_create(c, 1, &t), 0);
  ck_assert_int_eq(sp_job_join(c, &t, 0, 1, "cpu"), 0);
  sp_storage_desc s = {.id = 1, .fd = fd, .offset = 0, .length = 4,
                       .addr = addr};
  ck_assert_int_eq(sp_register_storages(c, &s, 1), 0);
  return c;
}

/* max_user_registrations at its edge, over two ranks of one user; a rank
 * that leaves gives its registrations back. */
START_TEST(user_registrations_bounded) {
  start_with(QUOTA_USERS "max_user_registrations = 10\n", NULL);
  int fd = memfd_of("regs", 4096);
  void *addr = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
  sp_client *a = rank_with_storage(fd, addr);
  sp_client *b = rank_with_storage(fd, addr);
  char keys[8][8];
  sp_tensor_desc t[8];
  for (int i = 0; i < 8; i++) {
    snprintf(keys[i], sizeof keys[i], "k%d", i);
    t[i] = one_element(keys[i]);
  }
  ck_assert_int_eq(sp_register_tensors(a, t, 5), 0);
  ck_assert_int_eq(sp_register_tensors(b, t, 3), 0);
  ck_assert_uint_eq(user_status(geteuid()).registrations, 10);
  ck_assert_int_eq(sp_register_tensors(b, t + 3, 1), SP_ELIMIT);
  ck_assert_ptr_nonnull(strstr(sp_last_message(b), "max_user_registrations"));
  ck_assert_int_eq(export_as_nobody(), 0);
  sp_close(a);
  for (int tries = 0; user_status(geteuid()).registrations != 4; tries++) {
    ck_assert_int_lt(tries, 500);
    usleep(10000);
  }
  ck_assert_int_eq(sp_register_tensors(b, t + 3, 1), 0);
  sp_close(b);
  munmap(addr, 4096);
  close(fd);
}
END_TEST

/* Keys of any length up to 1,024 bytes, each unique by its first digits. */
static void key_of(char *buf, size_t len, uint32_t n) {
  memset(buf, 'k', len);
  buf[len] = '\0';
  char digits[16];
  int d = snprintf(digits, sizeof digits, "%u.", n);
  memcpy(buf, digits, (size_t)d < len ? (size_t)d : len);
}

/* One user registers tensors with keys of up to 1,024 bytes until
 * max_user_registration_bytes: it reaches the bound exactly, one byte more
 * is refused, and the daemon's memory grew by at most twice the bound
 * (docs/operations.md).  Another user's job exports beside it. */
START_TEST(user_registration_bytes_bounded) {
  enum { LIMIT = 64 << 20 };
  start_with(QUOTA_USERS "max_user_registration_bytes = 64M\n", NULL);
  int fd = memfd_of("bytes", 4096);
  void *addr = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
  long rss_before = sp_test_rss_kb(daemon_.pid);
  sp_client *c = rank_with_storage(fd, addr);
  static char key[2][1025];
  /* What a tensor costs beside its key's bytes, from status. */
  uint64_t before = user_status(geteuid()).registration_bytes;
  key_of(key[0], 10, 0);
  sp_tensor_desc t = one_element(key[0]);
  ck_assert_int_eq(sp_register_tensors(c, &t, 1), 0);
  uint64_t used = user_status(geteuid()).registration_bytes;
  uint64_t base = used - before - 11;
  /* Whole frames of 1,024-byte keys while two more tensors fit... */
  enum { BATCH = 512 };
  static char keys[BATCH][1025];
  sp_tensor_desc batch[BATCH];
  uint32_t n = 1;
  while (LIMIT - used > (uint64_t)BATCH * (base + 1025) + 2 * (base + 1025)) {
    for (uint32_t i = 0; i < BATCH; i++) {
      key_of(keys[i], 1024, n + i);
      batch[i] = one_element(keys[i]);
    }
    ck_assert_int_eq(sp_register_tensors(c, batch, BATCH), 0);
    n += BATCH;
    used += (uint64_t)BATCH * (base + 1025);
  }
  while (LIMIT - used > 2 * (base + 1025)) {
    key_of(key[0], 1024, n++);
    t = one_element(key[0]);
    ck_assert_int_eq(sp_register_tensors(c, &t, 1), 0);
    used += base + 1025;
  }
  ck_assert_uint_eq(user_status(geteuid()).registration_bytes, used);
  /* ...then two whose keys take the user to the bound exactly. */
  uint64_t rest = LIMIT - used - 2 * (base + 1);
  ck_assert_uint_ge(rest, 2);
  ck_assert_uint_le(rest, 2048);
  key_of(key[0], rest / 2, n++);
  key_of(key[1], rest - rest / 2, n++);
  sp_tensor_desc last[2] = {one_element(key[0]), one_element(key[1])};
  ck_assert_int_eq(sp_register_tensors(c, last, 2), 0);
  ck_assert_uint_eq(user_status(geteuid()).registration_bytes, LIMIT);
  key_of(key[0], 1, n++);
  t = one_element(key[0]);
  ck_assert_int_eq(sp_register_tensors(c, &t, 1), SP_ELIMIT);
  ck_assert_ptr_nonnull(
      strstr(sp_last_message(c), "max_user_registration_bytes"));
  long grown_kb = sp_test_rss_kb(daemon_.pid) - rss_before;
  printf("registration bytes: the daemon grew by %ld KiB for %d KiB of "
         "registrations\n",
         grown_kb, LIMIT / 1024);
  ck_assert_msg(grown_kb * 1024 <= 2 * (long)LIMIT,
                "the daemon grew by %ld KiB for %d KiB of registrations",
                grown_kb, LIMIT / 1024);
  ck_assert_int_eq(export_as_nobody(), 0);
  sp_close(c);
  munmap(addr, 4096);
  close(fd);
}
END_TEST

/* ---- 9. what the daemon quotes back ------------------------------------- */

/* Whether s is UTF-8, as a strict decoder sees it (glibc's iconv refuses
 * what is not). */
static bool utf8(const char *s, size_t len) {
  iconv_t cd = iconv_open("UTF-8", "UTF-8");
  ck_assert(cd != (iconv_t)-1);
  char *out = malloc(4 * len + 4);
  char *in = (char *)s, *o = out;
  size_t inleft = len, outleft = 4 * len + 4;
  bool ok = iconv(cd, &in, &inleft, &o, &outleft) != (size_t)-1;
  free(out);
  iconv_close(cd);
  return ok;
}

/* {"op":<bytes ff ff ff>,"id":7}. */
static void send_bad_op(int sock) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "\xff\xff\xff", 7, 0);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
}

static void expect_utf8_error(int sock, int code) {
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(r.code, code);
  const char *msg;
  size_t len;
  ck_assert_int_eq(sp__msg_get_str(&r.map, "message", false, &msg, &len), 0);
  ck_assert_msg(utf8(msg, len), "the message is not UTF-8: %.*s", (int)len,
                msg);
  ck_assert_ptr_nonnull(strstr(r.message, "\\xff\\xff\\xff"));
  sp_test_reply_free(&r);
}

START_TEST(error_replies_are_utf8) {
  start_with("", NULL);
  /* After hello: an unknown op. */
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  send_bad_op(sock);
  expect_utf8_error(sock, SP_EUNKNOWNOP);
  ck_assert_int_eq(sp_test_ping(sock, 8), 0);
  close(sock);
  /* Before it: not a hello. */
  sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  send_bad_op(sock);
  expect_utf8_error(sock, SP_EHELLO);
  close(sock);
}
END_TEST

/* A client name of bytes that are not UTF-8, with a line break and a
 * forged line after it: the daemon's log stays UTF-8, one line per event. */
START_TEST(log_lines_are_utf8) {
  char dir[256], log[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(log, sizeof log, "%s/daemon.log", dir);
  start_with("", log);
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", 1, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION);
  sp__pack_kv_str(&mb.pk, "client", "\xfe\xff\nshardportd: error: forged");
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(r.code, 0);
  sp_test_reply_free(&r);
  close(sock);
  stop();
  FILE *f = fopen(log, "re");
  ck_assert_ptr_nonnull(f);
  char line[4096];
  bool quoted = false;
  while (fgets(line, sizeof line, f) != NULL) {
    ck_assert_msg(utf8(line, strlen(line)), "a log line is not UTF-8: %s",
                  line);
    ck_assert_msg(strncmp(line, "shardportd: error: forged", 25) != 0,
                  "a client forged a log line");
    quoted = quoted || strstr(line, "\\xfe\\xff") != NULL;
  }
  fclose(f);
  ck_assert_msg(quoted, "the hello's client name was not logged");
  sp_test_rmdir(dir);
}
END_TEST

int main(void) {
  if (geteuid() != 0) {
    printf("daemon-attacks: SKIPPED: needs root to connect as another user "
           "beside the attacker\n");
    return 77;
  }
  Suite *s = suite_create("daemon-attacks");
  TCase *tc = tcase_create("attacks");
  tcase_add_checked_fixture(tc, NULL, stop);
  tcase_set_timeout(tc, 240);
  tcase_add_test(tc, colliding_sids_cost_as_sequential);
  tcase_add_test(tc, one_memfd_many_storages);
  tcase_add_test(tc, mapping_bounds);
  tcase_add_test(tc, sparse_file_maps_storage_pages);
  tcase_add_test(tc, mapped_bytes_bound);
  tcase_add_test(tc, every_other_page_accepted);
  tcase_add_test(tc, user_jobs_bounded);
  tcase_add_test(tc, user_registrations_bounded);
  tcase_add_test(tc, user_registration_bytes_bounded);
  tcase_add_test(tc, error_replies_are_utf8);
  tcase_add_test(tc, log_lines_are_utf8);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
