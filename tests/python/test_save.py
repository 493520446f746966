"""Checkpoints saved by trainer ranks with real PyTorch on gloo: starts
private shardportd(s) and the ranks (save_worker.py), then reads what they
wrote with an independent reader (safetensors_reader.py) and compares it
byte for byte with the unsharded model (save_model.py).

    test_save.py SCENARIO

  one-daemon   3 ranks save; a second save into the directory is refused
               on every rank; with overwrite it replaces the first; a key
               whose dtype safetensors cannot name is refused on every rank
  two-daemons  4 ranks over 2 daemons (2 each) save one checkpoint; the
               second daemon killed while its ranks write fails the save
               on the first one's too
  killed       a rank killed while it writes, then the daemon killed while
               its ranks write: every rank fails, no index and no
               incomplete file under a final name; a new save succeeds

Exits 77 (skipped), loudly, when PyTorch cannot be imported.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import harness

torch = harness.require_torch()

import safetensors_reader  # noqa: E402
import save_model  # noqa: E402
import shardport  # noqa: E402

DEADLINE = 200
NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8",
         torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
         torch.float16: "F16", torch.bfloat16: "BF16",
         torch.float32: "F32", torch.float64: "F64"}


def start_ranks(how, world, sockets, workdir, ckpt, env=None):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "save_worker.py")
    init_file = os.path.join(workdir, "dist-init-%s-%f" % (how, time.time()))
    procs = []
    for rank in range(world):
        log = open(os.path.join(workdir, "%s-rank%d.log" % (how, rank)), "w+")
        procs.append((subprocess.Popen(
            [sys.executable, "-X", "faulthandler", worker, how, str(rank),
             str(world), init_file, sockets[rank], workdir, ckpt],
            stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {}))), log))
    return procs


def wait_ranks(procs):
    deadline = time.monotonic() + DEADLINE
    for proc, _ in procs:
        try:
            proc.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logs = {}
    for rank, (_, log) in enumerate(procs):
        log.seek(0)
        logs[rank] = log.read()
        log.close()
    return logs


def results(workdir, world, logs):
    out = {}
    for rank in range(world):
        path = os.path.join(workdir, "%d.json" % rank)
        assert os.path.exists(path), "rank %d wrote no result:\n%s" % (
            rank, logs[rank])
        with open(path) as f:
            out[rank] = json.load(f)
        os.unlink(path)
    return out


def run(how, world, sockets, workdir, ckpt):
    logs = wait_ranks(start_ranks(how, world, sockets, workdir, ckpt))
    return results(workdir, world, logs)


def raw(tensor):
    """The tensor's bytes in row-major order."""
    t = tensor.contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.view(-1).view(torch.uint8).numpy().tobytes())


def verify(ckpt, world, res):
    """The checkpoint holds the unsharded model, byte for byte, and the
    ranks' reports add up to it."""
    assert all(r["ok"] for r in res.values()), res
    metas, tensors, weight_map, total = safetensors_reader.read_checkpoint(
        ckpt)
    full = save_model.whole(world)
    assert set(tensors) == set(full), sorted(set(full) ^ set(tensors))[:5]
    for key, value in full.items():
        dtype, shape, data = tensors[key]
        assert dtype == NAMES[value.dtype], (key, dtype)
        assert shape == tuple(value.shape), (key, shape)
        assert data == raw(value), "%s differs from the unsharded model" % key
    expected_meta = dict(save_model.METADATA, format="pt")
    assert all(m == expected_meta for m in metas.values()), metas
    nfiles = len(set(weight_map.values()))
    assert nfiles == res[0]["total_files"], (nfiles, res[0])
    assert sum(r["files"] for r in res.values()) == nfiles
    assert sum(r["bytes"] for r in res.values()) == total
    assert all(r["total_bytes"] == total for r in res.values())
    assert [r["wrote_index"] for r in res.values()] == \
        [True] + [False] * (world - 1)
    # Several files per owner, and the key past the limit alone in its own.
    assert nfiles > 2 * world, nfiles
    big = weight_map["big"]
    assert [k for k, f in weight_map.items() if f == big] == ["big"]
    leftovers = [n for n in os.listdir(ckpt) if n.startswith(".")]
    assert not leftovers, leftovers


def no_checkpoint(ckpt):
    """What a failed save leaves: no index, and every file under a final
    name whole."""
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    assert safetensors_reader.INDEX not in names, names
    for n in names:
        if n.endswith(".safetensors"):
            safetensors_reader.read_file(os.path.join(ckpt, n))


def status_of(sock):
    with shardport.Client(sock) as c:
        jobs = c.status().jobs
    return jobs[0] if jobs else None


