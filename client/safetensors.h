/*
 * safetensors.h - what a save writes besides the tensors' bytes: each
 * file's safetensors header, the files' names and the checkpoint's index
 * (docs/checkpoints.md).  Pure code over memory; client/save.c writes it.
 */
#ifndef SP_CLIENT_SAFETENSORS_H
#define SP_CLIENT_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/dtype.h"
#include "shardport.h"

/* A growing buffer; a failed allocation sticks, and the builder that sees
 * it frees the buffer and returns SP_ENOMEM. */
struct st_buf {
  char *data;
  size_t len, cap;
  bool failed;
};
void st_buf_free(struct st_buf *b);

/* One tensor of a file, in the file's order (key order). */
struct st_tensor {
  const char *key;
  enum sp_dtype dtype;
  uint32_t ndim;
  const int64_t *shape;
  uint64_t nbytes;
};

/* The largest JSON header safetensors' own reader accepts (its
 * MAX_HEADER_SIZE): a file with a larger one cannot be loaded. */
#define ST_MAX_HEADER 100000000u

/* The file's first bytes: the 8-byte length, then the JSON header with
 * __metadata__ ({"format": "pt"} and the caller's strings) and each
 * tensor's dtype, shape and data_offsets, padded with spaces to a multiple
 * of 8.  0, SP_EDTYPE for a dtype safetensors cannot name, SP_ELIMIT for
 * a header longer than ST_MAX_HEADER, or SP_ENOMEM. */
int st_header(const struct st_tensor *tensors, size_t n,
              const sp_metadata *metadata, size_t nmetadata,
              struct st_buf *out);

/* "model.safetensors" when nfiles is 1, else "model-00002-of-00005..."
 * for file 1 (files count from 0 here, from 1 in the name). */
void st_file_name(uint32_t file, uint32_t nfiles, char *buf, size_t size);

/* model.safetensors.index.json: begin, one add per key in key order (the
 * first with first true), end (0 or SP_ENOMEM, the buffer freed). */
void st_index_begin(struct st_buf *out, uint64_t total_size);
void st_index_add(struct st_buf *out, const char *key, uint32_t file,
                  uint32_t nfiles, bool first);
int st_index_end(struct st_buf *out);

#endif /* SP_CLIENT_SAFETENSORS_H */
