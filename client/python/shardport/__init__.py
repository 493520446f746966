"""shardport for Python: export sharded PyTorch state dicts through the
node's shardportd, or push them into consumers (inference workers) laid
out as each consumer asks.

    import shardport

    with shardport.Client() as c:          # no PyTorch needed
        print(c.status().backend_active)

    with shardport.export_state_dict(model.state_dict(),
                                     placements={...}) as owned:
        torch.save(dict(owned), "whole.pt")   # this rank's whole tensors

The package is ctypes over libshardport (SHARDPORT_LIB overrides where it is
loaded from); PyTorch is imported only when tensors are handled.  See
docs/python.md.
"""

from . import errors
from ._lib import path as library_path
from .client import (Client, ConsumerStatus, JobStatus, NodeStatus,
                     OwnedSet, OwnedTensor, Progress, PushResult, SaveResult,
                     Status, StorageDesc, TargetDesc, TargetPiece, TensorDesc,
                     default_socket)
from .consumer import Consumer, Target
from .errors import ShardportError
from .export import Export, Job, export_state_dict, save_state_dict
from .placements import Piece, Placement

__all__ = [
    "Client", "Consumer", "ConsumerStatus", "Export", "Job", "JobStatus",
    "NodeStatus", "OwnedSet", "OwnedTensor", "Piece", "Placement",
    "Progress", "PushResult", "SaveResult", "ShardportError", "Status",
    "StorageDesc", "Target", "TargetDesc", "TargetPiece", "TensorDesc",
    "default_socket", "errors", "export_state_dict", "library_path",
    "save_state_dict",
]
