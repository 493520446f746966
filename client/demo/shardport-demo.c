/*
 * shardport-demo.c - the main job: N trainer ranks export a synthetic
 * sharded model through the node's shardportd and check every byte.
 *
 * The parent forks ranks 1..N-1 before anything connects and then runs rank
 * 0 itself.  Rank 0 creates the job and hands the ticket to each other rank
 * through a pipe.  Every rank builds its part of one deterministic model
 * (each element a hash of its key and flat index, so any rank can compute
 * the unsharded original): dim-0 shards with uneven and empty row ranges,
 * replicated and plain tensors, experts held whole by one rank, in bfloat16
 * and float32, several tensors per memfd storage at aligned offsets.  Each
 * rank registers, exports, checks every tensor it owns against the
 * original, releases (as many times as --exports says: a job that exports
 * every few steps), checks that its registered memory is byte for byte
 * what it wrote, and leaves; then it sends rank 0 what it owned, and rank 0
 * checks that every key was owned exactly once and prints one summary line.
 *
 * With --consumers N the job pushes into N tensor-parallel consumers
 * instead (consumers.h): forked like the ranks, each joins with the
 * ticket, registers its buffer and targets, and checks every byte of every
 * push against the original of that step; the ranks write the next step's
 * values into their storages between pushes, as an optimizer does.
 * --via-export delivers the same bytes the way it is done without
 * consumers, for comparison: the ranks export whole tensors and each owner
 * copies every consumer's slices out of them.
 *
 * The same program is the load generator of tests/bench/export_bench,
 * nodes_bench and consumers_bench (--machine prints the figures as
 * key=value pairs).
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/demo/consumers.h"
#include "client/demo/model.h"
#include "shardport.h"

/* Daemons the ranks may be spread over (one --socket each). */
#define MAX_NODES 8
#define ALIGN 64
/* Bytes that fill a storage between tensors: they must survive too. */
#define FILLER 0xa5
/* Exports or pushes one run may make in a row (--exports, --pushes). */
#define MAX_EXPORTS 16
/* Consumers a demo job may push into (--consumers). */
#define MAX_DEMO_CONSUMERS 16

/* ---- options ---- */

struct opts {
  uint32_t ranks;
  double scale;
  /* The daemons' sockets: ranks are spread over them in blocks, rank 0's
   * daemon first (a job across nodes when there are several). */
  const char *sockets[MAX_NODES];
  uint32_t nsockets;
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms;
  const char *status_cmd;
  uint32_t exports;
  bool machine;
  uint32_t consumers;
  const char *consumer_socket;
  uint32_t pushes;
  bool via_export;
};

static void usage(FILE *f) {
  fprintf(f,
          "usage: shardport-demo [options]\n"
          "  -r, --ranks N        trainer ranks (default 4, at most %d)\n"
          "  -S, --scale X        model size factor (default 1: about 450 "
          "MiB)\n"
          "  -s, --socket PATH    the daemon's socket (default: as "
          "libshardport finds it);\n"
          "                       given up to %d times, the ranks are "
          "spread over\n"
          "                       those daemons in blocks (a job across "
          "nodes)\n"
          "      --max-keys N     keys per round (default: the daemon's)\n"
          "      --max-bytes N    traffic per round in bytes (default: the "
          "daemon's)\n"
          "      --timeout-ms N   the export's timeout (default: the "
          "daemon's)\n"
          "      --status-cmd CMD run CMD with /bin/sh once while the export "
          "moves data\n"
          "      --exports N      export, check and release N times in a "
          "row (default 1,\n"
          "                       at most %d); the summary gives the first "
          "and the last\n"
          "      --consumers N    push into N tensor-parallel consumers "
          "(at most %d)\n"
          "                       instead of exporting\n"
          "      --consumer-socket PATH\n"
          "                       the consumers' daemon (default: the last "
          "--socket)\n"
          "      --pushes N       with --consumers: push N times (default "
          "3, at most %d),\n"
          "                       the weights changing in between\n"
          "      --via-export     with --consumers: export whole tensors "
          "and copy the\n"
          "                       consumers' slices out of them instead, "
          "for comparison\n"
          "      --machine        print the summary as key=value pairs\n"
          "  -h, --help           this text\n",
          MAX_RANKS, MAX_NODES, MAX_EXPORTS, MAX_DEMO_CONSUMERS, MAX_EXPORTS);
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || *end || s[0] == '-' || v > max)
    return -1;
  *out = v;
  return 0;
}

