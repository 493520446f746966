/*
 * layer.h - included by every header of the daemon's upper floor (jobs,
 * exports, the across-nodes wing, connections and the server).  The
 * libraries below it (daemon/plan/, daemon/xfer/, daemon/cuda/) are built
 * with their layer's macro (daemon/plan/meson.build and its neighbours),
 * so an include that reaches up from them fails to build; the layers and
 * what each may include are in docs/internals.md.  No include guard: every
 * include checks.
 */
#if defined(SP_LAYER_PLAN) || defined(SP_LAYER_XFER) || defined(SP_LAYER_CUDA)
#error "a header of the daemon's upper floor is included from daemon/plan/, daemon/xfer/ or daemon/cuda/, which lie below it"
#endif
