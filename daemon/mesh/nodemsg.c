/*
 * nodemsg.c - the messages between daemons (docs/protocol.md, "Between
 * daemons"), packed and parsed in one place; see nodemsg.h.
 *
 * Every field is read with the bounds the protocol states, and a message
 * that breaks one is refused with a sentence naming the field, exactly as
 * request.c does for clients: another daemon of a job is a peer, not a
 * trusted party.  A rank's registrations travel as a `meta` map whose
 * storages and tensors are what the rank registered (sids, views, pieces
 * and groups as the rank's own requests spelled them), so the receiving
 * daemon reads them with request.c's parsers and builds a registry of the
 * remote rank with registry.c's checks: one set of rules for a view,
 * wherever it was registered.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/nodelink.h"
#include "daemon/mesh/nodemsg.h"
#include "daemon/netaddr.h"
#include "proto/fail.h"
#include "proto/tensor.h"
#include "daemon/save.h"
#include "daemon/xfer/remote.h"
#include "proto/wire.h"
#include "shardport.h"

static const struct {
  enum nodemsg_op op;
  const char *name;
} op_names[] = {
    {NODEMSG_HELLO, "peer_hello"}, {NODEMSG_DATA, "peer_data"},
    {NODEMSG_CHALLENGE, "peer_challenge"},
    {NODEMSG_JOIN, "join"},        {NODEMSG_LEFT, "left"},
    {NODEMSG_ASK, "ask"},          {NODEMSG_PLAN, "plan"},
    {NODEMSG_PLANNED, "planned"},  {NODEMSG_GO, "go"},
    {NODEMSG_MOVED, "moved"},      {NODEMSG_PUBLISH, "publish"},
    {NODEMSG_SAVED, "saved"},      {NODEMSG_COMMIT, "commit"},
    {NODEMSG_FAIL, "fail"},        {NODEMSG_BEAT, "beat"},
    {NODEMSG_BYE, "bye"},          {NODEMSG_ERROR, "error"},
    {NODEMSG_ABORT, "abort"},
};

const char *nodemsg_op_name(enum nodemsg_op op) {
  for (size_t i = 0; i < sizeof op_names / sizeof op_names[0]; i++)
    if (op_names[i].op == op)
      return op_names[i].name;
  return "?";
}

void nodemsg_free(struct nodemsg *m) {
  free(m->nodes);
  free(m->rank_nodes);
  free(m->replicas);
  m->nodes = NULL;
  m->rank_nodes = NULL;
  m->replicas = NULL;
}

/* ---- reading ---- */

static int get_u(const msgpack_object *map, const char *key, uint64_t max,
                 uint64_t *out, char *msg, size_t msglen) {
  int rc = sp__msg_get_u64(map, key, false, out);
  if (rc != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"%s\" must be an unsigned integer", key);
  if (*out > max)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "\"%s\" is %" PRIu64 ", more than %" PRIu64, key, *out,
                     max);
  return 0;
}

static int get_u32(const msgpack_object *map, const char *key, uint32_t max,
                   uint32_t *out, char *msg, size_t msglen) {
  uint64_t v;
  int rc = get_u(map, key, max, &v, msg, msglen);
  if (rc == 0)
    *out = (uint32_t)v;
  return rc;
}

static int get_fixed_bin(const msgpack_object *map, const char *key,
                         uint8_t *out, size_t len, char *msg, size_t msglen) {
  const uint8_t *p;
  size_t n;
  if (sp__msg_get_bin(map, key, false, &p, &n) != 0 || n != len)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"%s\" must be a bin of %zu "
                     "bytes",
                     key, len);
  memcpy(out, p, len);
  return 0;
}

/* A peer's "addr:port": numeric, as peer_advertise is. */
static int get_addr(const msgpack_object *map, const char *key, char *out,
                    char *msg, size_t msglen) {
  const char *p;
  size_t n;
  struct sockaddr_storage sa;
  socklen_t salen;
  if (sp__msg_get_str(map, key, false, &p, &n) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"%s\" must be a string", key);
  if (netaddr_parse(p, n, false, &sa, &salen) != 0)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "\"%s\" is not a numeric "
                     "address and port",
                     key);
  memcpy(out, p, n);
  out[n] = '\0';
  return 0;
}

static int get_code(const msgpack_object *map, int *code, char *msg,
                    size_t msglen) {
  const char *p;
  size_t n;
  if (sp__msg_get_str(map, "code", false, &p, &n) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"code\" must be a string");
  *code = sp__error_from_name(p, n);
  return 0;
}

static int get_message(const msgpack_object *map, char *out, char *msg,
                       size_t msglen) {
  const char *p;
  size_t n;
  if (sp__msg_get_str(map, "message", false, &p, &n) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG, "\"message\" must be a string");
  if (n > SP_ERRMSG_MAX)
    n = SP_ERRMSG_MAX;
  memcpy(out, p, n);
  out[n] = '\0';
  /* A message goes to trainers as it is: it must be text. */
  for (size_t i = 0; i < n; i++)
    if (out[i] == '\0')
      out[i] = '?';
  return 0;
}