static int parse_opts(int argc, char **argv, struct opts *o) {
  enum {
    MAX_KEYS = 256,
    MAX_BYTES,
    TIMEOUT,
    STATUS_CMD,
    EXPORTS,
    MACHINE,
    CONSUMERS,
    CONSUMER_SOCKET,
    PUSHES,
    VIA_EXPORT
  };
  static const struct option longopts[] = {
      {"ranks", required_argument, NULL, 'r'},
      {"scale", required_argument, NULL, 'S'},
      {"socket", required_argument, NULL, 's'},
      {"max-keys", required_argument, NULL, MAX_KEYS},
      {"max-bytes", required_argument, NULL, MAX_BYTES},
      {"timeout-ms", required_argument, NULL, TIMEOUT},
      {"status-cmd", required_argument, NULL, STATUS_CMD},
      {"exports", required_argument, NULL, EXPORTS},
      {"machine", no_argument, NULL, MACHINE},
      {"consumers", required_argument, NULL, CONSUMERS},
      {"consumer-socket", required_argument, NULL, CONSUMER_SOCKET},
      {"pushes", required_argument, NULL, PUSHES},
      {"via-export", no_argument, NULL, VIA_EXPORT},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  *o = (struct opts){.ranks = 4, .scale = 1.0, .exports = 1, .pushes = 3};
  int c;
  uint64_t v;
  while ((c = getopt_long(argc, argv, "r:S:s:h", longopts, NULL)) != -1) {
    switch (c) {
    case 'r':
      if (parse_u64(optarg, MAX_RANKS, &v) < 0 || v == 0)
        return -1;
      o->ranks = (uint32_t)v;
      break;
    case 'S': {
      char *end;
      o->scale = strtod(optarg, &end);
      if (end == optarg || *end || !(o->scale > 0) || o->scale > 16)
        return -1;
      break;
    }
    case 's':
      if (o->nsockets == MAX_NODES)
        return -1;
      o->sockets[o->nsockets++] = optarg;
      break;
    case MAX_KEYS:
      if (parse_u64(optarg, UINT32_MAX, &v) < 0)
        return -1;
      o->max_keys = (uint32_t)v;
      break;
    case MAX_BYTES:
      if (parse_u64(optarg, UINT64_MAX, &o->max_bytes) < 0)
        return -1;
      break;
    case TIMEOUT:
      if (parse_u64(optarg, UINT32_MAX, &v) < 0)
        return -1;
      o->timeout_ms = (uint32_t)v;
      break;
    case STATUS_CMD:
      o->status_cmd = optarg;
      break;
    case EXPORTS:
      if (parse_u64(optarg, MAX_EXPORTS, &v) < 0 || v == 0)
        return -1;
      o->exports = (uint32_t)v;
      break;
    case MACHINE:
      o->machine = true;
      break;
    case CONSUMERS:
      if (parse_u64(optarg, MAX_DEMO_CONSUMERS, &v) < 0 || v == 0)
        return -1;
      o->consumers = (uint32_t)v;
      break;
    case CONSUMER_SOCKET:
      o->consumer_socket = optarg;
      break;
    case PUSHES:
      if (parse_u64(optarg, MAX_EXPORTS, &v) < 0 || v == 0)
        return -1;
      o->pushes = (uint32_t)v;
      break;
    case VIA_EXPORT:
      o->via_export = true;
      break;
    case 'h':
      usage(stdout);
      exit(0);
    default:
      return -1;
    }
  }
  if (o->via_export && o->consumers == 0)
    return -1;
  if (o->consumer_socket == NULL && o->nsockets > 0)
    o->consumer_socket = o->sockets[o->nsockets - 1];
  return optind == argc ? 0 : -1;
}

/* ---- one rank's holdings ---- */

/* What a rank holds of a key: elements [first, first + count) of the
 * original, as a tensor of shape rows x cols at byte_off in its group's
 * storage. */
struct holding {
  uint32_t key;
  int64_t rows;
  uint64_t first, count;
  uint64_t byte_off;
};

struct storage {
  int fd;
  uint8_t *addr;
  uint64_t len;
};

struct rank_state {
  const struct model *m;
  uint32_t rank;
  uint32_t step; /* the model's values its storages hold */
  size_t nheld;
  struct holding *held;
  struct storage *storages; /* [ngroups] */
};

static bool holds(const struct key *k, uint32_t rank) {
  return k->kind != EXPERT || k->expert == rank;
}

static void holding_of(const struct key *k, uint32_t rank,
                       struct holding *h) {
  if (k->kind == SHARD0) {
    h->rows = k->rows[rank + 1] - k->rows[rank];
    h->first = (uint64_t)(k->rows[rank] * key_cols(k));
    h->count = (uint64_t)(h->rows * key_cols(k));
  } else {
    h->rows = k->shape[0];
    h->first = 0;
    h->count = key_numel(k);
  }
}

/* Lays out the rank's holdings group by group; storage lengths in len. */
static int plan_rank(struct rank_state *s) {
  const struct model *m = s->m;
  s->held = calloc(m->nkeys, sizeof *s->held);
  s->storages = calloc(m->ngroups, sizeof *s->storages);
  if (!s->held || !s->storages)
    return -1;
  for (uint32_t i = 0; i < m->nkeys; i++) {
    const struct key *k = &m->keys[i];
    if (!holds(k, s->rank))
      continue;
    struct holding *h = &s->held[s->nheld++];
    h->key = i;
    holding_of(k, s->rank, h);
    struct storage *st = &s->storages[k->group];
    h->byte_off = (st->len + ALIGN - 1) / ALIGN * ALIGN;
    st->len = h->byte_off + h->count * key_esize(k);
  }
  for (uint32_t g = 0; g < m->ngroups; g++) {
    s->storages[g].fd = -1;
    if (s->storages[g].len == 0)
      s->storages[g].len = 1;
  }
  return 0;
}

/* Writes group g's storage bytes, filler included, into buf. */
static void build_storage(const struct rank_state *s, uint32_t g,
                          uint8_t *buf) {
  memset(buf, FILLER, s->storages[g].len);
  for (size_t i = 0; i < s->nheld; i++) {
    const struct holding *h = &s->held[i];
    const struct key *k = &s->m->keys[h->key];
    if (k->group == g)
      key_fill(k, s->step, h->first, h->count, buf + h->byte_off);
  }
}

static void free_rank(struct rank_state *s) {
  for (uint32_t g = 0; s->storages && g < s->m->ngroups; g++) {
    if (s->storages[g].addr)
      munmap(s->storages[g].addr, s->storages[g].len);
    if (s->storages[g].fd >= 0)
      close(s->storages[g].fd);
  }
  free(s->storages);
  free(s->held);
}

/* ---- what a rank reports to rank 0 ---- */

struct result {
  int ok;
  /* CLOCK_MONOTONIC around each sp_export, sp_push or sp_receive (with
   * --via-export: each export and the copies after it), seconds. */
  double t_start[MAX_EXPORTS], t_end[MAX_EXPORTS];
  uint64_t owned, owned_bytes, identity_bytes;
  /* Pushes: the bytes a rank sent or a consumer received, every push
   * together, and whether the last push reused the plan. */
  uint64_t push_bytes;
  int plan_reused;
  char error[512];
};

/* The consumers' layouts and buffers, made by the parent before anything
 * forks, so that every process of the demo maps them: a consumer
 * registers its own, and with --via-export the owners copy into them. */
struct consumers {
  uint32_t n;
  struct consumer_layout layouts[MAX_DEMO_CONSUMERS];
  int fds[MAX_DEMO_CONSUMERS];
  uint8_t *bufs[MAX_DEMO_CONSUMERS];
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

__attribute__((format(printf, 2, 3))) static int fail(struct result *r,
                                                      const char *fmt, ...) {
  if (r->error[0])
    return -1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->error, sizeof r->error, fmt, ap);
  va_end(ap);
  return -1;
}

static int fail_sp(struct result *r, sp_client *c, const char *what, int rc) {
  const char *msg = c ? sp_last_message(c) : "";
  return fail(r, "%s: %s%s%s", what, sp_strerror(rc), msg[0] ? ": " : "",
              msg);
}

static int write_all(int fd, const void *buf, size_t len) {
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t len) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* ---- progress (rank 0) ---- */

struct progress {
  bool tty;
  const char *status_cmd;
  bool status_done;
};

static void run_status(const char *cmd) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  if (pid > 0)
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
      ;
}

