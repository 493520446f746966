"""Multi-process exports with real PyTorch: starts a private shardportd and
WORLD trainer ranks (torch_worker.py) on gloo, then checks across ranks
what each rank reported.

    test_torch.py SCENARIO

Exits 77 (skipped), loudly, when PyTorch cannot be imported.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import harness

WORLD = 3
# Seconds the ranks of one scenario may take together before they are
# killed: a guard against hangs, far above the few seconds they need (a
# sanitizer build on a loaded machine is several times slower).
DEADLINE = 200


def run_ranks(scenario, daemon, workdir):
    """Starts every rank, waits for all of them; returns their exit
    statuses by rank and their output."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "torch_worker.py")
    init_file = os.path.join(workdir, "dist-init")
    procs = []
    for rank in range(WORLD):
        log = open(os.path.join(workdir, "rank%d.log" % rank), "w+")
        procs.append((subprocess.Popen(
            [sys.executable, "-X", "faulthandler", worker, scenario,
             str(rank), str(WORLD),
             init_file, daemon.socket, workdir],
            stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + DEADLINE
    statuses = []
    for proc, _ in procs:
        try:
            statuses.append(proc.wait(max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            statuses.append(proc.wait())
    output = {}
    for rank, (_, log) in enumerate(procs):
        log.seek(0)
        output[rank] = log.read()
        log.close()
    return statuses, output


def results(workdir, ranks):
    out = {}
    for rank in ranks:
        with open(os.path.join(workdir, "%d.json" % rank)) as f:
            out[rank] = json.load(f)
    return out


def check_model(res):
    owned = [k for r in res.values() for k in r["owned"]]
    every = {"embed.weight", "head.weight", "proj.weight", "proj.bias",
             "norm.weight", "norm.bias", "out.weight", "out.bias"}
    assert sorted(owned) == sorted(every), \
        "every key must be owned by exactly one rank: %s" % owned
    tied = [r for r in res.values() if "embed.weight" in r["owned"]]
    assert len(tied) == 1 and "head.weight" in tied[0]["owned"], \
        "tied keys must land on one owner: %s" % res
    assert tied[0]["tied_same_memory"], "tied keys must share one buffer"


def check_dtypes_views(res):
    owned = [k for r in res.values() for k in r["owned"]]
    every = {"bf16.w", "int16.w", "transposed.w", "strided.w", "step"} | {
        "experts.%d.w" % r for r in range(WORLD)}
    assert sorted(owned) == sorted(every), \
        "every key must be owned by exactly one rank: %s" % owned
    for rank, r in res.items():
        assert r["expert"] in r["owned"], \
            "rank %d must keep its expert: %s" % (rank, r)
        assert r["expert"] in r["identity"], \
            "rank %d's expert must come back as its own tensor" % rank
    step_owner = [r for r in res.values() if "step" in r["owned"]]
    assert "step" in step_owner[0]["identity"], \
        "a plain tensor must come back as its owner's own tensor"


def check_same_refusal(res, expected_type):
    kinds = {(r["type"], r["message"]) for r in res.values()}
    assert len(kinds) == 1, "ranks saw different errors: %s" % res
    (kind, message), = kinds
    assert kind == expected_type, "expected %s, got %s: %s" % (
        expected_type, kind, message)
    return message


def check_refusal(res):
    message = check_same_refusal(res, "BadTiling")
    assert message.startswith("key 'w'"), message


def check_no_daemon(res):
    message = check_same_refusal(res, "NoDaemon")
    assert "nobody-listens.sock" in message, message


def check_rank_killed(res):
    from torch_worker import VICTIM
    assert VICTIM not in res
    message = check_same_refusal(res, "RankLost")
    assert "rank %d" % VICTIM in message, message


def check_plain_left_out(res):
    message = check_same_refusal(res, "InvalidArgument")
    assert "without a placement in a job of 3 ranks: w." in message, message


def check_plain_differs(res):
    message = check_same_refusal(res, "DifferentData")
    assert message.startswith("key 'w' (plain): rank 1's copy differs from "
                              "rank 0's"), message
    assert "and 1 more rank's too" in message, message


def check_affine_columns(res):
    owned = sorted(k for r in res.values() for k in r["owned"])
    assert owned == ["tp.h", "tp.w"], owned


def check_rank_gone_early(res):
    from torch_worker import GONE
    survivors = {r: v for r, v in res.items() if r != GONE}
    message = check_same_refusal(survivors, "Timeout")
    # The first exchange the others wait in names the rank they wait for.
    assert message.startswith("rank(s) %d did not " % GONE), message
    assert "within 2 s" in message, message


CHECKS = {
    "model": check_model,
    "dtypes-views": check_dtypes_views,
    "refusal": check_refusal,
    "no-daemon": check_no_daemon,
    "rank-killed": check_rank_killed,
    "plain-left-out": check_plain_left_out,
    "plain-differs": check_plain_differs,
    "affine-columns": check_affine_columns,
    "rank-gone-early": check_rank_gone_early,
}


def main():
    scenario = sys.argv[1]
    torch = harness.require_torch()
    print("PyTorch %s, %d ranks on gloo, scenario %s"
          % (torch.__version__, WORLD, scenario), flush=True)
    # A refusal is logged as a warning: journalctl -p warning shows it.
    daemon_args = ("--log-level", "warn") if scenario == "refusal" else ()
    with tempfile.TemporaryDirectory(prefix="sp-torch-") as workdir, \
            harness.daemon(*daemon_args) as daemon:
        statuses, output = run_ranks(scenario, daemon, workdir)
        survivors = range(WORLD)
        if scenario == "rank-killed":
            from torch_worker import VICTIM
            expected = [0 if r != VICTIM else -signal.SIGKILL
                        for r in range(WORLD)]
            survivors = [r for r in range(WORLD) if r != VICTIM]
        else:
            expected = [0] * WORLD
        try:
            assert statuses == expected, \
                "rank exit statuses %s, expected %s" % (statuses, expected)
            CHECKS[scenario](results(workdir, survivors))
            if scenario == "refusal":
                log = daemon.log_text()
                assert " shardportd: warn: job " in log and \
                    "failed: bad_tiling: key 'w'" in log, log
            import shardport
            with shardport.Client(daemon.socket) as client:
                client.ping()  # the daemon is ready for the next export
        except BaseException:
            for rank, text in output.items():
                print("--- rank %d ---\n%s" % (rank, text), file=sys.stderr)
            print("--- shardportd ---\n" + daemon.log_text(),
                  file=sys.stderr)
            raise
    print("ok: %s" % scenario)


if __name__ == "__main__":
    main()
