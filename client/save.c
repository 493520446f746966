/*
 * save.c - sp_save: export, write this rank's checkpoint files, pass the
 * commit with every other rank, and (rank 0) write the index.  See
 * include/shardport.h and docs/checkpoints.md.
 *
 * The order on disk is what makes a save crash-safe:
 *   1. every file is written under a temporary name in the directory
 *      (".NAME.PID-EXPORT.tmp") and fsynced; rank 0 has moved an old index
 *      aside (overwrite) or refused (no overwrite) before it reports;
 *   2. once every rank's files are durable, each rank renames its own to
 *      their final names and fsyncs the directory;
 *   3. once every rank renamed, rank 0 writes the index under a temporary
 *      name, fsyncs it, renames it and fsyncs the directory.
 * The daemons hold the barriers between the steps (daemon/save.h): a
 * failure anywhere reaches every rank, which deletes the temporary files
 * it made, so no index and no file that is not whole ever carries a final
 * name.  An index moved aside comes back when the save fails before any
 * file was renamed.
 *
 * Memory: the owned tensors the export published, plus one staging buffer
 * of SAVE_CHUNK bytes for a tensor that is not contiguous on the host,
 * or two of them (pinned) for one on a GPU, whose bytes come off the
 * device into one while the other is written (client/cudart.c).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "client/cudart.h"
#include "client/safetensors.h"
#include "proto/dtype.h"
#include "proto/text.h"
#include "proto/view.h"

/* The most bytes written by one write(), and the size of a staging
 * buffer: large enough for the file system to stream, small enough that
 * progress and a peer's failure are heard often. */
#define SAVE_CHUNK (UINT64_C(16) << 20)
/* With the test seam's delay, writes are this small, so that a save of a
 * few mebibytes is caught in the middle. */
#define SAVE_TEST_CHUNK (UINT64_C(64) << 10)
/* How often the daemon hears how far this rank has got. */
#define SAVE_REPORT_MS 100
#define SAVE_NAME_MAX 96
/* The barriers of the commit (docs/protocol.md, save_step). */
#define SAVE_STEPS 3u
#define INDEX_NAME "model.safetensors.index.json"
#define LOCK_NAME ".model.safetensors.lock"

struct save_file {
  uint32_t index;
  size_t first, n; /* its tensors: set->tensors[first .. first + n) */
  char final[SAVE_NAME_MAX];
  char tmp[SAVE_NAME_MAX + 48];
  bool created; /* the temporary file exists */
  bool renamed;
};

struct saver {
  sp_client *c;
  const sp_save_opts *o;
  int dirfd;
  int lockfd; /* rank 0: the directory's lock, held for the whole save */
  const char *dir;
  uint64_t export_request;
  uint64_t export_id;
  sp_owned_set *set; /* until released, once the files are written */
  const uint32_t *file;
  uint32_t nfiles;
  uint64_t total_size;
  struct save_file *files;
  size_t nmine;
  uint64_t written, to_write;
  uint64_t reported_ms, reported_bytes;
  uint64_t chunk;
  uint32_t delay_ms;
  /* When sp_save was called, by the clock file times are kept in. */
  struct timespec called;
  /* Rank 0: the old index, moved aside under this name (overwrite). */
  bool index_aside;
  char aside[SAVE_NAME_MAX];
  uint32_t step; /* the last step every rank passed */
  /* The error came from the daemon (or the connection), not from this
   * rank's own writing: there is nothing to report. */
  bool daemon_said;
  /* GPU staging, made on the first device tensor. */
  struct client_cuda_stage *stage;
  void *host_stage;
};

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

__attribute__((format(printf, 3, 4))) static int say(sp_client *c, int code,
                                                     const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->message, sizeof c->message, fmt, ap);
  va_end(ap);
  return code;
}

/* A system call on a file of the checkpoint failed. */
static int sys_fail(struct saver *sv, const char *what, const char *name) {
  int err = errno;
  return say(sv->c, err == ENOMEM ? SP_ENOMEM : SP_EWRITE, "%s %s/%s: %s",
             what, sv->dir, name, strerror(err));
}

/* ---- options ---- */

static bool utf8_valid(const char *s) { return sp__utf8_valid(s, strlen(s)); }

