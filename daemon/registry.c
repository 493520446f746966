/*
 * registry.c - one rank's registered storages and tensors; see daemon.h.
 *
 * Storages are kept in the planner's form (struct sp_storage) beside what
 * only the daemon needs (the sid, the read-only mapping), and tensors in the
 * planner's form (struct plan_key_in), so gathering a job's metadata for
 * plan_build copies nothing.
 *
 * Two rules protect the trainer and the daemon:
 *   - a trainer's memory is never written: every host storage is mapped
 *     PROT_READ, so even a bug in the engine cannot corrupt a trainer; a
 *     CUDA storage (a rank on the CUDA backend) is opened through the
 *     backend (daemon/cuda/storage.c: cuMem allocations read-only, IPC
 *     allocations only ever copied from);
 *   - a frame is registered whole or not at all: everything is checked and
 *     mapped first, and committed only when nothing can fail any more, so a
 *     refusal leaves the registry exactly as it was.
 *
 * Host storages share mappings.  A trainer that registers one storage per
 * parameter, all in one memfd, would otherwise cost one mapping each, and
 * vm.max_map_count (65530 by default) ends that for every job of the node.
 * A file is known by its device and inode, never by descriptor: the same
 * memfd arrives as a new descriptor in every frame, and memfds of
 * different processes are different files.  A storage that a mapping of
 * its file holds already points into it.
 *
 * Only the pages storages lie in are mapped, never a whole file: a client
 * declares a file's size and its storages' offsets, and mapping a sparse
 * file of terabytes whole, or the span between two storages at its ends,
 * would take the daemon's address space (each user's is also bounded,
 * max_user_mapped_bytes).  A frame's storages that no mapping holds are
 * mapped in runs: storages close together share one run as long as the
 * pages between them are no more than the pages they cover (make_runs),
 * so a run takes at most twice the address space its storages need.
 * Mappings of a file may overlap (a storage that straddles an older run
 * gets a new one); the older stays for the storages in it.  Every mapping
 * is PROT_READ.  What a registry takes is counted (reg_usage) and offered
 * to its quotas before a frame is kept.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "proto/fail.h"
#include "daemon/daemon.h"
#include "shardport.h"

/* What a registration costs, counted against max_user_registration_bytes:
 * its entries in the registry's arrays, its slots in the lookup tables as
 * many as a table just grown holds per entry (four: idxset.c keeps a load
 * from a quarter to a half), and what it owns.  The arrays' spare room,
 * from doubling, may hold as much again (docs/operations.md, "Quotas"). */
#define STORAGE_COST                                                           \
  (sizeof(struct sp_storage) + sizeof(struct reg_storage) +                    \
   2 * 4 * sizeof(uint64_t))

static uint64_t tensor_cost(const struct req_tensor *t) {
  uint64_t holders = 0;
  for (size_t i = 0; i < t->npieces; i++)
    holders += t->pieces[i].nholders;
  return sizeof(struct plan_key_in) + 4 * sizeof(uint64_t) + t->key_len + 1 +
         t->npieces * sizeof(struct affine_piece) + holders * sizeof(uint32_t);
}

void registry_init(struct registry *reg, uint32_t device_type) {
  memset(reg, 0, sizeof *reg);
  reg->device_type = device_type;
  idxset_init(&reg->by_sid);
  idxset_init(&reg->by_base);
  idxset_init(&reg->by_name);
  idxset_init(&reg->by_file);
}

static void close_cuda(const struct registry *reg, struct reg_storage *s) {
  if (s->gpu.import != NULL)
    gpu_storage_close(reg->gpu, &s->gpu);
}

void registry_free(struct registry *reg) {
  for (size_t i = 0; i < reg->nstorages; i++)
    close_cuda(reg, &reg->info[i]);
  for (size_t i = 0; i < reg->nmaps; i++)
    munmap(reg->maps[i].addr, reg->maps[i].len);
  free(reg->places);
  for (size_t i = 0; i < reg->nkeys; i++) {
    free((char *)reg->keys[i].name);
    free((void *)reg->keys[i].pieces);
  }
  free(reg->storages);
  free(reg->info);
  free(reg->keys);
  free(reg->maps);
  free(reg->files);
  idxset_free(&reg->by_sid);
  idxset_free(&reg->by_base);
  idxset_free(&reg->by_name);
  idxset_free(&reg->by_file);
  memset(reg, 0, sizeof *reg);
}

/* Room for more items in an array of *cap, doubling. */
static int grow(void **array, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t ncap = *cap > 0 ? *cap : 64;
  while (ncap < need)
    ncap *= 2;
  void *p = realloc(*array, ncap * size);
  if (p == NULL)
    return SP_ENOMEM;
  *array = p;
  *cap = ncap;
  return 0;
}

/* Counts what a kept frame gave back, in the registry and for its quotas. */
static void release(struct registry *reg, const struct reg_usage *less) {
  reg->used.mappings -= less->mappings;
  reg->used.mapped_bytes -= less->mapped_bytes;
  if (reg->quota != NULL)
    reg->quota->release(reg->quota_arg, less);
}

