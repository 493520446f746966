/*
 * mapping.h - a registered CUDA storage as the movers read it: the one
 * type of the CUDA backend that daemon/xfer/ sees (a storage of the
 * registry holds one, daemon/xfer/engine.h), so it needs no other header
 * of the backend.
 */
#ifndef SP_DAEMON_CUDA_MAPPING_H
#define SP_DAEMON_CUDA_MAPPING_H

#include <stdint.h>

struct gpu_import;

struct gpu_mapping {
  struct gpu_import *import; /* the opened allocation, shared and counted */
  const uint8_t *data;       /* the storage's first byte (device address) */
  int device;                /* the local ordinal it lives on */
};

#endif /* SP_DAEMON_CUDA_MAPPING_H */