static int check_opts(sp_client *c, const char *dir, const sp_save_opts *o) {
  if (!dir || !dir[0])
    return say(c, SP_EINVAL, "save: no directory given");
  if (o->nmetadata > 0 && !o->metadata)
    return say(c, SP_EINVAL, "save: %zu metadata entries but no array",
               o->nmetadata);
  for (size_t i = 0; i < o->nmetadata; i++) {
    const sp_metadata *m = &o->metadata[i];
    if (!m->key || !m->value || !utf8_valid(m->key) || !utf8_valid(m->value))
      return say(c, SP_EINVAL, "save: metadata entry %zu is not two UTF-8 "
                 "strings", i);
    if (strcmp(m->key, "format") == 0)
      return say(c, SP_EINVAL, "save: the metadata key \"format\" is "
                 "shardport's (it writes \"pt\")");
    for (size_t j = 0; j < i; j++)
      if (strcmp(o->metadata[j].key, m->key) == 0)
        return say(c, SP_EINVAL, "save: the metadata key \"%s\" is given "
                   "twice", m->key);
  }
  return 0;
}

/* mkdir -p, each level with mode 0777 less the umask. */
static int make_dir(sp_client *c, const char *dir) {
  char path[4096];
  if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path)
    return say(c, SP_EINVAL, "save: the directory's name is too long");
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0')
      continue;
    char was = *p;
    *p = '\0';
    if (mkdir(path, 0777) != 0 && errno != EEXIST)
      return say(c, SP_EWRITE, "save: cannot make directory %s: %s", path,
                 strerror(errno));
    *p = was;
    if (was == '\0')
      return 0;
  }
}

/* FNV-1a over len bytes, on from h: the digests of what every rank must
 * ask alike.  They only need to tell apart what a job's own ranks pass by
 * mistake, so no keyed hash is needed. */
static uint64_t digest(uint64_t h, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= UINT64_C(0x100000001b3);
  }
  return h;
}

#define DIGEST_SEED UINT64_C(0xcbf29ce484222325)

/* The metadata's digest: one per entry, NUL bytes between key and value,
 * summed, so that the order in which a rank lists them does not matter
 * (check_opts refused repeated keys). */
static uint64_t metadata_digest(const sp_save_opts *o) {
  uint64_t sum = o->nmetadata;
  for (size_t i = 0; i < o->nmetadata; i++) {
    const sp_metadata *m = &o->metadata[i];
    uint64_t h = digest(DIGEST_SEED, m->key, strlen(m->key) + 1);
    sum += digest(h, m->value, strlen(m->value) + 1);
  }
  return sum;
}

/* What the rank needs before it asks: its options checked, the directory
 * made and opened, and the digests of the directory (as this process
 * resolves it, symbolic links followed) and the metadata.  0, or this
 * rank's refusal with its sentence in c->message. */
static int prepare(struct saver *sv, const char *dir,
                   struct client_save_ask *ask) {
  int rc = check_opts(sv->c, dir, sv->o);
  if (rc == 0)
    rc = make_dir(sv->c, dir);
  if (rc < 0)
    return rc;
  sv->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (sv->dirfd < 0)
    return say(sv->c, SP_EWRITE, "save: cannot open directory %s: %s", dir,
               strerror(errno));
  char real[PATH_MAX];
  if (!realpath(dir, real))
    return say(sv->c, SP_EWRITE, "save: cannot resolve directory %s: %s",
               dir, strerror(errno));
  ask->directory = digest(DIGEST_SEED, real, strlen(real));
  ask->metadata = metadata_digest(sv->o);
  return 0;
}

/* ---- talking to the daemon while writing ---- */

/* A word from the daemon while this rank writes can only be the save's
 * failure (daemon/save.h): read it when one is waiting. */
static int heard_failure(struct saver *sv) {
  struct pollfd p = {.fd = sv->c->sock, .events = POLLIN};
  if (poll(&p, 1, 0) <= 0)
    return 0;
  struct client_reply reply;
  struct sp_msg_head head;
  int rc = client_next(sv->c, sv->export_request, sv->c->timeout_ms, &reply,
                       &head);
  sv->daemon_said = rc < 0;
  if (rc == 0) {
    client_reply_release(&reply);
    return say(sv->c, SP_EBADMSG, "save: the daemon sent a \"%s\" frame "
               "while this rank wrote", head.op);
  }
  return rc;
}

static void tell_progress(struct saver *sv) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(sv->c, &mb, "save_progress", 2);
  sp__pack_kv_u64(&mb.pk, "export_id", sv->export_id);
  sp__pack_kv_u64(&mb.pk, "bytes_written", sv->written);
  /* A notification: nothing comes back. */
  client_start(sv->c, &mb, id);
  sv->reported_bytes = sv->written;
}

