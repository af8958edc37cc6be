"""
Blocking work off the agent's reactor thread: its heartbeats stay on time
while the weights directories (100,000 real files) are scanned again and
again; on the real reactor, over a loopback link, in bounded time.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Generator
from typing import Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.task import LoopingCall, deferLater
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from llmgw.agent.link import AgentFactory, AgentProtocol
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.protocol import MessageStream
from tests.typing_support import tcp_port

FILES = 100_000


def _tree(root: str) -> str:
    """
    C{FILES} empty files in one Hugging Face cache entry under C{root}, 100
    folders of 1,000.

    @return: C{root}.
    """
    entry = os.path.join(root, "models--org--big")
    for i in range(FILES // 1000):
        folder = os.path.join(entry, f"d{i:03d}")
        os.makedirs(folder)
        for j in range(1000):
            with open(os.path.join(folder, f"f{j:04d}"), "wb"):
                pass
    return root


class _Server(MessageStream[pb.AgentMessage]):
    """
    Welcomes the agent with a heartbeat every second; notes when each
    heartbeat and each weights report arrives (monotonic seconds).
    """

    def __init__(self) -> None:
        super().__init__(pb.AgentMessage)
        self.heartbeats: list[float] = []
        self.reports: list[pb.WeightsReport] = []
        self.lost: Deferred[None] = Deferred()

    def message_received(self, message: pb.AgentMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "register":
            welcome = pb.Welcome(server_version="test", heartbeat_interval_seconds=1)
            self.send(pb.ControlMessage(welcome=welcome))
        elif kind == "heartbeat":
            self.heartbeats.append(time.monotonic())
        elif kind == "weights_report":
            self.reports.append(message.weights_report)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(None)


class HeartbeatDuringScanTests(TestCase):
    timeout = 180

    @defer.inlineCallbacks
    def test_heartbeats_on_time(self) -> Generator[Any, Any, None]:
        """
        While scans of 100,000 files run back to back for at least six
        heartbeat intervals, the heartbeats come every second (no gap over 1.5 s) and
        the reactor answers within 0.3 s; the scans report the files.
        """
        from twisted.internet import reactor

        weights = yield deferToThread(_tree, tempfile.mkdtemp(prefix="llmgw-scan-"))
        servers: list[_Server] = []

        def build() -> _Server:
            servers.append(_Server())
            return servers[-1]

        servers_factory = Factory.forProtocol(build)
        # Twisted annotates listenTCP for a ServerFactory; any factory serves.
        port = reactor.listenTCP(0, servers_factory, interface="127.0.0.1")  # type: ignore[arg-type]
        self.addCleanup(port.stopListening)
        factory = AgentFactory(
            lambda: pb.Register(node_id="n1"),
            pb.Heartbeat,
            cast(IEngineReactor, reactor),
            tempfile.mkdtemp(),
            weights_dirs=(weights,),
            in_thread=deferToThread,
        )
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", tcp_port(port))
        agent: AgentProtocol = yield endpoint.connect(factory)
        yield agent.registered

        lags: list[float] = []
        last = [time.monotonic()]

        def tick() -> None:
            now = time.monotonic()
            lags.append(now - last[0] - 0.02)
            last[0] = now

        ticker = LoopingCall(tick)
        ticker.start(0.02)
        started = time.monotonic()
        scans = 0
        while time.monotonic() - started < 6:
            yield agent.send_weights()
            scans += 1
        ticker.stop()
        took = time.monotonic() - started
        server = servers[0]
        agent.transport.loseConnection()  # type: ignore[union-attr]
        yield server.lost
        # Let the agent's end close too.
        yield deferLater(reactor, 0.05, lambda: None)

        report = server.reports[-1]
        self.assertEqual(
            [f.path for f in report.files], [os.path.join(weights, "models--org--big")]
        )
        beats = [t for t in server.heartbeats if t >= started]
        self.assertGreaterEqual(len(beats), 5, server.heartbeats)
        gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
        print(
            f"agent scan: {scans} scans in {took:.1f} s; worst reactor lag"
            f" {max(lags):.3f} s; worst heartbeat gap {max(gaps):.2f} s"
        )
        self.assertLess(max(gaps), 1.5, gaps)
        self.assertLess(
            max(lags), 0.3, f"{scans} scans in {took:.1f}s; worst lag {max(lags):.3f}s"
        )
