"""Loading libshardport and mirroring include/shardport.h with ctypes.

Every structure here repeats its C definition field for field and in order;
a change to include/shardport.h must be made here too.  Nothing in this module
imports PyTorch.
"""

import ctypes
import os

SP_MAX_DIMS = 8
SP_TICKET_MAX = 512

# The soname the library is installed under (client/meson.build: soversion 0).
_SONAME = "libshardport.so.0"


def _build_tree_path():
    """The library of the build tree this package was copied into.

    client/python/meson.build copies the package to
    <build>/client/python/shardport, two directories below the library at
    <build>/client/libshardport.so.0.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(os.path.dirname(here)), _SONAME)


def _load():
    """Returns (CDLL, path).

    SHARDPORT_LIB wins.  A package inside a build tree then uses that tree's
    library, so a developer never runs a build's Python against an older
    installed library; an installed package uses the installed soname, found
    the way the dynamic linker finds any library.
    """
    override = os.environ.get("SHARDPORT_LIB")
    if override:
        return ctypes.CDLL(override), override
    local = _build_tree_path()
    if os.path.exists(local):
        return ctypes.CDLL(local), local
    try:
        return ctypes.CDLL(_SONAME), _SONAME
    except OSError as exc:
        raise ImportError(
            "shardport: cannot load %s (%s); install libshardport or set "
            "SHARDPORT_LIB to the library's path" % (_SONAME, exc)) from None


lib, path = _load()


class sp_node_status(ctypes.Structure):
    _fields_ = [
        ("node", ctypes.c_uint32),
        ("address", ctypes.c_char_p),
        ("self", ctypes.c_int),
        ("connected", ctypes.c_int),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("control_sent", ctypes.c_uint64),
        ("control_received", ctypes.c_uint64),
    ]


class sp_consumer_status(ctypes.Structure):
    _fields_ = [
        ("index", ctypes.c_uint32),
        ("state", ctypes.c_char_p),
        ("node", ctypes.c_int64),
        ("device", ctypes.c_char_p),
        ("bytes_received", ctypes.c_uint64),
    ]


class sp_job_status(ctypes.Structure):
    _fields_ = [
        ("job_id", ctypes.c_char_p),
        ("phase", ctypes.c_char_p),
        ("error", ctypes.c_char_p),
        ("world", ctypes.c_uint32),
        ("joined", ctypes.c_uint32),
        ("round", ctypes.c_uint32),
        ("rounds", ctypes.c_uint32),
        ("bytes_moved", ctypes.c_uint64),
        ("bytes_total", ctypes.c_uint64),
        ("rate_bps", ctypes.c_double),
        ("plan_digest", ctypes.c_char_p),
        ("node", ctypes.c_uint32),
        ("nnodes", ctypes.c_size_t),
        ("nodes", ctypes.POINTER(sp_node_status)),
        ("asked", ctypes.c_uint32),
        ("export_id", ctypes.c_uint64),
        ("bytes_prepared", ctypes.c_uint64),
        ("bytes_to_prepare", ctypes.c_uint64),
        ("bytes_written", ctypes.c_uint64),
        ("bytes_to_write", ctypes.c_uint64),
        ("plans_reused", ctypes.c_uint64),
        ("nconsumers", ctypes.c_uint32),
        ("consumers", ctypes.POINTER(sp_consumer_status)),
        ("pushes", ctypes.c_uint64),
        ("push_plans", ctypes.c_uint64),
    ]


class sp_status_info(ctypes.Structure):
    _fields_ = [
        ("daemon_version", ctypes.c_char_p),
        ("protocol_version", ctypes.c_uint32),
        ("backends_built", ctypes.c_char_p),
        ("backend_active", ctypes.c_char_p),
        ("backend_reason", ctypes.c_char_p),
        ("uptime_s", ctypes.c_double),
        ("clients", ctypes.c_uint32),
        ("pool_used", ctypes.c_uint64),
        ("pool_capacity", ctypes.c_uint64),
        ("njobs", ctypes.c_size_t),
        ("jobs", ctypes.POINTER(sp_job_status)),
        ("peer_address", ctypes.c_char_p),
        ("draining", ctypes.c_int),
        ("loop_max_busy_us", ctypes.c_uint64),
    ]


class sp_ticket(ctypes.Structure):
    _fields_ = [
        ("len", ctypes.c_size_t),
        ("bytes", ctypes.c_uint8 * SP_TICKET_MAX),
    ]


class sp_storage_desc(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("fd", ctypes.c_int),
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("addr", ctypes.c_void_p),
        ("kind", ctypes.c_int),
        ("handle", ctypes.c_void_p),
        ("handle_len", ctypes.c_size_t),
        ("device", ctypes.c_char_p),
    ]


# enum sp_storage_kind
SP_STORAGE_MEMFD = 0
SP_STORAGE_CUDA = 1
SP_STORAGE_CUDA_IPC = 2
SP_STORAGE_CUDA_FD = 3

# enum sp_placement
SP_PLACEMENT_SHARD0 = 1
SP_PLACEMENT_REPLICATED = 2
SP_PLACEMENT_PLAIN = 3
SP_PLACEMENT_EXPERT = 4
SP_PLACEMENT_AFFINE = 5

_Dims = ctypes.c_int64 * SP_MAX_DIMS


class sp_piece(ctypes.Structure):
    _fields_ = [
        ("ndim", ctypes.c_uint32),
        ("shape", _Dims),
        ("src_offset", ctypes.c_int64),
        ("src_stride", _Dims),
        ("dst_offset", ctypes.c_int64),
        ("dst_stride", _Dims),
        ("nholders", ctypes.c_uint32),
        ("holders", ctypes.POINTER(ctypes.c_uint32)),
    ]


class sp_tensor_desc(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("storage", ctypes.c_uint32),
        ("dtype", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("shape", _Dims),
        ("stride", _Dims),
        ("offset", ctypes.c_int64),
        ("placement", ctypes.c_int),
        ("global_ndim", ctypes.c_uint32),
        ("global_shape", _Dims),
        ("npieces", ctypes.c_size_t),
        ("pieces", ctypes.POINTER(sp_piece)),
    ]


class sp_group(ctypes.Structure):
    _fields_ = [
        ("nkeys", ctypes.c_size_t),
        ("keys", ctypes.POINTER(ctypes.c_char_p)),
    ]


class sp_progress(ctypes.Structure):
    _fields_ = [
        ("phase", ctypes.c_char_p),
        ("round", ctypes.c_uint32),
        ("rounds", ctypes.c_uint32),
        ("bytes_moved", ctypes.c_uint64),
        ("bytes_total", ctypes.c_uint64),
        ("bytes_written", ctypes.c_uint64),
        ("bytes_to_write", ctypes.c_uint64),
    ]


sp_progress_fn = ctypes.CFUNCTYPE(None, ctypes.POINTER(sp_progress),
                                  ctypes.c_void_p)


class sp_export_opts(ctypes.Structure):
    _fields_ = [
        ("ngroups", ctypes.c_size_t),
        ("groups", ctypes.POINTER(sp_group)),
        ("max_keys", ctypes.c_uint32),
        ("max_bytes", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint32),
        ("progress", sp_progress_fn),
        ("progress_arg", ctypes.c_void_p),
    ]


class sp_metadata(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("value", ctypes.c_char_p),
    ]


class sp_save_opts(ctypes.Structure):
    _fields_ = [
        ("max_shard_bytes", ctypes.c_uint64),
        ("nmetadata", ctypes.c_size_t),
        ("metadata", ctypes.POINTER(sp_metadata)),
        ("overwrite", ctypes.c_int),
        ("export_opts", sp_export_opts),
    ]


class sp_save_result(ctypes.Structure):
    _fields_ = [
        ("files", ctypes.c_uint32),
        ("total_files", ctypes.c_uint32),
        ("bytes", ctypes.c_uint64),
        ("total_bytes", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
        ("wrote_index", ctypes.c_int),
    ]


class sp_owned_tensor(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("shape", _Dims),
        ("stride", _Dims),
        ("data", ctypes.c_void_p),
        ("identity", ctypes.c_int),
        ("device", ctypes.c_char_p),
        ("device_index", ctypes.c_int),
    ]


class sp_owned_set(ctypes.Structure):
    _fields_ = [
        ("export_id", ctypes.c_uint64),
        ("ntensors", ctypes.c_size_t),
        ("tensors", ctypes.POINTER(sp_owned_tensor)),
    ]


SP_MAX_CONSUMERS = 4096

# enum sp_target_part
SP_TARGET_WHOLE = 1
SP_TARGET_SHARD = 2
SP_TARGET_PIECES = 3


class sp_target_piece(ctypes.Structure):
    _fields_ = [
        ("start", _Dims),
        ("shape", _Dims),
        ("storage", ctypes.c_uint32),
        ("stride", _Dims),
        ("offset", ctypes.c_int64),
    ]


class sp_target_desc(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("global_shape", _Dims),
        ("part", ctypes.c_int),
        ("storage", ctypes.c_uint32),
        ("shape", _Dims),
        ("stride", _Dims),
        ("offset", ctypes.c_int64),
        ("dim", ctypes.c_uint32),
        ("npieces", ctypes.c_size_t),
        ("pieces", ctypes.POINTER(sp_target_piece)),
    ]


class sp_push_opts(ctypes.Structure):
    _fields_ = [
        ("max_keys", ctypes.c_uint32),
        ("max_bytes", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint32),
    ]


class sp_push_result(ctypes.Structure):
    _fields_ = [
        ("push_id", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("plan_reused", ctypes.c_int),
    ]


_client_p = ctypes.c_void_p

# name: (restype, argtypes), in the order of include/shardport.h.
_PROTOTYPES = {
    "sp_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "sp_err_name": (ctypes.c_char_p, [ctypes.c_int]),
    "sp_format_bytes": (ctypes.c_char_p,
                        [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
    "sp_default_socket_origin": (ctypes.c_int,
                                 [ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_char_p)]),
    "sp_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_client_p)]),
    "sp_connect_explain": (ctypes.c_int,
                           [ctypes.c_char_p, ctypes.POINTER(_client_p),
                            ctypes.c_char_p, ctypes.c_size_t]),
    "sp_close": (None, [_client_p]),
    "sp_set_timeout": (ctypes.c_int, [_client_p, ctypes.c_uint32]),
    "sp_last_message": (ctypes.c_char_p, [_client_p]),
    "sp_ping": (ctypes.c_int, [_client_p, ctypes.POINTER(ctypes.c_uint64)]),
    "sp_status": (ctypes.c_int,
                  [_client_p, ctypes.POINTER(ctypes.POINTER(sp_status_info))]),
    "sp_status_free": (None, [ctypes.POINTER(sp_status_info)]),
    "sp_job_create": (ctypes.c_int,
                      [_client_p, ctypes.c_uint32, ctypes.POINTER(sp_ticket)]),
    "sp_job_join": (ctypes.c_int,
                    [_client_p, ctypes.POINTER(sp_ticket), ctypes.c_uint32,
                     ctypes.c_uint32, ctypes.c_char_p]),
    "sp_cuda_device_name": (ctypes.c_int,
                            [_client_p, ctypes.c_int, ctypes.c_char_p,
                             ctypes.c_size_t]),
    "sp_job_leave": (ctypes.c_int, [_client_p]),
    "sp_register_storages": (ctypes.c_int,
                             [_client_p, ctypes.POINTER(sp_storage_desc),
                              ctypes.c_size_t]),
    "sp_register_tensors": (ctypes.c_int,
                            [_client_p, ctypes.POINTER(sp_tensor_desc),
                             ctypes.c_size_t]),
    "sp_export": (ctypes.c_int,
                  [_client_p, ctypes.POINTER(sp_export_opts),
                   ctypes.POINTER(ctypes.POINTER(sp_owned_set))]),
    "sp_release": (ctypes.c_int, [_client_p, ctypes.POINTER(sp_owned_set)]),
    "sp_job_create_with_consumers": (ctypes.c_int,
                                     [_client_p, ctypes.c_uint32,
                                      ctypes.c_uint32,
                                      ctypes.POINTER(sp_ticket)]),
    "sp_consumer_join": (ctypes.c_int,
                         [_client_p, ctypes.POINTER(sp_ticket),
                          ctypes.c_uint32, ctypes.c_uint32, ctypes.c_char_p]),
    "sp_register_targets": (ctypes.c_int,
                            [_client_p, ctypes.POINTER(sp_target_desc),
                             ctypes.c_size_t]),
    "sp_push": (ctypes.c_int,
                [_client_p, ctypes.POINTER(sp_push_opts),
                 ctypes.POINTER(sp_push_result)]),
    "sp_receive": (ctypes.c_int,
                   [_client_p, ctypes.c_uint32,
                    ctypes.POINTER(sp_push_result)]),
    "sp_save": (ctypes.c_int,
                [_client_p, ctypes.c_char_p, ctypes.POINTER(sp_save_opts),
                 ctypes.POINTER(sp_save_result)]),
}


def _missing(name):
    def fail(*_args):
        raise RuntimeError(
            "shardport: %s has no %s; it is older than this package"
            % (path, name))
    return fail


class _Functions:
    """The library's functions with their prototypes set.

    A function the loaded library lacks (an older libshardport) fails with a
    message naming the library when it is called, so that status and ping
    keep working against it.
    """

    def __init__(self):
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                setattr(self, name, _missing(name))
                continue
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)


fn = _Functions()
