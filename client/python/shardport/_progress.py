"""The one-line progress an export shows on a terminal."""

import sys


def _size(n):
    if n < 1024:
        return "%d B" % n
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return "%.1f %s" % (n, unit)


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
        if p.bytes_total:
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
