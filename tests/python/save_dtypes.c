/*
 * save_dtypes.c - every dtype safetensors names, saved through the C
 * library, for test_save_dtypes.py to read back with its own reader
 * (PyTorch 1.13 has no uint16/32/64 nor float8 tensors to save them from
 * Python).
 *
 *   save-dtypes SOCKET DIR
 *
 * Two forked ranks hold the uneven dim-0 shards (rows 0-1 and 2-4) of one
 * [5, 3] key per dtype, named "t.<dtype>", in one memfd each, and save
 * them into DIR.  Byte b of key k's whole tensor is
 * (k * 31 + b * 7) & 0xff, 0 or 1 for bool (test_save_dtypes.py computes
 * the same).  Exits 0 once both ranks saved.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shardport.h"

#define WORLD 2
#define ROWS 5
#define COLS 3

static const struct {
  const char *name;
  size_t size;
} dtypes[] = {{"bool", 1},    {"uint8", 1},         {"int8", 1},
              {"int16", 2},   {"uint16", 2},        {"float16", 2},
              {"bfloat16", 2}, {"int32", 4},        {"uint32", 4},
              {"float32", 4}, {"float64", 8},       {"int64", 8},
              {"uint64", 8},  {"float8_e4m3fn", 1}, {"float8_e5m2", 1}};
#define NKEYS (sizeof dtypes / sizeof dtypes[0])

static unsigned char byte_of(size_t key, size_t b) {
  unsigned char v = (unsigned char)((key * 31 + b * 7) & 0xff);
  return strcmp(dtypes[key].name, "bool") == 0 ? (unsigned char)(v & 1) : v;
}

static int fail(const char *what, sp_client *c, int rc) {
  fprintf(stderr, "save-dtypes: %s: %s: %s\n", what, sp_strerror(rc),
          c ? sp_last_message(c) : "");
  return 1;
}

static int rank_main(uint32_t rank, const char *sock, const sp_ticket *t,
                     const char *dir) {
  int64_t first = rank == 0 ? 0 : 2, rows = rank == 0 ? 2 : 3;
  size_t len = 0, offset[NKEYS];
  for (size_t k = 0; k < NKEYS; k++) {
    /* Each key at an offset in elements of its own dtype. */
    len = (len + dtypes[k].size - 1) / dtypes[k].size * dtypes[k].size;
    offset[k] = len;
    len += (size_t)rows * COLS * dtypes[k].size;
  }
  int fd = memfd_create("save-dtypes", MFD_CLOEXEC);
  unsigned char *mem = MAP_FAILED;
  if (fd < 0 || ftruncate(fd, (off_t)len) != 0 ||
      (mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
          MAP_FAILED)
    return fail("memfd", NULL, SP_ENOMEM);
  for (size_t k = 0; k < NKEYS; k++) {
    size_t skip = (size_t)first * COLS * dtypes[k].size;
    for (size_t b = 0; b < (size_t)rows * COLS * dtypes[k].size; b++)
      mem[offset[k] + b] = byte_of(k, skip + b);
  }
  sp_client *c = NULL;
  int rc = sp_connect(sock, &c);
  if (rc == 0)
    rc = sp_job_join(c, t, rank, WORLD, "cpu");
  if (rc != 0)
    return fail("join", c, rc);
  sp_storage_desc s = {.id = 1, .fd = fd, .length = len, .addr = mem};
  sp_tensor_desc td[NKEYS];
  char names[NKEYS][32];
  for (size_t k = 0; k < NKEYS; k++) {
    snprintf(names[k], sizeof names[k], "t.%s", dtypes[k].name);
    td[k] = (sp_tensor_desc){.key = names[k],
                             .storage = 1,
                             .dtype = dtypes[k].name,
                             .ndim = 2,
                             .shape = {rows, COLS},
                             .stride = {COLS, 1},
                             .offset = (int64_t)(offset[k] / dtypes[k].size),
                             .placement = SP_PLACEMENT_SHARD0,
                             .global_ndim = 2,
                             .global_shape = {ROWS, COLS}};
  }
  if ((rc = sp_register_storages(c, &s, 1)) != 0 ||
      (rc = sp_register_tensors(c, td, NKEYS)) != 0)
    return fail("register", c, rc);
  /* A limit of 24 bytes: the files split by size as well as by owner. */
  sp_save_opts o = {.max_shard_bytes = 24,
                    .export_opts = {.timeout_ms = 60000}};
  if ((rc = sp_save(c, dir, &o, NULL)) != 0)
    return fail("save", c, rc);
  sp_job_leave(c);
  sp_close(c);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: save-dtypes SOCKET DIR\n");
    return 2;
  }
  sp_client *c = NULL;
  sp_ticket t;
  int rc = sp_connect(argv[1], &c);
  if (rc == 0)
    rc = sp_job_create(c, WORLD, &t);
  if (rc != 0)
    return fail("create", c, rc);
  pid_t pid[WORLD];
  for (uint32_t r = 0; r < WORLD; r++)
    if ((pid[r] = fork()) == 0)
      _exit(rank_main(r, argv[1], &t, argv[2]));
  int failed = 0;
  for (uint32_t r = 0; r < WORLD; r++) {
    int st;
    waitpid(pid[r], &st, 0);
    failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  sp_close(c);
  return failed;
}
