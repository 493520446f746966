/*
 * files.h - which checkpoint file each key of a save is written to.
 *
 * A save (docs/checkpoints.md) has every owner write the keys it owns into
 * safetensors files of its own.  Every rank and every daemon of the job
 * must agree on the numbering without talking about it, so it is a pure
 * function of what the plan already fixed: the keys in name order, each
 * key's owner and byte size, and the caller's limit on one file's bytes.
 */
#ifndef SP_DAEMON_PLAN_FILES_H
#define SP_DAEMON_PLAN_FILES_H

#include <stddef.h>
#include <stdint.h>

/*
 * Numbers the files of a save.  Owners are taken in rank order, and each
 * owner's keys in the order given (name order); a key goes into its
 * owner's current file unless that file already holds bytes and the key's
 * bytes would take it past limit, in which case the owner starts its next
 * file.  So:
 *   - one owner's keys never share a file with another owner's;
 *   - a file holds at most limit bytes of tensors, unless one key alone
 *     holds more (it then has a file of its own);
 *   - files are numbered 0, 1, ... without gaps, rank 0's first; an owner
 *     with no keys has no file;
 *   - everything owned by one rank and within limit is one file.
 * The bytes counted are the tensors' own (a file's header is not counted,
 * as other tools that cut checkpoints count them).
 *
 * file[k] receives key k's file; *nfiles the count (0 only when nkeys is
 * 0).  limit 0 is treated as 1: every key with bytes gets a file of its
 * own.  owner[k] must be below world.  Returns 0, or SP_ENOMEM (file and
 * *nfiles are then not set).
 */
int plan_files_number(size_t nkeys, const uint32_t *owner,
                      const uint64_t *nbytes, uint32_t world, uint64_t limit,
                      uint32_t *file, uint32_t *nfiles);

#endif /* SP_DAEMON_PLAN_FILES_H */
