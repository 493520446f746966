"""How a rank holds each key: the explicit placements a caller gives.

A placement is given per key as a string (``"shard0"``, ``"replicated"``,
``"plain"``, ``"expert"``) or as a Placement when the whole tensor's shape
must be stated.  Nothing here imports PyTorch; inferring placements from
DTensors lives in tensors.py.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from . import errors

KINDS = ("shard0", "replicated", "plain", "expert")


@dataclass(frozen=True)
class Placement:
    """kind is one of KINDS.  global_shape is the whole tensor's shape; for
    ``shard0`` without it, the package adds up every rank's rows through
    torch.distributed, and for the other kinds it is the local shape."""
    kind: str
    global_shape: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise errors.UnsupportedLayout(
                "unknown placement %r (expected one of %s)"
                % (self.kind, ", ".join(KINDS)))
        if self.global_shape is not None:
            object.__setattr__(self, "global_shape",
                               tuple(int(d) for d in self.global_shape))


def normalize(key, value):
    """A Placement from what a caller wrote for key."""
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        try:
            return Placement(value)
        except errors.UnsupportedLayout as exc:
            raise errors.UnsupportedLayout("%s: %s" % (key, exc.message)) \
                from None
    raise errors.InvalidArgument(
        "%s: a placement is a string or a shardport.Placement, not %s"
        % (key, type(value).__name__))
