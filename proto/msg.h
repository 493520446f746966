/*
 * msg.h - building and reading protocol messages.
 *
 * Every message is a msgpack map with `op` (string) and `id` (unsigned
 * request id).  A reply carries its request's id and, on success, its
 * request's op; a failure is {"op":"error","id":N,"code":..,"message":..}.
 * docs/protocol.md is the normative description of every message.
 */
#ifndef SP_PROTO_MSG_H
#define SP_PROTO_MSG_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"

/* The most bytes of an op name; longer ones are refused as bad_message. */
#define SP_OP_MAX 31
/* The most bytes of an error message on the wire. */
#define SP_ERRMSG_MAX 1024

/* A message being built: header space, then the msgpack payload. */
struct sp_msgbuf {
  msgpack_sbuffer sbuf;
  msgpack_packer pk;
  /* A write failed for want of memory: the message is incomplete and
   * sp__msgbuf_finish refuses it (msgpack-c's packers drop write errors). */
  bool failed;
};

/* Starts a message: reserves the frame header and packs a map of
 * nfields + 2 pairs whose first two are op and id. */
void sp__msgbuf_begin(struct sp_msgbuf *mb, const char *op, uint64_t id,
                      uint32_t nfields);
/* Patches the frame header and moves the bytes into tx (fds none).  The
 * msgbuf is left empty.  Returns SP_EFRAMETOOBIG past the 4-byte length. */
int sp__msgbuf_finish(struct sp_msgbuf *mb, struct sp_frame_tx *tx);
/* Drops a message that will not be sent. */
void sp__msgbuf_discard(struct sp_msgbuf *mb);

void sp__pack_str(msgpack_packer *pk, const char *s);
void sp__pack_strn(msgpack_packer *pk, const char *s, size_t len);
void sp__pack_bin(msgpack_packer *pk, const void *data, size_t len);
void sp__pack_kv_str(msgpack_packer *pk, const char *key, const char *value);
void sp__pack_kv_u64(msgpack_packer *pk, const char *key, uint64_t value);
void sp__pack_kv_i64(msgpack_packer *pk, const char *key, int64_t value);
void sp__pack_kv_f64(msgpack_packer *pk, const char *key, double value);
void sp__pack_kv_bool(msgpack_packer *pk, const char *key, bool value);

/* A complete error reply in tx; the message is printf-style, made valid
 * UTF-8 without control characters (sp__text_sanitize) and truncated to
 * SP_ERRMSG_MAX bytes. */
int sp__msg_error(struct sp_frame_tx *tx, uint64_t id, int code,
                  const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* The envelope of a received message. */
struct sp_msg_head {
  char op[SP_OP_MAX + 1];
  uint64_t id;
};

/* Reads op and id from a decoded top-level map: SP_EBADMSG when either is
 * missing, of the wrong type, or op is longer than SP_OP_MAX. */
int sp__msg_head(const msgpack_object *map, struct sp_msg_head *head);

/* Field access on a decoded map.  Each returns 0, SP_EBADMSG when the field
 * is absent (unless it is optional: then 1 and the output is untouched) or
 * has the wrong type. */
const msgpack_object *sp__msg_field(const msgpack_object *map, const char *key);
int sp__msg_get_u64(const msgpack_object *map, const char *key, bool optional,
                    uint64_t *out);
int sp__msg_get_i64(const msgpack_object *map, const char *key, bool optional,
                    int64_t *out);
int sp__msg_get_f64(const msgpack_object *map, const char *key, bool optional,
                    double *out);
int sp__msg_get_bool(const msgpack_object *map, const char *key, bool optional,
                     bool *out);
/* A string field as pointer and length into the frame (not terminated). */
int sp__msg_get_str(const msgpack_object *map, const char *key, bool optional,
                    const char **ptr, size_t *len);
/* A string field copied into buf (terminated); SP_EBADMSG if it does not fit
 * or holds a NUL byte. */
int sp__msg_get_strbuf(const msgpack_object *map, const char *key,
                       bool optional, char *buf, size_t size);
int sp__msg_get_bin(const msgpack_object *map, const char *key, bool optional,
                    const uint8_t **ptr, size_t *len);
/* An array or map field. */
int sp__msg_get_array(const msgpack_object *map, const char *key, bool optional,
                      const msgpack_object_array **out);
int sp__msg_get_map(const msgpack_object *map, const char *key, bool optional,
                    const msgpack_object **out);

/* For an error reply: the code named by its wire name (SP_EINTERNAL for a
 * name this build does not know) and the message (terminated, truncated). */
int sp__msg_error_code(const msgpack_object *map, char *message, size_t size);

/* Wire name <-> code, from the one table in shardport.h. */
int sp__error_from_name(const char *name, size_t len);

#endif /* SP_PROTO_MSG_H */
