"""The Prometheus endpoint (docs/operations.md, "Monitoring"): scraped from
running daemons, one and two across nodes, after exports that published
and one that failed; parsed with prometheus_client's parser (Debian's
python3-prometheus-client, independent of the daemon) and with the
format's rules checked line by line; 64 scrapers at once while an export
moves; bad HTTP requests; the endpoint off by default.

meson test sets SHARDPORTD, SHARDPORT_DEMO (the export load) and
PYTHONPATH (the package, for status).
"""

import concurrent.futures
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import harness
import shardport

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:
    # Not a skip: the parser is one of the build's test dependencies.
    sys.exit("prometheus_client cannot be imported by %s (%s): "
             "apt-get install -y python3-prometheus-client (.ci/deps.sh "
             "installs it)" % (sys.executable, exc))

DEMO = os.environ["SHARDPORT_DEMO"]
SERVING = re.compile(r"metrics: serving http://([0-9.]+):([0-9]+)/metrics")
# A sample line of the text format: name, optional labels, value.
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*='
                    r'"(?:[^"\\\n]|\\[\\"n])*",?)*\})? (\S+)$')


def endpoint(d):
    """The address the daemon said it serves metrics on."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = SERVING.search(d.log_text())
        if m:
            return m.group(1), int(m.group(2))
        time.sleep(0.02)
    raise AssertionError("no metrics endpoint in the log:\n" + d.log_text())


def fetch(addr, path="/metrics", method="GET"):
    conn = http.client.HTTPConnection(addr[0], addr[1], timeout=30)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), r.read().decode()
    finally:
        conn.close()


def strict_check(text):
    """The rules the parser forgives: every family has HELP and TYPE before
    its samples, counters end in _total, no series twice, values are
    numbers, the text ends with a newline."""
    assert text.endswith("\n"), "the exposition does not end with a newline"
    helped, typed, seen = set(), {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split(" ")[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            if kind == "counter":
                assert name.endswith("_total"), "counter %s" % name
            typed[name] = kind
            continue
        m = SAMPLE.match(line)
        assert m, "not a sample line: %r" % line
        name = m.group(1)
        family = name
        if name not in typed:
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert typed.get(family) == "histogram", "no TYPE for %s" % name
        assert family in helped, "no HELP for %s" % family
        float(m.group(3))
        series = (name, m.group(2) or "")
        assert series not in seen, "series twice: %s" % line
        seen.add(series)


def scrape(addr):
    """{(name, frozenset(labels)): value} of one scrape, checked by both
    parsers."""
    status, ctype, text = fetch(addr)
    assert status == 200, (status, text)
    assert ctype.startswith("text/plain; version=0.0.4"), ctype
    strict_check(text)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def series(samples, name):
    return {k[1]: v for k, v in samples.items() if k[0] == name}


def demo(sockets, ranks=2, extra=(), check=True):
    """Runs the demo job over the daemons; its key=value summary."""
    args = [DEMO, "--ranks", str(ranks), "--machine", *extra]
    for s in sockets:
        args += ["--socket", s]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError("demo failed: %s" % p.stderr)
    if p.returncode != 0:
        return None
    return dict(kv.split("=") for kv in p.stdout.split())


def wait_for(addr, name, want, **labels):
    """Scrapes until the counter reaches want: a rank hears its reply a
    moment before the daemon's loop has recorded the export's end."""
    deadline = time.monotonic() + 10
    while True:
        s = scrape(addr)
        if value(s, name, **labels) >= want or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def listening_tcp(pid):
    """TCP sockets the process listens on (state 0A of /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    count += 1
    return count


class OneDaemon(unittest.TestCase):

    def test_off_by_default(self):
        with harness.daemon() as d:
            self.assertEqual(listening_tcp(d.proc.pid), 0)
            self.assertNotIn("metrics:", d.log_text())
        printed = subprocess.run(
            [os.environ["SHARDPORTD"], "--config", "/dev/null",
             "--socket", "/tmp/unused.sock", "--print-config"],
            capture_output=True, text=True, check=True).stdout
        self.assertIn("metrics_listen = none\n", printed)
        self.assertIn("metrics_connections = 64\n", printed)

    def test_a_published_export_is_counted(self):
        with harness.daemon("--metrics-listen", "127.0.0.1:0") as d:
            addr = endpoint(d)
            self.assertEqual(listening_tcp(d.proc.pid), 1)
            s = scrape(addr)
            build = series(s, "shardport_build_info")
            self.assertEqual(len(build), 1)
            labels = dict(next(iter(build)))
            with shardport.Client(d.socket) as c:
                st = c.status()
            self.assertEqual(labels["version"], st.daemon_version)
            self.assertEqual(labels["protocol"], str(st.protocol_version))
            backend = dict(next(iter(series(s, "shardport_backend_info"))))
            self.assertEqual(backend["backend"], st.backend_active)
            self.assertEqual(backend["reason"], st.backend_reason)
            self.assertEqual(value(s, "shardport_pool_capacity_bytes",
                                   device="host"), st.pool_capacity)
            self.assertEqual(sum(series(s, "shardport_exports_total")
                                 .values()), 0)

            ran = demo([d.socket], ranks=3, extra=["--max-keys", "16"])
            s = wait_for(addr, "shardport_exports_total", 1,
                         result="published")
            self.assertEqual(value(s, "shardport_exports_total",
                                   result="published"), 1)
            self.assertEqual(value(s, "shardport_export_keys_total"),
                             int(ran["keys"]))
            # The engine copies every byte the owners' pool segments hold;
            # identity tensors stay where they are.
            self.assertEqual(value(s, "shardport_export_moved_bytes_total"),
                             int(ran["pool_bytes"]))
            rounds = re.search(r"published: moved .* in ([0-9]+) round",
                               d.log_text())
            self.assertEqual(value(s, "shardport_export_rounds_total"),
                             int(rounds.group(1)))
            self.assertEqual(value(s, "shardport_export_duration_seconds_count"),
                             1)
            self.assertEqual(
                value(s, "shardport_export_planning_duration_seconds_count"),
                1)
            self.assertLessEqual(
                value(s, "shardport_export_duration_seconds_sum"),
                float(ran["seconds"]) + 0.5)
            self.assertEqual(value(s, "shardport_export_duration_seconds_bucket",
                                   le="+Inf"), 1)
            self.assertEqual(value(s, "shardport_clients"), 0)
            self.assertEqual(value(s, "shardport_jobs"), 0)


    def test_loop_max_busy_has_its_own_window(self):
        """The longest loop iteration since the previous scrape: a status
        request between two scrapes does not start the scrape's window
        again, nor a scrape the status's.  Every iteration the second
        scrape counts (from the first scrape on, the demo's included) is
        one the second status counts too (from the first status on)."""
        with harness.daemon("--metrics-listen", "127.0.0.1:0") as d:
            addr = endpoint(d)
            with shardport.Client(d.socket) as c:
                c.status()
                scrape(addr)
                demo([d.socket])
                busy_s = value(scrape(addr), "shardport_loop_max_busy_seconds")
                busy_us = c.status().loop_max_busy_us
            self.assertGreater(busy_s, 0)
            # The gauge is rounded to the microsecond, status truncates.
            self.assertLessEqual(round(busy_s * 1e6), busy_us + 1,
                                 "the status after the scrape saw a "
                                 "shorter longest iteration than the "
                                 "scrape: the scrape ended its window")

    def test_failed_export_is_counted_by_its_code(self):
        """Rank 0 asks for an export with a 300 ms timeout that rank 1 never
        joins in: the export fails with timeout, and rank 0's ask is
        answered with it."""
        with harness.daemon("--metrics-listen", "127.0.0.1:0") as d:
            addr = endpoint(d)
            with shardport.Client(d.socket) as r0, \
                    shardport.Client(d.socket) as r1:
                ticket = r0.create_job(2)
                r0.join(ticket, 0, 2)
                r1.join(ticket, 1, 2)
                with self.assertRaises(shardport.errors.Timeout):
                    r0.export(timeout=0.3)
                s = wait_for(addr, "shardport_exports_total", 1,
                             result="timeout")
                self.assertEqual(value(s, "shardport_ranks"), 2)
                self.assertEqual(value(s, "shardport_jobs"), 1)
                self.assertEqual(value(s, "shardport_clients"), 2)
            failed = {dict(k)["result"]: v for k, v in
                      series(s, "shardport_exports_total").items() if v}
            self.assertEqual(failed, {"timeout": 1})
            refused = {dict(k)["code"]: v for k, v in
                       series(s, "shardport_requests_refused_total").items()
                       if v}
            self.assertEqual(refused, {"timeout": 1})
            self.assertEqual(value(s, "shardport_export_duration_seconds_count"),
                             1)
            self.assertGreaterEqual(
                value(s, "shardport_export_duration_seconds_sum"), 0.3)
            # It never planned.
            self.assertEqual(
                value(s, "shardport_export_planning_duration_seconds_count"),
                0)

    def test_bad_requests_get_4xx(self):
        with harness.daemon("--metrics-listen", "127.0.0.1:0") as d:
            addr = endpoint(d)
            self.assertEqual(fetch(addr, "/nothing")[0], 404)
            self.assertEqual(fetch(addr, "/metrics/")[0], 404)
            self.assertEqual(fetch(addr, "/metrics", "POST")[0], 405)
            self.assertEqual(fetch(addr, "/metrics", "DELETE")[0], 405)
            self.assertEqual(fetch(addr, "/metrics", "HEAD")[0], 200)
            for raw, want in (
                    (b"GET metrics HTTP/1.1\r\nHost: x\r\n\r\n", 404),
                    (b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", 400),
                    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 40000
                     + b"\r\n\r\n", 431),
                    (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
                    # Not HTTP at all: closed without a word.
                    (b"BOGUS\r\n\r\n", None)):
                with socket.create_connection(addr, timeout=10) as sock:
                    sock.sendall(raw)
                    reply = sock.recv(4096).decode("latin-1")
                code = int(reply.split(" ")[1]) if reply else None
                self.assertEqual(code, want, (raw[:30], reply[:80]))
            # The daemon still serves, both its socket and the endpoint.
            with shardport.Client(d.socket) as c:
                c.ping()
            scrape(addr)

    def test_address_in_use_is_said(self):
        """An address another socket holds: the daemon does not start
        (exit status 3) and says which address and why."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            where = "127.0.0.1:%d" % taken.getsockname()[1]
            workdir = tempfile.mkdtemp(prefix="sp-metrics-")
            try:
                p = subprocess.run(
                    [os.environ["SHARDPORTD"], "--config", "/dev/null",
                     "--socket", os.path.join(workdir, "s.sock"),
                     "--metrics-listen", where],
                    capture_output=True, text=True, timeout=30)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertRegex(p.stderr, "metrics: cannot serve HTTP on %s: .*"
                                   "Address already in use" % where)

    def test_connections_are_bounded(self):
        """metrics_connections = 2: with one connection open a scrape is
        served; with two, a third waits, unserved, until one goes."""
        workdir = tempfile.mkdtemp(prefix="sp-metrics-")
        cfg = os.path.join(workdir, "shardportd.conf")
        with open(cfg, "w") as f:
            f.write("metrics_listen = 127.0.0.1:0\nmetrics_connections = 2\n")
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        try:
            with harness.daemon("--config", cfg) as d:
                addr = endpoint(d)
                held = [socket.create_connection(addr, timeout=10)]
                time.sleep(0.2)
                self.assertEqual(fetch(addr)[0], 200)
                held.append(socket.create_connection(addr, timeout=10))
                time.sleep(0.2)
                third = socket.create_connection(addr, timeout=1)
                third.sendall(request)
                with self.assertRaises(socket.timeout):
                    third.recv(100)
                held.pop().close()
                third.settimeout(10)
                self.assertTrue(third.recv(100).startswith(b"HTTP/1.1 200"))
                third.close()
                for h in held:
                    h.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def test_64_scrapers_while_an_export_moves(self):
        """64 threads scrape without pause while an export moves: every
        scrape parses, the export publishes and verifies, and status round
        trips stay near those measured in the same run under the same load
        of 64 threads that parse a saved scrape without asking the daemon."""
        os.environ["SHARDPORTD_TEST_ROUND_DELAY_MS"] = "100"
        try:
            ctx = harness.daemon("--metrics-listen", "127.0.0.1:0")
            d = ctx.__enter__()
        finally:
            del os.environ["SHARDPORTD_TEST_ROUND_DELAY_MS"]
        try:
            addr = endpoint(d)
            saved = os.path.join(os.path.dirname(d.socket), "saved")
            with open(saved, "w") as f:
                f.write(fetch(addr)[2])
            client = shardport.Client(d.socket)

            def phase(kind):
                load = subprocess.Popen(
                    [sys.executable, __file__, "--load", kind, addr[0],
                     str(addr[1]), saved], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True)
                time.sleep(0.5)
                job = subprocess.Popen(
                    [DEMO, "--ranks", "2", "--machine", "--max-keys", "32",
                     "--socket", d.socket], stdout=subprocess.PIPE, text=True)
                pings = []
                while job.poll() is None:
                    pings.append(client.ping())
                    time.sleep(0.005)
                out, _ = job.communicate()
                report, _ = load.communicate("")
                self.assertEqual(load.returncode, 0)
                self.assertEqual(job.returncode, 0)
                self.assertIn("verified=1", out)
                return statistics.median(pings), json.loads(report)

            control, _ = phase("offline")
            loaded, seen = phase("online")
            print("status round trip under 64 threads: %.3f ms parsing "
                  "offline (the limit: 3x), %.3f ms scraping; %d scrapes"
                  % (control * 1e3, loaded * 1e3, len(seen)))
            self.assertGreaterEqual(len(seen), 64)
            # The scrapes saw the ranks while they were joined.
            self.assertIn(2, seen)
            self.assertLess(loaded, 3 * control)
            s = wait_for(addr, "shardport_exports_total", 2,
                         result="published")
            self.assertEqual(value(s, "shardport_exports_total",
                                   result="published"), 2)
            client.close()
        finally:
            ctx.__exit__(None, None, None)


class TwoDaemons(unittest.TestCase):

    def test_bytes_to_and_from_each_peer(self):
        with harness.daemon("--metrics-listen", "127.0.0.1:0",
                            "--peer-listen", "127.0.0.1:0") as a, \
                harness.daemon("--metrics-listen", "127.0.0.1:0",
                               "--peer-listen", "127.0.0.1:0") as b:
            ma, mb = endpoint(a), endpoint(b)
            with shardport.Client(a.socket) as c:
                pa = c.status().peer_address
            with shardport.Client(b.socket) as c:
                pb = c.status().peer_address
            demo([a.socket, b.socket], ranks=4)
            sa = wait_for(ma, "shardport_exports_total", 1, result="published")
            sb = wait_for(mb, "shardport_exports_total", 1, result="published")
            for s in (sa, sb):
                self.assertEqual(value(s, "shardport_exports_total",
                                       result="published"), 1)
            a_sent = value(sa, "shardport_peer_sent_bytes_total", peer=pb)
            b_got = value(sb, "shardport_peer_received_bytes_total", peer=pa)
            b_sent = value(sb, "shardport_peer_sent_bytes_total", peer=pa)
            a_got = value(sa, "shardport_peer_received_bytes_total", peer=pb)
            self.assertGreater(a_sent + b_sent, 0)
            self.assertEqual(a_sent, b_got)
            self.assertEqual(b_sent, a_got)
            # Only the one peer is named on each.
            self.assertEqual(len(series(sa, "shardport_peer_sent_bytes_total")),
                             1)


def load(kind, host, port, saved):
    """64 threads that scrape (online) or parse a saved scrape (offline)
    until stdin closes; prints the ranks each scrape showed, as JSON."""
    with open(saved) as f:
        text = f.read()
    stop = threading.Event()
    seen = []

    def worker():
        while not stop.is_set():
            if kind == "online":
                seen.append(value(scrape((host, port)), "shardport_ranks"))
            else:
                strict_check(text)
                for family in text_string_to_metric_families(text):
                    for _ in family.samples:
                        pass

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(worker) for _ in range(64)]
        sys.stdin.read()
        stop.set()
        for f in futures:
            f.result()
    print(json.dumps(seen))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        load(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        unittest.main(verbosity=2)
