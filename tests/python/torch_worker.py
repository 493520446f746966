"""One trainer rank of a multi-process PyTorch test (test_torch.py starts
world of them).

    torch_worker.py SCENARIO RANK WORLD INIT_FILE SOCKET OUT_DIR

Each rank joins torch.distributed on gloo, builds its shards, exports them
through the shardport package and checks every owned tensor byte for byte
against the tensor PyTorch itself assembles: an all_gather of every rank's
shard, then torch.cat.  It writes what the parent checks across ranks to
OUT_DIR/RANK.json; a failed check exits non-zero with its traceback.
"""

import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import shardport
from shardport import Placement, errors


def split_rows(rows, world, weights):
    """Uneven dim-0 cuts: rank r gets rows in proportion to weights[r]
    (a zero weight gives an empty shard).  Returns [(start, stop)]."""
    total = sum(weights)
    counts = [rows * w // total for w in weights]
    counts[max(range(world), key=lambda r: weights[r])] += rows - sum(counts)
    cuts, start = [], 0
    for n in counts:
        cuts.append((start, start + n))
        start += n
    return cuts


def gather_whole(shard):
    """The whole tensor as PyTorch assembles it: every rank's dim-0 shard,
    all_gathered (padded to the longest, gloo needs equal sizes) and
    concatenated in rank order.  Bytes travel as uint8, so any dtype works
    on gloo."""
    shard = shard.contiguous()
    row_bytes = math.prod(shard.shape[1:]) * shard.element_size()
    rows = torch.tensor([shard.shape[0]])
    all_rows = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rows, rows)
    longest = int(max(r.item() for r in all_rows))
    raw = torch.zeros(longest * row_bytes, dtype=torch.uint8)
    mine = shard.view(torch.uint8).reshape(-1) if shard.numel() else raw[:0]
    raw[:mine.numel()] = mine
    everyone = [torch.empty_like(raw) for _ in all_rows]
    dist.all_gather(everyone, raw)
    parts = [buf[:int(r.item()) * row_bytes]
             for buf, r in zip(everyone, all_rows)]
    whole = torch.cat(parts)
    return whole.view(shard.dtype).reshape(-1, *shard.shape[1:])


def as_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(key, got, want):
    assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (key, got.shape, want.shape)
    assert torch.equal(as_bytes(got), as_bytes(want)), \
        "%s: the export differs from PyTorch's gather" % key


