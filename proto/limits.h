/*
 * limits.h - the bounds applied to everything that arrives from a socket.
 *
 * Every limit is checked before anything is allocated for the data it
 * bounds, so a hostile or broken peer costs at most one frame's worth of
 * memory.  The daemon reads its values from the configuration.
 */
#ifndef SP_PROTO_LIMITS_H
#define SP_PROTO_LIMITS_H

#include <stdint.h>

/* The most fds one frame may carry; SCM_RIGHTS buffers are sized for it. */
#define SP_FDS_MAX 64

struct sp_limits {
  uint32_t max_frame;  /* payload bytes of one frame */
  uint32_t max_depth;  /* msgpack nesting; the top-level map is depth 1 */
  uint32_t max_items;  /* elements of one array or pairs of one map; the
                          whole frame holds at most twice as many items */
  uint32_t max_string; /* bytes of one str, bin or ext */
  uint32_t max_fds;    /* fds carried by one frame, at most SP_FDS_MAX */
};

#define SP_LIMITS_DEFAULT_MAX_FRAME (16u << 20)
#define SP_LIMITS_DEFAULT_MAX_DEPTH 16u
/* The deepest nesting any configuration may allow (msgpack-c's own stack). */
#define SP_LIMITS_MAX_DEPTH 32u
#define SP_LIMITS_DEFAULT_MAX_ITEMS (1u << 18)
#define SP_LIMITS_DEFAULT_MAX_STRING (1u << 20)
#define SP_LIMITS_DEFAULT_MAX_FDS 32u

void sp__limits_default(struct sp_limits *limits);

#endif /* SP_PROTO_LIMITS_H */
