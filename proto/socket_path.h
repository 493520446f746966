/*
 * socket_path.h - the default socket path, shared by the daemon and the
 * library (sp_default_socket_path in shardport.h adds $SHARDPORT_SOCKET).
 */
#ifndef SP_PROTO_SOCKET_PATH_H
#define SP_PROTO_SOCKET_PATH_H

#include <stddef.h>

#define SP_SYSTEM_SOCKET "/run/shardport/shardport.sock"

/* The path for this process's user without $SHARDPORT_SOCKET: the system
 * socket for root, else $XDG_RUNTIME_DIR/shardport.sock.  SP_EINVAL (and an
 * empty buf) when there is none or it does not fit. */
int sp__socket_path_for_user(char *buf, size_t size);

#endif /* SP_PROTO_SOCKET_PATH_H */