static int parse_nodes(const msgpack_object *map, struct nodemsg *m,
                       char *msg, size_t msglen) {
  const msgpack_object_array *a, *r;
  if (sp__msg_get_array(map, "nodes", false, &a) != 0 ||
      sp__msg_get_array(map, "rank_nodes", false, &r) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"nodes\" and \"rank_nodes\" must be arrays");
  if (a->size == 0 || a->size > NODE_MAX_NODES || r->size == 0 ||
      r->size > REQ_MAX_WORLD)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "%u nodes and %u ranks: 1 to %u nodes and 1 to %u ranks",
                     a->size, r->size, NODE_MAX_NODES, REQ_MAX_WORLD);
  m->nodes = calloc(a->size, sizeof *m->nodes);
  m->rank_nodes = calloc(r->size, sizeof *m->rank_nodes);
  if (m->nodes == NULL || m->rank_nodes == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  m->nnodes = a->size;
  m->world = r->size;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *o = &a->ptr[i];
    struct nodemsg_node *n = &m->nodes[i];
    int rc;
    if (o->type != MSGPACK_OBJECT_MAP)
      return sp__failf(msg, msglen, SP_EBADMSG, "nodes[%u]: not a map", i);
    if ((rc = get_u32(o, "node", NODE_MAX_NODES - 1, &n->node, msg,
                      msglen)) != 0 ||
        (rc = get_u(o, "node_id", UINT64_MAX, &n->node_id, msg, msglen)) !=
            0 ||
        (rc = get_addr(o, "addr", n->addr, msg, msglen)) != 0)
      return rc;
    /* Ascending node numbers: each once. */
    if (i > 0 && n->node <= m->nodes[i - 1].node)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "nodes[%u]: node %u is not above node %u", i, n->node,
                       m->nodes[i - 1].node);
  }
  for (uint32_t i = 0; i < r->size; i++) {
    const msgpack_object *o = &r->ptr[i];
    bool listed = false;
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        o->via.u64 >= NODE_MAX_NODES)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "rank_nodes[%u] is not a node number", i);
    m->rank_nodes[i] = (uint32_t)o->via.u64;
    for (size_t k = 0; k < m->nnodes && !listed; k++)
      listed = m->nodes[k].node == m->rank_nodes[i];
    if (!listed)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "rank_nodes[%u] names node %u, which is not listed", i,
                       m->rank_nodes[i]);
  }
  return 0;
}

/* Digests per bin of "replicas": a control frame's strings and bins hold
 * at most a mebibyte (the client limits apply to control messages). */
#define REPLICAS_PER_BIN (SP_LIMITS_DEFAULT_MAX_STRING / 8)

/* planned: optional "replica_rank" and "replicas" (an array of bins, each
 * of 8 bytes per key, little-endian, at most REPLICAS_PER_BIN keys; at
 * most REQ_MAX_PER_RANK keys in all), both or neither. */
static int parse_replicas(const msgpack_object *map, struct nodemsg *m,
                          char *msg, size_t msglen) {
  if (sp__msg_field(map, "replicas") == NULL &&
      sp__msg_field(map, "replica_rank") == NULL)
    return 0;
  int rc = get_u32(map, "replica_rank", REQ_MAX_WORLD - 1, &m->replica_rank,
                   msg, msglen);
  if (rc != 0)
    return rc;
  const msgpack_object_array *a;
  if (sp__msg_get_array(map, "replicas", false, &a) != 0 || a->size == 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"replicas\" must be an array of bins");
  size_t total = 0;
  for (uint32_t i = 0; i < a->size; i++) {
    const msgpack_object *o = &a->ptr[i];
    if (o->type != MSGPACK_OBJECT_BIN || o->via.bin.size == 0 ||
        o->via.bin.size % 8 != 0 || o->via.bin.size / 8 > REPLICAS_PER_BIN)
      return sp__failf(msg, msglen, SP_EBADMSG,
                       "replicas[%u] must be a bin of 8 bytes per key, at "
                       "most %u keys",
                       i, REPLICAS_PER_BIN);
    total += o->via.bin.size / 8;
  }
  if (total > REQ_MAX_PER_RANK)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "\"replicas\" holds %zu digests, more than %u", total,
                     REQ_MAX_PER_RANK);
  m->replicas = malloc(total * sizeof *m->replicas);
  if (m->replicas == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < a->size; i++) {
    const uint8_t *p = (const uint8_t *)a->ptr[i].via.bin.ptr;
    for (size_t j = 0; j < a->ptr[i].via.bin.size / 8; j++) {
      uint64_t v = 0;
      for (int b = 7; b >= 0; b--)
        v = v << 8 | p[j * 8 + (size_t)b];
      m->replicas[m->nreplicas++] = v;
    }
  }
  return 0;
}

