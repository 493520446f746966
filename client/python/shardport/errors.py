"""Typed exceptions, one class per libshardport error code.

The classes are generated from the library's own error table (SP_ERROR_MAP
in include/shardport.h) by asking sp_err_name for every code in the range the
table may use, so a code added to the C table becomes a Python class without
a change here.  A class is named after the code's wire name in CamelCase:
``rank_lost`` is ``RankLost``, ``bad_tiling`` is ``BadTiling``,
``version_mismatch`` is ``VersionMismatch``.

Every exception carries ``code`` (the negative C code), ``name`` (the wire
name) and ``message`` (the daemon's own text when it sent one, else the
library's sentence for the code).

A code whose remedy is another's derives from that one's class: a daemon
that is stopping (``DaemonStopping``) ends its jobs as it goes, so
``except DaemonRestarted`` catches both, and the handler re-creates the job
(docs/python.md).
"""

from . import _lib

# SP_ERROR_MAP numbers its codes from 1 upward in blocks; this bound leaves
# the table room to grow.
_MAX_CODE = 255


class ShardportError(Exception):
    """Base of every error shardport reports."""

    code = 0
    name = "unknown"

    def __init__(self, message):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return "%s (%s)" % (self.message, self.name)


def _camel(wire_name):
    return "".join(part.capitalize() for part in wire_name.split("_"))


# wire name -> the wire name of the class it derives from.
_PARENTS = {"daemon_stopping": "daemon_restarted"}


def _generate():
    table = {}
    for number in range(1, _MAX_CODE + 1):
        wire = _lib.fn.sp_err_name(-number).decode()
        if wire != "unknown":
            table[wire] = -number
    classes, by_name = {}, {}
    # Parents first, so that a child's base exists when it is made.
    for wire in sorted(table, key=lambda w: w in _PARENTS):
        code = table[wire]
        base = by_name.get(_PARENTS.get(wire), ShardportError)
        doc = _lib.fn.sp_strerror(code).decode()
        cls = type(_camel(wire), (base,),
                   {"code": code, "name": wire, "__doc__": doc,
                    "__module__": __name__})
        classes[code] = by_name[wire] = cls
    return classes


_BY_CODE = _generate()
_BY_NAME = {cls.name: cls for cls in _BY_CODE.values()}
globals().update({cls.__name__: cls for cls in _BY_CODE.values()})
__all__ = ["ShardportError", "error_for"] + sorted(
    cls.__name__ for cls in _BY_CODE.values())


def error_for(code, message=None):
    """The exception for a negative code; message defaults to the library's
    sentence for it.  A code the table does not know is reported as
    ``internal``, as docs/protocol.md asks of clients."""
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = _BY_NAME["internal"]
        message = message or "unknown error code %d" % code
    if not message:
        message = _lib.fn.sp_strerror(code).decode()
    return cls(message)
