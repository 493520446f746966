/*
 * client.h - what the files of libshardport share and nothing else sees.
 *
 * The library speaks one request at a time on a blocking socket: a caller
 * begins a message with client_begin, packs its fields, and client_call sends
 * it and reads frames until the reply that carries the request's id.  Every
 * symbol here is hidden from the shared object's dynamic table.
 */
#ifndef SP_CLIENT_CLIENT_H
#define SP_CLIENT_CLIENT_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"
#include "proto/msg.h"
#include "shardport.h"

/* How long one request may take unless sp_set_timeout says otherwise. */
#define CLIENT_DEFAULT_TIMEOUT_MS 30000u

/* A storage this rank registered: what an identity tensor of an export
 * points into (client/register.c). */
struct client_storage {
  uint32_t id;
  bool used;
  uint64_t length;
  const void *addr;
  /* "cuda:<GPU UUID>" of a CUDA storage and this process's ordinal of that
   * GPU; "" and -1 for host memory. */
  char device[48];
  int device_index;
};

/* The registered storages by id: an open-addressing table, at most half
 * full. */
struct client_storages {
  struct client_storage *slots;
  size_t cap; /* 0 or a power of two */
  size_t count;
};

/* An export published to this connection and not yet released
 * (client/export.c). */
struct client_export;

struct sp_client {
  int sock;
  struct sp_frame_rx rx;
  uint64_t next_id;
  uint32_t timeout_ms; /* 0 waits forever */
  /* The first error that left the stream out of step (a partly written
   * request, a framing error); every later request fails with it. */
  int broken;
  /* The daemon's text from the last error reply, for sp_last_message. */
  char message[SP_ERRMSG_MAX + 1];
  /* The connection is a rank of a job (join answered, no leave since): a
   * connection that ends then ends the job for this process. */
  bool joined;
  uint32_t rank; /* the rank it joined as */
  bool consumer; /* it joined as consumer `rank` (sp_consumer_join) */
  /* The job this connection joined: its storages and its live exports. */
  struct client_storages storages;
  struct client_export *exports;
};

/* A reply being held: map points into frame.data and zone, which the reply
 * owns until client_reply_release. */
struct client_reply {
  struct sp_frame frame;
  msgpack_zone zone;
  msgpack_object map;
};

/* Begins a request with nfields fields after op and id; returns its id. */
uint64_t client_begin(sp_client *c, struct sp_msgbuf *mb, const char *op,
                      uint32_t nfields);

/*
 * Sends the request in mb (left empty whatever happens) and waits for the
 * frame that answers it.  Returns 0 with the reply in *reply when it carries
 * op; the error reply's code (its text kept for sp_last_message) when the
 * daemon refused; SP_EBADMSG for a reply with another op; SP_ETIMEOUT when
 * the client's timeout passed first; or a transport code.
 */
int client_call(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                const char *op, struct client_reply *reply);

/* As client_call, with nfds descriptors attached to the request's first
 * byte; the caller keeps them (the daemon receives duplicates).  More than
 * the frame limits allow fails with SP_ETOOMANYFDS or SP_EFRAMETOOBIG before
 * anything is sent. */
int client_call_fds(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                    const char *op, const int *fds, size_t nfds,
                    struct client_reply *reply);

/*
 * For a request answered by several frames (export): client_start sends it
 * (0, or the code of a refusal or of the transport), then client_next reads
 * each frame that carries the request's id, whatever its op, waiting at most
 * wait_ms for it (0: forever).  The frame's descriptors stay in
 * reply->frame.fds for the caller to take; client_reply_release closes the
 * rest.  An error reply ends the answer: its code is returned as by
 * client_call.
 */
int client_start(sp_client *c, struct sp_msgbuf *mb, uint64_t id);
int client_next(sp_client *c, uint64_t id, uint64_t wait_ms,
                struct client_reply *reply, struct sp_msg_head *head);

void client_reply_release(struct client_reply *reply);

/* Keys longer than this are refused by the daemon; the library refuses them
 * first so that one bad key costs no frame. */