static void callback(struct saver *sv) {
  sp_progress_fn fn = sv->o->export_opts.progress;
  if (!fn)
    return;
  sp_progress p = {.phase = "writing",
                   .bytes_written = sv->written,
                   .bytes_to_write = sv->to_write};
  fn(&p, sv->o->export_opts.progress_arg);
}

/* n more bytes are written: the daemon hears it now and then, a failure
 * elsewhere is looked for, and the test seam may pause. */
static int advance(struct saver *sv, uint64_t n) {
  sv->written += n;
  uint64_t now = now_ms();
  if (now - sv->reported_ms >= SAVE_REPORT_MS || sv->written == sv->to_write) {
    sv->reported_ms = now;
    tell_progress(sv);
    callback(sv);
  }
  if (sv->delay_ms > 0)
    nanosleep(&(struct timespec){sv->delay_ms / 1000,
                                 (long)(sv->delay_ms % 1000) * 1000000},
              NULL);
  return heard_failure(sv);
}

/* ---- writing ---- */

static int write_all(struct saver *sv, int fd, const struct save_file *f,
                     const void *data, uint64_t len, bool counts) {
  const char *p = data;
  while (len > 0) {
    size_t n = len < sv->chunk ? (size_t)len : (size_t)sv->chunk;
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return sys_fail(sv, "cannot write", f->tmp);
    p += w;
    len -= (uint64_t)w;
    if (counts) {
      int rc = advance(sv, (uint64_t)w);
      if (rc < 0)
        return rc;
    }
  }
  return 0;
}

static bool row_major(const sp_owned_tensor *t) {
  int64_t expect = 1;
  for (uint32_t d = t->ndim; d-- > 0;) {
    if (t->shape[d] != 1 && t->stride[d] != expect)
      return false;
    expect *= t->shape[d];
  }
  return true;
}

static uint64_t tensor_bytes(const sp_owned_tensor *t) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < t->ndim; d++)
    n *= (uint64_t)t->shape[d];
  enum sp_dtype dt;
  sp__dtype_from_name(t->dtype, strlen(t->dtype), &dt);
  return n * sp__dtype_size(dt);
}

/* Where a tensor's bytes are gathered before they are written: plain
 * memory for the host, the pinned double buffer for a GPU. */
struct gather {
  struct saver *sv;
  int fd;
  const struct save_file *f;
  bool cuda;
  int buf;      /* the buffer being filled */
  uint64_t used; /* its bytes */
  bool pending[2]; /* a GPU buffer whose copies are in flight */
  uint64_t pending_len[2];
  uint8_t *host; /* the host buffer */
};

static int flush_gpu(struct gather *g, int b) {
  void *host;
  int rc = client_cuda_stage_wait(g->sv->c, g->sv->stage, b, &host);
  if (rc == 0)
    rc = write_all(g->sv, g->fd, g->f, host, g->pending_len[b], true);
  g->pending[b] = false;
  return rc;
}

/* The buffer being filled is full (or the tensor ends): on the host it is
 * written at once; on a GPU its copies are marked, the other buffer is
 * written while they run, and filling goes on in the other. */
static int flush(struct gather *g) {
  if (g->used == 0)
    return 0;
  if (!g->cuda) {
    int rc = write_all(g->sv, g->fd, g->f, g->host, g->used, true);
    g->used = 0;
    return rc;
  }
  int rc = client_cuda_stage_mark(g->sv->c, g->sv->stage, g->buf);
  if (rc < 0)
    return rc;
  g->pending[g->buf] = true;
  g->pending_len[g->buf] = g->used;
  g->used = 0;
  g->buf ^= 1;
  if (g->pending[g->buf])
    return flush_gpu(g, g->buf);
  return 0;
}

/* Bytes [src, src + len) of the tensor's memory go next. */
static int put_run(struct gather *g, const uint8_t *src, uint64_t len) {
  while (len > 0) {
    uint64_t room = g->sv->chunk - g->used;
    uint64_t n = len < room ? len : room;
    int rc = g->cuda ? client_cuda_stage_copy(g->sv->c, g->sv->stage, g->buf,
                                              g->used, src, n)
                     : 0;
    if (rc < 0)
      return rc;
    if (!g->cuda)
      memcpy(g->host + g->used, src, n);
    g->used += n;
    src += n;
    len -= n;
    if (g->used == g->sv->chunk && (rc = flush(g)) < 0)
      return rc;
  }
  return 0;
}

