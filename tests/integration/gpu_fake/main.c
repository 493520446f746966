/*
 * main.c - the GPU export suite: the CUDA backend end to end on the fake
 * CUDA runtime and fake NCCL (docs/fakes.md), a real shardportd serving the
 * CUDA backend on four fake GPUs and one forked trainer process per rank
 * (rank.h) that holds its shards in fake device memory.
 *
 * tests/gpu/run.sh runs the "export" and "faults" cases of this suite on
 * real GPUs too, with SP_TEST_GPUS saying how many there are (scenarios
 * then put their ranks on at most that many; default 4, the fakes').
 */
#include <check.h>
#include <stdlib.h>

#include "tests/integration/gpu_fake/cases.h"
#include "tests/integration/gpu_fake/world.h"

static TCase *add_case(Suite *s, const char *name, void (*start)(void),
                       void (*stop)(void), int timeout) {
  TCase *tc = tcase_create(name);
  if (start != NULL)
    tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, timeout);
  suite_add_tcase(s, tc);
  return tc;
}

int main(int argc, char **argv) {
  Suite *s = suite_create("gpu-fake-export");
  struct gpu_cases c = {
      .export =
          add_case(s, "export", world_daemon_start, world_daemon_stop, 120),
      .pool = add_case(s, "pool", world_daemon_start, world_daemon_stop, 120),
      .small_pool = add_case(s, "small-pool", world_small_pool_start,
                             world_small_pool_stop, 120),
      .faults = add_case(s, "faults", world_daemon_start_slow,
                         world_daemon_stop, 120),
      .nodes = add_case(s, "nodes", world_nodes_start, world_nodes_stop, 120),
      .nodes_join = add_case(s, "nodes-join", world_nodes_start_logged,
                             world_nodes_stop_logged, 120),
      .nodes_faults = add_case(s, "nodes-faults", world_nodes_start_slow,
                               world_nodes_stop, 120),
      .nodes_again = add_case(s, "nodes-again", world_nodes_start_launch_error,
                              world_nodes_stop, 120),
      .selection = add_case(s, "selection", NULL, NULL, 60),
      .gpu_fault = add_case(s, "gpu-fault", world_faulty_gpu_start,
                            world_daemon_stop, 120),
      .slow_gpus = add_case(s, "slow-gpus", world_slow_gpus_start,
                            world_daemon_stop, 120),
  };
  /* This order keeps each case's tests in the order they always ran. */
  test_selection_add(&c);
  test_exports_add(&c);
  test_refusals_add(&c);
  test_nodes_add(&c);
  test_replicas_add(&c);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  int run = srunner_ntests_run(sr);
  srunner_free(sr);
  return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
