"""
L{llmgw.router.upstream.http1.EngineClient} against a scripted server on real
loopback sockets: the bytes it sends, the framings it reads, which
connections it keeps, how it fails, cancels and applies backpressure.
"""

from __future__ import annotations

import socket

from twisted.internet import reactor
from twisted.internet.defer import CancelledError
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss

from llmgw.router.upstream.base import BadAnswer, NoAnswer, UpstreamConnectError
from llmgw.router.upstream.http1 import AnswerBroken
from tests.http1_support import (
    Answer,
    EngineClientTestCase,
    Reader,
    ScriptedServer,
    ServerConnection,
    ShiftedClock,
    bounded,
    read_body,
    sleep,
    until,
)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;x=y\r\nhello\r\nA\r\n0123456789\r\na\r\nabcdefghij\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)


def _bytes(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


class RequestTests(EngineClientTestCase):
    async def test_request_bytes(self) -> None:
        """
        The request line carries the base's path prefix and the path, then
        C{Host} with the port, C{Content-Length} and the given headers, in
        order, then the body.
        """
        base = self.start(OK)
        d = self.client.post(
            base + b"/prefix",
            b"/v1/x",
            [(b"Content-Type", b"application/json"), (b"X-A", b"1")],
            b'{"a":1}',
        )
        await read_body(await bounded(d))
        port = base.rsplit(b":", 1)[1]
        self.assertEqual(
            self.server.requests,
            [
                b"POST /prefix/v1/x HTTP/1.1\r\nHost: 127.0.0.1:" + port + b"\r\n"
                b"Content-Length: 7\r\nContent-Type: application/json\r\n"
                b'X-A: 1\r\n\r\n{"a":1}'
            ],
        )

    async def test_header_value_cr_lf_neutralised(self) -> None:
        """
        CR, LF and NUL in a header value do not end the line: no header is
        injected.
        """
        base = self.start(OK)
        d = self.client.post(base, b"/v1/x", [(b"X-A", b"a\r\nX-Injected: 1\n\0")], b"")
        await read_body(await bounded(d))
        head = self.server.requests[0].split(b"\r\n\r\n")[0]
        lines = head.split(b"\r\n")
        self.assertEqual(len(lines), 4)
        self.assertTrue(lines[3].startswith(b"X-A: a"))
        self.assertNotIn(b"\n", lines[3])
        self.assertNotIn(b"\0", lines[3])

    async def test_ipv6_host_in_brackets(self) -> None:
        """
        An IPv6 replica's C{Host} is its address in brackets and its port.
        """
        try:
            probe = socket.socket(socket.AF_INET6)
            probe.bind(("::1", 0))
            probe.close()
        except OSError:
            self.skipTest("no IPv6 loopback")
        self.server = ScriptedServer([OK])
        base = self.server.listen("::1")
        self.addCleanup(self.server.stop)
        client = self.new_client(4, 4.0)
        reader = await read_body(await self.post(base, client=client))
        self.assertEqual(reader.body, b"ok")
        port = base.rsplit(b":", 1)[1]
        self.assertIn(b"\r\nHost: [::1]:" + port + b"\r\n", self.server.requests[0])


class BodyTests(EngineClientTestCase):
    async def test_content_length_one_write(self) -> None:
        base = self.start(
            b"HTTP/1.1 201 Made\r\nContent-Length: 5\r\nX-B: 2\r\n\r\nhello"
        )
        response = await self.post(base)
        self.assertEqual(
            (response.code, response.phrase, response.length), (201, b"Made", 5)
        )
        self.assertEqual(response.headers.getRawHeaders(b"x-b"), [b"2"])
        reader = await read_body(response)
        self.assertEqual(reader.body, b"hello")
        self.assertIsNotNone(reader.reason)
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(ResponseDone))

    async def test_content_length_byte_by_byte(self) -> None:
        """
        Head and body read one byte at a time, the connection kept after.
        """
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"
        base = self.start(_bytes(answer), OK)
        self.assertEqual((await self.exchange(base)).body, b"hello world")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)

    async def test_chunked_byte_by_byte(self) -> None:
        """
        Chunk sizes in either case of hex, with extensions, and trailers,
        all split across reads; the connection is kept after the last
        chunk.
        """
        base = self.start(_bytes(CHUNKED), OK)
        reader = await self.exchange(base)
        self.assertEqual(reader.body, b"hello0123456789abcdefghij")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)

    async def test_chunked_one_write(self) -> None:
        base = self.start(CHUNKED, OK)
        self.assertEqual((await self.exchange(base)).body, b"hello0123456789abcdefghij")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)

    async def test_transfer_encoding_wins_over_content_length(self) -> None:
        """
        With both, the body is chunked and the connection is not kept.
        """
        answer = CHUNKED.replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n\r\n", 1)
        base = self.start(answer, OK)
        self.assertEqual((await self.exchange(base)).body, b"hello0123456789abcdefghij")
        await self.closed_by_client(self.server.connections[0])
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 2)

    async def test_until_close(self) -> None:
        """
        Without length or chunks the body ends with the close, with
        L{PotentialDataLoss}; the next request opens a new connection.
        """

        def answer(connection: ServerConnection) -> None:
            connection.write(b"HTTP/1.1 200 OK\r\n\r\nuntil ")
            reactor.callLater(0.02, connection.write, b"closed")
            reactor.callLater(0.04, connection.close)

        base = self.start(answer, OK)
        reader = await self.exchange(base)
        self.assertEqual(reader.body, b"until closed")
        assert reader.reason is not None
        self.assertTrue(reader.reason.check(PotentialDataLoss))
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 2)

    async def test_no_body_after_204_and_304(self) -> None:
        """
        204 and 304 have no body, even with a C{Content-Length}; the
        connection is kept.
        """
        base = self.start(
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
            OK,
        )
        for code in (204, 304):
            response = await self.post(base)
            self.assertEqual(response.code, code)
            self.assertEqual((await read_body(response)).body, b"")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)

    async def test_interim_answers_skipped(self) -> None:
        """
        C{100 Continue} and C{103 Early Hints}, in the same write as the
        answer or apart, are skipped.
        """
        interim = (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
        )
        base = self.start(interim + OK, [interim, OK])
        for _ in range(2):
            response = await self.post(base)
            self.assertEqual(response.code, 200)
            self.assertEqual((await read_body(response)).body, b"ok")

    async def test_bare_lf_line_endings(self) -> None:
        """
        A head whose lines end in a bare LF is read (RFC 9112 section 2.2
        lets a recipient); the connection is kept.  Chunk lines must end
        in CRLF: L{tests.test_http1_refusals}.
        """
        base = self.start(
            b"HTTP/1.1 200 OK\nContent-Length: 2\nX-B: 1\n\nok",
            _bytes(
                b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n2\r\nok\r\n0\r\n\n"
            ),
            OK,
        )
        response = await self.post(base)
        self.assertEqual(response.headers.getRawHeaders(b"X-B"), [b"1"])
        self.assertEqual((await read_body(response)).body, b"ok")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)


