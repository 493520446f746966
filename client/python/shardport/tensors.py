"""PyTorch tensors in and out: registration descriptors from a state dict,
and owned tensors over published memory.

This is the only module that imports PyTorch at its top, and the package
imports it only when tensors are handled.

Tensors in.  A CPU tensor is registered as its whole storage (a shared
memory fd, as PyTorch's file-descriptor sharing produces it) plus a view:
dtype, shape, stride and storage offset in elements.  A CUDA tensor's
storage is registered as the CUDA IPC handle PyTorch's _share_cuda_() gives
(its allocation's base, in PyTorch's own byte format, which the daemon
reads) and the storage's offset from that base.  Views of one storage
(tied weights, a flat parameter buffer cut into shards, a transposed view)
become one storage and many views; storages are told apart by (device, base
address), never by address alone (docs/protocol.md, storage_add).  One
registration is all CPU or all CUDA tensors.

Tensors out.  An owned tensor is a PyTorch tensor over the published memory,
made without a copy: the bytes are wrapped as uint8 (host memory through
ctypes, device memory through __cuda_array_interface__), reinterpreted as
the dtype (which also covers bfloat16, which numpy lacks) and given the
owned view's shape and strides.  An identity tensor is the caller's own
object.
"""

import ctypes
import functools
import importlib
import os

import torch

from . import _rendezvous, errors
from .client import StorageDesc, TensorDesc
from .placements import Placement, normalize


def dtype_name(dtype):
    """The PyTorch name the protocol uses: torch.bfloat16 is "bfloat16"."""
    return str(dtype)[len("torch."):]


