"""The package's CUDA storages on the fake CUDA runtime (docs/fakes.md),
without PyTorch: a daemon serving the CUDA backend on two fake GPUs, and
two rank processes that hold their shard of one tensor in fake device
memory, register it as PyTorch's _share_cuda_() handle bytes (rank 0) or as
a device pointer (rank 1), export, and read what they own back through the
fake runtime byte for byte.

PyTorch's own CUDA path (tensors.py: _share_cuda_() of a CUDA tensor, the
owned tensors over device memory) needs a GPU and a CUDA build of PyTorch;
tests/gpu/run.sh is where that can run.

A save (docs/checkpoints.md) writes the same ranks' device tensors into a
checkpoint through the library's pinned staging: the assembled tensors
and an identity tensor with a transposed view, in many small writes (the
test seam's), read back with the tests' own reader of the format.

usage: test_cuda_fake.py               the test (meson runs it)
       test_cuda_fake.py rank R SOCKET TICKET_HEX [METRICS_URL]
       test_cuda_fake.py save R SOCKET TICKET_HEX DIR
                                      one rank (internal)
"""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import harness
import shardport

ROWS, COLS = 6, 5  # float32
SPLIT = (2, 4)     # rows of rank 0 and rank 1
PREFIX = 256       # bytes of the allocation before the shard


def original():
    return bytes((i * 7 + 3) % 251 for i in range(ROWS * COLS * 4))


BIG = (256, 300)      # float32, rows split as BIG_SPLIT
BIG_SPLIT = (100, 156)
T_MEM = (6, 4)        # rank 1's expert "t": this memory, viewed transposed


def original_big():
    return bytes((i * 13 + 5) % 253 for i in range(BIG[0] * BIG[1] * 4))


def t_memory():
    return bytes((i * 3 + 1) % 247 for i in range(T_MEM[0] * T_MEM[1] * 4))


def t_expected():
    """The transposed view's elements in row-major order."""
    mem, rows, cols = t_memory(), T_MEM[0], T_MEM[1]
    return b"".join(mem[(j * cols + i) * 4:(j * cols + i) * 4 + 4]
                    for i in range(cols) for j in range(rows))


def pool_used(metrics_url):
    """shardport_pool_used_bytes of one scrape: {device: bytes}."""
    text = urllib.request.urlopen(metrics_url).read().decode()
    return {dev: int(v) for dev, v in re.findall(
        r'^shardport_pool_used_bytes\{device="([^"]+)"\} ([0-9]+)$',
        text, re.M)}


def rank_main(rank, socket, ticket, metrics_url=None):
    """One rank: its shard in fake device memory, registered, exported,
    what it owns read back; prints "owned N ok" or raises.  With
    metrics_url, also the pool's used bytes while it holds what it owns
    ("used {device: bytes}")."""
    rt = ctypes.CDLL(os.environ["SHARDPORT_CUDART_LIB"])
    vp = ctypes.c_void_p
    rt.cudaMalloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t]
    rt.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
    rt.cudaStreamSynchronize.argtypes = [vp]
    rt.cudaIpcGetMemHandle.argtypes = [vp, vp]

    def copy(dst, src, n, kind):
        assert rt.cudaMemcpyAsync(dst, src, n, kind, None) == 0
        assert rt.cudaStreamSynchronize(None) == 0

    ok = 0
    assert rt.cudaSetDevice(rank) == ok
    rows = SPLIT[rank]
    first = sum(SPLIT[:rank]) * COLS * 4
    shard = original()[first:first + rows * COLS * 4]
    base = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(base), PREFIX + len(shard)) == ok
    addr = base.value + PREFIX
    kind_h2d, kind_d2h = 1, 2
    copy(addr, ctypes.c_char_p(shard), len(shard), kind_h2d)
    with shardport.Client(socket) as client:
        device = client.cuda_device_name(rank)
        client.join(ticket, rank, 2, device)
        if rank == 0:
            ipc = (ctypes.c_char * 64)()
            assert rt.cudaIpcGetMemHandle(ctypes.cast(ipc, vp), base) == ok
            desc = shardport.StorageDesc(
                id=1, fd=-1, offset=PREFIX, length=len(shard), addr=addr,
                kind="cuda_ipc", handle=b"\x02c" + bytes(ipc))
        else:
            desc = shardport.StorageDesc(id=1, fd=-1, offset=0,
                                         length=len(shard), addr=addr,
                                         kind="cuda")
        client.register_storages([desc])
        client.register_tensors([shardport.TensorDesc(
            key="w", storage=1, dtype="float32", shape=(rows, COLS),
            stride=(COLS, 1), offset=0, placement="shard0",
            global_shape=(ROWS, COLS))])
        owned = client.export()
        try:
            for t in owned.tensors:
                assert t.device == device, (t.device, device)
                assert t.device_index == rank
                assert t.shape == (ROWS, COLS) and t.stride == (COLS, 1)
                back = (ctypes.c_char * (ROWS * COLS * 4))()
                copy(ctypes.cast(back, vp), t.data, len(back), kind_d2h)
                assert bytes(back) == original(), "the tensor differs"
            print("owned %d ok" % len(owned.tensors), flush=True)
            if metrics_url is not None:
                print("used %s" % json.dumps(pool_used(metrics_url)),
                      flush=True)
        finally:
            client.release(owned)
        client.leave()


