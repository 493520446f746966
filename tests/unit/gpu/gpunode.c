/*
 * gpunode.c - one "node" of a multi-node GPU export, for test_gpu_comm.c:
 * the CUDA backend's data plane (daemon/cuda/) driven directly, without
 * the control plane between daemons.
 *
 *   gpunode NCCL_ID_HEX NODES NODE [EXPORTS]
 *
 * Every node builds the same job (tests/unit/plan/tjob.c): NODES nodes of
 * G ranks (GPUNODE_GPUS, default 2), rank r on node r / G and on its local
 * GPU r % G, shard0 keys of several dtypes and affine column
 * splits, cut into rounds of two keys, and plans it (the planner is pure,
 * so every node gets the same plan).  It then does what a daemon does for
 * its local ranks: their storages in (fake) device memory holding a
 * deterministic original, the owners' segments, one communicator per local
 * rank created in one group and warmed, and gpu_engine_run, EXPORTS times
 * with the same communicators; after each, every tensor a local rank owns
 * is read back and compared with the original byte for byte.
 *
 * Prints "ok EXPORT KEYS" per export, or "fail ..." (exit 1) when a byte
 * differs, or "error CODE: MESSAGE" (exit 2) when the backend failed: what
 * the fault tests expect of a survivor.  On the fakes SHARDPORT_FAKE_NODE
 * must equal NODE (the parent sets it); GPUNODE_TIMEOUT_MS bounds every
 * wait.  NCCL_ID_HEX "-" makes the id here and prints "id HEX" first (real
 * NCCL serves the id's rendezvous from the process that made it, so the
 * GPU script lets node 0 make it).  GPUNODE_SELF=1 adds, once the
 * communicators are warm, a round of sends of every local rank to itself,
 * checked byte for byte ("self ok").  GPUNODE_ID2=HEX runs a second job of
 * the same ranks at the same time, on its own communicators (made from
 * that id; "-" makes it here and prints "id2 HEX" after "id HEX") and
 * segments, each job's exports on a thread of its own, as
 * two jobs' engines run in a daemon; the first job exports 2 * EXPORTS
 * times, and each job frees its segments once its exports are over.  GPUNODE_MEMCHECK=1 fails ("fail ...")
 * when the exports took device memory that cudaMemGetInfo counts beyond
 * what the warmed communicators had taken.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cuda/internal.h"
#include "daemon/plan/plan.h"
#include "daemon/publish.h"
#include "daemon/registry.h"
#include "shardport.h"
#include "tests/unit/plan/tjob.h"

#define MAX_WORLD 16

static uint32_t GPUS_PER_NODE = 2;

struct skey {
  const char *name;
  enum sp_dtype dtype;
  uint32_t ndim;
  int64_t shape[2];
  bool affine; /* columns split; else rows (shard0) */
};

static const struct skey keys[] = {
    {"a.f32", SP_DTYPE_FLOAT32, 2, {12, 5}, false},
    {"b.bf16", SP_DTYPE_BFLOAT16, 1, {9, 0}, false},
    {"c.cols", SP_DTYPE_FLOAT32, 2, {4, 10}, true},
    {"d.fp8", SP_DTYPE_FLOAT8_E4M3FN, 2, {7, 3}, false},
    {"e.i64", SP_DTYPE_INT64, 2, {16, 4}, false},
    {"f.cols16", SP_DTYPE_INT16, 2, {6, 13}, true},
    {"g.big", SP_DTYPE_FLOAT32, 2, {300, 129}, false},
};
#define NKEYS (sizeof keys / sizeof keys[0])

static uint64_t mix(uint64_t x) {
  x += UINT64_C(0x9e3779b97f4a7c15);
  x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
  return x ^ (x >> 31);
}

/* Element i of key k's original. */
static void element(size_t k, uint64_t i, uint8_t *out) {
  uint64_t v = mix(((uint64_t)k << 40) + i);
  memcpy(out, &v, sp__dtype_size(keys[k].dtype));
}

/* How many of n rows or columns rank r holds: uneven, and rank 1 none
 * when there are more than two ranks. */
static int64_t part(int64_t n, uint32_t world, uint32_t r) {
  bool skip1 = world > 2;
  if (r == 1 && skip1)
    return 0;
  uint64_t w = 0, mine = 0;
  for (uint32_t q = 0; q < world; q++)
    if (q != 1 || !skip1) {
      w += q + 1;
      if (q < r)
        mine += q + 1;
    }
  return (int64_t)((uint64_t)n * (mine + r + 1) / w - (uint64_t)n * mine / w);
}

