"""Journal fields (docs/operations.md, "Monitoring"): a daemon whose stderr
is the journal stream (JOURNAL_STREAM names it) sends each line to the
journal's socket through libsystemd, with PRIORITY and the SHARDPORT_*
fields of the job it is about; without that socket it falls back to "<N>"
lines on stderr.

The journal's socket is libsystemd's fixed path
/run/systemd/journal/socket, so the test runs in a mount namespace of its
own (unshare -m, as root) with a tmpfs on /run and binds that path itself,
reading the datagrams in the journal's native protocol.  Where it cannot
(not root, no unshare), it says why and exits 77 (skipped).

meson test sets SHARDPORTD, SHARDPORT_DEMO and PYTHONPATH.
"""

import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import harness
import shardport

JOURNAL = "/run/systemd/journal/socket"


def skip(why):
    banner = "!" * 72
    print("%s\nSKIPPED: the journal fields cannot be tested here: %s\n%s"
          % (banner, why, banner), file=sys.stderr, flush=True)
    sys.exit(harness.EXIT_SKIP)


def parse_entry(data):
    """One datagram of the native protocol: KEY=VALUE lines, or KEY, a
    newline, a 64-bit little-endian length, the value and a newline."""
    fields = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, val = line.split(b"=", 1)
            i = nl + 1
        else:
            key = line
            (n,) = struct.unpack_from("<Q", data, nl + 1)
            val = data[nl + 9:nl + 9 + n]
            assert data[nl + 9 + n:nl + 10 + n] == b"\n"
            i = nl + 10 + n
        fields[key.decode()] = val.decode()
    return fields


class JournalFields(unittest.TestCase):

    def setUp(self):
        self.workdir = tempfile.mkdtemp(prefix="sp-journal-")
        os.makedirs(os.path.dirname(JOURNAL), exist_ok=True)
        self.journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.journal.bind(JOURNAL)
        # Read as the daemon writes: a datagram socket's queue is short, and
        # a full one would block the daemon's sends.
        self.received = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                data = self.journal.recv(1 << 20)
            except OSError:
                return
            self.received.append(parse_entry(data))

    def tearDown(self):
        self.journal.shutdown(socket.SHUT_RDWR)
        self.journal.close()
        if os.path.exists(JOURNAL):
            os.unlink(JOURNAL)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self, name):
        """A daemon whose stderr is what JOURNAL_STREAM names."""
        path = os.path.join(self.workdir, name + ".sock")
        log = open(os.path.join(self.workdir, name + ".log"), "w+")
        st = os.fstat(log.fileno())
        env = dict(os.environ, JOURNAL_STREAM="%d:%d" % (st.st_dev,
                                                         st.st_ino))
        proc = subprocess.Popen(
            [os.environ["SHARDPORTD"], "--socket", path, "--config",
             "/dev/null"], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 10
        while not os.path.exists(path):
            self.assertIsNone(proc.poll())
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)
        return proc, path, log

    def stop(self, proc, log):
        proc.terminate()
        self.assertEqual(proc.wait(10), 0)
        log.seek(0)
        text = log.read()
        log.close()
        return text

    def entries_until_stopped(self):
        """What the journal got, up to the daemon's last line."""
        deadline = time.monotonic() + 10
        while not any(e["MESSAGE"] == "stopped" for e in self.received):
            self.assertLess(time.monotonic(), deadline, self.received)
            time.sleep(0.02)
        return list(self.received)

    def test_a_jobs_story_carries_its_fields(self):
        proc, path, log = self.start("d")
        demo = subprocess.run(
            [os.environ["SHARDPORT_DEMO"], "--ranks", "2", "--machine",
             "--socket", path], capture_output=True, text=True, timeout=120)
        self.assertEqual(demo.returncode, 0, demo.stderr)
        with shardport.Client(path) as r0, shardport.Client(path) as r1:
            ticket = r0.create_job(2)
            r0.join(ticket, 0, 2)
            r1.join(ticket, 1, 2)
            with self.assertRaises(shardport.errors.Timeout):
                r0.export(timeout=0.2)
        text = self.stop(proc, log)
        # Every line went to the journal, none to the stream.
        self.assertEqual(text, "")
        got = self.entries_until_stopped()
        for e in got:
            self.assertEqual(e["SYSLOG_IDENTIFIER"], "shardportd")
            self.assertIn(e["PRIORITY"], ("3", "4", "6", "7"))
        # Every line about a job names it in a field: `journalctl
        # SHARDPORT_JOB=ID` is the whole story.
        for e in got:
            about = re.match(r"job ([0-9a-f]{32}):", e["MESSAGE"])
            if about:
                self.assertEqual(e.get("SHARDPORT_JOB"), about.group(1), e)
        jobs = []
        for e in got:
            if "SHARDPORT_JOB" in e and e["SHARDPORT_JOB"] not in jobs:
                jobs.append(e["SHARDPORT_JOB"])
        self.assertEqual(len(jobs), 2, got)
        story = [e for e in got if e.get("SHARDPORT_JOB") == jobs[0]]
        for e in story:
            self.assertIn(jobs[0], e["MESSAGE"])
        published = [e for e in story if "published" in e["MESSAGE"]]
        self.assertEqual(len(published), 1)
        self.assertEqual(published[0]["SHARDPORT_EXPORT"], "1")
        self.assertEqual(published[0]["PRIORITY"], "6")
        self.assertNotIn("SHARDPORT_ERROR", published[0])
        joined = sorted(e["SHARDPORT_RANK"] for e in story
                        if " joined " in e["MESSAGE"])
        self.assertEqual(joined, ["0", "1"])
        self.assertTrue(any("created" in e["MESSAGE"] for e in story))
        self.assertTrue(any(e["MESSAGE"].endswith("ended") for e in story))
        # The failed export: warning, with its error code.
        failed = [e for e in got if e.get("SHARDPORT_JOB") == jobs[1]
                  and "failed" in e["MESSAGE"]]
        self.assertEqual(len(failed), 1)
        self.assertEqual(failed[0]["PRIORITY"], "4")
        self.assertEqual(failed[0]["SHARDPORT_ERROR"], "timeout")
        # Lines about no job carry no job field.
        listening = [e for e in got if e["MESSAGE"].startswith("listening")]
        self.assertEqual(len(listening), 1)
        self.assertNotIn("SHARDPORT_JOB", listening[0])

    def test_without_the_socket_lines_go_to_the_stream(self):
        os.unlink(JOURNAL)
        proc, _, log = self.start("d")
        text = self.stop(proc, log)
        lines = text.splitlines()
        self.assertTrue(lines)
        for line in lines:
            self.assertRegex(line, r"^<[3467]>")
        self.assertTrue(any(line.startswith("<6>listening") for line in lines))


def main():
    if sys.argv[1:2] != ["--inside"]:
        if os.geteuid() != 0:
            skip("it needs root for a mount namespace of its own (unshare -m),"
                 " and runs as uid %d" % os.geteuid())
        unshare = shutil.which("unshare")
        if unshare is None:
            skip("unshare (util-linux) is not installed")
        probe = subprocess.run([unshare, "-m", "true"], capture_output=True,
                               text=True)
        if probe.returncode != 0:
            skip("unshare -m fails here: %s" % probe.stderr.strip())
        os.execv(unshare, [unshare, "-m", "--propagation", "private",
                           sys.executable, __file__, "--inside"])
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
    unittest.main(argv=[sys.argv[0]], verbosity=2)


if __name__ == "__main__":
    main()
