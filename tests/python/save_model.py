"""The model test_save.py saves: the whole tensors, and each rank's shards
of them with their placements.

Every placement (uneven and empty shard0 rows, replicated, expert, affine
column pieces), every dtype this PyTorch has that safetensors names, tied
weights, more than 4,096 keys, and a limit on a file's bytes that cuts
every owner's keys into several files, with one key larger than the limit.
"""

import torch

import shardport

LIMIT = 4096
METADATA = {"producer": "shardport tests", "note": "quotes \" and \\ too"}
MANY = 4500
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64]


def whole(world):
    """key -> the unsharded tensor (deterministic)."""
    g = torch.Generator().manual_seed(1234)
    t = {}
    for dt in DTYPES:
        raw = torch.randint(-100, 100, (7, 3), generator=g)
        t["dtype." + str(dt).split(".")[1]] = (raw > 0) if dt == torch.bool \
            else raw.to(dt)
    t["empty.rows"] = torch.randn(1, 4, generator=g)
    t["zero.sized"] = torch.randn(0, 5, generator=g)
    t["norm.weight"] = torch.randn(8, generator=g)
    for r in range(world):
        t["expert.%d" % r] = torch.randn(3, 3, generator=g)
    t["affine.w"] = torch.randn(4, 2 * world, generator=g)
    t["embed.weight"] = torch.randn(6, 4, generator=g)
    t["lm_head.weight"] = t["embed.weight"]
    t["big"] = torch.randn(64, 64, generator=g)  # 16 KiB: past LIMIT
    for i in range(MANY):
        t["many.%05d" % i] = torch.randn(world, generator=g)
    return t


def shards(rank, world):
    """This rank's state dict and placements."""
    full = whole(world)
    state, placements = {}, {}
    tied = full["embed.weight"].tensor_split(world)[rank].clone()
    for key, tensor in full.items():
        if key.startswith("expert."):
            if key == "expert.%d" % rank:
                state[key], placements[key] = tensor.clone(), "expert"
        elif key == "norm.weight":
            state[key], placements[key] = tensor.clone(), "replicated"
        elif key == "affine.w":
            rows = tensor.shape[0]
            mine = tensor[:, 2 * rank:2 * rank + 2].clone()
            piece = shardport.Piece(shape=(rows, 2), src_offset=0,
                                    src_stride=(2, 1), dst_offset=2 * rank,
                                    dst_stride=(2 * world, 1),
                                    holders=(rank,))
            state[key] = mine
            placements[key] = shardport.Placement(
                "affine", tuple(tensor.shape), pieces=[piece])
        elif key in ("embed.weight", "lm_head.weight"):
            # One storage, two keys: tied weights.
            state[key] = tied
            placements[key] = shardport.Placement("shard0",
                                                  tuple(tensor.shape))
        else:
            state[key] = tensor.tensor_split(world)[rank].clone()
            placements[key] = shardport.Placement("shard0",
                                                  tuple(tensor.shape))
    return state, placements
