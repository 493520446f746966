/*
 * shardport.h - the public C API of libshardport.
 *
 * A training process talks to the node's shardportd through an opaque
 * sp_client.  Every function returns 0 (or a non-negative count) on success
 * and a negative SP_E* code on failure; sp_strerror() and sp_err_name() turn
 * a code into text.  The library never aborts and never prints.
 *
 * Ownership: whatever a function hands out through an out-pointer belongs to
 * the caller and is released with the matching *_free / sp_close call.
 */
#ifndef SHARDPORT_H
#define SHARDPORT_H

#include <stddef.h>
#include <stdint.h>

#include "shardport_version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SP_BUILDING_LIBRARY)
#define SP_EXPORT __attribute__((visibility("default")))
#else
#define SP_EXPORT
#endif

/*
 * The one table of error codes, shared by the daemon (which sends the wire
 * name in an `error` reply), the library and the CLI.  Numbers are stable:
 * append new codes, never renumber, and keep a retired number unused.
 *
 *   X(NAME, number, "wire_name", "message")
 */
#define SP_ERROR_MAP(X)                                                        \
  /* transport and framing */                                                  \
  X(IO, 1, "io", "input/output error on the connection")                       \
  X(NODAEMON, 2, "no_daemon", "shardportd is not running at that socket")      \
  X(CLOSED, 3, "closed", "the peer closed the connection")                     \
  X(VERSION, 4, "version_mismatch", "protocol version mismatch")               \
  X(FRAMETOOBIG, 5, "frame_too_large", "frame is larger than the limit")       \
  X(MALFORMED, 6, "malformed", "frame is not one well-formed msgpack map")     \
  X(TOODEEP, 7, "too_deep", "msgpack nesting is deeper than the limit")        \
  X(TOOMANY, 8, "too_many_items",                                              \
    "a container declares more items than the frame or the limit allows")      \
  X(STRTOOLONG, 9, "string_too_long", "a string is longer than the limit")     \
  X(TOOMANYFDS, 10, "too_many_fds",                                            \
    "a frame carries more file descriptors than allowed")                      \
  X(UNEXPECTEDFD, 11, "unexpected_fd",                                         \
    "a file descriptor arrived where none is expected")                        \
  X(BADMSG, 12, "bad_message", "a message field is missing or has a bad type") \
  X(UNKNOWNOP, 13, "unknown_op", "unknown operation")                          \
  X(PERM, 14, "permission_denied", "permission denied")                        \
  X(NOMEM, 15, "no_memory", "out of memory")                                   \
  X(TIMEOUT, 16, "timeout", "the operation timed out")                         \
  X(INVAL, 17, "invalid_argument", "invalid argument")                         \
  X(BUSY, 18, "busy", "the resource is busy")                                  \
  X(INTERNAL, 19, "internal", "internal error in shardport")                   \
  X(HELLO, 20, "hello_required", "the first frame must be hello")              \
  X(LIMIT, 21, "limit_exceeded", "a configured limit was exceeded")            \
  /* views and storages */                                                     \
  X(DTYPE, 40, "unknown_dtype", "unknown dtype")                               \
  X(OVERFLOW, 41, "overflow", "a size or extent computation overflows")        \
  X(OUTOFBOUNDS, 42, "view_out_of_bounds",                                     \
    "a view reaches outside its storage")                                      \
  X(ZEROSTRIDE, 43, "zero_stride", "a view has a zero stride")                 \
  X(SELFOVERLAP, 44, "self_overlap", "a view reaches one address twice")       \
  X(NOSTORAGE, 45, "no_such_storage", "the view names an unknown storage")     \
  X(DUPKEY, 46, "duplicate_key", "a key is registered twice")                  \
  X(BADFD, 47, "bad_fd", "a storage fd is unusable or too small")              \
  /* cross-rank validation */                                                  \
  X(KEYSET, 60, "key_set_mismatch", "ranks disagree on the set of keys")       \
  X(PLACEMENT, 61, "placement_mismatch", "ranks disagree on a key's placement") \
  X(DTYPEMISMATCH, 62, "dtype_mismatch", "ranks disagree on a key's dtype")    \
  X(DEVICEMISMATCH, 63, "device_mismatch",                                     \
    "ranks disagree on a key's device type")                                   \
  X(SHAPE, 64, "shape_mismatch", "ranks disagree on a key's global shape")     \
  X(TILING, 65, "bad_tiling", "dim-0 shards do not tile the global shape")      \
  X(MIXEDDEVICE, 66, "mixed_devices",                                          \
    "a key's shards are on more than one device type")                         \
  X(EXPERT, 67, "expert_conflict", "an expert key is held by more than one rank") \
  X(GROUPS, 68, "group_mismatch", "ranks disagree on the together-groups")     \
  X(BYTES, 69, "bytes_mismatch", "byte counts disagree with the views")        \
  X(DOUBLEWRITE, 70, "written_twice",                                          \
    "an element is written by two holders that are not both replicas")         \
  X(UNCOVERED, 71, "uncovered", "an element of the full tensor is not held")   \
  X(DIFFERENT, 72, "different_data", "replicas hold different data")           \
  X(UNSUPPORTED, 73, "unsupported_layout", "unsupported layout")               \
  X(SOURCEBOUNDS, 74, "source_out_of_bounds",                                  \
    "a piece reads outside its rank's shard")                                  \
  X(DESTBOUNDS, 75, "dest_out_of_bounds",                                      \
    "a piece writes outside the full tensor")                                  \
  /* jobs and exports */                                                       \
  X(NOJOB, 90, "no_such_job", "no such job")                                   \
  X(NOEXPORT, 91, "no_such_export", "no such export")                          \
  X(EXPORTING, 92, "export_in_progress", "an export is already in progress")   \
  X(RANK, 93, "bad_rank", "rank is out of range or already joined")            \
  X(RANKLOST, 94, "rank_lost", "a rank left or died during the export")        \
  X(NODELOST, 95, "node_lost", "a peer daemon was lost during the export")     \
  X(DIGEST, 96, "plan_digest_mismatch", "daemons computed different plans")    \
  X(TICKET, 97, "bad_ticket", "the job ticket or its secret is not valid")     \
  X(STATE, 98, "bad_state", "the request does not fit the job's state")        \
  X(BACKEND, 99, "backend", "the memory or transport backend failed")          \
  X(POOL, 100, "pool_exhausted", "the memory pool is exhausted")            \
  X(ABORTED, 101, "aborted", "the job was aborted by its owner or root")      \
  X(DAEMONSTOPPING, 102, "daemon_stopping",                                    \
    "shardportd is stopping and takes no new jobs, ranks or exports")          \
  X(DAEMONRESTARTED, 103, "daemon_restarted",                                  \
    "shardportd stopped or restarted; the job is gone, create it again")      \
  X(CONSUMERLOST, 104, "consumer_lost",                                        \
    "a consumer left or died during the push")                                 \
  /* checkpoints */                                                            \
  X(EXISTS, 120, "checkpoint_exists",                                          \
    "a checkpoint exists in that directory already")                           \
  X(WRITE, 121, "write_failed", "a rank could not write its checkpoint files")