static int64_t before(int64_t n, uint32_t world, uint32_t r) {
  int64_t s = 0;
  for (uint32_t q = 0; q < r; q++)
    s += part(n, world, q);
  return s;
}

static struct affine_piece pieces[NKEYS][MAX_WORLD];
static uint32_t holders[MAX_WORLD];

static struct tjob *build_job(uint32_t world) {
  struct tjob *job = tjob_new(world);
  for (uint32_t r = 0; r < world; r++) {
    tjob_node(job, r, r / GPUS_PER_NODE);
    holders[r] = r;
  }
  for (size_t k = 0; k < NKEYS; k++) {
    const struct skey *s = &keys[k];
    if (!s->affine) {
      int64_t rows[MAX_WORLD];
      for (uint32_t r = 0; r < world; r++)
        rows[r] = part(s->shape[0], world, r);
      tjob_shard0(job, s->name, s->dtype, s->ndim, s->shape, rows);
      continue;
    }
    uint64_t numel[MAX_WORLD];
    const struct affine_piece *pp[MAX_WORLD];
    size_t np[MAX_WORLD];
    for (uint32_t r = 0; r < world; r++) {
      int64_t w = part(s->shape[1], world, r);
      numel[r] = (uint64_t)(s->shape[0] * w);
      pieces[k][r] = (struct affine_piece){
          .ndim = 2, .shape = {s->shape[0], w}, .src_stride = {w, 1},
          .dst_offset = before(s->shape[1], world, r),
          .dst_stride = {s->shape[1], 1}, .nholders = 1,
          .holders = &holders[r]};
      pp[r] = &pieces[k][r];
      np[r] = w > 0 ? 1 : 0;
    }
    tjob_affine(job, s->name, s->dtype, s->ndim, s->shape, numel, pp, np);
  }
  /* GPU storages, told apart by (device, base) as a daemon would. */
  for (uint32_t r = 0; r < world; r++)
    for (size_t k = 0; k < NKEYS; k++) {
      tjob_key(job, r, keys[k].name)->device_type = SP_DEVICE_CUDA;
      struct sp_storage *st = tjob_storage(job, r, keys[k].name);
      st->device.type = SP_DEVICE_CUDA;
      st->device.index = (int32_t)(r % GPUS_PER_NODE);
    }
  tjob_limits(job, 2, 0);
  return job;
}

/* Rank r's holding of key k as the original's bytes. */
static void fill(size_t k, uint32_t world, uint32_t r, uint8_t *out,
                 uint64_t nbytes) {
  const struct skey *s = &keys[k];
  size_t es = sp__dtype_size(s->dtype);
  memset(out, 0, nbytes);
  int64_t cols = s->ndim == 2 ? s->shape[1] : 1;
  if (!s->affine) {
    uint64_t first = (uint64_t)(before(s->shape[0], world, r) * cols);
    for (uint64_t i = 0; i < nbytes / es; i++)
      element(k, first + i, out + i * es);
    return;
  }
  int64_t w = part(s->shape[1], world, r), c0 = before(s->shape[1], world, r);
  for (int64_t y = 0; y < s->shape[0]; y++)
    for (int64_t x = 0; x < w; x++)
      element(k, (uint64_t)(y * cols + c0 + x), out + (size_t)(y * w + x) * es);
}