static void on_progress(const sp_progress *p, void *arg) {
  struct progress *pr = arg;
  if (pr->tty) {
    fprintf(stderr, "\r\033[K  export: %s", p->phase);
    if (p->rounds > 0)
      fprintf(stderr, ", round %u of %u", p->round, p->rounds);
    char moved[32], total[32];
    if (p->bytes_total > 0)
      fprintf(stderr, ", %s of %s",
              sp_format_bytes(p->bytes_moved, moved, sizeof moved),
              sp_format_bytes(p->bytes_total, total, sizeof total));
    fflush(stderr);
  }
  /* Once some bytes have moved (or in the last round of a short export),
   * so that the table shows the export on its way. */
  if (pr->status_cmd && !pr->status_done && strcmp(p->phase, "moving") == 0 &&
      p->round >= 1 && (p->bytes_moved > 0 || p->round == p->rounds)) {
    pr->status_done = true;
    if (pr->tty)
      fputc('\n', stderr);
    run_status(pr->status_cmd);
  }
}

/* ---- one rank ---- */

static int make_storages(struct rank_state *s, struct result *r) {
  for (uint32_t g = 0; g < s->m->ngroups; g++) {
    struct storage *st = &s->storages[g];
    st->fd = memfd_create("shardport-demo", MFD_CLOEXEC);
    if (st->fd < 0 || ftruncate(st->fd, (off_t)st->len) != 0)
      return fail(r, "memfd: %s", strerror(errno));
    st->addr = mmap(NULL, st->len, PROT_READ | PROT_WRITE, MAP_SHARED, st->fd,
                    0);
    if (st->addr == MAP_FAILED) {
      st->addr = NULL;
      return fail(r, "mmap: %s", strerror(errno));
    }
    build_storage(s, g, st->addr);
  }
  return 0;
}

static int register_all(sp_client *c, struct rank_state *s, struct result *r) {
  const struct model *m = s->m;
  sp_storage_desc *sd = calloc(m->ngroups, sizeof *sd);
  sp_tensor_desc *td = calloc(s->nheld, sizeof *td);
  int rc = -1;
  if (!sd || !td) {
    fail(r, "out of memory");
    goto out;
  }
  for (uint32_t g = 0; g < m->ngroups; g++)
    sd[g] = (sp_storage_desc){.id = g, .fd = s->storages[g].fd,
                              .length = s->storages[g].len,
                              .addr = s->storages[g].addr};
  for (size_t i = 0; i < s->nheld; i++) {
    const struct holding *h = &s->held[i];
    const struct key *k = &m->keys[h->key];
    sp_tensor_desc *t = &td[i];
    t->key = k->name;
    t->storage = k->group;
    t->dtype = k->bf16 ? "bfloat16" : "float32";
    t->ndim = k->ndim;
    t->shape[0] = h->rows;
    t->shape[1] = k->shape[1];
    t->stride[0] = k->ndim == 2 ? k->shape[1] : 1;
    t->stride[1] = 1;
    t->offset = (int64_t)(h->byte_off / key_esize(k));
    t->placement = k->kind == SHARD0       ? SP_PLACEMENT_SHARD0
                   : k->kind == REPLICATED ? SP_PLACEMENT_REPLICATED
                   : k->kind == PLAIN      ? SP_PLACEMENT_PLAIN
                                           : SP_PLACEMENT_EXPERT;
    t->global_ndim = k->ndim;
    t->global_shape[0] = k->shape[0];
    t->global_shape[1] = k->shape[1];
  }
  int e = sp_register_storages(c, sd, m->ngroups);
  if (e < 0) {
    fail_sp(r, c, "register storages", e);
    goto out;
  }
  e = sp_register_tensors(c, td, s->nheld);
  if (e < 0) {
    fail_sp(r, c, "register tensors", e);
    goto out;
  }
  rc = 0;
out:
  free(sd);
  free(td);
  return rc;
}

