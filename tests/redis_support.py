"""
A throwaway Redis for tests: C{redis-server} on a free loopback port, no
persistence (C{--save "" --appendonly no}), its working folder temporary,
stopped and removed when the test ends.

Binary from Debian's C{redis-server} package (C{/usr/bin/redis-server}) or
C{PATH}.  L{start_redis} raises L{SkipTest} naming the package when it is
absent, or fails when C{CI=true}.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from tests.support import free_port, missing

PACKAGE = "redis-server"


def require_redis() -> str:
    """
    @return: the path of C{redis-server}.
    @raise SkipTest: it is missing and C{CI} is not C{true}.
    @raise AssertionError: it is missing under C{CI=true}.
    """
    path = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if path is not None:
        return path
    why = f"redis-server not found: install Debian's {PACKAGE!r} package"
    missing(why)


class RedisServer:
    """
    One C{redis-server} process.

    @ivar port: its TCP port on 127.0.0.1.
    @ivar url: C{redis://127.0.0.1:PORT/0}.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = tempfile.mkdtemp(prefix="llmgw-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """
        Start it and wait until it answers C{PING}.

        @raise RuntimeError: it exited or did not answer in C{timeout}
            seconds (its log in the message).
        """
        log_path = os.path.join(self.directory, "redis.log")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self.directory,
                    "--daemonize",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.directory,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if self._ping():
                return
            time.sleep(0.05)
        with open(log_path, errors="replace") as f:
            output = f.read()
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{output[-3000:]}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def halt(self) -> None:
        """
        SIGTERM (SIGKILL after 10 s), keeping the folder and the port, for
        L{start} again (an outage).
        """
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def stop(self) -> None:
        """
        SIGTERM (SIGKILL after 10 s) and remove the folder; safe twice.
        """
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def start_redis(case: Any) -> str:
    """
    A Redis of this test's own, stopped and removed in its cleanup.

    @param case: a trial test case (for C{addCleanup}).
    @return: its URL, C{redis://127.0.0.1:PORT/0}.
    @raise SkipTest: see L{require_redis}.
    """
    server = RedisServer(require_redis())
    case.addCleanup(server.stop)
    server.start()
    return server.url
