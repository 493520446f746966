/*
 * test_cuda_api.c - the run-time loading seam (daemon/cuda/api.c): it loads
 * the fakes through SHARDPORT_CUDART_LIB and SHARDPORT_NCCL_LIB, and every
 * way of failing leaves a reason an operator can act on.
 *
 * The environment of this process points at the fakes (meson sets it);
 * cases that need another environment run the fakepeer helper with it, so
 * that the fake runtime, which reads its environment once, is never asked
 * to change its mind.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/cuda/api.h"
#include "shardport.h"
#include "child.h"

START_TEST(loads_the_fakes_named_by_the_environment) {
  struct cuda_api api;
  char why[512] = "unset";
  ck_assert_int_eq(cuda_api_load(&api, why, sizeof(why)), 0);
  ck_assert_str_eq(why, "");
  ck_assert_ptr_nonnull(strstr(api.cudart_path, "libfakecudart.so"));
  ck_assert_ptr_nonnull(strstr(api.nccl_path, "libfakenccl.so"));
  ck_assert_int_eq(api.runtime_version, CUDART_VERSION);
  ck_assert_int_eq(api.driver_version, CUDART_VERSION);
  ck_assert_int_eq(api.nccl_version, NCCL_VERSION_CODE);
  ck_assert_int_eq(api.device_count, 2);
  ck_assert_ptr_nonnull(api.cuMemGetAddressRange);
  ck_assert_ptr_nonnull(api.ncclCommInitRankConfig);

  struct cuda_device_info devs[4];
  ck_assert_int_eq(cuda_api_probe(&api, devs, 4, why, sizeof(why)), 2);
  ck_assert_int_eq(devs[1].ordinal, 1);
  ck_assert_int_eq((int)strlen(devs[0].uuid_str), 40);
  ck_assert_int_eq(strncmp(devs[0].uuid_str, "GPU-", 4), 0);
  ck_assert_str_ne(devs[0].uuid_str, devs[1].uuid_str);
  ck_assert_str_eq(devs[0].pci_bus_id, "0000:18:00.0");
  ck_assert_str_eq(devs[1].pci_bus_id, "0000:28:00.0");
  ck_assert_int_eq(devs[0].cc_major, 9);
  /* A short array gets what fits; the count is still the whole. */
  ck_assert_int_eq(cuda_api_probe(&api, devs, 1, why, sizeof(why)), 2);
  cuda_api_unload(&api);
  ck_assert_ptr_null(api.cudart_handle);
  ck_assert_ptr_null(api.cudaMalloc);
}
END_TEST

/* Sets name=value for one load and restores the previous value. */
static int load_with(const char *name, const char *value, struct cuda_api *api,
                     char *why, size_t whylen) {
  const char *old = getenv(name);
  char *saved = old != NULL ? strdup(old) : NULL;
  setenv(name, value, 1);
  int rc = cuda_api_load(api, why, whylen);
  if (saved != NULL)
    setenv(name, saved, 1);
  else
    unsetenv(name);
  free(saved);
  return rc;
}

START_TEST(a_missing_runtime_path_is_named_in_the_reason) {
  struct cuda_api api;
  char why[512];
  ck_assert_int_eq(load_with("SHARDPORT_CUDART_LIB", "/nonexistent/libcudart.so.13",
                             &api, why, sizeof(why)),
                   SP_EBACKEND);
  ck_assert_msg(strstr(why, "SHARDPORT_CUDART_LIB=/nonexistent/libcudart.so.13") != NULL &&
                    strstr(why, "No such file") != NULL,
                "%s", why);
  ck_assert_ptr_null(api.cudart_handle);
  cuda_api_unload(&api); /* harmless on a failed table */
}
END_TEST