/* Compares an owned tensor, element by element through its strides, with
 * the original; contiguous tensors in chunks. */
static int verify_tensor(const struct key *k, const sp_owned_tensor *t,
                         struct result *r) {
  const char *dtype = k->bf16 ? "bfloat16" : "float32";
  if (strcmp(t->dtype, dtype) != 0 || t->ndim != k->ndim)
    return fail(r, "%s: dtype %s, %u dims; expected %s, %u dims", k->name,
                t->dtype, t->ndim, dtype, k->ndim);
  for (uint32_t d = 0; d < k->ndim; d++)
    if (t->shape[d] != k->shape[d])
      return fail(r, "%s: dim %u is %lld, expected %lld", k->name, d,
                  (long long)t->shape[d], (long long)k->shape[d]);
  uint64_t n = key_numel(k);
  uint32_t es = key_esize(k);
  bool contiguous =
      k->ndim == 1 ? (t->stride[0] == 1 || n <= 1)
                   : (t->stride[1] == 1 || k->shape[1] <= 1) &&
                         (t->stride[0] == k->shape[1] || k->shape[0] <= 1);
  uint8_t chunk[64 * 1024];
  if (contiguous) {
    uint64_t per = sizeof chunk / es;
    for (uint64_t at = 0; at < n; at += per) {
      uint64_t cnt = n - at < per ? n - at : per;
      key_fill(k, 0, at, cnt, chunk);
      if (memcmp((const uint8_t *)t->data + at * es, chunk, cnt * es) != 0)
        return fail(r, "%s: bytes differ from the original in elements "
                    "[%llu, %llu)", k->name, (unsigned long long)at,
                    (unsigned long long)(at + cnt));
    }
    return 0;
  }
  for (uint64_t i = 0; i < n; i++) {
    uint64_t row = k->ndim == 2 ? i / (uint64_t)k->shape[1] : 0;
    uint64_t col = k->ndim == 2 ? i % (uint64_t)k->shape[1] : i;
    int64_t off = k->ndim == 2 ? (int64_t)row * t->stride[0] +
                                     (int64_t)col * t->stride[1]
                               : (int64_t)col * t->stride[0];
    key_fill(k, 0, i, 1, chunk);
    if (memcmp((const uint8_t *)t->data + off * es, chunk, es) != 0)
      return fail(r, "%s: element %llu differs from the original", k->name,
                  (unsigned long long)i);
  }
  return 0;
}

/* Checks every tensor of set and marks it in owned (nkeys entries: none
 * twice); the first export's (count) is what the rank reports. */
static int verify_owned(const struct rank_state *s, const sp_owned_set *set,
                        uint8_t *owned, bool count, struct result *r) {
  for (size_t i = 0; i < set->ntensors; i++) {
    const sp_owned_tensor *t = &set->tensors[i];
    uint32_t index;
    const struct key *k = model_find_key(s->m, t->key, &index);
    if (!k)
      return fail(r, "received \"%s\", which is no key of the model", t->key);
    if (owned[index])
      return fail(r, "received \"%s\" twice", t->key);
    owned[index] = 1;
    if (verify_tensor(k, t, r) < 0)
      return -1;
    if (!count)
      continue;
    r->owned++;
    r->owned_bytes += key_nbytes(k);
    if (t->identity)
      r->identity_bytes += key_nbytes(k);
  }
  return 0;
}

/* The rank's registered memory must be exactly what it wrote. */
static int verify_storages(const struct rank_state *s, struct result *r) {
  uint64_t biggest = 0;
  for (uint32_t g = 0; g < s->m->ngroups; g++)
    if (s->storages[g].len > biggest)
      biggest = s->storages[g].len;
  uint8_t *buf = malloc(biggest);
  if (!buf)
    return fail(r, "out of memory");
  int rc = 0;
  for (uint32_t g = 0; g < s->m->ngroups && rc == 0; g++) {
    build_storage(s, g, buf);
    if (memcmp(buf, s->storages[g].addr, s->storages[g].len) != 0)
      rc = fail(r, "registered storage %u changed during the export", g);
  }
  free(buf);
  return rc;
}

/* The optimizer's step: the storages take the model's values of step. */
static void refill_storages(struct rank_state *s, uint32_t step) {
  s->step = step;
  for (uint32_t g = 0; g < s->m->ngroups; g++)
    build_storage(s, g, s->storages[g].addr);
}

/* Pushes o->pushes times, the next step's values written in between; rank
 * 0 shows the status once, after the first push. */