/* The tensor's elements in row-major order, each contiguous run of its
 * view at once. */
static int gather_tensor(struct gather *g, const sp_owned_tensor *t,
                         uint32_t esize) {
  uint32_t nd = t->ndim;
  /* The innermost dims that are contiguous make one run. */
  uint64_t run = esize;
  uint32_t outer = nd;
  int64_t expect = 1;
  while (outer > 0 && (t->shape[outer - 1] == 1 ||
                       t->stride[outer - 1] == expect)) {
    run *= (uint64_t)t->shape[outer - 1];
    expect *= t->shape[outer - 1];
    outer--;
  }
  int64_t idx[SP_MAX_DIMS] = {0};
  for (;;) {
    int64_t off = 0;
    for (uint32_t d = 0; d < outer; d++)
      off += idx[d] * t->stride[d];
    int rc = put_run(g, (const uint8_t *)t->data + off * (int64_t)esize, run);
    if (rc < 0)
      return rc;
    uint32_t d = outer;
    while (d > 0 && ++idx[d - 1] == t->shape[d - 1])
      idx[--d] = 0;
    if (d == 0)
      return 0;
  }
}

static int write_tensor(struct saver *sv, int fd, const struct save_file *f,
                        const sp_owned_tensor *t) {
  uint64_t nbytes = tensor_bytes(t);
  if (nbytes == 0)
    return 0;
  bool cuda = strcmp(t->device, "cpu") != 0;
  if (!cuda && row_major(t))
    return write_all(sv, fd, f, t->data, nbytes, true);
  struct gather g = {.sv = sv, .fd = fd, .f = f, .cuda = cuda};
  if (cuda) {
    if (!sv->stage) {
      int rc = client_cuda_stage_new(sv->c, t->device_index, sv->chunk,
                                     &sv->stage);
      if (rc < 0)
        return rc;
    }
  } else {
    if (!sv->host_stage && !(sv->host_stage = malloc(sv->chunk)))
      return SP_ENOMEM;
    g.host = sv->host_stage;
  }
  enum sp_dtype dt;
  sp__dtype_from_name(t->dtype, strlen(t->dtype), &dt);
  int rc = gather_tensor(&g, t, sp__dtype_size(dt));
  if (rc == 0)
    rc = flush(&g);
  /* The GPU buffers still in flight, oldest first. */
  for (int i = 0; i < 2; i++) {
    int b = g.buf ^ i;
    if (g.pending[b]) {
      int frc = flush_gpu(&g, b);
      if (rc == 0)
        rc = frc;
    }
  }
  return rc;
}

/* A new file of the save, under its temporary name.  The name is this
 * process's and this export's: what is there already is left by an
 * earlier process of the same pid, or put in the way (a symbolic link to
 * a file elsewhere), and goes; the file is made anew, never through a
 * link. */
static int create_new(struct saver *sv, const char *name) {
  unlinkat(sv->dirfd, name, 0);
  int fd = openat(sv->dirfd, name,
                  O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0)
    return sys_fail(sv, "cannot create", name);
  return fd;
}

static int write_file(struct saver *sv, struct save_file *f) {
  const sp_owned_tensor *ts = &sv->set->tensors[f->first];
  struct st_tensor *st = malloc((f->n > 0 ? f->n : 1) * sizeof *st);
  if (!st)
    return SP_ENOMEM;
  for (size_t i = 0; i < f->n; i++) {
    enum sp_dtype dt = SP_DTYPE_INVALID;
    sp__dtype_from_name(ts[i].dtype, strlen(ts[i].dtype), &dt);
    st[i] = (struct st_tensor){.key = ts[i].key,
                               .dtype = dt,
                               .ndim = ts[i].ndim,
                               .shape = ts[i].shape,
                               .nbytes = tensor_bytes(&ts[i])};
  }
  struct st_buf header;
  int rc = st_header(st, f->n, sv->o->metadata, sv->o->nmetadata, &header);
  free(st);
  if (rc == SP_EDTYPE)
    return say(sv->c, rc, "save: a tensor of %s has a dtype safetensors "
               "cannot name", f->final);
  if (rc == SP_ELIMIT)
    return say(sv->c, rc, "save: the header of %s would be larger than the "
               "%u bytes safetensors readers accept: its %zu keys' names "
               "are too long together; save with a smaller max_shard_bytes",
               f->final, ST_MAX_HEADER, f->n);
  if (rc < 0)
    return rc;
  int fd = create_new(sv, f->tmp);
  if (fd < 0) {
    st_buf_free(&header);
    return fd;
  }
  f->created = true;
  rc = write_all(sv, fd, f, header.data, header.len, false);
  st_buf_free(&header);
  for (size_t i = 0; rc == 0 && i < f->n; i++)
    rc = write_tensor(sv, fd, f, &ts[i]);
  if (rc == 0 && fsync(fd) != 0)
    rc = sys_fail(sv, "cannot fsync", f->tmp);
  if (close(fd) != 0 && rc == 0)
    rc = sys_fail(sv, "cannot close", f->tmp);
  return rc;
}

