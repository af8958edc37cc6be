"""
The throwaway PostgreSQL and Redis of the tests: they start, answer, and
are gone after cleanup; absent, they skip naming Debian's package, and
fail under C{CI=true}.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from unittest import SkipTest
from urllib.parse import urlsplit

from twisted.trial.unittest import SynchronousTestCase

from tests import pg_support, prometheus_support, redis_support


class PostgresHarnessTests(SynchronousTestCase):
    def test_start_query_stop(self) -> None:
        """
        A server of the test's own answers C{psql} on its URL; stopping
        removes its folder.
        """
        server = pg_support.PostgresServer(pg_support.require_postgres())
        self.addCleanup(server.stop)
        server.start()
        url = server.create_database("t")
        parts = urlsplit(url)
        self.assertEqual((parts.hostname, parts.port), ("127.0.0.1", server.port))
        command = [
            os.path.join(server.bindir, "psql"),
            "-h",
            "127.0.0.1",
            "-p",
            str(server.port),
            "-U",
            "postgres",
            "-d",
            "t",
            "-tAc",
            "SELECT 40 + 2",
        ]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        out = subprocess.run(command, capture_output=True, timeout=30, check=True)
        self.assertEqual(out.stdout.strip(), b"42")
        server.stop()
        self.assertFalse(os.path.exists(server.directory))
        with socket.socket() as s:
            self.assertNotEqual(s.connect_ex(("127.0.0.1", server.port)), 0)

    def test_absent(self) -> None:
        """
        No binaries: skipped naming the package; under CI, a failure.
        """
        self.patch(pg_support, "find_bindir", lambda: None)
        self.patch(os, "environ", {**os.environ, "CI": "false"})
        with self.assertRaises(SkipTest) as skipped:
            pg_support.require_postgres()
        self.assertIn("'postgresql' package", str(skipped.exception))
        self.patch(os, "environ", {**os.environ, "CI": "true"})
        self.assertRaises(AssertionError, pg_support.require_postgres)


class RedisHarnessTests(SynchronousTestCase):
    def test_start_ping_stop(self) -> None:
        server = redis_support.RedisServer(redis_support.require_redis())
        self.addCleanup(server.stop)
        server.start()
        self.assertTrue(server._ping())
        server.stop()
        self.assertFalse(server._ping())
        self.assertFalse(os.path.exists(server.directory))

    def test_absent(self) -> None:
        # The modules redis_support calls.
        self.patch(shutil, "which", lambda name: None)
        self.patch(os.path, "exists", lambda path: False)
        self.patch(os, "environ", {**os.environ, "CI": "false"})
        with self.assertRaises(SkipTest) as skipped:
            redis_support.require_redis()
        self.assertIn("'redis-server' package", str(skipped.exception))
        self.patch(os, "environ", {**os.environ, "CI": "true"})
        self.assertRaises(AssertionError, redis_support.require_redis)


class PrometheusHarnessTests(SynchronousTestCase):
    def test_check_metrics(self) -> None:
        """
        C{promtool check metrics} passes a well-formed scrape and names the
        problem of a counter without C{_total}.
        """
        good = b"# HELP a_total A.\n# TYPE a_total counter\na_total 1\n"
        self.assertEqual(prometheus_support.check_metrics(good), (0, ""))
        bad = b"# HELP a A.\n# TYPE a counter\na 1\n"
        code, problems = prometheus_support.check_metrics(bad)
        self.assertNotEqual(code, 0)
        self.assertIn("_total", problems)

    def test_absent(self) -> None:
        """
        No binaries: skipped naming the package; under CI, a failure.
        """
        self.patch(shutil, "which", lambda name: None)
        self.patch(os.path, "exists", lambda path: False)
        self.patch(os, "environ", {**os.environ, "CI": "false"})
        for name in ("promtool", "prometheus"):
            with self.assertRaises(SkipTest) as skipped:
                prometheus_support.require(name)
            self.assertIn("'prometheus' package", str(skipped.exception))
        self.patch(os, "environ", {**os.environ, "CI": "true"})
        self.assertRaises(AssertionError, prometheus_support.require, "prometheus")