typedef enum sp_error {
#define SP_ERROR_ENUM(name, num, wire, msg) SP_E##name = -(num),
  SP_ERROR_MAP(SP_ERROR_ENUM)
#undef SP_ERROR_ENUM
} sp_error;

/* A human sentence for a code; never NULL, also for unknown codes. */
SP_EXPORT const char *sp_strerror(int code);
/* The wire name of a code ("frame_too_large"); "unknown" for unknown codes. */
SP_EXPORT const char *sp_err_name(int code);

/* The socket path used when none is given (docs/operations.md, "Socket
 * paths"): $SHARDPORT_SOCKET; else for root the system socket
 * /run/shardport/shardport.sock; else $XDG_RUNTIME_DIR/shardport.sock when
 * a socket is there, else the system socket when one is there, else
 * $XDG_RUNTIME_DIR/shardport.sock when XDG_RUNTIME_DIR is an absolute
 * path, else the system socket.  Returns 0 and writes at most size bytes,
 * or SP_EINVAL when it does not fit (buf is then ""). */
SP_EXPORT int sp_default_socket_path(char *buf, size_t size);
/* As sp_default_socket_path; *origin (when origin is not NULL) receives a
 * static phrase saying where the path came from, for messages ("from
 * $SHARDPORT_SOCKET", "the system socket: XDG_RUNTIME_DIR is not set"). */
SP_EXPORT int sp_default_socket_origin(char *buf, size_t size,
                                       const char **origin);

/* Writes bytes into buf (size bytes; "" never) as shardport writes every
 * size a person reads, in the CLI, the daemon's log and the demo alike:
 * "512 B", "1.5 KiB", ... "16.0 EiB" (binary units, one decimal).
 * Returns buf. */
SP_EXPORT const char *sp_format_bytes(uint64_t bytes, char *buf, size_t size);

typedef struct sp_client sp_client;

/* Connects and performs the hello exchange.  path NULL means the default
 * path.  On failure *out is untouched; SP_ENODAEMON means nothing listens,
 * SP_EPERM that the socket or the daemon refused this process, SP_EVERSION
 * that the daemon speaks another protocol version.  The socket is
 * close-on-exec.  A client serves one thread at a time. */
SP_EXPORT int sp_connect(const char *path, sp_client **out);
/* As sp_connect; on failure why (whylen bytes; NULL when whylen is 0)
 * receives a sentence for a person: the path tried and, for the default
 * path, where it came from; what went wrong (nothing there, a socket
 * nobody answers on, the file system's permissions, the daemon's own
 * refusal in its words); and what to do about it. */
SP_EXPORT int sp_connect_explain(const char *path, sp_client **out, char *why,
                                 size_t whylen);
/* Closes the connection and frees the client; NULL is allowed. */
SP_EXPORT void sp_close(sp_client *client);

/* How long each later request on client may take, in milliseconds (default
 * 30000; 0 waits forever).  A request that takes longer fails with
 * SP_ETIMEOUT; the client stays usable and drops the late reply.  A client
 * whose request could not be written whole fails every later request with
 * the error that broke it.  Returns 0 or SP_EINVAL. */