/* go: optional "differ_key", "differ_ranks" and "differ_digests" (two
 * each), all or none. */
static int parse_differ(const msgpack_object *map, struct nodemsg *m,
                        char *msg, size_t msglen) {
  if (sp__msg_field(map, "differ_key") == NULL &&
      sp__msg_field(map, "differ_ranks") == NULL &&
      sp__msg_field(map, "differ_digests") == NULL)
    return 0;
  int rc = get_u32(map, "differ_key", REQ_MAX_PER_RANK - 1, &m->differ_key,
                   msg, msglen);
  if (rc != 0)
    return rc;
  const msgpack_object_array *r, *d;
  if (sp__msg_get_array(map, "differ_ranks", false, &r) != 0 ||
      sp__msg_get_array(map, "differ_digests", false, &d) != 0 ||
      r->size != 2 || d->size != 2)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"differ_ranks\" and \"differ_digests\" must be arrays "
                     "of two unsigned integers");
  for (int i = 0; i < 2; i++) {
    if (r->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
        r->ptr[i].via.u64 >= REQ_MAX_WORLD ||
        d->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "\"differ_ranks\" must hold ranks and "
                       "\"differ_digests\" unsigned integers");
    m->differ_ranks[i] = (uint32_t)r->ptr[i].via.u64;
    m->differ_digests[i] = d->ptr[i].via.u64;
  }
  m->differ = true;
  return 0;
}

static int parse_options(const msgpack_object *map, struct nodemsg *m,
                         char *msg, size_t msglen) {
  int rc;
  if ((rc = get_u32(map, "max_keys", UINT32_MAX, &m->max_keys, msg,
                    msglen)) != 0 ||
      (rc = get_u(map, "max_bytes", UINT64_MAX, &m->max_bytes, msg,
                  msglen)) != 0 ||
      (rc = get_u32(map, "timeout_ms", REQ_MAX_TIMEOUT_MS, &m->timeout_ms,
                    msg, msglen)) != 0)
    return rc;
  /* Optional: a save's file limit (daemon/save.h); absent for an export. */
  if (sp__msg_field(map, "save") != NULL &&
      (rc = get_u(map, "save", UINT64_MAX, &m->save_limit, msg, msglen)) != 0)
    return rc;
  return 0;
}

/* An ask's save (its limit read as "save" by parse_options): the options
 * every rank must ask alike and, "code" and "message" together, the
 * rank's refusal. */
static int parse_ask_save(const msgpack_object *map, struct nodemsg *m,
                          char *msg, size_t msglen) {
  m->save.limit = m->save_limit;
  m->save_limit = 0;
  if (m->save.limit == 0)
    return 0;
  int rc;
  if (sp__msg_get_bool(map, "save_overwrite", false, &m->save.overwrite) !=
          0 ||
      (rc = get_u(map, "save_directory", UINT64_MAX, &m->save.directory, msg,
                  msglen)) != 0 ||
      (rc = get_u(map, "save_metadata", UINT64_MAX, &m->save.metadata, msg,
                  msglen)) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "a save's ask needs \"save_overwrite\" (bool), "
                     "\"save_directory\" and \"save_metadata\" (uints)");
  if (sp__msg_field(map, "code") == NULL)
    return 0;
  if ((rc = get_code(map, &m->save.refused, msg, msglen)) != 0 ||
      (rc = get_message(map, m->message, msg, msglen)) != 0)
    return rc;
  if (m->save.refused >= 0)
    m->save.refused = SP_EINVAL;
  snprintf(m->save.refusal, sizeof m->save.refusal, "%.*s",
           (int)REQ_MAX_REFUSAL, m->message);
  return 0;
}

