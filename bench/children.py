"""
Child processes of a benchmark run: started with their output in a file,
found ready by a line they print, stopped last started first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

START_TIMEOUT = 30.0
"""
Seconds a child process has to print its listening line.
"""

STOP_TIMEOUT = 10.0
"""
Seconds between SIGTERM and SIGKILL, and after SIGKILL.
"""


class BenchError(Exception):
    """
    The benchmark cannot go on: a process did not start, a check failed.
    """


@dataclass
class Child:
    """
    A child process whose stdout and stderr go to C{log_path}.
    """

    name: str
    popen: subprocess.Popen[bytes]
    log_path: str

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for(self, pattern: str) -> re.Match[str]:
        """
        Wait until the output matches C{pattern}.

        @raise BenchError: the process exited or C{START_TIMEOUT} passed first.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            # Only the first lines: the server logs one line per request.
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                match = regex.search(f.read(65536))
            if match is not None:
                return match
            if self.popen.poll() is not None:
                raise BenchError(
                    f"{self.name} exited with {self.popen.returncode}:\n"
                    + self.output()[-3000:]
                )
            time.sleep(0.05)
        raise BenchError(
            f"{self.name}: no {pattern!r} in {START_TIMEOUT} s:\n"
            + self.output()[-3000:]
        )

    def cpu_seconds(self) -> float:
        """
        @return: user and system CPU seconds the process has used so far
            (C{/proc/PID/stat}, fields 14 and 15, in clock ticks; C{taskset}
            execs the program, so the pid is the program's).
        """
        with open(f"/proc/{self.popen.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """
        SIGTERM, then SIGKILL after C{STOP_TIMEOUT} seconds.
        """
        if self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(STOP_TIMEOUT)


class Children:
    """
    Starts child processes and stops them all, last started first.
    """

    def __init__(self, directory: str, pin: bool) -> None:
        self._directory = self.directory = directory
        self._pin = pin
        self._children: list[Child] = []

    def pinned(self, core: str, argv: list[str]) -> list[str]:
        """
        C{argv} run on C{core}, when pinning.
        """
        return ["taskset", "-c", core, *argv] if self._pin else argv

    def start(
        self,
        name: str,
        core: str,
        argv: list[str],
        env: dict[str, str] | None = None,
    ) -> Child:
        """
        @param env: the child's environment; this process's when L{None}.
        """
        log_path = os.path.join(self._directory, f"{name}.log")
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                self.pinned(core, argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._directory,
                env=env,
            )
        child = Child(name, popen, log_path)
        self._children.append(child)
        return child

    def find(self, name: str) -> Child:
        """
        @return: the child started as C{name}.
        @raise KeyError: none was.
        """
        for child in self._children:
            if child.name == name:
                return child
        raise KeyError(name)

    def all(self) -> list[Child]:
        """
        The children started so far, in order.
        """
        return list(self._children)

    def stop_all(self) -> None:
        for child in reversed(self._children):
            try:
                child.stop()
            except Exception as e:  # keep stopping the others
                sys.stderr.write(f"router_bench: stopping {child.name}: {e}\n")