def torch_dtype(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise errors.UnknownDtype("the daemon published dtype %r, which this "
                                  "PyTorch does not have" % name)
    return dtype


@functools.lru_cache(maxsize=None)
def _dtensor_api():
    """(DTensor, Shard, Replicate) of this PyTorch, or None on versions
    without DTensor (1.13 has none in its public API).  Cached: a failed
    import searches the path again every time."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            m = importlib.import_module(module)
            return m.DTensor, m.Shard, m.Replicate
        except (ImportError, AttributeError):
            continue
    return None


def _infer(key, value, world, default):
    """(local tensor, Placement) for a value without an explicit placement:
    a DTensor with Shard(0) on a 1-D mesh of every rank is shard0, with
    Replicate() replicated; a plain tensor is default (a Placement), or
    plain in a job of one rank, or None (the caller must say); anything
    else is refused."""
    dtensor = _dtensor_api()
    if dtensor is not None and isinstance(value, dtensor[0]):
        _, shard, replicate = dtensor
        mesh = value.device_mesh
        ranks = mesh.mesh.flatten().tolist()
        if mesh.ndim != 1 or ranks != list(range(world)):
            raise errors.UnsupportedLayout(
                "%s: a DTensor on device mesh %s; shardport infers placements "
                "only on a 1-D mesh of ranks 0..%d in order; give this key's "
                "placement explicitly" % (key, mesh.mesh.tolist(), world - 1))
        (placement,) = value.placements
        global_shape = tuple(value.shape)
        if isinstance(placement, shard) and placement.dim == 0:
            return value.to_local(), Placement("shard0", global_shape)
        if isinstance(placement, replicate):
            return value.to_local(), Placement("replicated", global_shape)
        raise errors.UnsupportedLayout(
            "%s: DTensor placement %s cannot be inferred (only Shard(0) and "
            "Replicate() are); give this key's placement explicitly"
            % (key, placement))
    # Whole on every rank, or each rank's own rows?  Only the caller knows:
    # guessing plain when each rank holds its part would publish the
    # owner's part as the whole tensor.
    if default is not None:
        return value, default
    if world == 1:
        return value, Placement("plain", tuple(value.shape))
    return value, None


def _local(key, value, explicit, world, default):
    """The local tensor and Placement (None: a plain tensor the caller must
    place) of one state dict entry."""
    if not isinstance(value, torch.Tensor):
        raise errors.InvalidArgument("%s: a %s is not a tensor"
                                     % (key, type(value).__name__))
    if explicit is None:
        tensor, placement = _infer(key, value, world, default)
    else:
        dtensor = _dtensor_api()
        is_dtensor = dtensor is not None and isinstance(value, dtensor[0])
        tensor = value.to_local() if is_dtensor else value
        placement = normalize(key, explicit)
    if tensor.device.type not in ("cpu", "cuda"):
        raise errors.InvalidArgument("%s: tensors on %s cannot be registered"
                                     % (key, tensor.device))
    if tensor.layout != torch.strided:
        raise errors.UnsupportedLayout("%s: a %s tensor; only strided tensors "
                                       "can be registered"
                                       % (key, tensor.layout))
    return tensor, placement


def _untyped_storage(tensor):
    # PyTorch 2 names it untyped_storage(); 1.13 reaches it through the
    # typed storage.
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage()
    return tensor.storage().untyped()


def _gather_rows(rows, world, timeout):
    """The whole tensor's dim 0 of every key in rows (this rank's shard0
    keys without a global shape, with their local rows): the sum of every
    rank's rows, added up through torch.distributed's store, waiting at
    most timeout seconds for the others (_rendezvous).

    Every rank takes part whenever torch.distributed spans the job, also
    with nothing to ask: a rank that skipped the exchange would leave the
    others waiting in it."""
    import torch.distributed as dist
    spans_job = (dist.is_available() and dist.is_initialized()
                 and dist.get_world_size() == world)
    if not spans_job:
        if rows:
            raise errors.InvalidArgument(
                "%s: shard0 needs the whole tensor's shape: give "
                "shardport.Placement('shard0', global_shape), or initialize "
                "torch.distributed over the job's %d ranks so that "
                "shardport can add up their rows" % (next(iter(rows)), world))
        return {}
    everyone = _rendezvous.exchange(dist, "report the rows of their shard0 "
                                    "keys", rows, list(range(world)),
                                    timeout)
    return {key: sum(r.get(key, 0) for r in everyone) for key in rows}


def _unplaced(keys, world):
    """The refusal of plain tensors left out of placements in a job of
    world ranks."""
    named = ", ".join(keys[:8]) + (" and %d more" % (len(keys) - 8)
                                   if len(keys) > 8 else "")
    return errors.InvalidArgument(
        "%d plain tensor(s) without a placement in a job of %d ranks: %s. "
        "shardport cannot tell whether every rank holds the same values "
        "(\"plain\" or \"replicated\"; the daemon then checks that every "
        "copy is equal) or its own part (\"shard0\", an affine Placement, "
        "\"expert\"): name each in placements, or pass "
        "default_placement=\"plain\" when every rank holds them whole"
        % (len(keys), world, named))


def one_device_type(tensors, what):
    """Refuses tensors both on the CPU and on CUDA devices: one process
    registers host memory or device memory.  tensors maps names to
    tensors; what names them in the refusal."""
    on = {}
    for key, t in tensors.items():
        on.setdefault(t.device.type, key)
    if len(on) > 1:
        raise errors.InvalidArgument(
            "%s mixes CPU tensors (%s) and CUDA tensors (%s); one process "
            "registers one or the other (move the CPU ones to its GPU, or "
            "the CUDA ones to the CPU)" % (what, on["cpu"], on["cuda"]))


def cuda_devices(tensors):
    """The CUDA device ordinals tensors lie on, sorted: the devices to
    synchronize before the daemon reads or writes their memory."""
    return sorted({t.device.index for t in tensors if t.device.type == "cuda"})


class Storages:
    """The storages behind a set of tensors, each registered once however
    many tensors view it, told apart by (device, base address) (never by
    address alone: docs/protocol.md, storage_add).  descs are their
    StorageDescs, ids 0, 1, ... in the order first seen.  It keeps every
    storage alive: the fd the daemon duplicated and the memory the tensors
    point into belong to them."""

    def __init__(self):
        self.descs = []
        self._kept = []
        self._ids = {}

    def id_of(self, tensor):
        """The id of tensor's storage, registering it on first sight."""
        storage = _untyped_storage(tensor)
        if tensor.device.type == "cuda":
            identity = (str(tensor.device), storage.data_ptr())
            if identity in self._ids:
                return self._ids[identity]
            return self._add_cuda(identity, storage)
        # _share_fd_cpu_ moves a storage that is not yet in shared memory
        # into a new shm file (every view of it follows, as with
        # share_memory_()) and returns the file's fd, which the storage
        # keeps open.  Calling it directly leaves the process's sharing
        # strategy alone.  The base address is read after the move.
        fd, length = storage._share_fd_cpu_()
        identity = (str(tensor.device), storage.data_ptr())
        if identity in self._ids:
            return self._ids[identity]
        sid = self._ids[identity] = len(self.descs)
        if length == 0:
            # An empty storage has no shm file; it still needs one, empty,
            # for the views (an empty shard) that name it.
            fd = os.memfd_create("shardport-empty", os.MFD_CLOEXEC)
            storage = _EmptyFile(fd)
        self._kept.append(storage)
        self.descs.append(StorageDesc(
            id=sid, fd=fd, offset=0, length=length,
            addr=storage.data_ptr()))
        return sid

    def _add_cuda(self, identity, storage):
        """A CUDA storage as its IPC handle: _share_cuda_() returns the
        handle of the storage's allocation base in PyTorch's own format
        (which the daemon reads as it is) and the storage's byte offset
        from that base.  The library finds the GPU's UUID itself."""
        sid = self._ids[identity] = len(self.descs)
        length = storage.nbytes() if callable(storage.nbytes) else storage.size()
        self._kept.append(storage)
        if length == 0:
            # No allocation to name: the daemon opens nothing for it.
            self.descs.append(StorageDesc(
                id=sid, fd=-1, offset=0, length=0, addr=0, kind="cuda"))
            return sid
        shared = storage._share_cuda_()
        handle, offset = shared[1], shared[3]
        self.descs.append(StorageDesc(
            id=sid, fd=-1, offset=offset, length=length,
            addr=storage.data_ptr(), kind="cuda_ipc", handle=bytes(handle)))
        return sid


