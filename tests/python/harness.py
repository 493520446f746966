"""What the Python suites share: a private shardportd per test, and the
loud skip when PyTorch is missing.

meson test sets SHARDPORTD (the built daemon), SHARDPORT_LIB (the built
library) and PYTHONPATH (the package's source directory).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# meson test counts this exit status as a skipped test.
EXIT_SKIP = 77


def require_torch():
    """Imports torch, or says loudly that it cannot and exits as skipped:
    a PyTorch suite never passes without running."""
    try:
        import torch
    except ImportError as exc:
        banner = "!" * 72
        print("%s\nSKIPPED: PyTorch cannot be imported by %s (%s).\n"
              "These tests need Debian's python3-torch: apt-get install -y "
              "python3-torch python3-numpy\n(.ci/deps.sh installs it).\n%s"
              % (banner, sys.executable, exc, banner),
              file=sys.stderr, flush=True)
        sys.exit(EXIT_SKIP)
    return torch


def _listening(path):
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class Daemon:
    """A running private shardportd: its socket path, process and log."""

    def __init__(self, path, proc, log):
        self.socket = path
        self.proc = proc
        self._log = log

    def log_text(self):
        self._log.flush()
        self._log.seek(0)
        return self._log.read()


@contextlib.contextmanager
def daemon(*extra_args):
    """Starts shardportd on a private socket and yields its Daemon; stops it
    and removes its directory afterwards.  A daemon that does not stop
    cleanly on SIGTERM fails the test and shows its log."""
    workdir = tempfile.mkdtemp(prefix="sp-pytest-")
    path = os.path.join(workdir, "s.sock")
    log = open(os.path.join(workdir, "shardportd.log"), "w+")
    proc = subprocess.Popen(
        [os.environ["SHARDPORTD"], "--socket", path, "--config", "/dev/null",
         *extra_args], stdout=log, stderr=subprocess.STDOUT)
    running = Daemon(path, proc, log)
    try:
        deadline = time.monotonic() + 10
        while not _listening(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("shardportd did not start:\n"
                                   + running.log_text())
            time.sleep(0.01)
        yield running
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            if proc.wait(10) != 0:
                raise RuntimeError("shardportd exited %d on SIGTERM:\n%s"
                                   % (proc.returncode, running.log_text()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
