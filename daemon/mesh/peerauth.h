/*
 * peerauth.h - the proofs daemons exchange to show they know a job's secret
 * (peerauth.c).  Internal to daemon/mesh/.
 */
#ifndef SP_DAEMON_MESH_PEERAUTH_H
#define SP_DAEMON_MESH_PEERAUTH_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/request.h"

/* The handshake between daemons proves the job's secret without sending
 * it (docs/protocol.md, "Handshakes"). */
#define PEERAUTH_NONCE_BYTES 32
#define PEERAUTH_PROOF_BYTES 32

/* Who proves: the daemon that dialled the link, or the one that listened. */
enum peerauth_side { PEERAUTH_DIALER = 1, PEERAUTH_LISTENER = 2 };
/* Which link the proof opens: a control link (peer_hello) or a data link
 * (peer_data). */
enum peerauth_link { PEERAUTH_CONTROL = 1, PEERAUTH_DATA = 2 };

/* Which connection of a data link a proof opens: the dialling daemon
 * (its node number and node_id, random per run), which of its streams this
 * is, of how many, and the export it was dialled for (its session: the
 * link is dialled anew after an export that did not publish).  Bound into
 * the proof, so that a handshake proven for one stream of one session of
 * one daemon's run opens no other stream, count, session or run. */
struct peerauth_stream {
  uint32_t node;
  uint64_t node_id;
  uint32_t stream, streams;
  uint64_t export_id;
};

/* A fresh random nonce from getrandom: 0 or SP_EINTERNAL. */
int peerauth_nonce(uint8_t nonce[PEERAUTH_NONCE_BYTES]);
/* HMAC-SHA-256 keyed by the job's secret over "shardport-peer-2", side,
 * link, the job id, the listener's nonce and the dialer's nonce, and for a
 * data link (stream not NULL) the stream it opens. */
void peerauth_proof(const uint8_t secret[JOB_SECRET_BYTES],
                    enum peerauth_side side, enum peerauth_link link,
                    const uint8_t job[JOB_ID_BYTES],
                    const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                    const uint8_t dialer_nonce[PEERAUTH_NONCE_BYTES],
                    const struct peerauth_stream *stream,
                    uint8_t proof[PEERAUTH_PROOF_BYTES]);
/* Compares two proofs in time independent of where they differ. */
bool peerauth_equal(const uint8_t a[PEERAUTH_PROOF_BYTES],
                    const uint8_t b[PEERAUTH_PROOF_BYTES]);


#endif /* SP_DAEMON_MESH_PEERAUTH_H */
