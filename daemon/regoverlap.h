/*
 * regoverlap.h - whether a range of a file holds bytes a rank registered
 * (regoverlap.c).
 *
 * A consumer grants the daemon write access to its buffers; nothing a
 * trainer registered is ever written.  The planner cannot tell (it sees
 * storages, not files), so the daemon asks each trainer registry of the
 * node, before it maps a consumer's memfd storage writable, whether the
 * storage's bytes of its file meet a host storage the registry holds.
 */
#ifndef SP_DAEMON_REGOVERLAP_H
#define SP_DAEMON_REGOVERLAP_H

#include <stdint.h>
#include <sys/types.h>

#include "daemon/layer.h"
#include "daemon/registry.h"

/* The sid of a host storage of reg that shares a byte with bytes
 * [offset, offset + length) of the file (dev, ino), the lowest such sid;
 * 0 when none does (an empty range meets nothing). */
uint32_t regoverlap_sid(const struct registry *reg, dev_t dev, ino_t ino,
                        uint64_t offset, uint64_t length);

#endif /* SP_DAEMON_REGOVERLAP_H */