class Model(nn.Module):
    """A small language-model-like module; head is tied to embed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(37, 16)
        self.proj = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 16)
        self.head = nn.Linear(16, 37, bias=False)
        self.head.weight = self.embed.weight


# Dim-0 weights per sharded key: uneven everywhere, and out.bias leaves the
# last rank an empty shard.
MODEL_SHARDING = {
    "embed.weight": [3, 1, 2, 1],
    "proj.weight": [1, 2, 3, 1],
    "proj.bias": [2, 2, 1, 3],
    "out.weight": [1, 1, 1, 4],
    "out.bias": [5, 3, 1, 0],
}
MODEL_REPLICATED = ("norm.weight", "norm.bias")


def scenario_model(ctx):
    """A model's state dict, FSDP-style: every rank's shards are views of
    one flat buffer (one storage, many views), norm replicated, head tied
    to embed.  One export_state_dict call."""
    rank, world = ctx.rank, ctx.world
    torch.manual_seed(1234)
    full = Model().state_dict()
    cuts = {k: split_rows(full[k].shape[0], world, w[:world])[rank]
            for k, w in MODEL_SHARDING.items()}
    flat = torch.empty(sum(full[k][a:b].numel() for k, (a, b) in cuts.items()))
    state, placements, offset = {}, {}, 0
    for key, (a, b) in cuts.items():
        rows = full[key][a:b]
        view = flat[offset:offset + rows.numel()].view(rows.shape)
        view.copy_(rows)
        offset += rows.numel()
        state[key], placements[key] = view, "shard0"
    state["head.weight"] = state["embed.weight"]
    placements["head.weight"] = "shard0"
    for key in MODEL_REPLICATED:
        state[key], placements[key] = full[key].clone(), "replicated"
    assert set(state) == set(full)

    expected = {k: gather_whole(state[k]) for k in sorted(placements)
                if placements[k] == "shard0"}
    for key, whole in expected.items():
        assert_same(key, whole, full[key])  # the gather itself is right
    expected.update({k: full[k] for k in MODEL_REPLICATED})

    with shardport.export_state_dict(state, placements, socket=ctx.socket,
                                     progress=False, timeout=30) as owned:
        for key, tensor in owned.items():
            assert_same(key, tensor, expected[key])
        result = {"owned": sorted(owned)}
        if "embed.weight" in owned:
            result["tied_same_memory"] = (
                owned["embed.weight"].data_ptr()
                == owned["head.weight"].data_ptr())
    assert owned.released
    return result


def scenario_dtypes_views(ctx):
    """bfloat16 and int16 shards, shards held as non-contiguous views
    (transposed, every other column), a 0-d plain tensor and one expert per
    rank, through a long-lived Job exported twice: in-place updates between
    exports are seen, identity tensors are the caller's own objects."""
    rank, world = ctx.rank, ctx.world
    torch.manual_seed(99)
    whole = {
        "bf16.w": torch.randn(29, 6).to(torch.bfloat16),
        "int16.w": torch.randint(-30000, 30000, (41, 3), dtype=torch.int16),
        "transposed.w": torch.randn(17, 5),
        "strided.w": torch.randn(13, 4, dtype=torch.float64),
    }
    weights = {"bf16.w": [1, 4, 2, 2], "int16.w": [3, 0, 2, 1],
               "transposed.w": [2, 1, 1, 2], "strided.w": [1, 1, 3, 1]}
    state, placements = {}, {}
    for key, t in whole.items():
        a, b = split_rows(t.shape[0], world, weights[key][:world])[rank]
        rows = t[a:b]
        if key == "transposed.w":
            # Held column-major: the registered view has strides (1, rows).
            local = torch.empty(t.shape[1], b - a).t()
        elif key == "strided.w":
            # Every other column of a wider buffer whose other columns hold
            # garbage that must never reach the export.
            local = torch.full((b - a, 2 * t.shape[1]), -7.0,
                               dtype=t.dtype)[:, ::2]
        else:
            local = torch.empty_like(rows)
        local.copy_(rows)
        state[key] = local
        placements[key] = Placement("shard0", tuple(t.shape))
    assert not state["transposed.w"].is_contiguous()
    assert not state["strided.w"].is_contiguous()
    state["step"] = torch.tensor(1000, dtype=torch.int64)
    placements["step"] = "plain"
    expert_key = "experts.%d.w" % rank
    state[expert_key] = torch.full((rank + 2, 3), float(rank))
    placements[expert_key] = "expert"

    for key in whole:  # the reference itself is right
        assert_same(key, gather_whole(state[key]), whole[key])
    identity = set()
    with shardport.Job.from_torch_distributed(socket=ctx.socket,
                                              timeout=30) as job:
        job.register(state, placements)
        for _ in range(2):
            expected = {k: gather_whole(state[k]) for k in sorted(whole)}
            with job.export(progress=False) as owned:
                for key, tensor in owned.items():
                    if key in expected:
                        assert_same(key, tensor, expected[key])
                    else:
                        assert tensor is state[key], \
                            "%s: identity is not the caller's object" % key
                        identity.add(key)
                owned_keys = sorted(owned)
            try:
                owned[owned_keys[0]]
                raise AssertionError("a released export still hands out "
                                     "tensors")
            except errors.NoSuchExport:
                pass
            # Change the registered memory in place: the next export must
            # see it without registering again.
            for key in whole:
                state[key].add_(1)
    return {"owned": owned_keys, "identity": sorted(identity),
            "expert": expert_key}


def scenario_refusal(ctx):
    """Shards that do not tile the global shape: every rank must raise the
    same exception with the same message."""
    rank, world = ctx.rank, ctx.world
    rows = rank + 1
    total = sum(r + 1 for r in range(world))
    state = {"w": torch.full((rows, 4), float(rank)),
             "fine": torch.ones(3)}
    placements = {"w": Placement("shard0", (total + 1, 4)),
                  "fine": "replicated"}
    try:
        shardport.export_state_dict(state, placements, socket=ctx.socket,
                                    progress=False, timeout=30).release()
    except shardport.ShardportError as exc:
        return {"type": type(exc).__name__, "name": exc.name,
                "message": exc.message, "str": str(exc)}
    raise AssertionError("the export of shards that do not tile succeeded")


def scenario_no_daemon(ctx):
    """Rank 0 cannot create the job (nothing listens at the socket): every
    rank raises its error instead of waiting for a ticket."""
    state = {"w": torch.ones(2)}
    missing = os.path.join(ctx.out_dir, "nobody-listens.sock")
    try:
        shardport.export_state_dict(state, {"w": "plain"}, socket=missing,
                                    progress=False, timeout=30).release()
    except shardport.ShardportError as exc:
        return {"type": type(exc).__name__, "message": exc.message}
    raise AssertionError("an export without a daemon succeeded")


# The rank that scenario_rank_killed kills.
VICTIM = 1


def scenario_rank_killed(ctx):
    """A rank is SIGKILLed while every other rank waits inside its export:
    they all get RankLost.  Each survivor's progress callback, which the
    library calls once the daemon has its export request, leaves a file;
    the victim dies when it sees them all, so no sleep decides the order."""
    rank, world = ctx.rank, ctx.world
    state = {"w": torch.full((rank + 1, 8), float(rank))}
    placements = {"w": Placement("shard0", (sum(range(1, world + 1)), 8))}
    asked = os.path.join(ctx.out_dir, "asked.%d")
    with shardport.Job.from_torch_distributed(socket=ctx.socket,
                                              timeout=30) as job:
        job.register(state, placements)
        if rank == VICTIM:
            others = [asked % r for r in range(world) if r != VICTIM]
            while not all(os.path.exists(p) for p in others):
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)

        def note_asked(_progress):
            open(asked % rank, "a").close()

        try:
            job.export(progress=note_asked, timeout=20).release()
        except errors.RankLost as exc:
            return {"type": type(exc).__name__, "message": exc.message}
    raise AssertionError("the export succeeded although rank %d was killed"
                         % VICTIM)


