"""One trainer rank or one consumer of a push scenario (test_consumers.py).

    consumers_worker.py SCENARIO trainer RANK WORLD CONSUMERS INIT SOCKET DIR
    consumers_worker.py SCENARIO consumer INDEX WORLD CONSUMERS INIT SOCKET DIR

Trainers run torch.distributed (gloo, file init); consumers do not: they
read the job's ticket from DIR/ticket, which rank 0 writes.  Each process
writes what it saw to DIR/<role>.<index>.json.  Every value is a function
of (key, step), so each side knows the unsharded original of every step.
"""

import json
import os
import signal
import sys
import time

import torch

import shardport
from shardport import Placement, Target, errors

TIMEOUT = 30


def original(shapes, step):
    """The unsharded model at step: key -> tensor."""
    g = torch.Generator().manual_seed(7000 + step)
    out = {}
    for key, (shape, dtype) in sorted(shapes.items()):
        if dtype == torch.int16:
            out[key] = torch.randint(-30000, 30000, shape, generator=g,
                                     dtype=dtype)
        else:
            out[key] = torch.randn(shape, generator=g).to(dtype)
    return out


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8),
                       b.contiguous().view(torch.uint8))


def rows_of(n, parts, i):
    """(first, count) of part i of n rows cut like torch.tensor_split."""
    chunk = torch.arange(n).tensor_split(parts)[i]
    return (int(chunk[0]) if len(chunk) else 0), len(chunk)


def wait_for(path):
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError("%s never appeared" % path)
        time.sleep(0.005)


def touch(path):
    open(path, "a").close()


class Ctx:
    def __init__(self, argv):
        (self.scenario, self.role, index, world, consumers, self.init_file,
         self.socket, self.dir) = argv
        self.index, self.world = int(index), int(world)
        self.consumers = int(consumers)

    def path(self, name):
        return os.path.join(self.dir, name)


# ---- the trainers' side, alike in every scenario ----

def trainer_state(ctx, shapes, placements, step):
    """This rank's part of the model at step, by placement."""
    state = {}
    for key, tensor in original(shapes, step).items():
        kind = placements[key]
        if kind == "shard0":
            state[key] = tensor.tensor_split(ctx.world)[ctx.index].clone()
        elif kind == "expert" and key.endswith(".%d" % ctx.index):
            state[key] = tensor.clone()
        elif kind == "replicated":
            state[key] = tensor.clone()
    return state


def trainer_job(ctx, shapes, placements):
    """Joins (rank 0 creates the job and writes the ticket) and registers
    step 0's values; returns (job, state)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + ctx.init_file,
                            rank=ctx.index, world_size=ctx.world)
    job = shardport.Job.from_torch_distributed(
        consumers=ctx.consumers, socket=ctx.socket, timeout=TIMEOUT)
    if ctx.index == 0:
        with open(ctx.path("ticket.part"), "wb") as f:
            f.write(job.ticket)
        os.rename(ctx.path("ticket.part"), ctx.path("ticket"))
    state = trainer_state(ctx, shapes, placements, 0)
    job.register(state, {
        k: Placement(placements[k], shapes[k][0]) if placements[k] == "shard0"
        else placements[k] for k in state})
    return job, state


def update(ctx, state, shapes, placements, step):
    """The optimizer's step, in place."""
    for key, tensor in trainer_state(ctx, shapes, placements, step).items():
        state[key].copy_(tensor)


def consumer_join(ctx):
    wait_for(ctx.path("ticket"))
    with open(ctx.path("ticket"), "rb") as f:
        ticket = f.read()
    return shardport.Consumer.join(ticket, ctx.index, ctx.consumers,
                                   socket=ctx.socket, timeout=TIMEOUT)


def check_received(layout, shapes, step):
    """Every view of layout (key -> [(view, dim, first)]) against the
    original at step; the bytes compared."""
    want = original(shapes, step)
    nbytes = 0
    for key, views in layout.items():
        for view, dim, first in views:
            expected = want[key] if dim is None else want[key].narrow(
                dim, first, view.shape[dim])
            assert same_bytes(view, expected), \
                "%s differs from the original of step %d" % (key, step)
            nbytes += view.numel() * view.element_size()
    return nbytes


def refusal(exc):
    return {"type": type(exc).__name__, "message": exc.message}


# ---- subsets: three consumers, each its own subset of the keys ----

SUBSET_SHAPES = {
    "a": ((7, 5), torch.float32),
    "b": ((4, 9), torch.bfloat16),
    "c": ((10,), torch.int16),
    "e.0": ((3, 4), torch.float32),
    "n": ((5,), torch.float32),
    "z": ((64, 64), torch.float32),     # no consumer wants it
}
SUBSET_PLACEMENTS = {"a": "shard0", "b": "shard0", "c": "shard0",
                     "e.0": "expert", "n": "replicated", "z": "shard0"}
SUBSET_STEPS = (1, 2)


def subset_layout(index):
    """(targets, layout) of consumer index: 0 wants a whole, its columns
    of b and the expert; 1 its columns of b and c as two pieces in one
    buffer, back to front; 2 only n."""
    if index == 0:
        a, b, e = torch.empty(7, 5), torch.empty(4, 5, dtype=torch.bfloat16), \
            torch.empty(3, 4)
        return ({"a": Target.whole(a),
                 "b": Target.shard(b, 1, (4, 9)),
                 "e.0": Target.whole(e)},
                {"a": [(a, None, 0)], "b": [(b, 1, 0)], "e.0": [(e, None, 0)]})
    if index == 1:
        b = torch.empty(4, 4, dtype=torch.bfloat16)
        c = torch.empty(10, dtype=torch.int16)
        return ({"b": Target.shard(b, 1, (4, 9)),
                 "c": Target.pieces((10,), [((6,), c[0:4]),
                                            ((0,), c[4:10])])},
                {"b": [(b, 1, 5)], "c": [(c[0:4], 0, 6), (c[4:10], 0, 0)]})
    n = torch.empty(5)
    return {"n": Target.whole(n)}, {"n": [(n, None, 0)]}


