/*
 * backend.c - which memory and transport backend serves, and why.
 *
 * The host backend (memfd storages, TCP between daemons) is always built
 * and always works.  The CUDA backend (daemon/cuda/gpu.h) is compiled when
 * the toolkit's headers are found and serves when the CUDA runtime, NCCL
 * and a GPU are there at run time: `auto` tries it and falls back to the
 * host backend, giving the reason (no driver, no device, a library that
 * does not load) that `shardport status` shows; `cuda` insists and refuses
 * to start without it.
 */
#include <stdio.h>
#include <string.h>

#include "build_config.h"
#include "daemon/backend.h"
#include "daemon/cuda/gpu.h"
#include "shardport.h"

static const char *const backend_names[] = {
    [BACKEND_AUTO] = "auto",
    [BACKEND_HOST] = "host",
    [BACKEND_CUDA] = "cuda",
};

const char *const backend_built[] = {
    "host",
#if SP_HAVE_CUDA
    "cuda",
#endif
};
const size_t backend_nbuilt = sizeof(backend_built) / sizeof(backend_built[0]);

int backend_parse(const char *name) {
  for (size_t i = 0; i < sizeof(backend_names) / sizeof(backend_names[0]); i++)
    if (strcmp(name, backend_names[i]) == 0)
      return (int)i;
  return -1;
}

const char *backend_name(enum backend_kind kind) { return backend_names[kind]; }

int backend_select(enum backend_kind want, struct backend_choice *out,
                   char *err, size_t errsize) {
  memset(out, 0, sizeof *out);
  out->active = "host";
  if (want == BACKEND_HOST) {
    snprintf(out->reason, sizeof(out->reason), "selected by configuration");
    return 0;
  }
  if (want != BACKEND_AUTO && want != BACKEND_CUDA) {
    snprintf(err, errsize, "unknown backend");
    return SP_EBACKEND;
  }
  char why[sizeof out->reason - 64];
  if (gpu_open(&out->gpu, why, sizeof why) != 0) {
    out->gpu = NULL;
    if (want == BACKEND_CUDA) {
      snprintf(err, errsize, "backend cuda is not available: %s", why);
      return SP_EBACKEND;
    }
    snprintf(out->reason, sizeof(out->reason),
             "the CUDA backend cannot serve: %s", why);
    return 0;
  }
  char found[sizeof out->reason - 64];
  gpu_describe(out->gpu, found, sizeof found);
  out->active = "cuda";
  snprintf(out->reason, sizeof(out->reason), "%s: %s",
           want == BACKEND_CUDA ? "selected by configuration" : "found",
           found);
  return 0;
}

void backend_release(struct backend_choice *choice) {
  gpu_close(choice->gpu);
  choice->gpu = NULL;
}
