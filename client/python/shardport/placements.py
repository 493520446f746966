"""How a rank holds each key: the explicit placements a caller gives.

A placement is given per key as a string (``"shard0"``, ``"replicated"``,
``"plain"``, ``"expert"``) or as a Placement when the whole tensor's shape
must be stated, or its pieces (``"affine"``).  Nothing here imports
PyTorch; inferring placements from DTensors lives in tensors.py.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from . import errors
from ._lib import SP_MAX_DIMS

KINDS = ("shard0", "replicated", "plain", "expert", "affine")


def _ints(what, values, *, ndim=None):
    """values as a tuple of non-negative ints, ndim of them when given."""
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise errors.InvalidArgument("%s must be integers, not %r"
                                     % (what, values)) from None
    if any(v < 0 for v in out):
        raise errors.InvalidArgument("%s must not be negative: %s"
                                     % (what, out))
    if ndim is not None and len(out) != ndim:
        raise errors.InvalidArgument("%s has %d dims, the piece's shape %d"
                                     % (what, len(out), ndim))
    return out


@dataclass(frozen=True)
class Piece:
    """A box of elements of an ``affine`` placement (include/shardport.h,
    sp_piece): its shape; where it is read from this rank's tensor taken
    row-major (src_offset and src_stride, in elements); where it goes in the
    whole tensor taken row-major (dst_offset and dst_stride); and the ranks
    holding this very box, this one included (more than one: replicas,
    which the daemon compares).  The daemon checks every piece: a zero
    stride, a box that reaches an element twice or outside either tensor,
    and elements of the whole tensor that no rank holds are refused."""
    shape: Tuple[int, ...]
    src_offset: int
    src_stride: Tuple[int, ...]
    dst_offset: int
    dst_stride: Tuple[int, ...]
    holders: Tuple[int, ...]

    def __post_init__(self):
        shape = _ints("a piece's shape", self.shape)
        if len(shape) > SP_MAX_DIMS:
            raise errors.InvalidArgument("a piece has %d dims, at most %d"
                                         % (len(shape), SP_MAX_DIMS))
        fields = {
            "shape": shape,
            "src_offset": _ints("src_offset", [self.src_offset])[0],
            "dst_offset": _ints("dst_offset", [self.dst_offset])[0],
            "src_stride": _ints("src_stride", self.src_stride,
                                ndim=len(shape)),
            "dst_stride": _ints("dst_stride", self.dst_stride,
                                ndim=len(shape)),
            "holders": _ints("holders", self.holders),
        }
        if not fields["holders"]:
            raise errors.InvalidArgument("a piece needs its holders: the "
                                         "ranks holding it, this one too")
        for name, value in fields.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class Placement:
    """kind is one of KINDS.  global_shape is the whole tensor's shape; for
    ``shard0`` without it, the package adds up every rank's rows through
    torch.distributed, and for the other kinds but ``affine`` it is the
    local shape.  pieces: an ``affine`` placement's Pieces (none when this
    rank holds nothing of the key)."""
    kind: str
    global_shape: Optional[Tuple[int, ...]] = None
    pieces: Tuple[Piece, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise errors.UnsupportedLayout(
                "unknown placement %r (expected one of %s)"
                % (self.kind, ", ".join(KINDS)))
        if self.global_shape is not None:
            object.__setattr__(self, "global_shape",
                               tuple(int(d) for d in self.global_shape))
        pieces = tuple(self.pieces)
        if self.kind != "affine" and pieces:
            raise errors.InvalidArgument("pieces belong to an affine "
                                         "placement, not to %s" % self.kind)
        if self.kind == "affine" and self.global_shape is None:
            raise errors.InvalidArgument("an affine placement needs the "
                                         "whole tensor's global_shape")
        if not all(isinstance(p, Piece) for p in pieces):
            raise errors.InvalidArgument("an affine placement's pieces are "
                                         "shardport.Piece objects")
        object.__setattr__(self, "pieces", pieces)


def normalize(key, value):
    """A Placement from what a caller wrote for key."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        try:
            return Placement(value)
        except errors.ShardportError as exc:
            raise type(exc)("%s: %s" % (key, exc.message)) from None
    raise errors.InvalidArgument(
        "%s: a placement is a string or a shardport.Placement, not %s"
        % (key, type(value).__name__))
