/*
 * msg.c - building messages into frames and reading fields of decoded ones.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "shardport.h"
#include "proto/msg.h"
#include "proto/text.h"

/* The packer's writer: remembers the first failure, after which nothing more
 * is appended, so that a message never goes out with a hole in it. */
static int msgbuf_write(void *data, const char *buf, size_t len) {
  struct sp_msgbuf *mb = data;
  if (!mb->failed && msgpack_sbuffer_write(&mb->sbuf, buf, len) != 0)
    mb->failed = true;
  return mb->failed ? -1 : 0;
}

void sp__msgbuf_begin(struct sp_msgbuf *mb, const char *op, uint64_t id,
                      uint32_t nfields) {
  static const char header_space[SP_FRAME_HEADER];
  msgpack_sbuffer_init(&mb->sbuf);
  mb->failed = false;
  msgpack_packer_init(&mb->pk, mb, msgbuf_write);
  msgbuf_write(mb, header_space, sizeof header_space);
  msgpack_pack_map(&mb->pk, nfields + 2);
  sp__pack_kv_str(&mb->pk, "op", op);
  sp__pack_kv_u64(&mb->pk, "id", id);
}

int sp__msgbuf_finish(struct sp_msgbuf *mb, struct sp_frame_tx *tx) {
  if (mb->failed) {
    sp__msgbuf_discard(mb);
    return SP_ENOMEM;
  }
  size_t len = mb->sbuf.size - SP_FRAME_HEADER;
  if (len > UINT32_MAX) {
    sp__msgbuf_discard(mb);
    return SP_EFRAMETOOBIG;
  }
  uint8_t *p = (uint8_t *)mb->sbuf.data;
  p[0] = (uint8_t)(len >> 24);
  p[1] = (uint8_t)(len >> 16);
  p[2] = (uint8_t)(len >> 8);
  p[3] = (uint8_t)len;
  memset(tx, 0, sizeof *tx);
  tx->len = mb->sbuf.size;
  tx->buf = (uint8_t *)msgpack_sbuffer_release(&mb->sbuf);
  return 0;
}

void sp__msgbuf_discard(struct sp_msgbuf *mb) {
  msgpack_sbuffer_destroy(&mb->sbuf);
  msgpack_sbuffer_init(&mb->sbuf);
}

void sp__pack_strn(msgpack_packer *pk, const char *s, size_t len) {
  msgpack_pack_str(pk, len);
  msgpack_pack_str_body(pk, s, len);
}

void sp__pack_str(msgpack_packer *pk, const char *s) {
  sp__pack_strn(pk, s, strlen(s));
}

void sp__pack_bin(msgpack_packer *pk, const void *data, size_t len) {
  msgpack_pack_bin(pk, len);
  msgpack_pack_bin_body(pk, data, len);
}

void sp__pack_kv_str(msgpack_packer *pk, const char *key, const char *value) {
  sp__pack_str(pk, key);
  sp__pack_str(pk, value);
}

void sp__pack_kv_u64(msgpack_packer *pk, const char *key, uint64_t value) {
  sp__pack_str(pk, key);
  msgpack_pack_uint64(pk, value);
}

void sp__pack_kv_i64(msgpack_packer *pk, const char *key, int64_t value) {
  sp__pack_str(pk, key);
  msgpack_pack_int64(pk, value);
}

void sp__pack_kv_f64(msgpack_packer *pk, const char *key, double value) {
  sp__pack_str(pk, key);
  msgpack_pack_double(pk, value);
}

void sp__pack_kv_bool(msgpack_packer *pk, const char *key, bool value) {
  sp__pack_str(pk, key);
  if (value)
    msgpack_pack_true(pk);
  else
    msgpack_pack_false(pk);
}

int sp__msg_error(struct sp_frame_tx *tx, uint64_t id, int code,
                  const char *fmt, ...) {
  char text[SP_ERRMSG_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  /* Messages quote what peers sent (an op name, a storage kind), and the
   * message is a msgpack str, which strict decoders refuse unless it is
   * UTF-8.  Escaping never shortens the text, so a character that
   * formatting cut at the end is dropped here, not half sent. */
  char message[SP_ERRMSG_MAX + 1];
  sp__text_sanitize(text, message, sizeof message);

  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "error", id, 2);
  sp__pack_kv_str(&mb.pk, "code", sp_err_name(code));
  sp__pack_kv_str(&mb.pk, "message", message);
  return sp__msgbuf_finish(&mb, tx);
}

const msgpack_object *sp__msg_field(const msgpack_object *map,
                                    const char *key) {
  if (map->type != MSGPACK_OBJECT_MAP)
    return NULL;
  size_t klen = strlen(key);
  for (uint32_t i = 0; i < map->via.map.size; i++) {
    const msgpack_object *k = &map->via.map.ptr[i].key;
    if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
        memcmp(k->via.str.ptr, key, klen) == 0)
      return &map->via.map.ptr[i].val;
  }
  return NULL;
}