/* Counts what a kept frame took, in the registry and for its quotas. */
static void charge(struct registry *reg, const struct reg_usage *more) {
  reg->used.mappings += more->mappings;
  reg->used.mapped_bytes += more->mapped_bytes;
  reg->used.registrations += more->registrations;
  reg->used.bytes += more->bytes;
  if (reg->quota != NULL)
    reg->quota->charge(reg->quota_arg, more);
}

struct sid_probe {
  const struct registry *reg;
  uint32_t sid;
};

static bool match_sid(const void *ctx, uint32_t idx) {
  const struct sid_probe *p = ctx;
  return p->reg->info[idx].sid == p->sid;
}

struct base_probe {
  const struct registry *reg;
  uint64_t base;
};

static bool match_base(const void *ctx, uint32_t idx) {
  const struct base_probe *p = ctx;
  return p->reg->storages[idx].base == p->base;
}

uint32_t registry_find_sid(const struct registry *reg, uint32_t sid) {
  struct sid_probe p = {reg, sid};
  return idxset_find(&reg->by_sid, idxset_hash_u64(sid), match_sid, &p);
}

/* Opens a CUDA storage of a CUDA rank on the GPU it names (its rank's
 * when it names none). */
static int open_cuda_storage(const struct registry *reg,
                             const struct req_storage *rs,
                             const struct sp_frame *frame, uint32_t index,
                             struct reg_storage *out, char *msg,
                             size_t msglen) {
  memset(out, 0, sizeof *out);
  out->sid = rs->sid;
  int device = reg->device;
  if (rs->device[0] != '\0' &&
      (device = gpu_find_device(reg->gpu, rs->device, strlen(rs->device))) < 0)
    return sp_failf(msg, msglen, SP_EINVAL,
                    "storages[%u] (sid %u): device \"%s\" is not a GPU of "
                    "this node",
                    index, rs->sid, rs->device);
  out->gpu.device = device;
  if (rs->length == 0)
    return 0;
  char why[SP_ERRMSG_MAX / 2];
  int rc = gpu_storage_open(
      reg->gpu, device,
      rs->kind == REQ_STORAGE_CUDA_IPC ? GPU_STORAGE_IPC : GPU_STORAGE_FD,
      rs->handle, rs->kind == REQ_STORAGE_CUDA_FD ? frame->fds[rs->fd] : -1,
      rs->offset, rs->length, &out->gpu, why, sizeof why);
  if (rc != 0)
    return sp_failf(msg, msglen, rc, "storages[%u] (sid %u): %s", index,
                    rs->sid, why);
  return 0;
}

static int sid_cmp(const void *a, const void *b) {
  uint32_t x = (*(const struct req_storage *const *)a)->sid;
  uint32_t y = (*(const struct req_storage *const *)b)->sid;
  return x < y ? -1 : x > y;
}

static int base_cmp(const void *a, const void *b) {
  uint64_t x = (*(const struct req_storage *const *)a)->base;
  uint64_t y = (*(const struct req_storage *const *)b)->base;
  return x < y ? -1 : x > y;
}

/* Refuses a sid registered twice, and two storages with bytes at one base
 * address: the planner takes equal (device, base) for the same memory when
 * it looks for tied weights, so a trainer that sent one base for two
 * different regions would get one tensor's bytes under another's name. */
static int check_unique(const struct registry *reg, const struct req_storage *s,
                        size_t n, char *msg, size_t msglen) {
  const struct req_storage **by = malloc((n > 0 ? n : 1) * sizeof *by);
  int rc = 0;
  if (by == NULL)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++)
    by[i] = &s[i];
  qsort(by, n, sizeof *by, sid_cmp);
  for (size_t i = 0; i < n && rc == 0; i++) {
    if ((i > 0 && by[i]->sid == by[i - 1]->sid) ||
        registry_find_sid(reg, by[i]->sid) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EINVAL,
                    "storage sid %u is registered twice", by[i]->sid);
  }
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (s[i].length > 0)
      by[m++] = &s[i];
  qsort(by, m, sizeof *by, base_cmp);
  for (size_t i = 0; i < m && rc == 0; i++) {
    struct base_probe p = {reg, by[i]->base};
    if ((i > 0 && by[i]->base == by[i - 1]->base) ||
        idxset_find(&reg->by_base, idxset_hash_u64(by[i]->base), match_base,
                    &p) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EINVAL,
                    "storage sid %u: another storage of this rank has base "
                    "address 0x%llx; register each storage once",
                    by[i]->sid, (unsigned long long)by[i]->base);
  }
  free(by);
  return rc;
}

/* Checks n more storages against the limit and the ones registered. */
static int check_storages(const struct registry *reg,
                          const struct req_storage *s, size_t n, char *msg,
                          size_t msglen) {
  if (n > REQ_MAX_PER_RANK - reg->nstorages)
    return sp_failf(msg, msglen, SP_ELIMIT,
                    "a rank may register at most %u storages",
                    REQ_MAX_PER_RANK);
  return check_unique(reg, s, n, msg, msglen);
}

/* Asks the quotas for more, then makes room for n more storages, so that
 * registering them cannot fail halfway. */
