/*
 * stage.h - the connections' large frames, staged daemon-wide (stage.c).
 */
#ifndef SP_DAEMON_STAGE_H
#define SP_DAEMON_STAGE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"

struct server;

/* A large frame of one connection as the stage sees it (conn.c embeds
 * it): waiting to be taken in, taken in (on a worker or being served),
 * or taken in and queued for its next turn of the loop. */
enum stage_where { STAGE_NONE, STAGE_WAITING, STAGE_TAKEN, STAGE_QUEUED };
struct stage_item {
  struct stage_item *prev, *next;
  uint64_t bytes;
  enum stage_where where;
  /* Taken in and not yet decoded: it holds one of the stage's decoding
   * slots. */
  bool decoding;
  /* Called on the loop when the item is taken in after it waited, and at
   * each turn it was queued for. */
  void (*go)(struct stage_item *it);
};

/* Before the loop runs: 0, or a negative code (logged). */
int stage_init(struct server *srv);
/* Takes a frame of bytes in now (true) if no frame waits, a decoding slot
 * is free and it fits under max_staged_bytes (or nothing is taken in);
 * else it waits, and its go is called once it has been taken in. */
bool stage_take(struct server *srv, struct stage_item *it, uint64_t bytes);
/* Queues a taken item's next turn: go is called from a later iteration of
 * the loop, one item per iteration. */
void stage_queue(struct server *srv, struct stage_item *it);
/* Takes a waiting or queued item out of its queue (a waiting one was never
 * taken in; a queued one still is). */
void stage_remove(struct server *srv, struct stage_item *it);
/* A taken item is decoded (back from its worker): its decoding slot is
 * free again, and waiting items may be taken in. */
void stage_decoded(struct server *srv, struct stage_item *it);
/* A taken item's bytes, and its decoding slot if it still holds one, are
 * free again: waiting items are taken in. */
void stage_give_back(struct server *srv, struct stage_item *it);
/* After a reload: a raised max_staged_bytes takes in the waiting items
 * that fit now. */
void stage_bound_changed(struct server *srv);
/* With the server's other handles, once every connection is ending: every
 * item waiting or queued has its go called now, and later ones at once. */
void stage_close(struct server *srv);
/* After the loop ended. */
void stage_free(struct server *srv);

#endif /* SP_DAEMON_STAGE_H */
