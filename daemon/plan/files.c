/*
 * files.c - the numbering of a save's files; see files.h.
 *
 * Two passes over the keys: the first counts each owner's files, so that
 * the second can give each owner's first file its number (the files of
 * all lower ranks come first) and then number the rest in order.  Both
 * passes cut an owner's keys at the same places, by the one rule in
 * starts_file().
 */
#include <stdbool.h>
#include <stdlib.h>

#include "daemon/plan/files.h"
#include "shardport.h"

/* Whether a key of bytes starts a new file of an owner whose current file
 * already holds used bytes and any key at all (open). */
static bool starts_file(bool open, uint64_t used, uint64_t bytes,
                        uint64_t limit) {
  if (!open)
    return true;
  /* An empty file takes anything; past that, a key that does not fit in
   * what is left starts the next one.  Written as a difference so that
   * used + bytes cannot overflow. */
  return used > 0 && bytes > limit - (used < limit ? used : limit);
}

int plan_files_number(size_t nkeys, const uint32_t *owner,
                      const uint64_t *nbytes, uint32_t world, uint64_t limit,
                      uint32_t *file, uint32_t *nfiles) {
  if (limit == 0)
    limit = 1;
  /* Per owner: whether it has a file open, the bytes in it, and (first
   * pass) how many files it has, (second pass) its current file's
   * number. */
  bool *open = calloc(world > 0 ? world : 1, sizeof *open);
  uint64_t *used = calloc(world > 0 ? world : 1, sizeof *used);
  uint32_t *count = calloc(world > 0 ? world : 1, sizeof *count);
  if (open == NULL || used == NULL || count == NULL) {
    free(open);
    free(used);
    free(count);
    return SP_ENOMEM;
  }
  for (size_t k = 0; k < nkeys; k++) {
    uint32_t r = owner[k];
    if (starts_file(open[r], used[r], nbytes[k], limit)) {
      count[r]++;
      open[r] = true;
      used[r] = 0;
    }
    used[r] += nbytes[k];
  }
  /* count[r] becomes the number of rank r's first file. */
  uint32_t total = 0;
  for (uint32_t r = 0; r < world; r++) {
    uint32_t n = count[r];
    count[r] = total;
    total += n;
    open[r] = false;
    used[r] = 0;
  }
  for (size_t k = 0; k < nkeys; k++) {
    uint32_t r = owner[k];
    if (starts_file(open[r], used[r], nbytes[k], limit)) {
      if (open[r])
        count[r]++;
      open[r] = true;
      used[r] = 0;
    }
    used[r] += nbytes[k];
    file[k] = count[r];
  }
  *nfiles = total;
  free(open);
  free(used);
  free(count);
  return 0;
}