/* Every local rank sends 1 MiB to itself and receives it, in one group. */
static int self_round(struct gpu *gpu, struct gpu_comms *comms,
                      const struct gpu_comm_rank *local, size_t nlocal) {
  const struct cuda_api *a = &gpu->api;
  enum { N = 1 << 20 };
  uint8_t *send[MAX_WORLD] = {0}, *recv[MAX_WORLD] = {0};
  uint8_t *host = malloc(N);
  int rc = host == NULL ? -1 : 0;
  for (size_t i = 0; i < nlocal && rc == 0; i++) {
    a->cudaSetDevice(local[i].device);
    if (a->cudaMalloc((void **)&send[i], N) != cudaSuccess ||
        a->cudaMalloc((void **)&recv[i], N) != cudaSuccess ||
        a->cudaMemsetAsync(send[i], 0x40 + (int)i, N,
                           gpu_comms_stream(comms, i)) != cudaSuccess ||
        a->cudaMemsetAsync(recv[i], 0, N, gpu_comms_stream(comms, i)) !=
            cudaSuccess)
      rc = -1;
  }
  if (rc == 0) {
    a->ncclGroupStart();
    for (size_t i = 0; i < nlocal; i++) {
      a->cudaSetDevice(local[i].device);
      a->ncclSend(send[i], N, ncclUint8, (int)local[i].rank,
                  gpu_comms_comm(comms, i), gpu_comms_stream(comms, i));
      a->ncclRecv(recv[i], N, ncclUint8, (int)local[i].rank,
                  gpu_comms_comm(comms, i), gpu_comms_stream(comms, i));
    }
    ncclResult_t res = a->ncclGroupEnd();
    if (res != ncclSuccess && res != ncclInProgress)
      rc = -1;
  }
  for (size_t i = 0; i < nlocal && rc == 0; i++) {
    /* Non-blocking: the launch is enqueued once the async state settles. */
    ncclResult_t st = ncclInProgress;
    while (st == ncclInProgress)
      a->ncclCommGetAsyncError(gpu_comms_comm(comms, i), &st);
    a->cudaSetDevice(local[i].device);
    if (st != ncclSuccess ||
        a->cudaStreamSynchronize(gpu_comms_stream(comms, i)) != cudaSuccess ||
        a->cudaMemcpy2DAsync(host, N, recv[i], N, N, 1, cudaMemcpyDeviceToHost,
                             NULL) != cudaSuccess ||
        a->cudaStreamSynchronize(NULL) != cudaSuccess) {
      rc = -1;
      break;
    }
    for (size_t j = 0; j < N; j++)
      if (host[j] != (uint8_t)(0x40 + i))
        rc = -1;
  }
  for (size_t i = 0; i < nlocal; i++) {
    a->cudaSetDevice(local[i].device);
    if (send[i] != NULL)
      a->cudaFree(send[i]);
    if (recv[i] != NULL)
      a->cudaFree(recv[i]);
  }
  free(host);
  return rc;
}

static int fail(const char *fmt, const char *a, int code) {
  printf(fmt, a);
  printf("\n");
  fflush(stdout);
  return code;
}

/* One job's owners' segments and communicators on this node. */
struct job_state {
  uint8_t *dst[MAX_WORLD];
  uint64_t dst_size[MAX_WORLD];
  struct gpu_segment *segs[MAX_WORLD];
  struct gpu_comms *comms;
};

#define MAX_JOBS 2

/* What one node holds: the plan, its ranks' storages, each job's segments
 * and communicators; freed whatever happened. */
struct node_state {
  struct gpu *gpu;
  struct tjob *job;
  struct plan *plan;
  struct publish_layout layout;
  bool have_layout;
  struct xfer_storage *src[MAX_WORLD];
  size_t nsrc[MAX_WORLD];
  struct gpu_comm_rank local[MAX_WORLD];
  size_t nlocal;
  struct job_state jobs[MAX_JOBS];
  int njobs;
};

static void node_free(struct node_state *ns) {
  for (int j = 0; j < MAX_JOBS; j++) {
    gpu_comms_free(ns->jobs[j].comms);
    for (uint32_t r = 0; r < MAX_WORLD; r++)
      gpu_segment_free(ns->gpu, ns->jobs[j].segs[r]);
  }
  for (uint32_t r = 0; r < MAX_WORLD; r++) {
    for (size_t i = 0; ns->src[r] != NULL && i < ns->nsrc[r]; i++)
      /* As the daemon frees: not under NCCL work still being aborted. */
      gpu_device_free(ns->gpu, ns->src[r][i].gpu.device,
                      (void *)ns->src[r][i].gpu.data);
    free(ns->src[r]);
  }
  if (ns->have_layout)
    publish_layout_free(&ns->layout);
  plan_free(ns->plan);
  if (ns->job != NULL)
    tjob_free(ns->job);
  gpu_close(ns->gpu);
}

