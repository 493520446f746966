/*
 * simranks.c - the scale simulation's ranks as threads; see simranks.h.
 */
#include "tests/scale/simranks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "tests/integration/model.h"

#define ELEMENT_BYTES 4
#define KEY_NAME_MAX 16
/* A thousand threads each need little stack: the client's calls keep
 * their buffers on the heap. */
#define RANK_STACK_BYTES (512u << 10)
#define TICKET_WAIT_MS 60000

double sim_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void key_name(uint32_t k, char name[KEY_NAME_MAX]) {
  snprintf(name, KEY_NAME_MAX, "k%05u", k);
}

struct rank_arg {
  struct sim_job *j;
  uint32_t r;
};

/* What one rank holds between its calls. */
struct rank_state {
  sp_client *c;
  int fd;
  uint8_t *mem;
  size_t len;
};

static void note_failure(struct sim_rank *rk, const char *what,
                         const char *detail) {
  if (rk->failure[0] == '\0')
    snprintf(rk->failure, sizeof rk->failure, "%s: %s", what, detail);
}

/* Fills the rank's row of every key and registers it as one storage and
 * nkeys views: 0 or the failing call's code. */
static int register_rows(struct sim_job *j, uint32_t r, struct rank_state *s) {
  size_t row = (size_t)j->cols * ELEMENT_BYTES;
  s->len = (size_t)j->nkeys * row;
  s->fd = memfd_create("simrank", MFD_CLOEXEC);
  if (s->fd < 0 || ftruncate(s->fd, (off_t)s->len) != 0)
    return SP_EIO;
  s->mem = mmap(NULL, s->len, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  if (s->mem == MAP_FAILED) {
    s->mem = NULL;
    return SP_EIO;
  }
  sp_tensor_desc *t = calloc(j->nkeys, sizeof *t);
  char(*names)[KEY_NAME_MAX] = calloc(j->nkeys, sizeof *names);
  int rc = SP_ENOMEM;
  if (t == NULL || names == NULL)
    goto out;
  for (uint32_t k = 0; k < j->nkeys; k++) {
    key_name(k, names[k]);
    for (uint32_t col = 0; col < j->cols; col++)
      model_element(names[k], (uint64_t)r * j->cols + col, ELEMENT_BYTES,
                    s->mem + k * row + col * ELEMENT_BYTES);
    t[k] = (sp_tensor_desc){.key = names[k], .storage = 1, .dtype = "float32",
                            .ndim = 2, .shape = {1, j->cols},
                            .stride = {j->cols, 1},
                            .offset = (int64_t)k * j->cols,
                            .placement = SP_PLACEMENT_SHARD0, .global_ndim = 2,
                            .global_shape = {j->world, j->cols}};
  }
  sp_storage_desc st = {.id = 1, .fd = s->fd, .length = s->len,
                        .addr = s->mem};
  rc = sp_register_storages(s->c, &st, 1);
  if (rc == 0)
    rc = sp_register_tensors(s->c, t, j->nkeys);
out:
  free(t);
  free(names);
  return rc;
}

static int setup(struct sim_job *j, uint32_t r, struct rank_state *s) {
  int rc = sp_connect(j->sockets[r / j->per_node], &s->c);
  if (rc < 0)
    return rc;
  if (r == 0) {
    if ((rc = sp_job_create(s->c, j->world, &j->ticket)) < 0)
      return rc;
    atomic_store(&j->ticket_ready, true);
  } else {
    for (int waited = 0; !atomic_load(&j->ticket_ready); waited++) {
      if (waited > TICKET_WAIT_MS)
        return SP_ETIMEOUT;
      usleep(1000);
    }
  }
  if ((rc = sp_job_join(s->c, &j->ticket, r, j->world, "cpu")) < 0)
    return rc;
  return register_rows(j, r, s);
}

/* Every owned key is whole and equal to the original, byte for byte. */
static bool check_owned(struct sim_job *j, struct sim_rank *rk,
                        const sp_owned_set *set) {
  for (size_t i = 0; i < set->ntensors; i++) {
    const sp_owned_tensor *t = &set->tensors[i];
    unsigned k;
    if (sscanf(t->key, "k%u", &k) != 1 || k >= j->nkeys || t->ndim != 2 ||
        t->shape[0] != j->world || t->shape[1] != j->cols ||
        t->data == NULL || strcmp(t->dtype, "float32") != 0) {
      note_failure(rk, t->key, "not the shape, dtype or key registered");
      return false;
    }
    atomic_fetch_add(&j->owners[k], 1);
    const uint8_t *data = t->data;
    for (uint32_t row = 0; row < j->world; row++)
      for (uint32_t col = 0; col < j->cols; col++) {
        uint8_t want[ELEMENT_BYTES];
        model_element(t->key, (uint64_t)row * j->cols + col, ELEMENT_BYTES,
                      want);
        const uint8_t *got =
            data + (t->stride[0] * row + t->stride[1] * col) * ELEMENT_BYTES;
        if (memcmp(got, want, ELEMENT_BYTES) != 0) {
          note_failure(rk, t->key, "an element differs from the original");
          return false;
        }
      }
  }
  return true;
}

struct progress_arg {
  struct sim_rank *rk;
  uint32_t e;
};

static void on_progress(const sp_progress *p, void *arg) {
  struct progress_arg *a = arg;
  if (a->rk->first_round_s[a->e] == 0 && strcmp(p->phase, "moving") == 0)
    a->rk->first_round_s[a->e] = sim_now_s();
}

static void export_once(struct sim_job *j, struct sim_rank *rk,
                        struct rank_state *s, uint32_t e) {
  struct progress_arg pa = {rk, e};
  sp_export_opts eo = {.timeout_ms = j->timeout_ms,
                       .progress = on_progress,
                       .progress_arg = &pa};
  sp_owned_set *set = NULL;
  rk->asked_s[e] = sim_now_s();
  rk->export_rc[e] = sp_export(s->c, &eo, &set);
  if (rk->export_rc[e] != 0) {
    note_failure(rk, "sp_export", sp_last_message(s->c));
    return;
  }
  if (!check_owned(j, rk, set))
    rk->export_rc[e] = SP_EINVAL;
  int rc = sp_release(s->c, set);
  if (rc != 0 && rk->export_rc[e] == 0) {
    rk->export_rc[e] = rc;
    note_failure(rk, "sp_release", sp_last_message(s->c));
  }
}

static void *rank_main(void *arg) {
  struct rank_arg *a = arg;
  struct sim_job *j = a->j;
  struct sim_rank *rk = &j->rank[a->r];
  struct rank_state s = {.fd = -1};
  rk->setup_rc = setup(j, a->r, &s);
  if (rk->setup_rc != 0)
    note_failure(rk, "setup", s.c != NULL ? sp_last_message(s.c)
                                          : sp_strerror(rk->setup_rc));
  pthread_barrier_wait(&j->gate);
  for (uint32_t e = 0; e < j->exports; e++) {
    pthread_barrier_wait(&j->gate);
    if (rk->setup_rc == 0)
      export_once(j, rk, &s, e);
    else
      rk->export_rc[e] = rk->setup_rc;
    pthread_barrier_wait(&j->gate);
  }
  sp_close(s.c);
  if (s.mem != NULL)
    munmap(s.mem, s.len);
  if (s.fd >= 0)
    close(s.fd);
  free(a);
  return NULL;
}

int sim_start(struct sim_job *j) {
  j->world = j->nodes * j->per_node;
  j->rank = calloc(j->world, sizeof *j->rank);
  j->owners = calloc(j->nkeys, sizeof *j->owners);
  if (j->rank == NULL || j->owners == NULL ||
      pthread_barrier_init(&j->gate, NULL, j->world + 1) != 0)
    return -1;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, RANK_STACK_BYTES);
  for (uint32_t r = 0; r < j->world; r++) {
    struct rank_arg *a = malloc(sizeof *a);
    if (a == NULL)
      abort();
    *a = (struct rank_arg){j, r};
    /* A rank that cannot start would leave the others at the barrier:
     * nothing to report then but the failure itself. */
    if (pthread_create(&j->rank[r].thread, &attr, rank_main, a) != 0) {
      fprintf(stderr, "scale-sim: cannot start rank %u's thread\n", r);
      abort();
    }
  }
  pthread_attr_destroy(&attr);
  pthread_barrier_wait(&j->gate);
  return 0;
}

void sim_export(struct sim_job *j) {
  for (uint32_t k = 0; k < j->nkeys; k++)
    atomic_store(&j->owners[k], 0);
  pthread_barrier_wait(&j->gate);
  pthread_barrier_wait(&j->gate);
}

void sim_finish(struct sim_job *j) {
  for (uint32_t r = 0; r < j->world; r++)
    pthread_join(j->rank[r].thread, NULL);
  pthread_barrier_destroy(&j->gate);
  free(j->rank);
  free((void *)j->owners);
}
