/*
 * test_idxset.c - the daemon's hash tables against hash flooding.
 *
 * Values a client picks to collide under the daemon's old fixed hash
 * (tests/unkeyed_hash.h: public and invertible) must cost the table no more
 * than ordinary values: storage ids, base addresses and key names alike.
 * The cost is counted, not timed: the probes that looking up every member
 * takes.
 */
#include <check.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/idxset.h"
#include "tests/unkeyed_hash.h"

/* Members per table: the crafted ones cost about n * n / 2 probes under the
 * old hash, the ordinary ones about 1.5 * n. */
#define N 20000u

/* ---- measuring --------------------------------------------------------- */

/* The table's size once n members are reserved, which the attacker knows:
 * it depends on n alone. */
static size_t table_cap(size_t n) {
  struct idxset s;
  idxset_init(&s);
  ck_assert_int_eq(idxset_reserve(&s, n), 0);
  size_t cap = s.mask + 1;
  idxset_free(&s);
  return cap;
}

/* The probes that finding every member takes: each member's distance from
 * its home slot, plus one.  A slot holds the member's hash's high 32 bits
 * above its index + 1 (idxset.c), so the home is read from the slot the way
 * unkeyed_home reads it from a hash. */
static uint64_t probes(const struct idxset *s) {
  uint64_t total = 0;
  for (size_t i = 0; i <= s->mask; i++)
    if (s->slot[i] != 0)
      total += ((i - unkeyed_home(s->slot[i], s->mask + 1)) & s->mask) + 1;
  return total;
}

static uint64_t cost_of_u64s(const uint64_t *v, size_t n) {
  struct idxset s;
  idxset_init(&s);
  ck_assert_int_eq(idxset_reserve(&s, n), 0);
  for (size_t i = 0; i < n; i++)
    idxset_insert(&s, idxset_hash_u64(v[i]), (uint32_t)i);
  uint64_t cost = probes(&s);
  idxset_free(&s);
  return cost;
}

static uint64_t cost_of_names(char (*names)[32], size_t n) {
  struct idxset s;
  idxset_init(&s);
  ck_assert_int_eq(idxset_reserve(&s, n), 0);
  for (size_t i = 0; i < n; i++)
    idxset_insert(&s, idxset_hash_bytes(names[i], strlen(names[i])),
                  (uint32_t)i);
  uint64_t cost = probes(&s);
  idxset_free(&s);
  return cost;
}

/* The crafted values must cost at most twice the ordinary ones: both are
 * about 1.5 probes per member under a keyed hash. */
static void assert_no_dearer(const char *what, uint64_t crafted,
                             uint64_t ordinary) {
  ck_assert_msg(crafted <= 2 * ordinary,
                "%s: %u values crafted to collide cost %llu probes, ordinary "
                "ones %llu",
                what, N, (unsigned long long)crafted,
                (unsigned long long)ordinary);
}

/* ---- page faults ------------------------------------------------------- */

static long minor_faults(void) {
  struct rusage ru;
  ck_assert_int_eq(getrusage(RUSAGE_SELF, &ru), 0);
  return ru.ru_minflt;
}

/* Once reserved, a table's pages are the process's own: the insertions
 * take no page fault.  Fresh zeroed pages would fault twice each, once on
 * the probe's read (the shared zero page) and once on the write, which
 * replaces that page and flushes the TLB of every CPU the process runs on
 * (the daemon indexes a large frame's storages on the loop while its
 * workers run). */
START_TEST(reserved_table_takes_no_faults) {
  struct idxset s;
  idxset_init(&s);
  /* A table of 64 MiB: more than the largest block the allocator takes
   * from memory it already holds, so its pages are fresh. */
  const uint32_t n = 1u << 22;
  ck_assert_int_eq(idxset_reserve(&s, n), 0);
  size_t pages = (s.mask + 1) * sizeof *s.slot / (size_t)sysconf(_SC_PAGESIZE);
  long before = minor_faults();
  for (uint32_t i = 0; i < n; i++)
    idxset_insert(&s, idxset_hash_u64(i), i);
  long faults = minor_faults() - before;
  idxset_free(&s);
  printf("%u insertions into a table of %zu pages: %ld page faults\n", n,
         pages, faults);
  /* Under ASan the accesses fault in the table's shadow, an eighth of
   * its pages; fresh pages would fault twice each. */
  ck_assert_msg(faults * 4 < (long)pages,
                "%ld page faults inserting into a reserved table of %zu pages",
                faults, pages);
}
END_TEST

/* ---- the tests ---------------------------------------------------------- */

/* Storage ids are 32 bits, so the finalizer cannot be inverted onto them;
 * the attacker scans for ids whose old home slots fall in a window eight
 * times narrower than their count: one run of slots that every insertion
 * walks to its end. */
