/*
 * quota.h - what each user may hold, and what it holds (quota.c).
 */
#ifndef SP_DAEMON_QUOTA_H
#define SP_DAEMON_QUOTA_H

#include <msgpack.h>
#include <stddef.h>
#include <sys/types.h>

#include "daemon/layer.h"

struct registry;
struct server;

/* What holds a user's entry: its connections, the jobs it created, its
 * connections' ranks (which hold the registrations). */
enum quota_kind { QUOTA_CLIENT, QUOTA_JOB, QUOTA_RANK, QUOTA_KINDS };

struct quota_user;
struct reg_usage;
struct reg_quota_ops;

/* The entry of uid, made when it has none, held once more by kind: NULL
 * when out of memory. */
struct quota_user *quota_hold(struct server *srv, uid_t uid,
                              enum quota_kind kind);
/* One holder of kind is gone; the entry goes with its last holder. */
void quota_release(struct quota_user *u, enum quota_kind kind);
/* job_create, or a join that makes a shadow, for u, which holds the new job
 * already: 0, or SP_ELIMIT past
 * max_user_jobs with a sentence. */
int quota_job_admit(const struct quota_user *u, char *msg, size_t msglen);
/* The registry quota of a rank of user u (quota_arg is u): max_client_mappings
 * on the registry, the max_user_* bounds on u. */
extern const struct reg_quota_ops quota_registry_ops;
/* A rank's registry is freed: what it held no longer counts for u. */
void quota_unregister(struct quota_user *u, const struct reg_usage *used);
/* The users array of the status reply. */
void quota_status_pack(const struct server *srv, msgpack_packer *pk);

#endif /* SP_DAEMON_QUOTA_H */