static int reserve_storages(struct registry *reg, size_t n,
                            const struct reg_usage *more, char *msg,
                            size_t msglen) {
  int rc;
  if (reg->quota != NULL &&
      (rc = reg->quota->admit(reg->quota_arg, reg, more, msg, msglen)) != 0)
    return rc;
  size_t need = reg->nstorages + n;
  if (grow((void **)&reg->storages, &reg->storage_cap_s, need,
           sizeof *reg->storages) != 0 ||
      grow((void **)&reg->info, &reg->storage_cap_i, need, sizeof *reg->info) !=
          0 ||
      idxset_reserve(&reg->by_sid, n) != 0 ||
      idxset_reserve(&reg->by_base, n) != 0 ||
      grow((void **)&reg->maps, &reg->map_cap, reg->nmaps + more->mappings,
           sizeof *reg->maps) != 0 ||
      grow((void **)&reg->places, &reg->place_cap,
           reg->nmaps + more->mappings, sizeof *reg->places) != 0 ||
      grow((void **)&reg->files, &reg->file_cap, reg->nfiles + more->mappings,
           sizeof *reg->files) != 0 ||
      idxset_reserve(&reg->by_file, more->mappings) != 0)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  return 0;
}

/* The frame's descriptors as files: each looked at once. */
struct frame_file {
  bool used;      /* a memfd storage of the frame names it */
  struct stat st; /* valid when used */
  uint32_t same;  /* the frame's first descriptor of the same file */
  uint32_t file;  /* the file in reg->files, or IDXSET_NONE if new */
};

/* Pages of a file: a storage's that no mapping holds yet, or a mapping
 * the registry holds (old); after the sweep, the frame's runs. */
struct page_span {
  uint32_t fd;      /* the frame's first descriptor of the file */
  uint32_t old;     /* the mapping in reg->maps, or IDXSET_NONE */
  uint32_t storage; /* a new span's storage in the frame */
  uint32_t run;     /* a span's run; a run's index among the fresh */
  uint64_t lo, hi;  /* file offsets, page boundaries */
  uint64_t covered; /* pages of storages in it */
  bool fresh;       /* a run: it holds a new span, so it is mapped */
  void *addr;       /* a run's mapping, once made */
};

/* What a frame's memfd storages need mapped, and where each will lie. */
struct frame_maps {
  struct frame_file ff[SP_FDS_MAX];
  struct page_span *spans; /* nspans, then the runs made of them */
  struct page_span *runs;
  size_t nspans, nruns;
  /* Per storage of the frame: its mapping in reg->maps, a new one counted
   * from the registry's nmaps in run order. */
  uint32_t *map_of;
  /* Per mapping of the registry, and new ones after: the run that
   * replaces it (absorbed), then its index once the replaced are gone. */
  uint32_t *absorbed;
  uint32_t *index;
  struct reg_usage more, less;
};

struct file_probe {
  const struct registry *reg;
  dev_t dev;
  ino_t ino;
};

static bool match_file(const void *ctx, uint32_t idx) {
  const struct file_probe *p = ctx;
  return p->reg->files[idx].dev == p->dev && p->reg->files[idx].ino == p->ino;
}

static uint64_t file_hash(dev_t dev, ino_t ino) {
  uint64_t id[2] = {(uint64_t)dev, (uint64_t)ino};
  return idxset_hash_bytes(id, sizeof id);
}

static uint32_t find_file(const struct registry *reg, const struct stat *st) {
  struct file_probe p = {reg, st->st_dev, st->st_ino};
  return idxset_find(&reg->by_file, file_hash(st->st_dev, st->st_ino),
                     match_file, &p);
}

/* The first place in file order whose (file, offset) is past (file, lo),
 * or with at_least, not before it. */
static size_t place_bound(const struct registry *reg, uint32_t file,
                          uint64_t lo, bool at_least) {
  size_t a = 0, b = reg->nmaps;
  while (a < b) {
    size_t mid = a + (b - a) / 2;
    const struct reg_place *p = &reg->places[mid];
    bool before = p->file < file ||
                  (p->file == file &&
                   (at_least ? p->offset < lo : p->offset <= lo));
    if (before)
      a = mid + 1;
    else
      b = mid;
  }
  return a;
}

/* The mapping of file that holds bytes [lo, hi), or IDXSET_NONE: of the
 * mappings in file order that start at or before lo, the one reaching
 * furthest (reg_place). */
static uint32_t find_map(const struct registry *reg, uint32_t file,
                         uint64_t lo, uint64_t hi) {
  size_t a = place_bound(reg, file, lo, false);
  if (a == 0 || reg->places[a - 1].file != file)
    return IDXSET_NONE;
  uint32_t reach = reg->places[a - 1].reach;
  const struct reg_map *m = &reg->maps[reach];
  return m->offset + m->len >= hi ? reach : IDXSET_NONE;
}

static uint64_t page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

static uint64_t pages_of(uint64_t offset, uint64_t length) {
  uint64_t page = page_size();
  return (offset + length + page - 1) / page * page - offset / page * page;
}

/* Looks at the file of a storage's descriptor, once per frame: its stat,
 * the frame's first descriptor of the same file, and the registry's entry
 * for it if it has one. */