/* This rank's files: the set's tensors grouped by file, which the daemon
 * numbers in key order (daemon/plan/files.h). */
static int group_files(struct saver *sv) {
  size_t n = sv->set->ntensors;
  sv->files = calloc(n > 0 ? n : 1, sizeof *sv->files);
  if (!sv->files)
    return SP_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && sv->file[i] < sv->file[i - 1])
      return say(sv->c, SP_EBADMSG, "bad export reply: the files of a save "
                 "do not follow key order");
    if (i == 0 || sv->file[i] != sv->file[i - 1]) {
      struct save_file *f = &sv->files[sv->nmine++];
      f->index = sv->file[i];
      f->first = i;
      st_file_name(f->index, sv->nfiles, f->final, sizeof f->final);
      snprintf(f->tmp, sizeof f->tmp, ".%s.%ld-%" PRIu64 ".tmp", f->final,
               (long)getpid(), sv->export_id);
    }
    sv->files[sv->nmine - 1].n++;
    sv->to_write += tensor_bytes(&sv->set->tensors[i]);
  }
  return 0;
}

static int sync_dir(struct saver *sv) {
  if (fsync(sv->dirfd) != 0)
    return sys_fail(sv, "cannot fsync", ".");
  return 0;
}

/* Rank 0, for the whole of its save: one save at a time in a directory.
 * Two at once would rename their files over each other's, and each index
 * could name the other's files.  The lock file goes when the save ends;
 * a lock taken on a file another save just removed is taken again. */
static int take_lock(struct saver *sv) {
  for (int tries = 0; tries < 3; tries++) {
    int fd = openat(sv->dirfd, LOCK_NAME,
                    O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0)
      return sys_fail(sv, "cannot create", LOCK_NAME);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      close(fd);
      errno = err;
      if (err == EWOULDBLOCK)
        return say(sv->c, SP_EBUSY, "save: another save into %s is running "
                   "(it holds %s/%s); wait until it ends, or save elsewhere",
                   sv->dir, sv->dir, LOCK_NAME);
      return sys_fail(sv, "cannot lock", LOCK_NAME);
    }
    struct stat held, named;
    if (fstat(fd, &held) == 0 &&
        fstatat(sv->dirfd, LOCK_NAME, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
        held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      sv->lockfd = fd;
      return 0;
    }
    close(fd);
  }
  return say(sv->c, SP_EBUSY, "save: other saves into %s keep starting and "
             "ending; wait until they end, or save elsewhere", sv->dir);
}

static void drop_lock(struct saver *sv) {
  if (sv->lockfd < 0)
    return;
  unlinkat(sv->dirfd, LOCK_NAME, 0);
  close(sv->lockfd);
  sv->lockfd = -1;
}

/* Rank 0, before it reports step 1: an index in the way is refused, or
 * (overwrite) moved aside so that no file renamed later is ever named by
 * the old checkpoint's index. */
static int clear_index(struct saver *sv) {
  if (faccessat(sv->dirfd, INDEX_NAME, F_OK, AT_SYMLINK_NOFOLLOW) != 0)
    return 0;
  if (!sv->o->overwrite)
    return say(sv->c, SP_EEXISTS, "%s/%s exists: the directory holds a "
               "checkpoint; save elsewhere, or overwrite it", sv->dir,
               INDEX_NAME);
  snprintf(sv->aside, sizeof sv->aside, "." INDEX_NAME ".%ld.replaced",
           (long)getpid());
  if (renameat(sv->dirfd, INDEX_NAME, sv->dirfd, sv->aside) != 0)
    return sys_fail(sv, "cannot move aside", INDEX_NAME);
  sv->index_aside = true;
  return sync_dir(sv);
}