static int push_loop(const struct opts *o, sp_client *c, struct rank_state *s,
                     struct progress *pr, struct result *r) {
  sp_push_opts po = {.max_keys = o->max_keys, .max_bytes = o->max_bytes,
                     .timeout_ms = o->timeout_ms};
  for (uint32_t p = 0; p < o->pushes; p++) {
    if (p > 0)
      refill_storages(s, p);
    sp_push_result res;
    r->t_start[p] = now_s();
    int e = sp_push(c, &po, &res);
    r->t_end[p] = now_s();
    if (e < 0)
      return fail_sp(r, c, "push", e);
    r->push_bytes += res.bytes;
    r->plan_reused = res.plan_reused;
    if (p == 0 && pr && pr->status_cmd)
      run_status(pr->status_cmd);
  }
  return 0;
}

/* The path without consumers: export, copy every consumer's slices of
 * each owned tensor into its buffer, release; o->pushes times. */
static int via_export_loop(const struct opts *o, sp_client *c,
                           struct rank_state *s, const struct consumers *cons,
                           struct result *r) {
  sp_export_opts eo = {.max_keys = o->max_keys, .max_bytes = o->max_bytes,
                       .timeout_ms = o->timeout_ms};
  for (uint32_t p = 0; p < o->pushes; p++) {
    if (p > 0)
      refill_storages(s, p);
    sp_owned_set *set;
    r->t_start[p] = now_s();
    int e = sp_export(c, &eo, &set);
    if (e < 0)
      return fail_sp(r, c, "export", e);
    for (size_t i = 0; i < set->ntensors; i++) {
      uint32_t key;
      if (model_find_key(s->m, set->tensors[i].key, &key) == NULL)
        continue;
      for (uint32_t n = 0; n < cons->n; n++)
        consumer_copy_owned(s->m, &cons->layouts[n], key, &set->tensors[i],
                            cons->bufs[n]);
    }
    r->t_end[p] = now_s();
    if ((e = sp_release(c, set)) < 0)
      return fail_sp(r, c, "release", e);
  }
  return 0;
}

static int run_rank(const struct opts *o, const struct model *m,
                    uint32_t rank, int ticket_fd, const int *ticket_out,
                    struct progress *pr, uint8_t *owned,
                    const struct consumers *cons, struct result *r) {
  struct rank_state s = {.m = m, .rank = rank};
  sp_client *c = NULL;
  sp_owned_set *set = NULL;
  uint8_t *again = NULL;
  int rc = -1, e;
  if (plan_rank(&s) < 0) {
    fail(r, "out of memory");
    goto out;
  }
  if (make_storages(&s, r) < 0)
    goto out;
  /* Ranks in blocks over the daemons: rank 0 on the first. */
  const char *socket =
      o->nsockets > 0 ? o->sockets[(uint64_t)rank * o->nsockets / o->ranks]
                      : NULL;
  char why[1024];
  if ((e = sp_connect_explain(socket, &c, why, sizeof why)) < 0) {
    fail(r, "%s", why);
    goto out;
  }
  sp_ticket ticket;
  if (rank == 0) {
    bool pushing = o->consumers > 0 && !o->via_export;
    e = pushing ? sp_job_create_with_consumers(c, o->ranks, o->consumers,
                                               &ticket)
                : sp_job_create(c, o->ranks, &ticket);
    if (e < 0) {
      fail_sp(r, c, "create the job", e);
      goto out;
    }
    /* The other ranks, then the consumers. */
    uint32_t takers = o->ranks + (pushing ? o->consumers : 0);
    for (uint32_t i = 1; i < takers; i++)
      if (write_all(ticket_out[i], &ticket, sizeof ticket) < 0) {
        fail(r, "passing the ticket to %s %u: %s",
             i < o->ranks ? "rank" : "consumer",
             i < o->ranks ? i : i - o->ranks, strerror(errno));
        goto out;
      }
  } else if (read_all(ticket_fd, &ticket, sizeof ticket) < 0 ||
             ticket.len > SP_TICKET_MAX) {
    fail(r, "no ticket from rank 0");
    goto out;
  }
  if ((e = sp_job_join(c, &ticket, rank, o->ranks, "cpu")) < 0) {
    fail_sp(r, c, "join", e);
    goto out;
  }
  if (register_all(c, &s, r) < 0)
    goto out;
  if (o->consumers > 0) {
    if ((o->via_export ? via_export_loop(o, c, &s, cons, r)
                       : push_loop(o, c, &s, pr, r)) < 0)
      goto out;
    goto done;
  }

  again = calloc(s.m->nkeys, 1);
  if (again == NULL) {
    fail(r, "out of memory");
    goto out;
  }
  sp_export_opts eo = {.max_keys = o->max_keys, .max_bytes = o->max_bytes,
                       .timeout_ms = o->timeout_ms};
  if (pr) {
    eo.progress = on_progress;
    eo.progress_arg = pr;
  }
  for (uint32_t x = 0; x < o->exports; x++) {
    r->t_start[x] = now_s();
    e = sp_export(c, &eo, &set);
    r->t_end[x] = now_s();
    if (pr && pr->tty)
      fprintf(stderr, "\r\033[K");
    /* An export too quick to catch moving still shows its status, done. */
    if (e == 0 && pr && pr->status_cmd && !pr->status_done) {
      pr->status_done = true;
      run_status(pr->status_cmd);
    }
    if (e < 0) {
      fail_sp(r, c, "export", e);
      goto out;
    }
    /* The first export's keys are the rank's; a later one's are checked
     * as carefully. */
    if (x > 0)
      memset(again, 0, s.m->nkeys);
    if (verify_owned(&s, set, x == 0 ? owned : again, x == 0, r) < 0)
      goto out;
    e = sp_release(c, set);
    set = NULL;
    if (e < 0) {
      fail_sp(r, c, "release", e);
      goto out;
    }
  }
done:
  if (verify_storages(&s, r) < 0)
    goto out;
  if ((e = sp_job_leave(c)) < 0) {
    fail_sp(r, c, "leave", e);
    goto out;
  }
  rc = 0;
out:
  if (set)
    sp_release(c, set);
  sp_close(c);
  free(again);
  free_rank(&s);
  r->ok = rc == 0;
  return rc;
}

