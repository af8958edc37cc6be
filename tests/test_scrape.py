"""
The C{/metrics} client (L{llmgw.router.scrape}): framing of answers fed in
pieces, one byte at a time included, over a L{StringTransport}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.scrape import PageProtocol, ScrapeError, build_request

BODY = b"vllm:num_requests_running 1.0\n" * 10


def chunked(body: bytes, size: int) -> bytes:
    out = b""
    for at in range(0, len(body), size):
        piece = body[at : at + size]
        out += b"%x\r\n" % len(piece) + piece + b"\r\n"
    return out + b"0\r\n\r\n"


class PageProtocolTests(SynchronousTestCase):
    def connect(self, max_size: int = 1 << 20) -> tuple[PageProtocol, StringTransport]:
        protocol = PageProtocol(max_size)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def answer(self, data: bytes, one_byte: bool = False) -> tuple[Any, PageProtocol]:
        protocol, transport = self.connect()
        d = protocol.get(build_request("h", 80, "/metrics", None))
        self.assertTrue(transport.value().startswith(b"GET /metrics HTTP/1.1\r\n"))
        pieces = [data[i : i + 1] for i in range(len(data))] if one_byte else [data]
        for piece in pieces:
            protocol.dataReceived(piece)
        return d, protocol

    def test_content_length_kept_alive(self) -> None:
        """
        A C{Content-Length} answer fires when complete; the connection stays
        reusable, and a second request on it works.
        """
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        d, protocol = self.answer(head + BODY, one_byte=True)
        self.assertEqual(self.successResultOf(d), (200, BODY))
        self.assertTrue(protocol.reusable)
        again = protocol.get(b"GET /metrics HTTP/1.1\r\n\r\n")
        protocol.dataReceived(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno")
        self.assertEqual(self.successResultOf(again), (404, b"no"))

    def test_chunked_one_byte_at_a_time(self) -> None:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        d, protocol = self.answer(head + chunked(BODY, 7), one_byte=True)
        self.assertEqual(self.successResultOf(d), (200, BODY))
        self.assertTrue(protocol.reusable)

    def test_connection_close(self) -> None:
        """
        C{Connection: close} and HTTP/1.0 answers close the connection; an
        answer with no length ends with the connection.
        """
        head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n"
        d, protocol = self.answer(head + b"ok")
        self.assertEqual(self.successResultOf(d), (200, b"ok"))
        self.assertFalse(protocol.reusable)
        d, protocol = self.answer(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        self.assertNoResult(d)
        protocol.connectionLost()
        self.assertEqual(self.successResultOf(d), (200, b"until the end"))

    def test_errors(self) -> None:
        """
        Not HTTP, too large, and a connection lost mid-body fail with
        L{ScrapeError}.
        """
        d, _ = self.answer(b"SSH-2.0-OpenSSH\r\n\r\n")
        self.failureResultOf(d, ScrapeError)
        protocol, _ = self.connect(max_size=10)
        d = protocol.get(b"GET / HTTP/1.1\r\n\r\n")
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        self.failureResultOf(d, ScrapeError)
        d, protocol = self.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        protocol.connectionLost()
        self.failureResultOf(d, ScrapeError)

    def test_cancel_aborts(self) -> None:
        protocol, transport = self.connect()
        d = protocol.get(b"GET / HTTP/1.1\r\n\r\n")
        d.cancel()
        self.assertTrue(transport.disconnecting)
        self.assertFalse(protocol.reusable)
        self.failureResultOf(d)

    def test_bearer(self) -> None:
        request = build_request("10.0.0.1", 8000, "/metrics", "s3cret")
        self.assertIn(b"\r\nAuthorization: Bearer s3cret\r\n", request)
        self.assertIn(b"\r\nHost: 10.0.0.1:8000\r\n", request)
