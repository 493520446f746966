"""Saves attacked: key names, options the ranks disagree on, paths, a file
system that refuses, names in the way and two saves into one directory
(docs/checkpoints.md).  Starts a private shardportd and the ranks
(save_attack_worker.py); what they wrote is read back with the strict
reader (safetensors_reader.py).

    test_save_attacks.py SCENARIO

  names      keys that JSON must escape (quotes, backslash, control
             characters, DEL), non-ASCII, "/" and a 1,024-byte key read
             back exactly; 0-dim tensors and a limit of one byte; a key
             named __metadata__ refused on every rank
  disagree   ranks that pass another directory, metadata, overwrite or
             limit, and a rank that refuses its own options or cannot make
             the directory: every rank fails at once with one sentence
             naming the ranks; a relative path and a symbolic link that
             resolve alike are one directory
  faults     a rank whose files may not grow (EFBIG): every rank fails
             with its words, nothing left under a final name or a
             temporary one, and the same job saves again; symbolic links
             planted at the temporary names are never followed; a save
             into a directory whose lock another save holds is refused on
             its every rank; rank 0 killed at the commit's first barrier leaves the
             old checkpoint's files whole and its index aside, which the
             next save removes; a directory holding the files of a save that died
             before its index is saved into, its stale temporary files
             removed and those of a later save kept

Exits 77 (skipped), loudly, when PyTorch cannot be imported.
"""

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time

import harness

torch = harness.require_torch()

import safetensors_reader  # noqa: E402
import save_attack_worker  # noqa: E402
import shardport  # noqa: E402

DEADLINE = 200
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "save_attack_worker.py")


class Ranks:
    """One job's ranks, started from a spec, running save_attack_worker."""

    def __init__(self, workdir, name, world, sock, env=None, **spec):
        self.outdir = os.path.join(workdir, name + "-out")
        os.makedirs(self.outdir)
        self.world = world
        spec.update(world=world, socket=sock, outdir=self.outdir,
                    init_file=os.path.join(self.outdir, "dist-init"))
        self.spec = spec
        path = os.path.join(self.outdir, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.procs = []
        for rank in range(world):
            log = open(os.path.join(self.outdir, "rank%d.log" % rank), "w+")
            self.procs.append((subprocess.Popen(
                [sys.executable, "-X", "faulthandler", WORKER, path,
                 str(rank)], stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, **(env or {}))), log))

    def results(self, killed=()):
        """Each rank's result, once every rank has ended (but those
        killed, which wrote none)."""
        deadline = time.monotonic() + DEADLINE
        out = {}
        for rank, (proc, log) in enumerate(self.procs):
            try:
                proc.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            text = log.read()
            log.close()
            if rank in killed:
                continue
            path = os.path.join(self.outdir, "%d.json" % rank)
            assert os.path.exists(path), "rank %d wrote no result:\n%s" % (
                rank, text)
            with open(path) as f:
                out[rank] = json.load(f)
        return out


def save(workdir, name, world, sock, **spec):
    return Ranks(workdir, name, world, sock, **spec).results()


def verify(path, world, res, keys=()):
    """path holds the test model, byte for byte, and nothing hidden."""
    assert all(r["ok"] for r in res.values()), res
    _, tensors, _, _ = safetensors_reader.read_checkpoint(path)
    _, _, whole = save_attack_worker.model(world, 0, keys)
    assert set(tensors) == set(whole), sorted(set(tensors) ^ set(whole))
    for key, value in whole.items():
        dtype, shape, data = tensors[key]
        assert (dtype, shape) == ("F32", tuple(value.shape)), (key, dtype)
        assert data == value.contiguous().numpy().tobytes(), key
    hidden = [n for n in os.listdir(path) if n.startswith(".")]
    assert not hidden, hidden


def failed_alike(res, error, *words):
    """Every rank failed with error and one message holding words."""
    assert all(not r["ok"] and r["error"] == error for r in res.values()), res
    messages = {r["message"] for r in res.values()}
    assert len(messages) == 1, messages
    message = messages.pop()
    for w in words:
        assert w in message, (w, message)
    return message