/* The local ranks' storages, holding the original, and segments. */
static int node_setup(struct node_state *ns, uint32_t world, uint64_t node,
                      char *msg, size_t msglen) {
  const struct plan_input *in = tjob_input(ns->job, 0, 0);
  const struct cuda_api *a = &ns->gpu->api;
  for (uint32_t r = 0; r < world; r++) {
    if (r / GPUS_PER_NODE != node)
      continue;
    int dev = (int)(r % GPUS_PER_NODE);
    ns->local[ns->nlocal++] = (struct gpu_comm_rank){.rank = r, .device = dev};
    const struct plan_rank_in *ri = NULL;
    for (size_t i = 0; i < in->nranks; i++)
      if (in->ranks[i].rank == r)
        ri = &in->ranks[i];
    ns->src[r] = calloc(ri->nstorages, sizeof *ns->src[r]);
    if (ns->src[r] == NULL)
      return -1;
    ns->nsrc[r] = ri->nstorages;
    a->cudaSetDevice(dev);
    for (size_t i = 0; i < ri->nentries; i++) {
      struct plan_key_in held;
      size_t k = 0;
      plan_input_holding(in, ri, &ri->entries[i], &held);
      while (strcmp(keys[k].name, held.name) != 0)
        k++;
      uint32_t si = held.storage;
      uint64_t n = ri->storages[si].nbytes;
      if (n == 0)
        continue;
      void *p = NULL;
      uint8_t *host = malloc(n);
      if (host == NULL || a->cudaMalloc(&p, n) != cudaSuccess) {
        free(host);
        snprintf(msg, msglen, "no device storage");
        return -1;
      }
      ns->src[r][si].gpu.data = p;
      ns->src[r][si].gpu.device = dev;
      fill(k, world, r, host, n);
      cudaError_t err = a->cudaMemcpy2DAsync(p, n, host, n, n, 1,
                                             cudaMemcpyHostToDevice, NULL);
      if (err == cudaSuccess)
        err = a->cudaStreamSynchronize(NULL);
      free(host);
      if (err != cudaSuccess) {
        snprintf(msg, msglen, "cannot fill a storage");
        return -1;
      }
    }
    for (int j = 0; j < ns->njobs; j++) {
      struct job_state *js = &ns->jobs[j];
      js->dst_size[r] = ns->layout.seg_size[r];
      if (ns->layout.seg_size[r] > 0) {
        if (gpu_segment_new(ns->gpu, dev, ns->layout.seg_size[r], &js->segs[r],
                            msg, msglen) != 0)
          return -1;
        js->dst[r] = gpu_segment_info(js->segs[r])->ptr;
      }
    }
  }
  return 0;
}

/* Every tensor a local rank owns, read back and compared: how many, or -1
 * (printed). */
static long verify(struct node_state *ns, const struct job_state *js,
                   uint64_t node) {
  const struct cuda_api *a = &ns->gpu->api;
  long verified = 0;
  for (size_t k = 0; k < ns->plan->nkeys; k++) {
    const struct plan_key *key = &ns->plan->keys[k];
    if (key->kind != PLAN_KEY_MOVE || key->owner / GPUS_PER_NODE != node)
      continue;
    size_t i = 0;
    while (strcmp(keys[i].name, key->name) != 0)
      i++;
    uint8_t *host = malloc(key->nbytes);
    a->cudaSetDevice((int)(key->owner % GPUS_PER_NODE));
    if (host == NULL ||
        a->cudaMemcpy2DAsync(host, key->nbytes,
                             js->dst[key->owner] + ns->layout.offset[k],
                             key->nbytes, key->nbytes, 1,
                             cudaMemcpyDeviceToHost, NULL) != cudaSuccess ||
        a->cudaStreamSynchronize(NULL) != cudaSuccess) {
      free(host);
      fail("fail reading %s back", key->name, 1);
      return -1;
    }
    size_t es = sp__dtype_size(key->dtype);
    uint8_t want[8];
    for (uint64_t j = 0; j < key->nbytes / es; j++) {
      element(i, j, want);
      if (memcmp(host + j * es, want, es) != 0) {
        free(host);
        fail("fail %s differs from the original", key->name, 1);
        return -1;
      }
    }
    free(host);
    verified++;
  }
  return verified;
}

/* The free device memory of each local rank's GPU (cudaMemGetInfo). */
static void device_free(struct node_state *ns, size_t *free_bytes) {
  const struct cuda_api *a = &ns->gpu->api;
  for (size_t i = 0; i < ns->nlocal; i++) {
    size_t total = 0;
    free_bytes[i] = 0;
    a->cudaSetDevice(ns->local[i].device);
    a->cudaMemGetInfo(&free_bytes[i], &total);
  }
}

