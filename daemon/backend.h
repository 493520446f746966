/*
 * backend.h - which data backend serves (host or CUDA), and why (backend.c).
 */
#ifndef SP_DAEMON_BACKEND_H
#define SP_DAEMON_BACKEND_H

#include <stddef.h>

#include "daemon/layer.h"

struct gpu;

enum backend_kind { BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA };

/* Which backend serves, and why, in words for status and the log. */
struct backend_choice {
  const char *active;
  char reason[512];
  /* The CUDA backend when it serves (daemon/cuda/gpu.h), else NULL. */
  struct gpu *gpu;
};

/* "auto", "host", "cuda" <-> kind; -1 for an unknown name. */
int backend_parse(const char *name);
const char *backend_name(enum backend_kind kind);
/* The backends compiled into this build, in status order. */
extern const char *const backend_built[];
extern const size_t backend_nbuilt;
/* Picks the backend for want; SP_EBACKEND with a reason in err when the
 * requested one cannot serve. */
int backend_select(enum backend_kind want, struct backend_choice *out,
                   char *err, size_t errsize);
/* Releases what backend_select loaded (the CUDA backend). */
void backend_release(struct backend_choice *choice);

#endif /* SP_DAEMON_BACKEND_H */
