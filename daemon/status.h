/*
 * status.h - the status reply (status.c).
 */
#ifndef SP_DAEMON_STATUS_H
#define SP_DAEMON_STATUS_H

#include <stdint.h>

#include "daemon/layer.h"
#include "proto/msg.h"

struct server;

/* Builds the status reply for request id into mb; starts a new window
 * of loop_max_busy_us. */
void status_pack(struct server *srv, uint64_t id, struct sp_msgbuf *mb);

#endif /* SP_DAEMON_STATUS_H */
