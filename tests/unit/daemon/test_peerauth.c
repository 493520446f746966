/*
 * test_peerauth.c - the proofs of the handshake between daemons
 * (daemon/mesh/peerauth.c): the exact bytes docs/protocol.md names are MAC'd,
 * every one of them matters, and proofs compare equal only when equal.
 *
 * The expected proofs were computed from the documented layout with
 * Python's hmac module, an implementation of its own:
 *   hmac.new(secret, b"shardport-peer-2" + bytes([side, link]) + job
 *            + listener_nonce + dialer_nonce + stream,
 *            hashlib.sha256).hexdigest()
 * with secret = 00..0f, job = 10..1f, listener_nonce = 32 bytes of a0,
 * dialer_nonce = 00..1f, and stream empty for a control link and for a
 * data link node.to_bytes(4, "big") + node_id.to_bytes(8, "big")
 * + bytes([streams, stream]) + export_id.to_bytes(8, "big") with node 1,
 * node_id 0x0102030405060708, stream 1 of 3, export 5.
 */
#include <check.h>
#include <stdio.h>
#include <string.h>

#include "daemon/mesh/peerauth.h"
#include "daemon/request.h"

static uint8_t secret[JOB_SECRET_BYTES], job[JOB_ID_BYTES];
static uint8_t listener_nonce[PEERAUTH_NONCE_BYTES];
static uint8_t dialer_nonce[PEERAUTH_NONCE_BYTES];
static const struct peerauth_stream stream_1_of_3 = {
    .node = 1,
    .node_id = 0x0102030405060708u,
    .stream = 1,
    .streams = 3,
    .export_id = 5};

static void setup(void) {
  for (int i = 0; i < JOB_SECRET_BYTES; i++)
    secret[i] = (uint8_t)i;
  for (int i = 0; i < JOB_ID_BYTES; i++)
    job[i] = (uint8_t)(16 + i);
  memset(listener_nonce, 0xa0, sizeof listener_nonce);
  for (int i = 0; i < PEERAUTH_NONCE_BYTES; i++)
    dialer_nonce[i] = (uint8_t)i;
}

static void hex(const uint8_t *p, char *out) {
  for (int i = 0; i < PEERAUTH_PROOF_BYTES; i++)
    snprintf(out + 2 * i, 3, "%02x", p[i]);
}

/* A data link's proofs bind stream_1_of_3; a control link's no stream. */
static void proof_of(enum peerauth_side side, enum peerauth_link link,
                     uint8_t out[PEERAUTH_PROOF_BYTES]) {
  peerauth_proof(secret, side, link, job, listener_nonce, dialer_nonce,
                 link == PEERAUTH_DATA ? &stream_1_of_3 : NULL, out);
}