class ReuseTests(EngineClientTestCase):
    async def test_sequential_requests_share_a_connection(self) -> None:
        base = self.start(OK, OK, OK)
        for _ in range(3):
            self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)
        self.assertEqual(len(self.server.connections[0].requests), 3)
        self.assertEqual(self.client.idle_connections(), 1)

    async def test_connection_close_not_kept(self) -> None:
        base = self.start(
            b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, close\r\n"
            b"Content-Length: 2\r\n\r\nok",
            OK,
        )
        await self.exchange(base)
        await self.closed_by_client(self.server.connections[0])
        await self.exchange(base)
        self.assertEqual(len(self.server.connections), 2)

    async def test_http10_not_kept(self) -> None:
        base = self.start(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", OK)
        await self.exchange(base)
        await self.closed_by_client(self.server.connections[0])
        await self.exchange(base)
        self.assertEqual(len(self.server.connections), 2)

    async def test_at_most_max_idle_kept(self) -> None:
        """
        Three answers ending together leave two connections kept, the
        third closed.
        """
        held: list[ServerConnection] = []

        def hold(connection: ServerConnection) -> None:
            held.append(connection)
            if len(held) == 3:
                for c in held:
                    c.write(OK)

        base = self.start(hold, hold, hold, idle=2)
        posts = [self.client.post(base, b"/v1/x", [], b"{}") for _ in range(3)]
        for d in posts:
            await read_body(await bounded(d))
        self.assertEqual(len(self.server.connections), 3)
        await until(lambda: len(self.server.open_connections()) == 2)
        self.assertEqual(self.client.idle_connections(), 2)

    async def test_none_kept_with_max_idle_zero(self) -> None:
        """
        With C{max_idle_connections} 0 the body still ends and the
        connection is closed.
        """
        base = self.start(OK, OK, idle=0)
        self.assertEqual((await self.exchange(base)).body, b"ok")
        await self.closed_by_client(self.server.connections[0])
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 2)

    async def test_idle_too_long_not_handed_out(self) -> None:
        """
        A connection idle for longer than C{idle_connection_timeout} (by the
        client's clock, before the sweep runs) is closed, not used.
        """
        clock = ShiftedClock()
        self.server = ScriptedServer([OK, OK])
        base = self.server.listen()
        self.addCleanup(self.server.stop)
        client = self.new_client(4, 10.0, clock)
        await read_body(await self.post(base, client=client))
        clock.shift = 10.5
        await read_body(await self.post(base, client=client))
        self.assertEqual(len(self.server.connections), 2)
        await until(lambda: self.server.connections[0].closed)

    async def test_idle_connection_closed_by_sweep(self) -> None:
        base = self.start(OK, idle_timeout=0.3)
        await self.exchange(base)
        self.assertEqual(self.client.idle_connections(), 1)
        await sleep(0.2)
        self.assertFalse(self.server.connections[0].closed)
        await until(lambda: self.server.connections[0].closed, 1.5)
        self.assertEqual(self.client.idle_connections(), 0)


