/*
 * inbox.c - how a member and the root talk: a message goes over the
 * node's link, or, on the root's own node, into the mesh's inbox, which
 * the job handles on its next wake-up, so that a member's call into the
 * root (or the root's into its own member) never re-enters the caller.
 */
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

static void inbox_push(struct mesh *ms, bool to_root, uint32_t from,
                       const struct nodemsg *m, struct nodeblob **blobs,
                       size_t nblobs) {
  struct inbox_item *it = calloc(1, sizeof *it);
  if (it == NULL ||
      (nblobs > 0 && (it->blobs = calloc(nblobs, sizeof *it->blobs)) == NULL)) {
    free(it);
    log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
             "job %s: out of memory queueing a message", ms->job->hex);
    return;
  }
  it->to_root = to_root;
  it->from = from;
  it->msg = *m;
  /* The message's arrays are the item's own copies. */
  it->msg.nodes = NULL;
  it->msg.rank_nodes = NULL;
  if (m->nnodes > 0) {
    it->msg.nodes = malloc(m->nnodes * sizeof *m->nodes);
    it->msg.rank_nodes = malloc(m->world * sizeof *m->rank_nodes);
    if (it->msg.nodes == NULL || it->msg.rank_nodes == NULL) {
      nodemsg_free(&it->msg);
      free(it->blobs);
      free(it);
      log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
               "job %s: out of memory queueing a message", ms->job->hex);
      return;
    }
    memcpy(it->msg.nodes, m->nodes, m->nnodes * sizeof *m->nodes);
    memcpy(it->msg.rank_nodes, m->rank_nodes,
           m->world * sizeof *m->rank_nodes);
  }
  it->msg.replicas = NULL;
  if (m->nreplicas > 0) {
    it->msg.replicas = malloc(m->nreplicas * sizeof *m->replicas);
    if (it->msg.replicas == NULL) {
      nodemsg_free(&it->msg);
      free(it->blobs);
      free(it);
      log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
               "job %s: out of memory queueing a message", ms->job->hex);
      return;
    }
    memcpy(it->msg.replicas, m->replicas,
           m->nreplicas * sizeof *m->replicas);
  }
  for (size_t i = 0; i < nblobs; i++)
    it->blobs[i] = nodeblob_ref(blobs[i]);
  it->nblobs = nblobs;
  if (ms->inbox_tail != NULL)
    ms->inbox_tail->next = it;
  else
    ms->inbox_head = it;
  ms->inbox_tail = it;
  ms->ops->wake(ms->job);
}

void inbox_item_free(struct inbox_item *it) {
  for (size_t i = 0; i < it->nblobs; i++)
    nodeblob_unref(it->blobs[i]);
  free(it->blobs);
  nodemsg_free(&it->msg);
  free(it);
}

void mesh_advance(struct job *job) {
  struct mesh *ms = job->mesh;
  /* A shadow nobody joins, or is joining, has nothing to wait for. */
  if (!ms->root && !job->ever_joined && ms->joins == NULL) {
    ms->ops->end(job);
    return;
  }
  while (ms->inbox_head != NULL) {
    struct inbox_item *it = ms->inbox_head;
    ms->inbox_head = it->next;
    if (ms->inbox_head == NULL)
      ms->inbox_tail = NULL;
    if (it->to_root)
      coord_handle(ms, it->from, &it->msg,
                   it->nblobs > 0 ? it->blobs[0] : NULL);
    else
      member_handle(ms, &it->msg, it->blobs, it->nblobs);
    inbox_item_free(it);
  }
}

int inbox_send(struct nodelink *l, const struct nodemsg *m) {
  struct sp_msgbuf mb;
  nodemsg_pack(m, &mb);
  return nodelink_send(l, &mb);
}

/* A member's message to the root: by the inbox on the root's own node. */
void inbox_to_root(struct mesh *ms, const struct nodemsg *m,
                   struct nodeblob *blob) {
  if (ms->root) {
    inbox_push(ms, true, 0, m, blob != NULL ? &blob : NULL, blob != NULL);
    return;
  }
  if (ms->root_link == NULL || !ms->hello_done)
    return;
  if (inbox_send(ms->root_link, m) == 0 && blob != NULL)
    nodelink_send_blob(ms->root_link, blob);
}

/* The root's message to a node. */
void inbox_to_node(struct mesh *ms, uint32_t node, const struct nodemsg *m,
                   struct nodeblob **blobs, size_t nblobs) {
  if (node == ms->self) {
    inbox_push(ms, false, 0, m, blobs, nblobs);
    return;
  }
  struct mesh_node *n = mesh_node_get(ms, node);
  if (n == NULL || n->ctl == NULL)
    return;
  if (inbox_send(n->ctl, m) != 0)
    return;
  for (size_t i = 0; i < nblobs; i++)
    nodelink_send_blob(n->ctl, blobs[i]);
}