def nothing_saved(path):
    """What a failed save leaves: no index, no file under a final name or a
    temporary one."""
    names = os.listdir(path) if os.path.isdir(path) else []
    assert not names, names


NAMES = ['quote"d', "back\\slash", "ctl\x01\x1f\x7f", "tab\tnew\nline",
         "caf\u00e9.\u2028.\U0001f600", "a/b/../c", "k" * 1024]


def names(workdir):
    with harness.daemon() as d:
        path = os.path.join(workdir, "names")
        verify(path, 3, save(workdir, "names", 3, d.socket, path=path,
                             keys=NAMES), NAMES)
        # The smallest limit: every key with bytes in a file of its own;
        # 0-dim tensors (shape []) on the replicas' owner.
        path = os.path.join(workdir, "sizes")
        keys = ["scalar.a", "scalar.b", "k0", "k1"]
        res = save(workdir, "sizes", 3, d.socket, path=path, keys=keys,
                   limit=1)
        verify(path, 3, res, keys)
        assert sum(r["files"] for r in res.values()) == 5, res
        path = os.path.join(workdir, "reserved")
        res = save(workdir, "reserved", 3, d.socket, path=path,
                   keys=["__metadata__"])
        failed_alike(res, "invalid_argument", '"__metadata__"',
                     "rename it")
        nothing_saved(path)


def disagree(workdir):
    with harness.daemon() as d:
        base = os.path.join(workdir, "ckpt")
        elsewhere = os.path.join(workdir, "elsewhere")
        os.makedirs(elsewhere)
        cases = [
            ({"metadata": {"step": "2"}}, "invalid_argument",
             "the save's metadata: ranks 0 and 1"),
            ({"overwrite": True}, "invalid_argument",
             "the save's overwrite: rank 0 asked false, rank 1 true"),
            ({"path": base + "-other"}, "invalid_argument",
             "the save's directory: ranks 0 and 1"),
            ({"limit": 4096}, "invalid_argument",
             "max_shard_bytes: rank 0 asked 5368709120, rank 1 asked 4096"),
            # The same relative path from another working directory.
            ({"path": "ckpt", "cwd": elsewhere}, "invalid_argument",
             "the save's directory: ranks 0 and 1"),
            # The rank's own refusals, which it used to keep to itself
            # while the others waited for it until the timeout.
            ({"metadata": {"format": "other"}}, "invalid_argument",
             "refused by rank 1: save: the metadata key \"format\""),
            ({"path": os.path.join(workdir, "file", "under")}, "write_failed",
             "refused by rank 1: save: cannot make directory"),
            ({"path": "/" + "x" * 5000}, "invalid_argument",
             "refused by rank 1: save: the directory's name is too long"),
        ]
        with open(os.path.join(workdir, "file"), "w"):
            pass
        for i, (theirs, error, words) in enumerate(cases):
            ranks = [{}, theirs]
            res = save(workdir, "case%d" % i, 2, d.socket, path=base,
                       cwd=workdir, metadata={"step": "1"}, ranks=ranks,
                       timeout=60)
            failed_alike(res, error, words)
            nothing_saved(base)
        # A relative path and a symbolic link to the directory are the
        # directory itself.
        os.symlink(base, base + "-link")
        ranks = [{"path": "ckpt"}, {"path": base + "-link"}]
        verify(base, 2, save(workdir, "alias", 2, d.socket, path=base,
                             cwd=workdir, ranks=ranks))


