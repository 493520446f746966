"""Consumers: an inference worker's side of a push.

A consumer is a process outside the trainer ranks that receives the job's
keys straight into its own tensors, laid out the way its engine keeps them.
It joins the job with the ticket and its index, registers a Target per key
it wants (any subset of the keys), and then receives every push the
trainers make, in a loop:

    consumer = shardport.Consumer.join(ticket, index, consumers)
    consumer.register({
        "mlp.up": shardport.Target.shard(up, dim=0, global_shape=(4096, 1024)),
        "attn.q": shardport.Target.pieces((1024, 1024), [((0, 0), qkv[:256])]),
    })
    while serving:
        consumer.receive()          # every byte of every target in place

The daemon writes a consumer's tensors during receive() only, and nothing
else of its memory.  Registration works as a trainer's (tensors.py): each
storage once, moved into shared memory when it is not there yet, CUDA
memory by its IPC handle.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from . import errors
from .client import Client, TargetDesc, TargetPiece
from .export import join_device, synchronize


def _shape(what, values):
    try:
        shape = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise errors.InvalidArgument("%s must be integers, not %r"
                                     % (what, values)) from None
    if any(v < 0 for v in shape):
        raise errors.InvalidArgument("%s must not be negative: %s"
                                     % (what, shape))
    return shape


@dataclass(frozen=True)
class Target:
    """Where a consumer wants one key, and which part of the whole tensor
    it holds.  Make one with Target.whole, Target.shard or Target.pieces;
    the key's dtype is its tensors' dtype."""
    part: str
    global_shape: Tuple[int, ...]
    tensor: Optional[object] = None
    dim: int = 0
    pieces: Tuple = ()

    @classmethod
    def whole(cls, tensor):
        """tensor receives the whole tensor (its shape is the key's)."""
        return cls("whole", tuple(tensor.shape), tensor=tensor)

    @classmethod
    def shard(cls, tensor, dim, global_shape):
        """tensor receives a slice of the whole tensor along dim: its
        shape is global_shape but in dim.  The consumers holding the key
        as a shard concatenate in index order and tile that dim (tensor
        parallel rows, dim 0, or columns, dim 1; uneven and empty slices
        allowed)."""
        return cls("shard", _shape("a shard's global_shape", global_shape),
                   tensor=tensor, dim=int(dim))

    @classmethod
    def pieces(cls, global_shape, pieces):
        """Boxes of the whole tensor, each (start, view): the box that
        starts at element start of the whole tensor and has view's shape
        lands in view, which may lie anywhere in the consumer's tensors.
        q, k and v of a fused QKV buffer are pieces of three keys, each
        view a slice of the one buffer."""
        boxes = []
        for start, view in pieces:
            boxes.append((_shape("a piece's start", start), view))
        return cls("pieces", _shape("the pieces' global_shape",
                                    global_shape), pieces=tuple(boxes))

    def tensors(self):
        """The tensors the daemon writes for this target."""
        if self.part == "pieces":
            return [view for _, view in self.pieces]
        return [self.tensor]


def _checked(key, tensor, dtype=None):
    """tensor, refused when it cannot be a destination of key (of dtype,
    when given: the key's first view's)."""
    import torch
    if not isinstance(tensor, torch.Tensor):
        raise errors.InvalidArgument("%s: a target's destination is a "
                                     "tensor, not a %s"
                                     % (key, type(tensor).__name__))
    if tensor.device.type not in ("cpu", "cuda"):
        raise errors.InvalidArgument("%s: tensors on %s cannot be "
                                     "registered" % (key, tensor.device))
    if tensor.layout != torch.strided:
        raise errors.UnsupportedLayout("%s: a %s tensor; only strided "
                                       "tensors can be registered"
                                       % (key, tensor.layout))
    if dtype is not None and tensor.dtype != dtype:
        raise errors.DtypeMismatch("%s: a piece's view is %s, the key's "
                                   "first one %s: every view of a target "
                                   "has the key's dtype"
                                   % (key, tensor.dtype, dtype))
    return tensor


class TargetRegistration:
    """A consumer's targets as storages plus target descriptors.  It keeps
    the tensors' storages alive (tensors.Storages)."""

    def __init__(self, targets):
        from .tensors import Storages, cuda_devices, dtype_name, \
            one_device_type
        self._storages = Storages()
        self.storage_descs = self._storages.descs
        self.target_descs = []
        every, dtypes = {}, {}
        for key, target in targets.items():
            if not isinstance(target, Target):
                raise errors.InvalidArgument(
                    "%s: a target is a shardport.Target (Target.whole, "
                    "Target.shard, Target.pieces), not a %s"
                    % (key, type(target).__name__))
            views = target.tensors()
            if not views:
                raise errors.InvalidArgument("%s: a pieces target needs at "
                                             "least one piece" % key)
            dtypes[key] = _checked(key, views[0]).dtype
            for i, view in enumerate(views):
                every["%s[%d]" % (key, i)] = _checked(key, view, dtypes[key])
        # Refused before any storage is moved into shared memory.
        one_device_type(every, "the targets")
        # The GPUs whose streams must be done before the daemon writes.
        self.cuda_devices = cuda_devices(every.values())
        for key, target in targets.items():
            self.target_descs.append(
                self._describe(key, target, dtype_name(dtypes[key])))

    def _view(self, tensor):
        return dict(storage=self._storages.id_of(tensor),
                    stride=tuple(tensor.stride()),
                    offset=tensor.storage_offset())

    def _describe(self, key, target, dtype):
        if target.part == "pieces":
            pieces = tuple(
                TargetPiece(start=start, shape=tuple(view.shape),
                            **self._view(view))
                for start, view in target.pieces)
            return TargetDesc(key=key, dtype=dtype,
                              global_shape=target.global_shape,
                              part="pieces", pieces=pieces)
        return TargetDesc(key=key, dtype=dtype,
                          global_shape=target.global_shape, part=target.part,
                          shape=tuple(target.tensor.shape), dim=target.dim,
                          **self._view(target.tensor))


class Consumer:
    """One consumer of a job: one connection to its node's daemon.  Make it
    with Consumer.join; closing it leaves the job (a push that is running
    then fails on every trainer and consumer with errors.ConsumerLost
    naming this index, and so does every later push until the index joins
    again)."""

    def __init__(self, client, index, consumers, timeout=None):
        self.client = client
        self.index = index
        self.consumers = consumers
        self.timeout = timeout
        self._registration = None

    @classmethod
    def join(cls, ticket, index, consumers, *, socket=None, timeout=None,
             device=None):
        """Joins the job of ticket (the bytes of the trainers' job.ticket)
        as consumer index of its consumers, on the daemon of this node
        (socket as for Client: None finds it), which may be a node no
        trainer is on.  device: where this consumer's tensors are, as for
        Job.create.  timeout bounds each request to the daemon, in seconds
        (None: the library's 30 s)."""
        client = Client(socket, timeout)
        try:
            client.consumer_join(ticket, index, consumers,
                                 join_device(client, device))
        except BaseException:
            client.close()
            raise
        return cls(client, index, consumers, timeout)

    def register(self, targets):
        """Registers where this consumer wants its keys: a mapping of key
        to shardport.Target, any subset of the job's keys; once.  The
        daemon checks each view against its storage at once; whether the
        targets fit the trainers' keys (dtype, shape, a tiling of the
        shards, no byte shared with another consumer's target) is decided
        when the next push is planned, and refuses that push everywhere.
        CPU tensors not yet in shared memory are moved there, as
        Tensor.share_memory_() does."""
        if self._registration is not None:
            raise errors.BadState("this consumer already registered its "
                                  "targets; register once, receive many "
                                  "times")
        registration = TargetRegistration(targets)
        self.client.register_storages(registration.storage_descs)
        self.client.register_targets(registration.target_descs)
        self._registration = registration

    def receive(self, timeout=None):
        """Takes part in the job's next push; returns its
        shardport.PushResult (bytes: those written into this consumer's
        tensors) once every byte of every target is in place (on GPUs with
        the daemon's stream work complete), or raises the push's error,
        the one every trainer and consumer gets.  timeout: seconds to wait
        for the push to start and for its progress (None: the daemon's
        export_timeout).  Do not read the targets while it runs."""
        if self._registration is None:
            raise errors.BadState("register the targets before receiving")
        synchronize(self._registration.cuda_devices)
        return self.client.receive(timeout=timeout)

    def close(self):
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()
