/*
 * publish.h - the publication layout: where each owned tensor lies in its
 * owner's segment (publish.c).
 */
#ifndef SP_DAEMON_PUBLISH_H
#define SP_DAEMON_PUBLISH_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/plan/plan.h"
#include "proto/msg.h"

struct registry;

#define PUBLISH_ALIGN 256u
#define PUBLISH_IDENTITY UINT64_MAX

struct publish_layout {
  uint32_t world;
  size_t nkeys;
  uint64_t *offset;    /* [nkeys]: byte offset in the owner's segment, or
                          PUBLISH_IDENTITY */
  uint64_t *seg_size;  /* [world]: 0 when the rank needs no segment */
  size_t *owned_first; /* [world + 1] */
  uint32_t *owned;     /* keys by owner, each owner's in name order */
};

int publish_layout_build(const struct plan *plan, struct publish_layout *out);
void publish_layout_free(struct publish_layout *l);
/* Cuts rank's owned keys into parts whose frames pass a peer's wire check
 * with frame_limit and max_items (sp_limits: items per container, and twice
 * that in the whole frame): part i lists owned[(*first)[i] ..
 * (*first)[i + 1]) (the last up to owned_first[rank + 1]).  There is always
 * at least one part. */
int publish_parts(const struct plan *plan, const struct publish_layout *l,
                  uint32_t rank, uint64_t frame_limit, uint32_t max_items,
                  size_t **first, size_t *nparts);
/* A rank's segment on a GPU, as part 0 of its reply names it. */
struct publish_device {
  const char *device;    /* "cuda:<GPU UUID>" */
  const uint8_t *handle; /* GPU_IPC_HANDLE_BYTES: cudaIpcMemHandle_t */
  const uint8_t *event;  /* GPU_IPC_HANDLE_BYTES: cudaIpcEventHandle_t */
  uint64_t size;
};

/* Packs one part of rank's export reply; owner is rank's registry (for
 * identity tensors' sids); dev is the rank's segment when it is on a GPU
 * (part 0 lists it in cuda_segments and carries no descriptor), else NULL;
 * files is a save's numbering (daemon/save.h: each tensor's file, and in
 * part 0 the file count and total bytes), or NULL for an export. */
struct save_files;
void publish_pack(const struct plan *plan, const struct publish_layout *l,
                  const struct registry *owner, uint32_t rank,
                  uint64_t request_id, uint64_t export_id, size_t part,
                  size_t nparts, size_t first, size_t end,
                  const struct publish_device *dev,
                  const struct save_files *files, struct sp_msgbuf *mb);

#endif /* SP_DAEMON_PUBLISH_H */
