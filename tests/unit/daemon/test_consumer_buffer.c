/*
 * test_consumer_buffer.c - a consumer's memfd storages mapped writable
 * (daemon/consumer_buffer.h): what the daemon writes lands in the
 * consumer's file, buffers in one file share a memory id, and a buffer in a
 * trainer's registered bytes, of another kind, in a short, read-only or
 * sealed file or behind a descriptor that is no file is refused, with
 * nothing left mapped.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/consumer_buffer.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

static int map(const struct req_storage *s, size_t n, const int *fds,
               size_t nfds, const struct consumer_trainer *t, size_t nt,
               struct consumer_files *files, struct consumer_buffer *out,
               char *msg) {
  struct sp_frame frame = {.nfds = nfds};
  for (size_t i = 0; i < nfds; i++)
    frame.fds[i] = fds[i];
  return consumer_buffers_map(s, n, &frame, t, nt, files, out, msg, 512);
}

START_TEST(writes_land_in_the_consumers_file) {
  long page = sysconf(_SC_PAGESIZE);
  int fd = tmodel_memfd("consumer", (size_t)(2 * page));
  struct req_storage s = {.sid = 4, .fd = 0, .offset = 100, .length = 5000};
  struct consumer_files files = {0};
  struct consumer_buffer b;
  char msg[512], back[5000];

  ck_assert_int_eq(map(&s, 1, &fd, 1, NULL, 0, &files, &b, msg), 0);
  ck_assert_uint_eq(b.sid, 4);
  ck_assert_uint_eq(b.s.device.type, SP_DEVICE_CPU);
  ck_assert_uint_eq(b.s.nbytes, 5000);
  ck_assert_uint_eq(b.s.memory, 1);
  ck_assert_uint_eq(b.s.memory_offset, 100);
  for (int i = 0; i < 5000; i++)
    b.data[i] = (uint8_t)(i * 7 + 1);
  ck_assert_int_eq(pread(fd, back, sizeof back, 100), (ssize_t)sizeof back);
  ck_assert_mem_eq(back, b.data, sizeof back);
  consumer_buffers_unmap(&b, 1);
  ck_assert_ptr_null(b.map);
  consumer_files_free(&files);
  close(fd);
}
END_TEST

START_TEST(buffers_in_one_file_share_a_memory_id) {
  int fds[2] = {tmodel_memfd("consumer-a", 4096),
                tmodel_memfd("consumer-b", 4096)};
  int again = dup(fds[0]);
  int all[3] = {fds[0], fds[1], again};
  struct req_storage s[4] = {{.sid = 1, .fd = 0, .offset = 0, .length = 64},
                             {.sid = 2, .fd = 1, .offset = 0, .length = 64},
                             {.sid = 3, .fd = 2, .offset = 64, .length = 64},
                             {.sid = 4, .fd = 1, .offset = 64, .length = 0}};
  struct consumer_files files = {0};
  struct consumer_buffer b[4];
  char msg[512];

  ck_assert_int_eq(map(s, 4, all, 3, NULL, 0, &files, b, msg), 0);
  ck_assert_uint_eq(b[0].s.memory, 1);
  ck_assert_uint_eq(b[1].s.memory, 2);
  /* Another descriptor of the first file: the same object. */
  ck_assert_uint_eq(b[2].s.memory, 1);
  ck_assert_uint_eq(b[2].s.memory_offset, 64);
  /* An empty buffer names its file and maps nothing. */
  ck_assert_uint_eq(b[3].s.memory, 2);
  ck_assert_ptr_null(b[3].data);
  consumer_buffers_unmap(b, 4);
  consumer_files_free(&files);
  for (int i = 0; i < 3; i++)
    close(all[i]);
}
END_TEST

START_TEST(a_buffer_in_a_trainers_storage_is_refused) {
  struct tmodel m;
  tmodel_init(&m, 2, 8192);
  int own = tmodel_memfd("consumer", 4096);
  int fds[2] = {own, m.fd[1]};
  struct consumer_trainer t[2] = {{.rank = 0, .reg = &m.reg[0]},
                                  {.rank = 1, .reg = &m.reg[1]}};
  struct req_storage s[2] = {{.sid = 1, .fd = 0, .offset = 0, .length = 64},
                             {.sid = 9, .fd = 1, .offset = 8191, .length = 1}};
  struct consumer_files files = {0};
  struct consumer_buffer b[2];
  char msg[512];

  ck_assert_int_eq(map(s, 2, fds, 2, t, 2, &files, b, msg), SP_EPERM);
  ck_assert_str_eq(msg, "storages[1] (sid 9) shares bytes with rank 1's "
                        "storage sid 1: a trainer's memory is never written");
  /* All or none: the first buffer is not left mapped. */
  ck_assert_ptr_null(b[0].map);
  consumer_files_free(&files);
  close(own);
  tmodel_free(&m);
}
END_TEST

/* One storage refused: its code, with nothing mapped. */
static int refused(struct req_storage s, int fd, char *msg) {
  struct consumer_files files = {0};
  struct consumer_buffer b;
  int rc = map(&s, 1, &fd, 1, NULL, 0, &files, &b, msg);
  ck_assert_ptr_null(b.map);
  consumer_files_free(&files);
  return rc;
}

START_TEST(buffers_that_cannot_be_written_are_refused) {
  int fd = tmodel_memfd("consumer", 4096);
  char path[64], msg[512];
  int pipefd[2];
  struct req_storage s = {.sid = 2, .fd = 0, .offset = 0, .length = 4096};

  s.kind = REQ_STORAGE_CUDA_FD;
  ck_assert_int_eq(refused(s, fd, msg), SP_EINVAL);
  s.kind = REQ_STORAGE_MEMFD;
  s.offset = 1;
  ck_assert_int_eq(refused(s, fd, msg), SP_EBADFD);
  ck_assert_str_eq(msg, "storages[0] (sid 2): the file has 4096 bytes, fewer "
                        "than offset + length");
  s.offset = 0;
  s.length = UINT64_MAX;
  ck_assert_int_eq(refused(s, fd, msg), SP_EBADFD);
  s.length = 4096;

  ck_assert_int_eq(pipe(pipefd), 0);
  ck_assert_int_eq(refused(s, pipefd[0], msg), SP_EBADFD);
  ck_assert_str_eq(msg,
                   "storages[0] (sid 2): the descriptor is not a memfd or shm "
                   "file");
  close(pipefd[0]);
  close(pipefd[1]);

  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  int ro = open(path, O_RDONLY | O_CLOEXEC);
  ck_assert_int_ge(ro, 0);
  ck_assert_int_eq(refused(s, ro, msg), SP_EBADFD);
  close(ro);

  int sealed = memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(sealed, 0);
  ck_assert_int_eq(ftruncate(sealed, 4096), 0);
  ck_assert_int_eq(fcntl(sealed, F_ADD_SEALS, F_SEAL_WRITE), 0);
  ck_assert_int_eq(refused(s, sealed, msg), SP_EBADFD);
  close(sealed);
  close(fd);
}
END_TEST

int main(void) {
  Suite *s = suite_create("consumer-buffer");
  TCase *tc = tcase_create("consumer-buffer");
  tcase_add_test(tc, writes_land_in_the_consumers_file);
  tcase_add_test(tc, buffers_in_one_file_share_a_memory_id);
  tcase_add_test(tc, a_buffer_in_a_trainers_storage_is_refused);
  tcase_add_test(tc, buffers_that_cannot_be_written_are_refused);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
