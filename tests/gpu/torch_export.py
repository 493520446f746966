"""One rank of a PyTorch job on a real GPU, for tests/gpu/run.sh.

    python3 tests/gpu/torch_export.py RANK WORLD PORT

Every rank joins torch.distributed (gloo, on 127.0.0.1:PORT), puts its
shards in CUDA memory from PyTorch's caching allocator (whatever
PYTORCH_CUDA_ALLOC_CONF says: run.sh runs it with and without
expandable_segments:True), wraps them as DTensors with Shard(0) or
Replicate() on a 1-D mesh, registers the state dict with the placements
left to shardport to infer, exports twice and compares every owned tensor
with the whole tensor, computed here, byte for byte.  Prints "ok RANK KEYS"
or raises.  Every rank uses GPU RANK % torch.cuda.device_count().
"""

import os
import sys

import torch
import torch.distributed as dist

import shardport

SHAPES = {"embed.weight": (1000, 64), "layer.0.w": (257, 33),
          "layer.0.b": (257,), "norm.weight": (64,)}
REPLICATED = {"norm.weight"}


def whole(name, shape, device):
    """The whole tensor: the same on every rank, different per key."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(ord(c) for c in name)
    return (torch.arange(n, dtype=torch.float32, device=device) * 0.5
            + seed).reshape(shape)


def main():
    rank, world, port = (int(a) for a in sys.argv[1:4])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cuda", (world,))
    state = {}
    for name, shape in SHAPES.items():
        full = whole(name, shape, device)
        if name in REPLICATED:
            state[name] = DTensor.from_local(full.clone(), mesh, [Replicate()],
                                             run_check=False)
            continue
        rows = torch.tensor_split(full, world, dim=0)[rank].clone()
        state[name] = DTensor.from_local(rows, mesh, [Shard(0)],
                                         run_check=False, shape=full.shape,
                                         stride=full.stride())
    torch.cuda.synchronize()
    checked = 0
    with shardport.Job.from_torch_distributed() as job:
        job.register(state)
        for _ in range(2):
            with job.export() as owned:
                for key in owned:
                    got = owned[key]
                    want = whole(key, SHAPES[key], got.device)
                    if not torch.equal(got, want):
                        raise AssertionError("%s differs on rank %d"
                                             % (key, rank))
                    checked += 1
    dist.barrier()
    print("ok %d %d" % (rank, checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