SP_EXPORT int sp_set_timeout(sp_client *client, uint32_t timeout_ms);

/* The daemon's own text from the last error reply on client ("" when none
 * came); it says more than sp_strerror, such as which limit or which rank.
 * When the library itself refused a reply (sp_export: SP_EBADMSG), it holds
 * the library's reason instead.  Valid until the next call on client. */
SP_EXPORT const char *sp_last_message(const sp_client *client);

/* A round trip; *rtt_ns (optional) receives its duration. */
SP_EXPORT int sp_ping(sp_client *client, uint64_t *rtt_ns);

/* One daemon of a job across nodes, as the daemon answering sees it. */
typedef struct sp_node_status {
  uint32_t node;           /* its node number in the job (0: the job's root) */
  char *address;           /* "addr:port" other daemons dial */
  int self;                /* 1: the daemon that answered */
  int connected;           /* 1: a connection to it is up (always for self) */
  uint64_t bytes_sent;     /* bytes of exports sent to it */
  uint64_t bytes_received; /* bytes of exports received from it */
} sp_node_status;

/* The daemon's view of one job, as sp_status reports it. */
typedef struct sp_job_status {
  char *job_id;         /* hex id */
  char *phase;          /* waiting, planning, allocating, moving, publishing,
                           writing (a save), published, failed */
  char *error;          /* set when phase is failed, else NULL */
  uint32_t world;       /* ranks in the job */
  uint32_t joined;      /* ranks joined on this daemon's view */
  uint32_t round;       /* current round, 1-based; 0 before the first */
  uint32_t rounds;      /* rounds in the plan */
  uint64_t bytes_moved; /* bytes moved by the export so far */
  uint64_t bytes_total; /* bytes the export will move */
  double rate_bps;      /* recent bytes per second */
  /* The last plan's digest as 16 hex digits ("" before the first plan;
   * NULL from a daemon that does not report it): equal on every daemon of
   * a job across nodes. */
  char *plan_digest;
  uint32_t node;          /* this daemon's node number in the job */
  size_t nnodes;          /* 0 for a job on one daemon */
  sp_node_status *nodes;  /* the job's daemons, by node number */
  uint32_t asked;         /* ranks waiting for the next export */
  uint64_t export_id;     /* the running or last export (0 before the first) */
  /* The owners' pool segments of the running export on this daemon, and
   * how much of them is prepared (phase allocating: before round 1). */
  uint64_t bytes_prepared;
  uint64_t bytes_to_prepare;
  /* A save (phase writing): the tensor bytes this daemon's ranks have
   * written to their files, and will write. */
  uint64_t bytes_written;
  uint64_t bytes_to_write;
  /* Consumers (docs/protocol.md, "Consumers"): how many the job was
   * created with, each as this daemon sees it, and its pushes. */
  uint32_t nconsumers;
  struct sp_consumer_status *consumers; /* [nconsumers], by index */
  uint64_t pushes;     /* pushes finished, delivered or failed */
  uint64_t push_plans; /* plans built for pushes: a push that reused the
                          previous push's plan (no registration changed)
                          adds none */
} sp_job_status;

/* One consumer of a job, as the daemon answering sees it. */
typedef struct sp_consumer_status {
  uint32_t index;
  char *state;  /* absent, joined, receiving (waits for or takes part in a
                   push), leaving */
  int64_t node; /* its node number in the job when known; else -1 */
  char *device; /* as it joined ("cpu", "cuda:<GPU UUID>"); "" when absent */
  uint64_t bytes_received; /* into its buffers, every push together */
} sp_consumer_status;

typedef struct sp_status_info {
  char *daemon_version;
  uint32_t protocol_version;
  char *backends_built;  /* comma-separated, e.g. "host,cuda" */
  char *backend_active;  /* "host" or "cuda" */
  char *backend_reason;  /* why that backend is active */
  double uptime_s;
  uint32_t clients;      /* connections open now */
  uint64_t pool_used;    /* bytes of the memory pool in use */
  uint64_t pool_capacity;
  size_t njobs;
  sp_job_status *jobs;
  /* Where other daemons reach this one for jobs across nodes; NULL when it
   * does not listen for them. */
  char *peer_address;
  /* 1: the daemon is stopping; it takes no new jobs or exports while the
   * running ones finish (docs/operations.md). */
  int draining;
  /* The longest the daemon's event loop was busy in one iteration since
   * the previous status request, in microseconds: how long any client may
   * have waited for an answer (0 from a daemon that does not report it). */
  uint64_t loop_max_busy_us;
} sp_status_info;

/* Fills *out with a newly allocated snapshot; free it with sp_status_free. */
SP_EXPORT int sp_status(sp_client *client, sp_status_info **out);
SP_EXPORT void sp_status_free(sp_status_info *status);

/* ---- the operator's view of jobs (docs/protocol.md, "jobs") ---- */