static int look_at(const struct registry *reg, const struct req_storage *rs,
                   size_t i, const struct sp_frame *frame,
                   struct frame_file *ff, char *msg, size_t msglen) {
  struct frame_file *f = &ff[rs->fd];
  if (f->used)
    return 0;
  if (fstat(frame->fds[rs->fd], &f->st) != 0)
    return sp_failf(msg, msglen, SP_EBADFD, "storages[%zu] (sid %u): fstat: %s",
                    i, rs->sid, strerror(errno));
  f->used = true;
  f->same = rs->fd;
  for (uint32_t j = 0; j < frame->nfds; j++)
    if (ff[j].used && j != rs->fd && ff[j].st.st_dev == f->st.st_dev &&
        ff[j].st.st_ino == f->st.st_ino) {
      f->same = ff[j].same;
      break;
    }
  f->file = find_file(reg, &f->st);
  /* One size per file in a frame, its first descriptor's: the file may
   * have grown or shrunk between the two fstats, and every storage is
   * checked against the one size its runs are cut to. */
  f->st.st_size = ff[f->same].st.st_size;
  return 0;
}

/* Looks at each descriptor a memfd storage names, checks every memfd
 * storage against its file, and collects the pages of those no mapping of
 * the registry holds yet. */
static int plan_files(const struct registry *reg, const struct req_storage *s,
                      size_t n, const struct sp_frame *frame,
                      struct frame_maps *fm, char *msg, size_t msglen) {
  struct frame_file *ff = fm->ff;
  uint64_t page = page_size();
  memset(ff, 0, frame->nfds * sizeof *ff);
  for (size_t i = 0; i < n; i++) {
    const struct req_storage *rs = &s[i];
    fm->map_of[i] = IDXSET_NONE;
    if (rs->kind != REQ_STORAGE_MEMFD)
      continue;
    int rc = look_at(reg, rs, i, frame, ff, msg, msglen);
    if (rc != 0)
      return rc;
    const struct frame_file *f = &ff[rs->fd];
    if (!S_ISREG(f->st.st_mode))
      return sp_failf(msg, msglen, SP_EBADFD,
                      "storages[%zu] (sid %u): the descriptor is not a memfd "
                      "or shm file",
                      i, rs->sid);
    if ((uint64_t)f->st.st_size < rs->offset + rs->length)
      return sp_failf(msg, msglen, SP_EBADFD,
                      "storages[%zu] (sid %u): the file has %lld bytes, fewer "
                      "than offset + length = %llu",
                      i, rs->sid, (long long)f->st.st_size,
                      (unsigned long long)(rs->offset + rs->length));
    if (rs->length == 0)
      continue;
    uint32_t file = f->file;
    if (file != IDXSET_NONE &&
        (fm->map_of[i] = find_map(reg, file, rs->offset,
                                  rs->offset + rs->length)) != IDXSET_NONE)
      continue;
    uint64_t lo = rs->offset / page * page;
    fm->spans[fm->nspans++] = (struct page_span){
        .fd = f->same, .old = IDXSET_NONE, .storage = (uint32_t)i, .lo = lo,
        .hi = lo + pages_of(rs->offset, rs->length),
        .covered = pages_of(rs->offset, rs->length)};
  }
  return 0;
}

/* Adds the registry's mappings of each file the frame maps anew as spans,
 * so that new runs may take them in. */
static void add_old_spans(const struct registry *reg, struct frame_maps *fm,
                          size_t nfds) {
  size_t nnew = fm->nspans;
  for (uint32_t j = 0; j < nfds; j++) {
    const struct frame_file *f = &fm->ff[j];
    bool needed = false;
    for (size_t k = 0; k < nnew && !needed; k++)
      needed = fm->spans[k].fd == j;
    if (!f->used || f->same != j || f->file == IDXSET_NONE || !needed)
      continue;
    for (size_t k = place_bound(reg, f->file, 0, true);
         k < reg->nmaps && reg->places[k].file == f->file; k++) {
      const struct reg_map *m = &reg->maps[reg->places[k].map];
      fm->spans[fm->nspans++] = (struct page_span){
          .fd = j, .old = reg->places[k].map, .storage = UINT32_MAX,
          .lo = m->offset, .hi = m->offset + m->len, .covered = m->covered};
    }
  }
}

static int span_cmp(const void *a, const void *b) {
  const struct page_span *x = a, *y = b;
  if (x->fd != y->fd)
    return x->fd < y->fd ? -1 : 1;
  if (x->lo != y->lo)
    return x->lo < y->lo ? -1 : 1;
  return x->hi < y->hi ? -1 : x->hi > y->hi;
}

/* Whether span sp may join run: the joined run would take no more than
 * twice the pages its storages cover. */
static bool may_join(const struct page_span *run, const struct page_span *sp,
                     uint64_t *covered) {
  if (run == NULL || run->fd != sp->fd)
    return false;
  uint64_t hi = sp->hi > run->hi ? sp->hi : run->hi;
  uint64_t beyond = sp->hi > run->hi ? sp->hi - run->hi : 0;
  uint64_t add = sp->lo < run->hi
                     ? (sp->covered < beyond ? sp->covered : beyond)
                     : sp->covered;
  /* Never more than the run's pages: storages overlap, and so the
   * doubling below cannot overflow (file offsets are below 2^63). */
  *covered = run->covered + add;
  if (*covered > hi - run->lo)
    *covered = hi - run->lo;
  return hi - run->lo <= 2 * *covered;
}