def cuda_runtime():
    """The fake runtime (SHARDPORT_CUDART_LIB), or on a GPU machine
    (tests/gpu/run.sh) the real one."""
    if os.environ.get("SHARDPORT_CUDART_LIB"):
        return ctypes.CDLL(os.environ["SHARDPORT_CUDART_LIB"])
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    raise RuntimeError("no CUDA runtime to load")


def save_rank_main(rank, socket, ticket, directory):
    """One rank of a save: its shards of "w" and "big" (and on rank 1 the
    expert "t", a transposed view) in device memory, saved.  The ranks
    share the GPUs there are."""
    rt = cuda_runtime()
    vp = ctypes.c_void_p
    rt.cudaMalloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t]
    rt.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
    rt.cudaStreamSynchronize.argtypes = [vp]
    count = ctypes.c_int()
    assert rt.cudaGetDeviceCount(ctypes.byref(count)) == 0
    ordinal = rank % count.value
    assert rt.cudaSetDevice(ordinal) == 0
    rows, big_rows = SPLIT[rank], BIG_SPLIT[rank]
    w = original()[sum(SPLIT[:rank]) * COLS * 4:][:rows * COLS * 4]
    big = original_big()[sum(BIG_SPLIT[:rank]) * BIG[1] * 4:][
        :big_rows * BIG[1] * 4]
    t = t_memory() if rank == 1 else b""
    mem = w + big + t
    base = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(base), len(mem)) == 0
    assert rt.cudaMemcpyAsync(base, ctypes.c_char_p(mem), len(mem), 1,
                              None) == 0
    assert rt.cudaStreamSynchronize(None) == 0
    with shardport.Client(socket) as client:
        client.join(ticket, rank, 2, client.cuda_device_name(ordinal))
        client.register_storages([shardport.StorageDesc(
            id=1, fd=-1, offset=0, length=len(mem), addr=base.value,
            kind="cuda")])
        tensors = [
            shardport.TensorDesc(key="w", storage=1, dtype="float32",
                                 shape=(rows, COLS), stride=(COLS, 1),
                                 offset=0, placement="shard0",
                                 global_shape=(ROWS, COLS)),
            shardport.TensorDesc(key="big", storage=1, dtype="float32",
                                 shape=(big_rows, BIG[1]),
                                 stride=(BIG[1], 1), offset=len(w) // 4,
                                 placement="shard0", global_shape=BIG)]
        if rank == 1:
            tensors.append(shardport.TensorDesc(
                key="t", storage=1, dtype="float32",
                shape=(T_MEM[1], T_MEM[0]), stride=(1, T_MEM[1]),
                offset=(len(w) + len(big)) // 4, placement="expert",
                global_shape=(T_MEM[1], T_MEM[0])))
        client.register_tensors(tensors)
        result = client.save(directory, max_shard_bytes=1 << 20)
        print("saved %d %d" % (result.files, result.bytes), flush=True)
        client.leave()


