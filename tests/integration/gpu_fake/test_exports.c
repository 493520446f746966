/*
 * test_exports.c - exports on one node of fake GPUs: every registration
 * kind, large strided tensors, segments reused by their owner, the device
 * pool's capacity, and a rank killed mid-round.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/world.h"

START_TEST(device_pointers_one_gpu_each) {
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 4,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  world_export_cleanly(&sc);
}
END_TEST

START_TEST(every_registration_kind_across_shared_gpus) {
  /* Ranks 0 and 2 share GPU 0, ranks 1 and 3 GPU 1: copies within a GPU
   * and peer copies between them; three exports of one job (the plan is
   * reused, and so are each owner's segments). */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .exports = 3,
                        .max_keys = 3,
                        .modes = {MODE_TORCH, MODE_RAW, MODE_FD, MODE_PTR}};
  world_export_cleanly(&sc);
}
END_TEST

START_TEST(cumem_allocations_sharing_a_gpu_are_mapped_apart) {
  /* All four ranks register their shards by cuMem descriptor, two on each
   * GPU: the descriptors have one inode (docs/fakes.md), and each of the
   * four allocations must still be its own mapping in the daemon. */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .modes = {MODE_FD, MODE_FD, MODE_FD, MODE_FD}};
  world_export_cleanly(&sc);
}
END_TEST

START_TEST(a_thread_without_a_context_registers_and_exports) {
  /* Every rank uses the library from a thread that never touched CUDA
   * (an asynchronous checkpoint thread): its registrations need a context
   * for the driver's address lookup, and its exports must make none on a
   * GPU the rank never used (restoring "device 0" would, since CUDA 12;
   * docs/fakes.md).  Ranks 1 and 3 sit on GPU 1 and never use GPU 0. */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .library_thread = true,
                        .modes = {MODE_PTR, MODE_PTR, MODE_FD, MODE_FD}};
  world_export_cleanly(&sc);
}
END_TEST

START_TEST(an_unreleased_segment_lives_while_its_rank_holds_it) {
  /* Each rank leaves by closing its connection while it still holds its
   * export (the ranks check the daemon's count then); the segments are
   * freed once the rank processes ended. */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .close_holding = true,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  world_export_cleanly(&sc);
}
END_TEST

/* Whether one of world_node0's jobs is moving data. */
static bool a_job_moves(void) {
  sp_client *c;
  sp_status_info *st;
  bool moving = false;
  if (sp_connect(world_node0.socket, &c) < 0)
    return false;
  if (sp_status(c, &st) == 0) {
    for (size_t j = 0; j < st->njobs; j++)
      moving = moving || strcmp(st->jobs[j].phase, "moving") == 0;
    sp_status_free(st);
  }
  sp_close(c);
  return moving;
}

