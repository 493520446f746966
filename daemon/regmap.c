/*
 * regmap.c - which pages of a rank's registered files the daemon maps,
 * and how storages share those mappings; see regmap.h.
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
 * max_user_mapped_bytes, quota.c).  A frame's storages that no mapping
 * holds are mapped in runs: storages close together share one run as long
 * as the pages between them are no more than the pages they cover
 * (make_runs), so a run takes at most twice the address space its
 * storages need.  A run that comes near a mapping the registry holds
 * takes it in and replaces it: the storages in it move to the run and the
 * old mapping is unmapped, which is safe because a rank registers only
 * while its job runs no export (job.c).  Mappings of a file that no run
 * took in may overlap a run; they stay for the storages in them.  Every
 * mapping is PROT_READ.
 *
 * The steps keep a frame whole or nothing: regmap_plan and regmap_map may
 * fail and leave the registry as it was; regmap_commit cannot fail.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/idxset.h"
#include "daemon/registry.h"
#include "daemon/regmap.h"
#include "daemon/request.h"
#include "proto/fail.h"
#include "shardport.h"

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
struct regmap_frame {
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
    return sp__failf(msg, msglen, SP_EBADFD,
                     "storages[%zu] (sid %u): fstat: %s", i, rs->sid,
                     strerror(errno));
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
                      struct regmap_frame *fm, char *msg, size_t msglen) {
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
      return sp__failf(msg, msglen, SP_EBADFD,
                       "storages[%zu] (sid %u): the descriptor is not a memfd "
                       "or shm file",
                       i, rs->sid);
    if ((uint64_t)f->st.st_size < rs->offset + rs->length)
      return sp__failf(msg, msglen, SP_EBADFD,
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
static void add_old_spans(const struct registry *reg, struct regmap_frame *fm,
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
 * its storages' pages, so that a trainer registering storages packed one
 * after another in one memfd, a frame each, maps it again only each time
 * their pages double (storages with gaps between them fill no such room,
 * and each frame's run replaces the last).  Whatever
 * offsets a client declares in however large a sparse file, a mapping
 * takes at most twice the address space of its storages. */
static void make_runs(struct regmap_frame *fm) {
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
static void keep_fresh(const struct registry *reg, struct regmap_frame *fm) {
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

static void unmap_runs(struct regmap_frame *fm) {
  for (size_t r = 0; r < fm->nruns; r++)
    if (fm->runs[r].addr != NULL) {
      munmap(fm->runs[r].addr, (size_t)(fm->runs[r].hi - fm->runs[r].lo));
      fm->runs[r].addr = NULL;
    }
}

/* Maps each fresh run of the frame, read-only. */
static int map_runs(struct regmap_frame *fm, const struct sp_frame *frame,
                    char *msg, size_t msglen) {
  for (size_t r = 0; r < fm->nruns; r++) {
    struct page_span *run = &fm->runs[r];
    if (run->hi - run->lo > SIZE_MAX) {
      unmap_runs(fm);
      return sp__failf(msg, msglen, SP_EBADFD,
                       "bytes %llu to %llu of the file of descriptor %u are "
                       "too many to map",
                       (unsigned long long)run->lo, (unsigned long long)run->hi,
                       run->fd);
    }
    void *p = mmap(NULL, (size_t)(run->hi - run->lo), PROT_READ, MAP_SHARED,
                   frame->fds[run->fd], (off_t)run->lo);
    if (p == MAP_FAILED) {
      int err = errno;
      unmap_runs(fm);
      return sp__failf(msg, msglen, err == ENOMEM ? SP_ENOMEM : SP_EBADFD,
                       "cannot map bytes %llu to %llu of the file of "
                       "descriptor %u read-only: %s",
                       (unsigned long long)run->lo, (unsigned long long)run->hi,
                       run->fd, strerror(err));
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
static void append_runs(struct registry *reg, struct regmap_frame *fm) {
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
static void drop_absorbed(struct registry *reg, struct regmap_frame *fm,
                          size_t old) {
  for (size_t i = 0; i < reg->nstorages; i++) {
    struct xfer_storage *st = &reg->info[i];
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
static void commit_maps(struct registry *reg, struct regmap_frame *fm,
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

int regmap_plan(const struct registry *reg, const struct req_storage *s,
                size_t n, const struct sp_frame *frame,
                struct regmap_frame **out, char *msg, size_t msglen) {
  struct regmap_frame *fm = calloc(1, sizeof *fm);
  *out = fm;
  if (fm == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  /* The new spans and the registry's mappings, then as many runs. */
  size_t spans = n + reg->nmaps + 1;
  fm->spans = malloc(2 * spans * sizeof *fm->spans);
  fm->map_of = malloc((n + 1) * sizeof *fm->map_of);
  fm->absorbed = malloc(spans * sizeof *fm->absorbed);
  fm->index = malloc(spans * sizeof *fm->index);
  if (fm->spans == NULL || fm->map_of == NULL || fm->absorbed == NULL ||
      fm->index == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  int rc = plan_files(reg, s, n, frame, fm, msg, msglen);
  if (rc != 0)
    return rc;
  add_old_spans(reg, fm, frame->nfds);
  make_runs(fm);
  keep_fresh(reg, fm);
  return 0;
}

void regmap_usage(const struct regmap_frame *fm, struct reg_usage *more,
                  struct reg_usage *less) {
  *more = fm->more;
  *less = fm->less;
}

int regmap_map(struct regmap_frame *fm, const struct sp_frame *frame,
               char *msg, size_t msglen) {
  return map_runs(fm, frame, msg, msglen);
}

void regmap_commit(struct registry *reg, struct regmap_frame *fm,
                   const struct req_storage *s, size_t n) {
  commit_maps(reg, fm, s, n);
}

uint32_t regmap_map_of(const struct regmap_frame *fm, size_t i) {
  return fm->map_of[i];
}

void regmap_frame_free(struct regmap_frame *fm) {
  if (fm == NULL)
    return;
  free(fm->spans);
  free(fm->map_of);
  free(fm->absorbed);
  free(fm->index);
  free(fm);
}
