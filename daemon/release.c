/*
 * release.c - release (docs/protocol.md): a rank gives back an export
 * published to it.
 *
 * A published export's segment is the rank's until it releases it or
 * leaves (job.c frees what a departed rank held).  A host segment may
 * still be mapped by the trainer after release: the pool counts it until
 * its file ends (pool.h).  A device segment is kept for the rank's next
 * export, whose tensors then need no fresh device memory.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "daemon/conn.h"
#include "daemon/job.h"
#include "daemon/pool.h"
#include "daemon/release.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "shardport.h"

int release_op_release(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE, "release: join a job first");
  uint64_t export_id;
  char msg[128];
  int rc = request_parse_release(map, &export_id, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "release: %s", msg);
  for (struct job_published **p = &m->published; *p != NULL; p = &(*p)->next) {
    if ((*p)->export_id != export_id)
      continue;
    struct job_published *pub = *p;
    /* A reply still streaming keeps its part 0 until it is written; the
     * segment's descriptor in it is a duplicate. */
    *p = pub->next;
    /* A device segment is kept for this rank's next export. */
    pool_segment_put(m->job->srv->pool, pub->segment);
    free(pub);
    struct sp_msgbuf mb;
    sp__msgbuf_begin(&mb, "release", head->id, 0);
    return conn_send_msgbuf(c, &mb);
  }
  return conn_send_error(c, head->id, SP_ENOEXPORT,
                         "release: export %" PRIu64 " is not published to "
                         "rank %" PRIu32 " of job %s",
                         export_id, m->rank, m->job->hex);
}