/* Whether every bucket received on this node starts aligned in its
 * owner's staging (comm.c): NCCL moves aligned buffers fastest.  A bucket
 * starts bucket_offset bytes before each of its moves. */
static bool staging_aligned(const struct node_state *ns,
                            const struct job_state *js, uint64_t node) {
  for (size_t k = 0; k < ns->plan->nrounds; k++) {
    const struct plan_round *rd = &ns->plan->rounds[k];
    for (size_t i = 0; i < rd->nmoves; i++) {
      const struct plan_move *m = &rd->moves[i];
      if (ns->plan->node[m->dst] != node)
        continue;
      const uint8_t *at = gpu_comms_received(js->comms, rd, m);
      if (at != NULL && (uintptr_t)(at - m->bucket_offset) % 256 != 0) {
        printf("fail round %zu: the bucket of key %s starts at %p in "
               "staging, not 256-byte aligned\n",
               k + 1, ns->plan->keys[m->key].name,
               (const void *)(at - m->bucket_offset));
        fflush(stdout);
        return false;
      }
    }
  }
  return true;
}

/* One job's exports, one after the other, each verified. */
struct exports {
  struct node_state *ns;
  struct job_state *js;
  uint64_t node;
  uint32_t timeout_ms;
  int count;
  int status;
};

