"""
Debian's Prometheus for tests: C{promtool check metrics} on a scrape, and a
throwaway C{prometheus} server on a free loopback port with its own
configuration and storage folder, stopped and removed when the test ends.

Binaries from Debian's C{prometheus} package (C{/usr/bin/promtool},
C{/usr/bin/prometheus}) or C{PATH}.  L{require} raises L{SkipTest} naming
the package when one is absent, or fails when C{CI=true}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tests.support import free_port, missing

PACKAGE = "prometheus"


def require(name: str) -> str:
    """
    @param name: C{promtool} or C{prometheus}.
    @return: the path of the binary.
    @raise SkipTest: it is missing and C{CI} is not C{true}.
    @raise AssertionError: it is missing under C{CI=true}.
    """
    debian = f"/usr/bin/{name}"
    path = shutil.which(name) or (debian if os.path.exists(debian) else None)
    if path is not None:
        return path
    why = f"{name} not found: install Debian's {PACKAGE!r} package"
    missing(why)


def check_metrics(text: bytes) -> tuple[int, str]:
    """
    Run C{promtool check metrics} on one scrape (it reads standard input).

    @return: its exit status and its output (problems, one a line).
    """
    done = subprocess.run(
        [require("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        timeout=60,
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


class PrometheusServer:
    """
    One C{prometheus} process scraping what its configuration says.

    @ivar url: its HTTP API's base, C{http://127.0.0.1:PORT}.
    """

    def __init__(self, binary: str, config: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = tempfile.mkdtemp(prefix="llmgw-prometheus-")
        self.config_path = os.path.join(self.directory, "prometheus.yml")
        with open(self.config_path, "w") as f:
            f.write(config)
        self.log_path = os.path.join(self.directory, "prometheus.log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        """
        Start it and wait until C{/-/ready} answers 200.

        @raise RuntimeError: it exited or was not ready in C{timeout}
            seconds (its log in the message).
        """
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={os.path.join(self.directory, 'data')}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
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
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        output = self.log()
        self.stop()
        raise RuntimeError(f"prometheus did not start:\n{output[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def query(self, expr: str) -> list[dict[str, Any]]:
        """
        One instant query through the HTTP API (C{/api/v1/query}).

        @return: the result's vector, each C{{"metric": {labels},
            "value": [time, "value"]}}.
        @raise AssertionError: the answer is not a successful vector.
        """
        address = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(address, timeout=10) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        assert answer["data"]["resultType"] == "vector", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

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


def start_prometheus(case: Any, config: str) -> PrometheusServer:
    """
    A Prometheus of this test's own with C{config} (YAML text), stopped
    and removed in its cleanup.

    @param case: a trial test case (for C{addCleanup}).
    @raise SkipTest: see L{require}.
    """
    server = PrometheusServer(require("prometheus"), config)
    case.addCleanup(server.stop)
    server.start()
    return server