static int rename_files(struct saver *sv) {
  for (size_t i = 0; i < sv->nmine; i++) {
    struct save_file *f = &sv->files[i];
    if (renameat(sv->dirfd, f->tmp, sv->dirfd, f->final) != 0)
      return sys_fail(sv, "cannot rename", f->tmp);
    f->renamed = true;
  }
  return sv->nmine > 0 ? sync_dir(sv) : 0;
}

/* After a failure: this rank's temporary files go; the old index comes
 * back when no file of the new checkpoint took a final name anywhere
 * (step 1 was never passed). */
static void clean_up(struct saver *sv) {
  for (size_t i = 0; i < sv->nmine; i++)
    if (sv->files[i].created && !sv->files[i].renamed)
      unlinkat(sv->dirfd, sv->files[i].tmp, 0);
  if (sv->index_aside) {
    if (sv->step == 0)
      renameat(sv->dirfd, sv->aside, sv->dirfd, INDEX_NAME);
    else
      unlinkat(sv->dirfd, sv->aside, 0);
  }
  fsync(sv->dirfd);
}

/* ---- the commit ---- */

/* Reads one part of the weight map into the index being built. */
static int take_map(struct saver *sv, const msgpack_object *map,
                    struct st_buf *index, uint64_t *next_part,
                    uint64_t *parts) {
  uint64_t part, nparts, files, total;
  const msgpack_object_array *keys, *key_files;
  if (sp__msg_get_u64(map, "part", false, &part) != 0 ||
      sp__msg_get_u64(map, "parts", false, &nparts) != 0 ||
      sp__msg_get_u64(map, "files", false, &files) != 0 ||
      sp__msg_get_u64(map, "total_size", false, &total) != 0 ||
      sp__msg_get_array(map, "keys", false, &keys) != 0 ||
      sp__msg_get_array(map, "key_files", false, &key_files) != 0 ||
      keys->size != key_files->size || part != *next_part || nparts == 0 ||
      (*next_part > 0 && nparts != *parts) || files != sv->nfiles)
    return say(sv->c, SP_EBADMSG, "bad save reply: part %" PRIu64 " of the "
               "weight map is not the one expected", *next_part);
  if (part == 0)
    st_index_begin(index, total);
  *parts = nparts;
  for (uint32_t i = 0; i < keys->size; i++) {
    const msgpack_object *k = &keys->ptr[i], *f = &key_files->ptr[i];
    char key[1025];
    if (k->type != MSGPACK_OBJECT_STR || k->via.str.size == 0 ||
        k->via.str.size >= sizeof key ||
        memchr(k->via.str.ptr, '\0', k->via.str.size) ||
        f->type != MSGPACK_OBJECT_POSITIVE_INTEGER || f->via.u64 >= files)
      return say(sv->c, SP_EBADMSG, "bad save reply: entry %u of part %"
                 PRIu64 " of the weight map is no key and file", i, part);
    memcpy(key, k->via.str.ptr, k->via.str.size);
    key[k->via.str.size] = '\0';
    if (!utf8_valid(key))
      return say(sv->c, SP_EBADMSG, "bad save reply: a key of the weight "
                 "map is not UTF-8");
    st_index_add(index, key, (uint32_t)f->via.u64, sv->nfiles,
                 part == 0 && i == 0);
  }
  (*next_part)++;
  return 0;
}

/* Reports step (or, with code < 0, this rank's failure at it) and waits
 * until every rank has: the daemon's error, or 0.  Rank 0's reply to step
 * 2 carries the weight map, built into *index. */