class FailureTests(EngineClientTestCase):
    async def test_pooled_connection_closed_and_noticed(self) -> None:
        base = self.start(OK, OK)
        await self.exchange(base)
        self.server.connections[0].close()
        await until(lambda: self.client.idle_connections() == 0)
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 2)

    async def test_pooled_connection_closed_unnoticed(self) -> None:
        """
        A kept connection the replica closes as the request goes: the
        failure says the connection was reused.
        """
        base = self.start(OK)
        await self.exchange(base)
        self.server.connections[0].close()
        d = self.client.post(base, b"/v1/x", [], b"{}")
        e = await self.failure_of(d, NoAnswer)
        assert isinstance(e, NoAnswer)
        self.assertTrue(e.reused)

    async def test_new_connection_closed_without_answer(self) -> None:
        base = self.start(ServerConnection.close)
        e = await self.failure_of(self.client.post(base, b"/v1/x", [], b"{}"), NoAnswer)
        assert isinstance(e, NoAnswer)
        self.assertFalse(e.reused)

    async def test_reused_connection_closed_without_answer(self) -> None:
        base = self.start(OK, ServerConnection.close)
        await self.exchange(base)
        e = await self.failure_of(self.client.post(base, b"/v1/x", [], b"{}"), NoAnswer)
        assert isinstance(e, NoAnswer)
        self.assertTrue(e.reused)

    async def test_partial_head_then_close(self) -> None:
        def answer(connection: ServerConnection) -> None:
            connection.write(b"HTTP/1.1 200 OK\r\nContent-Len")
            reactor.callLater(0.02, connection.close)

        base = self.start(answer)
        await self.failure_of(self.client.post(base, b"/v1/x", [], b"{}"), AnswerBroken)

    async def assert_bad_head(self, answer: Answer) -> None:
        base = self.start(answer)
        await self.failure_of(self.client.post(base, b"/v1/x", [], b"{}"), BadAnswer)
        await self.closed_by_client(self.server.connections[0])

    async def test_garbage_status_line(self) -> None:
        await self.assert_bad_head(b"HTTP/1.1 2OO OK\r\n\r\n")

    async def test_not_http(self) -> None:
        """
        A status line of another protocol, however well formed, is refused.
        """
        await self.assert_bad_head(b"ICY 200 OK\r\nContent-Length: 0\r\n\r\n")
        await self.assert_bad_head(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def test_bad_content_length(self) -> None:
        await self.assert_bad_head(b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nok")

    async def test_conflicting_content_lengths(self) -> None:
        await self.assert_bad_head(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"
        )

    async def test_head_over_64k_unterminated(self) -> None:
        await self.assert_bad_head(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70000)

    async def test_head_over_64k_terminated(self) -> None:
        """
        A head over the limit fails even when its end came in the same
        read as the bytes past the limit.
        """
        await self.assert_bad_head(
            b"HTTP/1.1 200 OK\r\nX-Big: "
            + b"a" * 100000
            + b"\r\nContent-Length: 2\r\n\r\nok"
        )

    async def assert_bad_body(self, answer: Answer, error: type[Exception]) -> None:
        base = self.start(answer)
        response = await self.post(base)
        reader = Reader()
        response.deliverBody(reader)
        await self.failure_of(reader.done, error)
        await self.closed_by_client(self.server.connections[0])

    async def test_bad_chunk_size(self) -> None:
        await self.assert_bad_body(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0x3\r\n",
            BadAnswer,
        )

    async def test_chunk_longer_than_its_size(self) -> None:
        await self.assert_bad_body(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nokk\r\n0\r\n\r\n",
            BadAnswer,
        )

    async def test_chunk_line_over_limit(self) -> None:
        """
        A chunk-size line longer than 4 KiB fails even when it ends in the
        same read.
        """
        await self.assert_bad_body(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2;x=" + b"y" * 8000 + b"\r\nok\r\n0\r\n\r\n",
            BadAnswer,
        )

    async def test_content_length_cut_short(self) -> None:
        def answer(connection: ServerConnection) -> None:
            connection.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
            reactor.callLater(0.02, connection.close)

        await self.assert_bad_body(answer, AnswerBroken)

    async def test_chunked_cut_short(self) -> None:
        def answer(connection: ServerConnection) -> None:
            connection.write(CHUNKED[:-10])
            reactor.callLater(0.02, connection.close)

        await self.assert_bad_body(answer, AnswerBroken)

    async def test_connection_refused(self) -> None:
        server = ScriptedServer()
        base = server.listen()
        await server.stop()
        client = self.new_client(4, 4.0)
        e = await self.failure_of(
            client.post(base, b"/v1/x", [], b"{}"), UpstreamConnectError
        )
        assert isinstance(e, UpstreamConnectError)
        self.assertFalse(e.timed_out)


class CancelTests(EngineClientTestCase):
    async def test_cancel_waiting_for_head(self) -> None:
        """
        Cancelling while the head has not come closes the connection, on a
        new connection and on a reused one; neither is used again.
        """
        base = self.start(None, OK, None, OK)
        d = self.client.post(base, b"/v1/x", [], b"{}")
        await until(lambda: len(self.server.requests) == 1)
        d.cancel()
        await self.failure_of(d, CancelledError)
        await self.closed_by_client(self.server.connections[0])
        await self.exchange(base)
        d = self.client.post(base, b"/v1/x", [], b"{}")
        await until(lambda: len(self.server.requests) == 3)
        self.assertEqual(len(self.server.connections), 2)
        d.cancel()
        await self.failure_of(d, CancelledError)
        await self.closed_by_client(self.server.connections[1])
        await self.exchange(base)
        self.assertEqual(len(self.server.connections), 3)

    async def test_cancel_while_connecting(self) -> None:
        """
        Cancelling before the connection is made fails the post with
        L{CancelledError}, not as a replica that cannot be reached, and
        leaves no connection open.
        """
        base = self.start(OK)
        d = self.client.post(base, b"/v1/x", [], b"{}")
        d.cancel()
        await self.failure_of(d, CancelledError)
        await sleep(0.1)
        self.assertEqual(self.server.open_connections(), [])
        self.assertEqual(self.server.requests, [])
        self.assertEqual((await self.exchange(base)).body, b"ok")

    async def test_old_body_transport_inert(self) -> None:
        """
        Once its body ended, an answer's transport no longer pauses nor
        closes the connection, which serves the next request.
        """
        base = self.start(OK, [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no", b"k"])
        first = await self.exchange(base)
        second = await self.post(base)
        assert first.transport is not None
        first.transport.pauseProducing()  # type: ignore[attr-defined]
        first.transport.stopProducing()  # type: ignore[attr-defined]
        self.assertEqual((await read_body(second)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)
        self.assertFalse(self.server.connections[0].closed)

    async def test_abort_mid_body(self) -> None:
        base = self.start(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nsome")
        response = await self.post(base)
        reader = Reader()
        response.deliverBody(reader)
        await until(lambda: reader.body == b"some")
        reader.abort()
        await self.closed_by_client(self.server.connections[0])


class FlowTests(EngineClientTestCase):
    async def test_pause_stops_delivery(self) -> None:
        """
        While paused, what the replica writes is not delivered; resuming
        delivers it.
        """
        sent: list[ServerConnection] = []

        def answer(connection: ServerConnection) -> None:
            sent.append(connection)
            connection.write(CHUNKED[:61])

        base = self.start(answer, OK)
        response = await self.post(base)
        reader = Reader(lambda r, data: r.transport.pauseProducing())  # type: ignore[union-attr]
        response.deliverBody(reader)
        await until(lambda: reader.body == b"hello")
        for i in range(5):
            sent[0].write(b"1\r\n%d\r\n" % i)
            await sleep(0.05)
        self.assertEqual(reader.body, b"hello")
        sent[0].write(b"0\r\n\r\n")
        await sleep(0.05)
        self.assertEqual(reader.body, b"hello")
        assert reader.transport is not None
        reader._hook = None
        reader.transport.resumeProducing()  # type: ignore[attr-defined]
        await bounded(reader.done)
        self.assertEqual(reader.body, b"hello01234")
        self.assertEqual((await self.exchange(base)).body, b"ok")

    async def test_body_ending_while_paused(self) -> None:
        """
        A body whose end comes in the read that paused it leaves the
        connection working for the next request.
        """
        base = self.start(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", OK)
        response = await self.post(base)
        reader = Reader(lambda r, data: r.transport.pauseProducing())  # type: ignore[union-attr]
        response.deliverBody(reader)
        await bounded(reader.done)
        self.assertEqual(reader.body, b"hello")
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 1)


class JunkTests(EngineClientTestCase):
    async def test_junk_with_the_answer(self) -> None:
        base = self.start(OK + b"JUNK", OK)
        self.assertEqual((await self.exchange(base)).body, b"ok")
        await self.closed_by_client(self.server.connections[0])
        self.assertEqual((await self.exchange(base)).body, b"ok")
        self.assertEqual(len(self.server.connections), 2)

    async def test_junk_after_the_answer(self) -> None:
        def answer(connection: ServerConnection) -> None:
            connection.write(OK)
            reactor.callLater(0.05, connection.write, b"JUNK")

        base = self.start(answer)
        self.assertEqual((await self.exchange(base)).body, b"ok")
        await self.closed_by_client(self.server.connections[0])
