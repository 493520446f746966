/*
 * test_client_save.c - what sp_save asks the daemon for, against a fake
 * daemon that records each export request's "save" map and refuses it:
 * the digests every rank's must match (docs/checkpoints.md), and the
 * rank's own refusal, which travels with the request instead of leaving
 * the other ranks waiting.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/unit/client/fake_daemon.h"

#define MAX_ASKS 8

struct ask {
  uint64_t limit, directory, metadata;
  bool overwrite;
  char error[64];
  char message[512];
};

struct seen {
  int rc;
  size_t n;
  struct ask asks[MAX_ASKS];
};

/* Records every export's save map and answers it with an error, until the
 * client closes. */
static void script_record_saves(int conn, void *arg) {
  struct seen *s = arg;
  s->rc = fake_hello(conn);
  while (s->rc == 0) {
    struct fake_request req;
    if (fake_recv(conn, &req) < 0)
      return;
    const msgpack_object *save = sp__msg_field(&req.map, "save");
    if (strcmp(req.head.op, "export") != 0 || save == NULL ||
        save->type != MSGPACK_OBJECT_MAP || s->n == MAX_ASKS) {
      s->rc = SP_EBADMSG;
      fake_request_free(&req);
      return;
    }
    struct ask *a = &s->asks[s->n++];
    if (sp__msg_get_u64(save, "max_shard_bytes", false, &a->limit) != 0 ||
        sp__msg_get_u64(save, "directory", false, &a->directory) != 0 ||
        sp__msg_get_u64(save, "metadata", false, &a->metadata) != 0 ||
        sp__msg_get_bool(save, "overwrite", false, &a->overwrite) != 0)
      s->rc = SP_EBADMSG;
    sp__msg_get_strbuf(save, "error", true, a->error, sizeof a->error);
    sp__msg_get_strbuf(save, "message", true, a->message, sizeof a->message);
    s->rc = fake_send_error(conn, req.head.id, "aborted", "recorded");
    fake_request_free(&req);
  }
}

static char tmp[64];

static void setup(void) {
  snprintf(tmp, sizeof tmp, "/tmp/sp-client-save-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tmp));
}

static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
  ck_assert_int_eq(system(cmd), 0);
}

/* Saves into each of dirs with the metadata of each, through one fake
 * daemon that records the asks into *s. */
static void save_each(struct seen *s, size_t n, const char *const *dirs,
                      const sp_save_opts *opts) {
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_record_saves, s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  for (size_t i = 0; i < n; i++) {
    ck_assert_int_eq(sp_save(c, dirs[i], &opts[i], NULL), SP_EABORTED);
    ck_assert_str_eq(sp_last_message(c), "recorded");
  }
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s->rc, 0);
  ck_assert_uint_eq(s->n, n);
}

/* The directory as the rank resolves it, whatever path leads there; the
 * metadata whatever order its entries come in. */
START_TEST(digests_name_what_is_saved_not_how_it_is_spelt) {
  char real[96], link[96], through[160], other[96];
  snprintf(real, sizeof real, "%s/real", tmp);
  snprintf(link, sizeof link, "%s/link", tmp);
  snprintf(through, sizeof through, "%s/./../%s/link/", tmp, tmp + 5);
  snprintf(other, sizeof other, "%s/other", tmp);
  ck_assert_int_eq(mkdir(real, 0700), 0);
  ck_assert_int_eq(symlink(real, link), 0);
  sp_metadata ab[] = {{"a", "1"}, {"b", "2"}}, ba[] = {{"b", "2"}, {"a", "1"}};
  sp_metadata ab3[] = {{"a", "1"}, {"b", "3"}}, split[] = {{"a", "12"}};
  sp_metadata joined[] = {{"a1", "2"}};
  const char *dirs[] = {real, through, real, other, real, real, real};
  sp_save_opts opts[] = {
      {.nmetadata = 2, .metadata = ab},
      {.nmetadata = 2, .metadata = ba},
      {.nmetadata = 2, .metadata = ab3},
      {.nmetadata = 2, .metadata = ab},
      {.nmetadata = 1, .metadata = split},
      {.nmetadata = 1, .metadata = joined},
      {.nmetadata = 2, .metadata = ab, .overwrite = 1,
       .max_shard_bytes = 4096},
  };
  struct seen s = {0};
  save_each(&s, 7, dirs, opts);
  const struct ask *a = s.asks;
  for (size_t i = 0; i < 7; i++)
    ck_assert_str_eq(a[i].error, "");
  ck_assert_uint_eq(a[0].directory, a[1].directory);
  ck_assert_uint_eq(a[0].metadata, a[1].metadata);
  ck_assert_uint_eq(a[0].directory, a[2].directory);
  ck_assert_uint_ne(a[0].metadata, a[2].metadata);
  ck_assert_uint_ne(a[0].directory, a[3].directory);
  ck_assert_uint_ne(a[4].metadata, a[5].metadata);
  ck_assert_uint_eq(a[0].limit, SP_SAVE_DEFAULT_SHARD_BYTES);
  ck_assert(!a[0].overwrite);
  ck_assert_uint_eq(a[6].limit, 4096);
  ck_assert(a[6].overwrite);
}
END_TEST

/* What the rank cannot save with is said in its request, in its words. */
START_TEST(a_ranks_refusal_goes_with_its_request) {
  char dir[96], file[96], under[128], longdir[5000];
  snprintf(dir, sizeof dir, "%s/d", tmp);
  snprintf(file, sizeof file, "%s/file", tmp);
  snprintf(under, sizeof under, "%s/under", file);
  FILE *f = fopen(file, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  memset(longdir, 'x', sizeof longdir - 1);
  longdir[0] = '/';
  longdir[sizeof longdir - 1] = '\0';
  /* A UTF-16 surrogate (U+D800) written as UTF-8: no UTF-8 decoder
   * accepts it, so no loader could read the header. */
  sp_metadata surrogate[] = {{"k", "\xed\xa0\x80"}};
  sp_metadata overlong[] = {{"\xc0\xaf", "v"}};
  sp_metadata format[] = {{"format", "np"}};
  const char *dirs[] = {dir, dir, dir, under, longdir};
  sp_save_opts opts[] = {
      {.nmetadata = 1, .metadata = surrogate},
      {.nmetadata = 1, .metadata = overlong},
      {.nmetadata = 1, .metadata = format},
      {0},
      {0},
  };
  struct seen s = {0};
  save_each(&s, 5, dirs, opts);
  const char *words[] = {
      "save: metadata entry 0 is not two UTF-8 strings",
      "save: metadata entry 0 is not two UTF-8 strings",
      "save: the metadata key \"format\" is shardport's",
      "save: cannot make directory",
      "save: the directory's name is too long",
  };
  const char *codes[] = {"invalid_argument", "invalid_argument",
                         "invalid_argument", "write_failed",
                         "invalid_argument"};
  for (size_t i = 0; i < 5; i++) {
    ck_assert_str_eq(s.asks[i].error, codes[i]);
    ck_assert_msg(strstr(s.asks[i].message, words[i]) != NULL,
                  "ask %zu: %s", i, s.asks[i].message);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("client-save");
  TCase *tc = tcase_create("asks");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, digests_name_what_is_saved_not_how_it_is_spelt);
  tcase_add_test(tc, a_ranks_refusal_goes_with_its_request);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