/* One job as sp_jobs lists it. */
typedef struct sp_job_entry {
  char *job_id;       /* 32 hex digits */
  char *phase;        /* as sp_job_status.phase */
  uint32_t owner_uid; /* who created it (the only user besides root who may
                         abort it) */
  uint32_t owner_pid; /* the process that created it */
  double age_s;       /* seconds since it was created */
  uint64_t exports;   /* exports finished, published or failed */
  uint32_t world;
  uint32_t joined;    /* ranks joined on this daemon */
  uint32_t asked;     /* of those, ranks waiting for the next export */
  uint64_t export_id; /* the running or last export (0 before the first) */
  uint32_t node;       /* this daemon's node number in the job */
  uint32_t node_count; /* daemons the job spans; 0 for a job on one daemon */
} sp_job_entry;

typedef struct sp_job_list {
  size_t njobs;
  sp_job_entry *jobs; /* in job id order */
} sp_job_list;

/* Every job of the daemon, fetched a page at a time; free with
 * sp_job_list_free. */
SP_EXPORT int sp_jobs(sp_client *client, sp_job_list **out);
SP_EXPORT void sp_job_list_free(sp_job_list *list);

/* One rank of a job as the daemon answering sees it. */
typedef struct sp_rank_info {
  char *state;  /* absent, joined, asked, exporting, pushing, leaving */
  uint32_t pid; /* its process, when it is served by this daemon; else 0 */
  int64_t node; /* its node number in the job when known; else -1 */
} sp_rank_info;

/* One finished export of a job. */
typedef struct sp_export_record {
  uint64_t export_id; /* 0: it failed while its ranks asked, unstarted */
  int failed;         /* 0: published */
  char *error;        /* "<code>: <message>" when failed, else NULL */
  double age_s;       /* seconds since it ended */
  double duration_s;  /* from the first ask (or its start) to its end */
  uint32_t rounds;
  uint64_t bytes_moved;
  uint64_t bytes_total;
  double rate_bps;
} sp_export_record;

/* One job in full. */
typedef struct sp_job_detail {
  sp_job_status job;   /* the job as sp_status reports it */
  uint32_t owner_uid;
  uint32_t owner_pid;
  double age_s;
  uint64_t exports;    /* exports finished, of which history keeps the last */
  size_t nranks;       /* the job's world */
  sp_rank_info *ranks; /* by rank */
  size_t nhistory;
  sp_export_record *history; /* the last finished exports, newest first (the
                                daemon's export_history of them) */
} sp_job_detail;

/* The job whose id is job or starts with it (1 to 32 hex digits):
 * SP_ENOJOB when none, SP_EINVAL when the prefix fits several (or is not
 * hex).  Free *out with sp_job_detail_free. */
SP_EXPORT int sp_job_show(sp_client *client, const char *job,
                          sp_job_detail **out);
SP_EXPORT void sp_job_detail_free(sp_job_detail *detail);

/* Aborts the job whose id is job or starts with it, as sp_job_show finds
 * it: its running export and waiting ranks fail with SP_EABORTED, and its
 * ranks' connections end with it.  Only the job's owner and root may
 * (SP_EPERM).  job_id (optional, at least 33 bytes) receives the whole id. */
SP_EXPORT int sp_job_abort(sp_client *client, const char *job, char *job_id,
                           size_t size);

/* ---- jobs, registration and exports (docs/protocol.md, "Jobs") ---- */

/* Dimensions of a view; more are refused as invalid_argument. */
#define SP_MAX_DIMS 8
/* Bytes a ticket may take. */
#define SP_TICKET_MAX 512

/* A job's ticket: opaque bytes that rank 0's process gets from
 * sp_job_create and hands to its peers by its own means (a broadcast, a
 * file, an environment variable: it is plain bytes).  sp_job_create zeroes
 * the bytes past len, so the whole struct may be sent as it is. */
typedef struct sp_ticket {
  size_t len;
  uint8_t bytes[SP_TICKET_MAX];
} sp_ticket;

/* Creates a job of world ranks on this connection's daemon. */
SP_EXPORT int sp_job_create(sp_client *client, uint32_t world,
                            sp_ticket *ticket);
/* Joins this connection to the job as rank (0 <= rank < world).  device is
 * "cpu" for host storages or "cuda:<GPU UUID>".  One job per connection;
 * closing the connection leaves the job. */
SP_EXPORT int sp_job_join(sp_client *client, const sp_ticket *ticket,
                          uint32_t rank, uint32_t world, const char *device);
/* Writes "cuda:<GPU UUID>", the name sp_job_join takes for a GPU, of this
 * process's CUDA device ordinal (as cudaSetDevice and torch number it),
 * into buf.  Loads the CUDA runtime as CUDA storages do.  SP_EBACKEND
 * without a usable runtime (sp_last_message says why), SP_EINVAL for an
 * ordinal this process does not see or a buf of fewer than 48 bytes. */
SP_EXPORT int sp_cuda_device_name(sp_client *client, int ordinal, char *buf,
                                  size_t size);
/* Leaves the job: the daemon releases every export and registration of this
 * rank, and the library unmaps every set this rank still holds (their data
 * pointers become NULL; sp_release then only frees them). */
SP_EXPORT int sp_job_leave(sp_client *client);

