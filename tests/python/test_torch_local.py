"""The tensor layer in one process with real PyTorch: registration of
storages and views, local refusals, owned tensors over raw memory, and an
export of a one-rank job through a private daemon.

Exits 77 (skipped), loudly, when PyTorch cannot be imported.
"""

import ctypes
import dataclasses
import io
import os
import types
import unittest
from unittest import mock

import harness

torch = harness.require_torch()

import shardport  # noqa: E402 (after the torch check, on purpose)
from shardport import Piece, Placement, errors  # noqa: E402
from shardport.client import OwnedTensor, Progress  # noqa: E402
from shardport._progress import TerminalProgress  # noqa: E402
from shardport.tensors import OwnedTensors, Registration  # noqa: E402


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU: this PyTorch may have no CUDA,
    and the refusal of a mix looks only at the devices."""

    @property
    def device(self):
        return torch.device("cuda", 0)


class StandInDTensor(torch.Tensor):
    """Stands in for DTensor where PyTorch has none (1.13): the attributes
    the inference reads, with DTensor's meaning."""


class StandInShard:
    def __init__(self, dim):
        self.dim = dim

    def __repr__(self):
        return "Shard(dim=%d)" % self.dim


class StandInReplicate:
    pass


def stand_in_dtensor(local, global_shape, placement, mesh):
    t = torch.Tensor._make_subclass(StandInDTensor, torch.empty(global_shape))
    t.device_mesh = types.SimpleNamespace(ndim=mesh.dim(), mesh=mesh)
    t.placements = (placement,)
    t.to_local = lambda: local
    return t


def plain(state):
    return {k: "plain" for k in state}


def piece(**fields):
    """A piece: rank 0's three columns of a (4, 6) tensor, but fields."""
    values = dict(shape=(4, 3), src_offset=0, src_stride=(3, 1),
                  dst_offset=0, dst_stride=(6, 1), holders=(0,))
    values.update(fields)
    return Piece(**values)