int nodemsg_parse(const struct sp_msg_head *head, const msgpack_object *map,
                  struct nodemsg *m, char *msg, size_t msglen) {
  memset(m, 0, sizeof *m);
  m->op = 0;
  for (size_t i = 0; i < sizeof op_names / sizeof op_names[0]; i++)
    if (strcmp(head->op, op_names[i].name) == 0)
      m->op = op_names[i].op;
  m->id = head->id;
  int rc = 0;
  switch (m->op) {
  case NODEMSG_CHALLENGE:
    if ((rc = get_u(map, "version", UINT64_MAX, &m->version, msg, msglen)) !=
        0)
      return rc;
    return get_fixed_bin(map, "nonce", m->nonce, PEERAUTH_NONCE_BYTES, msg,
                         msglen);
  case NODEMSG_HELLO:
  case NODEMSG_DATA:
    /* A request carries who is asking; the reply only who answers.  Both
     * carry their sender's proof, never the job's secret. */
    if (sp__msg_field(map, "job") == NULL) {
      if (m->op == NODEMSG_HELLO &&
          ((rc = get_u32(map, "node", NODE_MAX_NODES - 1, &m->node, msg,
                         msglen)) != 0 ||
           (rc = get_u(map, "node_id", UINT64_MAX, &m->node_id, msg,
                       msglen)) != 0))
        return rc;
      m->reply = true;
      return get_fixed_bin(map, "proof", m->proof, PEERAUTH_PROOF_BYTES, msg,
                           msglen);
    }
    if ((rc = get_u(map, "version", UINT64_MAX, &m->version, msg, msglen)) !=
            0 ||
        (rc = get_fixed_bin(map, "job", m->job, JOB_ID_BYTES, msg, msglen)) !=
            0 ||
        (rc = get_fixed_bin(map, "nonce", m->nonce, PEERAUTH_NONCE_BYTES, msg,
                            msglen)) != 0 ||
        (rc = get_fixed_bin(map, "proof", m->proof, PEERAUTH_PROOF_BYTES, msg,
                            msglen)) != 0 ||
        (rc = get_u(map, "node_id", UINT64_MAX, &m->node_id, msg, msglen)) !=
            0)
      return rc;
    if (m->op == NODEMSG_HELLO)
      return get_addr(map, "addr", m->addr, msg, msglen);
    if ((rc = get_u32(map, "node", NODE_MAX_NODES - 1, &m->node, msg,
                      msglen)) != 0 ||
        (rc = get_u32(map, "streams", REMOTE_STREAMS_MAX, &m->streams, msg,
                      msglen)) != 0 ||
        (rc = get_u32(map, "stream", REMOTE_STREAMS_MAX - 1, &m->stream, msg,
                      msglen)) != 0 ||
        (rc = get_u(map, "export_id", UINT64_MAX, &m->export_id, msg,
                    msglen)) != 0)
      return rc;
    if (m->streams == 0 || m->stream >= m->streams)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "stream %" PRIu32 " of %" PRIu32
                       " is not a stream of a data link",
                       m->stream, m->streams);
    return 0;
  case NODEMSG_JOIN:
    if (sp__msg_field(map, "rank") == NULL) {
      m->reply = true;
      return 0;
    }
    if ((rc = get_u32(map, "rank", REQ_MAX_WORLD - 1, &m->rank, msg,
                      msglen)) != 0 ||
        (rc = get_u32(map, "world", REQ_MAX_WORLD, &m->world, msg, msglen)) !=
            0 ||
        (rc = get_u32(map, "device_type", SP_DEVICE_TYPE_COUNT - 1,
                      &m->device_type, msg, msglen)) != 0)
      return rc;
    return 0;
  case NODEMSG_LEFT:
    if ((rc = get_u32(map, "rank", REQ_MAX_WORLD - 1, &m->rank, msg,
                      msglen)) != 0)
      return rc;
    if (sp__msg_get_bool(map, "disconnected", false, &m->disconnected) != 0)
      return sp__failf(msg, msglen, SP_EBADMSG,
                       "\"disconnected\" must be a bool");
    /* Optional: why the rank left, when its daemon knows. */
    if (sp__msg_field(map, "message") != NULL)
      return get_message(map, m->message, msg, msglen);
    return 0;
  case NODEMSG_ASK:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) !=
            0 ||
        (rc = get_u32(map, "rank", REQ_MAX_WORLD - 1, &m->rank, msg,
                      msglen)) != 0)
      return rc;
    if ((rc = parse_options(map, m, msg, msglen)) != 0)
      return rc;
    return parse_ask_save(map, m, msg, msglen);
  case NODEMSG_PLAN:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) !=
            0 ||
        (rc = get_u(map, "export_id", UINT64_MAX, &m->export_id, msg,
                    msglen)) != 0 ||
        (rc = parse_options(map, m, msg, msglen)) != 0)
      return rc;
    /* Optional: a new generation of the job's communicators, from 1 on,
     * with the NCCL id the root made for it; both or neither. */
    if (sp__msg_field(map, "comm_gen") != NULL ||
        sp__msg_field(map, "nccl_id") != NULL) {
      if ((rc = get_u(map, "comm_gen", UINT64_MAX, &m->comm_gen, msg,
                      msglen)) != 0 ||
          (rc = get_fixed_bin(map, "nccl_id", m->nccl_id, NODE_NCCL_ID_BYTES,
                              msg, msglen)) != 0)
        return rc;
      if (m->comm_gen == 0)
        return sp__failf(msg, msglen, SP_EINVAL,
                         "\"comm_gen\" is 0: the ticket's NCCL id is never "
                         "sent");
    }
    return parse_nodes(map, m, msg, msglen);
  case NODEMSG_PLANNED:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) !=
            0 ||
        (rc = get_u(map, "digest", UINT64_MAX, &m->digest, msg, msglen)) != 0)
      return rc;
    if (sp__msg_field(map, "code") != NULL &&
        (rc = get_code(map, &m->code, msg, msglen)) != 0)
      return rc;
    return parse_replicas(map, m, msg, msglen);
  case NODEMSG_GO:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) != 0)
      return rc;
    return parse_differ(map, m, msg, msglen);
  case NODEMSG_MOVED:
  case NODEMSG_PUBLISH:
  case NODEMSG_BEAT:
    return get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen);
  case NODEMSG_SAVED:
  case NODEMSG_COMMIT:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) != 0)
      return rc;
    if ((rc = get_u32(map, "step", SAVE_STEPS, &m->step, msg, msglen)) != 0)
      return rc;
    if (m->step == 0)
      return sp__failf(msg, msglen, SP_EINVAL, "\"step\" is 0: steps count "
                      "from 1");
    return 0;
  case NODEMSG_FAIL:
    if ((rc = get_u(map, "gather", UINT64_MAX, &m->gather, msg, msglen)) != 0)
      return rc;
    __attribute__((fallthrough));
  case NODEMSG_ERROR:
  case NODEMSG_ABORT:
    if ((rc = get_code(map, &m->code, msg, msglen)) != 0)
      return rc;
    if (m->code == 0)
      m->code = SP_EINTERNAL;
    return get_message(map, m->message, msg, msglen);
  case NODEMSG_BYE:
    return 0;
  }
  return sp__failf(msg, msglen, SP_EUNKNOWNOP, "unknown operation \"%s\"",
                   head->op);
}

