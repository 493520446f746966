"""The package without PyTorch: status and ping through a private daemon,
typed exceptions, and no torch import along the way."""

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import unittest

import harness
import shardport
from shardport import errors


class ClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls._daemon = harness.daemon()
        cls.socket = cls._daemon.__enter__().socket

    @classmethod
    def tearDownClass(cls):
        cls._daemon.__exit__(None, None, None)

    def test_ping(self):
        with shardport.Client(self.socket) as client:
            rtt = client.ping()
        self.assertGreater(rtt, 0)
        self.assertLess(rtt, 10)

    def test_status(self):
        with shardport.Client(self.socket) as client:
            status = client.status()
        self.assertEqual(status.protocol_version, 4)
        self.assertTrue(status.daemon_version)
        self.assertIn("host", status.backends_built)
        self.assertIn(status.backend_active, status.backends_built)
        self.assertTrue(status.backend_reason)
        self.assertGreaterEqual(status.clients, 1)
        self.assertGreaterEqual(status.uptime_s, 0)
        self.assertEqual(status.jobs, ())

    def test_save_refuses_strings_c_cannot_take(self):
        # C would cut a string at a NUL, and safetensors' metadata is
        # strings only: refused before anything is written or asked.
        with tempfile.TemporaryDirectory() as d, \
                shardport.Client(self.socket) as client:
            path = os.path.join(d, "ckpt")
            with self.assertRaisesRegex(TypeError, "of type int, not a str"):
                client.save(path, metadata={"step": 1})
            with self.assertRaisesRegex(ValueError, "NUL"):
                client.save(path, metadata={"a\0b": "v"})
            with self.assertRaisesRegex(ValueError, "NUL"):
                client.save(path + "\0more")
            self.assertEqual(os.listdir(d), [])

    def test_a_key_with_nul_is_refused_not_cut(self):
        desc = shardport.TensorDesc(
            key="embed\0.weight", storage=1, dtype="float32", shape=(1,),
            stride=(1,), offset=0, placement="replicated", global_shape=(1,))
        with shardport.Client(self.socket) as client:
            with self.assertRaisesRegex(errors.InvalidArgument, "NUL"):
                client.register_tensors([desc])

    def test_default_socket_from_environment(self):
        saved = os.environ.get("SHARDPORT_SOCKET")
        os.environ["SHARDPORT_SOCKET"] = self.socket
        try:
            with shardport.Client() as client:
                client.ping()
        finally:
            if saved is None:
                del os.environ["SHARDPORT_SOCKET"]
            else:
                os.environ["SHARDPORT_SOCKET"] = saved

    def test_closed_client_raises_closed(self):
        client = shardport.Client(self.socket)
        client.close()
        with self.assertRaises(errors.Closed):
            client.ping()

    def test_no_daemon_is_typed(self):
        with tempfile.TemporaryDirectory() as empty:
            path = os.path.join(empty, "none.sock")
            with self.assertRaises(errors.NoDaemon) as caught:
                shardport.Client(path)
        exc = caught.exception
        self.assertIsInstance(exc, shardport.ShardportError)
        self.assertEqual(exc.code, -2)
        self.assertEqual(exc.name, "no_daemon")
        self.assertIn(path, exc.message)
        self.assertIn("no_daemon", str(exc))

    def test_no_daemon_names_the_default_path_and_its_origin(self):
        with tempfile.TemporaryDirectory() as empty:
            path = os.path.join(empty, "none.sock")
            saved = os.environ.get("SHARDPORT_SOCKET")
            os.environ["SHARDPORT_SOCKET"] = path
            try:
                self.assertEqual(shardport.default_socket(),
                                 (path, "from $SHARDPORT_SOCKET"))
                with self.assertRaises(errors.NoDaemon) as caught:
                    shardport.Client()
            finally:
                if saved is None:
                    del os.environ["SHARDPORT_SOCKET"]
                else:
                    os.environ["SHARDPORT_SOCKET"] = saved
        message = caught.exception.message
        self.assertIn("%s (from $SHARDPORT_SOCKET)" % path, message)
        self.assertNotIn("the default socket", message)
        self.assertIn("start shardportd", message)

    def test_daemon_gone_is_typed(self):
        with harness.daemon() as running:
            client = shardport.Client(running.socket)
            running.proc.kill()
            running.proc.wait()
            with self.assertRaises(shardport.ShardportError) as caught:
                client.ping()
            client.close()
        self.assertIn(caught.exception.name, ("closed", "io"))


class LayoutTest(unittest.TestCase):
    """The ctypes structs repeat include/shardport.h field for field: sizes
    and offsets as the C compiler lays them out (abi_layout.c)."""

    def test_structs_match_the_header(self):
        from shardport import _lib
        layout = json.loads(subprocess.run(
            [os.environ["SHARDPORT_ABI_LAYOUT"]], check=True,
            capture_output=True, text=True).stdout)
        for name, value in layout["constants"].items():
            self.assertEqual(getattr(_lib, name), value, name)
        for name, fields in layout["structs"].items():
            mirror = getattr(_lib, name)
            size = fields.pop("size")
            with self.subTest(struct=name):
                self.assertEqual(ctypes.sizeof(mirror), size)
                self.assertEqual([f[0] for f in mirror._fields_],
                                 list(fields))
                for field, offset in fields.items():
                    self.assertEqual(getattr(mirror, field).offset, offset,
                                     field)


class ErrorTableTest(unittest.TestCase):

    def test_classes_follow_the_c_table(self):
        self.assertEqual(errors.VersionMismatch.code, -4)
        self.assertEqual(errors.VersionMismatch.name, "version_mismatch")
        self.assertEqual(errors.RankLost.code, -94)
        self.assertEqual(errors.BadTiling.code, -65)
        self.assertEqual(errors.PoolExhausted.name, "pool_exhausted")
        for name in errors.__all__:
            cls = getattr(errors, name)
            if cls is shardport.ShardportError or not isinstance(cls, type):
                continue
            self.assertTrue(issubclass(cls, shardport.ShardportError))
            exc = errors.error_for(cls.code)
            self.assertIs(type(exc), cls)
            self.assertTrue(exc.message)

    def test_a_stopping_daemon_is_caught_as_restarted(self):
        self.assertEqual(errors.DaemonRestarted.name, "daemon_restarted")
        self.assertTrue(issubclass(errors.DaemonStopping,
                                   errors.DaemonRestarted))
        self.assertEqual(errors.Aborted.code, -101)

    def test_unknown_code_is_internal(self):
        exc = errors.error_for(-250, "what the daemon said")
        self.assertIs(type(exc), errors.Internal)
        self.assertEqual(exc.message, "what the daemon said")


class RestartTest(unittest.TestCase):

    def test_a_job_whose_daemon_stopped_raises_daemon_restarted(self):
        with harness.daemon() as running:
            client = shardport.Client(running.socket)
            client.join(client.create_job(2), 0, 2)
            running.proc.terminate()
            self.assertEqual(running.proc.wait(10), 0)
            # Every later call says so, until the job is made again.
            for _ in range(2):
                with self.assertRaises(errors.DaemonRestarted) as caught:
                    client.ping()
                self.assertIn("create a new job", caught.exception.message)
            client.close()


class NoTorchTest(unittest.TestCase):

    def test_torch_was_never_imported(self):
        with harness.daemon() as running:
            with shardport.Client(running.socket) as client:
                client.status()
                client.ping()
        self.assertNotIn("torch", sys.modules)


if __name__ == "__main__":
    unittest.main(verbosity=2)
