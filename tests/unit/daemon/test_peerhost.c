/*
 * test_peerhost.c - what a host is to the peer port's limits
 * (daemon/peerhost.c): IPv4 addresses, IPv6 /64 prefixes, IPv4-mapped
 * IPv6 as IPv4; and which link in its handshake is dropped at the cap.
 */
#include <arpa/inet.h>
#include <check.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/peerhost.h"

/* The host of a numeric address, IPv4 or IPv6. */
static struct peer_host host_of(const char *addr) {
  struct sockaddr_storage sa;
  memset(&sa, 0, sizeof sa);
  struct sockaddr_in *v4 = (struct sockaddr_in *)&sa;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&sa;
  if (inet_pton(AF_INET, addr, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(1000);
  } else {
    ck_assert_int_eq(inet_pton(AF_INET6, addr, &v6->sin6_addr), 1);
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(2000);
  }
  struct peer_host h;
  peerhost_of(&sa, &h);
  return h;
}

static bool same(const char *a, const char *b) {
  struct peer_host x = host_of(a), y = host_of(b);
  return peerhost_cmp(&x, &y) == 0;
}

START_TEST(ipv6_hosts_are_64_prefixes) {
  /* A host cycling addresses in its /64 stays one host... */
  ck_assert(same("2001:db8:1:2::1", "2001:db8:1:2::2"));
  ck_assert(same("2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff"));
  /* ...and the next /64 is another, at the prefix's last bit. */
  ck_assert(!same("2001:db8:1:2::1", "2001:db8:1:3::1"));
  ck_assert(same("2001:db8:1:2::1", "2001:db8:1:2:8000::1"));
  ck_assert(!same("fe80::1", "fe81::1"));
}
END_TEST

START_TEST(ipv4_hosts_are_addresses) {
  ck_assert(same("192.0.2.1", "192.0.2.1"));
  ck_assert(!same("192.0.2.1", "192.0.2.2"));
  /* An IPv4 address and an IPv6 one whose first bytes are alike differ. */
  ck_assert(!same("192.0.2.1", "c000:201::"));
}
END_TEST

START_TEST(ipv4_mapped_is_ipv4) {
  ck_assert(same("::ffff:192.0.2.1", "192.0.2.1"));
  ck_assert(!same("::ffff:192.0.2.1", "192.0.2.2"));
  /* All mapped addresses share ::/64, but each is its own IPv4 host. */
  ck_assert(!same("::ffff:192.0.2.1", "::ffff:192.0.2.2"));
  /* Not mapped: ::1 is an IPv6 host of its own. */
  ck_assert(!same("::1", "0.0.0.1"));
}
END_TEST

static struct peerhost_entry entry(const char *addr, uint64_t id) {
  return (struct peerhost_entry){host_of(addr), id, NULL};
}

/* The oldest link of the host that holds the most: a host spread over
 * its /64 holds them all, so its oldest goes, not another daemon's. */
START_TEST(victim_is_crowded_hosts_oldest) {
  struct peerhost_entry e[5] = {
      entry("2001:db8::10", 1),  /* another daemon, oldest of all */
      entry("2001:db8:0:1::a", 3), entry("2001:db8:0:1::b", 2),
      entry("2001:db8:0:1::c", 4), entry("192.0.2.9", 5)};
  size_t v = peerhost_victim(e, 5);
  ck_assert_uint_eq(e[v].id, 2);
}
END_TEST

/* Ties: of the hosts that hold the most, the one whose oldest is oldest,
 * whatever order the links come in. */
START_TEST(victim_ties_go_to_oldest) {
  struct peerhost_entry e[4] = {entry("192.0.2.1", 7), entry("192.0.2.2", 3),
                                entry("::ffff:192.0.2.1", 4),
                                entry("192.0.2.2", 9)};
  size_t v = peerhost_victim(e, 4);
  ck_assert_uint_eq(e[v].id, 3);
  struct peerhost_entry one = entry("::1", 42);
  ck_assert_uint_eq(peerhost_victim(&one, 1), 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("daemon-peerhost");
  TCase *tc = tcase_create("peerhost");
  tcase_add_test(tc, ipv6_hosts_are_64_prefixes);
  tcase_add_test(tc, ipv4_hosts_are_addresses);
  tcase_add_test(tc, ipv4_mapped_is_ipv4);
  tcase_add_test(tc, victim_is_crowded_hosts_oldest);
  tcase_add_test(tc, victim_ties_go_to_oldest);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
