"""
The C{/metrics} client (L{llmgw.router.upstream.scrape}): framing of answers fed in
pieces, one byte at a time included, over a L{StringTransport}; and the
load poller over loopback sockets refusing answers that are not HTTP/1.1.
"""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet import reactor
from twisted.internet.testing import StringTransport
from twisted.logger import LogEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.reactors import IConnectingReactor
from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.load import LoadBoard, LoadCollector, make_scraper
from llmgw.router.upstream.scrape import PageProtocol, ScrapeError, build_request
from tests.http1_support import ScriptedServer, until
from tests.typing_support import collect

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


PAGE = b"vllm:num_requests_running 3.0\nvllm:num_requests_waiting 5.0\n"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class PollerOverSocketsTests(TestCase):
    """
    The load poller as the servers wire it (L{make_scraper}, L{LoadBoard},
    L{LoadCollector}) against a scripted engine on loopback: answers that
    are not valid HTTP/1.1 leave the replica's load unreadable.
    """

    timeout = 20

    async def poll(self, answer: bytes) -> tuple[LoadBoard, str]:
        """
        Poll one replica whose engine answers C{GET /metrics} with
        C{answer}.

        @return: the board after the poll, and the collector's exposition.
        """
        server = ScriptedServer([answer])
        base = server.listen().decode()
        self.addCleanup(server.stop)
        board = LoadBoard(
            reactor,
            make_scraper(cast(IConnectingReactor, reactor), 5.0, 1.0),
            interval=1.0,
        )
        board.set_endpoints([Endpoint("r1", base, ("m",))])
        self.addCleanup(board.scraper.close_all)
        board.poll_all()
        await until(lambda: board._targets["r1"].in_flight is None)
        registry = CollectorRegistry()
        registry.register(LoadCollector(board))
        return board, generate_latest(registry).decode()

    async def test_valid_answer_read(self) -> None:
        """
        The control: a valid chunked page gives a reading.
        """
        board, exposed = await self.poll(
            CHUNKED_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(PAGE), PAGE)
        )
        reading = board.reading("r1")
        assert reading is not None
        self.assertEqual((reading.running, reading.waiting), (3.0, 5.0))
        self.assertIn(
            'llmgw_engine_metrics_available{model="m",replica="r1"} 1.0', exposed
        )
        self.assertIn('llmgw_engine_load_stale{model="m",replica="r1"} 0.0', exposed)

    async def assert_unavailable(self, answer: bytes, why: str = "") -> None:
        log: list[LogEvent] = []
        observer = collect(log)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        board, exposed = await self.poll(answer)
        self.assertIsNone(board.reading("r1"))
        self.assertIn('llmgw_engine_load_stale{model="m",replica="r1"} 1.0', exposed)
        self.assertNotIn("llmgw_engine_requests_running{", exposed)
        warnings = [
            e for e in log if "cannot read engine load" in e.get("log_format", "")
        ]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["replica"], "r1")
        self.assertIn(why, warnings[0]["why"])

    async def test_chunk_data_not_followed_by_crlf(self) -> None:
        await self.assert_unavailable(CHUNKED_HEAD + b"5\r\nhelloXY0\r\n\r\n")

    async def test_negative_content_length(self) -> None:
        await self.assert_unavailable(
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n" + PAGE
        )

    async def test_bare_lf_chunk_end(self) -> None:
        await self.assert_unavailable(
            CHUNKED_HEAD + b"%x\r\n%s\n0\r\n\r\n" % (len(PAGE), PAGE)
        )

    async def test_switching_protocols(self) -> None:
        await self.assert_unavailable(
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE)
        )

    async def test_endless_interim_answers(self) -> None:
        """
        An engine that sends a thousand C{103 Early Hints} before its page
        is refused at the eleventh: its load unreadable, the warning
        naming the replica and why.
        """
        hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
        await self.assert_unavailable(
            hints * 1000
            + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE),
            "not valid HTTP/1.1: more than 10 interim (1xx) answers",
        )

    async def test_answer_that_stops_mid_body(self) -> None:
        """
        An engine that sends a head and then nothing: the poll times out,
        the reading is unavailable, the connection is aborted, and nothing
        else is logged (the cancelled poll used to be failed a second time
        by the connection's loss: an C{AlreadyCalledError} traceback on
        every poll).
        """
        await self.assert_unavailable(
            b"HTTP/1.1 200 OK\r\nContent-Length: 9999\r\n\r\n" + PAGE
        )