/* What memory a storage is (sp_storage_desc.kind).  The CUDA kinds need a
 * rank joined with a "cuda:<GPU UUID>" device and a daemon serving the CUDA
 * backend; the library reaches the CUDA runtime at run time (it does not
 * link it; SHARDPORT_CUDART_LIB names the file), only when a call needs it.
 *
 * Readiness: the daemon reads a CUDA storage from the moment every rank
 * asked for an export.  A trainer must therefore have finished writing it
 * before it calls sp_export: synchronize the streams that wrote it
 * (cudaStreamSynchronize, torch.cuda.synchronize()) first. */
typedef enum sp_storage_kind {
  SP_STORAGE_MEMFD = 0,    /* host memory: bytes [offset, offset + length) of
                              the memfd or shm file fd */
  SP_STORAGE_CUDA = 1,     /* device memory at addr: the library gets the IPC
                              handle of its allocation, the offset from the
                              allocation's base and the GPU itself; offset,
                              fd, handle and device are ignored */
  SP_STORAGE_CUDA_IPC = 2, /* device memory given by handle: a
                              cudaIpcMemHandle_t of the allocation's base (64
                              bytes) or PyTorch's _share_cuda_() handle bytes,
                              with offset the storage's bytes from that base
                              (_share_cuda_()'s storage offset) */
  SP_STORAGE_CUDA_FD = 3,  /* device memory in a cuMem allocation (PyTorch's
                              expandable segments) exported as the POSIX
                              descriptor fd; offset into the allocation */
} sp_storage_kind;

/* A storage: memory the daemon reads the rank's tensors from.  The daemon
 * maps host storages read-only and never writes any storage.  Descriptors
 * stay the caller's (the daemon receives duplicates). */
typedef struct sp_storage_desc {
  uint32_t id;      /* chosen by the caller, unique within its rank */
  int fd;           /* SP_STORAGE_MEMFD and SP_STORAGE_CUDA_FD */
  uint64_t offset;  /* bytes into fd, or (CUDA_IPC) from the handle's base */
  uint64_t length;  /* bytes */
  const void *addr; /* the caller's own address of the storage's first byte
                       (a device address for the CUDA kinds); identity
                       tensors are returned as pointers into it */
  sp_storage_kind kind;   /* 0 (SP_STORAGE_MEMFD) when left zeroed */
  const void *handle;     /* SP_STORAGE_CUDA_IPC: the handle bytes */
  size_t handle_len;
  const char *device;     /* CUDA_IPC, CUDA_FD: "cuda:<GPU UUID>" of the
                             GPU it lives on, or NULL: the library asks the
                             runtime which GPU holds addr */
} sp_storage_desc;

/* Registers n storages; any number, sent in as many frames as the limits
 * need (32 descriptors a frame).  Each frame is registered whole or not at
 * all; on failure the storages of this call's earlier frames stay
 * registered.  SP_EINVAL, before anything is sent, for an unknown kind, a
 * negative fd where one is needed, a NULL addr with a non-zero length, a
 * CUDA_IPC storage without handle bytes, or an id already registered or
 * given twice; SP_EBACKEND when a CUDA storage needs the CUDA runtime and
 * it cannot be loaded, or the runtime refuses addr (sp_last_message says
 * why; a pointer into an expandable segment has no IPC handle: register it
 * as SP_STORAGE_CUDA_FD).  The daemon checks the rest (bad_fd for a file
 * shorter than offset + length, or an IPC handle it cannot open). */
SP_EXPORT int sp_register_storages(sp_client *client,
                                   const sp_storage_desc *storages, size_t n);

typedef enum sp_placement {
  SP_PLACEMENT_SHARD0 = 1, /* rows of the global shape, in rank order */
  SP_PLACEMENT_REPLICATED, /* whole on every rank (a replicated DTensor) */
  SP_PLACEMENT_PLAIN,      /* whole on every rank (a plain tensor) */
  SP_PLACEMENT_EXPERT,     /* whole on this rank only */
  SP_PLACEMENT_AFFINE,     /* pieces of the full tensor (sp_piece) */
} sp_placement;

/* An affine piece: a box of elements read from this rank's shard (the view,
 * taken row-major) and written into the full tensor (row-major). */
typedef struct sp_piece {
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t src_offset;
  int64_t src_stride[SP_MAX_DIMS];
  int64_t dst_offset;
  int64_t dst_stride[SP_MAX_DIMS];
  uint32_t nholders;
  const uint32_t *holders; /* ranks holding this piece, this one included */
} sp_piece;

typedef struct sp_tensor_desc {
  const char *key;
  uint32_t storage;  /* an sp_storage_desc id */
  const char *dtype; /* PyTorch name: "float32", "bfloat16", ... */
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS]; /* elements */
  int64_t offset;              /* storage offset, elements */
  sp_placement placement;
  uint32_t global_ndim;        /* the whole tensor's shape */
  int64_t global_shape[SP_MAX_DIMS];
  size_t npieces; /* affine only */
  const sp_piece *pieces;
} sp_tensor_desc;

