"""
A node's state changes only by messages on its current link (issue 14,
case 7): the server's L{AgentHub} in this process on a real TCP port,
behind the production TLS options, agents played by TLS sockets that stop
reading, so that the server's writes back up and a link it closes stays
open (as over a cut path: TLS goes on reading while its close waits);
what they send then is what a healed path retransmits on the old
connection.
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, threads
from twisted.internet.task import deferLater
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.trial.unittest import TestCase

from llmgw.control.agents import AgentHub
from llmgw.control.inventory import Inventory
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import encode_frame
from llmgw.wire.tls import server_options
from tests.support import make_certs
from tests.typing_support import tcp_port


class _Heard:
    def __init__(self) -> None:
        self.registered: list[str] = []
        self.statuses: list[str] = []

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        self.registered.append(node_id)

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        self.statuses.append(status.shard_id)


def _frame(**kind: Any) -> bytes:
    return encode_frame(pb.AgentMessage(**kind).SerializeToString())


def _register() -> bytes:
    # One agent's (one agent_instance), connecting again in
    # test_replaced_link_ignored: another agent's would be refused.
    return _frame(
        register=pb.Register(node_id="n1", address="127.0.0.1", agent_instance="a1")
    )


def _ready(shard_id: str) -> bytes:
    status = pb.ShardStatus(shard_id=shard_id)
    status.state = pb.SHARD_STATE_READY
    return _frame(shard_status=status)


class LinkCurrentTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        from twisted.internet import reactor

        self.reactor = reactor
        self.ca = make_certs(
            tempfile.mkdtemp(prefix="llmgw-link-"), "127.0.0.1", ["n1"]
        )
        self.inventory = Inventory()
        # Silent for 6 heartbeats of 1 s: the link times out.
        self.hub = AgentHub(reactor, self.inventory, heartbeat_interval=1)
        self.heard = _Heard()
        self.hub.listen(self.heard)
        ca = self.ca
        factory = TLSMemoryBIOFactory(
            server_options(f"{ca}/ca.pem", f"{ca}/server.pem", f"{ca}/server-key.pem"),
            False,
            self.hub,
        )
        # Twisted annotates listenTCP for a ServerFactory; a wrapping one serves.
        listening = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[arg-type]
        self.addCleanup(listening.stopListening)
        self.port = tcp_port(listening)

    def agent(self) -> defer.Deferred[ssl.SSLSocket]:
        """
        Connect as n1 (the handshake in a thread: the server runs in this
        one); the connection never reads, so the server's writes to it
        back up.
        """
        context = ssl.create_default_context(cafile=os.path.join(self.ca, "ca.pem"))
        folder = os.path.join(self.ca, "agents", "n1")
        context.load_cert_chain(
            os.path.join(folder, "agent.pem"), os.path.join(folder, "agent-key.pem")
        )

        def connect() -> ssl.SSLSocket:
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.connect(("127.0.0.1", self.port))
            tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
            self.addCleanup(tls.close)
            return tls

        return threads.deferToThread(connect)

    @defer.inlineCallbacks
    def until(
        self, check: Callable[[], bool], seconds: float
    ) -> Generator[Any, Any, None]:
        deadline = time.monotonic() + seconds
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError("timed out")
            yield deferLater(self.reactor, 0.05, lambda: None)

    def back_up(self) -> None:
        """
        16 MiB of commands to n1 that its agent never reads.
        """
        for _ in range(8):
            command = pb.RemoveWeights(paths=["x" * 1_000_000, "y" * 1_000_000])
            d = self.hub.send("n1", pb.ControlMessage(remove_weights=command))
            d.addErrback(lambda _: None)

    @staticmethod
    def late(sock: ssl.SSLSocket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server closed it: as it should

    @defer.inlineCallbacks
    def test_timed_out_link_ignored(self) -> Generator[Any, Any, None]:
        """
        The link falls silent past its timeout; then it delivers a
        heartbeat and a shard status: neither counts (the node is not
        heard from, the status not told), and the node is disconnected.
        """
        old = yield self.agent()
        old.sendall(_register())
        yield self.until(lambda: "n1" in self.hub.links, 10)
        self.back_up()
        # Past the 6 s timeout (measured: the server closes it at 6 s).
        yield deferLater(self.reactor, 7.5, lambda: None)
        (node,) = self.inventory.nodes()
        heard = node.heard
        self.late(old, _frame(heartbeat=pb.Heartbeat()) + _ready("s1"))
        yield deferLater(self.reactor, 1.0, lambda: None)
        self.assertEqual(self.heard.statuses, [])
        self.assertEqual(node.heard, heard)
        self.assertFalse(node.connected)

    @defer.inlineCallbacks
    def test_replaced_link_ignored(self) -> Generator[Any, Any, None]:
        """
        The agent connects again; the old connection, still closing,
        delivers a Register and a shard status: the new link stays the
        node's, and the status is not told.
        """
        old = yield self.agent()
        old.sendall(_register())
        yield self.until(lambda: "n1" in self.hub.links, 10)
        self.back_up()
        new = yield self.agent()
        first = self.hub.links["n1"]
        new.sendall(_register())
        yield self.until(lambda: self.hub.links.get("n1") not in (None, first), 10)
        current = self.hub.links["n1"]
        self.late(old, _register() + _ready("s1"))
        yield deferLater(self.reactor, 1.0, lambda: None)
        self.assertIs(self.hub.links.get("n1"), current)
        self.assertEqual(self.heard.statuses, [])
        self.assertEqual(self.heard.registered, ["n1", "n1"])
        new.sendall(_ready("s2"))
        yield self.until(lambda: self.heard.statuses == ["s2"], 10)
