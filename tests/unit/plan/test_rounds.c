/*
 * test_rounds.c - rounds, buckets, local and remote moves, the digest, and
 * an engine run on host memory that checks a plan carries every byte to
 * its owner exactly.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/plan/plan.h"
#include "shardport.h"
#include "tests/unit/plan/oracle.h"
#include "tests/unit/plan/tjob.h"

static struct plan *build(struct tjob *job) {
  struct plan *plan;
  char msg[512];
  ck_assert_msg(plan_build(tjob_input(job, 0, 0), &plan, msg, sizeof msg) == 0,
                "%s", msg);
  return plan;
}

/* Two rows over two ranks: the owner holds one, so every key moves. */
static void pair_key(struct tjob *job, const char *name, enum sp_dtype dtype,
                     int64_t cols) {
  const int64_t shape[2] = {2, cols}, rows[2] = {1, 1};
  tjob_shard0(job, name, dtype, 2, shape, rows);
}

START_TEST(round_boundary_at_4096_keys) {
  struct tjob *job = tjob_new(2);
  struct plan *plan;

  for (int i = 0; i < 4097; i++)
    pair_key(job, tjob_name(job, "k%05d", i), SP_DTYPE_UINT8, 2);
  plan = build(job);
  ck_assert_uint_eq(plan->ntransfer, 4097);
  ck_assert_uint_eq(plan->nrounds, 2);
  ck_assert_uint_eq(plan->rounds[0].nkeys, 4096);
  ck_assert_uint_eq(plan->rounds[1].first, 4096);
  ck_assert_uint_eq(plan->rounds[1].nkeys, 1);
  ck_assert_uint_eq(plan->keys[plan_find_key(plan, "k04095")].round, 0);
  ck_assert_uint_eq(plan->keys[plan_find_key(plan, "k04096")].round, 1);
  plan_free(plan);
  tjob_limits(job, 1000, 0);
  plan = build(job);
  ck_assert_uint_eq(plan->nrounds, 5);
  ck_assert_uint_eq(plan->rounds[4].nkeys, 97);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* A round closes before the budget is passed; a key larger than the budget
 * travels alone. */
START_TEST(byte_budget_and_a_large_key_alone) {
  struct tjob *job = tjob_new(2);
  struct plan *plan;
  static const size_t want_first[4] = {0, 2, 3, 5};
  static const size_t want_keys[4] = {2, 1, 2, 1};

  pair_key(job, "a0", SP_DTYPE_UINT8, 50);  /* 100 bytes */
  pair_key(job, "a1", SP_DTYPE_UINT8, 50);  /* 100 */
  pair_key(job, "a2", SP_DTYPE_UINT8, 500); /* 1000 */
  pair_key(job, "a3", SP_DTYPE_UINT8, 50);
  pair_key(job, "a4", SP_DTYPE_UINT8, 50);
  pair_key(job, "a5", SP_DTYPE_UINT8, 50);
  tjob_limits(job, 0, 250);
  plan = build(job);
  ck_assert_uint_eq(plan->nrounds, 4);
  for (size_t r = 0; r < 4; r++) {
    ck_assert_uint_eq(plan->rounds[r].first, want_first[r]);
    ck_assert_uint_eq(plan->rounds[r].nkeys, want_keys[r]);
  }
  ck_assert_uint_eq(plan->rounds[1].nbytes, 1000);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* Uneven, empty and zero-row shards: moves only from ranks with rows, each
 * landing after the rows of the ranks before it. */
START_TEST(uneven_and_empty_shards) {
  struct tjob *job = tjob_new(4);
  const int64_t shape[2] = {9, 3}, rows[4] = {3, 0, 5, 1};
  struct plan *plan;
  const struct plan_round *round;
  uint64_t want_offset[4] = {0, 0, 9, 24};
  size_t seen = 0;

  tjob_node(job, 1, 0); /* ranks 0 and 1 share a node */
  tjob_shard0(job, "w", SP_DTYPE_FLOAT32, 2, shape, rows);
  plan = build(job);
  ck_assert_uint_eq(plan->keys[0].owner, 0);
  ck_assert_uint_eq(plan->nrounds, 1);
  round = &plan->rounds[0];
  ck_assert_uint_eq(round->nlocal, 1); /* rank 0's own rows */
  ck_assert_uint_eq(round->nmoves, 2); /* ranks 2 and 3 */
  ck_assert_uint_eq(round->nbuckets, 2);
  ck_assert_uint_eq(round->ranks[0].nrecv, 2);
  ck_assert_uint_eq(round->ranks[0].nlocal, 1);
  ck_assert_uint_eq(round->ranks[1].nsend, 0);
  for (size_t i = 0; i < round->nmoves + round->nlocal; i++) {
    const struct plan_move *m =
        i < round->nmoves ? &round->moves[i] : &round->local[i - round->nmoves];
    struct sp_view src;
    struct plan_region dst;
    plan_moves_regions(plan, m, &src, &dst);
    ck_assert_uint_eq(m->dst_offset, want_offset[m->src]);
    ck_assert_int_eq(dst.offset, (int64_t)want_offset[m->src]);
    ck_assert_int_eq(dst.shape[0], rows[m->src]);
    ck_assert_int_eq(dst.stride[0], 3);
    ck_assert_int_eq(dst.stride[1], 1);
    ck_assert_int_eq(src.shape[0], rows[m->src]);
    ck_assert_uint_eq(m->nbytes, (uint64_t)rows[m->src] * 12);
    seen |= (size_t)1 << m->src;
  }
  ck_assert_uint_eq(seen, 0xd);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* Between one pair of ranks, each dtype is its own bucket, in dtype order,
 * on both sides. */
START_TEST(mixed_dtypes_bucket_apart) {
  struct tjob *job = tjob_new(2);
  const int64_t shape[1] = {8}, rows[2] = {0, 8};
  const struct plan_round *round;
  struct plan *plan;

  tjob_shard0(job, "x_i8", SP_DTYPE_INT8, 1, shape, rows);
  tjob_shard0(job, "y_f32", SP_DTYPE_FLOAT32, 1, shape, rows);
  tjob_shard0(job, "z_f8", SP_DTYPE_FLOAT8_E4M3FN, 1, shape, rows);
  tjob_shard0(job, "big", SP_DTYPE_FLOAT64, 1, (const int64_t[]){64},
              (const int64_t[]){32, 32});
  /* An expert weighs rank 1 down, so every key is owned by rank 0. */
  tjob_expert(job, 1, "zz_expert", SP_DTYPE_UINT8, 1, (const int64_t[]){4096});
  plan = build(job);
  round = &plan->rounds[0];
  ck_assert_uint_eq(round->ranks[1].nsend, 4);
  for (size_t i = 0; i < round->ranks[1].nsend; i++) {
    const struct plan_bucket *b =
        &round->buckets[round->ranks[1].send_first + i];
    ck_assert_uint_eq(b->src, 1);
    ck_assert_uint_eq(b->dst, 0);
    ck_assert_uint_eq(b->nmoves, 1);
    if (i > 0)
      ck_assert_int_lt(round->buckets[round->ranks[1].send_first + i - 1].dtype,
                       b->dtype);
  }
  ck_assert_uint_eq(round->ranks[0].nrecv, 4);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* The fixture of the engine run: a (6, 8) affine key whose columns 0-2 are
 * on rank 0, 3-5 replicated on ranks 1 and 2 (rank 2 cutting the replica
 * into two row blocks), 6-7 on rank 3, dealt to an owner like any key. */
struct affine_fixture {
  uint32_t holders[4][2];
  struct affine_piece pieces[6][2];
  const struct affine_piece *by_rank[6];
  size_t npieces[6];
  uint64_t numel[6];
};

static struct affine_piece box(int64_t r0, int64_t rows, int64_t c0,
                               int64_t cols, int64_t src,
                               const uint32_t *holders, uint32_t n) {
  struct affine_piece p = {.ndim = 2,
                           .src_offset = src,
                           .dst_offset = r0 * 8 + c0,
                           .nholders = n,
                           .holders = holders};
  p.shape[0] = rows;
  p.shape[1] = cols;
  p.src_stride[0] = cols;
  p.src_stride[1] = 1;
  p.dst_stride[0] = 8;
  p.dst_stride[1] = 1;
  return p;
}

static void affine_fixture_add(struct tjob *job, struct affine_fixture *f) {
  const int64_t shape[2] = {6, 8};
  memset(f, 0, sizeof *f);
  f->holders[0][0] = 0;
  f->holders[1][0] = 1;
  f->holders[1][1] = 2;
  f->holders[3][0] = 3;
  f->pieces[0][0] = box(0, 6, 0, 3, 0, f->holders[0], 1);
  f->pieces[1][0] = box(0, 6, 3, 3, 0, f->holders[1], 2);
  f->pieces[2][0] = box(0, 2, 3, 3, 0, f->holders[1], 2);
  f->pieces[2][1] = box(2, 4, 3, 3, 6, f->holders[1], 2);
  f->pieces[3][0] = box(0, 6, 6, 2, 0, f->holders[3], 1);
  for (int r = 0; r < 6; r++)
    f->by_rank[r] = f->pieces[r];
  f->npieces[0] = f->npieces[1] = f->npieces[3] = 1;
  f->npieces[2] = 2;
  f->numel[0] = f->numel[1] = f->numel[2] = 18;
  f->numel[3] = 12;
  tjob_affine(job, "aff", SP_DTYPE_FLOAT32, 2, shape, f->numel, f->by_rank,
              f->npieces);
}

/* Six ranks on three nodes, keys of many dtypes and shapes with uneven and
 * empty shards, whole keys, an expert, tied weights, a group and an affine
 * key, cut into many rounds by small limits. */
static struct tjob *mixed_job(uint64_t seed, struct affine_fixture *f) {
  static const enum sp_dtype dtypes[] = {
      SP_DTYPE_FLOAT32, SP_DTYPE_BFLOAT16, SP_DTYPE_FLOAT8_E5M2,
      SP_DTYPE_UINT8,   SP_DTYPE_INT16,    SP_DTYPE_COMPLEX64};
  static const int64_t shape_none[1] = {0};
  struct tjob *job = tjob_new(6);
  uint64_t state = seed;

  for (uint32_t r = 0; r < 6; r++)
    tjob_node(job, r, r / 2);
  for (int i = 0; i < 48; i++) {
    int64_t rows[6], shape[3], n = 0;
    uint32_t ndim = 1 + (uint32_t)(tjob_rand(&state) % 3);
    for (int r = 0; r < 6; r++)
      n += rows[r] = (int64_t)(tjob_rand(&state) % 4);
    shape[0] = n;
    for (uint32_t d = 1; d < ndim; d++)
      shape[d] = 1 + (int64_t)(tjob_rand(&state) % 5);
    tjob_shard0(job, tjob_name(job, "layers.%02d.weight", i),
                dtypes[tjob_rand(&state) % 6], ndim, shape, rows);
  }
  tjob_whole(job, "norm", PLAN_REPLICATED, SP_DTYPE_FLOAT32, 1,
             (const int64_t[]){16});
  tjob_whole(job, "step", PLAN_PLAIN, SP_DTYPE_INT64, 0, shape_none);
  tjob_expert(job, 4, "experts.4", SP_DTYPE_BFLOAT16, 2,
              (const int64_t[]){4, 4});
  tjob_tie(job, "tied.head", "layers.03.weight");
  tjob_group(job, PLAN_NONE, 3,
             (const char *const[]){"layers.05.weight", "layers.06.weight",
                                   "layers.40.weight"});
  affine_fixture_add(job, f);
  tjob_limits(job, 7, 600);
  return job;
}

/* Each bucket appears once among its source's sends and once among its
 * destination's receives, in (peer, device type, dtype) order on both
 * sides, with moves packed back to back. */
static void check_pairing(const struct plan *plan) {
  uint64_t total = 0, traffic = 0;

  for (size_t t = 0; t < plan->ntransfer; t++)
    traffic += plan->keys[plan->transfer[t]].traffic;
  for (size_t ri = 0; ri < plan->nrounds; ri++) {
    const struct plan_round *round = &plan->rounds[ri];
    uint32_t *sent = calloc(round->nbuckets + 1, sizeof *sent);
    uint32_t *received = calloc(round->nbuckets + 1, sizeof *received);
    uint64_t bytes = 0;
    for (uint32_t r = 0; r < plan->world; r++) {
      const struct plan_rank_round *rr = &round->ranks[r];
      for (size_t i = 0; i < rr->nsend; i++) {
        const struct plan_bucket *b = &round->buckets[rr->send_first + i];
        ck_assert_uint_eq(b->src, r);
        sent[rr->send_first + i]++;
        if (i > 0) {
          const struct plan_bucket *a = b - 1;
          ck_assert(a->dst < b->dst ||
                    (a->dst == b->dst && (a->device_type < b->device_type ||
                                          (a->device_type == b->device_type &&
                                           a->dtype < b->dtype))));
        }
      }
      for (size_t i = 0; i < rr->nrecv; i++) {
        uint32_t bi = round->recv_order[rr->recv_first + i];
        const struct plan_bucket *b = &round->buckets[bi];
        ck_assert_uint_eq(b->dst, r);
        received[bi]++;
        if (i > 0) {
          const struct plan_bucket *a =
              &round->buckets[round->recv_order[rr->recv_first + i - 1]];
          ck_assert(a->src < b->src ||
                    (a->src == b->src && (a->device_type < b->device_type ||
                                          (a->device_type == b->device_type &&
                                           a->dtype < b->dtype))));
        }
      }
      for (size_t i = 0; i < rr->nlocal; i++)
        ck_assert_uint_eq(round->local[rr->local_first + i].dst, r);
    }
    for (size_t b = 0; b < round->nbuckets; b++) {
      const struct plan_bucket *bk = &round->buckets[b];
      uint64_t offset = 0;
      ck_assert_uint_eq(sent[b], 1);
      ck_assert_uint_eq(received[b], 1);
      ck_assert_uint_ne(plan->node[bk->src], plan->node[bk->dst]);
      for (size_t i = 0; i < bk->nmoves; i++) {
        const struct plan_move *m = &round->moves[bk->first + i];
        const struct plan_key *key = &plan->keys[m->key];
        ck_assert_uint_eq(m->src, bk->src);
        ck_assert_uint_eq(m->dst, bk->dst);
        ck_assert_int_eq(key->dtype, bk->dtype);
        ck_assert_uint_eq(key->device_type, bk->device_type);
        ck_assert_uint_eq(m->bucket_offset, offset);
        offset += m->nbytes;
      }
      ck_assert_uint_eq(offset, bk->nbytes);
      bytes += bk->nbytes;
    }
    for (size_t i = 0; i < round->nlocal; i++) {
      const struct plan_move *m = &round->local[i];
      ck_assert_uint_eq(plan->node[m->src], plan->node[m->dst]);
      bytes += m->nbytes;
    }
    ck_assert_uint_eq(bytes, round->nbytes);
    ck_assert_uint_le(round->nkeys, plan->max_keys);
    ck_assert(round->nkeys == 1 || round->nbytes <= plan->max_bytes);
    total += bytes;
    free(sent);
    free(received);
  }
  ck_assert_uint_eq(total, traffic);
}

START_TEST(every_send_meets_its_receive) {
  for (uint64_t seed = 1; seed <= 20; seed++) {
    struct affine_fixture f;
    struct tjob *job = mixed_job(seed, &f);
    struct plan *plan = build(job);
    ck_assert_uint_gt(plan->nrounds, 4);
    check_pairing(plan);
    plan_free(plan);
    tjob_free(job);
  }
}
END_TEST

/* Element offsets of a strided box, row-major. */
static void box_offsets(uint32_t ndim, const int64_t *shape,
                        const int64_t *stride, int64_t offset, int64_t *out,
                        size_t *n) {
  int64_t idx[SP_MAX_DIMS] = {0};
  uint64_t numel = 1;
  *n = 0;
  for (uint32_t d = 0; d < ndim; d++)
    numel *= (uint64_t)shape[d];
  for (uint64_t e = 0; e < numel; e++) {
    int64_t at = offset;
    for (uint32_t d = 0; d < ndim; d++)
      at += idx[d] * stride[d];
    out[(*n)++] = at;
    for (uint32_t d = ndim; d-- > 0;) {
      if (++idx[d] < shape[d])
        break;
      idx[d] = 0;
    }
  }
}

struct sim {
  const struct plan_input *in;
  const struct plan *plan;
  uint8_t **mem[6];   /* per rank, per storage */
  uint8_t **owned;    /* per key, on its owner */
  uint8_t **written;  /* per key: element written once, or compared */
  uint8_t **expected; /* per key */
};

static const uint8_t *source_base(const struct sim *sim,
                                  const struct plan_move *m) {
  return sim->mem[m->src][m->storage];
}

/* Unpacks a move's bytes (row-major in its shape) into the owner's tensor;
 * a replica compares where another holder has written. */
static void land(struct sim *sim, const struct plan_move *m,
                 const uint8_t *bytes) {
  const struct plan_key *key = &sim->plan->keys[m->key];
  size_t es = sp__dtype_size(key->dtype), n;
  int64_t at[512];
  struct sp_view src;
  struct plan_region dst;

  plan_moves_regions(sim->plan, m, &src, &dst);
  box_offsets(dst.ndim, dst.shape, dst.stride, dst.offset, at, &n);
  for (size_t i = 0; i < n; i++) {
    uint8_t *to = sim->owned[m->key] + (size_t)at[i] * es;
    if (sim->written[m->key][at[i]]) {
      ck_assert(m->flags & PLAN_MOVE_REPLICA);
      ck_assert_mem_eq(to, bytes + i * es, es);
    } else {
      memcpy(to, bytes + i * es, es);
      sim->written[m->key][at[i]] = 1;
    }
  }
}

/* Packs a move's source elements, row-major in its shape. */
static void pack(const struct sim *sim, const struct plan_move *m,
                 uint8_t *out) {
  const struct plan_key *key = &sim->plan->keys[m->key];
  size_t es = sp__dtype_size(key->dtype), n;
  int64_t at[512];
  struct sp_view src;
  struct plan_region dst;

  plan_moves_regions(sim->plan, m, &src, &dst);
  box_offsets(src.ndim, src.shape, src.stride, src.offset, at, &n);
  ck_assert_uint_eq(n * es, m->nbytes);
  for (size_t i = 0; i < n; i++)
    memcpy(out + i * es, source_base(sim, m) + (size_t)at[i] * es, es);
}

static void sim_fill(struct sim *sim, uint64_t seed) {
  uint64_t state = seed;
  for (uint32_t r = 0; r < 6; r++) {
    const struct plan_rank_in *rank = &sim->in->ranks[r];
    sim->mem[r] = calloc(rank->nstorages, sizeof *sim->mem[r]);
    for (size_t s = 0; s < rank->nstorages; s++) {
      sim->mem[r][s] = malloc(rank->storages[s].nbytes + 1);
      for (uint64_t b = 0; b < rank->storages[s].nbytes; b++)
        sim->mem[r][s][b] = (uint8_t)tjob_rand(&state);
    }
  }
}

/* Rank r's registration of name, in full form in *out. */
static const struct plan_key_in *find_entry(const struct sim *sim, uint32_t r,
                                            const char *name,
                                            struct plan_key_in *out) {
  const struct plan_rank_in *rank = &sim->in->ranks[r];
  for (size_t j = 0; j < rank->nentries; j++) {
    plan_input_holding(sim->in, rank, &rank->entries[j], out);
    if (strcmp(out->name, name) == 0)
      return out;
  }
  return NULL;
}

/* The affine key's shards, extracted by the oracle from random data. */
static void sim_affine(struct sim *sim, uint32_t k, uint64_t *state) {
  const struct plan_key *key = &sim->plan->keys[k];
  size_t es = sp__dtype_size(key->dtype);
  struct affine_shard shards[6];
  struct affine_map map = {key->name, key->ndim, key->shape, 6, shards};
  char msg[256];

  for (uint64_t b = 0; b < key->nbytes; b++)
    sim->expected[k][b] = (uint8_t)tjob_rand(state);
  for (uint32_t r = 0; r < 6; r++) {
    struct plan_key_in held;
    const struct plan_key_in *e = find_entry(sim, r, key->name, &held);
    shards[r] = (struct affine_shard){(uint64_t)e->view.shape[0], e->npieces,
                                      e->pieces};
  }
  for (uint32_t r = 0; r < 6; r++) {
    struct plan_key_in held;
    const struct plan_key_in *e = find_entry(sim, r, key->name, &held);
    ck_assert_msg(
        oracle_extract(&map, r, es, sim->expected[k],
                       sim->mem[r][e->storage] + (size_t)e->view.offset * es,
                       msg, sizeof msg) == 0,
        "%s", msg);
  }
}

/* The whole tensor each key should become: shard0 shards concatenated in
 * rank order; the affine key as the random data its shards came from. */
static void sim_expect(struct sim *sim, uint64_t seed) {
  const struct plan *plan = sim->plan;
  uint64_t state = seed * 7 + 1;

  for (uint32_t k = 0; k < plan->nkeys; k++) {
    const struct plan_key *key = &plan->keys[k];
    size_t es = sp__dtype_size(key->dtype), used = 0;
    sim->expected[k] = calloc(key->nbytes + 1, 1);
    sim->owned[k] = calloc(key->nbytes + 1, 1);
    sim->written[k] = calloc(key->nbytes / es + 1, 1);
    if (key->placement == PLAN_AFFINE) {
      sim_affine(sim, k, &state);
      continue;
    }
    if (key->placement != PLAN_SHARD0)
      continue;
    for (uint32_t r = 0; r < 6; r++) {
      struct plan_key_in held;
      const struct plan_key_in *e = find_entry(sim, r, key->name, &held);
      int64_t at[512];
      size_t n;
      box_offsets(e->view.ndim, e->view.shape, e->view.stride, e->view.offset,
                  at, &n);
      for (size_t i = 0; i < n; i++, used += es)
        memcpy(sim->expected[k] + used,
               sim->mem[r][e->storage] + (size_t)at[i] * es, es);
    }
  }
}

/* Runs every round as an engine would: local moves copied straight from
 * the source storage, remote buckets packed by the sender in move order
 * and unpacked by the receiver at each move's bucket offset. */
static void sim_run(struct sim *sim) {
  const struct plan *plan = sim->plan;

  for (size_t ri = 0; ri < plan->nrounds; ri++) {
    const struct plan_round *round = &plan->rounds[ri];
    for (size_t i = 0; i < round->nlocal; i++) {
      uint8_t *bytes = malloc(round->local[i].nbytes + 1);
      pack(sim, &round->local[i], bytes);
      land(sim, &round->local[i], bytes);
      free(bytes);
    }
    for (size_t b = 0; b < round->nbuckets; b++) {
      const struct plan_bucket *bk = &round->buckets[b];
      uint8_t *wire = malloc(bk->nbytes + 1);
      for (size_t i = 0; i < bk->nmoves; i++)
        pack(sim, &round->moves[bk->first + i],
             wire + round->moves[bk->first + i].bucket_offset);
      for (size_t i = 0; i < bk->nmoves; i++)
        land(sim, &round->moves[bk->first + i],
             wire + round->moves[bk->first + i].bucket_offset);
      free(wire);
    }
  }
}

START_TEST(plan_carries_every_byte_exactly) {
  for (uint64_t seed = 1; seed <= 10; seed++) {
    struct affine_fixture f;
    struct tjob *job = mixed_job(seed, &f);
    struct sim sim = {.in = tjob_input(job, 0, 0)};
    struct plan *plan;
    char msg[512];
    size_t moved = 0;

    ck_assert_msg(plan_build(sim.in, &plan, msg, sizeof msg) == 0, "%s", msg);
    sim.plan = plan;
    sim.owned = calloc(plan->nkeys, sizeof *sim.owned);
    sim.written = calloc(plan->nkeys, sizeof *sim.written);
    sim.expected = calloc(plan->nkeys, sizeof *sim.expected);
    sim_fill(&sim, seed);
    sim_expect(&sim, seed);
    sim_run(&sim);
    for (uint32_t k = 0; k < plan->nkeys; k++) {
      const struct plan_key *key = &plan->keys[k];
      size_t es = sp__dtype_size(key->dtype);
      if (key->kind != PLAN_KEY_MOVE)
        continue;
      moved++;
      for (uint64_t e = 0; e < key->nbytes / es; e++)
        ck_assert_msg(sim.written[k][e], "key %s element %llu never written",
                      key->name, (unsigned long long)e);
      ck_assert_mem_eq(sim.owned[k], sim.expected[k], key->nbytes);
    }
    ck_assert_uint_gt(moved, 20);
    ck_assert_int_eq(plan->keys[plan_find_key(plan, "aff")].kind,
                     PLAN_KEY_MOVE);
    for (uint32_t k = 0; k < plan->nkeys; k++) {
      free(sim.owned[k]);
      free(sim.written[k]);
      free(sim.expected[k]);
    }
    for (uint32_t r = 0; r < 6; r++) {
      for (size_t st = 0; st < sim.in->ranks[r].nstorages; st++)
        free(sim.mem[r][st]);
      free(sim.mem[r]);
    }
    free(sim.owned);
    free(sim.written);
    free(sim.expected);
    plan_free(plan);
    tjob_free(job);
  }
}
END_TEST

/* Replicas of an affine piece all travel, flagged, and count as traffic. */
START_TEST(affine_replicas_travel_flagged) {
  struct affine_fixture f;
  struct tjob *job = tjob_new(6);
  struct plan *plan;
  const struct plan_key *key;
  size_t replicas = 0, moves = 0;

  affine_fixture_add(job, &f);
  plan = build(job);
  key = &plan->keys[0];
  ck_assert_uint_eq(key->nbytes, 6 * 8 * 4);
  ck_assert_uint_eq(key->traffic, (18 + 18 + 18 + 12) * 4);
  for (size_t i = 0; i < plan->rounds[0].nmoves; i++, moves++)
    replicas += (plan->rounds[0].moves[i].flags & PLAN_MOVE_REPLICA) != 0;
  for (size_t i = 0; i < plan->rounds[0].nlocal; i++, moves++)
    replicas += (plan->rounds[0].local[i].flags & PLAN_MOVE_REPLICA) != 0;
  ck_assert_uint_eq(moves, 5);
  ck_assert_uint_eq(replicas, 3);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

/* Same gathered metadata, any order: the same digest; another plan: another
 * digest. */
START_TEST(digest_is_deterministic_and_sensitive) {
  struct affine_fixture f;
  struct tjob *job = mixed_job(3, &f);
  struct plan *plan = build(job);
  uint64_t digest = plan->digest;
  struct plan *other;
  char msg[256];

  for (uint32_t view = 0; view < 6; view++) {
    for (uint64_t seed = 0; seed < 4; seed++) {
      ck_assert_int_eq(
          plan_build(tjob_input(job, view, seed), &other, msg, sizeof msg), 0);
      ck_assert_uint_eq(other->digest, digest);
      ck_assert_uint_eq(other->nrounds, plan->nrounds);
      for (size_t k = 0; k < plan->nkeys; k++) {
        ck_assert_uint_eq(other->keys[k].owner, plan->keys[k].owner);
        ck_assert_uint_eq(other->keys[k].round, plan->keys[k].round);
      }
      plan_free(other);
    }
  }
  tjob_limits(job, 8, 600);
  other = build(job);
  ck_assert_uint_ne(other->digest, digest);
  plan_free(other);
  tjob_limits(job, 7, 600);
  /* A source view one element further into its storage. */
  {
    const struct plan_move *m = &plan->rounds[0].moves[0];
    uint32_t src = m->src;
    const char *name = plan->keys[m->key].name;
    tjob_storage(job, src, name)->nbytes += 16;
    tjob_key(job, src, name)->view.offset = 1;
  }
  other = build(job);
  ck_assert_uint_ne(other->digest, digest);
  plan_free(other);
  /* Rank 5 moves to another node: moves change sides. */
  tjob_node(job, 5, 9);
  other = build(job);
  ck_assert_uint_ne(other->digest, digest);
  plan_free(other);
  plan_free(plan);
  tjob_free(job);
}
END_TEST

static void assert_moves_equal(const struct plan_move *a,
                               const struct plan_move *b, size_t n) {
  for (size_t i = 0; i < n; i++) {
    ck_assert_uint_eq(a[i].key, b[i].key);
    ck_assert_uint_eq(a[i].src, b[i].src);
    ck_assert_uint_eq(a[i].dst, b[i].dst);
    ck_assert_uint_eq(a[i].piece, b[i].piece);
    ck_assert_uint_eq(a[i].flags, b[i].flags);
    ck_assert_uint_eq(a[i].storage, b[i].storage);
    ck_assert_uint_eq(a[i].entry, b[i].entry);
    ck_assert_uint_eq(a[i].nbytes, b[i].nbytes);
    ck_assert_uint_eq(a[i].dst_offset, b[i].dst_offset);
    ck_assert_uint_eq(a[i].bucket_offset, b[i].bucket_offset);
  }
}

/* Rounds built on one thread and on several give one plan, move for move,
 * and one digest, whichever thread built which round. */
START_TEST(threads_give_the_same_plan) {
  struct affine_fixture f;
  struct tjob *job = mixed_job(5, &f);
  struct plan *one, *many;

  /* Rounds of three keys: many rounds for the threads to share. */
  tjob_limits(job, 3, 0);
  tjob_threads(job, 1);
  one = build(job);
  ck_assert_uint_gt(one->nrounds, 8);
  for (uint32_t threads = 2; threads <= 5; threads += 3) {
    tjob_threads(job, threads);
    many = build(job);
    ck_assert_uint_eq(many->digest, one->digest);
    ck_assert_uint_eq(many->nrounds, one->nrounds);
    for (size_t k = 0; k < one->nkeys; k++) {
      ck_assert_uint_eq(many->keys[k].owner, one->keys[k].owner);
      ck_assert_uint_eq(many->keys[k].round, one->keys[k].round);
    }
    for (size_t r = 0; r < one->nrounds; r++) {
      const struct plan_round *a = &one->rounds[r], *b = &many->rounds[r];
      ck_assert_uint_eq(b->digest, a->digest);
      ck_assert_uint_eq(b->nmoves, a->nmoves);
      ck_assert_uint_eq(b->nlocal, a->nlocal);
      ck_assert_uint_eq(b->nbuckets, a->nbuckets);
      assert_moves_equal(a->moves, b->moves, a->nmoves);
      assert_moves_equal(a->local, b->local, a->nlocal);
      for (size_t i = 0; i < a->nbuckets; i++) {
        ck_assert_uint_eq(b->buckets[i].src, a->buckets[i].src);
        ck_assert_uint_eq(b->buckets[i].dst, a->buckets[i].dst);
        ck_assert_uint_eq(b->buckets[i].nbytes, a->buckets[i].nbytes);
        ck_assert_uint_eq(b->buckets[i].first, a->buckets[i].first);
      }
    }
    plan_free(many);
  }
  plan_free(one);
  tjob_free(job);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-rounds");
  TCase *tc = tcase_create("rounds");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, round_boundary_at_4096_keys);
  tcase_add_test(tc, byte_budget_and_a_large_key_alone);
  tcase_add_test(tc, uneven_and_empty_shards);
  tcase_add_test(tc, mixed_dtypes_bucket_apart);
  tcase_add_test(tc, every_send_meets_its_receive);
  tcase_add_test(tc, plan_carries_every_byte_exactly);
  tcase_add_test(tc, affine_replicas_travel_flagged);
  tcase_add_test(tc, digest_is_deterministic_and_sensitive);
  tcase_add_test(tc, threads_give_the_same_plan);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
