"""The tests' own safetensors reader (safetensors_reader.py) against files
built here byte by byte: one that follows the format is read back, and
each that breaks one rule of it is refused, so that the reader cannot
share a mistake of shardport's writer and pass it."""

import json
import os
import struct
import sys
import tempfile

import safetensors_reader as reader

GOOD = {"__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [8, 8]},
        "s": {"dtype": "I16", "shape": [], "data_offsets": [8, 10]}}
DATA = bytes(range(10))


def build(header_text, data=DATA, pad=True, length=None):
    raw = header_text.encode("utf-8")
    if pad:
        raw += b" " * (-len(raw) % 8)
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def text(header):
    return json.dumps(header, separators=(",", ":"))


def with_entry(key, **fields):
    h = json.loads(json.dumps(GOOD))
    h[key] = dict(h[key], **fields)
    return text(h)


# Each broken file and the rule it breaks.
BROKEN = {
    "a hole before the last tensor":
        build(with_entry("s", data_offsets=[9, 11]), DATA + b"\0"),
    "overlapping tensors": build(with_entry("s", data_offsets=[6, 8]),
                                 DATA[:8]),
    "offsets backwards": build(with_entry("s", data_offsets=[10, 8])),
    "bytes after the last tensor": build(text(GOOD), DATA + b"\0"),
    "a header length that is no multiple of 8": build(text(GOOD), pad=False),
    "padding that is not spaces":
        build(text(GOOD) + "\n" * (-len(text(GOOD)) % 8 or 8), pad=False),
    "a length past the file": build(text(GOOD), length=1 << 20),
    "a header larger than safetensors reads":
        build(text(GOOD), length=100_000_008),
    "a key given twice": build(text(GOOD)[:-1] + ',"a":' +
                               json.dumps(GOOD["a"]) + "}"),
    "__metadata__ given twice": build(text(GOOD)[:-1] +
                                      ',"__metadata__":{}}'),
    "metadata that is not strings": build(
        text(dict(GOOD, __metadata__={"format": "pt", "n": 1}))),
    "a boolean offset": build(with_entry("a", data_offsets=[False, 8])),
    "a float offset": build(with_entry("s", data_offsets=[8.0, 10])),
    "a boolean dimension": build(with_entry("a", shape=[True, 2],
                                            data_offsets=[0, 8])),
    "a dtype the format has not": build(with_entry("a", dtype="F31")),
    "a field too many": build(with_entry("a", offsets=[0, 8])),
    "a header that is no object": build("[1]"),
    "a header of invalid UTF-8": struct.pack("<Q", 8) + b'{"\xff":1}  ',
    "bytes too few for the shape": build(with_entry("s", shape=[2])),
    "NaN in the header": build(with_entry("a", shape=[float("nan")])),
}


def main():
    with tempfile.TemporaryDirectory(prefix="sp-reader-") as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as f:
            f.write(build(text(GOOD)))
        meta, tensors = reader.read_file(path)
        assert meta == {"format": "pt"}, meta
        assert tensors == {"a": ("F32", (2,), DATA[:8]),
                           "e": ("BF16", (0, 3), b""),
                           "s": ("I16", (), DATA[8:10])}, tensors
        accepted = []
        for rule, data in BROKEN.items():
            with open(path, "wb") as f:
                f.write(data)
            try:
                reader.read_file(path)
                accepted.append(rule)
            except (reader.CheckpointError, UnicodeDecodeError):
                pass
        assert not accepted, "the reader accepted %s" % accepted
    print("reader: %d broken files refused" % len(BROKEN))


if __name__ == "__main__":
    sys.exit(main())
