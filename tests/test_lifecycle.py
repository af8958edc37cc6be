"""
The server's stop as a named sequence: L{Lifecycle} on a Clock, and the
production wiring of C{makeService} started and stopped in this process,
on ephemeral ports, with an agent linked.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import Clock, deferLater
from twisted.logger import LogEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.daemon.lifecycle import STOP_STEPS, Lifecycle
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import encode_frame
from tests.typing_support import collect

ORDER = [
    "listeners stop accepting",
    "router drain",
    "reconciler stop",
    "agent links closed",
    "usage flushed",
    "local engines stopped",
    "connection pools closed",
    "store closed",
]
"""
The server's stop as issue 9 and the makeService docstring tell it.
"""


class _Recorder(Service):
    def __init__(self, name: str, record: list[str], wait: Deferred[None] | None):
        self.name = name
        self._record = record
        self._wait = wait

    def startService(self) -> None:
        super().startService()
        self._record.append(f"start {self.name}")

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._record.append(f"stop {self.name}")
        if self.name == "broken":
            raise RuntimeError("cannot stop")
        return self._wait


def _steps(events: list[LogEvent]) -> list[tuple[str, str]]:
    """
    @return: C{("stopping" | "stopped", step)} of the stop's log lines.
    """
    found = []
    for event in events:
        template = event.get("log_format", "")
        if template.startswith(("stopping: {step}", "stopped: {step}")):
            found.append((template.split(":", 1)[0], event["step"]))
    return found


class LifecycleTests(SynchronousTestCase):
    """
    L{Lifecycle} stops step by step, each step once the one before ended.
    """

    def test_steps_in_order_with_durations(self) -> None:
        """
        Every step is logged, an empty one too, with how long it took; a
        step waits for the one before; a service that fails to stop is
        logged and the stop goes on; the start goes last step first.
        """
        clock = Clock()
        record: list[str] = []
        slow: Deferred[None] = Deferred()
        top = Lifecycle(clock)
        top.add(STOP_STEPS[0], _Recorder("listener", record, None))
        top.add(STOP_STEPS[1], _Recorder("drain", record, slow))
        top.add(STOP_STEPS[1], _Recorder("broken", record, None))
        top.add(STOP_STEPS[-1], _Recorder("store", record, None))
        top.startService()
        self.assertEqual(
            record, ["start store", "start drain", "start broken", "start listener"]
        )
        del record[:]
        events: list[LogEvent] = []
        observer = collect(events)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        stopped = top.stopService()
        self.assertEqual(record, ["stop listener", "stop drain"])
        self.assertNoResult(stopped)
        clock.advance(2.5)
        slow.callback(None)
        self.successResultOf(stopped)
        self.assertEqual(
            record, ["stop listener", "stop drain", "stop broken", "stop store"]
        )
        expected = []
        for step in STOP_STEPS:
            expected += [("stopping", step), ("stopped", step)]
        self.assertEqual(_steps(events), expected)
        (drained,) = [
            e
            for e in events
            if e.get("log_format", "").startswith("stopped:")
            and e["step"] == STOP_STEPS[1]
        ]
        self.assertEqual(drained["seconds"], 2.5)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_unknown_step(self) -> None:
        """
        A step that is not in L{STOP_STEPS} is refused.
        """
        with self.assertRaises(KeyError):
            Lifecycle(Clock()).add("later", Service())


class _FakeAgent(Protocol):
    """
    Registers as node n1 over a plaintext link and notes when the server
    welcomes it and when the link ends.
    """

    def __init__(self) -> None:
        self.welcomed: Deferred[None] = Deferred()
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        register = pb.Register(node_id="n1", agent_version="test", cpus=1)
        message = pb.AgentMessage(register=register)
        self.transport.write(encode_frame(message.SerializeToString()))  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if not self.welcomed.called:
            self.welcomed.callback(None)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(None)


class MakeServiceStopTests(TestCase):
    """
    The production service tree, as C{twistd llmgw-server} builds it, on
    ephemeral ports with its own state directory.
    """

    timeout = 60

    @defer.inlineCallbacks
    def test_stop_order(self) -> Generator[Any, Any, None]:
        """
        A stop runs the named steps in the documented order, and the agent
        links are closed in their step: after the reconciler stopped,
        before the usage is flushed.
        """
        from twisted.internet import reactor

        from llmgw.server.tap import Options, makeService

        state = tempfile.mkdtemp(prefix="llmgw-lifecycle-")
        config = os.path.join(state, "server.toml")
        with open(config, "w") as f:
            f.write("insecure_agents = true\n")
        options = Options()
        options.parseOptions(
            [
                "--config",
                config,
                "--state-dir",
                state,
                "--listen",
                "tcp:0:interface=127.0.0.1",
                "--admin-listen",
                "tcp:0:interface=127.0.0.1",
                "--agent-listen",
                "tcp:0:interface=127.0.0.1",
                "--endpoint",
                "a=http://127.0.0.1:1=m",
            ]
        )
        events: list[Any] = []
        observer = collect(events)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        top = makeService(options)
        assert isinstance(top, Lifecycle)
        self.assertEqual(
            [
                (step, [type(s).__name__ for s in services])
                for step, services in top.steps()
            ],
            [
                (
                    ORDER[0],
                    ["ListeningService"] * 3 + ["RunnerStop", "ListeningService"],
                ),
                (ORDER[1], ["DrainService"]),
                (ORDER[2], ["Loop", "Runner", "LoadBoard", "History", "Watch"]),
                (ORDER[3], ["LinksService"]),
                (ORDER[4], ["UsageWriter", "UsageRetention", "ResponseRetention"]),
                (ORDER[5], []),
                (ORDER[6], ["PoolService"] * 2),
                (ORDER[7], ["StoreService"]),
            ],
        )
        top.startService()
        self.addCleanup(lambda: top.stopService() if top.running else None)
        (agent_port,) = [
            e["port"]
            for e in events
            if e.get("log_format", "").startswith("agent listener on")
        ]
        agent = _FakeAgent()
        yield connectProtocol(
            TCP4ClientEndpoint(reactor, "127.0.0.1", agent_port), agent
        )
        yield agent.welcomed
        # Let the reconciler's first pass run.
        yield deferLater(reactor, 0.1, lambda: None)
        del events[:]
        yield top.stopService()
        yield agent.lost
        expected = []
        for step in ORDER:
            expected += [("stopping", step), ("stopped", step)]
        self.assertEqual(_steps(events), expected)
        formats = [(e.get("log_format"), e.get("step")) for e in events]
        # The server's end of the link goes within its step.
        self.assertLess(
            formats.index(("stopping: {step}", "agent links closed")),
            formats.index(("agent {node} disconnected", None)),
        )
        self.assertLess(
            formats.index(("agent {node} disconnected", None)),
            formats.index(("stopped: {step} in {seconds:.3f}s", "agent links closed")),
        )