START_TEST(a_slow_job_does_not_hold_another_jobs_rounds) {
  /* Job A queues some 400 copies on each of two GPUs, 5 ms each on this
   * daemon's fake GPUs: two seconds of work.  Job B, on the same GPUs,
   * starts while A moves, has a few copies and gives a round one second
   * without progress.  With one stream per GPU for every job, B's copies
   * would wait behind A's and B would time out; each run of the engine has
   * streams of its own (docs/gpu.md). */
  enum { NKEYS = 800 };
  static struct tkey many[NKEYS];
  static char names[NKEYS][16];
  for (int i = 0; i < NKEYS; i++) {
    snprintf(names[i], sizeof names[i], "slow.%03d", i);
    many[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32",
                .es = 4, .ndim = 2, .shape = {4, 3}, .parts = {2, 2});
  }
  struct scenario slow = {.world = 2,
                          .nkeys = NKEYS,
                          .keys = many,
                          .gpus = 2,
                          .modes = {MODE_PTR, MODE_PTR}};
  struct scenario quick = {.world = 4,
                           .nkeys = world_nmixed,
                           .keys = world_mixed_keys,
                           .gpus = 2,
                           .timeout_ms = 1000,
                           .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world a, b;
  world_start(&a, &slow);
  int waited = 0;
  while (!a_job_moves() && waited < WAIT_MS) {
    usleep(2000);
    waited += 2;
  }
  ck_assert_msg(waited < WAIT_MS, "job A never moved");
  world_start(&b, &quick);
  world_finish(&quick, &b);
  world_finish(&slow, &a);
  world_assert_exported(&b, &quick);
  world_assert_exported(&a, &slow);
  world_free(&b, &quick);
  world_free(&a, &slow);
  world_assert_mappings_closed();
}
END_TEST

START_TEST(large_strided_tensors) {
  /* Big enough that copies are many 2-D slabs, uneven shards. */
  static const struct tkey keys[] = {
      K(.name = "big.rows", .kind = SHARD0, .dtype = "float32", .es = 4,
        .ndim = 2, .shape = {1000, 257}, .parts = {300, 1, 499, 200}),
      K(.name = "big.cols", .kind = AFFINE_COLS, .dtype = "bfloat16", .es = 2,
        .ndim = 2, .shape = {333, 1024}, .parts = {1, 511, 256, 256}),
  };
  struct scenario sc = {.world = 4,
                        .nkeys = 2,
                        .keys = keys,
                        .gpus = 3,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_FD, MODE_RAW}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}
END_TEST

START_TEST(segments_reused_by_their_owner) {
  /* Two exports of one job: each owner's second export is assembled in the
   * segment its first one was (the same device allocation, so the same IPC
   * handle and no new cudaMalloc); once the ranks left, every segment is
   * freed. */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_RAW, MODE_FD}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  int owners = 0;
  for (uint32_t i = 0; i < sc.world; i++) {
    if (w.rep[i].device_tensors == 0)
      continue;
    owners++;
    ck_assert_msg(w.rep[i].seg_inode[0] != 0 && w.rep[i].seg_inode[1] != 0,
                  "rank %u: segment not found in its maps", i);
    ck_assert_msg(w.rep[i].seg_inode[0] == w.rep[i].seg_inode[1],
                  "rank %u: export 2 got a new segment (%llu, then %llu)", i,
                  (unsigned long long)w.rep[i].seg_inode[0],
                  (unsigned long long)w.rep[i].seg_inode[1]);
    /* Never another rank's segment. */
    for (uint32_t j = 0; j < i; j++)
      ck_assert_msg(w.rep[j].seg_inode[0] == 0 ||
                        w.rep[j].seg_inode[0] != w.rep[i].seg_inode[1],
                    "ranks %u and %u share a segment", j, i);
  }
  ck_assert_int_gt(owners, 1);
  world_free(&w, &sc);
  world_assert_mappings_closed();
}
END_TEST

START_TEST(device_pool_capacity_refused_on_every_rank) {
  /* Rank 0's segment needs 1000 x 257 floats: more than the 64 KiB its
   * GPU lends the pool.  Every rank's export fails with pool_exhausted. */
  static const struct tkey keys[] = {
      K(.name = "big.rows", .kind = SHARD0, .dtype = "float32", .es = 4,
        .ndim = 2, .shape = {1000, 257}, .parts = {300, 700}),
  };
  struct scenario sc = {.world = 2,
                        .nkeys = 1,
                        .keys = keys,
                        .gpus = 2,
                        .modes = {MODE_PTR, MODE_TORCH}};
  struct world w;
  world_run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_EPOOL, "rank %u: %s: %s", i,
                  sp_strerror(w.rep[i].export_rc), w.rep[i].message);
    ck_assert_msg(strstr(w.rep[i].message, "gpu_pool_capacity") != NULL,
                  "rank %u: %s", i, w.rep[i].message);
  }
  world_free(&w, &sc);
  /* What fits still exports on the same daemon. */
  static const struct tkey small[] = {
      K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
        .shape = {64, 16}, .parts = {20, 44}),
  };
  struct scenario ok = {.world = 2,
                        .nkeys = 1,
                        .keys = small,
                        .gpus = 2,
                        .exports = 2,
                        .modes = {MODE_PTR, MODE_RAW}};
  world_run(&ok, &w);
  world_assert_exported(&w, &ok);
  world_free(&w, &ok);
  world_assert_mappings_closed();
}
END_TEST

