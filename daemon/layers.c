/*
 * layers.c - an empty program the build links each library below the
 * daemon's upper floor into, whole and given only the libraries below it
 * (daemon/meson.build): a call from the planner, the movers or the CUDA
 * backend up into jobs, exports, the mesh or the server leaves a symbol
 * undefined and fails the link, as an include of their headers fails to
 * compile (daemon/layer.h).
 */
int main(void) { return 0; }