def refusal_of(call):
    """The ShardportError call raises, as the parent compares it."""
    try:
        call()
    except shardport.ShardportError as exc:
        return {"type": type(exc).__name__, "message": exc.message}
    raise AssertionError("the call succeeded")


def scenario_plain_left_out(ctx):
    """Each rank holds its own rows of "w" and says nothing of it: a plain
    tensor in a job of three ranks is not guessed to be whole everywhere;
    every rank refuses before registering."""
    state = {"w": torch.full((2, 4), float(ctx.rank)),
             "b": torch.ones(3)}
    return refusal_of(lambda: shardport.export_state_dict(
        state, {"b": "replicated"}, socket=ctx.socket, progress=False,
        timeout=30).release())


def scenario_plain_differs(ctx):
    """The half weight of a sharded tensor exported as plain: the caller
    says plain (default_placement), but each rank holds its own rows.  The
    daemons compare the copies and every rank hears one different_data
    naming "w"."""
    state = {"w": torch.full((2, 4), float(ctx.rank)),
             "b": torch.ones(3)}
    return refusal_of(lambda: shardport.export_state_dict(
        state, socket=ctx.socket, progress=False, timeout=30,
        default_placement="plain").release())


def scenario_affine_columns(ctx):
    """Tensor parallelism: rank r holds columns of each weight, uneven,
    as one affine piece; the owner gets the whole weight, byte for byte
    PyTorch's own cat of the gathered columns."""
    rank, world = ctx.rank, ctx.world
    torch.manual_seed(7)
    whole = {"tp.w": torch.randn(5, 9), "tp.h": torch.randn(3, 7).to(
        torch.bfloat16)}
    state, placements = {}, {}
    for key, t in whole.items():
        cuts = split_rows(t.shape[1], world, [2, 3, 1, 1][:world])
        a, b = cuts[rank]
        state[key] = t[:, a:b].contiguous()
        cols = b - a
        pieces = () if cols == 0 else (shardport.Piece(
            shape=(t.shape[0], cols), src_offset=0, src_stride=(cols, 1),
            dst_offset=a, dst_stride=(t.shape[1], 1), holders=(rank,)),)
        placements[key] = Placement("affine", tuple(t.shape), pieces=pieces)
    expected = {k: gather_whole(state[k].t().contiguous()).t()
                for k in sorted(whole)}
    for key in whole:  # the reference itself is right
        assert_same(key, expected[key].contiguous(), whole[key])
    with shardport.export_state_dict(state, placements, socket=ctx.socket,
                                     progress=False, timeout=30) as owned:
        for key, tensor in owned.items():
            assert_same(key, tensor, whole[key])
        return {"owned": sorted(owned)}


# The rank that scenario_rank_gone_early ends before exporting.
GONE = 0


def scenario_rank_gone_early(ctx):
    """Rank 0 never reaches export_state_dict while the others wait in it
    (it hangs elsewhere, or died without its connections closing): they
    do not wait for it past their timeout, and say which rank they waited
    for.  Rank 0 stays until they have written their results, so that no
    closed connection tells them first."""
    if ctx.rank == GONE:
        others = [os.path.join(ctx.out_dir, "%d.json" % r)
                  for r in range(ctx.world) if r != GONE]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(p) for p in others) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return {"gone": True}
    state = {"w": torch.ones(2, 3)}
    return refusal_of(lambda: shardport.export_state_dict(
        state, {"w": Placement("shard0", (6, 3))}, socket=ctx.socket,
        progress=False, timeout=2).release())


SCENARIOS = {
    "model": scenario_model,
    "dtypes-views": scenario_dtypes_views,
    "refusal": scenario_refusal,
    "no-daemon": scenario_no_daemon,
    "rank-killed": scenario_rank_killed,
    "plain-left-out": scenario_plain_left_out,
    "plain-differs": scenario_plain_differs,
    "affine-columns": scenario_affine_columns,
    "rank-gone-early": scenario_rank_gone_early,
}


class Context:
    def __init__(self, rank, world, socket, out_dir):
        self.rank = rank
        self.world = world
        self.socket = socket
        self.out_dir = out_dir


def main():
    scenario, rank, world, init_file, sock, out_dir = sys.argv[1:]
    ctx = Context(int(rank), int(world), sock, out_dir)
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=ctx.rank, world_size=ctx.world)
    result = SCENARIOS[scenario](ctx)
    with open(os.path.join(out_dir, "%d.json" % ctx.rank), "w") as f:
        json.dump(result, f)
    # No barrier: in rank-killed a peer is gone and a collective would hang.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
