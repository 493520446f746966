/*
 * errors.c - code <-> text for the one error table in shardport.h.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "shardport.h"
#include "proto/fail.h"
#include "proto/msg.h"

struct error_entry {
  int code;
  const char *name;
  const char *message;
};

static const struct error_entry error_table[] = {
#define SP_ERROR_ENTRY(name, num, wire, msg) {-(num), wire, msg},
    SP_ERROR_MAP(SP_ERROR_ENTRY)
#undef SP_ERROR_ENTRY
};

static const struct error_entry *error_lookup(int code) {
  for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
    if (error_table[i].code == code)
      return &error_table[i];
  return NULL;
}

SP_EXPORT const char *sp_strerror(int code) {
  if (code >= 0)
    return "success";
  const struct error_entry *e = error_lookup(code);
  return e ? e->message : "unknown error";
}

SP_EXPORT const char *sp_err_name(int code) {
  if (code >= 0)
    return "ok";
  const struct error_entry *e = error_lookup(code);
  return e ? e->name : "unknown";
}

int sp__error_from_name(const char *name, size_t len) {
  for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++) {
    const char *n = error_table[i].name;
    if (strlen(n) == len && memcmp(n, name, len) == 0)
      return error_table[i].code;
  }
  return SP_EINTERNAL;
}

int sp__failf(char *msg, size_t msglen, int code, const char *fmt, ...) {
  if (msg != NULL && msglen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msglen, fmt, ap);
    va_end(ap);
  }
  return code;
}
