/*
 * loadprobe.c - a second client's ping latency, and large registrations;
 * see loadprobe.h.
 */
#include "tests/integration/loadprobe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/integration/harness.h"

uint64_t sp_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int keep(struct sp_prober *p, uint64_t sent, uint64_t took) {
  if (p->npings == p->cap) {
    size_t cap = p->cap > 0 ? 2 * p->cap : 4096;
    struct sp_ping *more = realloc(p->pings, cap * sizeof *more);
    if (more == NULL)
      return SP_ENOMEM;
    p->pings = more;
    p->cap = cap;
  }
  p->pings[p->npings++] = (struct sp_ping){sent, took};
  return 0;
}

static void *ping_loop(void *arg) {
  struct sp_prober *p = arg;
  int sock = sp_test_connect_hello(p->socket);
  if (sock < 0) {
    p->failed = sock;
    atomic_store(&p->started, true);
    return NULL;
  }
  for (uint64_t id = 1; !atomic_load(&p->stop); id++) {
    uint64_t t0 = sp_now_ns();
    int rc = sp_test_ping(sock, id);
    if (rc == 0)
      rc = keep(p, t0, sp_now_ns() - t0);
    if (rc != 0) {
      p->failed = rc;
      break;
    }
    atomic_store(&p->started, true);
  }
  atomic_store(&p->started, true);
  close(sock);
  return NULL;
}

void sp_prober_start(struct sp_prober *p, const char *socket) {
  memset(p, 0, sizeof *p);
  snprintf(p->socket, sizeof p->socket, "%s", socket);
  if (pthread_create(&p->thread, NULL, ping_loop, p) != 0) {
    p->failed = SP_ENOMEM;
    return;
  }
  while (!atomic_load(&p->started))
    usleep(1000);
}

int sp_prober_stop(struct sp_prober *p) {
  atomic_store(&p->stop, true);
  pthread_join(p->thread, NULL);
  return p->failed;
}

static int u64_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

struct sp_ping_stats sp_prober_window(const struct sp_prober *p,
                                      uint64_t from_ns, uint64_t to_ns) {
  struct sp_ping_stats s = {0};
  uint64_t *took = malloc((p->npings > 0 ? p->npings : 1) * sizeof *took);
  if (took == NULL)
    return s;
  for (size_t i = 0; i < p->npings; i++) {
    const struct sp_ping *g = &p->pings[i];
    if (g->sent_ns <= to_ns && g->sent_ns + g->took_ns >= from_ns)
      took[s.count++] = g->took_ns;
  }
  if (s.count > 0) {
    qsort(took, s.count, sizeof *took, u64_cmp);
    s.p50_ns = took[s.count / 2];
    s.p99_ns = took[s.count * 99 / 100];
    s.max_ns = took[s.count - 1];
  }
  free(took);
  return s;
}

void sp_prober_free(struct sp_prober *p) {
  free(p->pings);
  p->pings = NULL;
  p->npings = p->cap = 0;
}

void sp_pack_many_storages(struct sp_msgbuf *mb, uint64_t id, uint32_t first,
                           size_t n, uint64_t length) {
  sp__msgbuf_begin(mb, "storage_add", id, 1);
  sp__pack_str(&mb->pk, "storages");
  msgpack_pack_array(&mb->pk, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    msgpack_pack_map(&mb->pk, 6);
    sp__pack_kv_u64(&mb->pk, "sid", first + i);
    sp__pack_kv_str(&mb->pk, "kind", "memfd");
    sp__pack_kv_u64(&mb->pk, "fd", 0);
    sp__pack_kv_u64(&mb->pk, "offset", i * length);
    sp__pack_kv_u64(&mb->pk, "length", length);
    sp__pack_kv_u64(&mb->pk, "base", 0x10000000 + (first + i) * (length + 1));
  }
}

static void pack_dims(msgpack_packer *pk, const char *key, int64_t dim) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, 1);
  msgpack_pack_int64(pk, dim);
}

void sp_pack_many_tensors(struct sp_msgbuf *mb, uint64_t id, uint32_t first,
                          size_t n, uint64_t length) {
  sp__msgbuf_begin(mb, "tensor_add", id, 1);
  sp__pack_str(&mb->pk, "tensors");
  msgpack_pack_array(&mb->pk, (uint32_t)n);
  int64_t elems = (int64_t)(length / 4);
  for (size_t i = 0; i < n; i++) {
    char key[32];
    snprintf(key, sizeof key, "t%zu", first + i);
    msgpack_pack_map(&mb->pk, 8);
    sp__pack_kv_str(&mb->pk, "key", key);
    sp__pack_kv_u64(&mb->pk, "sid", first + i);
    sp__pack_kv_str(&mb->pk, "dtype", "float32");
    pack_dims(&mb->pk, "shape", elems);
    pack_dims(&mb->pk, "stride", 1);
    sp__pack_kv_u64(&mb->pk, "offset", 0);
    sp__pack_kv_str(&mb->pk, "placement", "replicated");
    pack_dims(&mb->pk, "global_shape", elems);
  }
}