START_TEST(crafted_sids_cost_as_sequential) {
  size_t cap = table_cap(N);
  uint64_t *crafted = malloc(N * sizeof *crafted);
  uint64_t *sequential = malloc(N * sizeof *sequential);
  ck_assert_ptr_nonnull(crafted);
  ck_assert_ptr_nonnull(sequential);
  size_t found = 0;
  for (uint64_t sid = 0; found < N && sid <= UINT32_MAX; sid++)
    if (unkeyed_home(unkeyed_u64(sid), cap) < N / 8)
      crafted[found++] = sid;
  ck_assert_uint_eq(found, N);
  for (size_t i = 0; i < N; i++)
    sequential[i] = i;
  assert_no_dearer("storage ids", cost_of_u64s(crafted, N),
                   cost_of_u64s(sequential, N));
  free(crafted);
  free(sequential);
}
END_TEST

/* Base addresses are 64 bits: the attacker inverts the old hash and gets
 * values whose hashes agree in every bit the table looks at. */
START_TEST(crafted_bases_cost_as_sequential) {
  uint64_t *crafted = malloc(N * sizeof *crafted);
  uint64_t *sequential = malloc(N * sizeof *sequential);
  ck_assert_ptr_nonnull(crafted);
  ck_assert_ptr_nonnull(sequential);
  for (size_t i = 0; i < N; i++) {
    crafted[i] = unkeyed_u64_inverse((UINT64_C(0x5eed) << 32) | i);
    ck_assert_uint_eq(unkeyed_u64(crafted[i]) >> 32, 0x5eed);
    sequential[i] = UINT64_C(0x7f0000000000) + 4096 * i;
  }
  assert_no_dearer("base addresses", cost_of_u64s(crafted, N),
                   cost_of_u64s(sequential, N));
  free(crafted);
  free(sequential);
}
END_TEST

/* Key names: scanned for like the storage ids. */
START_TEST(crafted_names_cost_as_sequential) {
  size_t cap = table_cap(N);
  char(*crafted)[32] = malloc(N * sizeof *crafted);
  char(*sequential)[32] = malloc(N * sizeof *sequential);
  ck_assert_ptr_nonnull(crafted);
  ck_assert_ptr_nonnull(sequential);
  size_t found = 0;
  for (uint32_t k = 0; found < N && k < UINT32_MAX; k++) {
    int len = snprintf(crafted[found], sizeof crafted[found], "w.%u", k);
    if (unkeyed_home(unkeyed_bytes(crafted[found], (size_t)len), cap) <
        N / 8)
      found++;
  }
  ck_assert_uint_eq(found, N);
  for (size_t i = 0; i < N; i++)
    snprintf(sequential[i], sizeof sequential[i], "layers.%zu.weight", i);
  assert_no_dearer("key names", cost_of_names(crafted, N),
                   cost_of_names(sequential, N));
  free(crafted);
  free(sequential);
}
END_TEST

/* The function under the key is SipHash-2-4: the example of the SipHash
 * paper (Aumasson and Bernstein, 2012, appendix A), key 00 01 .. 0f and
 * the 15 bytes 00 01 .. 0e, gives 0xa129ca6149be45e5. */
START_TEST(siphash_paper_vector) {
  unsigned char key[crypto_shorthash_KEYBYTES], msg[15], out[8];
  for (unsigned i = 0; i < sizeof key; i++)
    key[i] = (unsigned char)i;
  for (unsigned i = 0; i < sizeof msg; i++)
    msg[i] = (unsigned char)i;
  ck_assert_int_eq(crypto_shorthash(out, msg, sizeof msg, key), 0);
  uint64_t h = 0;
  for (int i = 7; i >= 0; i--)
    h = h << 8 | out[i];
  ck_assert_uint_eq(h, UINT64_C(0xa129ca6149be45e5));
}
END_TEST

/* The key is drawn per process: the same value hashes differently in a
 * new process of this program (one chance in 2^64 that they agree).  The
 * process is exec'd, not only forked: a fork inherits a key already
 * drawn. */
static const char *self_path;

static uint64_t hash_in_new_process(uint64_t v) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    char arg[32];
    snprintf(arg, sizeof arg, "%llu", (unsigned long long)v);
    dup2(fds[1], STDOUT_FILENO);
    execl(self_path, self_path, "--hash", arg, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char out[32] = "";
  ck_assert_int_gt(read(fds[0], out, sizeof out - 1), 0);
  close(fds[0]);
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return strtoull(out, NULL, 10);
}

START_TEST(key_is_per_process) {
  ck_assert_uint_ne(hash_in_new_process(42), hash_in_new_process(42));
  ck_assert_uint_eq(idxset_hash_u64(42), idxset_hash_u64(42));
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-idxset");
  TCase *tc = tcase_create("flooding");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, crafted_sids_cost_as_sequential);
  tcase_add_test(tc, crafted_bases_cost_as_sequential);
  tcase_add_test(tc, crafted_names_cost_as_sequential);
  tcase_add_test(tc, siphash_paper_vector);
  tcase_add_test(tc, key_is_per_process);
  tcase_add_test(tc, reserved_table_takes_no_faults);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--hash") == 0) {
    printf("%llu\n",
           (unsigned long long)idxset_hash_u64(strtoull(argv[2], NULL, 10)));
    return EXIT_SUCCESS;
  }
  self_path = argv[0];
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