/* ---- writing ---- */

static uint32_t fields_of(const struct nodemsg *m) {
  switch (m->op) {
  case NODEMSG_CHALLENGE:
    return 2;
  case NODEMSG_HELLO:
    return m->reply ? 3 : 6;
  case NODEMSG_DATA:
    return m->reply ? 1 : 9;
  case NODEMSG_JOIN:
    return m->reply ? 0 : 3;
  case NODEMSG_LEFT:
    return m->message[0] != '\0' ? 3 : 2;
  case NODEMSG_ASK:
    return 5 + (m->save.limit > 0 ? 4 : 0) + (m->save.refused < 0 ? 2 : 0);
  case NODEMSG_PLAN:
    return (m->comm_gen > 0 ? 9 : 7) + (m->save_limit > 0);
  case NODEMSG_PLANNED:
    return 2 + (m->code != 0) + (m->nreplicas > 0 ? 2 : 0);
  case NODEMSG_GO:
    return m->differ ? 4 : 1;
  case NODEMSG_MOVED:
  case NODEMSG_PUBLISH:
  case NODEMSG_BEAT:
    return 1;
  case NODEMSG_SAVED:
  case NODEMSG_COMMIT:
    return 2;
  case NODEMSG_FAIL:
    return 3;
  case NODEMSG_ERROR:
  case NODEMSG_ABORT:
    return 2;
  case NODEMSG_BYE:
    return 0;
  }
  return 0;
}

/* The digests in bins of REPLICAS_PER_BIN, little-endian whatever this
 * machine's order. */
static void pack_replicas(msgpack_packer *pk, const struct nodemsg *m) {
  sp__pack_kv_u64(pk, "replica_rank", m->replica_rank);
  sp__pack_str(pk, "replicas");
  size_t nbins = (m->nreplicas + REPLICAS_PER_BIN - 1) / REPLICAS_PER_BIN;
  msgpack_pack_array(pk, (uint32_t)nbins);
  for (size_t i = 0; i < m->nreplicas; i++) {
    if (i % REPLICAS_PER_BIN == 0) {
      size_t left = m->nreplicas - i;
      msgpack_pack_bin(pk, 8 * (left < REPLICAS_PER_BIN ? left
                                                        : REPLICAS_PER_BIN));
    }
    uint8_t le[8];
    for (int b = 0; b < 8; b++)
      le[b] = (uint8_t)(m->replicas[i] >> (8 * b));
    msgpack_pack_bin_body(pk, le, 8);
  }
}