/* A new job on the same daemon exports after a failed one. */
static void next_job_is_served(void) {
  static const struct tkey two[] = {
      K(.name = "a", .kind = SHARD0, .dtype = "float32", .es = 4, .ndim = 2,
        .shape = {6, 3}, .parts = {2, 4}),
      K(.name = "b", .kind = REPLICATED, .dtype = "int16", .es = 2, .ndim = 1,
        .shape = {7}),
  };
  struct scenario sc = {.world = 2,
                        .nkeys = 2,
                        .keys = two,
                        .gpus = 2,
                        .modes = {MODE_PTR, MODE_TORCH}};
  struct world w;
  world_run(&sc, &w);
  world_assert_exported(&w, &sc);
  world_free(&w, &sc);
}

START_TEST(a_sticky_error_fails_the_export_and_restarts_the_daemon) {
  /* GPU 1's first copy is an illegal address, which ends its context: the
   * export fails on every rank with backend and a sentence naming the GPU
   * and the error, status says why, and the daemon drains and exits with
   * failure so that systemd starts a fresh one. */
  struct scenario sc = {.world = 4,
                        .nkeys = world_nmixed,
                        .keys = world_mixed_keys,
                        .gpus = 2,
                        .modes = {MODE_PTR, MODE_PTR, MODE_PTR, MODE_PTR}};
  struct world w;
  world_run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    ck_assert_msg(w.rep[i].export_rc == SP_EBACKEND, "rank %u: %s: %s (%s)", i,
                  sp_strerror(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
    ck_assert_msg(strstr(w.rep[i].message, "cuda:GPU-") != NULL &&
                      strstr(w.rep[i].message, "CUDA error 700") != NULL &&
                      strstr(w.rep[i].message, "restarts") != NULL,
                  "rank %u: %s", i, w.rep[i].message);
  }
  world_free(&w, &sc);
  /* With every export done the daemon stops by itself, with failure. */
  int status = sp_test_wait(world_node0.pid, 20000);
  ck_assert_msg(status == 3, "shardportd exited with %d, not 3 (failure)",
                status);
  world_node0.pid = 0;
  sp_test_rmdir(world_node0.dir);
}
END_TEST

START_TEST(rank_killed_mid_round) {
  enum { N = 48 };
  static struct tkey keys[N];
  static char names[N][8];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "m.%02d", i);
    keys[i] = K(.name = names[i], .kind = SHARD0, .dtype = "float32", .es = 4,
                .ndim = 2, .shape = {4, 8}, .parts = {1, 1, 1, 1});
  }
  struct scenario sc = {.world = 4,
                        .nkeys = N,
                        .keys = keys,
                        .gpus = 4,
                        .max_keys = 4,
                        .fault = KILL_MOVING,
                        .victim = 2,
                        .modes = {MODE_PTR, MODE_TORCH, MODE_RAW, MODE_PTR}};
  struct world w;
  world_run(&sc, &w);
  for (uint32_t i = 0; i < sc.world; i++) {
    if (i == sc.victim)
      continue;
    ck_assert_msg(w.rep[i].export_rc == SP_ERANKLOST, "rank %u: %s: %s (%s)", i,
                  sp_strerror(w.rep[i].export_rc), w.rep[i].message,
                  w.rep[i].failure);
    ck_assert_msg(strstr(w.rep[i].message, "rank 2") != NULL, "rank %u: %s", i,
                  w.rep[i].message);
  }
  world_free(&w, &sc);
  next_job_is_served();
}
END_TEST

void test_exports_add(const struct gpu_cases *c) {
  tcase_add_test(c->export, device_pointers_one_gpu_each);
  tcase_add_test(c->export, every_registration_kind_across_shared_gpus);
  tcase_add_test(c->export, cumem_allocations_sharing_a_gpu_are_mapped_apart);
  tcase_add_test(c->export, large_strided_tensors);
  tcase_add_test(c->export, a_thread_without_a_context_registers_and_exports);
  tcase_add_test(c->export, an_unreleased_segment_lives_while_its_rank_holds_it);
  tcase_add_test(c->slow_gpus, a_slow_job_does_not_hold_another_jobs_rounds);
  tcase_add_test(c->pool, segments_reused_by_their_owner);
  tcase_add_test(c->small_pool, device_pool_capacity_refused_on_every_rank);
  tcase_add_test(c->faults, rank_killed_mid_round);
  tcase_add_test(c->gpu_fault,
                 a_sticky_error_fails_the_export_and_restarts_the_daemon);
}
