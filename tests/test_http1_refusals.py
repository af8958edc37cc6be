"""
L{llmgw.router.upstream.http1.EngineClient} against a scripted server on real
loopback sockets: the answers that once passed its parser (a bare LF after
chunk data, chunk data not followed by CRLF, a negative length, a 101) are
refused, the connection closed.
"""

from __future__ import annotations

from llmgw.router.upstream.http1 import BadAnswer
from tests.http1_support import Answer, EngineClientTestCase, Reader
from tests.test_http1 import OK, _bytes


class RefusalTests(EngineClientTestCase):
    async def assert_bad_head(self, answer: Answer) -> None:
        base = self.start(answer)
        await self.failure_of(self.client.post(base, b"/v1/x", [], b"{}"), BadAnswer)
        await self.closed_by_client(self.server.connections[0])

    async def assert_bad_body(self, answer: Answer, error: type[Exception]) -> None:
        base = self.start(answer)
        response = await self.post(base)
        reader = Reader()
        response.deliverBody(reader)
        await self.failure_of(reader.done, error)
        await self.closed_by_client(self.server.connections[0])

    async def test_chunk_data_not_followed_by_crlf(self) -> None:
        """
        The two bytes after chunk data must be CRLF: C{5\\r\\nhelloXY}
        is refused, in one read and one byte at a time.
        """
        answer = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhelloXY0\r\n\r\n"
        )
        await self.assert_bad_body(answer, BadAnswer)
        await self.assert_bad_body(_bytes(answer), BadAnswer)

    async def test_bare_lf_chunk_lines(self) -> None:
        """
        A bare LF after chunk data, or ending a chunk-size line, is refused
        (RFC 9112 section 7.1 requires CRLF there).
        """
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        await self.assert_bad_body(head + b"2\r\nok\n0\r\n\r\n", BadAnswer)
        await self.assert_bad_body(head + b"2\nok\r\n0\r\n\r\n", BadAnswer)

    async def test_negative_content_length(self) -> None:
        await self.assert_bad_head(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")

    async def test_switching_protocols_refused(self) -> None:
        """
        A C{101}, which no request of the router asks for, is refused, not
        skipped as an interim answer.
        """
        await self.assert_bad_head(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n" + OK
        )

    async def test_interim_answers_bounded(self) -> None:
        """
        A thousand C{103 Early Hints} before the answer: refused at the
        eleventh, the error saying so in words that a client may read.
        """
        hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
        base = self.start(hint * 1000 + OK)
        error = await self.failure_of(
            self.client.post(base, b"/v1/x", [], b"{}"), BadAnswer
        )
        assert isinstance(error, BadAnswer)
        self.assertEqual(error.what, "more than 10 interim (1xx) answers")
        await self.closed_by_client(self.server.connections[0])

    async def test_what_without_the_answers_bytes(self) -> None:
        """
        A bad status line: the error's message quotes it (for the log), its
        C{what} does not (for the client).
        """
        base = self.start(b"HTTP/1.1 2x0 at 10.9.8.7\r\n\r\n")
        error = await self.failure_of(
            self.client.post(base, b"/v1/x", [], b"{}"), BadAnswer
        )
        assert isinstance(error, BadAnswer)
        self.assertIn("10.9.8.7", str(error))
        self.assertEqual(error.what, "not a status line")
