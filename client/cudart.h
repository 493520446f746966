/*
 * cudart.h - the few CUDA runtime calls libshardport makes for CUDA storages
 * and device segments, loaded at run time on first use (client/cudart.c).
 *
 * libshardport never links the CUDA runtime: a trainer on the host backend
 * needs none, and one on GPUs usually has it loaded already (PyTorch
 * does), which the loader then reuses instead of loading a second copy.
 * SHARDPORT_CUDART_LIB names the file when set, as for the daemon.  Each
 * function returns 0 or a negative code with a sentence in c->message
 * (sp_last_message): SP_EBACKEND when the runtime cannot be loaded or a call
 * fails, SP_EINVAL when the caller's memory is not what it must be.
 */
#ifndef SP_CLIENT_CUDART_H
#define SP_CLIENT_CUDART_H

#include <stddef.h>
#include <stdint.h>

#include "client/client.h"

#define CLIENT_CUDA_HANDLE_BYTES 64
#define CLIENT_CUDA_DEVICE_MAX 48 /* "cuda:GPU-…" and its NUL */

/* For device memory at addr: the IPC handle of its allocation's base, addr's
 * offset from that base, and "cuda:<UUID>" of its GPU. */
int client_cuda_describe(sp_client *c, const void *addr,
                         uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                         uint64_t *offset, char device[CLIENT_CUDA_DEVICE_MAX]);

/* "cuda:<UUID>" of the GPU holding device memory at addr. */
int client_cuda_device_of(sp_client *c, const void *addr,
                          char device[CLIENT_CUDA_DEVICE_MAX]);

/* "cuda:<UUID>" of this process's ordinal: SP_EINVAL when it sees no such
 * device. */
int client_cuda_name(sp_client *c, int ordinal,
                     char device[CLIENT_CUDA_DEVICE_MAX]);

/* This process's ordinal of the GPU named "cuda:<UUID>": SP_EINVAL when it
 * does not see that GPU (its CUDA_VISIBLE_DEVICES hides it). */
int client_cuda_ordinal(sp_client *c, const char *device, int *ordinal);

/* Opens a daemon's segment: the IPC handle on GPU ordinal (the caller's
 * current device is left as it was), checks that it holds at least size
 * bytes, and waits on its IPC event, so that what it holds is assembled.
 * *ptr is the segment's device address, closed with client_cuda_close. */
int client_cuda_open(sp_client *c, int ordinal,
                     const uint8_t handle[CLIENT_CUDA_HANDLE_BYTES],
                     const uint8_t event[CLIENT_CUDA_HANDLE_BYTES],
                     uint64_t size, void **ptr);
void client_cuda_close(void *ptr);

/* A save's staging for tensors on a GPU (client/save.c): two pinned host
 * buffers of size bytes on ordinal's GPU, filled by device-to-host copies
 * on a stream of their own.  copy queues len bytes from device src into
 * buffer b at offset; mark records that buffer b's copies are all queued;
 * wait blocks until they are done and gives the buffer.  A buffer is not
 * copied into again before it was waited for.  free (NULL allowed) waits
 * for what is in flight. */
struct client_cuda_stage;
int client_cuda_stage_new(sp_client *c, int ordinal, uint64_t size,
                          struct client_cuda_stage **out);
int client_cuda_stage_copy(sp_client *c, struct client_cuda_stage *s, int b,
                           uint64_t offset, const void *src, uint64_t len);
int client_cuda_stage_mark(sp_client *c, struct client_cuda_stage *s, int b);
int client_cuda_stage_wait(sp_client *c, struct client_cuda_stage *s, int b,
                           void **host);
void client_cuda_stage_free(struct client_cuda_stage *s);

#endif /* SP_CLIENT_CUDART_H */
