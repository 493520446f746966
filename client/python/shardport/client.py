"""A connection to the node's shardportd, over libshardport.

Nothing here imports PyTorch: the status and ping calls, jobs, registration
of raw storages and views, and exports all work with plain Python values.
The tensor layer (tensors.py, export.py) is built on top of this one.
"""

import ctypes
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Tuple

from . import _lib, errors
from .errors import ShardportError, error_for


@dataclass(frozen=True)
class NodeStatus:
    """One daemon of a job across nodes (sp_node_status)."""
    node: int
    address: str
    self: bool
    connected: bool
    bytes_sent: int
    bytes_received: int
    # Bytes of control frames on the job's control link to it.
    control_sent: int = 0
    control_received: int = 0


@dataclass(frozen=True)
class ConsumerStatus:
    """One consumer of a job as the daemon answering sees it
    (sp_consumer_status).  state is ``absent`` (not joined there),
    ``joined``, ``receiving`` (waiting for or taking part in a push) or
    ``leaving``; node is its node in the job (None when unknown); device as
    it joined (``""`` when absent); bytes_received counts every push."""
    index: int
    state: str
    node: Optional[int]
    device: str
    bytes_received: int


@dataclass(frozen=True)
class JobStatus:
    """One job as the daemon reports it (sp_job_status)."""
    job_id: str
    phase: str
    error: Optional[str]
    world: int
    joined: int
    round: int
    rounds: int
    bytes_moved: int
    bytes_total: int
    rate_bps: float
    plan_digest: Optional[str] = None
    node: int = 0
    nodes: Tuple[NodeStatus, ...] = ()
    # A save (phase "writing"): the tensor bytes this daemon's ranks
    # wrote to their files, and will write.
    bytes_written: int = 0
    bytes_to_write: int = 0
    # Exports across nodes that reused the previous plan (root's digest).
    plans_reused: int = 0
    # A job with consumers: each of them by index, the pushes finished
    # (delivered or failed) and the plans built for them (a push that
    # reused the previous plan adds none).
    # Ranks waiting in the next export or push.
    asked: int = 0
    consumers: Tuple[ConsumerStatus, ...] = ()
    pushes: int = 0
    push_plans: int = 0


@dataclass(frozen=True)
class Status:
    """A snapshot of the daemon (sp_status_info)."""
    daemon_version: str
    protocol_version: int
    backends_built: Tuple[str, ...]
    backend_active: str
    backend_reason: str
    uptime_s: float
    clients: int
    pool_used: int
    pool_capacity: int
    jobs: Tuple[JobStatus, ...]
    peer_address: Optional[str] = None
    # The longest one iteration of the daemon's event loop was busy since
    # the previous status request, in microseconds.
    loop_max_busy_us: int = 0


@dataclass(frozen=True)
class StorageDesc:
    """A storage and the caller's own address of its first byte.

    kind ``memfd``: bytes [offset, offset + length) of the memfd or shm
    file fd.  On GPUs (include/shardport.h, sp_storage_kind): ``cuda``, the
    device memory at addr (the library finds its IPC handle); ``cuda_ipc``,
    handle (a cudaIpcMemHandle_t of the allocation's base, or PyTorch's
    _share_cuda_() bytes) and offset from that base; ``cuda_fd``, a cuMem
    allocation's POSIX descriptor fd and the offset into it.  device is
    ``cuda:<GPU UUID>`` or None (the library asks the CUDA runtime)."""
    id: int
    fd: int
    offset: int
    length: int
    addr: int
    kind: str = "memfd"
    handle: Optional[bytes] = None
    device: Optional[str] = None


@dataclass(frozen=True)
class TensorDesc:
    """A view into a registered storage and how this rank holds the key.
    shape, stride and offset are in elements; placement is one of
    ``shard0``, ``replicated``, ``plain``, ``expert``, ``affine``; pieces
    are an affine placement's shardport.Piece objects."""
    key: str
    storage: int
    dtype: str
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    placement: str
    global_shape: Tuple[int, ...]
    pieces: Tuple = ()


