/*
 * wire.h - the one place where bytes from a socket become msgpack objects.
 *
 * msgpack-c's unpacker trusts the counts a message declares (an array that
 * claims four billion elements makes it ask for about 96 GB), so a frame is
 * first walked by a bounded scanner that allocates nothing and checks every
 * declared length against the bytes left and the configured limits.  Only a
 * frame that passes is handed to msgpack-c.
 */
#ifndef SP_PROTO_WIRE_H
#define SP_PROTO_WIRE_H

#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/limits.h"

/*
 * Checks that data holds exactly one msgpack map and nothing after it,
 * nested at most limits->max_depth deep, with no container declaring more
 * items than limits->max_items or than the bytes left could hold, and no
 * str/bin/ext longer than limits->max_string or the bytes left.  Returns 0
 * or SP_EMALFORMED, SP_ETOODEEP, SP_ETOOMANY, SP_ESTRTOOLONG.
 */
int sp__wire_check(const uint8_t *data, size_t len,
                   const struct sp_limits *limits);

/*
 * Checks data with sp__wire_check, then unpacks it into zone.  *out is the
 * top-level map; its strings point into data, which must outlive it.
 */
int sp__wire_decode(const uint8_t *data, size_t len,
                    const struct sp_limits *limits, msgpack_zone *zone,
                    msgpack_object *out);

#endif /* SP_PROTO_WIRE_H */