class Registration:
    """One rank's state dict as storages plus views.

    It keeps every registered storage alive: the fd the daemon duplicated
    and the memory an identity tensor points into belong to them.  local
    maps each key to the tensor registered for it (the caller's own object,
    or a DTensor's local tensor).  default_placement places the plain
    tensors placements leaves out (None: plain in a job of one rank,
    refused in a bigger one).
    """

    def __init__(self, state_dict, placements, world, default_placement=None,
                 timeout=None):
        placements = dict(placements or {})
        unknown = sorted(set(placements) - set(state_dict))
        if unknown:
            raise errors.InvalidArgument("placements name keys that are not "
                                         "in the state dict: %s"
                                         % ", ".join(unknown))
        default = None
        if default_placement is not None:
            default = normalize("default_placement", default_placement)
        self.local = {}
        self._storages = Storages()
        self.storage_descs = self._storages.descs
        self.tensor_descs = []
        chosen = {}
        for key, value in state_dict.items():
            self.local[key], chosen[key] = _local(
                key, value, placements.get(key), world, default)
        unplaced = [key for key, p in chosen.items() if p is None]
        if unplaced:
            raise _unplaced(unplaced, world)
        needs_rows = {}
        for key, placement in chosen.items():
            if (placement.kind != "shard0"
                    or placement.global_shape is not None):
                continue
            if self.local[key].dim() == 0:
                raise errors.InvalidArgument("%s: a 0-dim tensor cannot be "
                                             "shard0" % key)
            needs_rows[key] = self.local[key].shape[0]
        for key, rows in _gather_rows(needs_rows, world, timeout).items():
            shape = (rows,) + tuple(self.local[key].shape[1:])
            chosen[key] = Placement("shard0", shape)
        one_device_type(self.local, "the state dict")
        # The GPUs whose streams must be synchronized before each export.
        self.cuda_devices = cuda_devices(self.local.values())
        for key, tensor in self.local.items():
            self.tensor_descs.append(self._describe(key, tensor, chosen[key]))

    def _describe(self, key, tensor, placement):
        global_shape = placement.global_shape
        return TensorDesc(
            key=key, storage=self._storages.id_of(tensor),
            dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()), offset=tensor.storage_offset(),
            placement=placement.kind,
            global_shape=(tuple(tensor.shape) if global_shape is None
                          else global_shape),
            pieces=placement.pieces)


