/*
 * quota.c - what each user holds on this daemon, and the bounds on it;
 * see quota.h and docs/operations.md, "Quotas".
 *
 * max_jobs and max_clients bound the daemon as a whole, so without more one
 * user could take all of it: create max_jobs jobs and leave, and every
 * other user's job_create is refused until job_timeout; register a million
 * tensors with long keys on each of many connections and take the node's
 * memory; map a file per storage until vm.max_map_count ends every job's
 * next mapping, or map terabytes of sparse file until the daemon's address
 * space is gone.  So what a user's connections, jobs and ranks hold is
 * counted per uid (SO_PEERCRED's, checked at accept) and bounded per uid,
 * and host mappings also per client, each bound a configuration value.  A
 * request past a bound is refused with limit_exceeded naming the bound;
 * what is already held stays.
 *
 * A user's entry lives while something holds it: a connection, a job it
 * created, a rank of its connection (which may outlive the connection
 * until no export reads its storages).  Loop thread only.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "daemon/config.h"
#include "daemon/quota.h"
#include "daemon/registry.h"
#include "daemon/server.h"
#include "proto/fail.h"
#include "proto/msg.h"
#include "shardport.h"

struct quota_user {
  struct quota_user *next;
  struct server *srv;
  uid_t uid;
  /* Holders, by kind; the entry is freed when none is left. */
  uint32_t held[QUOTA_KINDS];
  /* What the user's ranks registered. */
  struct reg_usage used;
};

struct quota_user *quota_hold(struct server *srv, uid_t uid,
                              enum quota_kind kind) {
  struct quota_user *u = srv->users;
  while (u != NULL && u->uid != uid)
    u = u->next;
  if (u == NULL) {
    u = calloc(1, sizeof *u);
    if (u == NULL)
      return NULL;
    u->srv = srv;
    u->uid = uid;
    u->next = srv->users;
    srv->users = u;
  }
  u->held[kind]++;
  return u;
}

void quota_release(struct quota_user *u, enum quota_kind kind) {
  u->held[kind]--;
  for (int k = 0; k < QUOTA_KINDS; k++)
    if (u->held[k] > 0)
      return;
  for (struct quota_user **p = &u->srv->users; *p != NULL; p = &(*p)->next)
    if (*p == u) {
      *p = u->next;
      break;
    }
  free(u);
}

int quota_job_admit(const struct quota_user *u, char *msg, size_t msglen) {
  uint32_t max = u->srv->cfg->max_user_jobs;
  /* The new job is held already: it counts. */
  if (u->held[QUOTA_JOB] > max)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "user %u holds %" PRIu32 " jobs, the most max_user_jobs "
                     "allows",
                     (unsigned)u->uid, max);
  return 0;
}

/* A registry of one of u's ranks may take more: per client, its mappings;
 * per user, everything its ranks registered. */
static int admit(void *arg, const struct registry *reg,
                 const struct reg_usage *more, char *msg, size_t msglen) {
  const struct quota_user *u = arg;
  const struct config *cfg = u->srv->cfg;
  if (reg->used.mappings + more->mappings > cfg->max_client_mappings)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "this client would map %" PRIu64 " files, more than "
                     "max_client_mappings (%" PRIu32 ") allows; put its "
                     "storages in fewer memfds",
                     reg->used.mappings + more->mappings,
                     cfg->max_client_mappings);
  if (u->used.mappings + more->mappings > cfg->max_user_mappings)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "user %u's clients would map %" PRIu64 " files, more "
                     "than max_user_mappings (%" PRIu32 ") allows",
                     (unsigned)u->uid, u->used.mappings + more->mappings,
                     cfg->max_user_mappings);
  if (u->used.mapped_bytes + more->mapped_bytes > cfg->max_user_mapped_bytes)
    return sp__failf(
        msg, msglen, SP_ELIMIT,
        "user %u's clients would map %" PRIu64 " bytes of "
        "storage files, more than max_user_mapped_bytes (%" PRIu64 ") allows",
        (unsigned)u->uid, u->used.mapped_bytes + more->mapped_bytes,
        cfg->max_user_mapped_bytes);
  if (u->used.registrations + more->registrations >
      cfg->max_user_registrations)
    return sp__failf(
        msg, msglen, SP_ELIMIT,
        "user %u would hold %" PRIu64 " registrations (storages "
        "and tensors), more than max_user_registrations (%" PRIu64 ") allows",
        (unsigned)u->uid, u->used.registrations + more->registrations,
        cfg->max_user_registrations);
  if (u->used.bytes + more->bytes > cfg->max_user_registration_bytes)
    return sp__failf(msg, msglen, SP_ELIMIT,
                     "user %u's registrations would take %" PRIu64 " bytes, "
                     "more than max_user_registration_bytes (%" PRIu64
                     ") allows",
                     (unsigned)u->uid, u->used.bytes + more->bytes,
                     cfg->max_user_registration_bytes);
  return 0;
}

static void charge(void *arg, const struct reg_usage *more) {
  struct quota_user *u = arg;
  u->used.mappings += more->mappings;
  u->used.mapped_bytes += more->mapped_bytes;
  u->used.registrations += more->registrations;
  u->used.bytes += more->bytes;
}

void quota_unregister(struct quota_user *u, const struct reg_usage *used) {
  u->used.mappings -= used->mappings;
  u->used.mapped_bytes -= used->mapped_bytes;
  u->used.registrations -= used->registrations;
  u->used.bytes -= used->bytes;
}

static void release(void *arg, const struct reg_usage *less) {
  quota_unregister(arg, less);
}

const struct reg_quota_ops quota_registry_ops = {admit, charge, release};

void quota_status_pack(const struct server *srv, msgpack_packer *pk) {
  uint32_t n = 0;
  for (const struct quota_user *u = srv->users; u != NULL; u = u->next)
    n++;
  msgpack_pack_array(pk, n);
  for (const struct quota_user *u = srv->users; u != NULL; u = u->next) {
    msgpack_pack_map(pk, 8);
    sp__pack_kv_u64(pk, "uid", u->uid);
    sp__pack_kv_u64(pk, "clients", u->held[QUOTA_CLIENT]);
    sp__pack_kv_u64(pk, "jobs", u->held[QUOTA_JOB]);
    sp__pack_kv_u64(pk, "ranks", u->held[QUOTA_RANK]);
    sp__pack_kv_u64(pk, "registrations", u->used.registrations);
    sp__pack_kv_u64(pk, "registration_bytes", u->used.bytes);
    sp__pack_kv_u64(pk, "mappings", u->used.mappings);
    sp__pack_kv_u64(pk, "mapped_bytes", u->used.mapped_bytes);
  }
}