class RegistrationTest(unittest.TestCase):

    def test_views_of_one_storage_are_one_storage(self):
        flat = torch.arange(40, dtype=torch.float32)
        state = {
            "a": flat[0:12].view(3, 4),
            "b": flat[12:20],
            "t": flat[20:32].view(4, 3).t(),
            "tied": None,
            "other": torch.ones(5),
        }
        state["tied"] = state["a"]
        reg = Registration(state, plain(state), world=1)
        self.assertEqual(len(reg.storage_descs), 2)
        shared, other = reg.storage_descs
        self.assertEqual(shared.length, 40 * 4)
        self.assertEqual(shared.addr, flat.data_ptr())
        self.assertEqual(os.fstat(shared.fd).st_size, 40 * 4)
        self.assertEqual(other.length, 5 * 4)
        by_key = {t.key: t for t in reg.tensor_descs}
        self.assertEqual([by_key[k].storage for k in "abt"], [0, 0, 0])
        self.assertEqual(by_key["other"].storage, 1)
        self.assertEqual(by_key["b"].offset, 12)
        self.assertEqual((by_key["t"].shape, by_key["t"].stride,
                          by_key["t"].offset), ((3, 4), (1, 3), 20))
        self.assertEqual(by_key["tied"],
                         dataclasses.replace(by_key["a"], key="tied"))
        self.assertIs(reg.local["tied"], state["a"])

    def test_storage_is_moved_into_shared_memory(self):
        t = torch.arange(6, dtype=torch.int16)
        view = t[2:]
        self.assertFalse(t.is_shared())
        reg = Registration({"t": t, "v": view}, {"t": "plain", "v": "plain"},
                           world=1)
        self.assertTrue(t.is_shared())
        self.assertEqual(len(reg.storage_descs), 1)
        self.assertEqual(view.data_ptr(), t.data_ptr() + 4)
        self.assertEqual(t.tolist(), list(range(6)))
        desc = reg.storage_descs[0]
        self.assertEqual(os.pread(desc.fd, 12, 0),
                         bytes(bytearray(t.numpy().tobytes())))

    def test_empty_storage_gets_an_empty_file(self):
        state = {"e": torch.empty(0, 4)}
        reg = Registration(state, {"e": Placement("shard0", (0, 4))}, 1)
        (desc,) = reg.storage_descs
        self.assertEqual((desc.length, desc.addr), (0, 0))
        self.assertEqual(os.fstat(desc.fd).st_size, 0)

    def test_explicit_global_shape(self):
        state = {"w": torch.zeros(2, 3)}
        reg = Registration(state, {"w": Placement("shard0", [7, 3])}, 4)
        (desc,) = reg.tensor_descs
        self.assertEqual((desc.placement, desc.global_shape),
                         ("shard0", (7, 3)))

    def test_refusals(self):
        cases = [
            ({"w": torch.zeros(2)}, {"w": "sharded"},
             errors.UnsupportedLayout, "unknown placement"),
            ({"w": torch.zeros(2)}, {"x": "plain"},
             errors.InvalidArgument, "not in the state dict"),
            ({"w": 3}, None, errors.InvalidArgument, "not a tensor"),
            ({"w": torch.zeros(2, device="meta")}, None,
             errors.InvalidArgument, "meta"),
            ({"w": torch.zeros(2, 2).to_sparse()}, None,
             errors.UnsupportedLayout, "strided"),
            ({"w": torch.zeros(2)}, {"w": "shard0"},
             errors.InvalidArgument, "torch.distributed"),
            ({"w": torch.tensor(1.0)}, {"w": "shard0"},
             errors.InvalidArgument, "0-dim"),
            ({"w": torch.zeros(2)}, {"w": 5},
             errors.InvalidArgument, "a placement is"),
            ({"w": torch.Tensor._make_subclass(OnCuda, torch.zeros(2)),
              "x": torch.zeros(2)},
             {"w": "plain", "x": "plain"}, errors.InvalidArgument,
             "mixes CPU tensors (x) and CUDA"),
            ({"w": torch.zeros(2)}, {"w": "affine"},
             errors.InvalidArgument, "needs the whole tensor's global_shape"),
        ]
        for state, placements, cls, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(cls) as caught:
                    Registration(state, placements, world=2)
                self.assertIn(text, caught.exception.message)
                self.assertIn("w" if text != "not in the state dict" else "x",
                              caught.exception.message)

    def test_no_dtensor_on_this_pytorch_means_plain(self):
        from shardport.tensors import _dtensor_api
        if torch.__version__.startswith("1."):
            self.assertIsNone(_dtensor_api())
        reg = Registration({"w": torch.zeros(3)}, None, world=1)
        self.assertEqual(reg.tensor_descs[0].placement, "plain")

    def test_plain_tensors_left_out_need_saying_in_a_bigger_job(self):
        state = {k: torch.zeros(3) for k in ("a", "b", "c")}
        # Whole on every rank, or each rank's own rows: only the caller
        # knows, so a job of more than one rank refuses to guess.
        with self.assertRaises(errors.InvalidArgument) as caught:
            Registration(state, {"b": "plain"}, world=2)
        message = caught.exception.message
        self.assertIn("2 plain tensor(s) without a placement in a job of 2 "
                      "ranks: a, c.", message)
        self.assertIn('default_placement="plain"', message)
        reg = Registration(state, {"b": Placement("shard0", (6,))}, world=2,
                           default_placement="plain")
        self.assertEqual([d.placement for d in reg.tensor_descs],
                         ["plain", "shard0", "plain"])
        reg = Registration(state, None, world=2,
                           default_placement=Placement("replicated"))
        self.assertEqual({d.placement for d in reg.tensor_descs},
                         {"replicated"})
        with self.assertRaises(errors.UnsupportedLayout):
            Registration(state, None, world=2, default_placement="whole")

    def test_affine_pieces_reach_the_descriptor(self):
        # Rank 1 of 2 holds columns 3..5 of a (4, 6) weight.
        cols = Piece(shape=(4, 3), src_offset=0, src_stride=(3, 1),
                     dst_offset=3, dst_stride=(6, 1), holders=(1,))
        reg = Registration({"w": torch.zeros(4, 3)},
                           {"w": Placement("affine", (4, 6), pieces=[cols])},
                           world=2)
        (desc,) = reg.tensor_descs
        self.assertEqual((desc.placement, desc.global_shape, desc.pieces),
                         ("affine", (4, 6), (cols,)))
        with self.assertRaises(errors.InvalidArgument) as caught:
            Placement("shard0", (2,), pieces=(cols,))
        self.assertIn("pieces belong to an affine", caught.exception.message)
        # A rank that holds nothing of the key gives no pieces.
        reg = Registration({"w": torch.zeros(0)},
                           {"w": Placement("affine", (4, 6))}, world=2)
        self.assertEqual(reg.tensor_descs[0].pieces, ())

    def test_pieces_refused_before_the_daemon_sees_them(self):
        cases = [
            (dict(src_stride=(3,)), "src_stride has 1 dims"),
            (dict(dst_stride=(-6, 1)), "must not be negative"),
            (dict(holders=()), "needs its holders"),
            (dict(shape=(1,) * 9, src_stride=(1,) * 9, dst_stride=(1,) * 9),
             "at most 8"),
            (dict(src_offset="x"), "must be integers"),
        ]
        for fields, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(errors.InvalidArgument) as caught:
                    piece(**fields)
                self.assertIn(text, caught.exception.message)