class _EmptyFile:
    """An empty memfd standing for an empty storage; closed with it."""

    def __init__(self, fd):
        self.fd = fd

    @staticmethod
    def data_ptr():
        return 0

    def __del__(self):
        os.close(self.fd)


def _extent_bytes(shape, stride, itemsize):
    """Bytes from the first element to the end of the last one."""
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, stride))) * itemsize


class _DeviceBytes:
    """nbytes of device memory at ptr as __cuda_array_interface__ sees
    them: what torch.as_tensor wraps without a copy.  The tensor keeps this
    object, and through it keepalive, alive."""

    def __init__(self, ptr, nbytes, keepalive):
        self.keepalive = keepalive
        # The library waited on the daemon's completion event before it
        # returned: no stream needs to wait (stream None).
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 2}


class OwnedTensors:
    """Builds PyTorch tensors over an export's published memory.

    keepalive is attached to every buffer wrapped, so a tensor still in use
    keeps its export from being released by the garbage collector; an
    explicit release still ends the memory, as documented.
    """

    def __init__(self, registration, keepalive):
        self._registration = registration
        self._keepalive = keepalive
        # Tied weights arrive sharing one buffer; wrapping each address once
        # makes their tensors share one PyTorch storage too.
        self._buffers = {}

    def tensor(self, owned):
        dtype = torch_dtype(owned.dtype)
        if owned.identity:
            mine = self._registration.local.get(owned.key)
            if mine is not None and self._same_view(mine, owned, dtype):
                return mine
        itemsize = torch.tensor([], dtype=dtype).element_size()
        nbytes = _extent_bytes(owned.shape, owned.stride, itemsize)
        cuda = owned.device.startswith("cuda:")
        device = (torch.device("cuda", owned.device_index) if cuda
                  else torch.device("cpu"))
        if nbytes == 0:
            return torch.empty(owned.shape, dtype=dtype, device=device)
        flat = self._buffers.get((owned.data, nbytes))
        if flat is None and cuda:
            flat = torch.as_tensor(_DeviceBytes(owned.data, nbytes,
                                                self._keepalive),
                                   device=device)
            self._buffers[(owned.data, nbytes)] = flat
        elif flat is None:
            raw = (ctypes.c_uint8 * nbytes).from_address(owned.data)
            raw.keepalive = self._keepalive
            flat = torch.frombuffer(raw, dtype=torch.uint8)
            self._buffers[(owned.data, nbytes)] = flat
        return torch.as_strided(flat.view(dtype), owned.shape, owned.stride)

    @staticmethod
    def _same_view(mine, owned, dtype):
        # The first element's address from the storage: an empty tensor's
        # data_ptr() is 0, and its offset may lie past the storage's end.
        first = (_untyped_storage(mine).data_ptr()
                 + mine.storage_offset() * mine.element_size())
        return (mine.dtype == dtype and tuple(mine.shape) == owned.shape
                and tuple(mine.stride()) == owned.stride
                and first == owned.data)
