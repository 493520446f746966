/*
 * test_property.c - the corrupted-map property of seed 003.
 *
 * With a fixed seed, random layouts (tgen.h: 2-D and 3-D tensors over 2 to
 * 8 ranks, row and uneven column splits, block grids, replicas cut at other
 * boundaries, strided sources, interleaved columns, pieces in random
 * order).  Each rank's shard is built from the true map; then one offset
 * or stride of one piece is corrupted and the true shards are rebuilt
 * through the corrupted map.  Every corrupted map must be refused or still
 * rebuild bit-exact, and every true map must round-trip (extract, then
 * rebuild) exactly.  The across-nodes suite runs the same layouts through
 * two daemons (tests/integration/nodes/test_property.c).
 */
#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/affine.h"
#include "tests/unit/plan/tgen.h"
#include "tests/unit/plan/tjob.h"

#define LAYOUTS 2400

START_TEST(corrupted_maps_are_refused_or_exact) {
  static struct tgen_layout truth, bad;
  uint64_t seed = 0x5eed5eedu;
  unsigned refused = 0, exact = 0, wrong = 0, roundtrip_failed = 0;
  char msg[256];

  for (unsigned n = 0; n < LAYOUTS; n++) {
    size_t elsize = (size_t)1 << (tjob_rand(&seed) % 4);
    uint8_t *full, *back, *shards[TGEN_MAX_RANKS];
    int rc;

    tgen_generate(&truth, &seed);
    ck_assert_msg(affine_validate(&truth.map, msg, sizeof msg) == 0,
                  "layout %u: the true map is refused: %s", n, msg);
    full = malloc(truth.numel * elsize);
    back = malloc(truth.numel * elsize);
    for (uint64_t i = 0; i < truth.numel * elsize; i++)
      full[i] = (uint8_t)tjob_rand(&seed);
    for (uint32_t r = 0; r < truth.nranks; r++) {
      shards[r] = malloc(truth.shard_numel[r] * elsize + 1);
      ck_assert_int_eq(affine_extract(&truth.map, r, elsize, full, shards[r],
                                      msg, sizeof msg),
                       0);
    }
    rc = affine_rebuild(&truth.map, elsize, (const void *const *)shards, back,
                        msg, sizeof msg);
    roundtrip_failed += rc != 0 || memcmp(full, back, truth.numel * elsize);

    tgen_copy(&bad, &truth);
    tgen_corrupt(&bad, &seed);
    memset(back, 0, truth.numel * elsize);
    rc = affine_rebuild(&bad.map, elsize, (const void *const *)shards, back,
                        msg, sizeof msg);
    if (rc != 0)
      refused++;
    else if (memcmp(full, back, truth.numel * elsize) == 0)
      exact++;
    else
      wrong++;
    for (uint32_t r = 0; r < truth.nranks; r++)
      free(shards[r]);
    free(full);
    free(back);
  }
  printf("affine property: %u layouts, refused %u, exact %u, wrong %u\n",
         LAYOUTS, refused, exact, wrong);
  fflush(stdout);
  ck_assert_uint_eq(refused + exact + wrong, LAYOUTS);
  ck_assert_uint_eq(roundtrip_failed, 0);
  ck_assert_uint_eq(wrong, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-property");
  TCase *tc = tcase_create("property");
  SRunner *sr;
  int failed;

  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, corrupted_maps_are_refused_or_exact);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