START_TEST(a_missing_nccl_path_is_named_in_the_reason) {
  struct cuda_api api;
  char why[512];
  ck_assert_int_eq(load_with("SHARDPORT_NCCL_LIB", "/nonexistent/libnccl.so.2",
                             &api, why, sizeof(why)),
                   SP_EBACKEND);
  ck_assert_msg(strstr(why, "SHARDPORT_NCCL_LIB=/nonexistent/libnccl.so.2") != NULL,
                "%s", why);
  ck_assert_ptr_null(api.cudart_handle);
  ck_assert_ptr_null(api.nccl_handle);
}
END_TEST

START_TEST(a_library_without_the_functions_is_refused) {
  struct cuda_api api;
  char why[512];
  /* A loadable library that is not a CUDA runtime. */
  ck_assert_int_eq(load_with("SHARDPORT_CUDART_LIB", "libm.so.6", &api, why,
                             sizeof(why)),
                   SP_EBACKEND);
  ck_assert_msg(strstr(why, "libm.so.6 lacks cudaRuntimeGetVersion") != NULL,
                "%s", why);
}
END_TEST

START_TEST(no_driver_is_reported_as_error_35) {
  char out[4096];
  int rc = peer_run((const char *[]){"probe", NULL},
                    (char *[]){"SHARDPORT_FAKE_GPUS=0", NULL}, -1, 10000, out,
                    sizeof(out));
  ck_assert_msg(rc == 2, "status %d: %s", rc, out);
  ck_assert_msg(strstr(out, "no usable NVIDIA driver: cudaGetDeviceCount failed "
                            "with error 35 (CUDA driver version is insufficient "
                            "for CUDA runtime version)") != NULL &&
                    strstr(out, "driver supports CUDA 0.0") != NULL,
                "%s", out);
}
END_TEST

START_TEST(no_visible_device_is_reported_as_error_100) {
  char out[4096];
  int rc = peer_run((const char *[]){"probe", NULL},
                    (char *[]){"CUDA_VISIBLE_DEVICES=", NULL}, -1, 10000, out,
                    sizeof(out));
  ck_assert_msg(rc == 2, "status %d: %s", rc, out);
  ck_assert_msg(strstr(out, "no CUDA device is visible: cudaGetDeviceCount "
                            "failed with error 100") != NULL,
                "%s", out);
}
END_TEST

/* The real runtime, found by the default search: on a machine without the
 * NVIDIA driver (this CI machine) the reason must say error 35; where a GPU
 * is present, loading must succeed. */
START_TEST(the_real_runtime_without_a_gpu_says_why) {
  char out[4096];
  int rc = peer_run((const char *[]){"probe", NULL},
                    (char *[]){"SHARDPORT_CUDART_LIB", "SHARDPORT_NCCL_LIB", NULL},
                    -1, 20000, out, sizeof(out));
  if (access("/dev/nvidiactl", F_OK) == 0) {
    ck_assert_msg(rc == 0, "a GPU machine failed to load CUDA: %s", out);
    return;
  }
  ck_assert_msg(rc == 2, "status %d: %s", rc, out);
  ck_assert_msg(strstr(out, "error 35") != NULL ||
                    strstr(out, "no CUDA runtime library found") != NULL,
                "%s", out);
  if (strstr(out, "error 35") == NULL)
    fprintf(stderr, "note: no CUDA runtime is installed here: %s", out);
}
END_TEST

int main(void) {
  Suite *s = suite_create("cuda-api");
  TCase *tc = tcase_create("load");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, loads_the_fakes_named_by_the_environment);
  tcase_add_test(tc, a_missing_runtime_path_is_named_in_the_reason);
  tcase_add_test(tc, a_missing_nccl_path_is_named_in_the_reason);
  tcase_add_test(tc, a_library_without_the_functions_is_refused);
  tcase_add_test(tc, no_driver_is_reported_as_error_35);
  tcase_add_test(tc, no_visible_device_is_reported_as_error_100);
  tcase_add_test(tc, the_real_runtime_without_a_gpu_says_why);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
