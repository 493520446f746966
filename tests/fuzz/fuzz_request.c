/*
 * fuzz_request.c - libFuzzer target for the request parser of every op.
 * The input is one frame's payload, as a client would send it; it goes
 * through the bounded decoder, then every op's parser reads the map as if
 * it were that op (hello's fields as conn.c reads them, then each parser
 * of daemon/request.c), and what storage_add and tensor_add would
 * register is checked by the registry as the daemon checks it (storages
 * described, not mapped); a consumer's target_add, push and receive too.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/msg.h"
#include "proto/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Descriptors a frame may carry: storage fd indices below it pass. */
#define FUZZ_NFDS 4

static void parse_hello(const msgpack_object *map) {
  uint64_t version;
  char client[64];
  (void)sp__msg_get_u64(map, "version", false, &version);
  (void)sp__msg_get_strbuf(map, "client", true, client, sizeof client);
}

static void parse_join(const msgpack_object *map,
                       const struct sp_limits *limits) {
  struct req_join join;
  struct req_ticket ticket;
  char msg[SP_ERRMSG_MAX + 1];
  if (request_parse_join(map, &join, msg, sizeof msg) == 0)
    (void)request_parse_ticket(join.ticket, join.ticket_len, limits, &ticket);
  if (request_parse_consumer_join(map, &join, msg, sizeof msg) == 0)
    (void)request_parse_ticket(join.ticket, join.ticket_len, limits, &ticket);
}

/* A consumer's target_add, push and receive. */
static void parse_consumer(const msgpack_object *map) {
  struct req_target *t;
  struct req_push push;
  size_t n;
  char msg[SP_ERRMSG_MAX + 1];
  if (request_parse_targets(map, &t, &n, msg, sizeof msg) == 0)
    request_targets_free(t, n);
  (void)request_parse_push(map, &push, msg, sizeof msg);
}

/* storage_add then tensor_add on one registry of the rank. */
static void parse_registration(const msgpack_object *map) {
  struct registry reg;
  struct req_storage *s;
  struct req_tensor *t;
  size_t ns, nt;
  char msg[SP_ERRMSG_MAX + 1];

  registry_init(&reg, SP_DEVICE_CPU);
  if (request_parse_storages(map, FUZZ_NFDS, &s, &ns, msg, sizeof msg) == 0) {
    /* Host storages, all of them (SP_DEVICE_CPU is 0). */
    struct sp_device *cpu = calloc(ns > 0 ? ns : 1, sizeof *cpu);
    if (cpu != NULL)
      (void)registry_add_remote_storages(&reg, s, cpu, ns, msg, sizeof msg);
    free(cpu);
    free(s);
  }
  if (request_parse_tensors(map, &t, &nt, msg, sizeof msg) == 0) {
    (void)registry_add_tensors(&reg, t, nt, msg, sizeof msg);
    request_tensors_free(t, nt);
  }
  registry_free(&reg);
}

static void parse_every_op(const msgpack_object *map,
                           const struct sp_limits *limits) {
  struct req_job_create create;
  struct req_export ask;
  uint64_t export_id;
  char msg[SP_ERRMSG_MAX + 1];

  parse_hello(map);
  (void)request_parse_job_create(map, &create, msg, sizeof msg);
  parse_join(map, limits);
  parse_registration(map);
  parse_consumer(map);
  if (request_parse_export(map, &ask, msg, sizeof msg) == 0)
    request_groups_free(&ask.groups);
  (void)request_parse_release(map, &export_id, msg, sizeof msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct sp_limits limits;
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;

  sp__limits_default(&limits);
  if (!msgpack_zone_init(&zone, 4096))
    return 0;
  if (sp__wire_decode(data, size, &limits, &zone, &map) == 0 &&
      sp__msg_head(&map, &head) == 0)
    parse_every_op(&map, &limits);
  msgpack_zone_destroy(&zone);
  return 0;
}