void nodemsg_pack(const struct nodemsg *m, struct sp_msgbuf *mb) {
  sp__msgbuf_begin(mb, nodemsg_op_name(m->op), m->id, fields_of(m));
  msgpack_packer *pk = &mb->pk;
  switch (m->op) {
  case NODEMSG_CHALLENGE:
    sp__pack_kv_u64(pk, "version", m->version);
    sp__pack_str(pk, "nonce");
    sp__pack_bin(pk, m->nonce, PEERAUTH_NONCE_BYTES);
    break;
  case NODEMSG_HELLO:
  case NODEMSG_DATA:
    if (m->reply) {
      if (m->op == NODEMSG_HELLO) {
        sp__pack_kv_u64(pk, "node", m->node);
        sp__pack_kv_u64(pk, "node_id", m->node_id);
      }
      sp__pack_str(pk, "proof");
      sp__pack_bin(pk, m->proof, PEERAUTH_PROOF_BYTES);
      break;
    }
    sp__pack_kv_u64(pk, "version", m->version);
    sp__pack_str(pk, "job");
    sp__pack_bin(pk, m->job, JOB_ID_BYTES);
    sp__pack_str(pk, "nonce");
    sp__pack_bin(pk, m->nonce, PEERAUTH_NONCE_BYTES);
    sp__pack_str(pk, "proof");
    sp__pack_bin(pk, m->proof, PEERAUTH_PROOF_BYTES);
    sp__pack_kv_u64(pk, "node_id", m->node_id);
    if (m->op == NODEMSG_HELLO) {
      sp__pack_kv_str(pk, "addr", m->addr);
    } else {
      sp__pack_kv_u64(pk, "node", m->node);
      sp__pack_kv_u64(pk, "streams", m->streams);
      sp__pack_kv_u64(pk, "stream", m->stream);
      sp__pack_kv_u64(pk, "export_id", m->export_id);
    }
    break;
  case NODEMSG_JOIN:
    if (m->reply)
      break;
    sp__pack_kv_u64(pk, "rank", m->rank);
    sp__pack_kv_u64(pk, "world", m->world);
    sp__pack_kv_u64(pk, "device_type", m->device_type);
    break;
  case NODEMSG_LEFT:
    sp__pack_kv_u64(pk, "rank", m->rank);
    sp__pack_kv_bool(pk, "disconnected", m->disconnected);
    if (m->message[0] != '\0')
      sp__pack_kv_str(pk, "message", m->message);
    break;
  case NODEMSG_ASK:
    sp__pack_kv_u64(pk, "gather", m->gather);
    sp__pack_kv_u64(pk, "rank", m->rank);
    sp__pack_kv_u64(pk, "max_keys", m->max_keys);
    sp__pack_kv_u64(pk, "max_bytes", m->max_bytes);
    sp__pack_kv_u64(pk, "timeout_ms", m->timeout_ms);
    if (m->save.limit > 0) {
      sp__pack_kv_u64(pk, "save", m->save.limit);
      sp__pack_kv_bool(pk, "save_overwrite", m->save.overwrite);
      sp__pack_kv_u64(pk, "save_directory", m->save.directory);
      sp__pack_kv_u64(pk, "save_metadata", m->save.metadata);
    }
    if (m->save.refused < 0) {
      sp__pack_kv_str(pk, "code", sp_err_name(m->save.refused));
      sp__pack_kv_str(pk, "message", m->save.refusal);
    }
    break;
  case NODEMSG_PLAN:
    sp__pack_kv_u64(pk, "gather", m->gather);
    sp__pack_kv_u64(pk, "export_id", m->export_id);
    sp__pack_kv_u64(pk, "max_keys", m->max_keys);
    sp__pack_kv_u64(pk, "max_bytes", m->max_bytes);
    sp__pack_kv_u64(pk, "timeout_ms", m->timeout_ms);
    if (m->save_limit > 0)
      sp__pack_kv_u64(pk, "save", m->save_limit);
    if (m->comm_gen > 0) {
      sp__pack_kv_u64(pk, "comm_gen", m->comm_gen);
      sp__pack_str(pk, "nccl_id");
      sp__pack_bin(pk, m->nccl_id, NODE_NCCL_ID_BYTES);
    }
    sp__pack_str(pk, "nodes");
    msgpack_pack_array(pk, (uint32_t)m->nnodes);
    for (size_t i = 0; i < m->nnodes; i++) {
      msgpack_pack_map(pk, 3);
      sp__pack_kv_u64(pk, "node", m->nodes[i].node);
      sp__pack_kv_u64(pk, "node_id", m->nodes[i].node_id);
      sp__pack_kv_str(pk, "addr", m->nodes[i].addr);
    }
    sp__pack_str(pk, "rank_nodes");
    msgpack_pack_array(pk, m->world);
    for (uint32_t r = 0; r < m->world; r++)
      msgpack_pack_uint32(pk, m->rank_nodes[r]);
    break;
  case NODEMSG_PLANNED:
    sp__pack_kv_u64(pk, "gather", m->gather);
    sp__pack_kv_u64(pk, "digest", m->digest);
    if (m->code != 0)
      sp__pack_kv_str(pk, "code", sp_err_name(m->code));
    if (m->nreplicas > 0)
      pack_replicas(pk, m);
    break;
  case NODEMSG_GO:
    sp__pack_kv_u64(pk, "gather", m->gather);
    if (m->differ) {
      sp__pack_kv_u64(pk, "differ_key", m->differ_key);
      sp__pack_str(pk, "differ_ranks");
      msgpack_pack_array(pk, 2);
      msgpack_pack_uint32(pk, m->differ_ranks[0]);
      msgpack_pack_uint32(pk, m->differ_ranks[1]);
      sp__pack_str(pk, "differ_digests");
      msgpack_pack_array(pk, 2);
      msgpack_pack_uint64(pk, m->differ_digests[0]);
      msgpack_pack_uint64(pk, m->differ_digests[1]);
    }
    break;
  case NODEMSG_MOVED:
  case NODEMSG_PUBLISH:
  case NODEMSG_BEAT:
    sp__pack_kv_u64(pk, "gather", m->gather);
    break;
  case NODEMSG_SAVED:
  case NODEMSG_COMMIT:
    sp__pack_kv_u64(pk, "gather", m->gather);
    sp__pack_kv_u64(pk, "step", m->step);
    break;
  case NODEMSG_FAIL:
    sp__pack_kv_u64(pk, "gather", m->gather);
    __attribute__((fallthrough));
  case NODEMSG_ERROR:
  case NODEMSG_ABORT:
    sp__pack_kv_str(pk, "code", sp_err_name(m->code));
    sp__pack_kv_str(pk, "message", m->message);
    break;
  case NODEMSG_BYE:
    break;
  }
}

