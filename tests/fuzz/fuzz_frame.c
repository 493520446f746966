/*
 * fuzz_frame.c - libFuzzer target for the frame decoder: the input is a byte
 * stream as a peer would send it, read frame by frame through the real
 * receiver and decoded through the bounded scanner.
 */
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "proto/frame.h"
#include "proto/msg.h"
#include "proto/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void decode(const struct sp_frame *frame, const struct sp_limits *limits) {
  msgpack_zone zone;
  if (!msgpack_zone_init(&zone, 4096))
    return;
  msgpack_object map;
  struct sp_msg_head head;
  if (sp__wire_decode(frame->data, frame->len, limits, &zone, &map) == 0)
    (void)sp__msg_head(&map, &head);
  msgpack_zone_destroy(&zone);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return 0;
  /* The socket buffer holds more than -max_len, so one write suffices. */
  if (size > 0 && write(sv[0], data, size) != (ssize_t)size)
    goto out;
  close(sv[0]);
  sv[0] = -1;
  fcntl(sv[1], F_SETFL, O_NONBLOCK);

  struct sp_limits limits;
  sp__limits_default(&limits);
  limits.max_frame = 1 << 16;
  struct sp_frame_rx rx;
  sp__frame_rx_init(&rx, &limits);
  struct sp_frame frame;
  while (sp__frame_rx_read(&rx, sv[1], &frame) == 1) {
    decode(&frame, &limits);
    sp__frame_release(&frame);
  }
  sp__frame_rx_reset(&rx);
out:
  if (sv[0] >= 0)
    close(sv[0]);
  close(sv[1]);
  return 0;
}
