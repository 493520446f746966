/*
 * layer.h - included by every header of daemon/xfer/: the planner, which
 * lies below the movers, is built with SP_LAYER_PLAN, so an include of a
 * mover from it fails to build (docs/internals.md).  No include guard:
 * every include checks.
 */
#ifdef SP_LAYER_PLAN
#error "daemon/plan/ is pure and lies below daemon/xfer/: it may not include a mover"
#endif