def one_daemon(workdir):
    with harness.daemon() as d:
        ckpt = os.path.join(workdir, "ckpt")
        socks = [d.socket] * 3
        verify(ckpt, 3, run("function", 3, socks, workdir, ckpt))
        # Ranks that leave once the save returned fail nothing.
        assert not re.search(r"export \d+ failed", d.log_text()), \
            d.log_text()
        refused = run("job", 3, socks, workdir, ckpt)
        assert all(r["error"] == "checkpoint_exists" for r in
                   refused.values()), refused
        assert len({r["message"] for r in refused.values()}) == 1, refused
        res = run("overwrite", 3, socks, workdir, ckpt)
        verify(ckpt, 3, res)
        for r in res.values():
            writing = [p for p in r["phases"] if p[0] == "writing"]
            assert writing and writing[-1][1] == writing[-1][2] == r["bytes"]
        other = os.path.join(workdir, "complex")
        refused = run("complex", 3, socks, workdir, other)
        assert all(r["error"] == "unknown_dtype" for r in refused.values()), \
            refused
        assert len({r["message"] for r in refused.values()}) == 1, refused
        assert "z.complex" in refused[0]["message"], refused
        no_checkpoint(other)


def two_daemons(workdir):
    with harness.daemon("--peer-listen", "127.0.0.1:0") as a, \
            harness.daemon("--peer-listen", "127.0.0.1:0") as b:
        ckpt = os.path.join(workdir, "ckpt")
        verify(ckpt, 4, run("function", 4, [a.socket, a.socket, b.socket,
                                            b.socket], workdir, ckpt))
        # The second node dies while every rank writes: the first node's
        # ranks fail with node_lost, and nothing is committed.
        lost = os.path.join(workdir, "lost")
        procs = start_ranks("function", 4, [a.socket, a.socket, b.socket,
                                            b.socket], workdir, lost,
                            env={"SHARDPORT_TEST_SAVE_DELAY_MS": "20"})
        wait_writing(a.socket)
        b.proc.send_signal(signal.SIGKILL)
        logs = wait_ranks(procs)
        out = results(workdir, 4, logs)
        assert [out[r]["error"] for r in (0, 1)] == ["node_lost"] * 2, out
        assert out[0]["message"] == out[1]["message"], out
        assert not any(r["ok"] for r in out.values()), out
        no_checkpoint(lost)


def wait_writing(sock):
    """Returns once the daemon at sock shows its job's ranks writing, some
    bytes written and not all (status, docs/checkpoints.md)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        job = status_of(sock)
        if job is not None and job.phase == "writing" and job.bytes_written:
            assert job.bytes_written < job.bytes_to_write, job
            return
        assert time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.01)


def kill_mid_save(workdir, d, victim, ckpt):
    """Starts a slow save into ckpt and kills victim ("rank" or "daemon")
    once the ranks write; returns the surviving ranks' results."""
    procs = start_ranks("function", 3, [d.socket] * 3, workdir, ckpt,
                        env={"SHARDPORT_TEST_SAVE_DELAY_MS": "20"})
    wait_writing(d.socket)
    if victim == "rank":
        procs[1][0].send_signal(signal.SIGKILL)
    else:
        d.proc.send_signal(signal.SIGKILL)
    logs = wait_ranks(procs)
    out = {}
    for rank in range(3):
        path = os.path.join(workdir, "%d.json" % rank)
        if rank == 1 and victim == "rank":
            assert not os.path.exists(path)
            continue
        assert os.path.exists(path), logs[rank]
        with open(path) as f:
            out[rank] = json.load(f)
        os.unlink(path)
        assert not out[rank]["ok"], (rank, out[rank], logs[rank])
    return out


def killed(workdir):
    ckpt = os.path.join(workdir, "ckpt")
    with harness.daemon() as d:
        out = kill_mid_save(workdir, d, "rank", ckpt)
        assert all(r["error"] == "rank_lost" for r in out.values()), out
        assert len({r["message"] for r in out.values()}) == 1, out
        no_checkpoint(ckpt)
        verify(ckpt, 3, run("function", 3, [d.socket] * 3, workdir, ckpt))
    ckpt = os.path.join(workdir, "ckpt-daemon")
    with harness.daemon() as d:
        out = kill_mid_save(workdir, d, "daemon", ckpt)
        assert all(r["error"] == "daemon_restarted" for r in out.values()), \
            out
        no_checkpoint(ckpt)
    with harness.daemon() as d:
        verify(ckpt, 3, run("function", 3, [d.socket] * 3, workdir, ckpt))


SCENARIOS = {"one-daemon": one_daemon, "two-daemons": two_daemons,
             "killed": killed}


def main():
    scenario = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="sp-save-") as workdir:
        SCENARIOS[scenario](workdir)
    print("%s: ok" % scenario)


if __name__ == "__main__":
    main()
