"""One trainer rank of test_save.py: builds its shards of the test model
(save_model.py), saves them as a checkpoint with shardport, and writes what
happened to OUTDIR/RANK.json.

    save_worker.py HOW RANK WORLD INIT_FILE SOCKET OUTDIR CHECKPOINT

HOW: "function" (shardport.save_state_dict), "job" (a Job's save, with a
progress callback), "overwrite" (a Job's save with overwrite=True),
"complex" (the model and a complex64 key, which safetensors cannot name).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import save_model
import shardport


def main():
    how, rank, world, init_file, sock, outdir, ckpt = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=world)
    state, placements = save_model.shards(rank, world)
    if how == "complex":
        state["z.complex"] = torch.zeros(world, dtype=torch.complex64)[
            rank:rank + 1].clone()
        placements["z.complex"] = shardport.Placement("shard0", (world,))
    out = {"rank": rank}
    phases = []

    def progress(p):
        phases.append((p.phase, p.bytes_written, p.bytes_to_write))

    try:
        if how in ("function", "complex"):
            result = shardport.save_state_dict(
                state, ckpt, placements, save_model.LIMIT, save_model.METADATA,
                socket=sock, timeout=60, progress=False)
        else:
            with shardport.Job.from_torch_distributed(socket=sock,
                                                      timeout=60) as job:
                job.register(state, placements)
                result = job.save(ckpt, max_shard_bytes=save_model.LIMIT,
                                  metadata=save_model.METADATA,
                                  overwrite=how == "overwrite",
                                  progress=progress)
        out.update(ok=True, files=result.files,
                   total_files=result.total_files, bytes=result.bytes,
                   total_bytes=result.total_bytes,
                   wrote_index=result.wrote_index, phases=phases)
    except shardport.ShardportError as exc:
        out.update(ok=False, error=exc.name, message=exc.message)
    with open(os.path.join(outdir, "%d.json" % rank), "w") as f:
        json.dump(out, f)
    # No barrier: a failed save must not leave a rank waiting on another.
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