#define CLIENT_KEY_MAX 1024

/* Whether the first n values are all >= 0 (what the wire's uints carry). */
bool client_non_negative(const int64_t *v, uint32_t n);

/* A registration of n items in as many frames of op as the limits need
 * (client/register.c): {"op":op,"id":..,field:[item...]}, each answered
 * with a count.  pack packs item i of arg; items counts the msgpack items
 * it adds as the wire check counts them (its place in the array, two per
 * map pair, one per array element).  0, the first frame's refusal (the
 * frames before it stay registered), or SP_ELIMIT for one item too large
 * for a frame alone. */
struct client_batch {
  const char *op;
  const char *field;
  size_t n;
  void (*pack)(msgpack_packer *pk, const void *arg, size_t i);
  uint64_t (*items)(const void *arg, size_t i);
  const void *arg;
};
int client_send_batched(sp_client *client, const struct client_batch *b);

/* client/explain.c: the sentence sp_connect_explain returns for a
 * connection to path (origin: where a default path came from, or NULL)
 * that failed with code; err is the errno of a failed connect() and 0 when
 * the daemon answered, daemon_msg its error reply's text (or NULL). */
void client_explain(char *why, size_t len, const char *path,
                    const char *origin, int code, int err,
                    const char *daemon_msg);

/* client/register.c: the storage table.  reserve makes room for n more so
 * that the adds after a daemon accepted a frame cannot fail. */
int client_storages_reserve(struct client_storages *t, size_t n);
void client_storages_add(struct client_storages *t,
                         const struct client_storage *s);
const struct client_storage *client_storages_find(
    const struct client_storages *t, uint32_t id);
void client_storages_clear(struct client_storages *t);

/* client/status.c: the readers every decoder of a reply shares.  A string
 * field as a new terminated copy (NULL stays in *out when optional and
 * absent; a NUL byte inside is SP_EBADMSG); an unsigned field that must fit
 * 32 bits (left as it is when optional and absent); a finite float not
 * below zero.  0 or SP_EBADMSG (SP_ENOMEM). */
int client_copy_str(const msgpack_object *map, const char *key, bool optional,
                    char **out);
int client_get_u32(const msgpack_object *map, const char *key, bool optional,
                   uint32_t *out);
int client_get_amount(const msgpack_object *map, const char *key,
                      double *out);
/* A job map of the status reply (docs/protocol.md) into job, which owns
 * its strings either way; client_job_clear frees them. */
int client_decode_job(const msgpack_object *o, sp_job_status *job);
void client_job_clear(sp_job_status *job);

/* client/export.c: unmaps every live export of c and detaches it from c, for
 * when the daemon has released them all (leave, close).  The caller's sets
 * stay allocated until sp_release, which then only frees them. */
void client_exports_detach(sp_client *c);
/* A save's part of the export request (docs/protocol.md, export "save"):
 * what every rank must ask alike, which the daemon compares, and this
 * rank's own refusal (code < 0, with its sentence), which fails the save
 * on every rank before anything moves. */
struct client_save_ask {
  uint64_t limit; /* the most tensor bytes of one file, 1 or more */
  bool overwrite;
  uint64_t directory, metadata; /* digests, client/save.c */
  int refused;
  const char *refusal;
};
/* sp_export, or with save the export of a save (client/save.c): its reply
 * also numbers the checkpoint's files.  *request_id (optional)
 * receives the export request's id, which the daemon's word about the
 * save carries until the rank reports its first step. */
int client_export_run(sp_client *client, const sp_export_opts *opts,
                      const struct client_save_ask *save, sp_owned_set **out,
                      uint64_t *request_id);
/* A save's set: the checkpoint's file count, in *file each tensor's file
 * (in the set's order), in *total_size the checkpoint's tensor bytes. */
uint32_t client_export_files(const sp_owned_set *set, const uint32_t **file,
                             uint64_t *total_size);

#endif /* SP_CLIENT_CLIENT_H */