@dataclass(frozen=True)
class Progress:
    """Where an export stands (sp_progress).  In a save, phase "writing"
    counts the bytes this rank wrote to its files, and will write."""
    phase: str
    round: int
    rounds: int
    bytes_moved: int
    bytes_total: int
    bytes_written: int = 0
    bytes_to_write: int = 0


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote (sp_save_result): this rank's files and tensor
    bytes, the whole checkpoint's, the seconds it took, and whether this
    rank wrote the index."""
    files: int
    total_files: int
    bytes: int
    total_bytes: int
    seconds: float
    wrote_index: bool


@dataclass(frozen=True)
class TargetPiece:
    """A box of the whole tensor a consumer wants (sp_target_piece): its
    first element start and extent shape in the whole tensor, and the view
    it lands at in the consumer's storage (stride and offset in elements
    of the key's dtype)."""
    start: Tuple[int, ...]
    shape: Tuple[int, ...]
    storage: int
    stride: Tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class TargetDesc:
    """Where a consumer wants one key (sp_target_desc).  part is
    ``whole`` (the view holds the whole tensor), ``shard`` (the view holds
    a slice along dim: the consumers holding the key as a shard tile that
    dim in index order) or ``pieces`` (boxes, each a TargetPiece with its
    own view).  dtype and global_shape must be the trainers'."""
    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    part: str
    storage: int = 0
    shape: Tuple[int, ...] = ()
    stride: Tuple[int, ...] = ()
    offset: int = 0
    dim: int = 0
    pieces: Tuple[TargetPiece, ...] = ()


@dataclass(frozen=True)
class PushResult:
    """What one push did (sp_push_result): the job's push number (from
    1); on a trainer the bytes this rank sent, on a consumer the bytes
    written into its buffers; and whether the previous push's plan was
    reused (no registration changed since)."""
    push_id: int
    bytes: int
    plan_reused: bool


@dataclass(frozen=True)
class OwnedTensor:
    """A whole tensor this rank owns after an export.  data is the address
    of its first element, valid until the export is released; identity says
    it points into one of this rank's own registered storages.  device is
    ``cpu`` or ``cuda:<GPU UUID>`` (then data is a device address, on this
    process's CUDA device device_index)."""
    key: str
    dtype: str
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    data: int
    identity: bool
    device: str = "cpu"
    device_index: int = -1


_STORAGE_KINDS = {
    "memfd": _lib.SP_STORAGE_MEMFD,
    "cuda": _lib.SP_STORAGE_CUDA,
    "cuda_ipc": _lib.SP_STORAGE_CUDA_IPC,
    "cuda_fd": _lib.SP_STORAGE_CUDA_FD,
}

_TARGET_PARTS = {
    "whole": _lib.SP_TARGET_WHOLE,
    "shard": _lib.SP_TARGET_SHARD,
    "pieces": _lib.SP_TARGET_PIECES,
}

_PLACEMENTS = {
    "shard0": _lib.SP_PLACEMENT_SHARD0,
    "replicated": _lib.SP_PLACEMENT_REPLICATED,
    "plain": _lib.SP_PLACEMENT_PLAIN,
    "expert": _lib.SP_PLACEMENT_EXPERT,
    "affine": _lib.SP_PLACEMENT_AFFINE,
}


# The longest explanation of a failed connection (sp_connect_explain).
_WHY_MAX = 2048


def default_socket():
    """(path, origin): the socket a Client without socket= connects to, and
    where that path comes from ($SHARDPORT_SOCKET, this user's own daemon,
    the system socket), as include/shardport.h's sp_default_socket_origin
    says."""
    buf = ctypes.create_string_buffer(4096)
    origin = ctypes.c_char_p()
    rc = _lib.fn.sp_default_socket_origin(buf, len(buf), ctypes.byref(origin))
    if rc < 0:
        raise error_for(rc)
    return buf.value.decode(), (origin.value or b"").decode()


def _text(raw):
    return None if raw is None else raw.decode("utf-8", "replace")