class TargetRegistrationTest(unittest.TestCase):
    """A consumer's targets become storages plus target descriptors, each
    view where its tensor lies (shardport.consumer)."""

    def test_fused_qkv_shard_and_whole(self):
        from shardport.consumer import TargetRegistration
        from shardport import Target
        qkv = torch.zeros(6 + 2 + 2, 4, dtype=torch.bfloat16)
        up = torch.zeros(3, 8)
        norm = torch.zeros(4)
        reg = TargetRegistration({
            "q": Target.pieces((12, 4), [((6, 0), qkv[0:6])]),
            "k": Target.pieces((4, 4), [((2, 0), qkv[6:8])]),
            "v": Target.pieces((4, 4), [((2, 0), qkv[8:10])]),
            "up": Target.shard(up, dim=0, global_shape=(6, 8)),
            "cols": Target.shard(up.t(), dim=1, global_shape=(8, 9)),
            "norm": Target.whole(norm),
        })
        self.assertTrue(qkv.is_shared() and up.is_shared())
        self.assertEqual(len(reg.storage_descs), 3)
        self.assertEqual(reg.cuda_devices, [])
        by_key = {t.key: t for t in reg.target_descs}
        q, k, v = by_key["q"], by_key["k"], by_key["v"]
        self.assertEqual((q.part, q.dtype, q.global_shape),
                         ("pieces", "bfloat16", (12, 4)))
        (qp,), (kp,), (vp,) = q.pieces, k.pieces, v.pieces
        self.assertEqual({qp.storage, kp.storage, vp.storage}, {0})
        self.assertEqual([(p.start, p.shape, p.stride, p.offset)
                          for p in (qp, kp, vp)],
                         [((6, 0), (6, 4), (4, 1), 0),
                          ((2, 0), (2, 4), (4, 1), 24),
                          ((2, 0), (2, 4), (4, 1), 32)])
        self.assertEqual((by_key["up"].part, by_key["up"].dim,
                          by_key["up"].shape, by_key["up"].stride,
                          by_key["up"].storage), ("shard", 0, (3, 8),
                                                  (8, 1), 1))
        self.assertEqual((by_key["cols"].dim, by_key["cols"].shape,
                          by_key["cols"].stride, by_key["cols"].storage),
                         (1, (8, 3), (1, 8), 1))
        self.assertEqual((by_key["norm"].part, by_key["norm"].global_shape,
                          by_key["norm"].storage, by_key["norm"].offset),
                         ("whole", (4,), 2, 0))
        self.assertEqual(reg.storage_descs[0].length, qkv.numel() * 2)

    def test_refusals(self):
        from shardport.consumer import TargetRegistration
        from shardport import Target
        buf = torch.zeros(4, 4)
        cases = [
            ({"w": buf}, errors.InvalidArgument, "is a shardport.Target"),
            ({"w": Target.pieces((4, 4), [])}, errors.InvalidArgument,
             "at least one piece"),
            ({"w": Target.pieces((4, 4), [((0, 0), buf[:2]),
                                          ((2, 0), buf.half()[2:])])},
             errors.DtypeMismatch, "the key's dtype"),
            ({"w": Target.whole(buf),
              "x": Target.whole(torch.Tensor._make_subclass(
                  OnCuda, torch.zeros(2)))},
             errors.InvalidArgument, "the targets mixes CPU tensors"),
            ({"w": Target.whole(buf.to_sparse())},
             errors.UnsupportedLayout, "strided"),
        ]
        for targets, cls, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(cls) as caught:
                    TargetRegistration(targets)
                self.assertIn(text, caught.exception.message)
        with self.assertRaises(errors.InvalidArgument):
            Target.shard(buf, 0, (-1, 4))
        with self.assertRaises(errors.InvalidArgument):
            Target.pieces((4, 4), [(("a", 0), buf)])


