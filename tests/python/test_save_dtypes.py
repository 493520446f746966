"""Every dtype safetensors names, saved by two ranks through the C library
(save_dtypes.c, as PyTorch 1.13 cannot make some of them) and read back
with the tests' own reader: each key's safetensors dtype name, shape and
bytes exactly as the ranks held them, files cut by a 24-byte limit."""

import os
import subprocess
import sys
import tempfile

import harness
import safetensors_reader

# The C library's dtype names, in save_dtypes.c's order, with their
# element sizes and the names safetensors gives them.
DTYPES = [("bool", 1, "BOOL"), ("uint8", 1, "U8"), ("int8", 1, "I8"),
          ("int16", 2, "I16"), ("uint16", 2, "U16"), ("float16", 2, "F16"),
          ("bfloat16", 2, "BF16"), ("int32", 4, "I32"), ("uint32", 4, "U32"),
          ("float32", 4, "F32"), ("float64", 8, "F64"), ("int64", 8, "I64"),
          ("uint64", 8, "U64"), ("float8_e4m3fn", 1, "F8_E4M3"),
          ("float8_e5m2", 1, "F8_E5M2")]
ROWS, COLS, LIMIT = 5, 3, 24


def expected(k, name, size):
    data = bytes((k * 31 + b * 7) & 0xff for b in range(ROWS * COLS * size))
    return bytes(v & 1 for v in data) if name == "bool" else data


def main():
    with harness.daemon() as d, tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        proc = subprocess.run([os.environ["SHARDPORT_SAVE_DTYPES"], d.socket,
                               path], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout
        _, tensors, weight_map, total = safetensors_reader.read_checkpoint(
            path)
        assert sorted(tensors) == sorted("t." + n for n, _, _ in DTYPES)
        for k, (name, size, st) in enumerate(DTYPES):
            dtype, shape, data = tensors["t." + name]
            assert (dtype, shape) == (st, (ROWS, COLS)), (name, dtype, shape)
            assert data == expected(k, name, size), name
        assert total == sum(ROWS * COLS * s for _, s, _ in DTYPES), total
        # Each file within the limit unless one key alone is larger.
        files = {}
        for key, f in weight_map.items():
            files.setdefault(f, []).append(len(tensors[key][2]))
        for f, sizes in files.items():
            assert sum(sizes) <= LIMIT or len(sizes) == 1, (f, sizes)
        assert len(files) > 2, files
    print("dtypes: %d saved and read back" % len(DTYPES))


if __name__ == "__main__":
    sys.exit(main())
