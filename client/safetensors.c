/*
 * safetensors.c - the bytes of a safetensors header and of the checkpoint
 * index, built in memory; see client/safetensors.h.
 *
 * The format (docs/checkpoints.md): an 8-byte little-endian header length
 * N, N bytes of UTF-8 JSON, then the tensors' bytes back to back.  The
 * JSON here is padded with spaces to a multiple of 8 bytes, so that the
 * first tensor starts 8-byte aligned; each tensor's data_offsets count
 * from the end of the header, in key order, without gaps.
 */
#include "client/safetensors.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/dtype.h"
#include "shardport.h"

static int reserve(struct st_buf *b, size_t more) {
  if (b->failed)
    return SP_ENOMEM;
  if (more <= b->cap - b->len)
    return 0;
  size_t cap = b->cap ? b->cap : 4096;
  while (cap - b->len < more) {
    if (cap > SIZE_MAX / 2) {
      b->failed = true;
      return SP_ENOMEM;
    }
    cap *= 2;
  }
  char *p = realloc(b->data, cap);
  if (!p) {
    b->failed = true;
    return SP_ENOMEM;
  }
  b->data = p;
  b->cap = cap;
  return 0;
}

void st_buf_free(struct st_buf *b) {
  free(b->data);
  memset(b, 0, sizeof *b);
}

static void put(struct st_buf *b, const char *s, size_t len) {
  if (reserve(b, len) == 0) {
    memcpy(b->data + b->len, s, len);
    b->len += len;
  }
}

static void puts_(struct st_buf *b, const char *s) { put(b, s, strlen(s)); }

static void put_u64(struct st_buf *b, uint64_t v) {
  char num[24];
  int n = snprintf(num, sizeof num, "%" PRIu64, v);
  put(b, num, (size_t)n);
}

/* A JSON string: quotes, backslashes and control characters escaped; the
 * rest (UTF-8, which the caller checked) as it is. */
static void put_string(struct st_buf *b, const char *s) {
  put(b, "\"", 1);
  const char *run = s;
  for (const char *p = s; *p; p++) {
    unsigned char ch = (unsigned char)*p;
    if (ch >= 0x20 && ch != '"' && ch != '\\')
      continue;
    put(b, run, (size_t)(p - run));
    char esc[8];
    if (ch == '"' || ch == '\\')
      snprintf(esc, sizeof esc, "\\%c", ch);
    else
      snprintf(esc, sizeof esc, "\\u%04x", ch);
    puts_(b, esc);
    run = p + 1;
  }
  puts_(b, run);
  put(b, "\"", 1);
}

int st_header(const struct st_tensor *tensors, size_t n,
              const sp_metadata *metadata, size_t nmetadata,
              struct st_buf *out) {
  memset(out, 0, sizeof *out);
  /* The length goes first; it is filled in once the JSON is whole. */
  put(out, "\0\0\0\0\0\0\0\0", 8);
  puts_(out, "{\"__metadata__\":{\"format\":\"pt\"");
  for (size_t i = 0; i < nmetadata; i++) {
    put(out, ",", 1);
    put_string(out, metadata[i].key);
    put(out, ":", 1);
    put_string(out, metadata[i].value);
  }
  put(out, "}", 1);
  uint64_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const struct st_tensor *t = &tensors[i];
    const char *dtype = sp__dtype_safetensors_name(t->dtype);
    if (!dtype) {
      st_buf_free(out);
      return SP_EDTYPE;
    }
    put(out, ",", 1);
    put_string(out, t->key);
    puts_(out, ":{\"dtype\":\"");
    puts_(out, dtype);
    puts_(out, "\",\"shape\":[");
    for (uint32_t d = 0; d < t->ndim; d++) {
      if (d > 0)
        put(out, ",", 1);
      put_u64(out, (uint64_t)t->shape[d]);
    }
    puts_(out, "],\"data_offsets\":[");
    put_u64(out, at);
    put(out, ",", 1);
    put_u64(out, at + t->nbytes);
    puts_(out, "]}");
    at += t->nbytes;
  }
  put(out, "}", 1);
  while (out->len % 8 != 0)
    put(out, " ", 1);
  if (out->failed) {
    st_buf_free(out);
    return SP_ENOMEM;
  }
  uint64_t json = out->len - 8;
  if (json > ST_MAX_HEADER) {
    st_buf_free(out);
    return SP_ELIMIT;
  }
  for (int i = 0; i < 8; i++)
    out->data[i] = (char)(uint8_t)(json >> (8 * i));
  return 0;
}

void st_file_name(uint32_t file, uint32_t nfiles, char *buf, size_t size) {
  if (nfiles == 1)
    snprintf(buf, size, "model.safetensors");
  else
    snprintf(buf, size, "model-%05" PRIu32 "-of-%05" PRIu32 ".safetensors",
             file + 1, nfiles);
}

void st_index_begin(struct st_buf *out, uint64_t total_size) {
  memset(out, 0, sizeof *out);
  puts_(out, "{\n  \"metadata\": {\n    \"total_size\": ");
  put_u64(out, total_size);
  puts_(out, "\n  },\n  \"weight_map\": {");
}

void st_index_add(struct st_buf *out, const char *key, uint32_t file,
                  uint32_t nfiles, bool first) {
  char name[64];
  st_file_name(file, nfiles, name, sizeof name);
  puts_(out, first ? "\n    " : ",\n    ");
  put_string(out, key);
  puts_(out, ": ");
  put_string(out, name);
}

int st_index_end(struct st_buf *out) {
  puts_(out, "\n  }\n}\n");
  if (out->failed) {
    st_buf_free(out);
    return SP_ENOMEM;
  }
  return 0;
}
