/*
 * request.h - requests decoded and bounded: the one place that validates them
 * (request.c).
 */
#ifndef SP_DAEMON_REQUEST_H
#define SP_DAEMON_REQUEST_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/cuda/gpu.h"
#include "daemon/layer.h"
#include "daemon/plan/consume.h"
#include "daemon/plan/plan.h"
#include "proto/limits.h"

/* Bounds from docs/protocol.md, "Jobs". */
#define REQ_MAX_WORLD 65536u
#define REQ_MAX_KEY 1024u
#define REQ_MAX_VALUE ((UINT64_C(1) << 62) - 1)
#define REQ_MAX_PER_RANK 1048576u
#define REQ_MAX_DEVICE 64u
#define REQ_MAX_TIMEOUT_MS 86400000u
/* The bytes of a rank's own refusal of a save that travel to every rank. */
#define REQ_MAX_REFUSAL 512u

#define JOB_ID_BYTES 16
#define JOB_SECRET_BYTES 16
/* An NCCL unique id (ncclUniqueId), reserved in version 2 tickets. */
#define NODE_NCCL_ID_BYTES 128

/* Consumers one job may have (SP_MAX_CONSUMERS). */
#define REQ_MAX_CONSUMERS 4096u
/* Pieces one consumer target may have. */
#define REQ_MAX_TARGET_PIECES 65536u

struct req_job_create {
  uint32_t world;
  uint32_t consumers;
};

struct req_join {
  const uint8_t *ticket; /* into the frame */
  size_t ticket_len;
  uint32_t rank;
  uint32_t world;
  uint32_t device_type; /* enum sp_device_type */
  char device[REQ_MAX_DEVICE + 1];
};

/* What a ticket holds (docs/protocol.md, "job_create"). */
struct req_ticket {
  uint32_t version; /* 1, or 2 for a job that may span nodes */
  uint8_t job[JOB_ID_BYTES];
  uint8_t secret[JOB_SECRET_BYTES];
  uint32_t world;
  uint32_t consumers; /* 0 when the ticket names none */
  /* Version 2: the root daemon's peer address ("" in version 1), and the
   * job's NCCL unique id when the root made one. */
  char root[NODE_ADDR_MAX];
  bool has_nccl_id;
  uint8_t nccl_id[NODE_NCCL_ID_BYTES];
};

enum req_storage_kind {
  REQ_STORAGE_MEMFD,    /* a memfd or shm file: fd, offset */
  REQ_STORAGE_CUDA_IPC, /* a CUDA IPC handle of the allocation base: handle */
  REQ_STORAGE_CUDA_FD,  /* a cuMem POSIX descriptor of the allocation: fd */
};

struct req_storage {
  uint32_t sid;
  enum req_storage_kind kind;
  uint32_t fd; /* index among the frame's descriptors (memfd, cuda_fd) */
  uint64_t offset;
  uint64_t length;
  uint64_t base;
  uint8_t handle[GPU_IPC_HANDLE_BYTES]; /* cuda_ipc, decoded */
  /* cuda kinds: "cuda:<GPU UUID>" the storage lives on; "" for the
   * rank's own device. */
  char device[REQ_MAX_DEVICE + 1];
};

struct req_tensor {
  const char *key; /* into the frame, not terminated */
  size_t key_len;
  uint32_t sid;
  struct sp_view view;
  enum plan_placement placement;
  uint32_t ndim; /* of the global shape */
  int64_t shape[SP_MAX_DIMS];
  size_t npieces;
  struct affine_piece *pieces; /* one block with the holders; owned */
};

/* Together-groups: names in one blob (each ended by NUL, each group by an
 * empty name) that plan_group arrays point into; the blob's bytes compare
 * equal exactly when the groups are the same list. */
struct req_groups {
  size_t ngroups;
  struct plan_group *groups;
  const char **names;
  char *blob;
  size_t blob_len;
};

