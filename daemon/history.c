/*
 * history.c - the last finished exports of a job, for the operator
 * (docs/protocol.md, "job_status"): a ring of export_history entries, the
 * newest kept.
 *
 * The ring is allocated by the job's first finished export, so a job that
 * never exports costs nothing.  An entry that cannot be stored (no memory)
 * is counted and dropped: the history is what status shows, never what an
 * export depends on.  Used from the loop only.
 */
#include <stdlib.h>
#include <string.h>

#include "daemon/history.h"

void history_init(struct history *h, uint32_t cap) {
  memset(h, 0, sizeof *h);
  h->cap = cap;
}

void history_free(struct history *h) {
  for (uint32_t i = 0; h->ring != NULL && i < h->count; i++)
    free(h->ring[i].error);
  free(h->ring);
  h->ring = NULL;
  h->count = 0;
}

void history_add(struct history *h, const struct history_entry *e) {
  h->total++;
  if (h->cap == 0)
    return;
  if (h->ring == NULL) {
    h->ring = calloc(h->cap, sizeof *h->ring);
    if (h->ring == NULL)
      return;
  }
  char *error = NULL;
  if (e->error != NULL && (error = strdup(e->error)) == NULL)
    return;
  struct history_entry *slot = &h->ring[h->next];
  if (h->count == h->cap)
    free(slot->error);
  else
    h->count++;
  *slot = *e;
  slot->error = error;
  h->next = (h->next + 1) % h->cap;
}

const struct history_entry *history_at(const struct history *h, uint32_t i) {
  return &h->ring[(h->next + h->cap - 1 - i) % h->cap];
}
