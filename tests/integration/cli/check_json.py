#!/usr/bin/env python3
"""Strict checks of `shardport ... --json` output, read from stdin.

usage: check_json.py MODE SOCKET [JOB]
  status        one status object on one line (docs/cli.md schema)
  status-lines  one or more status objects, one per line (--watch --json)
  status-fake   one status object with the fake daemon's exact values
  ping          one ping object
  jobs          one jobs object listing JOB (`shardport jobs --json`)
  job           one job object for JOB (`shardport status JOB --json`)
  abort         one abort object for JOB

Strict means: RFC 8259 only (no NaN or Infinity), no duplicate keys, exactly
the documented fields with exactly the documented types (a bool is not an
integer), and nothing but one newline after each object."""
import json
import sys


class Bad(Exception):
    pass


def no_constants(name):
    raise Bad(f"non-standard constant {name}")


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise Bad(f"duplicate keys in {keys}")
    return dict(pairs)


def parse_line(line):
    return json.loads(line, parse_constant=no_constants,
                      object_pairs_hook=no_duplicates)


def is_uint(v):
    return type(v) is int and v >= 0


def is_number(v):
    return type(v) in (int, float)


def is_str(v):
    return type(v) is str


def is_str_or_null(v):
    return v is None or type(v) is str


STATUS = {
    "socket": is_str,
    "daemon_version": is_str,
    "protocol_version": is_uint,
    "backends_built": lambda v: type(v) is list and all(is_str(x) for x in v),
    "backend_active": is_str,
    "backend_reason": is_str,
    "uptime_s": is_number,
    "clients": is_uint,
    "pool_used": is_uint,
    "pool_capacity": is_uint,
    "jobs": lambda v: type(v) is list,
    "peer_address": is_str_or_null,
    "draining": lambda v: type(v) is bool,
    "loop_max_busy_us": is_uint,
}

JOB = {
    "job_id": is_str,
    "phase": is_str,
    "error": is_str_or_null,
    "world": is_uint,
    "joined": is_uint,
    "round": is_uint,
    "rounds": is_uint,
    "bytes_moved": is_uint,
    "bytes_total": is_uint,
    "rate_bps": is_number,
    "plan_digest": is_str_or_null,
    "asked": is_uint,
    "export_id": is_uint,
    "bytes_prepared": is_uint,
    "bytes_to_prepare": is_uint,
    "bytes_written": is_uint,
    "bytes_to_write": is_uint,
    "node": is_uint,
    "plans_reused": is_uint,
    "nodes": lambda v: type(v) is list,
    "pushes": is_uint,
    "push_plans": is_uint,
    "consumers": lambda v: type(v) is list,
}

ENTRY = {
    "job_id": is_str,
    "phase": is_str,
    "owner_uid": is_uint,
    "owner_pid": is_uint,
    "age_s": is_number,
    "exports": is_uint,
    "world": is_uint,
    "joined": is_uint,
    "asked": is_uint,
    "export_id": is_uint,
    "node": is_uint,
    "node_count": is_uint,
}

DETAIL = dict(JOB, owner_uid=is_uint, owner_pid=is_uint, age_s=is_number,
              exports=is_uint, ranks=lambda v: type(v) is list,
              history=lambda v: type(v) is list)


def is_uint_or_null(v):
    return v is None or is_uint(v)


RANK = {"rank": is_uint, "state": is_str, "pid": is_uint_or_null,
        "node": is_uint_or_null}

RECORD = {
    "export_id": is_uint,
    "outcome": lambda v: v in ("published", "failed"),
    "error": is_str_or_null,
    "age_s": is_number,
    "duration_s": is_number,
    "rounds": is_uint,
    "bytes_moved": is_uint,
    "bytes_total": is_uint,
    "rate_bps": is_number,
}

NODE = {
    "node": is_uint,
    "address": is_str,
    "self": lambda v: type(v) is bool,
    "connected": lambda v: type(v) is bool,
    "bytes_sent": is_uint,
    "bytes_received": is_uint,
    "control_sent": is_uint,
    "control_received": is_uint,
}

PING = {"socket": is_str, "rtt_ns": is_uint}


def check_fields(obj, schema, what):
    if type(obj) is not dict:
        raise Bad(f"{what} is not an object")
    if set(obj) != set(schema):
        raise Bad(f"{what} fields {sorted(obj)} != documented {sorted(schema)}")
    for key, ok in schema.items():
        if not ok(obj[key]):
            raise Bad(f"{what}.{key} has the wrong type: {obj[key]!r}")


def check_status(obj, socket):
    check_fields(obj, STATUS, "status")
    for i, job in enumerate(obj["jobs"]):
        check_fields(job, JOB, f"jobs[{i}]")
        for k, node in enumerate(job["nodes"]):
            check_fields(node, NODE, f"jobs[{i}].nodes[{k}]")
    if obj["socket"] != socket:
        raise Bad(f"socket {obj['socket']!r} != {socket!r}")
    if obj["protocol_version"] != 4 or obj["uptime_s"] < 0:
        raise Bad("implausible values")


