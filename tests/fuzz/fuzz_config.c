/*
 * fuzz_config.c - libFuzzer target for the configuration file
 * (daemon/config.c): the input is a file's bytes, read by config_load from
 * a memfd as `shardportd --config FILE` reads a file, then checked as a
 * whole by config_check.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct config cfg;
  char path[64], err[512];
  int fd = memfd_create("fuzz-config", MFD_CLOEXEC);

  if (fd < 0)
    return 0;
  if (size == 0 || write(fd, data, size) == (ssize_t)size) {
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    config_default(&cfg);
    if (config_load(&cfg, path, true, err, sizeof err) == 0)
      (void)config_check(&cfg, err, sizeof err);
  }
  close(fd);
  return 0;
}
