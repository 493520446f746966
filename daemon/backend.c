/*
 * backend.c - which memory and transport backend serves, and why.
 *
 * The host backend (memfd storages, TCP between daemons) is always built.
 * The CUDA backend is compiled when its headers are found, and until its
 * implementation lands it cannot be selected; `auto` then says so in the
 * reason that `shardport status` shows.
 */
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "daemon/daemon.h"
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
  out->active = "host";
  switch (want) {
  case BACKEND_HOST:
    snprintf(out->reason, sizeof(out->reason), "selected by configuration");
    return 0;
  case BACKEND_AUTO:
    snprintf(out->reason, sizeof(out->reason), "%s",
             SP_HAVE_CUDA ? "the CUDA backend is not implemented yet"
                          : "built without the CUDA backend");
    return 0;
  case BACKEND_CUDA:
    snprintf(err, errsize, "backend cuda is not available: %s",
             SP_HAVE_CUDA ? "it is not implemented yet"
                          : "this build has no CUDA backend");
    return SP_EBACKEND;
  }
  snprintf(err, errsize, "unknown backend");
  return SP_EBACKEND;
}