/* Looks a field up and checks its type: 0 found, 1 absent but optional,
 * SP_EBADMSG otherwise. */
static int field_of_type(const msgpack_object *map, const char *key,
                         bool optional, msgpack_object_type type,
                         const msgpack_object **out) {
  const msgpack_object *o = sp__msg_field(map, key);
  if (!o)
    return optional ? 1 : SP_EBADMSG;
  if (o->type != type)
    return SP_EBADMSG;
  *out = o;
  return 0;
}

int sp__msg_get_u64(const msgpack_object *map, const char *key, bool optional,
                    uint64_t *out) {
  const msgpack_object *o;
  int rc = field_of_type(map, key, optional, MSGPACK_OBJECT_POSITIVE_INTEGER, &o);
  if (rc == 0)
    *out = o->via.u64;
  return rc;
}

int sp__msg_get_i64(const msgpack_object *map, const char *key, bool optional,
                    int64_t *out) {
  const msgpack_object *o = sp__msg_field(map, key);
  if (!o)
    return optional ? 1 : SP_EBADMSG;
  if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
    *out = o->via.i64;
  else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX)
    *out = (int64_t)o->via.u64;
  else
    return SP_EBADMSG;
  return 0;
}

int sp__msg_get_f64(const msgpack_object *map, const char *key, bool optional,
                    double *out) {
  const msgpack_object *o = sp__msg_field(map, key);
  if (!o)
    return optional ? 1 : SP_EBADMSG;
  if (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32)
    *out = o->via.f64;
  else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
    *out = (double)o->via.u64;
  else
    return SP_EBADMSG;
  return 0;
}

int sp__msg_get_bool(const msgpack_object *map, const char *key, bool optional,
                     bool *out) {
  const msgpack_object *o;
  int rc = field_of_type(map, key, optional, MSGPACK_OBJECT_BOOLEAN, &o);
  if (rc == 0)
    *out = o->via.boolean;
  return rc;
}

int sp__msg_get_str(const msgpack_object *map, const char *key, bool optional,
                    const char **ptr, size_t *len) {
  const msgpack_object *o;
  int rc = field_of_type(map, key, optional, MSGPACK_OBJECT_STR, &o);
  if (rc == 0) {
    *ptr = o->via.str.ptr;
    *len = o->via.str.size;
  }
  return rc;
}

int sp__msg_get_strbuf(const msgpack_object *map, const char *key,
                       bool optional, char *buf, size_t size) {
  const char *p;
  size_t len;
  int rc = sp__msg_get_str(map, key, optional, &p, &len);
  if (rc != 0)
    return rc;
  if (len >= size || memchr(p, '\0', len))
    return SP_EBADMSG;
  memcpy(buf, p, len);
  buf[len] = '\0';
  return 0;
}

int sp__msg_get_bin(const msgpack_object *map, const char *key, bool optional,
                    const uint8_t **ptr, size_t *len) {
  const msgpack_object *o;
  int rc = field_of_type(map, key, optional, MSGPACK_OBJECT_BIN, &o);
  if (rc == 0) {
    *ptr = (const uint8_t *)o->via.bin.ptr;
    *len = o->via.bin.size;
  }
  return rc;
}

int sp__msg_get_array(const msgpack_object *map, const char *key, bool optional,
                      const msgpack_object_array **out) {
  const msgpack_object *o;
  int rc = field_of_type(map, key, optional, MSGPACK_OBJECT_ARRAY, &o);
  if (rc == 0)
    *out = &o->via.array;
  return rc;
}

int sp__msg_get_map(const msgpack_object *map, const char *key, bool optional,
                    const msgpack_object **out) {
  return field_of_type(map, key, optional, MSGPACK_OBJECT_MAP, out);
}

int sp__msg_head(const msgpack_object *map, struct sp_msg_head *head) {
  int rc = sp__msg_get_strbuf(map, "op", false, head->op, sizeof head->op);
  if (rc == 0)
    rc = sp__msg_get_u64(map, "id", false, &head->id);
  return rc;
}

int sp__msg_error_code(const msgpack_object *map, char *message, size_t size) {
  const char *code, *text = "";
  size_t code_len, text_len;
  if (sp__msg_get_str(map, "code", false, &code, &code_len) != 0)
    return SP_EBADMSG;
  if (sp__msg_get_str(map, "message", true, &text, &text_len) != 0)
    text_len = 0;
  if (size > 0) {
    size_t n = text_len < size - 1 ? text_len : size - 1;
    memcpy(message, text, n);
    message[n] = '\0';
  }
  return sp__error_from_name(code, code_len);
}