def export_two_ranks(test, d, metrics_url=None):
    """Both ranks export the tensor through daemon d and check it; their
    outputs."""
    with shardport.Client(d.socket) as client:
        test.assertEqual(client.status().backend_active, "cuda")
        ticket = client.create_job(2)
    procs = [subprocess.Popen(
        [sys.executable, __file__, "rank", str(r), d.socket,
         ticket.hex(), *([metrics_url] if metrics_url else [])], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        test.assertEqual(p.returncode, 0, "rank %d: %s" % (r, out))
    # One rank owns the tensor; both checked what they own.
    owned = sorted(int(o.split()[1]) for o in outs)
    test.assertEqual(owned, [0, 1], outs)
    return outs


class CudaFakeTest(unittest.TestCase):

    def test_save_device_memory(self):
        import safetensors_reader
        workdir = tempfile.mkdtemp(prefix="sp-cuda-save-")
        ckpt = os.path.join(workdir, "ckpt")
        try:
            with harness.daemon("--backend", "cuda") as d:
                with shardport.Client(d.socket) as client:
                    ticket = client.create_job(2)
                # Small writes (the test seam), so that many chunks pass
                # through both staging buffers.
                env = dict(os.environ, SHARDPORT_TEST_SAVE_DELAY_MS="1")
                procs = [subprocess.Popen(
                    [sys.executable, __file__, "save", str(r), d.socket,
                     ticket.hex(), ckpt], stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, env=env)
                    for r in range(2)]
                outs = [p.communicate(timeout=120)[0] for p in procs]
                for r, (p, out) in enumerate(zip(procs, outs)):
                    self.assertEqual(p.returncode, 0, "rank %d: %s" % (r, out))
            _, tensors, _, total = safetensors_reader.read_checkpoint(ckpt)
            self.assertEqual(tensors["w"], ("F32", (ROWS, COLS), original()))
            self.assertEqual(tensors["big"], ("F32", BIG, original_big()))
            self.assertEqual(tensors["t"],
                             ("F32", (T_MEM[1], T_MEM[0]), t_expected()))
            self.assertEqual(total, sum(len(v[2]) for v in tensors.values()))
            try:
                from safetensors.numpy import load_file
            except ImportError:
                return
            # Where the format's own library is installed (a GPU machine,
            # tests/gpu/run.sh), it reads the same bytes.
            index = os.path.join(ckpt, safetensors_reader.INDEX)
            with open(index) as f:
                files = set(json.load(f)["weight_map"].values())
            loaded = {}
            for name in files:
                loaded.update(load_file(os.path.join(ckpt, name)))
            self.assertEqual({k: v.tobytes() for k, v in loaded.items()},
                             {k: v[2] for k, v in tensors.items()})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def test_two_ranks_export_device_memory(self):
        with harness.daemon("--backend", "cuda") as d:
            export_two_ranks(self, d)

    def test_metrics_name_each_gpu(self):
        """The pool gauges have a series per GPU (docs/operations.md,
        "Monitoring"), the capacity gpu_pool_capacity."""
        workdir = tempfile.mkdtemp(prefix="sp-cuda-metrics-")
        cfg = os.path.join(workdir, "shardportd.conf")
        with open(cfg, "w") as f:
            f.write("gpu_pool_capacity = 1G\nmetrics_listen = 127.0.0.1:0\n")
        try:
            with harness.daemon("--backend", "cuda", "--config", cfg) as d:
                # The daemon may answer before it has logged the line.
                deadline = time.monotonic() + 10
                while True:
                    m = re.search(r"metrics: serving (http://\S+/metrics)",
                                  d.log_text())
                    if m is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                self.assertIsNotNone(m, "the daemon never said where its "
                                     "metrics are served")
                outs = export_two_ranks(self, d, m.group(1))
                deadline = time.monotonic() + 10
                while True:
                    text = urllib.request.urlopen(m.group(1)).read().decode()
                    if ('{result="published"} 1\n' in text
                            or time.monotonic() > deadline):
                        break
                    time.sleep(0.05)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        self.assertIn('shardport_exports_total{result="published"} 1\n', text)
        self.assertIn('shardport_backend_info{backend="cuda",', text)
        gpus = int(os.environ["SHARDPORT_FAKE_GPUS"])
        for g in range(gpus):
            self.assertIn('shardport_pool_capacity_bytes{device="cuda:%d"} '
                          '1073741824\n' % g, text)
            self.assertRegex(text, r'shardport_pool_used_bytes\{device='
                                   r'"cuda:%d"\} [0-9]+\n' % g)
        self.assertNotIn('device="cuda:%d"' % gpus, text)
        # While a rank holds what it owns, its bytes are in its GPU's
        # series and not the host's: every tensor lay in device memory.  The
        # rank that owns nothing may read the gauges after the owner
        # released, so only the owner's reading counts its bytes.
        for out in outs:
            used = json.loads(re.search(r"^used (.*)$", out, re.M).group(1))
            self.assertEqual(used["host"], 0, out)
            if not re.search(r"^owned 0 ok$", out, re.M):
                self.assertGreater(sum(used.values()), 0, out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "save":
        save_rank_main(int(sys.argv[2]), sys.argv[3],
                       bytes.fromhex(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4]),
                  *sys.argv[5:6])
    else:
        unittest.main()