START_TEST(proofs_match_the_documented_layout) {
  static const struct {
    enum peerauth_side side;
    enum peerauth_link link;
    const char *want;
  } cases[] = {
      {PEERAUTH_DIALER, PEERAUTH_CONTROL,
       "78dbf6667d3265bfe4b9492b3fd8ff9de124c269d2230b743fb93ca7209f2971"},
      {PEERAUTH_LISTENER, PEERAUTH_CONTROL,
       "777cd431e45410d6dada92f1bc1fa306c89879db74e88c1bc50b96008e5fbc16"},
      {PEERAUTH_DIALER, PEERAUTH_DATA,
       "343cb3721aa3e1b063e8376ce38ae22201624c75ad350ae2494e8be865547ba1"},
      {PEERAUTH_LISTENER, PEERAUTH_DATA,
       "94ad95d6f52f086ded4f5ae0658db982bd3ff9beda97dde78f1d6811113048a5"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint8_t p[PEERAUTH_PROOF_BYTES];
    char got[2 * PEERAUTH_PROOF_BYTES + 1];
    proof_of(cases[i].side, cases[i].link, p);
    hex(p, got);
    ck_assert_str_eq(got, cases[i].want);
  }
}
END_TEST

/* Any byte of the secret, the job id or either nonce changes the proof,
 * and so does swapping the nonces: a proof made for one handshake holds
 * for no other. */
START_TEST(every_input_matters) {
  uint8_t base[PEERAUTH_PROOF_BYTES], p[PEERAUTH_PROOF_BYTES];
  proof_of(PEERAUTH_DIALER, PEERAUTH_CONTROL, base);
  uint8_t *inputs[] = {secret, job, listener_nonce, dialer_nonce};
  size_t lens[] = {sizeof secret, sizeof job, sizeof listener_nonce,
                   sizeof dialer_nonce};
  for (size_t k = 0; k < 4; k++)
    for (size_t i = 0; i < lens[k]; i++) {
      inputs[k][i] ^= 0x01;
      proof_of(PEERAUTH_DIALER, PEERAUTH_CONTROL, p);
      inputs[k][i] ^= 0x01;
      ck_assert_msg(!peerauth_equal(base, p), "input %zu byte %zu ignored",
                    k, i);
    }
  peerauth_proof(secret, PEERAUTH_DIALER, PEERAUTH_CONTROL, job, dialer_nonce,
                 listener_nonce, NULL, p);
  ck_assert(!peerauth_equal(base, p));
  proof_of(PEERAUTH_DIALER, PEERAUTH_CONTROL, p);
  ck_assert(peerauth_equal(base, p));
}
END_TEST

/* A data link's proof holds for the stream it was made for only: another
 * index, count, node, daemon run (node_id) or session (export) of the same
 * handshake, or the same stream without its binding (a control link's
 * layout), is another proof, so a proven connection cannot be passed off
 * as another stream. */
START_TEST(a_data_proof_binds_its_stream) {
  uint8_t base[PEERAUTH_PROOF_BYTES], p[PEERAUTH_PROOF_BYTES];
  proof_of(PEERAUTH_DIALER, PEERAUTH_DATA, base);
  struct peerauth_stream others[8];
  for (size_t i = 0; i < 8; i++)
    others[i] = stream_1_of_3;
  others[0].stream = 0;
  others[1].stream = 2;
  others[2].streams = 2;
  others[3].node = 2;
  others[4].node_id ^= 1;
  others[5].node_id ^= 1ull << 63;
  others[6].export_id = 4;
  others[7].export_id ^= 1ull << 63;
  for (size_t i = 0; i < 8; i++) {
    peerauth_proof(secret, PEERAUTH_DIALER, PEERAUTH_DATA, job, listener_nonce,
                   dialer_nonce, &others[i], p);
    ck_assert_msg(!peerauth_equal(base, p), "stream case %zu ignored", i);
  }
  peerauth_proof(secret, PEERAUTH_DIALER, PEERAUTH_DATA, job, listener_nonce,
                 dialer_nonce, NULL, p);
  ck_assert(!peerauth_equal(base, p));
  peerauth_proof(secret, PEERAUTH_DIALER, PEERAUTH_DATA, job, listener_nonce,
                 dialer_nonce, &stream_1_of_3, p);
  ck_assert(peerauth_equal(base, p));
}
END_TEST

START_TEST(equal_only_when_every_byte_is) {
  uint8_t a[PEERAUTH_PROOF_BYTES], b[PEERAUTH_PROOF_BYTES];
  proof_of(PEERAUTH_LISTENER, PEERAUTH_DATA, a);
  memcpy(b, a, sizeof a);
  ck_assert(peerauth_equal(a, b));
  b[0] ^= 0x80;
  ck_assert(!peerauth_equal(a, b));
  b[0] ^= 0x80;
  b[PEERAUTH_PROOF_BYTES - 1] ^= 0x01;
  ck_assert(!peerauth_equal(a, b));
}
END_TEST

START_TEST(nonces_are_fresh) {
  uint8_t a[PEERAUTH_NONCE_BYTES], b[PEERAUTH_NONCE_BYTES];
  ck_assert_int_eq(peerauth_nonce(a), 0);
  ck_assert_int_eq(peerauth_nonce(b), 0);
  ck_assert_mem_ne(a, b, sizeof a);
}
END_TEST

int main(void) {
  Suite *s = suite_create("peerauth");
  TCase *tc = tcase_create("proofs");
  tcase_add_checked_fixture(tc, setup, NULL);
  tcase_add_test(tc, proofs_match_the_documented_layout);
  tcase_add_test(tc, every_input_matters);
  tcase_add_test(tc, a_data_proof_binds_its_stream);
  tcase_add_test(tc, equal_only_when_every_byte_is);
  tcase_add_test(tc, nonces_are_fresh);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
