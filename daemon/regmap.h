/*
 * regmap.h - the host mappings of one storage_add frame (regmap.c).
 */
#ifndef SP_DAEMON_REGMAP_H
#define SP_DAEMON_REGMAP_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/frame.h"

/* The host mappings one storage_add frame needs (registry_add_storages):
 * planned, then mapped, then committed to the registry, or freed at any
 * step with nothing kept. */
struct regmap_frame;

/* Checks the frame's memfd storages against their files and plans their
 * mappings: 0, or SP_EBADFD / SP_ENOMEM with a sentence.  *out is set
 * either way, for regmap_frame_free. */
int regmap_plan(const struct registry *reg, const struct req_storage *s,
                size_t n, const struct sp_frame *frame,
                struct regmap_frame **out, char *msg, size_t msglen);
/* What the plan's new mappings take (more: mappings, mapped_bytes) and
 * what the mappings they replace give back once committed (less). */
void regmap_usage(const struct regmap_frame *fm, struct reg_usage *more,
                  struct reg_usage *less);
/* Makes the planned mappings, read-only: 0, or SP_ENOMEM / SP_EBADFD with
 * none of them left. */
int regmap_map(struct regmap_frame *fm, const struct sp_frame *frame,
               char *msg, size_t msglen);
/* Keeps the new mappings in reg (whose arrays have room for them) and
 * drops the ones they replace, moving registered storages into the new
 * ones; cannot fail. */
void regmap_commit(struct registry *reg, struct regmap_frame *fm,
                   const struct req_storage *s, size_t n);
/* After regmap_commit: the mapping in reg->maps the frame's non-empty
 * memfd storage i lies in. */
uint32_t regmap_map_of(const struct regmap_frame *fm, size_t i);
void regmap_frame_free(struct regmap_frame *fm);

#endif /* SP_DAEMON_REGMAP_H */