/* Makes the frame's runs from its spans, in file order: a span joins the
 * run before it while the run stays within twice the pages its storages
 * cover, and a run that holds a new span is mapped, taking in the
 * mappings it joined.  A run is then widened, within its file, to twice
 * its storages' pages, so that a trainer registering one storage after
 * another in one memfd maps it a logarithmic number of times.  Whatever
 * offsets a client declares in however large a sparse file, a mapping
 * takes at most twice the address space of its storages. */
static void make_runs(struct frame_maps *fm) {
  qsort(fm->spans, fm->nspans, sizeof *fm->spans, span_cmp);
  fm->runs = fm->spans + fm->nspans;
  fm->nruns = 0;
  for (size_t k = 0; k < fm->nspans; k++) {
    struct page_span *sp = &fm->spans[k];
    struct page_span *run = fm->nruns > 0 ? &fm->runs[fm->nruns - 1] : NULL;
    uint64_t covered;
    if (may_join(run, sp, &covered)) {
      run->covered = covered;
      if (sp->hi > run->hi)
        run->hi = sp->hi;
    } else {
      run = &fm->runs[fm->nruns++];
      *run = *sp;
    }
    run->fresh = run->fresh || sp->old == IDXSET_NONE;
    sp->run = (uint32_t)(fm->nruns - 1);
  }
}

/* Widens the fresh runs, keeps only those, says where each new storage
 * will lie and which mappings the runs replace, and counts both. */
static void keep_fresh(const struct registry *reg, struct frame_maps *fm) {
  uint64_t page = page_size();
  uint32_t kept = 0;
  for (size_t r = 0; r < fm->nruns; r++) {
    struct page_span *run = &fm->runs[r];
    run->run = IDXSET_NONE;
    if (!run->fresh)
      continue;
    uint64_t end =
        ((uint64_t)fm->ff[run->fd].st.st_size + page - 1) / page * page;
    uint64_t wide = run->lo + 2 * run->covered;
    if (wide > end)
      wide = end;
    if (wide > run->hi)
      run->hi = wide;
    run->run = kept++;
    fm->more.mappings++;
    fm->more.mapped_bytes += run->hi - run->lo;
  }
  for (size_t k = 0; k < reg->nmaps; k++)
    fm->absorbed[k] = IDXSET_NONE;
  for (size_t j = 0; j < fm->nspans; j++) {
    const struct page_span *sp = &fm->spans[j];
    uint32_t into = fm->runs[sp->run].run;
    if (into == IDXSET_NONE)
      continue;
    if (sp->old == IDXSET_NONE) {
      fm->map_of[sp->storage] = (uint32_t)(reg->nmaps + into);
    } else {
      fm->absorbed[sp->old] = into;
      fm->less.mappings++;
      fm->less.mapped_bytes += reg->maps[sp->old].len;
    }
  }
  for (size_t r = 0; r < fm->nruns; r++)
    if (fm->runs[r].run != IDXSET_NONE)
      fm->runs[fm->runs[r].run] = fm->runs[r];
  fm->nruns = kept;
}

static void unmap_runs(struct frame_maps *fm) {
  for (size_t r = 0; r < fm->nruns; r++)
    if (fm->runs[r].addr != NULL) {
      munmap(fm->runs[r].addr, (size_t)(fm->runs[r].hi - fm->runs[r].lo));
      fm->runs[r].addr = NULL;
    }
}

/* Maps each fresh run of the frame, read-only. */
static int map_runs(struct frame_maps *fm, const struct sp_frame *frame,
                    char *msg, size_t msglen) {
  for (size_t r = 0; r < fm->nruns; r++) {
    struct page_span *run = &fm->runs[r];
    if (run->hi - run->lo > SIZE_MAX) {
      unmap_runs(fm);
      return sp_failf(msg, msglen, SP_EBADFD,
                      "bytes %llu to %llu of the file of descriptor %u are "
                      "too many to map",
                      (unsigned long long)run->lo,
                      (unsigned long long)run->hi, run->fd);
    }
    void *p = mmap(NULL, (size_t)(run->hi - run->lo), PROT_READ, MAP_SHARED,
                   frame->fds[run->fd], (off_t)run->lo);
    if (p == MAP_FAILED) {
      int err = errno;
      unmap_runs(fm);
      return sp_failf(msg, msglen, err == ENOMEM ? SP_ENOMEM : SP_EBADFD,
                      "cannot map bytes %llu to %llu of the file of "
                      "descriptor %u read-only: %s",
                      (unsigned long long)run->lo,
                      (unsigned long long)run->hi, run->fd, strerror(err));
    }
    run->addr = p;
  }
  return 0;
}