static void *run_exports(void *arg) {
  struct exports *x = arg;
  struct node_state *ns = x->ns;
  struct gpu_run run = {.gpu = ns->gpu, .segments = x->js->segs,
                        .node = x->node, .comms = x->js->comms,
                        .timeout_ms = x->timeout_ms};
  x->status = 2;
  for (int n = 1; n <= x->count; n++) {
    struct engine e = {.plan = ns->plan,
                       .src = (const struct xfer_storage *const *)ns->src,
                       .dst = x->js->dst, .dst_size = x->js->dst_size,
                       .key_offset = ns->layout.offset, .threads = 1,
                       .gpu_run = &run};
    int rc = gpu_engine_run(&e);
    if (rc != 0) {
      printf("error %s: %s\n", sp_err_name(rc), e.msg);
      fflush(stdout);
      return NULL;
    }
    long verified = verify(ns, x->js, x->node);
    if (verified < 0 || (x->js->comms != NULL &&
                         !staging_aligned(ns, x->js, x->node))) {
      x->status = 1;
      return NULL;
    }
    printf("ok %d %ld\n", n, verified);
    fflush(stdout);
  }
  /* Done, the job frees its segments, as a daemon frees those of ranks
   * that leave, while another job's rounds may still run. */
  for (uint32_t r = 0; r < MAX_WORLD; r++) {
    gpu_segment_free(ns->gpu, x->js->segs[r]);
    x->js->segs[r] = NULL;
  }
  x->status = 0;
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 4)
    return fail("usage: %s NCCL_ID_HEX NODES NODE [EXPORTS]", argv[0], 64);
  const char *g = getenv("GPUNODE_GPUS");
  if (g != NULL)
    GPUS_PER_NODE = (uint32_t)atoi(g);
  uint8_t ids[MAX_JOBS][GPU_NCCL_ID_BYTES];
  uint8_t *id = ids[0];
  bool make_id = strcmp(argv[1], "-") == 0;
  const char *id2 = getenv("GPUNODE_ID2");
  for (size_t i = 0; !make_id && i < GPU_NCCL_ID_BYTES; i++)
    if (sscanf(argv[1] + 2 * i, "%2hhx", &id[i]) != 1)
      return fail("bad id %s", argv[1], 64);
  bool make_id2 = id2 != NULL && strcmp(id2, "-") == 0;
  for (size_t i = 0; id2 != NULL && !make_id2 && i < GPU_NCCL_ID_BYTES; i++)
    if (sscanf(id2 + 2 * i, "%2hhx", &ids[1][i]) != 1)
      return fail("bad id %s", id2, 64);
  uint32_t nodes = (uint32_t)atoi(argv[2]);
  uint64_t node = (uint64_t)atoi(argv[3]);
  int exports = argc > 4 ? atoi(argv[4]) : 1;
  const char *t = getenv("GPUNODE_TIMEOUT_MS");
  uint32_t timeout_ms = t ? (uint32_t)atoi(t) : 10000;
  uint32_t world = nodes * GPUS_PER_NODE;
  if (GPUS_PER_NODE < 1 || world > MAX_WORLD || node >= nodes)
    return fail("%s: bad node count", argv[2], 64);

  char msg[SP_ERRMSG_MAX + 1];
  struct node_state ns = {.njobs = id2 != NULL ? 2 : 1};
  if (gpu_open(&ns.gpu, msg, sizeof msg) != 0)
    return fail("error gpu_open: %s", msg, 2);
  int status = 2;
  if (make_id) {
    if (gpu_comms_unique_id(ns.gpu, id, msg, sizeof msg) != 0) {
      fail("error %s", msg, 2);
      goto out;
    }
    printf("id ");
    for (size_t i = 0; i < GPU_NCCL_ID_BYTES; i++)
      printf("%02x", id[i]);
    printf("\n");
    fflush(stdout);
  }
  if (make_id2) {
    if (gpu_comms_unique_id(ns.gpu, ids[1], msg, sizeof msg) != 0) {
      fail("error %s", msg, 2);
      goto out;
    }
    printf("id2 ");
    for (size_t i = 0; i < GPU_NCCL_ID_BYTES; i++)
      printf("%02x", ids[1][i]);
    printf("\n");
    fflush(stdout);
  }
  ns.job = build_job(world);
  if (plan_build(tjob_input(ns.job, 0, 0), &ns.plan, msg, sizeof msg) != 0 ||
      publish_layout_build(ns.plan, &ns.layout) != 0) {
    fail("error plan: %s", msg, 2);
    goto out;
  }
  ns.have_layout = true;
  if (node_setup(&ns, world, node, msg, sizeof msg) != 0) {
    fail("error setting up: %s", msg, 2);
    goto out;
  }
  for (int j = 0; j < ns.njobs; j++) {
    int rc = gpu_comms_create(ns.gpu, ids[j], world, ns.local, ns.nlocal,
                              ns.plan, timeout_ms, &ns.jobs[j].comms, msg,
                              sizeof msg);
    if (rc != 0) {
      ns.jobs[j].comms = NULL;
      printf("error %s: %s\n", sp_err_name(rc), msg);
      goto out;
    }
  }
  printf("ready\n");
  fflush(stdout);
  const char *self = getenv("GPUNODE_SELF");
  if (self != NULL && strcmp(self, "1") == 0) {
    if (self_round(ns.gpu, ns.jobs[0].comms, ns.local, ns.nlocal) != 0) {
      status = fail("fail %s", "self send/receive", 1);
      goto out;
    }
    printf("self ok\n");
    fflush(stdout);
  }
  size_t warm_free[MAX_WORLD];
  device_free(&ns, warm_free);
  struct exports ex[MAX_JOBS];
  pthread_t threads[MAX_JOBS];
  for (int j = 0; j < ns.njobs; j++) {
    /* The first job exports twice as often, so that the second one ends
     * (and frees) while the first one's rounds run. */
    ex[j] = (struct exports){.ns = &ns, .js = &ns.jobs[j], .node = node,
                             .timeout_ms = timeout_ms,
                             .count = j == 0 && ns.njobs > 1 ? 2 * exports
                                                             : exports};
    if (j > 0 && pthread_create(&threads[j], NULL, run_exports, &ex[j]) != 0) {
      status = fail("fail %s", "no thread for the second job", 1);
      goto out;
    }
  }
  run_exports(&ex[0]);
  for (int j = 1; j < ns.njobs; j++)
    pthread_join(threads[j], NULL);
  for (int j = 0; j < ns.njobs; j++)
    if (ex[j].status != 0) {
      status = ex[j].status;
      goto out;
    }
  const char *memcheck = getenv("GPUNODE_MEMCHECK");
  size_t after[MAX_WORLD];
  device_free(&ns, after);
  for (size_t i = 0; memcheck != NULL && strcmp(memcheck, "1") == 0 &&
                     i < ns.nlocal;
       i++)
    if (after[i] < warm_free[i]) {
      printf("fail the exports took %zu bytes of device memory on GPU %d "
             "beyond the warmed communicators'\n",
             warm_free[i] - after[i], ns.local[i].device);
      status = 1;
      goto out;
    }
  status = 0;
out:
  fflush(stdout);
  node_free(&ns);
  return status;
}