/* Registers n tensors (keys unique within the job's rank), in as many
 * frames as their size needs; as with storages, each frame is registered
 * whole or not at all and earlier frames stay registered on failure.  The
 * daemon checks every view against its storage.  SP_EINVAL, before anything
 * is sent, for what the wire cannot carry: a NULL or empty key or one
 * longer than 1024 bytes, a NULL dtype, an unknown placement, more than
 * SP_MAX_DIMS dims, a negative shape, stride or offset, pieces on a
 * placement other than affine; SP_ELIMIT for one tensor whose description
 * alone exceeds 4 MiB or the msgpack items one frame may hold. */
SP_EXPORT int sp_register_tensors(sp_client *client,
                                  const sp_tensor_desc *tensors, size_t n);

/* Keys that must end on one owner. */
typedef struct sp_group {
  size_t nkeys;
  const char *const *keys;
} sp_group;

/* Valid during the callback only. */
typedef struct sp_progress {
  const char *phase; /* waiting, planning, moving, publishing; writing in a
                        save (sp_save) */
  uint32_t round;
  uint32_t rounds;
  uint64_t bytes_moved;
  uint64_t bytes_total;
  /* A save: the tensor bytes this rank has written to its files so far,
   * and will write in all (0 outside phase writing). */
  uint64_t bytes_written;
  uint64_t bytes_to_write;
} sp_progress;

typedef void (*sp_progress_fn)(const sp_progress *progress, void *arg);

typedef struct sp_export_opts {
  size_t ngroups;
  const sp_group *groups;
  uint32_t max_keys;   /* keys per round; 0: 4096 */
  uint64_t max_bytes;  /* traffic per round; 0: the daemon's default */
  uint32_t timeout_ms; /* 0: the daemon's default */
  sp_progress_fn progress; /* optional, called from inside sp_export */
  void *progress_arg;
} sp_export_opts;

/* A whole tensor this rank owns after an export. */
typedef struct sp_owned_tensor {
  const char *key;
  const char *dtype;
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
  /* The first element: in a pool segment the library mapped read-write
   * (the tensor is the rank's to use), or for identity in the caller's own
   * storage.  Valid until sp_release, sp_job_leave or sp_close, whichever
   * comes first; tied weights share one data pointer.  NULL only for an
   * empty tensor in an empty segment; an empty identity tensor's data may
   * lie past its storage's end, where the caller's own view put it.  For a
   * rank on a GPU it is a device address (device says which GPU), and the
   * library has waited for the daemon's completion event: the tensor is
   * assembled. */
  void *data;
  int identity; /* 1: data points into the caller's own storage (no copy) */
  const char *device; /* "cpu", or "cuda:<GPU UUID>" */
  int device_index;   /* this process's CUDA ordinal of that GPU; -1: cpu */
} sp_owned_tensor;

typedef struct sp_owned_set {
  uint64_t export_id;
  size_t ntensors;
  sp_owned_tensor *tensors; /* sorted by key */
} sp_owned_set;

/* Runs one export of the job: returns when every rank asked, the plan ran
 * and this rank's tensors are published, or with the job's one error (the
 * same code on every rank; sp_last_message names the key and ranks).
 * opts NULL means defaults.  *out is released with sp_release.
 *
 * The daemon bounds the wait for the other ranks, and for progress, with
 * opts->timeout_ms (0: its export_timeout, 1 minute by default) and then
 * fails the export with SP_ETIMEOUT on every rank.  The library waits for
 * each frame of the daemon (progress or reply) at most the client's timeout
 * plus opts->timeout_ms, or plus 24 hours (the protocol's longest) when
 * opts->timeout_ms is 0, so that the daemon's answer ends the wait.  Every reply is checked
 * before a pointer is formed (segments mapped once, their length taken from
 * the file, which must be sealed against shrinking; identity tensors only
 * into storages this rank registered; every view inside its bytes): a reply that fails is SP_EBADMSG, the export is
 * released and sp_last_message says why. */
SP_EXPORT int sp_export(sp_client *client, const sp_export_opts *opts,
                        sp_owned_set **out);
/* Unmaps the set, tells the daemon to free its memory, frees the set; set
 * NULL does nothing.  The set is freed even when the daemon's answer is an
 * error.  A set that sp_job_leave or sp_close already detached is only
 * freed (client is not used then); otherwise client must be the one that
 * exported it (SP_EINVAL, nothing freed). */
SP_EXPORT int sp_release(sp_client *client, sp_owned_set *set);

/* ---- consumers and pushes (docs/protocol.md, "Consumers") ----
 *
 * A consumer is a process outside the trainer ranks (an inference worker)
 * that receives the job's keys straight into its own buffers, laid out the
 * way it asks.  A job is created with its trainer ranks and nconsumers
 * consumers; each consumer joins on the daemon of its own node with the
 * job's ticket and its index, registers the buffers it grants the daemon
 * write access to (sp_register_storages on its connection) and, per key it
 * wants, where its part of the whole tensor lands (sp_register_targets).
 * Then, as often as they like, every trainer rank calls sp_push and every
 * consumer sp_receive: one push writes the trainers' current weights into
 * every consumer's targets, each element sent once by one trainer rank,
 * no whole tensor assembled unless a consumer asked for one.
 *
 * The daemon writes a consumer's buffers only during a push, that is
 * between the consumer's sp_receive request and its return, and nothing
 * else: trainers' memory is never written.
 */