def _c_string(value, what):
    """value as the C library takes a string: a str without NUL characters
    (which C would cut the string at), in UTF-8; a save's metadata is
    strings only, as safetensors' is."""
    if not isinstance(value, str):
        raise TypeError("save: %s is of type %s, not a str" % (
            what, type(value).__name__))
    if "\0" in value:
        raise ValueError("save: %s holds a NUL character" % what)
    return value.encode("utf-8")


def _dims(values, what, key):
    if len(values) > _lib.SP_MAX_DIMS:
        raise errors.InvalidArgument(
            "%s: %d dims in %s, at most %d are supported"
            % (key, len(values), what, _lib.SP_MAX_DIMS))
    return (ctypes.c_int64 * _lib.SP_MAX_DIMS)(*values)


def _push_result(out):
    return PushResult(push_id=out.push_id, bytes=out.bytes,
                      plan_reused=bool(out.plan_reused))


class OwnedSet:
    """The tensors one export published to this rank.

    Release it with Client.release (or through the tensor layer's Export);
    until then the memory behind every non-identity tensor stays mapped.
    """

    def __init__(self, pointer):
        self._pointer = pointer
        contents = pointer.contents
        self.export_id = contents.export_id
        self.tensors = tuple(
            OwnedTensor(
                key=t.key.decode(),
                dtype=t.dtype.decode(),
                shape=tuple(t.shape[:t.ndim]),
                stride=tuple(t.stride[:t.ndim]),
                data=t.data or 0,
                identity=bool(t.identity),
                device=_text(t.device) or "cpu",
                device_index=t.device_index)
            for t in contents.tensors[:contents.ntensors])

    @property
    def released(self):
        return self._pointer is None


