"""shardport for Python: export sharded PyTorch state dicts through the
node's shardportd.

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
from .client import (Client, JobStatus, NodeStatus, OwnedSet, OwnedTensor,
                     Progress, SaveResult, Status, StorageDesc, TensorDesc,
                     default_socket)
from .errors import ShardportError
from .export import Export, Job, export_state_dict, save_state_dict
from .placements import Piece, Placement

__all__ = [
    "Client", "Export", "Job", "JobStatus", "NodeStatus", "OwnedSet",
    "OwnedTensor",
    "Piece", "Placement", "Progress", "SaveResult", "ShardportError",
    "Status", "StorageDesc", "TensorDesc", "default_socket", "errors",
    "export_state_dict", "library_path", "save_state_dict",
]