def check_jobs(obj, socket, job):
    check_fields(obj, {"socket": is_str, "jobs": lambda v: type(v) is list},
                 "jobs")
    for i, entry in enumerate(obj["jobs"]):
        check_fields(entry, ENTRY, f"jobs[{i}]")
    if obj["socket"] != socket:
        raise Bad(f"socket {obj['socket']!r} != {socket!r}")
    if job not in [e["job_id"] for e in obj["jobs"]]:
        raise Bad(f"job {job} is not listed")


def check_job(obj, socket, job):
    check_fields(obj, {"socket": is_str, "job": lambda v: type(v) is dict},
                 "job")
    detail = obj["job"]
    check_fields(detail, DETAIL, "job")
    for i, rank in enumerate(detail["ranks"]):
        check_fields(rank, RANK, f"job.ranks[{i}]")
        if rank["rank"] != i:
            raise Bad(f"ranks[{i}] is rank {rank['rank']}")
    for i, record in enumerate(detail["history"]):
        check_fields(record, RECORD, f"job.history[{i}]")
    if len(detail["ranks"]) != detail["world"]:
        raise Bad("not one rank entry per rank of the world")
    if obj["socket"] != socket or detail["job_id"] != job:
        raise Bad("socket or job id differs")


def check_fake(obj):
    want_reason = "no CUDA driver \u00e9 \x1b[31m \"q\" \\ \t \ufffd end"
    expect = {
        "daemon_version": "0.1.0-fake",
        "backends_built": ["host", "cuda"],
        "backend_active": "host",
        "backend_reason": want_reason,
        "uptime_s": 93784.5,
        "clients": 2,
        "pool_used": 1536,
        "pool_capacity": 1 << 30,
        "peer_address": None,
        "draining": False,
        # The fake daemon does not report it.
        "loop_max_busy_us": 0,
    }
    for key, value in expect.items():
        if obj[key] != value:
            raise Bad(f"{key} is {obj[key]!r}, want {value!r}")
    jobs = obj["jobs"]
    want_jobs = [
        {"job_id": "00ff00ff", "phase": "moving", "error": None, "world": 8,
         "joined": 8, "round": 3, "rounds": 10, "bytes_moved": 1 << 20,
         "bytes_total": 1 << 30, "rate_bps": 5e8, "plan_digest": None,
         "asked": 0, "export_id": 0, "bytes_prepared": 0,
         "bytes_to_prepare": 0, "bytes_written": 0, "bytes_to_write": 0,
         "node": 0, "plans_reused": 0, "nodes": [], "pushes": 0,
         "push_plans": 0, "consumers": []},
        {"job_id": "a1", "phase": "failed", "error": "rank 3 lost",
         "world": 2, "joined": 1, "round": 0, "rounds": 0, "bytes_moved": 0,
         "bytes_total": 0, "rate_bps": 0, "plan_digest": None, "asked": 0,
         "export_id": 0, "bytes_prepared": 0, "bytes_to_prepare": 0,
         "bytes_written": 0, "bytes_to_write": 0, "node": 0,
         "plans_reused": 0, "nodes": [], "pushes": 0, "push_plans": 0,
         "consumers": []},
    ]
    if jobs != want_jobs:
        raise Bad(f"jobs {jobs!r} != {want_jobs!r}")


def lines_of(text):
    if not text.endswith("\n"):
        raise Bad("output does not end with a newline")
    lines = text[:-1].split("\n")
    if any(not line for line in lines):
        raise Bad("empty line in output")
    return lines


def main():
    mode, socket = sys.argv[1], sys.argv[2]
    job = sys.argv[3] if len(sys.argv) > 3 else None
    raw = sys.stdin.buffer.read()
    # Strict UTF-8: JSON text must be valid Unicode.
    text = raw.decode("utf-8", errors="strict")
    lines = lines_of(text)
    if mode != "status-lines" and len(lines) != 1:
        raise Bad(f"{len(lines)} lines, want 1")
    for line in lines:
        obj = parse_line(line)
        if mode == "ping":
            check_fields(obj, PING, "ping")
            if obj["socket"] != socket:
                raise Bad("socket differs")
        elif mode == "jobs":
            check_jobs(obj, socket, job)
        elif mode == "job":
            check_job(obj, socket, job)
        elif mode == "abort":
            check_fields(obj, {"socket": is_str, "job_id": is_str}, "abort")
            if obj["socket"] != socket or obj["job_id"] != job:
                raise Bad("socket or job id differs")
        else:
            check_status(obj, socket)
            if mode == "status-fake":
                check_fake(obj)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Bad, ValueError, UnicodeDecodeError) as e:
        print(f"check_json: {e}")
        sys.exit(1)
