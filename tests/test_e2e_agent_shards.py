"""
Shards through a real link: an agent process (C{twistd llmgw-agent}) over
mutual TLS to an L{AgentHub} in this process, starting, stopping and
adopting engine processes, and stopping while blocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, threads
from twisted.internet.task import deferLater
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from llmgw.control.agents import AgentHub
from llmgw.control.inventory import Inventory
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.protocol import CommandFailed
from llmgw.wire.tls import server_options
from tests.support import (
    TWISTD,
    free_port,
    http,
    llmgw_certs,
    spawn,
)
from tests.typing_support import tcp_port


class _Heard:
    """
    The hub's listener (the control plane's place): what the links told.
    """

    def __init__(self) -> None:
        self.statuses: list[tuple[str, pb.ShardStatus]] = []

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        pass

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        self.statuses.append((node_id, status))


class _LinkedAgent(TestCase):
    """
    Commands through the real link: the server's AgentHub runs in this
    test's reactor behind the production TLS options; the agent is a
    twistd llmgw-agent process; the engine is llmgw sim.
    """

    timeout = 120

    # trial waits for the Deferred a setUp returns; unittest's own setUp
    # returns nothing.
    @defer.inlineCallbacks
    def setUp(self) -> Generator[Any, Any, None]:  # type: ignore[override]
        from twisted.internet import reactor

        self.dir = tempfile.mkdtemp(prefix="llmgw-shards-")
        ca = os.path.join(self.dir, "ca")
        for args in (
            ["init", "--dir", ca],
            ["server", "--dir", ca, "--host", "127.0.0.1"],
            ["agent", "--dir", ca, "--node-id", "gpu-01"],
        ):
            llmgw_certs(*args)
        self.inventory = Inventory()
        self.hub = AgentHub(reactor, self.inventory)
        self.heard = _Heard()
        self.hub.listen(self.heard)
        factory = TLSMemoryBIOFactory(
            server_options(f"{ca}/ca.pem", f"{ca}/server.pem", f"{ca}/server-key.pem"),
            False,
            self.hub,
        )
        # Twisted annotates listenTCP for a ServerFactory; a wrapping one serves.
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[arg-type]
        self.addCleanup(port.stopListening)
        self.agent_argv = [
            TWISTD,
            "-n",
            "--pidfile=",
            "llmgw-agent",
            "--server",
            f"127.0.0.1:{tcp_port(port)}",
            "--node-id",
            "gpu-01",
            "--tls-dir",
            f"{ca}/agents/gpu-01",
            "--state-dir",
            os.path.join(self.dir, "state"),
        ]
        self.agent = spawn(self.agent_argv, self.dir, "agent")
        self.addCleanup(lambda: self.agent.stop())
        yield self.until(lambda: "gpu-01" in self.hub.links, 30)

    @defer.inlineCallbacks
    def until(
        self, condition: Callable[[], bool], seconds: float
    ) -> Generator[Any, Any, None]:
        from twisted.internet import reactor

        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; agent log:\n{self.agent.output()}")
            yield deferLater(reactor, 0.05, lambda: None)

    def states(self, shard_id: str) -> list[str]:
        return [
            pb.ShardState.Name(s.state)
            for node, s in self.heard.statuses
            if node == "gpu-01" and s.shard_id == shard_id
        ]

    def start(self, shard_id: str, model: str, port: int, args: list[str]) -> Any:
        return self.hub.links["gpu-01"].send_command(
            pb.ControlMessage(
                start_shard=pb.StartShard(
                    shard_id=shard_id,
                    model=model,
                    engine="sim",
                    port=port,
                    args=args,
                )
            )
        )


class ShardLifecycleTests(_LinkedAgent):
    """
    Shards started, stopped, failed and adopted through the real link.
    """

    @defer.inlineCallbacks
    def test_start_ready_stop(self) -> Generator[Any, Any, None]:
        """
        StartShard for the sim engine: starting, then ready once it answers
        its health URL; it serves at its port; StopShard stops it and its
        process group is gone.
        """
        port = free_port()
        model = f"m-{os.getpid()}-{port}"
        self.addCleanup(subprocess.run, ["pkill", "-f", "--", f"--model {model}"])
        result = yield self.start("s1", model, port, [])
        self.assertTrue(result.ok)
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s1"), 30)
        self.assertEqual(
            self.states("s1"), ["SHARD_STATE_STARTING", "SHARD_STATE_READY"]
        )
        status, _, body = yield threads.deferToThread(
            http, "GET", f"http://127.0.0.1:{port}/v1/models"
        )
        self.assertEqual(json.loads(body)["data"][0]["id"], model)
        pgid = int(
            subprocess.run(
                ["pgrep", "-f", "--", f"--model {model}"],
                capture_output=True,
                text=True,
            ).stdout.split()[0]
        )
        # The engine leads a process group of its own (a new session).
        self.assertEqual(os.getpgid(pgid), pgid)
        os.killpg(pgid, 0)
        result = yield self.hub.links["gpu-01"].send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s1", grace_seconds=5))
        )
        self.assertTrue(result.ok)
        yield self.until(lambda: "SHARD_STATE_STOPPED" in self.states("s1"), 15)
        with self.assertRaises(ProcessLookupError):
            os.killpg(pgid, 0)

    @defer.inlineCallbacks
    def test_bad_args_fail_with_tail(self) -> Generator[Any, Any, None]:
        """
        An engine that exits at once (bad arguments) is reported failed,
        with its exit code and its last output lines; a port in use is
        refused before launch, saying so.
        """
        port = free_port()
        result = yield self.start("s2", "m", port, ["--no-such-flag"])
        self.assertTrue(result.ok)
        yield self.until(lambda: "SHARD_STATE_FAILED" in self.states("s2"), 30)
        (failed,) = [
            s for _, s in self.heard.statuses if s.state == pb.SHARD_STATE_FAILED
        ]
        self.assertTrue(failed.has_exit_code)
        self.assertEqual(failed.exit_code, 2)
        self.assertIn(
            "unrecognized arguments: --no-such-flag", "\n".join(failed.output_tail)
        )
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            failure = yield self.assertFailure(
                self.start("s3", "m", taken.getsockname()[1], []), CommandFailed
            )
        self.assertIn("is not free", str(failure))
        failure = yield self.assertFailure(
            self.start("../../escape", "m", free_port(), []), CommandFailed
        )
        self.assertIn("shard_id: bad value '../../escape'", str(failure))
        # Hostile fields get an answer and leave the link up.
        failure = yield self.assertFailure(
            self.start("s6", "m", 70000, []), CommandFailed
        )
        self.assertIn("port: bad value 70000", str(failure))
        link = self.hub.links["gpu-01"]
        failure = yield self.assertFailure(
            link.send_command(
                pb.ControlMessage(
                    start_shard=pb.StartShard(
                        shard_id="s7",
                        model="m",
                        engine="sim",
                        port=free_port(),
                        env={"A": "x\x00y"},
                    )
                )
            ),
            CommandFailed,
        )
        self.assertIn("env: bad variable", str(failure))
        self.assertIs(self.hub.links["gpu-01"], link)
        self.assertNotIn("Traceback", self.agent.output())

    @defer.inlineCallbacks
    def test_agent_restart_adopts_engine(self) -> Generator[Any, Any, None]:
        """
        An engine keeps serving while its agent restarts; the new agent
        adopts the same pid (listed in its Register), reports it ready
        again, starts no second engine, and can still stop it.
        """
        port = free_port()
        model = f"m-{os.getpid()}-{port}"
        self.addCleanup(subprocess.run, ["pkill", "-f", "--", f"--model {model}"])
        yield self.start("s4", model, port, [])
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s4"), 30)

        def engines() -> list[int]:
            found = subprocess.run(
                ["pgrep", "-f", "--", f"--model {model}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            return [int(p) for p in found]

        (pid,) = engines()
        first_link = self.hub.links["gpu-01"]
        self.assertEqual(self.agent.stop(), -signal.SIGTERM)
        status, _, _ = yield threads.deferToThread(
            http, "GET", f"http://127.0.0.1:{port}/health"
        )
        self.assertEqual(status, 200)
        self.heard.statuses.clear()
        self.agent = spawn(self.agent_argv, self.dir, "agent-again")
        yield self.until(
            lambda: self.hub.links.get("gpu-01") not in (None, first_link), 30
        )
        (node,) = self.inventory.nodes()
        self.assertEqual([(s["id"], s["pid"]) for s in node.shards], [("s4", pid)])
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s4"), 30)
        self.assertEqual(engines(), [pid])
        self.assertIn("adopted shard s4", self.agent.output())
        result = yield self.hub.links["gpu-01"].send_command(
            pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s4", grace_seconds=5))
        )
        self.assertTrue(result.ok)
        yield self.until(lambda: "SHARD_STATE_STOPPED" in self.states("s4"), 15)
        with self.assertRaises(ProcessLookupError):
            os.killpg(pid, 0)

    @defer.inlineCallbacks
    def test_taken_port_and_gpus_refused(self) -> Generator[Any, Any, None]:
        """
        A start on the port or GPUs of a shard this agent runs (still
        loading: its port not yet bound) is refused with the code the
        server takes as a placement fact, not an engine failure.
        """
        port = free_port()
        model = f"m-{os.getpid()}-{port}"
        self.addCleanup(subprocess.run, ["pkill", "-f", "--", f"--model {model}"])
        link = self.hub.links["gpu-01"]

        def start(shard_id: str, port: int, gpus: list[int]) -> Any:
            command = pb.StartShard(
                shard_id=shard_id,
                model=model,
                engine="sim",
                port=port,
                gpu_indices=gpus,
            )
            return link.send_command(pb.ControlMessage(start_shard=command))

        yield start("s6", port, [0])
        for shard_id, other, gpus, code in (
            ("s7", port, [1], "port_in_use"),
            ("s8", free_port(), [0, 1], "gpus_in_use"),
        ):
            with self.assertRaises(CommandFailed) as raised:
                yield start(shard_id, other, gpus)
            self.assertEqual(raised.exception.result.code, code)
        yield self.until(lambda: "SHARD_STATE_READY" in self.states("s6"), 30)


class DrainAndStopTests(_LinkedAgent):
    """
    Stops of unknown shards, and the agent stopping while blocked.
    """

    @defer.inlineCallbacks
    def test_stop_unknown_shard(self) -> Generator[Any, Any, None]:
        """
        The agent times no drain (the protocol has no such command since
        drains became the server's: it stops sending requests, waits for
        those in flight, then sends StopShard); a StopShard for a shard the
        agent does not run is refused with its id, and the link stays up.
        """

        def refused(failure: Failure) -> pb.CommandResult:
            refusal = failure.value
            assert isinstance(refusal, CommandFailed), failure
            return refusal.result

        result = (
            yield self.hub.links["gpu-01"]
            .send_command(pb.ControlMessage(stop_shard=pb.StopShard(shard_id="s5")))
            .addErrback(refused)
        )
        self.assertIn("no shard 's5'", result.error)

    def test_sigterm_while_blocked(self) -> None:
        """
        An agent whose TLS handshake hangs (a server that accepts and never
        answers) still exits within 5 s of SIGTERM.
        """
        silent = socket.socket()
        self.addCleanup(silent.close)
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        argv = list(self.agent_argv)
        argv[argv.index("--server") + 1] = f"127.0.0.1:{silent.getsockname()[1]}"
        argv[argv.index("--state-dir") + 1] = os.path.join(self.dir, "state-blocked")
        agent = spawn(argv, self.dir, "agent-blocked")
        self.addCleanup(agent.stop)
        agent.wait_for("dialing", timeout=30)
        accepted, _ = silent.accept()
        self.addCleanup(accepted.close)
        time.sleep(1)
        started = time.monotonic()
        agent.popen.send_signal(signal.SIGTERM)
        agent.popen.wait(10)
        self.assertLess(time.monotonic() - started, 5)
