"""A released segment's memory is given back off the event loop: the last
unmap and close of a large memfd frees its pages there and then, which on
the loop would hold every client's answer for as long (docs/operations.md,
"Large frames").  The demo job exports and releases through a daemon; the
daemon's longest loop iteration over that time (status'
loop_max_busy_us) is compared with the limit measured in the same run:
this process giving back a memfd of one owner's share of the pool.

meson test sets SHARDPORTD, SHARDPORT_DEMO and PYTHONPATH (the package).
"""

import mmap
import os
import subprocess
import time
import unittest

import harness
import shardport

DEMO = os.environ["SHARDPORT_DEMO"]
RANKS = 2
PAGE = mmap.PAGESIZE


def give_back_seconds(size):
    """How long unmapping and closing a written memfd of size bytes takes."""
    fd = os.memfd_create("shardport-test-limit")
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        for off in range(0, size, PAGE):
            m[off] = 1
        start = time.monotonic()
        m.close()
        os.close(fd)
        fd = -1
        return time.monotonic() - start
    finally:
        if fd >= 0:
            os.close(fd)


class ReleaseLeavesTheLoopFree(unittest.TestCase):
    def test_release_of_large_segments(self):
        with harness.daemon() as d:
            with shardport.Client(d.socket) as c:
                c.status()  # starts the window
                p = subprocess.run([DEMO, "--ranks", str(RANKS), "--scale",
                                    "2", "--machine", "--socket", d.socket],
                                   capture_output=True, text=True,
                                   timeout=300)
                self.assertEqual(p.returncode, 0, p.stderr)
                summary = dict(kv.split("=") for kv in p.stdout.split())
                busy_us = c.status().loop_max_busy_us
        share = int(summary["pool_bytes"]) // RANKS // PAGE * PAGE
        limit_us = give_back_seconds(share) * 1e6
        print("pool %s bytes over %d owners: loop busy at most %d us; giving "
              "back %d bytes here took %d us (ratio %.3f)"
              % (summary["pool_bytes"], RANKS, busy_us, share, limit_us,
                 busy_us / limit_us), flush=True)
        self.assertLess(busy_us, limit_us / 2,
                        "the loop was held about as long as giving back one "
                        "owner's segment takes")


if __name__ == "__main__":
    unittest.main(verbosity=2)