/* ---- a rank's registrations ---- */

static void piece_wire(const void *pieces, size_t i,
                       struct sp_piece_wire *out) {
  const struct affine_piece *p = &((const struct affine_piece *)pieces)[i];
  *out = (struct sp_piece_wire){.ndim = p->ndim,
                                .shape = p->shape,
                                .src_stride = p->src_stride,
                                .dst_stride = p->dst_stride,
                                .src_offset = p->src_offset,
                                .dst_offset = p->dst_offset,
                                .nholders = p->nholders,
                                .holders = p->holders};
}

/* A tensor as the rank's own tensor_add spelled it (docs/protocol.md). */
static void pack_tensor(msgpack_packer *pk, const struct registry *reg,
                        const struct plan_key_in *k) {
  sp__tensor_pack(pk, &(struct sp_tensor_wire){
                          .key = k->name,
                          .sid = reg->info[k->storage].sid,
                          .dtype = sp__dtype_name(k->view.dtype),
                          .ndim = k->view.ndim,
                          .shape = k->view.shape,
                          .stride = k->view.stride,
                          .offset = k->view.offset,
                          .placement = plan_layout_placement_name(k->placement),
                          .global_ndim = k->ndim,
                          .global_shape = k->shape,
                          .affine = k->placement == PLAN_AFFINE,
                          .npieces = k->npieces,
                          .piece = piece_wire,
                          .pieces = k->pieces});
}

void nodemsg_pack_meta(uint32_t rank, const struct registry *reg,
                       const struct req_groups *groups, struct sp_msgbuf *mb) {
  sp__msgbuf_begin(mb, "meta", 0, 5);
  msgpack_packer *pk = &mb->pk;
  sp__pack_kv_u64(pk, "rank", rank);
  sp__pack_kv_u64(pk, "device_type", reg->device_type);
  sp__pack_str(pk, "storages");
  msgpack_pack_array(pk, (uint32_t)reg->nstorages);
  for (size_t i = 0; i < reg->nstorages; i++) {
    const struct sp_storage *s = &reg->storages[i];
    msgpack_pack_map(pk, 6);
    sp__pack_kv_u64(pk, "sid", reg->info[i].sid);
    sp__pack_kv_u64(pk, "base", s->base);
    sp__pack_kv_u64(pk, "length", s->nbytes);
    sp__pack_kv_u64(pk, "device_type", s->device.type);
    sp__pack_kv_u64(pk, "device_index", (uint64_t)(uint32_t)s->device.index);
    sp__pack_str(pk, "device_uuid");
    sp__pack_bin(pk, s->device.uuid, sizeof s->device.uuid);
  }
  sp__pack_str(pk, "tensors");
  msgpack_pack_array(pk, (uint32_t)reg->nkeys);
  for (size_t i = 0; i < reg->nkeys; i++)
    pack_tensor(pk, reg, &reg->keys[i]);
  sp__pack_str(pk, "groups");
  msgpack_pack_array(pk, (uint32_t)groups->ngroups);
  for (size_t g = 0; g < groups->ngroups; g++) {
    msgpack_pack_array(pk, (uint32_t)groups->groups[g].nkeys);
    for (size_t k = 0; k < groups->groups[g].nkeys; k++)
      sp__pack_str(pk, groups->groups[g].keys[k]);
  }
}