def subsets_trainer(ctx):
    job, state = trainer_job(ctx, SUBSET_SHAPES, SUBSET_PLACEMENTS)
    results = []
    with job:
        for step in SUBSET_STEPS:
            update(ctx, state, SUBSET_SHAPES, SUBSET_PLACEMENTS, step)
            r = job.push(timeout=TIMEOUT)
            results.append({"push_id": r.push_id, "bytes": r.bytes,
                            "plan_reused": r.plan_reused})
        status = job.client.status()
        # The consumers stay joined until every trainer has read them.
        touch(ctx.path("status-read.%d" % ctx.index))
    (mine,) = [j for j in status.jobs if j.world == ctx.world]
    return {"pushes": results, "status_pushes": mine.pushes,
            "push_plans": mine.push_plans,
            "consumers": [[c.index, c.state, c.bytes_received]
                          for c in mine.consumers]}


def subsets_consumer(ctx):
    targets, layout = subset_layout(ctx.index)
    results = []
    with consumer_join(ctx) as consumer:
        consumer.register(targets)
        for step in SUBSET_STEPS:
            r = consumer.receive(timeout=TIMEOUT)
            checked = check_received(layout, SUBSET_SHAPES, step)
            results.append({"push_id": r.push_id, "bytes": r.bytes,
                            "checked": checked})
        # Leaving drops this consumer from status: wait until every
        # trainer has read the bytes it received.
        for r in range(ctx.world):
            wait_for(ctx.path("status-read.%d" % r))
    return {"pushes": results, "keys": sorted(targets)}


# ---- consumer-killed: consumer 1 dies while the push waits for it ----

KILLED_SHAPES = {"w": ((6, 8), torch.float32)}
KILLED_PLACEMENTS = {"w": "shard0"}
VICTIM = 1


def killed_layout(index, consumers):
    first, cols = rows_of(8, consumers, index)
    w = torch.empty(6, cols)
    return {"w": Target.shard(w, 1, (6, 8))}, {"w": [(w, 1, first)]}


def killed_trainer(ctx):
    job, state = trainer_job(ctx, KILLED_SHAPES, KILLED_PLACEMENTS)
    seen = {}
    with job:
        update(ctx, state, KILLED_SHAPES, KILLED_PLACEMENTS, 1)
        seen["first"] = job.push(timeout=TIMEOUT).push_id
        update(ctx, state, KILLED_SHAPES, KILLED_PLACEMENTS, 2)
        touch(ctx.path("pushing.%d" % ctx.index))
        try:
            job.push(timeout=TIMEOUT)
            raise AssertionError("the push succeeded without consumer 1")
        except errors.ConsumerLost as exc:
            seen["killed"] = refusal(exc)
        # Until consumer 1 joins again, a push fails at once.
        try:
            job.push(timeout=TIMEOUT)
            raise AssertionError("a push succeeded before consumer 1 "
                                 "joined again")
        except errors.ConsumerLost as exc:
            seen["absent"] = refusal(exc)
        touch(ctx.path("failed-again.%d" % ctx.index))
        wait_for(ctx.path("rejoined"))
        update(ctx, state, KILLED_SHAPES, KILLED_PLACEMENTS, 4)
        seen["rejoined"] = job.push(timeout=TIMEOUT).push_id
    return seen


def killed_consumer(ctx):
    targets, layout = killed_layout(ctx.index, ctx.consumers)
    seen = {}
    rejoining = os.path.exists(ctx.path("victim-gone"))
    with consumer_join(ctx) as consumer:
        consumer.register(targets)
        if rejoining:
            # The replacement of the victim: after the trainers saw their
            # push fail without it.
            touch(ctx.path("rejoined"))
            consumer.receive(timeout=TIMEOUT)
            seen["checked"] = check_received(layout, KILLED_SHAPES, 4)
            return seen
        consumer.receive(timeout=TIMEOUT)
        seen["checked_first"] = check_received(layout, KILLED_SHAPES, 1)
        if ctx.index == VICTIM:
            # Dies once every rank and the other consumer are about to
            # wait in the second push.  Whether it dies before or after
            # their requests reach the daemon, the push fails alike (the
            # daemon fails a push waiting for a consumer that left, and one
            # asked for after it left); the pause makes the first the rule.
            for name in ["pushing.%d" % r for r in range(ctx.world)] + [
                    "receiving.%d" % c for c in range(ctx.consumers)
                    if c != VICTIM]:
                wait_for(ctx.path(name))
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        touch(ctx.path("receiving.%d" % ctx.index))
        try:
            consumer.receive(timeout=TIMEOUT)
            raise AssertionError("the push succeeded without consumer 1")
        except errors.ConsumerLost as exc:
            seen["killed"] = refusal(exc)
        wait_for(ctx.path("rejoined"))
        consumer.receive(timeout=TIMEOUT)
        seen["checked"] = check_received(layout, KILLED_SHAPES, 4)
    return seen


SCENARIOS = {
    ("subsets", "trainer"): subsets_trainer,
    ("subsets", "consumer"): subsets_consumer,
    ("consumer-killed", "trainer"): killed_trainer,
    ("consumer-killed", "consumer"): killed_consumer,
}


def main():
    ctx = Ctx(sys.argv[1:])
    result = SCENARIOS[(ctx.scenario, ctx.role)](ctx)
    with open(ctx.path("%s.%d.json" % (ctx.role, ctx.index)), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