class DTensorInferenceTest(unittest.TestCase):
    """The inference rules against a stand-in DTensor API: PyTorch 1.13 has
    no DTensor, so a real one is not checked here."""

    def setUp(self):
        patcher = mock.patch("shardport.tensors._dtensor_api", lambda: (
            StandInDTensor, StandInShard, StandInReplicate))
        patcher.start()
        self.addCleanup(patcher.stop)

    def register(self, value, placements=None):
        return Registration({"w": value}, placements, world=2)

    def test_shard0_on_a_1d_mesh(self):
        local = torch.ones(2, 3)
        reg = self.register(stand_in_dtensor(
            local, (5, 3), StandInShard(0), torch.arange(2)))
        (desc,) = reg.tensor_descs
        self.assertEqual((desc.placement, desc.global_shape, desc.shape),
                         ("shard0", (5, 3), (2, 3)))
        self.assertIs(reg.local["w"], local)

    def test_replicate(self):
        local = torch.ones(5, 3)
        reg = self.register(stand_in_dtensor(
            local, (5, 3), StandInReplicate(), torch.arange(2)))
        self.assertEqual(reg.tensor_descs[0].placement, "replicated")

    def test_explicit_placement_registers_the_local_tensor(self):
        local = torch.ones(2, 3)
        reg = self.register(stand_in_dtensor(
            local, (4, 3), StandInShard(1), torch.arange(2)),
            {"w": Placement("expert")})
        self.assertIs(reg.local["w"], local)
        self.assertEqual(reg.tensor_descs[0].placement, "expert")

    def test_refusals(self):
        cases = [
            (StandInShard(1), torch.arange(2), "cannot be inferred"),
            (StandInShard(0), torch.arange(2).view(1, 2), "1-D mesh"),
            (StandInShard(0), torch.tensor([1, 0]), "1-D mesh"),
        ]
        for placement, mesh, text in cases:
            with self.subTest(text=text, mesh=mesh.tolist()):
                with self.assertRaises(errors.UnsupportedLayout) as caught:
                    self.register(stand_in_dtensor(torch.ones(2, 3), (4, 3),
                                                   placement, mesh))
                self.assertIn(text, caught.exception.message)
                self.assertIn("w:", caught.exception.message)


class OwnedTensorsTest(unittest.TestCase):

    def wrap(self, raw, **fields):
        registration = Registration({}, None, world=1)
        maker = OwnedTensors(registration, keepalive=raw)
        return maker, maker.tensor(OwnedTensor(
            key=fields.pop("key", "k"), identity=False, **fields))

    def test_bfloat16_without_a_copy(self):
        want = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16)
        raw = ctypes.create_string_buffer(
            want.view(torch.int16).numpy().tobytes(), 8)
        address = ctypes.addressof(raw)
        _, got = self.wrap(raw, dtype="bfloat16", shape=(2, 2),
                           stride=(2, 1), data=address)
        self.assertEqual(got.dtype, torch.bfloat16)
        self.assertEqual(got.data_ptr(), address)
        self.assertTrue(torch.equal(got, want.view(2, 2)))
        ctypes.memmove(address, b"\x00\x00", 2)
        self.assertEqual(got[0, 0].item(), 0.0)  # the same memory

    def test_strided_view_and_tied_buffers(self):
        base = torch.arange(6, dtype=torch.int16)
        raw = ctypes.create_string_buffer(base.numpy().tobytes(), 12)
        address = ctypes.addressof(raw)
        maker, got = self.wrap(raw, dtype="int16", shape=(3, 2),
                               stride=(1, 3), data=address)
        self.assertTrue(torch.equal(got, base.view(2, 3).t()))
        twin = maker.tensor(OwnedTensor(key="twin", dtype="int16",
                                        shape=(3, 2), stride=(1, 3),
                                        data=address, identity=False))
        self.assertEqual(twin.storage().data_ptr(),
                         got.storage().data_ptr())

    def test_empty_tensor(self):
        _, got = self.wrap(None, dtype="float32", shape=(0, 4),
                           stride=(4, 1), data=0)
        self.assertEqual(tuple(got.shape), (0, 4))

    def test_identity_is_the_callers_object(self):
        mine = torch.arange(4.0)
        registration = Registration({"m": mine}, None, world=1)
        maker = OwnedTensors(registration, keepalive=None)
        got = maker.tensor(OwnedTensor(key="m", dtype="float32", shape=(4,),
                                       stride=(1,), data=mine.data_ptr(),
                                       identity=True))
        self.assertIs(got, mine)