class Client:
    """One connection to shardportd.

    socket is the daemon's socket path (None: $SHARDPORT_SOCKET, then the
    default path).  timeout is how long each request may take, in seconds
    (None keeps the library's 30 s; 0 waits forever).  A Client serves one
    thread at a time.  Use it as a context manager or call close().
    """

    def __init__(self, socket: Optional[str] = None,
                 timeout: Optional[float] = None):
        self._handle = None
        handle = ctypes.c_void_p()
        path = None if socket is None else socket.encode()
        # The library's sentence names the path tried (and where a default
        # came from), what went wrong and what to do about it.
        why = ctypes.create_string_buffer(_WHY_MAX)
        rc = _lib.fn.sp_connect_explain(path, ctypes.byref(handle), why,
                                        len(why))
        if rc < 0:
            raise error_for(rc, why.value.decode("utf-8", "replace") or None)
        self._handle = handle
        if timeout is not None:
            self.set_timeout(timeout)

    def close(self):
        """Closes the connection; a job it joined is left, and the tensors
        of every export not yet released are unmapped."""
        if self._handle is not None:
            _lib.fn.sp_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()

    def __del__(self):
        self.close()

    def _live(self):
        if self._handle is None:
            raise errors.Closed("this Client is closed")
        return self._handle

    def _check(self, rc):
        """Turns a negative return code into its exception, with the
        daemon's own text when it sent one."""
        if rc < 0:
            raise error_for(rc, _lib.fn.sp_last_message(self._live()).decode(
                "utf-8", "replace"))
        return rc

    def set_timeout(self, seconds: float):
        self._check(_lib.fn.sp_set_timeout(self._live(),
                                           int(round(seconds * 1000))))

    def ping(self) -> float:
        """A round trip to the daemon; returns its duration in seconds."""
        rtt_ns = ctypes.c_uint64()
        self._check(_lib.fn.sp_ping(self._live(), ctypes.byref(rtt_ns)))
        return rtt_ns.value / 1e9

    def status(self) -> Status:
        info = ctypes.POINTER(_lib.sp_status_info)()
        self._check(_lib.fn.sp_status(self._live(), ctypes.byref(info)))
        try:
            s = info.contents
            jobs = tuple(
                JobStatus(job_id=_text(j.job_id), phase=_text(j.phase),
                          error=_text(j.error), world=j.world,
                          joined=j.joined, round=j.round, rounds=j.rounds,
                          bytes_moved=j.bytes_moved,
                          bytes_total=j.bytes_total, rate_bps=j.rate_bps,
                          plan_digest=_text(j.plan_digest), node=j.node,
                          bytes_written=j.bytes_written,
                          bytes_to_write=j.bytes_to_write,
                          plans_reused=j.plans_reused,
                          consumers=tuple(
                              ConsumerStatus(
                                  index=c.index, state=_text(c.state),
                                  node=None if c.node < 0 else c.node,
                                  device=_text(c.device) or "",
                                  bytes_received=c.bytes_received)
                              for c in j.consumers[:j.nconsumers]),
                          asked=j.asked, pushes=j.pushes,
                          push_plans=j.push_plans,
                          nodes=tuple(
                              NodeStatus(node=n.node,
                                         address=_text(n.address),
                                         self=bool(n.self),
                                         connected=bool(n.connected),
                                         bytes_sent=n.bytes_sent,
                                         bytes_received=n.bytes_received,
                                         control_sent=n.control_sent,
                                         control_received=(
                                             n.control_received))
                              for n in j.nodes[:j.nnodes]))
                for j in s.jobs[:s.njobs])
            built = _text(s.backends_built) or ""
            return Status(
                daemon_version=_text(s.daemon_version),
                protocol_version=s.protocol_version,
                backends_built=tuple(b for b in built.split(",") if b),
                backend_active=_text(s.backend_active),
                backend_reason=_text(s.backend_reason),
                uptime_s=s.uptime_s, clients=s.clients,
                pool_used=s.pool_used, pool_capacity=s.pool_capacity,
                jobs=jobs, peer_address=_text(s.peer_address),
                loop_max_busy_us=s.loop_max_busy_us)
        finally:
            _lib.fn.sp_status_free(info)

    # ---- jobs (docs/protocol.md, "Jobs") ----

    def create_job(self, world: int, consumers: int = 0) -> bytes:
        """Creates a job of world ranks and, when consumers is not 0, that
        many consumers (at most 4096); returns its ticket, opaque bytes
        that the trainers and consumers hand to each other by their own
        means."""
        ticket = _lib.sp_ticket()
        if consumers:
            self._check(_lib.fn.sp_job_create_with_consumers(
                self._live(), world, consumers, ctypes.byref(ticket)))
        else:
            self._check(_lib.fn.sp_job_create(self._live(), world,
                                              ctypes.byref(ticket)))
        return bytes(ticket.bytes[:ticket.len])

    @staticmethod
    def _ticket(ticket):
        if len(ticket) > _lib.SP_TICKET_MAX:
            raise errors.BadTicket("a ticket is at most %d bytes, this one "
                                   "has %d" % (_lib.SP_TICKET_MAX,
                                               len(ticket)))
        raw = _lib.sp_ticket(len=len(ticket))
        ctypes.memmove(raw.bytes, ticket, len(ticket))
        return raw

    def join(self, ticket: bytes, rank: int, world: int,
             device: str = "cpu"):
        """Joins this connection to the job as rank.  device is ``cpu`` for
        host storages or ``cuda:<GPU UUID>``."""
        raw = self._ticket(ticket)
        self._check(_lib.fn.sp_job_join(self._live(), ctypes.byref(raw),
                                        rank, world, device.encode()))

    def consumer_join(self, ticket: bytes, index: int, consumers: int,
                      device: str = "cpu"):
        """Joins this connection to the job as consumer index of its
        consumers, on this node's daemon (which may serve no trainer of
        the job).  device as for join."""
        raw = self._ticket(ticket)
        self._check(_lib.fn.sp_consumer_join(self._live(), ctypes.byref(raw),
                                             index, consumers,
                                             device.encode()))

    def leave(self):
        """Leaves the job: releases every export and registration."""
        self._check(_lib.fn.sp_job_leave(self._live()))

    def cuda_device_name(self, ordinal: int) -> str:
        """``cuda:<GPU UUID>`` of this process's CUDA device ordinal: the
        device join takes for a rank on that GPU."""
        buf = ctypes.create_string_buffer(64)
        self._check(_lib.fn.sp_cuda_device_name(self._live(), ordinal, buf,
                                                len(buf)))
        return buf.value.decode()

    def register_storages(self, storages: Sequence[StorageDesc]):
        array = (_lib.sp_storage_desc * len(storages))()
        # The handle bytes and device names must outlive the call.
        keep = []
        for slot, s in zip(array, storages):
            if s.kind not in _STORAGE_KINDS:
                raise errors.InvalidArgument(
                    "storage %d: unknown kind %r (expected one of %s)"
                    % (s.id, s.kind, ", ".join(_STORAGE_KINDS)))
            slot.id = s.id
            slot.fd = s.fd
            slot.offset = s.offset
            slot.length = s.length
            slot.addr = s.addr or None
            slot.kind = _STORAGE_KINDS[s.kind]
            if s.handle is not None:
                handle = ctypes.create_string_buffer(bytes(s.handle),
                                                     len(s.handle))
                keep.append(handle)
                slot.handle = ctypes.cast(handle, ctypes.c_void_p)
                slot.handle_len = len(s.handle)
            if s.device is not None:
                device = s.device.encode()
                keep.append(device)
                slot.device = device
        self._check(_lib.fn.sp_register_storages(self._live(), array,
                                                 len(storages)))

    @staticmethod
    def _pieces(t, keep):
        """t's pieces as an sp_piece array; keep holds what it points to."""
        array = (_lib.sp_piece * len(t.pieces))()
        for slot, p in zip(array, t.pieces):
            holders = (ctypes.c_uint32 * len(p.holders))(*p.holders)
            keep.append(holders)
            slot.ndim = len(p.shape)
            slot.shape = _dims(p.shape, "a piece's shape", t.key)
            slot.src_offset = p.src_offset
            slot.src_stride = _dims(p.src_stride, "a piece's src_stride",
                                    t.key)
            slot.dst_offset = p.dst_offset
            slot.dst_stride = _dims(p.dst_stride, "a piece's dst_stride",
                                    t.key)
            slot.nholders = len(p.holders)
            slot.holders = holders
        keep.append(array)
        return array

    def register_tensors(self, tensors: Sequence[TensorDesc]):
        array = (_lib.sp_tensor_desc * len(tensors))()
        # The pieces and their holders must outlive the call.
        keep = []
        for slot, t in zip(array, tensors):
            if t.placement not in _PLACEMENTS:
                raise errors.UnsupportedLayout(
                    "%s: unknown placement %r (expected one of %s)"
                    % (t.key, t.placement, ", ".join(_PLACEMENTS)))
            if "\0" in t.key:
                # C would cut the key at it, and register another name.
                raise errors.InvalidArgument(
                    "%r: a key cannot hold a NUL character" % (t.key,))
            slot.key = t.key.encode()
            slot.storage = t.storage
            slot.dtype = t.dtype.encode()
            slot.ndim = len(t.shape)
            slot.shape = _dims(t.shape, "its shape", t.key)
            slot.stride = _dims(t.stride, "its stride", t.key)
            slot.offset = t.offset
            slot.placement = _PLACEMENTS[t.placement]
            slot.global_ndim = len(t.global_shape)
            slot.global_shape = _dims(t.global_shape, "its global shape",
                                      t.key)
            if t.pieces:
                slot.npieces = len(t.pieces)
                slot.pieces = self._pieces(t, keep)
        self._check(_lib.fn.sp_register_tensors(self._live(), array,
                                                len(tensors)))

    @staticmethod
    def _target_pieces(t):
        """t's pieces as an sp_target_piece array."""
        array = (_lib.sp_target_piece * len(t.pieces))()
        for slot, p in zip(array, t.pieces):
            if not len(p.start) == len(p.shape) == len(p.stride) == len(
                    t.global_shape):
                raise errors.InvalidArgument(
                    "%s: a piece's start, shape and stride need one entry "
                    "per dim of the key's %d" % (t.key, len(t.global_shape)))
            slot.start = _dims(p.start, "a piece's start", t.key)
            slot.shape = _dims(p.shape, "a piece's shape", t.key)
            slot.storage = p.storage
            slot.stride = _dims(p.stride, "a piece's stride", t.key)
            slot.offset = p.offset
        return array

    def register_targets(self, targets: Sequence[TargetDesc]):
        """Registers where this consumer wants its keys (its storages
        first, with register_storages)."""
        array = (_lib.sp_target_desc * len(targets))()
        # The keys, dtypes and pieces must outlive the call.
        keep = []
        for slot, t in zip(array, targets):
            if t.part not in _TARGET_PARTS:
                raise errors.InvalidArgument(
                    "%s: unknown part %r (expected one of %s)"
                    % (t.key, t.part, ", ".join(_TARGET_PARTS)))
            if "\0" in t.key:
                raise errors.InvalidArgument(
                    "%r: a key cannot hold a NUL character" % (t.key,))
            key, dtype = t.key.encode(), t.dtype.encode()
            keep.extend([key, dtype])
            slot.key, slot.dtype = key, dtype
            slot.ndim = len(t.global_shape)
            slot.global_shape = _dims(t.global_shape, "its global shape",
                                      t.key)
            slot.part = _TARGET_PARTS[t.part]
            slot.storage = t.storage
            slot.shape = _dims(t.shape, "its shape", t.key)
            slot.stride = _dims(t.stride, "its stride", t.key)
            slot.offset = t.offset
            slot.dim = t.dim
            if t.pieces:
                pieces = self._target_pieces(t)
                keep.append(pieces)
                slot.npieces, slot.pieces = len(t.pieces), pieces
        self._check(_lib.fn.sp_register_targets(self._live(), array,
                                                len(targets)))

    @staticmethod
    def _timeout_ms(timeout):
        return 0 if timeout is None else int(round(timeout * 1000))

    def push(self, max_keys: int = 0, max_bytes: int = 0,
             timeout: Optional[float] = None) -> PushResult:
        """Pushes the trainers' current weights into every consumer (a
        collective over the job's ranks, every one with the same max_keys
        and max_bytes); returns once every consumer's bytes are in place.
        max_keys and max_bytes bound a round (0: the defaults); timeout is
        how long the daemon waits for the ranks and consumers, and for
        progress, in seconds (None: its export_timeout)."""
        opts = _lib.sp_push_opts(max_keys=max_keys, max_bytes=max_bytes,
                                 timeout_ms=self._timeout_ms(timeout))
        out = _lib.sp_push_result()
        self._check(_lib.fn.sp_push(self._live(), ctypes.byref(opts),
                                    ctypes.byref(out)))
        return _push_result(out)

    def receive(self, timeout: Optional[float] = None) -> PushResult:
        """Takes part in the job's next push as a consumer; returns once
        every byte this consumer asked for is in its buffers.  timeout as
        for push."""
        out = _lib.sp_push_result()
        self._check(_lib.fn.sp_receive(self._live(),
                                       self._timeout_ms(timeout),
                                       ctypes.byref(out)))
        return _push_result(out)

    def _export_opts(self, groups, max_keys, max_bytes, timeout, progress,
                     raised, keep):
        """sp_export_opts for groups and the rest; keep holds what the
        struct points to while the call runs."""
        group_keys = [(ctypes.c_char_p * len(g))(*(k.encode() for k in g))
                      for g in groups]
        group_array = (_lib.sp_group * len(group_keys))(*(
            _lib.sp_group(nkeys=len(keys), keys=keys) for keys in group_keys))
        keep.extend([group_keys, group_array])
        opts = _lib.sp_export_opts(
            ngroups=len(group_keys), groups=group_array,
            max_keys=max_keys, max_bytes=max_bytes,
            timeout_ms=self._timeout_ms(timeout))
        if progress is not None:
            def report(p, _arg):
                # ctypes cannot carry an exception through C; keep the first
                # one and stop calling the callback.
                if raised:
                    return
                c = p.contents
                try:
                    progress(Progress(phase=_text(c.phase), round=c.round,
                                      rounds=c.rounds,
                                      bytes_moved=c.bytes_moved,
                                      bytes_total=c.bytes_total,
                                      bytes_written=c.bytes_written,
                                      bytes_to_write=c.bytes_to_write))
                except BaseException as exc:  # re-raised after the call
                    raised.append(exc)
            opts.progress = _lib.sp_progress_fn(report)
            keep.append(opts.progress)
        return opts

    def save(self, path, max_shard_bytes: int = 5 * 2**30,
             metadata: Optional[Mapping] = None, overwrite: bool = False,
             groups: Sequence[Sequence[str]] = (), max_keys: int = 0,
             max_bytes: int = 0, timeout: Optional[float] = None,
             progress: Optional[Callable[[Progress], None]] = None
             ) -> SaveResult:
        """Saves the job's tensors as a Hugging Face checkpoint in path
        (sp_save): a collective, every rank with the same path and
        options.  metadata: strings every file's __metadata__ holds besides
        {"format": "pt"}; overwrite: replace a checkpoint already there
        (else errors.CheckpointExists).  The rest as for export."""
        raised, keep = [], []
        opts = _lib.sp_save_opts(
            max_shard_bytes=max_shard_bytes, overwrite=1 if overwrite else 0,
            export_opts=self._export_opts(groups, max_keys, max_bytes,
                                          timeout, progress, raised, keep))
        entries = [(_c_string(k, "a metadata key"),
                    _c_string(v, "the metadata value of %r" % (k,)))
                   for k, v in (metadata or {}).items()]
        where = os.fsencode(path)
        if b"\0" in where:
            raise ValueError("save: the path %r holds a NUL character"
                             % (path,))
        if entries:
            array = (_lib.sp_metadata * len(entries))(*(
                _lib.sp_metadata(key=k, value=v) for k, v in entries))
            keep.append(array)
            opts.nmetadata, opts.metadata = len(entries), array
        result = _lib.sp_save_result()
        rc = _lib.fn.sp_save(self._live(), where,
                             ctypes.byref(opts), ctypes.byref(result))
        if raised:
            raise raised[0]
        self._check(rc)
        return SaveResult(files=result.files, total_files=result.total_files,
                          bytes=result.bytes, total_bytes=result.total_bytes,
                          seconds=result.seconds,
                          wrote_index=bool(result.wrote_index))

    def export(self, groups: Sequence[Sequence[str]] = (),
               max_keys: int = 0, max_bytes: int = 0,
               timeout: Optional[float] = None,
               progress: Optional[Callable[[Progress], None]] = None
               ) -> OwnedSet:
        """Runs one export of the job and returns what this rank owns.

        groups are together-groups (keys that must end on one owner);
        max_keys and max_bytes bound a round (0: the defaults); timeout is
        how long the daemon waits for the other ranks and for progress, in
        seconds (None: the daemon's default).  progress is called from
        inside this call with a Progress; an exception it raises ends the
        export with that exception once the export returns, after the
        published tensors are released.
        """
        handle = self._live()
        raised, keep = [], []
        opts = self._export_opts(groups, max_keys, max_bytes, timeout,
                                 progress, raised, keep)
        out = ctypes.POINTER(_lib.sp_owned_set)()
        rc = _lib.fn.sp_export(handle, ctypes.byref(opts), ctypes.byref(out))
        if raised:
            if rc >= 0:
                _lib.fn.sp_release(handle, out)
            raise raised[0]
        self._check(rc)
        return OwnedSet(out)

    def release(self, owned: OwnedSet):
        """Unmaps an export's tensors and lets the daemon free them.  A
        second release of the same set does nothing."""
        if owned.released:
            return
        pointer, owned._pointer = owned._pointer, None
        if self._handle is None:
            # close() already unmapped the set and the daemon released it;
            # sp_release only frees a detached set and never uses the client.
            _lib.fn.sp_release(None, pointer)
            return
        self._check(_lib.fn.sp_release(self._handle, pointer))


__all__ = ["Client", "default_socket", "Status", "JobStatus",
           "ConsumerStatus", "StorageDesc", "TensorDesc", "TargetDesc",
           "TargetPiece", "Progress", "PushResult", "SaveResult", "OwnedSet",
           "OwnedTensor", "ShardportError"]