/* Consumers one job may have. */
#define SP_MAX_CONSUMERS 4096

/* As sp_job_create, for a job of world trainer ranks and nconsumers
 * consumers (0 <= nconsumers <= SP_MAX_CONSUMERS; 0 is sp_job_create).
 * The ticket serves trainers and consumers alike. */
SP_EXPORT int sp_job_create_with_consumers(sp_client *client, uint32_t world,
                                           uint32_t nconsumers,
                                           sp_ticket *ticket);

/* Joins this connection to the job as consumer index (0 <= index <
 * nconsumers, nconsumers the job's), on the daemon of this process's own
 * node.  device is "cpu" for host buffers or "cuda:<GPU UUID>".  One job
 * per connection, as a rank or a consumer; sp_job_leave and sp_close leave
 * it.  SP_ERANK for an index out of range or joined already, SP_ETICKET,
 * SP_ESTATE and SP_EINVAL as sp_job_join.  This version delivers into host
 * buffers on the daemon that created the job: a GPU device, or a daemon
 * other than the job's root, is SP_EUNSUPPORTED (docs/protocol.md,
 * "consumer_join").  A consumer that leaves fails the push it
 * takes part in (SP_ECONSUMERLOST, naming its index, on every trainer and
 * consumer), and every push after it until it joins again. */
SP_EXPORT int sp_consumer_join(sp_client *client, const sp_ticket *ticket,
                               uint32_t index, uint32_t nconsumers,
                               const char *device);

/* Which part of the whole tensor a target holds. */
typedef enum sp_target_part {
  SP_TARGET_WHOLE = 1, /* the whole tensor, at the target's view */
  SP_TARGET_SHARD,     /* a slice along dim `dim` at the target's view: the
                          consumers holding the key as a shard concatenate
                          in consumer index order and tile that dim
                          (tensor parallel rows or columns; uneven and
                          empty shards allowed) */
  SP_TARGET_PIECES,    /* boxes of the whole tensor, each with its own
                          view in any of the consumer's storages: q, k and
                          v into one fused buffer at the engine's offsets */
} sp_target_part;

/* A box of the whole tensor (its first element start, its extent shape,
 * the target's ndim dims) and the view it lands at: strides and offset in
 * elements of the key's dtype in storage `storage`. */
typedef struct sp_target_piece {
  int64_t start[SP_MAX_DIMS];
  int64_t shape[SP_MAX_DIMS];
  uint32_t storage;
  int64_t stride[SP_MAX_DIMS];
  int64_t offset;
} sp_target_piece;

/* Where a consumer wants one key.  dtype and global_shape must be the
 * trainers'; the view (storage, shape, stride, offset: elements) is the
 * whole tensor's (whole) or the consumer's slice (shard, its shape the
 * whole shape but in dim `dim`); pieces for SP_TARGET_PIECES only. */
typedef struct sp_target_desc {
  const char *key;
  const char *dtype; /* PyTorch name, as sp_tensor_desc */
  uint32_t ndim;
  int64_t global_shape[SP_MAX_DIMS];
  sp_target_part part;
  uint32_t storage; /* whole, shard: an sp_storage_desc id */
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
  int64_t offset;
  uint32_t dim; /* shard */
  size_t npieces;
  const sp_target_piece *pieces;
} sp_target_desc;

/* Registers n targets of this consumer, any subset of the job's keys, in
 * as many frames as they need; each frame is registered whole or not at
 * all, earlier frames stay registered on failure.  SP_EINVAL, before
 * anything is sent, for what the wire cannot carry (as sp_register_tensors:
 * a bad key, a NULL dtype, more than SP_MAX_DIMS dims, a negative shape,
 * start, stride or offset, an unknown part, pieces on a part other than
 * SP_TARGET_PIECES, a dim not below ndim); SP_ESTATE on a connection that
 * is not a consumer.  The daemon checks each view against its storage at
 * once (SP_ENOSTORAGE: register the storages first; SP_EOUTOFBOUNDS,
 * SP_EZEROSTRIDE, SP_ESELFOVERLAP); the rest (the trainers' keys, dtypes,
 * shapes, tilings, a key listed twice, aliasing between consumers) is the
 * planner's, and refuses the push on every trainer and consumer alike
 * (docs/planner.md, "Consumers").
 *
 * A consumer's storages (sp_register_storages on its connection) are the
 * buffers it grants the daemon write access to: on the host backend memfd
 * storages only, of a file the daemon can map writable (SP_EBADFD
 * otherwise), refused with SP_EPERM when they share a byte with memory a
 * trainer of the node registered; a trainer's storage registered later
 * over a consumer's buffer fails the next push with SP_EPERM on every
 * trainer and consumer, before anything is written. */
SP_EXPORT int sp_register_targets(sp_client *client,
                                  const sp_target_desc *targets, size_t n);

typedef struct sp_push_opts {
  uint32_t max_keys;   /* keys per round; 0: 4096 */
  uint64_t max_bytes;  /* traffic per round; 0: the daemon's default */
  uint32_t timeout_ms; /* 0: the daemon's export_timeout */
} sp_push_opts;