class TerminalProgressTest(unittest.TestCase):

    class Tty(io.StringIO):
        def isatty(self):
            return True

    def test_shown_on_a_terminal_only(self):
        self.assertFalse(TerminalProgress.wanted(io.StringIO()))
        tty = self.Tty()
        self.assertTrue(TerminalProgress.wanted(tty))
        shown = TerminalProgress(tty)
        shown(Progress("moving", 2, 5, 3 << 20, 8 << 20))
        shown.close()
        self.assertIn("round 2/5", tty.getvalue())
        self.assertIn("3.0 MiB / 8.0 MiB (37%)", tty.getvalue())
        self.assertTrue(tty.getvalue().endswith("\n"))

    def test_a_save_shows_the_bytes_written(self):
        tty = self.Tty()
        shown = TerminalProgress(tty)
        shown(Progress("writing", 0, 0, 0, 0, bytes_written=1 << 20,
                       bytes_to_write=4 << 20))
        shown.close()
        self.assertIn("writing", tty.getvalue())
        self.assertIn("1.0 MiB / 4.0 MiB written (25%)", tty.getvalue())

    def test_drawn_on_rank_0_only(self):
        from shardport.export import _terminal_progress
        with mock.patch.object(TerminalProgress, "wanted", lambda: True):
            self.assertIsInstance(_terminal_progress(0), TerminalProgress)
            self.assertIsNone(_terminal_progress(1))
        with mock.patch.object(TerminalProgress, "wanted", lambda: False):
            self.assertIsNone(_terminal_progress(0))


class OneRankExportTest(unittest.TestCase):

    def test_export_of_a_one_rank_job(self):
        state = {
            "w": torch.arange(12, dtype=torch.float32).view(3, 4),
            "b": torch.arange(3, dtype=torch.bfloat16),
        }
        placements = {"w": Placement("shard0", (3, 4)), "b": "replicated"}
        phases = []
        with harness.daemon() as daemon, \
                shardport.Job.create(1, socket=daemon.socket) as job:
            job.register(state, placements)
            with self.assertRaises(errors.BadState):
                job.register(state, placements)
            with job.export(progress=lambda p: phases.append(p.phase)) \
                    as owned:
                self.assertEqual(sorted(owned), ["b", "w"])
                # This rank holds everything whole: nothing is copied.
                self.assertIs(owned["w"], state["w"])
                self.assertIs(owned["b"], state["b"])
            self.assertTrue(owned.released)
            owned.release()  # a second release does nothing
        self.assertTrue(phases, "the progress callback was never called")
        self.assertEqual(phases[0], "waiting")

    def test_empty_view_past_its_storage_end(self):
        # The last rank's empty dim-0 shard of a column-sliced tensor:
        # PyTorch leaves its offset past the end of the storage.
        z = torch.arange(63, dtype=torch.float32).view(9, 7)
        tail = z[:, 2:7][9:9]
        self.assertEqual(tail.storage_offset(), 65)
        state = {"z": z, "tail": tail}
        with harness.daemon() as daemon, \
                shardport.Job.create(1, socket=daemon.socket) as job:
            job.register(state, plain(state))
            with job.export() as owned:
                self.assertIs(owned["tail"], tail)
                self.assertIs(owned["z"], z)


if __name__ == "__main__":
    unittest.main(verbosity=2)