static int place_cmp(const void *a, const void *b) {
  const struct reg_place *x = a, *y = b;
  if (x->file != y->file)
    return x->file < y->file ? -1 : 1;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Puts the registry's mappings in file order with their reach
 * (reg_place): n log n on at most max_client_mappings entries, and
 * nothing that can fail. */
static void order_places(struct registry *reg) {
  for (size_t k = 0; k < reg->nmaps; k++)
    reg->places[k] = (struct reg_place){reg->maps[k].offset,
                                        reg->maps[k].file, (uint32_t)k,
                                        (uint32_t)k};
  qsort(reg->places, reg->nmaps, sizeof *reg->places, place_cmp);
  for (size_t k = 1; k < reg->nmaps; k++) {
    struct reg_place *p = &reg->places[k];
    if (reg->places[k - 1].file != p->file)
      continue;
    const struct reg_map *m = &reg->maps[p->map];
    const struct reg_map *b = &reg->maps[reg->places[k - 1].reach];
    if (b->offset + b->len > m->offset + m->len)
      p->reach = reg->places[k - 1].reach;
  }
}

/* Appends the frame's runs to the registry's mappings, with the files
 * new to it. */
static void append_runs(struct registry *reg, struct frame_maps *fm) {
  for (size_t r = 0; r < fm->nruns; r++) {
    const struct page_span *run = &fm->runs[r];
    struct frame_file *f = &fm->ff[run->fd];
    if (f->file == IDXSET_NONE) {
      f->file = (uint32_t)reg->nfiles++;
      reg->files[f->file] = (struct reg_file){f->st.st_dev, f->st.st_ino};
      idxset_insert(&reg->by_file, file_hash(f->st.st_dev, f->st.st_ino),
                    f->file);
    }
    reg->maps[reg->nmaps++] = (struct reg_map){
        run->addr, (size_t)(run->hi - run->lo), run->lo, f->file,
        run->covered};
  }
}

/* Moves the registered storages in mappings a run replaced into the run,
 * unmaps the replaced ones and closes the gaps they leave in maps; index
 * says where each mapping went.  No export reads the registry meanwhile:
 * a rank registers only while its job runs none (job.c). */
static void drop_absorbed(struct registry *reg, struct frame_maps *fm,
                          size_t old) {
  for (size_t i = 0; i < reg->nstorages; i++) {
    struct reg_storage *st = &reg->info[i];
    if (st->data == NULL || fm->absorbed[st->map] == IDXSET_NONE)
      continue;
    const struct reg_map *from = &reg->maps[st->map];
    uint32_t to = (uint32_t)old + fm->absorbed[st->map];
    uint64_t at = from->offset + (uint64_t)(st->data - (uint8_t *)from->addr);
    st->data = (const uint8_t *)reg->maps[to].addr + (at - reg->maps[to].offset);
    st->map = to;
  }
  size_t kept = 0;
  for (size_t k = 0; k < reg->nmaps; k++) {
    if (k < old && fm->absorbed[k] != IDXSET_NONE) {
      munmap(reg->maps[k].addr, reg->maps[k].len);
      fm->index[k] = IDXSET_NONE;
      continue;
    }
    fm->index[k] = (uint32_t)kept;
    reg->maps[kept++] = reg->maps[k];
  }
  reg->nmaps = kept;
  for (size_t i = 0; i < reg->nstorages; i++)
    if (reg->info[i].data != NULL)
      reg->info[i].map = fm->index[reg->info[i].map];
}

/* Keeps the frame's new mappings and drops the ones they replace; each
 * memfd storage of the frame learns its final mapping (map_of) and counts
 * in its covered pages. */
static void commit_maps(struct registry *reg, struct frame_maps *fm,
                        const struct req_storage *s, size_t n) {
  size_t old = reg->nmaps;
  append_runs(reg, fm);
  for (size_t i = 0; i < n; i++) {
    uint32_t m = fm->map_of[i];
    if (m == IDXSET_NONE || m >= old)
      continue;
    /* Found in a mapping the registry held: its pages count there, or in
     * the run that replaces it. */
    if (fm->absorbed[m] != IDXSET_NONE)
      m = fm->map_of[i] = (uint32_t)old + fm->absorbed[m];
    struct reg_map *map = &reg->maps[m];
    map->covered += pages_of(s[i].offset, s[i].length);
    if (map->covered > map->len)
      map->covered = map->len;
  }
  if (fm->less.mappings > 0) {
    drop_absorbed(reg, fm, old);
    for (size_t i = 0; i < n; i++)
      if (fm->map_of[i] != IDXSET_NONE)
        fm->map_of[i] = fm->index[fm->map_of[i]];
  }
  if (fm->nruns > 0)
    order_places(reg);
}

/* A rank's storages are of its device's kind: memfd storages for a "cpu"
 * rank, CUDA storages for a CUDA rank. */
static int check_kinds(const struct registry *reg, const struct req_storage *s,
                       size_t n, char *msg, size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    bool memfd = s[i].kind == REQ_STORAGE_MEMFD;
    if (memfd && reg->gpu != NULL)
      return sp_failf(msg, msglen, SP_EINVAL,
                      "storages[%zu] (sid %u): a memfd storage, but this rank "
                      "joined with a CUDA device; register its CUDA storages",
                      i, s[i].sid);
    if (!memfd && reg->gpu == NULL)
      return sp_failf(msg, msglen, SP_EINVAL,
                      "storages[%zu] (sid %u): a CUDA storage, but this rank "
                      "joined with a \"cpu\" device",
                      i, s[i].sid);
  }
  return 0;
}

/* Opens each CUDA storage of the frame into fresh (a memfd storage's
 * memory comes with its file's mapping, map_files); nothing stays open when
 * one fails. */
