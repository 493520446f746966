/*
 * limits.c - the default bounds for data from a socket.
 */
#include "proto/limits.h"

void sp__limits_default(struct sp_limits *limits) {
  limits->max_frame = SP_LIMITS_DEFAULT_MAX_FRAME;
  limits->max_depth = SP_LIMITS_DEFAULT_MAX_DEPTH;
  limits->max_items = SP_LIMITS_DEFAULT_MAX_ITEMS;
  limits->max_string = SP_LIMITS_DEFAULT_MAX_STRING;
  limits->max_fds = SP_LIMITS_DEFAULT_MAX_FDS;
}