static int parse_storages(const msgpack_object *map, struct registry *reg,
                          char *msg, size_t msglen) {
  const msgpack_object_array *a;
  if (sp__msg_get_array(map, "storages", false, &a) != 0)
    return sp__failf(msg, msglen, SP_EBADMSG,
                     "\"storages\" must be an array of storage maps");
  if (a->size > REQ_MAX_PER_RANK)
    return sp__failf(msg, msglen, SP_ELIMIT, "%u storages, more than %u",
                     a->size, REQ_MAX_PER_RANK);
  struct req_storage *s = calloc(a->size > 0 ? a->size : 1, sizeof *s);
  struct sp_device *dev = calloc(a->size > 0 ? a->size : 1, sizeof *dev);
  int rc = s == NULL || dev == NULL
               ? sp__failf(msg, msglen, SP_ENOMEM, "out of memory")
               : 0;
  for (uint32_t i = 0; i < a->size && rc == 0; i++) {
    const msgpack_object *o = &a->ptr[i];
    char where[SP_ERRMSG_MAX / 2];
    uint64_t index;
    if (o->type != MSGPACK_OBJECT_MAP) {
      rc = sp__failf(msg, msglen, SP_EBADMSG, "storages[%u]: not a map", i);
      break;
    }
    if ((rc = get_u32(o, "sid", UINT32_MAX, &s[i].sid, where,
                      sizeof where)) != 0 ||
        (rc = get_u(o, "base", UINT64_MAX, &s[i].base, where,
                    sizeof where)) != 0 ||
        (rc = get_u(o, "length", REQ_MAX_VALUE, &s[i].length, where,
                    sizeof where)) != 0 ||
        (rc = get_u32(o, "device_type", SP_DEVICE_TYPE_COUNT - 1,
                      &dev[i].type, where, sizeof where)) != 0 ||
        (rc = get_u(o, "device_index", INT32_MAX, &index, where,
                    sizeof where)) != 0 ||
        (rc = get_fixed_bin(o, "device_uuid", dev[i].uuid,
                            sizeof dev[i].uuid, where, sizeof where)) != 0) {
      sp__failf(msg, msglen, rc, "storages[%u]: %s", i, where);
      break;
    }
    dev[i].index = (int32_t)index;
  }
  if (rc == 0)
    rc = registry_add_remote_storages(reg, s, dev, a->size, msg, msglen);
  free(s);
  free(dev);
  return rc;
}

void nodemsg_meta_limits(struct sp_limits *l) {
  sp__limits_default(l);
  l->max_frame = NODE_MAX_FRAME;
  l->max_depth = 8;
  l->max_items = NODE_MAX_ITEMS;
  l->max_fds = 0;
}

int nodemsg_parse_meta(const uint8_t *data, size_t len, uint32_t rank,
                       struct registry *reg, struct req_groups *groups,
                       char *msg, size_t msglen) {
  struct sp_limits limits;
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
  memset(groups, 0, sizeof *groups);
  registry_init(reg, SP_DEVICE_CPU);
  nodemsg_meta_limits(&limits);
  if (!msgpack_zone_init(&zone, MSGPACK_ZONE_CHUNK_SIZE))
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  int rc = sp__wire_decode(data, len, &limits, &zone, &map);
  if (rc != 0) {
    sp__failf(msg, msglen, rc, "%s", sp_strerror(rc));
    goto out;
  }
  uint32_t got, device_type;
  if ((rc = sp__msg_head(&map, &head)) != 0 || strcmp(head.op, "meta") != 0) {
    rc = sp__failf(msg, msglen, SP_EBADMSG, "not a meta message");
    goto out;
  }
  if ((rc = get_u32(&map, "rank", REQ_MAX_WORLD - 1, &got, msg, msglen)) !=
          0 ||
      (rc = get_u32(&map, "device_type", SP_DEVICE_TYPE_COUNT - 1,
                    &device_type, msg, msglen)) != 0)
    goto out;
  if (got != rank) {
    rc =
        sp__failf(msg, msglen, SP_EINVAL,
                  "it holds rank %u's registrations, not rank %u's", got, rank);
    goto out;
  }
  reg->device_type = device_type;
  if ((rc = parse_storages(&map, reg, msg, msglen)) != 0)
    goto out;
  struct req_tensor *t;
  size_t n;
  if ((rc = request_parse_tensors(&map, &t, &n, msg, msglen)) != 0)
    goto out;
  rc = registry_add_tensors(reg, t, n, msg, msglen);
  request_tensors_free(t, n);
  if (rc != 0)
    goto out;
  /* The groups, read as the rank's export request reads them. */
  struct req_export ask;
  if (sp__msg_field(&map, "groups") == NULL) {
    rc = sp__failf(msg, msglen, SP_EBADMSG, "\"groups\" is missing");
    goto out;
  }
  if ((rc = request_parse_export(&map, &ask, msg, msglen)) != 0)
    goto out;
  *groups = ask.groups;
out:
  msgpack_zone_destroy(&zone);
  if (rc != 0)
    registry_free(reg);
  return rc;
}
