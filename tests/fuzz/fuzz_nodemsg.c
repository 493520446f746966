/*
 * fuzz_nodemsg.c - libFuzzer target for the messages between daemons
 * (daemon/nodemsg.c).  The input is one frame's payload as a peer daemon
 * would send it: decoded by the bounded decoder and read as a message of
 * the op it names, and read as a rank's `meta` registrations (for rank 0),
 * which rebuild a registry through the registration checks.
 */
#include <stddef.h>
#include <stdint.h>

#include "daemon/mesh/nodelink.h"
#include "daemon/mesh/nodemsg.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/msg.h"
#include "proto/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct sp_limits limits;
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
  struct nodemsg m;
  struct registry reg;
  struct req_groups groups;
  char msg[SP_ERRMSG_MAX + 1];

  nodemsg_meta_limits(&limits);
  if (!msgpack_zone_init(&zone, 4096))
    return 0;
  if (sp__wire_decode(data, size, &limits, &zone, &map) == 0 &&
      sp__msg_head(&map, &head) == 0) {
    (void)nodemsg_parse(&head, &map, &m, msg, sizeof msg);
    nodemsg_free(&m);
  }
  msgpack_zone_destroy(&zone);
  if (nodemsg_parse_meta(data, size, 0, &reg, &groups, msg, sizeof msg) == 0) {
    registry_free(&reg);
    request_groups_free(&groups);
  }
  return 0;
}
