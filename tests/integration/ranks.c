/*
 * ranks.c - a job's ranks as threads of the test process; see ranks.h.
 */
#include "tests/integration/ranks.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define COLS 4
/* How long the test waits for a rank to reach a point. */
#define RANKS_WAIT_MS 20000

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static float element(uint32_t key, int64_t row, int64_t col) {
  return (float)key * 1000.0f + (float)row * 10.0f + (float)col;
}

struct rank_arg {
  struct ranks_job *j;
  uint32_t r;
};

static void on_progress(const sp_progress *p, void *arg) {
  struct ranks_rank *rk = arg;
  atomic_store(&rk->asked, true);
  if (strcmp(p->phase, "moving") == 0)
    atomic_store(&rk->moving, true);
}

/* Checks every owned key's rows against the original. */
static bool check_owned(const struct ranks_job *j, const sp_owned_set *set,
                        uint32_t *owned) {
  *owned = (uint32_t)set->ntensors;
  for (size_t i = 0; i < set->ntensors; i++) {
    const sp_owned_tensor *t = &set->tensors[i];
    unsigned key;
    if (sscanf(t->key, "k%u", &key) != 1 || t->ndim != 2 ||
        t->shape[0] != j->world || t->shape[1] != COLS || t->data == NULL)
      return false;
    const float *f = t->data;
    for (int64_t row = 0; row < j->world; row++)
      for (int64_t col = 0; col < COLS; col++)
        if (f[row * t->stride[0] + col * t->stride[1]] !=
            element(key, row, col))
          return false;
  }
  return true;
}

/* Connects, joins and registers: 0 or the failing call's code. */
static int setup(struct ranks_job *j, uint32_t r, sp_client **c, int *fd,
                 float **mem, size_t *len) {
  int rc = sp_connect(j->socket, c);
  if (rc < 0)
    return rc;
  if (r == 0) {
    if ((rc = sp_job_create(*c, j->world, &j->ticket)) < 0)
      return rc;
    atomic_store(&j->ticket_ready, true);
  } else {
    for (int waited = 0; !atomic_load(&j->ticket_ready); waited += 5) {
      if (waited > RANKS_WAIT_MS)
        return SP_ETIMEOUT;
      sleep_ms(5);
    }
  }
  if ((rc = sp_job_join(*c, &j->ticket, r, j->world, "cpu")) < 0)
    return rc;
  *len = (size_t)j->nkeys * COLS * sizeof(float);
  *fd = memfd_create("rank", MFD_CLOEXEC);
  if (*fd < 0 || ftruncate(*fd, (off_t)*len) != 0)
    return SP_EIO;
  *mem = mmap(NULL, *len, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (*mem == MAP_FAILED) {
    *mem = NULL;
    return SP_EIO;
  }
  for (uint32_t k = 0; k < j->nkeys; k++)
    for (int64_t col = 0; col < COLS; col++)
      (*mem)[k * COLS + col] = element(k, r, col);
  sp_storage_desc st = {.id = 1, .fd = *fd, .length = *len, .addr = *mem};
  if ((rc = sp_register_storages(*c, &st, 1)) < 0)
    return rc;
  sp_tensor_desc *t = calloc(j->nkeys, sizeof *t);
  char(*names)[16] = calloc(j->nkeys, sizeof *names);
  if (t == NULL || names == NULL) {
    free(t);
    free(names);
    return SP_ENOMEM;
  }
  for (uint32_t k = 0; k < j->nkeys; k++) {
    snprintf(names[k], sizeof names[k], "k%03u", k);
    t[k] = (sp_tensor_desc){.key = names[k], .storage = 1, .dtype = "float32",
                            .ndim = 2, .shape = {1, COLS}, .stride = {COLS, 1},
                            .offset = (int64_t)k * COLS,
                            .placement = SP_PLACEMENT_SHARD0, .global_ndim = 2,
                            .global_shape = {j->world, COLS}};
  }
  rc = sp_register_tensors(*c, t, j->nkeys);
  free(t);
  free(names);
  return rc;
}

static void *rank_main(void *arg) {
  struct rank_arg *a = arg;
  struct ranks_job *j = a->j;
  struct ranks_rank *rk = &j->rank[a->r];
  sp_client *c = NULL;
  int fd = -1;
  float *mem = NULL;
  size_t len = 0;
  rk->setup_rc = setup(j, a->r, &c, &fd, &mem, &len);
  atomic_fetch_add(&j->ready, 1);
  if (rk->setup_rc == 0 && rk->asks) {
    sp_export_opts eo = {.max_keys = j->max_keys,
                         .timeout_ms = j->timeout_ms ? j->timeout_ms : 10000,
                         .progress = on_progress,
                         .progress_arg = rk};
    sp_owned_set *set = NULL;
    rk->export_rc = sp_export(c, &eo, &set);
    snprintf(rk->export_message, sizeof rk->export_message, "%s",
             sp_last_message(c));
    if (rk->export_rc == 0) {
      rk->data_ok = check_owned(j, set, &rk->owned);
      rk->release_rc = sp_release(c, set);
    }
    atomic_store(&rk->exported, true);
  }
  for (int waited = 0; !atomic_load(&j->go_on) && waited < 2 * RANKS_WAIT_MS;
       waited += 5)
    sleep_ms(5);
  if (c != NULL) {
    rk->last_rc = sp_ping(c, NULL);
    snprintf(rk->last_message, sizeof rk->last_message, "%s",
             sp_last_message(c));
  }
  sp_close(c);
  if (mem != NULL)
    munmap(mem, len);
  if (fd >= 0)
    close(fd);
  free(a);
  return NULL;
}

void ranks_start(struct ranks_job *j) {
  ck_assert_uint_le(j->world, RANKS_MAX);
  for (uint32_t r = 0; r < j->world; r++) {
    j->rank[r].export_rc = 1;
    struct rank_arg *a = malloc(sizeof *a);
    ck_assert_ptr_nonnull(a);
    *a = (struct rank_arg){j, r};
    ck_assert_int_eq(pthread_create(&j->rank[r].thread, NULL, rank_main, a),
                     0);
  }
  for (int waited = 0; atomic_load(&j->ready) < j->world; waited += 5) {
    ck_assert_msg(waited < RANKS_WAIT_MS, "the ranks did not register");
    sleep_ms(5);
  }
  for (uint32_t r = 0; r < j->world; r++)
    ck_assert_msg(j->rank[r].setup_rc == 0, "rank %u: setup: %s", r,
                  sp_strerror(j->rank[r].setup_rc));
}

static void wait_flag(_Atomic bool *flag, const char *what, uint32_t r) {
  for (int waited = 0; !atomic_load(flag); waited += 5) {
    ck_assert_msg(waited < RANKS_WAIT_MS, "rank %u: %s did not come", r,
                  what);
    sleep_ms(5);
  }
}

void ranks_wait_asked(struct ranks_job *j, uint32_t r) {
  wait_flag(&j->rank[r].asked, "its first progress frame", r);
}

void ranks_wait_moving(struct ranks_job *j, uint32_t r) {
  wait_flag(&j->rank[r].moving, "the moving phase", r);
}

void ranks_wait_exported(struct ranks_job *j) {
  for (uint32_t r = 0; r < j->world; r++)
    if (j->rank[r].asks)
      wait_flag(&j->rank[r].exported, "the end of sp_export", r);
}

void ranks_finish(struct ranks_job *j) {
  atomic_store(&j->go_on, true);
  for (uint32_t r = 0; r < j->world; r++)
    pthread_join(j->rank[r].thread, NULL);
}
