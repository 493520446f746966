/*
 * dtype.h - the element types a tensor may have, by their PyTorch names.
 *
 * Names travel on the wire; the enum numbers never leave a process, so a new
 * dtype may be inserted anywhere.  SP_DTYPE_INVALID is zero so that a view
 * whose dtype was never set is refused rather than read as float64.
 */
#ifndef SP_PROTO_DTYPE_H
#define SP_PROTO_DTYPE_H

#include <stddef.h>
#include <stdint.h>

/* X(ENUM_SUFFIX, "pytorch name", element size in bytes, "safetensors name")
 *
 * The safetensors name is the dtype string a safetensors header holds for
 * it, as PyTorch's dtypes map to them (docs/checkpoints.md); NULL for a
 * dtype that format cannot name, which a save refuses. */
#define SP_DTYPE_MAP(X)                                                        \
  X(FLOAT64, "float64", 8, "F64")                                              \
  X(FLOAT32, "float32", 4, "F32")                                              \
  X(FLOAT16, "float16", 2, "F16")                                              \
  X(BFLOAT16, "bfloat16", 2, "BF16")                                           \
  X(FLOAT8_E4M3FN, "float8_e4m3fn", 1, "F8_E4M3")                              \
  X(FLOAT8_E4M3FNUZ, "float8_e4m3fnuz", 1, NULL)                               \
  X(FLOAT8_E5M2, "float8_e5m2", 1, "F8_E5M2")                                  \
  X(FLOAT8_E5M2FNUZ, "float8_e5m2fnuz", 1, NULL)                               \
  X(INT8, "int8", 1, "I8")                                                     \
  X(INT16, "int16", 2, "I16")                                                  \
  X(INT32, "int32", 4, "I32")                                                  \
  X(INT64, "int64", 8, "I64")                                                  \
  X(UINT8, "uint8", 1, "U8")                                                   \
  X(UINT16, "uint16", 2, "U16")                                                \
  X(UINT32, "uint32", 4, "U32")                                                \
  X(UINT64, "uint64", 8, "U64")                                                \
  X(BOOL, "bool", 1, "BOOL")                                                   \
  X(COMPLEX64, "complex64", 8, NULL)                                           \
  X(COMPLEX128, "complex128", 16, NULL)

enum sp_dtype {
  SP_DTYPE_INVALID = 0,
#define SP_DTYPE_ENUM(name, str, size, st) SP_DTYPE_##name,
  SP_DTYPE_MAP(SP_DTYPE_ENUM)
#undef SP_DTYPE_ENUM
      SP_DTYPE_COUNT
};

/* The dtype named by name[0..len) ("float32", or str(torch.float32), i.e.
 * "torch.float32"); SP_EDTYPE for any other name. */
int sp_dtype_from_name(const char *name, size_t len, enum sp_dtype *out);
/* The PyTorch name without the "torch." prefix; "invalid" outside the table. */
const char *sp_dtype_name(enum sp_dtype dtype);
/* Bytes per element; 0 outside the table, which callers treat as refusal. */
uint32_t sp_dtype_size(enum sp_dtype dtype);
/* The safetensors dtype name ("F32", "BF16"); NULL when the format has
 * none for it, and outside the table. */
const char *sp_dtype_safetensors_name(enum sp_dtype dtype);

#endif /* SP_PROTO_DTYPE_H */
