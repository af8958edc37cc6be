"""
The connection edge (L{llmgw.router.edge.channel}) on a L{Clock}: which deadline
runs in which phase of a connection, what is answered when one passes, and
the connection caps' counting and log line; and the open-file limit
raised at start (L{llmgw.daemon.fdlimit}).  The same behaviours through a
real server: L{tests.test_e2e_edge_http1}.
"""

from __future__ import annotations

import json
import resource
from dataclasses import replace
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.static import Data

from llmgw.router.edge.channel import LINGER
from llmgw.router.edge.connections import EdgeSite
from llmgw.router.settings import RouterConfig
from tests.typing_support import collect


class HalfCloseable(StringTransport):
    """
    A transport that records a half-close.
    """

    write_closed = False
    aborted = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


class EdgeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.settings = RouterConfig()

    def connect(self, host: str = "10.0.0.1") -> tuple[Any, HalfCloseable, EdgeSite]:
        site = getattr(self, "site", None)
        if site is None:
            root = Resource()
            root.putChild(b"", Data(b"ok", "text/plain"))
            site = EdgeSite(root, self.settings, self.clock)
            self.site = site
        address = IPv4Address("TCP", host, 40000)
        protocol = site.buildProtocol(address)
        transport = HalfCloseable(peerAddress=address)
        protocol.makeConnection(transport)
        return protocol, transport, site

    def answer(self, transport: HalfCloseable) -> tuple[int, Any]:
        head, _, body = transport.value().partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), json.loads(body)

    def close(self, protocol: Any) -> None:
        from twisted.internet.error import ConnectionDone
        from twisted.python.failure import Failure

        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_header_deadline_not_pushed_back(self) -> None:
        """
        The header deadline runs from the request's first byte: a header
        line every 3 s does not push it back; at 10 s the client gets a 408
        error object, the write side is closed, and the connection is
        aborted L{LINGER} seconds later.
        """
        protocol, transport, _ = self.connect()
        protocol.dataReceived(b"GET / HTTP/1.1\r\n")
        for i in range(3):
            self.clock.advance(3)
            protocol.dataReceived(b"X-%d: 1\r\n" % i)
        self.assertEqual(transport.value(), b"")
        self.clock.advance(1)
        status, body = self.answer(transport)
        self.assertEqual((status, body["error"]["code"]), (408, "header_timeout"))
        self.assertTrue(transport.write_closed)
        protocol.dataReceived(b"X-late: 1\r\n\r\n")
        self.clock.advance(LINGER)
        self.assertTrue(transport.aborted)
        self.close(protocol)

    def test_keepalive_between_requests(self) -> None:
        """
        After an answer the keep-alive timeout runs, not the header
        deadline; when it passes the connection closes without an answer.
        """
        self.settings = replace(self.settings, keepalive_timeout=30.0)
        protocol, transport, _ = self.connect()
        protocol.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"200 OK", transport.value())
        transport.clear()
        self.clock.advance(29)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), b"")
        self.close(protocol)

    def test_body_rate(self) -> None:
        """
        A body slower than C{min_body_rate} over a window is a 408; one at
        the rate is read on.
        """
        self.settings = replace(self.settings, min_body_rate=100, body_rate_window=1.0)
        protocol, transport, _ = self.connect()
        protocol.dataReceived(b"POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
        protocol.dataReceived(b"x" * 100)
        self.clock.advance(1)
        self.assertEqual(transport.value(), b"")
        protocol.dataReceived(b"x" * 99)
        self.clock.advance(1)
        status, body = self.answer(transport)
        self.assertEqual((status, body["error"]["code"]), (408, "body_timeout"))
        self.clock.advance(LINGER)
        self.close(protocol)

    def test_oversize_and_framing(self) -> None:
        """
        414 for a long request line, 431 for large headers, 400 for
        Content-Length with Transfer-Encoding, each as an error object.
        """
        self.settings = replace(
            self.settings, max_request_line=1024, max_header_size=2048
        )
        cases = [
            (b"GET /" + b"a" * 1100 + b" HTTP/1.1\r\n", 414, "uri_too_long"),
            (b"GET /" + b"a" * 3000, 414, "uri_too_long"),
            (
                b"GET / HTTP/1.1\r\nX: " + b"b" * 2100 + b"\r\n",
                431,
                "request_header_fields_too_large",
            ),
            (
                b"GET / HTTP/1.1\r\n" + b"X: 12345678\r\n" * 200,
                431,
                "request_header_fields_too_large",
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n",
                400,
                "invalid_framing",
            ),
            (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", 400, "invalid_http"),
        ]
        for request, status, code in cases:
            protocol, transport, _ = self.connect()
            # One byte at a time: the limits hold however the bytes come.
            for i in range(len(request)):
                protocol.dataReceived(request[i : i + 1])
            self.assertEqual(self.answer(transport)[0], status, request[:40])
            self.assertEqual(self.answer(transport)[1]["error"]["code"], code)
            self.clock.advance(LINGER)
            self.close(protocol)

    def test_caps_and_one_log_line(self) -> None:
        """
        Past the per-client cap a connection gets a 503 and is not counted;
        closing one makes room; the refusals make one log line per 10 s.
        """
        self.settings = replace(
            self.settings,
            max_connections=3,
            max_connections_per_client=2,
            keepalive_timeout=0.0,
        )
        events: list[dict[str, Any]] = []
        self.connect()
        self.site.logger = Logger(observer=collect(events))
        first, _, site = self.connect()
        refused = [self.connect()[1] for _ in range(3)]
        self.assertEqual(site.open_connections, 2)
        self.assertEqual(self.answer(refused[0])[0], 503)
        self.assertTrue(refused[0].disconnecting)
        self.assertEqual(len(events), 1, events)
        self.clock.advance(10)
        self.connect()
        self.assertEqual(len(events), 2)
        # The two held back, and this one.
        self.assertEqual(events[1]["refused"], 3)
        self.connect("10.0.0.2")
        self.assertEqual(self.answer(self.connect("10.0.0.3")[1])[0], 503)
        self.assertEqual(site.refused_connections, 5)
        self.close(first)
        self.assertEqual(site.open_connections, 2)
        self.connect()
        self.assertEqual(site.open_connections, 3)


class OpenFileLimitTests(SynchronousTestCase):
    """
    L{raise_open_file_limit} with C{resource}'s calls replaced.
    """

    def limits(self, soft: int, hard: int, refuse: bool = False) -> list[Any]:
        from llmgw.daemon import fdlimit

        calls: list[Any] = []
        state = [soft, hard]

        def getrlimit(which: int) -> tuple[int, int]:
            return state[0], state[1]

        def setrlimit(which: int, value: tuple[int, int]) -> None:
            if refuse:
                raise ValueError("not allowed")
            calls.append(value)
            state[0] = value[0]

        # The resource module fdlimit calls.
        self.patch(resource, "getrlimit", getrlimit)
        self.patch(resource, "setrlimit", setrlimit)
        events: list[dict[str, Any]] = []
        self.patch(fdlimit, "log", Logger(observer=collect(events)))
        return [calls, events]

    def test_raised_to_hard(self) -> None:
        """
        The soft limit is raised to the hard one and the line says both.
        """
        from llmgw.daemon.fdlimit import raise_open_file_limit

        calls, events = self.limits(1024, 65536)
        self.assertEqual(raise_open_file_limit(16384), 65536)
        self.assertEqual(calls, [(65536, 65536)])
        self.assertEqual(len(events), 1)
        self.assertEqual((events[0]["soft"], events[0]["target"]), (1024, 65536))

    def test_refused_and_too_low(self) -> None:
        """
        A refused raise is a warning, and a cap that cannot fit under the
        limit is another, naming both numbers.
        """
        from llmgw.daemon.fdlimit import raise_open_file_limit

        calls, events = self.limits(1024, 4096, refuse=True)
        self.assertEqual(raise_open_file_limit(16384), 1024)
        self.assertEqual(calls, [])
        self.assertEqual(len(events), 2)
        self.assertEqual((events[1]["cap"], events[1]["soft"]), (16384, 1024))