/* What one push did, on a trainer or a consumer. */
typedef struct sp_push_result {
  uint64_t push_id;  /* the job's pushes, numbered from 1 */
  uint64_t bytes;    /* a trainer: bytes this rank sent; a consumer: bytes
                        written into its buffers */
  int plan_reused;   /* 1: the previous push's plan was reused (no
                        registration of any trainer or consumer changed) */
} sp_push_result;

/* Pushes the trainers' current weights into every consumer: a collective
 * over the job's trainer ranks, which must pass the same max_keys and
 * max_bytes (SP_EINVAL on every rank otherwise).  The push starts once
 * every rank pushed and every consumer called sp_receive, and returns
 * when every consumer's every byte is in place, or with the push's one
 * error, the same code and message on every trainer and consumer: the
 * planner's refusals, SP_ECONSUMERLOST or SP_ERANKLOST naming who left,
 * SP_ETIMEOUT naming who did not come within timeout_ms, SP_EBADFD for a
 * file cut short.  As for sp_export, a trainer must have finished writing
 * its storages before it calls.  out (optional) is filled on success. */
SP_EXPORT int sp_push(sp_client *client, const sp_push_opts *opts,
                      sp_push_result *out);

/* Takes part in the job's next push as a consumer: returns when every byte
 * this consumer asked for is in its buffers (on GPUs: with the daemon's
 * stream work complete), or with the push's error (sp_push says which).
 * timeout_ms bounds the wait for the push to start and for its progress
 * (0: the daemon's export_timeout).  Until it returns, the daemon may
 * write every target; after, it writes none until the next sp_receive.
 * out (optional) is filled on success. */
SP_EXPORT int sp_receive(sp_client *client, uint32_t timeout_ms,
                         sp_push_result *out);

/* ---- checkpoints (docs/checkpoints.md) ---- */

/* One string of a checkpoint's __metadata__. */
typedef struct sp_metadata {
  const char *key;
  const char *value;
} sp_metadata;

/* The most tensor bytes of one file when sp_save_opts names none: 5 GiB. */
#define SP_SAVE_DEFAULT_SHARD_BYTES (UINT64_C(5) << 30)

typedef struct sp_save_opts {
  /* The most tensor bytes one file holds (0: 5 GiB); a tensor larger than
   * that alone gets a file of its own.  Every rank must pass the same. */
  uint64_t max_shard_bytes;
  /* Strings every file's __metadata__ holds after {"format": "pt"}:
   * UTF-8 keys and values, the key "format" and repeated keys refused. */
  size_t nmetadata;
  const sp_metadata *metadata;
  /* 1: replace a checkpoint already in the directory (its index is
   * removed before any file of the new one takes a final name); 0: refuse
   * with SP_EEXISTS on every rank. */
  int overwrite;
  /* The export's options: groups, rounds, timeout_ms and the progress
   * callback, which also hears phase writing. */
  sp_export_opts export_opts;
} sp_save_opts;

/* What sp_save wrote. */
typedef struct sp_save_result {
  uint32_t files;       /* files this rank wrote */
  uint32_t total_files; /* files of the whole checkpoint */
  uint64_t bytes;       /* tensor bytes this rank wrote */
  uint64_t total_bytes; /* tensor bytes of the whole checkpoint (the
                           index's total_size) */
  double seconds;       /* from the call to the index being durable */
  int wrote_index;      /* 1 on the rank that wrote the index (rank 0) */
} sp_save_result;

/*
 * Saves the job's tensors as a Hugging Face checkpoint in dir: safetensors
 * files and model.safetensors.index.json.  A collective: every rank of the
 * job calls it with the same dir and options, after registering.  It
 * exports, and each owner writes the tensors it owns into files of its
 * own (in parallel, on every node, with this process's permissions),
 * releases the export, and once every rank's files are durable under
 * their final names rank 0 writes the index; then every rank returns.
 * Files are written under temporary names, fsynced and renamed only when
 * every rank's are durable, and the index comes last, so a failure on any
 * rank, node or daemon fails the save on every rank with one error and
 * leaves no index and no incomplete file under a final name
 * (docs/checkpoints.md).  dir is made when missing (mode 0777 less the
 * umask).
 *
 * Every rank's dir (as it resolves it), max_shard_bytes, metadata and
 * overwrite are compared before anything moves; a rank whose options or
 * directory are bad still takes part, and every rank fails with its
 * error.
 *
 * Errors: the export's (sp_export), SP_EEXISTS when dir holds a checkpoint
 * and opts->overwrite is 0, SP_EWRITE when a rank could not write
 * (sp_last_message names the rank, the file and the system's reason),
 * SP_EDTYPE for a key whose dtype safetensors cannot name, SP_EBUSY while
 * another save into dir runs, SP_ELIMIT for a file whose header would
 * pass safetensors' 100,000,000 bytes, SP_EINVAL for bad options, ranks
 * whose options differ, or a key named __metadata__.  out (optional) is
 * filled on success.
 */
SP_EXPORT int sp_save(sp_client *client, const char *dir,
                      const sp_save_opts *opts, sp_save_result *out);

#ifdef __cplusplus
}
#endif

#endif /* SHARDPORT_H */
