"""One trainer rank of test_save_attacks.py: saves a small model (a Job,
registered, then its save) with the options its spec gives this rank, and
writes what happened to OUTDIR/RANK.json.

    save_attack_worker.py SPEC RANK

SPEC is a JSON file: world, init_file, socket, outdir, timeout, keys (the
model's extra key names), and the save's options, each of which
ranks[RANK] (a map per rank) may change for this rank: path, metadata,
overwrite, limit, cwd (the rank's working directory), fsize (a limit on
the size of a file the rank writes, RLIMIT_FSIZE) and links (a file: the
rank plants a symbolic link to it at each temporary name its save could
use, docs/checkpoints.md); delay_ms (the test seam's
SHARDPORT_TEST_SAVE_DELAY_MS for this rank's save); again (once the save failed, the same job
saves again with the rank's file size unlimited: "again" in the result).
"""

import json
import os
import resource
import sys

import torch
import torch.distributed as dist

import shardport


def mine(spec, name, rank, default=None):
    """This rank's value of option name."""
    ranks = spec.get("ranks") or [{}] * spec["world"]
    return ranks[rank].get(name, spec.get(name, default))


def model(world, rank, keys):
    """The test's model: "w" (uneven rows) and one small tensor per extra
    key, every rank holding its dim-0 shard; a key that starts with
    "scalar." is a 0-dim tensor every rank holds (replicated)."""
    state, placements, whole = {}, {}, {}
    g = torch.Generator().manual_seed(99)
    names = ["w"] + list(keys)
    for i, key in enumerate(names):
        if key.startswith("scalar."):
            full = torch.randn((), generator=g)
            state[key], placements[key] = full.clone(), "replicated"
        else:
            full = torch.randn(2 * world + 1 if i == 0 else world, 3,
                               generator=g)
            state[key] = full.tensor_split(world)[rank].clone()
            placements[key] = shardport.Placement("shard0",
                                                  tuple(full.shape))
        whole[key] = full
    return state, placements, whole


def plant_links(path, target, nfiles):
    """Symbolic links to target at every temporary name this process's save
    could write (files and index, the job's first exports)."""
    names = ["model.safetensors", "model.safetensors.index.json"] + [
        "model-%05d-of-%05d.safetensors" % (i + 1, nfiles)
        for i in range(nfiles)]
    os.makedirs(path, exist_ok=True)
    for name in names:
        for export_id in range(4):
            os.symlink(target, os.path.join(
                path, ".%s.%d-%d.tmp" % (name, os.getpid(), export_id)))


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(sys.argv[2])
    world = spec["world"]
    cwd = mine(spec, "cwd", rank)
    if cwd:
        os.chdir(cwd)
    dist.init_process_group("gloo", init_method="file://" + spec["init_file"],
                            rank=rank, world_size=world)
    state, placements, _ = model(world, rank, spec.get("keys", []))
    path = mine(spec, "path", rank)
    links = mine(spec, "links", rank)
    if links:
        plant_links(path, links, world)
    sock = mine(spec, "socket", rank)
    delay = mine(spec, "delay_ms", rank)
    if delay:
        os.environ["SHARDPORT_TEST_SAVE_DELAY_MS"] = str(delay)
    fsize = mine(spec, "fsize", rank)
    unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {"rank": rank}
    try:
        timeout = spec.get("timeout", 60)
        with shardport.Job.from_torch_distributed(socket=sock,
                                                  timeout=timeout) as job:
            job.register(state, placements)
            if fsize is not None:
                # Only now: torch.distributed's file store writes too.
                # Python ignores SIGXFSZ: a write past the limit fails
                # with EFBIG.
                resource.setrlimit(resource.RLIMIT_FSIZE,
                                   (fsize, unlimited[1]))
            options = dict(
                max_shard_bytes=mine(spec, "limit", rank, 5 * 2**30),
                metadata=mine(spec, "metadata", rank),
                overwrite=mine(spec, "overwrite", rank, False),
                timeout=timeout, progress=False)
            try:
                result = job.save(path, **options)
            except shardport.ShardportError as exc:
                if not mine(spec, "again", rank):
                    raise
                resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
                again = job.save(path, **options)
                out["again"] = {"files": again.files, "bytes": again.bytes}
                raise exc
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
        out.update(ok=True, files=result.files, bytes=result.bytes)
    except shardport.ShardportError as exc:
        out.update(ok=False, error=exc.name, message=exc.message)
    except (TypeError, ValueError) as exc:
        out.update(ok=False, error=type(exc).__name__, message=str(exc))
    with open(os.path.join(spec["outdir"], "%d.json" % rank), "w") as f:
        json.dump(out, f)
    # No barrier: a failed save must not leave a rank waiting on another.
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