static int open_cuda_storages(const struct registry *reg,
                              const struct req_storage *s, size_t n,
                              const struct sp_frame *frame,
                              struct reg_storage *fresh, char *msg,
                              size_t msglen) {
  for (size_t i = 0; i < n; i++) {
    memset(&fresh[i], 0, sizeof fresh[i]);
    fresh[i].sid = s[i].sid;
    if (s[i].kind == REQ_STORAGE_MEMFD)
      continue;
    int rc = open_cuda_storage(reg, &s[i], frame, (uint32_t)i, &fresh[i], msg,
                               msglen);
    if (rc != 0) {
      for (size_t k = 0; k < i; k++)
        close_cuda(reg, &fresh[k]);
      return rc;
    }
  }
  return 0;
}

/* Plans, admits, maps and keeps a frame's storages, with fm's arrays
 * allocated for them. */
static int add_storages(struct registry *reg, const struct req_storage *s,
                        size_t n, const struct sp_frame *frame,
                        struct frame_maps *fm, char *msg, size_t msglen) {
  int rc = check_storages(reg, s, n, msg, msglen);
  if (rc != 0 || (rc = check_kinds(reg, s, n, msg, msglen)) != 0 ||
      (rc = plan_files(reg, s, n, frame, fm, msg, msglen)) != 0)
    return rc;
  add_old_spans(reg, fm, frame->nfds);
  make_runs(fm);
  keep_fresh(reg, fm);
  struct reg_usage more = fm->more;
  more.registrations = n;
  more.bytes = n * STORAGE_COST;
  if ((rc = reserve_storages(reg, n, &more, msg, msglen)) != 0)
    return rc;
  /* Open into the spare room at the end; only the count commits them. */
  struct reg_storage *fresh = reg->info + reg->nstorages;
  if ((rc = open_cuda_storages(reg, s, n, frame, fresh, msg, msglen)) != 0)
    return rc;
  if ((rc = map_runs(fm, frame, msg, msglen)) != 0) {
    for (size_t i = 0; i < n; i++)
      close_cuda(reg, &fresh[i]);
    return rc;
  }
  commit_maps(reg, fm, s, n);
  for (size_t i = 0; i < n; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    struct sp_storage *st = &reg->storages[idx];
    memset(st, 0, sizeof *st);
    st->device.type = SP_DEVICE_CPU;
    if (s[i].kind == REQ_STORAGE_MEMFD) {
      if (s[i].length > 0) {
        const struct reg_map *m = &reg->maps[fm->map_of[i]];
        fresh[i].data = (const uint8_t *)m->addr + (s[i].offset - m->offset);
        fresh[i].map = fm->map_of[i];
      }
    } else {
      /* The planner tells storages apart by (device, base): the GPU's
       * UUID is what identifies it across processes. */
      int device = fresh[i].gpu.device;
      st->device.type = SP_DEVICE_CUDA;
      st->device.index = device;
      memcpy(st->device.uuid, gpu_device_uuid(reg->gpu, device),
             sizeof st->device.uuid);
    }
    st->base = s[i].base;
    st->nbytes = s[i].length;
    idxset_insert(&reg->by_sid, idxset_hash_u64(s[i].sid), idx);
    if (s[i].length > 0)
      idxset_insert(&reg->by_base, idxset_hash_u64(s[i].base), idx);
  }
  reg->nstorages += n;
  charge(reg, &more);
  release(reg, &fm->less);
  return 0;
}

int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen) {
  struct frame_maps fm = {0};
  /* The new spans and the registry's mappings, then as many runs. */
  size_t spans = n + reg->nmaps + 1;
  fm.spans = malloc(2 * spans * sizeof *fm.spans);
  fm.map_of = malloc((n + 1) * sizeof *fm.map_of);
  fm.absorbed = malloc(spans * sizeof *fm.absorbed);
  fm.index = malloc(spans * sizeof *fm.index);
  int rc = fm.spans != NULL && fm.map_of != NULL && fm.absorbed != NULL &&
                   fm.index != NULL
               ? add_storages(reg, s, n, frame, &fm, msg, msglen)
               : sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  free(fm.spans);
  free(fm.map_of);
  free(fm.absorbed);
  free(fm.index);
  return rc;
}

struct name_probe {
  const struct registry *reg;
  const char *name;
  size_t len;
};

static bool match_name(const void *ctx, uint32_t idx) {
  const struct name_probe *p = ctx;
  const char *name = p->reg->keys[idx].name;
  return strncmp(name, p->name, p->len) == 0 && name[p->len] == '\0';
}

static int tensor_key_cmp(const void *a, const void *b) {
  const struct req_tensor *x = *(const struct req_tensor *const *)a;
  const struct req_tensor *y = *(const struct req_tensor *const *)b;
  size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
  int c = memcmp(x->key, y->key, n);
  if (c != 0)
    return c;
  return x->key_len < y->key_len ? -1 : x->key_len > y->key_len;
}

/* Keys unique within the frame and against what is registered. */
static int check_keys(const struct registry *reg, const struct req_tensor *t,
                      size_t n, char *msg, size_t msglen) {
  const struct req_tensor **by = malloc((n > 0 ? n : 1) * sizeof *by);
  int rc = 0;
  if (by == NULL)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++)
    by[i] = &t[i];
  qsort(by, n, sizeof *by, tensor_key_cmp);
  for (size_t i = 0; i < n && rc == 0; i++) {
    struct name_probe p = {reg, by[i]->key, by[i]->key_len};
    if ((i > 0 && tensor_key_cmp(&by[i], &by[i - 1]) == 0) ||
        idxset_find(&reg->by_name,
                    idxset_hash_bytes(by[i]->key, by[i]->key_len), match_name,
                    &p) != IDXSET_NONE)
      rc = sp_failf(msg, msglen, SP_EDUPKEY,
                    "key '%.*s' is registered twice by this rank",
                    (int)by[i]->key_len, by[i]->key);
  }
  free(by);
  return rc;
}