/* A save's options as one rank asked (docs/protocol.md, export "save"):
 * what every rank must ask alike (the file limit, overwrite, and digests
 * of the directory and the metadata, client/save.c), and the rank's own
 * refusal, a code and its words, when it cannot take part. */
struct req_save {
  uint64_t limit; /* 0: an export */
  bool overwrite;
  uint64_t directory, metadata;
  int refused; /* 0, or a negative code */
  char refusal[REQ_MAX_REFUSAL + 1];
};

struct req_export {
  uint32_t max_keys;   /* 0: the planner's default */
  uint64_t max_bytes;  /* 0: the daemon's default */
  uint32_t timeout_ms; /* 0: the daemon's default */
  bool progress;
  struct req_groups groups;
  /* save.limit 0: an export; else a save (daemon/save.h) whose files
   * hold at most that many bytes of tensors. */
  struct req_save save;
};

/* A consumer's target (docs/protocol.md, "target_add"), as the planner
 * reads it (daemon/plan/consume.h) but with storages named by the
 * consumer's sids: the daemon turns them into indices.  key is a copy,
 * NUL-terminated; the pieces are owned. */
struct req_target {
  struct consume_target t;
  char *key;
  struct consume_piece *pieces;
  uint32_t sid; /* whole, shard */
  uint32_t *piece_sid; /* [npieces]: one block with pieces */
};

/* push (a rank) and receive (a consumer; only timeout_ms). */
struct req_push {
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms;
};

/* Each returns 0, or a negative code with a sentence in msg naming the
 * field.  Arrays come back malloc'ed; free them with the matching call. */
int request_parse_job_create(const msgpack_object *map,
                             struct req_job_create *out, char *msg,
                             size_t msglen);
int request_parse_join(const msgpack_object *map, struct req_join *out,
                       char *msg, size_t msglen);
/* consumer_join: the same fields, "consumer" and "consumers" in place of
 * "rank" and "world". */
int request_parse_consumer_join(const msgpack_object *map,
                                struct req_join *out, char *msg,
                                size_t msglen);
int request_parse_targets(const msgpack_object *map, struct req_target **out,
                          size_t *n, char *msg, size_t msglen);
void request_targets_free(struct req_target *t, size_t n);
int request_parse_push(const msgpack_object *map, struct req_push *out,
                       char *msg, size_t msglen);
/* A ticket's bytes, decoded with the bounded decoder: 0 or SP_ETICKET. */
int request_parse_ticket(const uint8_t *data, size_t len,
                         const struct sp_limits *limits,
                         struct req_ticket *out);
/* "cpu" or "cuda:<GPU UUID>": 0 and the device type, or SP_EINVAL. */
int request_parse_device(const char *s, size_t len, uint32_t *type);
/* nfds: the descriptors the frame carries (each storage names one). */
int request_parse_storages(const msgpack_object *map, size_t nfds,
                           struct req_storage **out, size_t *n, char *msg,
                           size_t msglen);
int request_parse_tensors(const msgpack_object *map, struct req_tensor **out,
                          size_t *n, char *msg, size_t msglen);
void request_tensors_free(struct req_tensor *t, size_t n);
int request_parse_export(const msgpack_object *map, struct req_export *out,
                         char *msg, size_t msglen);
void request_groups_free(struct req_groups *g);
int request_parse_release(const msgpack_object *map, uint64_t *export_id,
                          char *msg, size_t msglen);
/* job_status, job_abort: "job", a job id or a unique prefix of one (1 to
 * 32 hex digits), lowercased into out. */
int request_parse_job_ref(const msgpack_object *map,
                          char out[2 * JOB_ID_BYTES + 1], char *msg,
                          size_t msglen);
/* jobs: "after", a whole job id, or "" when absent. */
int request_parse_jobs(const msgpack_object *map,
                       char after[2 * JOB_ID_BYTES + 1], char *msg,
                       size_t msglen);

#endif /* SP_DAEMON_REQUEST_H */