/* ---- one consumer ---- */

/* Joins as consumer index with rank 0's ticket, registers its buffer and
 * targets, and receives every push, checking every byte against the
 * model of that step. */
static int run_consumer(const struct opts *o, const struct model *m,
                        uint32_t index, int ticket_fd,
                        const struct consumers *cons, struct result *r) {
  const struct consumer_layout *l = &cons->layouts[index];
  sp_client *c = NULL;
  sp_ticket ticket;
  char why[1024];
  int rc = -1, e;
  if ((e = sp_connect_explain(o->consumer_socket, &c, why, sizeof why)) < 0) {
    fail(r, "%s", why);
    goto out;
  }
  if (read_all(ticket_fd, &ticket, sizeof ticket) < 0 ||
      ticket.len > SP_TICKET_MAX) {
    fail(r, "no ticket from rank 0");
    goto out;
  }
  if ((e = sp_consumer_join(c, &ticket, index, o->consumers, "cpu")) < 0) {
    fail_sp(r, c, "join as a consumer", e);
    goto out;
  }
  if ((e = consumer_register(c, m, l, cons->fds[index], cons->bufs[index])) <
      0) {
    fail_sp(r, c, "register the targets", e);
    goto out;
  }
  for (uint32_t p = 0; p < o->pushes; p++) {
    sp_push_result res;
    r->t_start[p] = now_s();
    e = sp_receive(c, o->timeout_ms, &res);
    r->t_end[p] = now_s();
    if (e < 0) {
      fail_sp(r, c, "receive", e);
      goto out;
    }
    if (res.bytes != l->delivered) {
      fail(r, "push %u wrote %llu bytes, its targets hold %llu", p + 1,
           (unsigned long long)res.bytes, (unsigned long long)l->delivered);
      goto out;
    }
    r->push_bytes += res.bytes;
    if (consumer_verify(m, l, cons->bufs[index], p, r->error,
                        sizeof r->error) < 0)
      goto out;
  }
  /* Closing leaves the job, which may have ended with its last rank. */
  rc = 0;
out:
  sp_close(c);
  r->ok = rc == 0;
  return rc;
}

/* The consumers' layouts and buffers: 0, or -1 with the reason printed. */
static int make_consumers(const struct opts *o, const struct model *m,
                          struct consumers *cons) {
  cons->n = o->consumers;
  for (uint32_t i = 0; i < cons->n; i++) {
    struct consumer_layout *l = &cons->layouts[i];
    if (consumer_layout_build(m, i, cons->n, l) < 0) {
      fprintf(stderr, "shardport-demo: out of memory\n");
      return -1;
    }
    cons->fds[i] = memfd_create("shardport-demo-consumer", MFD_CLOEXEC);
    if (cons->fds[i] < 0 || ftruncate(cons->fds[i], (off_t)l->bytes) != 0 ||
        (cons->bufs[i] = mmap(NULL, l->bytes, PROT_READ | PROT_WRITE,
                              MAP_SHARED, cons->fds[i], 0)) == MAP_FAILED) {
      fprintf(stderr, "shardport-demo: consumer %u's buffer: %s\n", i,
              strerror(errno));
      return -1;
    }
  }
  return 0;
}

/* The summary of pushes (or of their export-then-copy stand-in): each
 * push from the last process's request to the last one done. */
