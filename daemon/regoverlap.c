/*
 * regoverlap.c - a file range against a registry's host storages.
 *
 * A host storage's place in its file is its mapping's file offset plus
 * where the storage starts in that mapping (regmap.c maps whole pages and
 * shares them between storages, so the mapping alone would claim bytes no
 * storage holds).  Each storage is visited once: this runs when a consumer
 * registers, never during a push.
 */
#include "daemon/regoverlap.h"

uint32_t regoverlap_sid(const struct registry *reg, dev_t dev, ino_t ino,
                        uint64_t offset, uint64_t length) {
  uint32_t found = 0;
  /* A range past 2^64 is cut at the end of the address space: no file
   * reaches further. */
  uint64_t last = length > UINT64_MAX - offset ? UINT64_MAX : offset + length;

  if (length == 0)
    return 0;
  for (size_t i = 0; i < reg->nstorages; i++) {
    const struct xfer_storage *info = &reg->info[i];
    if (info->data == NULL || reg->storages[i].nbytes == 0)
      continue;
    const struct reg_map *m = &reg->maps[info->map];
    const struct reg_file *f = &reg->files[m->file];
    if (f->dev != dev || f->ino != ino)
      continue;
    uint64_t start =
        m->offset + (uint64_t)(info->data - (const uint8_t *)m->addr);
    uint64_t end = start + reg->storages[i].nbytes;
    if (start < last && offset < end && (found == 0 || info->sid < found))
      found = info->sid;
  }
  return found;
}