/* Checks one tensor against its storage and fills in its planner form;
 * nothing is allocated. */
static int check_tensor(const struct registry *reg, const struct req_tensor *t,
                        size_t i, struct plan_key_in *out, char *msg,
                        size_t msglen) {
  int klen = (int)(t->key_len < 64 ? t->key_len : 64);
  uint32_t idx = registry_find_sid(reg, t->sid);
  if (idx == IDXSET_NONE)
    return sp_failf(msg, msglen, SP_ENOSTORAGE,
                    "tensors[%zu] ('%.*s'): storage sid %u is not registered",
                    i, klen, t->key, t->sid);
  char why[192];
  int rc = sp_view_check(&t->view, reg->storages[idx].nbytes, why, sizeof why);
  if (rc != 0)
    return sp_failf(msg, msglen, rc,
                    "tensors[%zu] ('%.*s') in storage sid %u of %llu bytes: %s",
                    i, klen, t->key, t->sid,
                    (unsigned long long)reg->storages[idx].nbytes, why);
  memset(out, 0, sizeof *out);
  out->placement = t->placement;
  out->device_type = reg->device_type;
  out->ndim = t->ndim;
  memcpy(out->shape, t->shape, sizeof out->shape);
  out->storage = idx;
  out->view = t->view;
  sp_view_nbytes(&t->view, &out->nbytes);
  out->npieces = t->npieces;
  return 0;
}

int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen) {
  if (n > REQ_MAX_PER_RANK - reg->nkeys)
    return sp_failf(msg, msglen, SP_ELIMIT,
                    "a rank may register at most %u tensors", REQ_MAX_PER_RANK);
  int rc = check_keys(reg, t, n, msg, msglen);
  if (rc != 0)
    return rc;
  struct reg_usage more = {.registrations = n};
  for (size_t i = 0; i < n; i++)
    more.bytes += tensor_cost(&t[i]);
  if (reg->quota != NULL &&
      (rc = reg->quota->admit(reg->quota_arg, reg, &more, msg, msglen)) != 0)
    return rc;
  size_t need = reg->nkeys + n;
  if (grow((void **)&reg->keys, &reg->key_cap, need, sizeof *reg->keys) != 0 ||
      idxset_reserve(&reg->by_name, n) != 0)
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  struct plan_key_in *fresh = reg->keys + reg->nkeys;
  for (size_t i = 0; i < n; i++)
    if ((rc = check_tensor(reg, &t[i], i, &fresh[i], msg, msglen)) != 0)
      return rc;
  size_t named = 0;
  for (; named < n; named++) {
    char *name = malloc(t[named].key_len + 1);
    if (name == NULL)
      break;
    memcpy(name, t[named].key, t[named].key_len);
    name[t[named].key_len] = '\0';
    fresh[named].name = name;
  }
  if (named < n) {
    for (size_t i = 0; i < named; i++)
      free((char *)fresh[i].name);
    return sp_failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  /* Committed: the pieces move from the request into the registry. */
  for (size_t i = 0; i < n; i++) {
    fresh[i].pieces = t[i].pieces;
    t[i].pieces = NULL;
    idxset_insert(&reg->by_name, idxset_hash_bytes(t[i].key, t[i].key_len),
                  (uint32_t)(reg->nkeys + i));
  }
  reg->nkeys = need;
  charge(reg, &more);
  return 0;
}

void registry_rank_in(const struct registry *reg, uint32_t rank,
                      struct plan_rank_in *out) {
  memset(out, 0, sizeof *out);
  out->rank = rank;
  out->nstorages = reg->nstorages;
  out->storages = reg->storages;
  out->nkeys = reg->nkeys;
  out->keys = reg->keys;
}

int registry_add_remote_storages(struct registry *reg,
                                 const struct req_storage *s,
                                 const struct sp_device *device, size_t n,
                                 char *msg, size_t msglen) {
  struct reg_usage more = {.registrations = n, .bytes = n * STORAGE_COST};
  int rc = check_storages(reg, s, n, msg, msglen);
  if (rc != 0 || (rc = reserve_storages(reg, n, &more, msg, msglen)) != 0)
    return rc;
  /* The rank's memory is on its own node: nothing here maps it. */
  for (size_t i = 0; i < n; i++) {
    uint32_t idx = (uint32_t)(reg->nstorages + i);
    memset(&reg->info[idx], 0, sizeof reg->info[idx]);
    reg->info[idx].sid = s[i].sid;
    struct sp_storage *st = &reg->storages[idx];
    memset(st, 0, sizeof *st);
    st->device = device[i];
    st->base = s[i].base;
    st->nbytes = s[i].length;
    idxset_insert(&reg->by_sid, idxset_hash_u64(s[i].sid), idx);
    if (s[i].length > 0)
      idxset_insert(&reg->by_base, idxset_hash_u64(s[i].base), idx);
  }
  reg->nstorages += n;
  charge(reg, &more);
  return 0;
}
