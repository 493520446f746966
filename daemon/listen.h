/*
 * listen.h - the client socket: systemd's, or made the safe way (listen.c).
 */
#ifndef SP_DAEMON_LISTEN_H
#define SP_DAEMON_LISTEN_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/un.h>

#include "daemon/layer.h"

struct config;

struct listener {
  int fd;
  /* A socket systemd passed in is systemd's to remove, not ours. */
  bool from_systemd;
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  /* The socket file we made, so that shutdown removes that file only. */
  dev_t dev;
  ino_t ino;
  /* An flock on "<path>.lock", held while the daemon runs, so that two
   * daemons started on one path cannot both decide the socket is stale. */
  int lock_fd;
};

/* Takes the socket from systemd socket activation when there is one, else
 * creates cfg->socket the safe way.  Returns 0 or -1 (logged). */
int listen_open(const struct config *cfg, struct listener *l);
/* Closes the socket and removes its file unless systemd owns it. */
void listen_close(struct listener *l);
/* What listen_open would refuse about cfg->socket's directory, without
 * making it (`shardportd -n`): 0, or -1 with what to do in err. */
int listen_check(const struct config *cfg, char *err, size_t errsize);

#endif /* SP_DAEMON_LISTEN_H */
