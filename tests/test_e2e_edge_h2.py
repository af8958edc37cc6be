"""
End to end, the hostile-client suite over HTTP/2 (TLS with ALPN C{h2}): a
rapid-reset flood (CVE-2023-44487) and more concurrent streams than the
server allows, each against a real C{twistd -n llmgw-server} with the C{h2}
library as the client, while a normal client keeps being served.  Both
defences are Twisted's and the C{h2} library's (see L{llmgw.router.edge.channel});
these tests hold them to bounds on the server's CPU time.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

import h2.config
import h2.connection
import h2.errors
import h2.events
from twisted.trial.unittest import SynchronousTestCase

from llmgw.wire.certs import init_ca, issue_server
from tests.edge_support import CHAT, P99_BOUND, EdgeServer

MODELS = [
    (":method", "GET"),
    (":path", "/v1/models"),
    (":authority", "127.0.0.1"),
    (":scheme", "https"),
]
# Seconds of server CPU a flood may cost.
CPU_BOUND = 10.0


def cpu_seconds(pid: int) -> float:
    """
    @return: the user and system CPU time of process C{pid}, seconds.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client(Protocol):
    """
    What the HTTP/2 client methods below read of the test case they run
    on: L{HTTP2BodyRateTests} borrows them from L{HTTP2Tests}.
    """

    ca: str
    port: int

    def addCleanup(self, f: Callable[..., object], *args: object) -> None: ...

    def assertEqual(
        self, first: object, second: object, msg: object = None
    ) -> None: ...


