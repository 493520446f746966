/*
 * cases.h - how the GPU export suite is put together: one Check TCase per
 * fixture (main.c makes them, with the names tests/gpu/run.sh selects),
 * and each test file's function that adds its tests to them, called in
 * the order main.c gives.
 */
#ifndef SP_TEST_GPU_FAKE_CASES_H
#define SP_TEST_GPU_FAKE_CASES_H

#include <check.h>

struct gpu_cases {
  TCase *export, *pool, *small_pool, *faults, *nodes, *nodes_join,
      *nodes_faults, *nodes_again, *selection, *gpu_fault, *slow_gpus;
};

/* test_selection.c: which backend a daemon serves and why. */
void test_selection_add(const struct gpu_cases *c);
/* test_exports.c: exports on one node: registration kinds, strided
 * tensors, the device pool, a rank killed mid-round. */
void test_exports_add(const struct gpu_cases *c);
/* test_refusals.c: what one rank's bad joins and storages get. */
void test_refusals_add(const struct gpu_cases *c);
/* test_nodes.c: two nodes through NCCL: communicators, faults, a new
 * generation after a failure. */
void test_nodes_add(const struct gpu_cases *c);
/* test_replicas.c: affine replicas compared on the GPUs, on one node and
 * across two. */
void test_replicas_add(const struct gpu_cases *c);

#endif /* SP_TEST_GPU_FAKE_CASES_H */