static bool summarize_pushes(const struct opts *o, const struct model *m,
                             const struct consumers *cons,
                             const struct result *results, uint32_t procs) {
  uint64_t delivered = 0;
  bool ok = true;
  for (uint32_t i = 0; i < cons->n; i++)
    delivered += cons->layouts[i].delivered;
  /* The export path's consumers take no part: their buffers are checked
   * here, with the last push's values. */
  for (uint32_t i = 0; o->via_export && i < cons->n; i++) {
    char err[512];
    if (consumer_verify(m, &cons->layouts[i], cons->bufs[i], o->pushes - 1,
                        err, sizeof err) < 0) {
      fprintf(stderr, "shardport-demo: %s\n", err);
      ok = false;
    }
  }
  uint64_t sent = 0;
  for (uint32_t i = 0; i < o->ranks; i++)
    sent += results[i].push_bytes;
  if (!o->via_export && sent != delivered * o->pushes) {
    fprintf(stderr, "shardport-demo: the ranks sent %llu bytes, the "
            "consumers' targets hold %llu\n", (unsigned long long)sent,
            (unsigned long long)(delivered * o->pushes));
    ok = false;
  }
  if (!ok)
    return false;
  double secs[MAX_EXPORTS];
  for (uint32_t p = 0; p < o->pushes; p++) {
    double last_start = 0, last_end = 0;
    for (uint32_t i = 0; i < procs; i++) {
      if (results[i].t_start[p] > last_start)
        last_start = results[i].t_start[p];
      if (results[i].t_end[p] > last_end)
        last_end = results[i].t_end[p];
    }
    secs[p] = last_end - last_start;
  }
  double first = secs[0], last = secs[o->pushes - 1];
  uint32_t nodes = o->nsockets > 1 ? o->nsockets : 1;
  if (o->machine) {
    printf("ranks=%u consumers=%u keys=%zu bytes=%llu delivered_bytes=%llu "
           "pushes=%u seconds=%.6f seconds_last=%.6f plan_reused=%d "
           "via_export=%d verified=1 nodes=%u\n",
           o->ranks, cons->n, m->nkeys, (unsigned long long)m->bytes,
           (unsigned long long)delivered, o->pushes, first, last,
           results[0].plan_reused, o->via_export ? 1 : 0, nodes);
    return true;
  }
  char model[32], bytes[32], rate[32], rate_last[32];
  sp_format_bytes(m->bytes, model, sizeof model);
  sp_format_bytes(delivered, bytes, sizeof bytes);
  sp_format_bytes(first > 0 ? (uint64_t)((double)delivered / first) : 0, rate,
                  sizeof rate);
  sp_format_bytes(last > 0 ? (uint64_t)((double)delivered / last) : 0,
                  rate_last, sizeof rate_last);
  printf("shardport-demo: %u ranks%s %s %zu keys of %s into %u consumers, "
         "%u times: %s a time, the first in %.3f s (%s/s), the last in "
         "%.3f s (%s/s)%s; every delivered byte verified OK\n",
         o->ranks, nodes > 1 ? " on several daemons" : "",
         o->via_export ? "exported and copied" : "pushed", m->nkeys, model,
         cons->n, o->pushes, bytes, first, rate, last, rate_last,
         o->via_export ? ""
         : results[0].plan_reused ? ", the plan reused"
                                   : "");
  return true;
}

/* ---- the parent: rank 0 and the summary ---- */

