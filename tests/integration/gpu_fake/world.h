/*
 * world.h - the test process's side of the GPU export suite: the daemons
 * (one, or two as two fake nodes) as Check fixtures, and the world of one
 * scenario's forked rank processes (rank.h) with what they reported.
 *
 * The test process never touches CUDA, so it can fork freely.  The
 * helpers assert with Check, so they are called from inside tests.
 */
#ifndef SP_TEST_GPU_FAKE_WORLD_H
#define SP_TEST_GPU_FAKE_WORLD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tests/integration/gpu_fake/scenario.h"
#include "tests/integration/harness.h"

/* The daemons of the fixtures: node 0 (every fixture) and node 1 (the
 * two-node ones). */
extern struct sp_test_daemon world_node0, world_node1;

struct world {
  pid_t pid[MAXR];
  int in[MAXR];
  int out[MAXR];
  struct report rep[MAXR];
  uint8_t *owned[MAXR];
  bool reported[MAXR];
};

/* Forks sc's ranks and hands rank 0's ticket to the others. */
void world_start(struct world *w, const struct scenario *sc);
/* Reads every rank's report and reaps it. */
void world_finish(const struct scenario *sc, struct world *w);
/* world_start, the scenario's fault (KILL_NODE: world_node1 is killed once
 * data moves), world_finish. */
void world_run(const struct scenario *sc, struct world *w);
void world_free(struct world *w, const struct scenario *sc);
/* Every rank exported without a failure, every key has one owner, and
 * something was assembled in device segments. */
void world_assert_exported(struct world *w, const struct scenario *sc);
/* Device allocations world_node0 has mapped now: its own segments and the
 * trainers' allocations it opened (the fake backs each with a memfd). */
int world_device_mappings(void);
/* Every segment of world_node0 freed and every allocation it opened closed,
 * waiting up to 2 s for the ranks' releases and departures to reach it. */
void world_assert_mappings_closed(void);
/* world_run, world_assert_exported, world_free and then
 * world_assert_mappings_closed: the whole life of a scenario that must
 * export cleanly and leave nothing mapped on world_node0. */
void world_export_cleanly(const struct scenario *sc);
/* How many lines of node's log (world_nodes_start_logged) hold what. */
int world_log_count(int node, const char *what);
/* The GPUs this run has: SP_TEST_GPUS on hardware, 4 on the fakes. */
int world_test_gpus(void);

/* The fixtures.  One daemon on the CUDA backend; the same pausing 50 ms
 * after each round (SHARDPORTD_TEST_ROUND_DELAY_MS); one whose GPUs lend
 * the pool 64 KiB each. */
void world_daemon_start(void);
void world_daemon_start_slow(void);
void world_daemon_stop(void);
/* One daemon on the CUDA backend whose GPU 1 faults at its first copy
 * (SHARDPORT_FAKE_FAULT, docs/fakes.md): an illegal address, sticky. */
void world_faulty_gpu_start(void);
/* One daemon on the CUDA backend whose every stream operation takes 5 ms
 * (SHARDPORT_FAKE_DELAY_US), so that a job's copies queue for a while. */
void world_slow_gpus_start(void);
void world_small_pool_start(void);
void world_small_pool_stop(void);
/* Two daemons as two fake nodes (SHARDPORT_FAKE_NODE 0 and 1), both
 * listening for peers on loopback; the same pausing after each round; the
 * same with node 1's NCCL failing its first round launch once; the same
 * with each daemon's log kept for world_log_count. */
void world_nodes_start(void);
void world_nodes_start_slow(void);
void world_nodes_start_launch_error(void);
void world_nodes_stop(void);
void world_nodes_start_logged(void);
void world_nodes_stop_logged(void);

/* A model of every placement and several dtypes over four ranks. */
extern const struct tkey world_mixed_keys[];
extern const size_t world_nmixed;

#endif /* SP_TEST_GPU_FAKE_WORLD_H */
