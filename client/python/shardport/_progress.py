"""The one-line progress an export shows on a terminal."""

import ctypes
import sys

from . import _lib


def _size(n):
    """n bytes as everything of shardport writes a size (sp_format_bytes):
    one export's figure reads the same here, in status and in the log."""
    buf = ctypes.create_string_buffer(32)
    _lib.fn.sp_format_bytes(n, buf, len(buf))
    return buf.value.decode()


class TerminalProgress:
    """Rewrites one line of stream per report and ends it when closed.
    Shown only where stream is a terminal: a log file gets nothing."""

    def __init__(self, stream=None):
        self._stream = stream if stream is not None else sys.stderr
        self._shown = False

    @staticmethod
    def wanted(stream=None):
        stream = stream if stream is not None else sys.stderr
        return hasattr(stream, "isatty") and stream.isatty()

    def __call__(self, p):
        line = "shardport: %-10s" % p.phase
        if p.rounds:
            line += " round %d/%d" % (p.round, p.rounds)
        if p.bytes_to_write:
            line += "  %s / %s written (%d%%)" % (
                _size(p.bytes_written), _size(p.bytes_to_write),
                100 * p.bytes_written // p.bytes_to_write)
        elif p.bytes_total:
            line += "  %s / %s (%d%%)" % (
                _size(p.bytes_moved), _size(p.bytes_total),
                100 * p.bytes_moved // p.bytes_total)
        self._stream.write("\r\033[K" + line)
        self._stream.flush()
        self._shown = True

    def close(self):
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = False