int main(int argc, char **argv) {
  struct opts o;
  if (parse_opts(argc, argv, &o) < 0) {
    usage(stderr);
    return 2;
  }
  struct model m;
  if (model_build(&m, o.ranks, o.scale) < 0) {
    fprintf(stderr, "shardport-demo: out of memory\n");
    return 1;
  }

  static struct consumers cons;
  if (o.consumers > 0 && make_consumers(&o, &m, &cons) < 0)
    return 1;
  /* The processes: the ranks, then the consumers (none on the export
   * path, whose owners write the consumers' buffers themselves). */
  uint32_t procs = o.ranks + (o.via_export ? 0 : o.consumers);

  /* Everything is forked before any connection: a process never shares a
   * socket (or, with CUDA, a driver context) with its parent. */
  enum { MAX_PROCS = MAX_RANKS + MAX_DEMO_CONSUMERS };
  int ticket_pipe[MAX_PROCS][2], result_pipe[MAX_PROCS][2];
  pid_t pids[MAX_PROCS] = {0};
  for (uint32_t i = 1; i < procs; i++)
    if (pipe2(ticket_pipe[i], O_CLOEXEC) != 0 ||
        pipe2(result_pipe[i], O_CLOEXEC) != 0) {
      fprintf(stderr, "shardport-demo: pipe: %s\n", strerror(errno));
      return 1;
    }
  /* A rank that dies must not kill the parent through a closed pipe. */
  signal(SIGPIPE, SIG_IGN);
  uint8_t *owned = calloc(m.nkeys, 1);
  uint8_t *theirs = calloc(m.nkeys, 1);
  if (!owned || !theirs)
    return 1;
  for (uint32_t i = 1; i < procs; i++) {
    pids[i] = fork();
    if (pids[i] < 0) {
      fprintf(stderr, "shardport-demo: fork: %s\n", strerror(errno));
      return 1;
    }
    if (pids[i] == 0) {
      for (uint32_t j = 1; j < procs; j++) {
        close(ticket_pipe[j][1]);
        close(result_pipe[j][0]);
        if (j != i) {
          close(ticket_pipe[j][0]);
          close(result_pipe[j][1]);
        }
      }
      struct result r = {0};
      if (i < o.ranks)
        run_rank(&o, &m, i, ticket_pipe[i][0], NULL, NULL, owned, &cons, &r);
      else
        run_consumer(&o, &m, i - o.ranks, ticket_pipe[i][0], &cons, &r);
      int ok = write_all(result_pipe[i][1], &r, sizeof r) == 0 &&
               write_all(result_pipe[i][1], owned, m.nkeys) == 0;
      for (uint32_t n = 0; n < cons.n; n++)
        consumer_layout_free(&cons.layouts[n]);
      free(owned);
      free(theirs);
      model_free(&m);
      exit(ok && r.ok ? 0 : 1);
    }
  }
  for (uint32_t i = 1; i < procs; i++) {
    close(ticket_pipe[i][0]);
    close(result_pipe[i][1]);
  }

  int ticket_out[MAX_PROCS];
  ticket_out[0] = -1; /* rank 0 passes the ticket, it takes none */
  for (uint32_t i = 1; i < procs; i++)
    ticket_out[i] = ticket_pipe[i][1];
  struct progress pr = {.tty = isatty(STDERR_FILENO) && !o.machine,
                        .status_cmd = o.status_cmd};
  static struct result results[MAX_PROCS];
  run_rank(&o, &m, 0, -1, ticket_out, &pr, owned, &cons, &results[0]);
  /* Processes still waiting for a ticket see end of file and give up. */
  for (uint32_t i = 1; i < procs; i++)
    close(ticket_pipe[i][1]);

  bool ok = results[0].ok;
  for (uint32_t i = 1; i < procs; i++) {
    memset(theirs, 0, m.nkeys);
    if (read_all(result_pipe[i][0], &results[i], sizeof results[i]) < 0 ||
        read_all(result_pipe[i][0], theirs, m.nkeys) < 0) {
      results[i].ok = 0;
      snprintf(results[i].error, sizeof results[i].error,
               "exited without a result");
    }
    close(result_pipe[i][0]);
    for (size_t k = 0; k < m.nkeys && results[i].ok; k++)
      owned[k] += theirs[k];
    ok = ok && results[i].ok;
  }
  for (uint32_t i = 1; i < procs; i++) {
    int status;
    while (waitpid(pids[i], &status, 0) < 0 && errno == EINTR)
      ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      ok = false;
  }
  for (uint32_t i = 0; i < procs; i++)
    if (!results[i].ok)
      fprintf(stderr, "shardport-demo: %s %u: %s\n",
              i < o.ranks ? "rank" : "consumer",
              i < o.ranks ? i : i - o.ranks,
              results[i].error[0] ? results[i].error : "failed");
  if (o.consumers > 0) {
    ok = ok && summarize_pushes(&o, &m, &cons, results, procs);
    for (uint32_t i = 0; i < cons.n; i++) {
      munmap(cons.bufs[i], cons.layouts[i].bytes);
      close(cons.fds[i]);
      consumer_layout_free(&cons.layouts[i]);
    }
    free(owned);
    free(theirs);
    model_free(&m);
    return ok ? 0 : 1;
  }

  /* Every key owned by exactly one rank. */
  uint64_t total_bytes = 0, identity_bytes = 0, max_owned = 0;
  /* Each export runs once every rank has asked: from the last request to
   * the last rank holding its tensors. */
  double secs[MAX_EXPORTS] = {0};
  for (uint32_t x = 0; x < o.exports && ok; x++) {
    double last_start = 0, last_end = 0;
    for (uint32_t i = 0; i < o.ranks; i++) {
      if (results[i].t_start[x] > last_start)
        last_start = results[i].t_start[x];
      if (results[i].t_end[x] > last_end)
        last_end = results[i].t_end[x];
    }
    secs[x] = last_end - last_start;
  }
  for (uint32_t i = 0; i < o.ranks && ok; i++) {
    total_bytes += results[i].owned_bytes;
    identity_bytes += results[i].identity_bytes;
    if (results[i].owned_bytes > max_owned)
      max_owned = results[i].owned_bytes;
  }
  for (size_t k = 0; k < m.nkeys && ok; k++)
    if (owned[k] != 1) {
      fprintf(stderr, "shardport-demo: \"%s\" was owned by %u ranks\n",
              m.keys[k].name, owned[k]);
      ok = false;
    }
  if (ok && total_bytes != m.bytes) {
    fprintf(stderr, "shardport-demo: ranks own %llu bytes of %llu\n",
            (unsigned long long)total_bytes, (unsigned long long)m.bytes);
    ok = false;
  }
  if (ok) {
    double first = secs[0], last = secs[o.exports - 1];
    /* The figures status and the daemon's log show for the export: the
     * bytes moved into the pool (keys already whole where they are move
     * nothing), in the same units. */
    uint64_t moved = m.bytes - identity_bytes;
    char model[32], moved_text[32], in_place[32], rate[32];
    sp_format_bytes(m.bytes, model, sizeof model);
    sp_format_bytes(moved, moved_text, sizeof moved_text);
    sp_format_bytes(identity_bytes, in_place, sizeof in_place);
    sp_format_bytes(first > 0 ? (uint64_t)((double)moved / first) : 0, rate,
                    sizeof rate);
    if (o.machine)
      printf("ranks=%u keys=%zu bytes=%llu pool_bytes=%llu "
             "identity_bytes=%llu max_rank_bytes=%llu seconds=%.6f "
             "verified=1 nodes=%u exports=%u seconds_last=%.6f\n",
             o.ranks, m.nkeys, (unsigned long long)m.bytes,
             (unsigned long long)(m.bytes - identity_bytes),
             (unsigned long long)identity_bytes,
             (unsigned long long)max_owned, first,
             o.nsockets > 1 ? o.nsockets : 1, o.exports, last);
    else
      printf("shardport-demo: %u ranks%s exported %zu keys of %s (%s "
             "already whole where they were): moved %s in %.3f s (%s/s); "
             "every owned tensor verified OK\n",
             o.ranks, o.nsockets > 1 ? " on several daemons" : "", m.nkeys,
             model, in_place, moved_text, first, rate);
    if (!o.machine && o.exports > 1)
      printf("shardport-demo: %u exports in a row, the last in %.3f s\n",
             o.exports, last);
  }
  free(owned);
  free(theirs);
  model_free(&m);
  return ok ? 0 : 1;
}