class HTTP2Tests(SynchronousTestCase, EdgeServer):
    """
    HTTP/2 clients that abuse streams cost bounded CPU and lose their
    connection with a GOAWAY.
    """

    timeout = 120

    def setUp(self) -> None:
        directory = tempfile.mkdtemp()
        self.ca = init_ca(directory)
        cert = issue_server(directory, ["127.0.0.1"])
        key = os.path.join(directory, "server-key.pem")
        self.start_edge(
            "",
            "--listen",
            f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        )
        self.url = self.url.replace("http:", "https:")

    def client_tls(self: _Client) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def h2_connect(
        self: _Client,
    ) -> tuple[ssl.SSLSocket, h2.connection.H2Connection]:
        context = ssl.create_default_context(cafile=self.ca)
        context.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        self.addCleanup(tls.close)
        self.assertEqual(tls.selected_alpn_protocol(), "h2")
        connection = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True)
        )
        connection.initiate_connection()
        tls.sendall(connection.data_to_send())
        return tls, connection

    def request_headers(self: object) -> list[tuple[str, str]]:
        return [
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "127.0.0.1"),
            (":scheme", "https"),
            ("content-type", "application/json"),
        ]

    def read_goaway(
        self, tls: ssl.SSLSocket, connection: h2.connection.H2Connection
    ) -> int | None:
        """
        Read until the server closes the connection.

        @return: the error code of the first GOAWAY it sent, if any.
        """
        codes = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                data = tls.recv(65536)
            except (ConnectionResetError, ssl.SSLError, TimeoutError):
                break
            if not data:
                break
            try:
                events = connection.receive_data(data)
            except h2.exceptions.ProtocolError:
                break
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    codes.append(event.error_code)
        if codes:
            print(f"GOAWAY: {len(codes)}, the first {codes[0]!r}")
        return codes[0] if codes else None

    def test_rapid_reset(self) -> None:
        """
        A client that opens streams and resets each at once, as fast as it
        can, gets a GOAWAY ENHANCE_YOUR_CALM after a bounded number, for a
        bounded cost in server CPU; a normal client is served meanwhile.
        """
        self.normal.run(20, 5.0)
        tls, connection = self.h2_connect()
        before = cpu_seconds(self.server.popen.pid)
        start = time.monotonic()
        sent = 0
        closed = False
        for batch in range(100):
            for _ in range(100):
                # A whole request (no body: a DATA frame each would soon
                # exhaust the flow-control window of a client that does not
                # read), then its reset.
                stream = connection.get_next_available_stream_id()
                connection.send_headers(stream, MODELS, end_stream=True)
                connection.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                sent += 1
            try:
                tls.sendall(connection.data_to_send())
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                closed = True
                break
            if batch % 5 == 4:
                self.normal.request()
        sent_at = time.monotonic()
        code = self.read_goaway(tls, connection)
        # Closed soon after the GOAWAY, not at the idle timeout (60 s).
        self.assertLess(time.monotonic() - sent_at, 5.0)
        elapsed = time.monotonic() - start
        cost = cpu_seconds(self.server.popen.pid) - before
        print(
            f"rapid reset: {sent} streams sent in {elapsed:.1f}s,"
            f" server CPU {cost:.2f}s, closed while sending: {closed}"
        )
        self.assertEqual(code, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        self.assertLess(cost, CPU_BOUND)
        self.normal.run(50, 5.0)
        self.assertLess(self.normal.p99(), P99_BOUND)
        self.note("HTTP/2 rapid reset")

    def test_too_many_streams(self) -> None:
        """
        A client that opens more concurrent streams than the 100 the server
        advertises (sent before it reads the server's settings) loses the
        connection with a GOAWAY; a normal client is served meanwhile, and
        a well-behaved HTTP/2 client after it.
        """
        tls, connection = self.h2_connect()
        for _ in range(150):
            stream = connection.get_next_available_stream_id()
            connection.send_headers(stream, self.request_headers())
        tls.sendall(connection.data_to_send())
        start = time.monotonic()
        code = self.read_goaway(tls, connection)
        self.assertEqual(code, h2.errors.ErrorCodes.PROTOCOL_ERROR)
        # Closed soon after the GOAWAY, not at the idle timeout (60 s).
        self.assertLess(time.monotonic() - start, 5.0)
        self.normal.run(50, 5.0)
        self.assertLess(self.normal.p99(), P99_BOUND)
        tls, connection = self.h2_connect()
        connection.send_headers(1, self.request_headers())
        connection.send_data(1, CHAT, end_stream=True)
        tls.sendall(connection.data_to_send())
        body = b""
        ended = False
        while not ended:
            data = tls.recv(65536)
            self.assertTrue(data, "connection closed")
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    body += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            tls.sendall(connection.data_to_send())
        self.assertTrue(json.loads(body)["choices"])
        # What the server advertised (h2's default, kept by Twisted).
        self.assertEqual(connection.remote_settings.max_concurrent_streams, 100)
        self.note("HTTP/2 too many streams")

    def test_http1_over_tls_error_answer(self) -> None:
        """
        Over TLS (no half-close there), an HTTP/1.1 request line of 100 KB
        still gets its 414 error object, and the connection closes promptly.
        """
        context = ssl.create_default_context(cafile=self.ca)
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        self.addCleanup(tls.close)
        start = time.monotonic()
        try:
            tls.sendall(b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            pass
        data = b""
        while True:
            try:
                chunk = tls.recv(65536)
            except (ConnectionResetError, ssl.SSLError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
        self.assertLess(time.monotonic() - start, 5.0)
        head, _, body = data.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 414 "), data[:200])
        self.assertEqual(json.loads(body)["error"]["code"], "uri_too_long")
        self.normal.request()


class HTTP2BodyRateTests(SynchronousTestCase, EdgeServer):
    """
    The minimum body rate holds over HTTP/2 as over HTTP/1.1.
    """

    timeout = 120
    client_tls = HTTP2Tests.client_tls
    h2_connect = HTTP2Tests.h2_connect
    request_headers = HTTP2Tests.request_headers

    def setUp(self) -> None:
        directory = tempfile.mkdtemp()
        self.ca = init_ca(directory)
        cert = issue_server(directory, ["127.0.0.1"])
        key = os.path.join(directory, "server-key.pem")
        self.start_edge(
            'min_body_rate = 1024\nbody_rate_window = "1s"\n',
            "--listen",
            f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        )

    def test_slow_body(self) -> None:
        """
        A stream whose body comes at a byte every 0.3 s (the connection's
        idle timeout pushed back by each) is reset within a few windows of
        1 s; it held on for ever (10 s and counting) before.  A request on
        the same connection at a normal rate is served.
        """
        tls, connection = self.h2_connect()
        connection.send_headers(1, self.request_headers())
        tls.sendall(connection.data_to_send())
        tls.settimeout(0.1)
        start = time.monotonic()
        reset_after = None
        while reset_after is None and time.monotonic() - start < 8:
            connection.send_data(1, b" ")
            tls.sendall(connection.data_to_send())
            time.sleep(0.3)
            try:
                data = tls.recv(65536)
            except (TimeoutError, ssl.SSLError):
                continue
            self.assertTrue(data, "connection closed")
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.StreamReset):
                    self.assertEqual(event.stream_id, 1)
                    reset_after = time.monotonic() - start
            tls.sendall(connection.data_to_send())
        print(f"HTTP/2 slow body: stream reset after {reset_after}s")
        self.assertIsNotNone(reset_after)
        assert reset_after is not None
        self.assertLess(reset_after, 4.0)
        tls.settimeout(10)
        connection.send_headers(3, self.request_headers())
        connection.send_data(3, CHAT, end_stream=True)
        tls.sendall(connection.data_to_send())
        body = b""
        ended = False
        while not ended:
            data = tls.recv(65536)
            self.assertTrue(data, "connection closed")
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    body += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            tls.sendall(connection.data_to_send())
        self.assertTrue(json.loads(body)["choices"])
        self.normal.run(20, 5.0)
        self.assertLess(self.normal.p99(), P99_BOUND)
