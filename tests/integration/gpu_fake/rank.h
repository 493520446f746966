/*
 * rank.h - one trainer rank of the GPU export suite, as a forked process:
 * it allocates its storage on its fake GPU (cudaMalloc, or a cuMem
 * allocation exported as a POSIX descriptor), writes a deterministic
 * original into it (every element a hash of its key and flat index),
 * registers it the way its mode says, exports, reads every owned tensor
 * back through the runtime and checks it byte for byte, checks its
 * registered memory is unchanged, releases, and reports to the test
 * process through a pipe (tests/integration/rankpipe.h).
 */
#ifndef SP_TEST_GPU_FAKE_RANK_H
#define SP_TEST_GPU_FAKE_RANK_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/cuda/api.h"
#include "tests/integration/gpu_fake/scenario.h"

struct holding {
  bool held;
  int64_t shape[2];
  uint64_t byte_off;
  uint64_t nbytes;
};

struct rank {
  const struct scenario *sc;
  uint32_t rank;
  int out_fd;
  struct cuda_api api;
  int device;
  char device_name[64];
  cudaStream_t stream;
  struct holding *h;
  uint8_t *image; /* the storage's bytes as written */
  uint64_t len;
  uint8_t *alloc; /* device: the allocation (cudaMalloc or cuMem) */
  uint64_t alloc_size;
  uint8_t *storage;                 /* device: alloc + PREFIX */
  CUmemGenericAllocationHandle mem; /* MODE_FD */
  int mem_fd;
  struct report rep;
  uint8_t *owned;
};

/* Loads the CUDA runtime (the fake's, or the machine's) and takes the
 * rank's GPU: 0, or -1 with the failure in r->rep. */
int rank_cuda_start(struct rank *r);
/* The rank process: runs sc as rank on the daemon at socket, reading the
 * ticket from in_fd and writing its messages to out_fd; never returns. */
__attribute__((noreturn)) void rank_main(const struct scenario *sc,
                                         const char *socket, uint32_t rank,
                                         int in_fd, int out_fd);

#endif /* SP_TEST_GPU_FAKE_RANK_H */
