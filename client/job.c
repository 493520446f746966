/*
 * job.c - sp_job_create (with or without consumers), sp_job_join,
 * sp_job_leave.
 *
 * The daemon is the one judge of a job's state (joined or not, rank taken,
 * ticket valid); the library checks only what it cannot send, and forgets
 * the rank's storages and exports once the daemon has let it leave.
 */
#include <string.h>

#include "client/client.h"
#include "client/cudart.h"

/* The largest world docs/protocol.md allows. */
#define JOB_WORLD_MAX 65536u

SP_EXPORT int sp_job_create_with_consumers(sp_client *client, uint32_t world,
                                           uint32_t nconsumers,
                                           sp_ticket *ticket) {
  if (!client || !ticket || world == 0 || world > JOB_WORLD_MAX ||
      nconsumers > SP_MAX_CONSUMERS)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "job_create", nconsumers ? 2 : 1);
  sp__pack_kv_u64(&mb.pk, "world", world);
  if (nconsumers)
    sp__pack_kv_u64(&mb.pk, "consumers", nconsumers);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "job_create", &reply);
  if (rc < 0)
    return rc;
  const uint8_t *bytes;
  size_t len;
  rc = sp__msg_get_bin(&reply.map, "ticket", false, &bytes, &len);
  if (rc == 0 && (len == 0 || len > SP_TICKET_MAX))
    rc = SP_EBADMSG;
  if (rc == 0) {
    /* Zero past len, so that a caller may send the whole struct. */
    memset(ticket, 0, sizeof *ticket);
    ticket->len = len;
    memcpy(ticket->bytes, bytes, len);
  }
  client_reply_release(&reply);
  return rc;
}

SP_EXPORT int sp_job_create(sp_client *client, uint32_t world,
                            sp_ticket *ticket) {
  return sp_job_create_with_consumers(client, world, 0, ticket);
}

SP_EXPORT int sp_job_join(sp_client *client, const sp_ticket *ticket,
                          uint32_t rank, uint32_t world, const char *device) {
  if (!client || !ticket || ticket->len == 0 || ticket->len > SP_TICKET_MAX ||
      !device)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "join", 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket->bytes, ticket->len);
  sp__pack_kv_u64(&mb.pk, "rank", rank);
  sp__pack_kv_u64(&mb.pk, "world", world);
  sp__pack_kv_str(&mb.pk, "device", device);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "join", &reply);
  if (rc < 0)
    return rc;
  client_reply_release(&reply);
  client->joined = true;
  client->rank = rank;
  return 0;
}

SP_EXPORT int sp_cuda_device_name(sp_client *client, int ordinal, char *buf,
                                  size_t size) {
  if (!client || !buf || size < CLIENT_CUDA_DEVICE_MAX)
    return SP_EINVAL;
  return client_cuda_name(client, ordinal, buf);
}

SP_EXPORT int sp_job_leave(sp_client *client) {
  if (!client)
    return SP_EINVAL;
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "leave", 0);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "leave", &reply);
  if (rc < 0)
    return rc;
  client_reply_release(&reply);
  client->joined = false;
  client->consumer = false;
  /* The daemon has released every export and registration of this rank:
   * its pool may hand the segments to someone else, so nothing of them may
   * stay mapped here. */
  client_exports_detach(client);
  client_storages_clear(&client->storages);
  return 0;
}
