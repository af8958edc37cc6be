"""
Helpers for end-to-end tests: start the daemons as a user would, as child
processes, and find the ports they listen on from what they print.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn
from unittest import SkipTest

if TYPE_CHECKING:
    from twisted.trial.unittest import SynchronousTestCase

    # The base of a mixin that calls the test case's own methods
    # (addCleanup, the assertions): what mypy checks those calls against.
    # At run time the test case it is mixed into provides them.
    CaseMixin = SynchronousTestCase
else:
    CaseMixin = object

BIN = os.path.dirname(sys.executable)
TWISTD = os.path.join(BIN, "twistd")


_home: list[str] = []


def hermetic_env() -> dict[str, str]:
    """
    The environment for a child process of a test: this process's, with
    C{HOME} and the XDG folders in a temporary folder of its own (made on
    first use, one per test process).  A daemon that falls back to its
    default state directory, C{~/.local/state/llmgw}, then never reads or
    writes the user's, nor meets the lock of a server the user runs there
    (a C{make run} in another terminal).  The user's C{LLMGW_*} variables
    (C{llmgw ctl}'s admin URL and key) are left out too.

    @return: a new dict, for C{subprocess}'s C{env}.
    """
    if not _home:
        _home.append(tempfile.mkdtemp(prefix="llmgw-home-"))
    home = _home[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["HOME"] = home
    env["XDG_STATE_HOME"] = os.path.join(home, ".local", "state")
    env["XDG_CONFIG_HOME"] = os.path.join(home, ".config")
    env["XDG_DATA_HOME"] = os.path.join(home, ".local", "share")
    return env


def missing(why: str, in_ci: str | None = None) -> NoReturn:
    """
    A system piece a test needs is absent (a Debian package, a set-up):
    skip naming it, except in CI (C{CI=true}), where C{.ci/run} installs
    it and its absence is a failure.

    @param why: what is missing and what provides it.
    @param in_ci: the message in CI, if other than C{why}.
    @raise AssertionError: under C{CI=true}.
    @raise SkipTest: elsewhere.
    """
    if os.environ.get("CI") == "true":
        raise AssertionError(why if in_ci is None else in_ci)
    raise SkipTest(why)


def free_port() -> int:
    """
    A TCP port that was free a moment ago on every address (for programs
    that cannot listen on port 0 and tell which port they got).

    Chosen at random from 10000 to 19999: below the kernel's ephemeral range
    (32768 to 60999 on Linux), where the outgoing connections of every other
    process, another test run beside this one among them, take their local
    ports, and below the engines' port ranges the tests configure (20000
    and up).  A port the kernel handed out as ephemeral was taken by such a
    connection before the server listened on it (seen: "Address already in
    use" with two make test runs side by side).
    """
    for _ in range(200):
        port = random.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free TCP port from 10000 to 19999")


def closed_port() -> int:
    """
    A port on 127.0.0.1 where nothing listens: connections are refused.
    """
    return free_port()


@dataclass
class Process:
    """
    A child process whose output goes to a file.
    """

    popen: subprocess.Popen[bytes]
    log_path: str

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """
        Wait until the output matches C{pattern}.

        @raise AssertionError: the process exited or the time ran out first.
        """
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            match = regex.search(self.output())
            if match is not None:
                return match
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"process exited with {self.popen.returncode} before"
                    f" printing {pattern!r}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(
            f"no {pattern!r} within {timeout} s:\n{self.output()[-3000:]}"
        )

    def stop(self, timeout: float = 10.0) -> int:
        """
        SIGTERM, then SIGKILL after C{timeout} seconds.

        A SIGKILLed child is waited for up to a minute: on a loaded 2-core CI
        machine (a real vLLM loading beside this test) one was seen not yet
        reaped 10 s after SIGKILL, and a teardown is no place to fail a test
        that passed.

        @return: the exit status.
        """
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(max(timeout, 60.0))
        return self.popen.returncode


def logged_usage(server: Process, rid: str) -> tuple[int, int, int]:
    """
    @param rid: the C{X-Request-ID} the client sent.
    @return: the status, prompt and completion tokens of the server's usage
        log line for that request (L{Process.wait_for}'s wait).
    """
    match = server.wait_for(
        rf"request \S+ client_id={rid} .*status=(\d+)"
        r" prompt_tokens=(\d+) completion_tokens=(\d+)"
    )
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def spawn(
    argv: list[str], directory: str, name: str, env: dict[str, str] | None = None
) -> Process:
    """
    Start C{argv} with its output in C{directory/name.log}.

    @param env: variables set on top of L{hermetic_env}.
    """
    log_path = os.path.join(directory, f"{name}.log")
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=directory,
            env={**hermetic_env(), **(env or {})},
        )
    return Process(popen, log_path)


class Processes:
    """
    Starts the simulator and the server for one test and stops them at its
    end.  Mix into a trial test case that has C{addCleanup} and C{mktemp}.
    """

    def _directory(self) -> str:
        directory = getattr(self, "_process_dir", None)
        if directory is None:
            directory = tempfile.mkdtemp(prefix="llmgw-e2e-")
            self._process_dir = directory
        return directory

    def start_sim(self, *args: str, model: str = "sim-model") -> tuple[Process, str]:
        """
        Start C{llmgw sim} on a free port.

        @return: the process and its base URL, C{http://127.0.0.1:PORT}.
        """
        process = spawn(
            [os.path.join(BIN, "llmgw"), "sim", "--port", "0", "--model", model, *args],
            self._directory(),
            f"sim-{time.monotonic_ns()}",
        )
        self.addCleanup(process.stop)  # type: ignore[attr-defined]
        match = process.wait_for(r"llmgw sim listening on (http://[\d.]+:\d+)")
        return process, match.group(1)

    def start_server(
        self,
        *args: str,
        config: str | None = None,
        state: str | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[Process, str, str]:
        """
        Start C{twistd -n llmgw-server} listening on free ports.

        @param config: TOML text for C{--config}, if any.
        @param state: a name for its state directory, to reuse it in a
            later start (after this one stopped); by default its own.
        @param env: variables set for it on top of L{hermetic_env}.
        @return: the process, the client API base URL and the admin base URL.
        """
        directory = self._directory()
        argv = [TWISTD, "-n", "--pidfile=", "llmgw-server"]
        if config is not None:
            path = os.path.join(directory, f"config-{time.monotonic_ns()}.toml")
            with open(path, "w") as f:
                f.write(config)
            argv += ["--config", path]
        if not any(a.startswith("--listen") for a in args):
            argv += ["--listen", "tcp:0:interface=127.0.0.1"]
        if not any(a.startswith("--admin-listen") for a in args):
            argv += ["--admin-listen", "tcp:0:interface=127.0.0.1"]
        if "--state-dir" not in args:
            # Its own store and certificates, not the user's.
            name = state or f"state-{time.monotonic_ns()}"
            argv += ["--state-dir", os.path.join(directory, name)]
        argv += list(args)
        process = spawn(argv, directory, f"server-{time.monotonic_ns()}", env)
        self.addCleanup(process.stop)  # type: ignore[attr-defined]
        match = process.wait_for(
            r"client API listening on ([\d.]+):(\d+), admin on ([\d.]+):(\d+)"
        )
        return (
            process,
            f"http://127.0.0.1:{match.group(2)}",
            f"http://127.0.0.1:{match.group(4)}",
        )


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """
    One plain HTTP exchange, for what the OpenAI client cannot send.

    @return: status, headers (lower-case names) and body.
    """
    request = urllib.request.Request(
        url, data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                response.read(),
            )
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def until_known(urls: list[str], key: str, seconds: float = 10.0) -> float:
    """
    Wait until every server or router at C{urls} admits C{key}: the
    others learn a key made through one by the store (PostgreSQL's
    notification, or their poll), which takes a moment.  A server that
    knows no key yet lets every request in, so each is first asked with
    a key no server has until it answers 401 (it knows some key), then
    with C{key} until it answers 200.  C{GET /v1/models} authenticates
    without counting against a key's rpm or tpm.

    @param urls: base URLs (scheme, host and port).
    @return: seconds until the last one admitted it.
    @raise AssertionError: one did not, within C{seconds}.
    """
    began = time.monotonic()
    deadline = began + seconds
    for url in urls:
        for asked, wanted in (("sk-llmgw-tests-no-such-key", 401), (key, 200)):
            while True:
                status, _, body = http(
                    "GET",
                    url + "/v1/models",
                    headers={"Authorization": f"Bearer {asked}"},
                )
                if status == wanted:
                    break
                if status not in (200, 401) or time.monotonic() > deadline:
                    raise AssertionError(
                        f"{url}: wanted {wanted} for the key, got {status} {body!r}"
                    )
                time.sleep(0.05)
    return time.monotonic() - began


def sim_stats(base_url: str) -> dict[str, Any]:
    """
    @return: the simulator's counters (C{GET /sim/stats}).
    """
    status, _, body = http("GET", base_url + "/sim/stats")
    assert status == 200, status
    result: dict[str, Any] = json.loads(body)
    return result


def llmgw_certs(*args: str) -> None:
    """
    Run C{llmgw certs ARGS} as an operator would.

    @raise subprocess.CalledProcessError: it failed.
    """
    subprocess.run(
        [os.path.join(BIN, "llmgw"), "certs", *args],
        check=True,
        timeout=60,
        capture_output=True,
        env=hermetic_env(),
    )


def make_certs(directory: str, hosts: str, nodes: list[str]) -> str:
    """
    A fleet CA, a server certificate for C{hosts} (comma-separated) and
    an agent certificate per node, made with C{llmgw certs} as an operator
    would.

    @return: the CA folder; agents' folders are C{CA/agents/NODE}.
    """
    ca = os.path.join(directory, "ca")
    for args in (
        ["init", "--dir", ca],
        ["server", "--dir", ca, "--host", hosts],
        *(["agent", "--dir", ca, "--node-id", node] for node in nodes),
    ):
        llmgw_certs(*args)
    return ca


def spawn_agent(
    directory: str,
    config: str,
    agent_port: int,
    node_id: str,
    tls_dir: str,
    *extra: str,
    env: dict[str, str] | None = None,
) -> Process:
    """
    Start C{twistd -n llmgw-agent} as an operator would: C{config} as its
    TOML file, dialing 127.0.0.1:C{agent_port}, its state in
    C{directory/state-NODE}.

    @param env: variables set on top of L{hermetic_env} (such as
        L{fake_nvml_env}'s).
    """
    path = os.path.join(directory, f"agent-{node_id}-{time.monotonic_ns()}.toml")
    with open(path, "w") as f:
        f.write(config)
    return spawn(
        [
            TWISTD,
            "-n",
            "--pidfile=",
            "llmgw-agent",
            "--config",
            path,
            "--server",
            f"127.0.0.1:{agent_port}",
            "--node-id",
            node_id,
            "--tls-dir",
            tls_dir,
            "--state-dir",
            os.path.join(directory, f"state-{node_id}"),
            *extra,
        ],
        directory,
        f"agent-{node_id}-{time.monotonic_ns()}",
        env,
    )


def fake_nvml_env(state: str) -> dict[str, str]:
    """
    @param state: the JSON file describing the GPUs (see
        L{tests.fake_nvml.pynvml}).
    @return: the variables that make a daemon import the fake C{pynvml}.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.join(here, "fake_nvml"), os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "FAKE_NVML_STATE": state,
    }


class CtlMixin:
    """
    C{llmgw ctl} against C{self.admin_url}, as an operator runs it, with
    stdin from /dev/null (never the test runner's terminal: ctl asks a
    terminal before deleting).
    """

    admin_url: str

    def ctl(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        """
        @param ok: fail unless it exits with 0.
        """
        done = subprocess.run(
            [os.path.join(BIN, "llmgw"), "ctl", "--admin-url", self.admin_url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=hermetic_env(),
            stdin=subprocess.DEVNULL,
        )
        if ok and done.returncode != 0:
            raise AssertionError(f"llmgw ctl {' '.join(args)}: {done.stderr}")
        return done

    def ctl_json(self, *args: str) -> Any:
        """
        @return: C{llmgw ctl --json ARGS}'s answer.
        """
        return json.loads(self.ctl("--json", *args).stdout)