def faults(workdir):
    with harness.daemon() as d:
        # Rank 1's files may not grow past 1,000 bytes: its write fails
        # with EFBIG, as on a full file system.
        path = os.path.join(workdir, "efbig")
        keys = ["k%d" % i for i in range(6)]
        res = save(workdir, "efbig", 3, d.socket, path=path, keys=keys,
                   ranks=[{}, {"fsize": 64}, {}], again=True)
        failed_alike(res, "write_failed", "rank 1", "File too large")
        # The same job, the limit lifted, saves again into the directory.
        verify(path, 3, {r: dict(v["again"], ok=True)
                         for r, v in res.items()}, keys)
        path = os.path.join(workdir, "efbig-nothing")
        res = save(workdir, "efbig-nothing", 3, d.socket, path=path,
                   keys=keys, ranks=[{}, {"fsize": 64}, {}])
        failed_alike(res, "write_failed", "rank 1", "File too large")
        nothing_saved(path)
        # Links at every temporary name a rank could use point at a file
        # the save must never write through them.
        victim = os.path.join(workdir, "victim")
        with open(victim, "w") as f:
            f.write("not a checkpoint")
        path = os.path.join(workdir, "links")
        res = save(workdir, "links", 1, d.socket, path=path, links=victim)
        with open(victim) as f:
            assert f.read() == "not a checkpoint", "written through a link"
        verify(path, 1, res)
        # A save into a directory whose lock another save's rank 0 holds
        # (the test holds it here) is refused on every rank, before any
        # file takes a final name; once it is free, the save goes ahead
        # and removes the lock file.
        path = os.path.join(workdir, "busy")
        os.makedirs(path)
        with open(os.path.join(path, ".model.safetensors.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            res = save(workdir, "busy", 2, d.socket, path=path)
            failed_alike(res, "busy", "another save into %s is running"
                         % path)
            assert os.listdir(path) == [".model.safetensors.lock"], \
                os.listdir(path)
        verify(path, 2, save(workdir, "free", 2, d.socket, path=path))
        # Rank 0 killed while it waits at the commit's first barrier, the
        # old index moved aside (overwrite): the others fail, the old
        # files stay whole and the old index hidden, until the next save.
        path = os.path.join(workdir, "barrier")
        keys = ["k%03d" % i for i in range(60)]
        verify(path, 3, save(workdir, "barrier-old", 3, d.socket, path=path,
                             keys=keys), keys)
        slow = Ranks(workdir, "barrier", 3, d.socket, path=path, keys=keys,
                     overwrite=True, ranks=[{}, {"delay_ms": 200}, {}])
        wait_writing(d.socket)
        slow.procs[0][0].kill()
        failed_alike(slow.results(killed=(0,)), "rank_lost", "rank 0")
        names = os.listdir(path)
        assert safetensors_reader.INDEX not in names, names
        assert [n for n in names if n.endswith(".replaced")], names
        for n in names:
            if n.endswith(".safetensors"):
                safetensors_reader.read_file(os.path.join(path, n))
        verify(path, 3, save(workdir, "barrier-new", 3, d.socket, path=path,
                             keys=keys), keys)
        # What a save that died after renaming its files leaves (final
        # names, no index, a temporary file of a killed process) is no
        # checkpoint: a save goes ahead and removes the stale file.
        # A temporary file written since the save began is a later save's
        # (this one's lock released), and stays.
        path = os.path.join(workdir, "partial")
        os.makedirs(path)
        stale = ".model-00001-of-00002.safetensors.1-0.tmp"
        later = ".model-00002-of-00002.safetensors.2-0.tmp"
        for name in ("model-00001-of-00002.safetensors", stale, later):
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"\0" * 100)
        now = time.time()
        os.utime(os.path.join(path, stale), (now - 60, now - 60))
        os.utime(os.path.join(path, later), (now + 3600, now + 3600))
        res = save(workdir, "partial", 2, d.socket, path=path)
        assert os.listdir(path).count(later) == 1, os.listdir(path)
        os.unlink(os.path.join(path, later))
        verify(path, 2, res)


def wait_writing(sock):
    """Returns once a job at sock shows its ranks writing."""
    deadline = time.monotonic() + DEADLINE
    while True:
        with shardport.Client(sock) as c:
            jobs = c.status().jobs
        if any(j.phase == "writing" and j.bytes_written for j in jobs):
            return
        assert time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.01)


SCENARIOS = {"names": names, "disagree": disagree, "faults": faults}


def main():
    with tempfile.TemporaryDirectory(prefix="sp-save-attacks-") as workdir:
        SCENARIOS[sys.argv[1]](workdir)
    print("%s: ok" % sys.argv[1])


if __name__ == "__main__":
    main()
