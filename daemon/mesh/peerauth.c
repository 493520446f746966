/*
 * peerauth.c - the proofs of the handshake between daemons; see peerauth.h
 * and docs/protocol.md ("Handshakes").
 *
 * Two daemons of a job prove to each other that they know the job's secret
 * without sending it: the daemon that listens sends a fresh random nonce
 * first, the daemon that dials answers with its own nonce and an
 * HMAC-SHA-256, keyed by the secret, over both nonces, the job id, the kind
 * of link and the direction, and the listener answers with the same MAC in
 * the other direction.  A nonce is never used twice, so bytes recorded from
 * one handshake prove nothing on another connection; the direction is in
 * the MAC, so a listener's proof cannot be sent back as a dialer's; a data
 * link's MAC also covers the dialler's node, node_id, the stream's index
 * and count and the export it was dialled for, so that whoever sits on the
 * path cannot relabel a proven connection as another stream (the pair
 * would deal its stripes to the wrong sockets), another session's or
 * another run's.
 *
 * HMAC and SHA-256 are nettle's (RFC 2104 over FIPS 180-4), and proofs are
 * compared with nettle's memeql_sec, whose time does not depend on where
 * two proofs first differ.
 */
#include <nettle/hmac.h>
#include <nettle/memops.h>
#include <string.h>
#include <sys/random.h>

#include "daemon/mesh/peerauth.h"
#include "shardport.h"

/* The first bytes of every MAC'd message: names the protocol and its
 * version, so that no other use of a job's secret can be replayed here. */
static const char proof_label[] = "shardport-peer-2";

int peerauth_nonce(uint8_t nonce[PEERAUTH_NONCE_BYTES]) {
  size_t got = 0;
  while (got < PEERAUTH_NONCE_BYTES) {
    ssize_t n = getrandom(nonce + got, PEERAUTH_NONCE_BYTES - got, 0);
    if (n < 0)
      return SP_EINTERNAL;
    got += (size_t)n;
  }
  return 0;
}

void peerauth_proof(const uint8_t secret[JOB_SECRET_BYTES],
                    enum peerauth_side side, enum peerauth_link link,
                    const uint8_t job[JOB_ID_BYTES],
                    const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                    const uint8_t dialer_nonce[PEERAUTH_NONCE_BYTES],
                    const struct peerauth_stream *stream,
                    uint8_t proof[PEERAUTH_PROOF_BYTES]) {
  struct hmac_sha256_ctx ctx;
  uint8_t kinds[2] = {(uint8_t)side, (uint8_t)link};
  hmac_sha256_set_key(&ctx, JOB_SECRET_BYTES, secret);
  hmac_sha256_update(&ctx, sizeof proof_label - 1,
                     (const uint8_t *)proof_label);
  hmac_sha256_update(&ctx, sizeof kinds, kinds);
  hmac_sha256_update(&ctx, JOB_ID_BYTES, job);
  hmac_sha256_update(&ctx, PEERAUTH_NONCE_BYTES, listener_nonce);
  hmac_sha256_update(&ctx, PEERAUTH_NONCE_BYTES, dialer_nonce);
  if (stream != NULL) {
    /* Big-endian, at fixed widths (docs/protocol.md, "Handshakes"). */
    uint8_t b[22];
    for (int i = 0; i < 4; i++)
      b[i] = (uint8_t)(stream->node >> (24 - 8 * i));
    for (int i = 0; i < 8; i++)
      b[4 + i] = (uint8_t)(stream->node_id >> (56 - 8 * i));
    b[12] = (uint8_t)stream->streams;
    b[13] = (uint8_t)stream->stream;
    for (int i = 0; i < 8; i++)
      b[14 + i] = (uint8_t)(stream->export_id >> (56 - 8 * i));
    hmac_sha256_update(&ctx, sizeof b, b);
  }
  hmac_sha256_digest(&ctx, PEERAUTH_PROOF_BYTES, proof);
}

bool peerauth_equal(const uint8_t a[PEERAUTH_PROOF_BYTES],
                    const uint8_t b[PEERAUTH_PROOF_BYTES]) {
  return memeql_sec(a, b, PEERAUTH_PROOF_BYTES) != 0;
}