static int report(struct saver *sv, uint32_t step, int code,
                  struct st_buf *index) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(sv->c, &mb, "save_step", code < 0 ? 5 : 3);
  sp__pack_kv_u64(&mb.pk, "export_id", sv->export_id);
  sp__pack_kv_u64(&mb.pk, "step", step);
  sp__pack_kv_u64(&mb.pk, "bytes_written", sv->written);
  if (code < 0) {
    sp__pack_kv_str(&mb.pk, "error", sp_err_name(code));
    sp__pack_kv_str(&mb.pk, "message",
                   sv->c->message[0] ? sv->c->message : sp_strerror(code));
  }
  int rc = client_start(sv->c, &mb, id);
  /* The others may write for long: the daemon bounds the wait (the
   * export's timeout for progress), the library allows it as an export's
   * frames. */
  uint64_t daemon_ms = sv->o->export_opts.timeout_ms
                           ? sv->o->export_opts.timeout_ms
                           : UINT64_C(86400000);
  uint64_t wait_ms =
      sv->c->timeout_ms == 0 ? 0 : sv->c->timeout_ms + daemon_ms;
  bool map = step == 2 && sv->c->rank == 0 && code == 0;
  uint64_t next_part = 0, parts = 1;
  while (rc == 0) {
    struct client_reply reply;
    struct sp_msg_head head;
    rc = client_next(sv->c, id, wait_ms, &reply, &head);
    if (rc < 0)
      break;
    uint64_t got;
    if (strcmp(head.op, "save_step") != 0 ||
        sp__msg_get_u64(&reply.map, "step", false, &got) != 0 || got != step)
      rc = say(sv->c, SP_EBADMSG, "bad save reply: a \"%s\" frame answered "
               "step %" PRIu32, head.op, step);
    else if (map)
      rc = take_map(sv, &reply.map, index, &next_part, &parts);
    client_reply_release(&reply);
    if (rc == 0 && (!map || next_part == parts))
      break;
  }
  if (rc == 0 && code == 0)
    sv->step = step;
  sv->daemon_said = true;
  return rc;
}

static int write_index(struct saver *sv, struct st_buf *index) {
  int rc = st_index_end(index);
  if (rc < 0)
    return rc;
  struct save_file f = {.created = false};
  snprintf(f.final, sizeof f.final, INDEX_NAME);
  snprintf(f.tmp, sizeof f.tmp, "." INDEX_NAME ".%ld-%" PRIu64 ".tmp",
           (long)getpid(), sv->export_id);
  int fd = create_new(sv, f.tmp);
  if (fd < 0)
    return fd;
  rc = write_all(sv, fd, &f, index->data, index->len, false);
  if (rc == 0 && fsync(fd) != 0)
    rc = sys_fail(sv, "cannot fsync", f.tmp);
  if (close(fd) != 0 && rc == 0)
    rc = sys_fail(sv, "cannot close", f.tmp);
  if (rc == 0 && renameat(sv->dirfd, f.tmp, sv->dirfd, INDEX_NAME) != 0)
    rc = sys_fail(sv, "cannot rename", f.tmp);
  if (rc < 0)
    unlinkat(sv->dirfd, f.tmp, 0);
  return rc == 0 ? sync_dir(sv) : rc;
}

/* Once the index is durable, every file of this save has its final name:
 * a temporary file of the checkpoint older than this save, or an old
 * index moved aside, is what a process killed in an earlier save left,
 * and goes now. */
static void remove_stale(struct saver *sv) {
  int fd = dup(sv->dirfd);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    if (fd >= 0)
      close(fd);
    return;
  }
  static const char aside[] = "." INDEX_NAME ".", replaced[] = ".replaced";
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *name = e->d_name;
    size_t n = strlen(name);
    bool temporary = n > 4 && strcmp(name + n - 4, ".tmp") == 0 &&
                     (strncmp(name, ".model-", 7) == 0 ||
                      strncmp(name, ".model.safetensors", 18) == 0);
    /* An old index a rank 0 that died moved aside, which no index names
     * now. */
    bool old_index = n > sizeof aside + sizeof replaced - 2 &&
                     strncmp(name, aside, sizeof aside - 1) == 0 &&
                     strcmp(name + n - (sizeof replaced - 1), replaced) == 0;
    /* Only what is older than this save: a file written since is a
     * later save's, whose rank 0 took the lock once this one's let go. */
    struct stat st;
    if ((temporary || old_index) &&
        fstatat(sv->dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        (st.st_mtim.tv_sec < sv->called.tv_sec ||
         (st.st_mtim.tv_sec == sv->called.tv_sec &&
          st.st_mtim.tv_nsec < sv->called.tv_nsec)))
      unlinkat(sv->dirfd, name, 0);
  }
  closedir(d);
}

/* The rank's part, from its published tensors to the last step.  A local
 * failure is reported at the step being gathered, so that every rank
 * hears it; the daemon's answer is then the save's error. */
