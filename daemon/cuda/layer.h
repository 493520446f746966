/*
 * layer.h - included by every header of daemon/cuda/ but mapping.h: the
 * planner and the movers, which lie below the CUDA backend, are built with
 * SP_LAYER_PLAN and SP_LAYER_XFER, so an include of the backend from them
 * fails to build (docs/internals.md).  mapping.h, the one type the movers
 * read of it, is theirs to include.  No include guard: every include
 * checks.
 */
#if defined(SP_LAYER_PLAN) || defined(SP_LAYER_XFER)
#error "daemon/plan/ and daemon/xfer/ lie below daemon/cuda/: they may include daemon/cuda/mapping.h only"
#endif
