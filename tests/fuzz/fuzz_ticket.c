/*
 * fuzz_ticket.c - libFuzzer target for job tickets (request_parse_ticket):
 * the input is a ticket's bytes as a trainer hands them to `join`, both
 * versions (a job on one daemon, a job that may span nodes).
 */
#include <stddef.h>
#include <stdint.h>

#include "daemon/request.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct sp_limits limits;
  struct req_ticket ticket;

  sp__limits_default(&limits);
  (void)request_parse_ticket(data, size, &limits, &ticket);
  return 0;
}