static int run(struct saver *sv, sp_save_result *res) {
  struct st_buf index = {0};
  bool rank0 = sv->c->rank == 0;
  int rc = group_files(sv);
  if (rc == 0 && rank0)
    rc = take_lock(sv);
  if (rc == 0 && rank0)
    rc = clear_index(sv);
  for (size_t i = 0; rc == 0 && i < sv->nmine; i++)
    rc = write_file(sv, &sv->files[i]);
  if (rc == 0) {
    tell_progress(sv);
    callback(sv);
  }
  /* The published tensors are on disk: their memory goes back now.  The
   * release's answer must not hide why writing failed. */
  char why[sizeof sv->c->message];
  memcpy(why, sv->c->message, sizeof why);
  int rel = sp_release(sv->c, sv->set);
  sv->set = NULL;
  if (rc < 0)
    memcpy(sv->c->message, why, sizeof why);
  if (rc == 0 && rel < 0) {
    rc = rel;
    sv->daemon_said = true;
  }
  for (uint32_t step = 1; step <= SAVE_STEPS; step++) {
    if (rc < 0 && !sv->daemon_said) {
      /* This rank's own failure: every rank hears it, this one too, in
       * the daemon's words (which name this rank). */
      int said = report(sv, step, rc, NULL);
      if (said < 0)
        rc = said;
      break;
    }
    if (rc < 0)
      break;
    rc = report(sv, step, 0, &index);
    if (rc < 0)
      break;
    if (step == 1) {
      rc = rename_files(sv);
      if (rc == 0 && sv->index_aside && unlinkat(sv->dirfd, sv->aside, 0) == 0)
        sv->index_aside = false;
    } else if (step == 2 && rank0) {
      rc = write_index(sv, &index);
    } else if (step == SAVE_STEPS && rank0) {
      remove_stale(sv);
    }
  }
  st_buf_free(&index);
  if (rc < 0)
    clean_up(sv);
  drop_lock(sv);
  if (rc < 0)
    return rc;
  res->files = (uint32_t)sv->nmine;
  res->total_files = sv->nfiles;
  res->bytes = sv->written;
  res->total_bytes = sv->total_size;
  res->wrote_index = rank0;
  return 0;
}

SP_EXPORT int sp_save(sp_client *client, const char *dir,
                      const sp_save_opts *opts, sp_save_result *out) {
  static const sp_save_opts defaults;
  if (!opts)
    opts = &defaults;
  if (!client)
    return SP_EINVAL;
  uint64_t started = now_ms();
  struct saver sv = {.c = client, .o = opts, .dir = dir, .chunk = SAVE_CHUNK,
                     .dirfd = -1, .lockfd = -1};
  clock_gettime(CLOCK_REALTIME, &sv.called);
  /* The test seam of docs/checkpoints.md: each write waits this long. */
  const char *delay = getenv("SHARDPORT_TEST_SAVE_DELAY_MS");
  if (delay && delay[0]) {
    sv.delay_ms = (uint32_t)strtoul(delay, NULL, 10);
    sv.chunk = SAVE_TEST_CHUNK;
  }
  /* This rank's own refusal (its options, a directory it cannot make or
   * open) goes with its request rather than back to the caller alone: the
   * daemon then fails the save on every rank with it, and no rank waits
   * for one that gave up. */
  struct client_save_ask ask = {
      .limit = opts->max_shard_bytes ? opts->max_shard_bytes
                                     : SP_SAVE_DEFAULT_SHARD_BYTES,
      .overwrite = opts->overwrite != 0};
  char refusal[sizeof client->message];
  client->message[0] = '\0';
  ask.refused = prepare(&sv, dir, &ask);
  memcpy(refusal, client->message, sizeof refusal);
  ask.refusal = refusal[0] ? refusal : sp_strerror(ask.refused);
  int rc = client_export_run(client, &opts->export_opts, &ask, &sv.set,
                             &sv.export_request);
  if (rc == 0 && ask.refused < 0)
    rc = say(client, SP_EBADMSG, "save: the daemon published a save this "
             "rank refused");
  if (rc == 0) {
    sv.export_id = sv.set->export_id;
    sv.nfiles = client_export_files(sv.set, &sv.file, &sv.total_size);
    sp_save_result res = {0};
    rc = run(&sv, &res);
    res.seconds = (double)(now_ms() - started) / 1000.0;
    if (rc == 0 && out)
      *out = res;
  }
  if (sv.set)
    sp_release(client, sv.set);
  client_cuda_stage_free(sv.stage);
  free(sv.host_stage);
  free(sv.files);
  if (sv.dirfd >= 0)
    close(sv.dirfd);
  return rc;
}
