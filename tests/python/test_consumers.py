"""Pushes into consumers with real PyTorch: starts a private shardportd,
the trainer ranks (gloo) and the consumer processes of a scenario
(consumers_worker.py), then checks what each of them reported.

    test_consumers.py SCENARIO     (subsets, consumer-killed)

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

# Seconds a scenario's processes may take together: a guard against
# hangs, far above the few seconds they need.
DEADLINE = 200

# (trainer ranks, consumers) of each scenario.
SIZES = {"subsets": (3, 3), "consumer-killed": (2, 2)}


def start(scenario, role, index, world, consumers, daemon, workdir):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "consumers_worker.py")
    log = open(os.path.join(workdir, "%s.%d.log" % (role, index)), "a+")
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", worker, scenario, role,
         str(index), str(world), str(consumers),
         os.path.join(workdir, "dist-init"), daemon.socket, workdir],
        stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def wait_all(procs, deadline):
    statuses = {}
    for name, (proc, _) in procs.items():
        try:
            statuses[name] = proc.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            statuses[name] = proc.wait()
    return statuses


def report(workdir, name):
    with open(os.path.join(workdir, "%s.json" % name)) as f:
        return json.load(f)


def check_subsets(workdir, world, consumers):
    trainers = [report(workdir, "trainer.%d" % r) for r in range(world)]
    takers = [report(workdir, "consumer.%d" % c) for c in range(consumers)]
    assert [t["keys"] for t in takers] == [["a", "b", "e.0"], ["b", "c"],
                                           ["n"]], takers
    for push in range(2):
        sent = sum(t["pushes"][push]["bytes"] for t in trainers)
        got = [t["pushes"][push] for t in takers]
        # Each consumer got exactly the bytes of its targets, each checked
        # against the original; the key nobody wants was not sent.
        for g in got:
            assert g["bytes"] == g["checked"], got
        assert sent == sum(g["bytes"] for g in got), (sent, got)
        ids = {t["pushes"][push]["push_id"] for t in trainers} | {
            g["push_id"] for g in got}
        assert ids == {push + 1}, ids
    reused = [[p["plan_reused"] for p in t["pushes"]] for t in trainers]
    assert reused == [[False, True]] * world, reused
    for t in trainers:
        assert (t["status_pushes"], t["push_plans"]) == (2, 1), t
        total = [sum(t2["pushes"][p]["bytes"] for p in range(2))
                 for t2 in takers]
        assert [c[0] for c in t["consumers"]] == list(range(consumers)), t
        assert [c[2] for c in t["consumers"]] == total, (t, total)


def check_killed(workdir, world, consumers):
    from consumers_worker import VICTIM
    trainers = [report(workdir, "trainer.%d" % r) for r in range(world)]
    survivor = report(workdir, "consumer.0")
    # The victim wrote nothing; its replacement wrote this.
    again = report(workdir, "consumer.%d" % VICTIM)
    killed = {json.dumps(t["killed"], sort_keys=True) for t in trainers}
    killed.add(json.dumps(survivor["killed"], sort_keys=True))
    assert len(killed) == 1, "trainers and consumer saw different errors: " \
        "%s" % killed
    (kind,) = killed
    kind = json.loads(kind)
    assert kind["type"] == "ConsumerLost", kind
    assert "consumer %d" % VICTIM in kind["message"], kind
    for t in trainers:
        assert t["absent"]["type"] == "ConsumerLost", t
        assert "consumer %d" % VICTIM in t["absent"]["message"], t
    assert survivor["checked_first"] > 0 and survivor["checked"] > 0, survivor
    assert again["checked"] > 0, again


def run(scenario):
    world, consumers = SIZES[scenario]
    with tempfile.TemporaryDirectory(prefix="sp-consumers-") as workdir, \
            harness.daemon() as daemon:
        deadline = time.monotonic() + DEADLINE
        procs = {}
        for c in range(consumers):
            procs["consumer.%d" % c] = start(scenario, "consumer", c, world,
                                             consumers, daemon, workdir)
        for r in range(world):
            procs["trainer.%d" % r] = start(scenario, "trainer", r, world,
                                            consumers, daemon, workdir)
        try:
            if scenario == "consumer-killed":
                from consumers_worker import VICTIM
                victim = "consumer.%d" % VICTIM
                (proc, _) = procs[victim]
                status = proc.wait(max(1, deadline - time.monotonic()))
                assert status == -signal.SIGKILL, \
                    "the victim exited %s" % status
                # Its replacement joins once the trainers saw a push fail
                # without it.
                open(os.path.join(workdir, "victim-gone"), "a").close()
                for r in range(world):
                    path = os.path.join(workdir, "failed-again.%d" % r)
                    while not os.path.exists(path):
                        assert time.monotonic() < deadline, path
                        time.sleep(0.01)
                procs[victim + ".again"] = start(
                    scenario, "consumer", VICTIM, world, consumers, daemon,
                    workdir)
            statuses = wait_all(procs, deadline)
            expected = {n: 0 for n in procs}
            if scenario == "consumer-killed":
                expected["consumer.%d" % VICTIM] = -signal.SIGKILL
            assert statuses == expected, "exit statuses %s, expected %s" % (
                statuses, expected)
            (check_subsets if scenario == "subsets" else check_killed)(
                workdir, world, consumers)
            import shardport
            with shardport.Client(daemon.socket) as client:
                client.ping()  # the daemon serves on
        except BaseException:
            for name, (_, log) in procs.items():
                log.seek(0)
                print("--- %s ---\n%s" % (name, log.read()), file=sys.stderr)
            print("--- shardportd ---\n" + daemon.log_text(),
                  file=sys.stderr)
            raise
        finally:
            for _, log in procs.values():
                log.close()


def main():
    scenario = sys.argv[1]
    torch = harness.require_torch()
    print("PyTorch %s, scenario %s: %d trainer ranks on gloo, %d consumers"
          % ((torch.__version__, scenario) + SIZES[scenario]), flush=True)
    run(scenario)
    print("ok: %s" % scenario)


if __name__ == "__main__":
    main()
