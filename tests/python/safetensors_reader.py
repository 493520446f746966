"""An independent reader of safetensors checkpoints, for the tests: it
parses each file byte by byte as the format lays it out (docs/checkpoints.md)
and shares no code with shardport.

    files, weight_map, total_size = read_checkpoint(directory)

Every rule of the format is checked, and a file that breaks one raises
CheckpointError naming it: the 8-byte little-endian length, at most
MAX_HEADER bytes of header, UTF-8 JSON that is one object padded with
spaces to a multiple of 8 (so the tensors start 8-byte aligned), no key
twice in any object, __metadata__ a map of strings, every tensor exactly
dtype, shape and data_offsets, integers that are integers (not floats,
not booleans), the tensors laid out back to back from 0 without gaps or
overlaps in offset order, and nothing after the last one.  The index:
metadata.total_size an integer, weight_map keys to file names of the
convention, each file's keys exactly those the index puts there.
read_checkpoint returns each key's dtype name, shape and raw bytes.
"""

import json
import os
import re
import struct

# dtype name -> bytes per element.
ELEMENT = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2,
           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8,
           "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
INDEX = "model.safetensors.index.json"
# The largest header safetensors' own reader accepts.
MAX_HEADER = 100_000_000
NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


class CheckpointError(Exception):
    pass


def _no_repeats(pairs):
    """An object's members, refusing a key given twice (json keeps the
    last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError("the key %r is given twice" % key)
        out[key] = value
    return out


def _refuse_constant(name):
    raise CheckpointError("%s is not a JSON number safetensors allows"
                          % name)


def _json(text):
    return json.loads(text, object_pairs_hook=_no_repeats,
                      parse_constant=_refuse_constant)


def _is_uint(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_file(path):
    """(metadata, {key: (dtype, shape, bytes)}) of one file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise CheckpointError("%s: shorter than its length field" % path)
    (n,) = struct.unpack("<Q", data[:8])
    if n % 8 != 0 or 8 + n > len(data) or n > MAX_HEADER:
        raise CheckpointError("%s: header length %d is not a multiple of 8 "
                              "within the file and %d bytes" % (path, n,
                                                                MAX_HEADER))
    raw = data[8:8 + n]
    text = raw.decode("utf-8")
    body = text.rstrip(" ")
    if not body.startswith("{") or not body.endswith("}") or \
            len(text) - len(body) >= 8:
        raise CheckpointError("%s: the header is not one JSON object padded "
                              "with fewer than 8 spaces" % path)
    header = _json(body)
    if not isinstance(header, dict):
        raise CheckpointError("%s: the header is not an object" % path)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str)
            for k, v in meta.items()):
        raise CheckpointError("%s: __metadata__ is not a map of strings"
                              % path)
    buffer = data[8 + n:]
    for key, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape",
                                                 "data_offsets"}:
            raise CheckpointError("%s: %s is not exactly dtype, shape and "
                                  "data_offsets: %r" % (path, key, e))
        offsets = e["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2 or \
                not all(_is_uint(v) for v in offsets) or \
                offsets[0] > offsets[1]:
            raise CheckpointError("%s: %s has data_offsets %r" % (path, key,
                                                                  offsets))
        if not isinstance(e["shape"], list) or \
                not all(_is_uint(d) for d in e["shape"]):
            raise CheckpointError("%s: %s has shape %r" % (path, key,
                                                           e["shape"]))
    entries = sorted(header.items(),
                     key=lambda kv: tuple(kv[1]["data_offsets"]))
    at = 0
    tensors = {}
    for key, e in entries:
        dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in ELEMENT:
            raise CheckpointError("%s: %s has dtype %r" % (path, key, dtype))
        count = 1
        for d in shape:
            count *= d
        if begin != at or end - begin != count * ELEMENT[dtype]:
            raise CheckpointError("%s: %s lies at [%d, %d), expected [%d, "
                                  "%d)" % (path, key, begin, end, at,
                                           at + count * ELEMENT[dtype]))
        tensors[key] = (dtype, tuple(shape), buffer[begin:end])
        at = end
    if at != len(buffer):
        raise CheckpointError("%s: %d bytes after the last tensor"
                              % (path, len(buffer) - at))
    return meta, tensors


def read_checkpoint(directory):
    """(metadata of each file, {key: (dtype, shape, bytes)}, weight_map,
    total_size), checking the index against the files."""
    with open(os.path.join(directory, INDEX), "rb") as f:
        index = _json(f.read().decode("utf-8"))
    if not isinstance(index, dict) or set(index) != {"metadata",
                                                     "weight_map"}:
        raise CheckpointError("the index is not metadata and weight_map")
    if not isinstance(index["metadata"], dict) or \
            not _is_uint(index["metadata"].get("total_size")):
        raise CheckpointError("the index's total_size is no integer")
    total_size = index["metadata"]["total_size"]
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("the weight_map does not map keys to files")
    names = sorted(set(weight_map.values()))
    if names != ["model.safetensors"]:
        if not all(NAME.match(n) for n in names):
            raise CheckpointError("the index names files %s" % names)
        counts = {NAME.match(n).group(2) for n in names}
        numbers = sorted(int(NAME.match(n).group(1)) for n in names)
        if len(counts) != 1 or numbers != list(
                range(1, int(counts.pop()) + 1)):
            raise CheckpointError("the index names files %s" % names)
    metas, tensors = {}, {}
    for name in names:
        meta, found = read_file(os.path.join(directory, name))
        metas[name] = meta
        for key, value in found.items():
            if weight_map.get(key) != name or key in tensors:
                raise CheckpointError("%s holds %s, which the index puts in "
                                      "%s" % (name, key, weight_map.get(key)))
            tensors[key] = value
    if set(tensors) != set(weight_map):
        raise CheckpointError("the index names keys no file holds: %s"
                              % sorted(set(weight_map) - set(tensors))[:5])
    if total_size != sum(len(v[2]) for v in tensors.values()):
        raise CheckpointError("total_size %d is not the tensors' bytes"
                              % total_size)
    return metas, tensors, weight_map, total_size
