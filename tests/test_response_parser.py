"""
L{llmgw.router.upstream.response_parser}, without sockets: every framing fed whole
and one byte at a time, Hypothesis splits, the refusals, the limits, and a
differential oracle against h11 (python-hyper) on generated valid and
invalid answers (L{tests.test_response_parser_h11}).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.response_parser import (
    MAX_CHUNK_LINE,
    MAX_HEAD,
    MAX_INTERIM,
    MAX_TRAILERS,
    End,
    Event,
    Framing,
    Head,
    InvalidResponse,
    ResponseParser,
)

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunked(body: bytes, size: int, ext: bytes = b"", trailers: bytes = b"") -> bytes:
    """
    @return: C{body} as a chunked body of chunks of C{size} bytes, each
        size line with C{ext}, then C{trailers} (field lines with CRLF).
    """
    out = b""
    for at in range(0, len(body), size):
        piece = body[at : at + size]
        out += b"%x%s\r\n" % (len(piece), ext) + piece + b"\r\n"
    return out + b"0\r\n" + trailers + b"\r\n"


class Outcome:
    """
    What a parser made of an answer: its head, body and end, or the error.
    """

    def __init__(self, events: Sequence[Event], error: str | None = None) -> None:
        heads = [e for e in events if isinstance(e, Head)]
        ends = [e for e in events if isinstance(e, End)]
        self.head = heads[0] if heads else None
        self.body = b"".join(e for e in events if isinstance(e, bytes))
        self.end = ends[0] if ends else None
        self.error = error
        self.events = list(events)


def parse(pieces: Sequence[bytes], close: bool = True) -> Outcome:
    """
    Feed C{pieces} one after another, then close if C{close}.
    """
    parser = ResponseParser()
    events: list[Event] = []
    try:
        for piece in pieces:
            events += parser.feed(piece)
        if close:
            end = parser.close()
            if end is not None:
                events.append(end)
    except InvalidResponse as e:
        return Outcome(events + e.events, str(e))
    return Outcome(events)


def one_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


class FramingTests(SynchronousTestCase):
    """
    Each framing, fed in one piece and one byte at a time, gives the same
    head, body and end.
    """

    def both(self, data: bytes, close: bool = False) -> Outcome:
        whole = parse([data], close)
        split = parse(one_byte(data), close)
        self.assertIsNone(whole.error)
        self.assertIsNone(split.error)
        assert whole.head is not None and split.head is not None
        self.assertEqual(
            (whole.head.status, whole.head.headers, whole.body),
            (split.head.status, split.head.headers, split.body),
        )
        self.assertEqual(
            whole.end and whole.end.keep_alive, split.end and split.end.keep_alive
        )
        return whole

    def test_content_length(self) -> None:
        found = self.both(
            b"HTTP/1.1 201 Made\r\nContent-Length: 5\r\nX-B: 2\r\n\r\nhello"
        )
        assert found.head is not None and found.end is not None
        self.assertEqual(
            (found.head.status, found.head.reason, found.head.length),
            (201, b"Made", 5),
        )
        self.assertEqual(found.head.framing, Framing.LENGTH)
        self.assertEqual(found.head.headers[b"x-b"], [b"2"])
        self.assertEqual(found.body, b"hello")
        self.assertTrue(found.end.keep_alive)

    def test_chunked_with_extensions_and_trailers(self) -> None:
        """
        Sizes in either case of hex, with leading zeros and extensions
        (token and quoted values, whitespace around C{;} and C{=}), and
        trailers.
        """
        found = self.both(
            CHUNKED_HEAD + b'5;x=y\r\nhello\r\nA ; a = "q\\"" ;b\r\n0123456789\r\n'
            b"000a\r\nabcdefghij\r\n0\r\nX-Trailer: t\r\n\r\n"
        )
        assert found.head is not None and found.end is not None
        self.assertEqual(found.head.framing, Framing.CHUNKED)
        self.assertIsNone(found.head.length)
        self.assertEqual(found.body, b"hello0123456789abcdefghij")
        self.assertTrue(found.end.keep_alive)

    def test_folded_trailer(self) -> None:
        """
        A trailer line folded onto the next (obs-fold, RFC 9112 section
        5.2) is read as the head's fields are; a folded line with no field
        before it is refused.
        """
        found = self.both(CHUNKED_HEAD + b"5\r\nhello\r\n0\r\nX-T: 1\r\n 2\r\n\r\n")
        assert found.end is not None
        self.assertEqual(found.body, b"hello")
        self.assertTrue(found.end.keep_alive)
        refused = parse([CHUNKED_HEAD + b"5\r\nhello\r\n0\r\n 2\r\n\r\n"])
        self.assertIn("not a header line", refused.error or "")

    def test_until_close(self) -> None:
        """
        Without a length the body ends with the connection, which is not
        kept.
        """
        data = b"HTTP/1.1 200 OK\r\n\r\nuntil closed"
        self.assertIsNone(self.both(data).end)
        found = self.both(data, close=True)
        assert found.end is not None
        self.assertEqual(found.body, b"until closed")
        self.assertFalse(found.end.keep_alive)

    def test_no_body(self) -> None:
        """
        204 and 304 have no body, even with a length; nor has the answer to
        a C{HEAD}.
        """
        for data in (
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
        ):
            found = self.both(data)
            assert found.end is not None
            self.assertEqual(found.body, b"")
            self.assertTrue(found.end.keep_alive)
        parser = ResponseParser()
        parser.expect(head_request=True)
        events = parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        self.assertIsInstance(events[-1], End)

    def test_interim_answers_skipped(self) -> None:
        found = self.both(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )
        assert found.head is not None
        self.assertEqual((found.head.status, found.body), (200, b"ok"))
        self.assertEqual(len([e for e in found.events if isinstance(e, Head)]), 1)

    def test_bare_lf_head_and_trailers(self) -> None:
        """
        The head and the trailers may end lines with a bare LF (RFC 9112
        section 2.2); chunk lines may not (L{RefusalTests}).
        """
        found = self.both(
            b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\nX-B: 1\n\n"
            b"2\r\nok\r\n0\r\nT: 1\n\n"
        )
        self.assertEqual(found.body, b"ok")

    def test_obs_fold_joined(self) -> None:
        found = self.both(
            b"HTTP/1.1 200 OK\r\nX: a\r\n  b\r\nContent-Length: 0\r\n\r\n"
        )
        assert found.head is not None
        self.assertEqual(found.head.headers[b"x"], [b"a b"])

    def test_repeated_identical_lengths(self) -> None:
        """
        The same C{Content-Length} repeated, in one field or several, is
        one length (RFC 9110 section 8.6).
        """
        found = self.both(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok"
        )
        self.assertEqual(found.body, b"ok")

    def test_body_of_one_read_is_one_piece(self) -> None:
        """
        The chunks decoded from one read come as one data event.
        """
        parser = ResponseParser()
        parser.feed(CHUNKED_HEAD)
        events = parser.feed(b"2\r\nab\r\n2\r\ncd\r\n")
        self.assertEqual(events, [b"abcd"])

    @given(st.binary(max_size=300), st.integers(1, 50), st.integers(0, 400))
    def test_chunked_cut_anywhere(self, body: bytes, size: int, cut: int) -> None:
        """
        A chunked body cut anywhere has not ended until its last byte.
        """
        data = chunked(body, size)
        cut = min(cut, len(data))
        parser = ResponseParser()
        events = parser.feed(CHUNKED_HEAD + data[:cut])
        found = Outcome(events)
        if cut < len(data):
            self.assertIsNone(found.end)
            self.assertTrue(body.startswith(found.body))
        else:
            self.assertEqual(found.body, body)
            self.assertIsNotNone(found.end)


class PersistenceTests(SynchronousTestCase):
    def keep(self, data: bytes) -> bool:
        found = parse([data], close=False)
        self.assertIsNone(found.error)
        assert found.end is not None
        return found.end.keep_alive

    def test_decisions(self) -> None:
        """
        RFC 9112 section 9.3: HTTP/1.1 keeps but with C{close}; HTTP/1.0
        only with C{keep-alive}; both lengths, or bytes past the end, do
        not keep.
        """
        ok = b"Content-Length: 2\r\n\r\nok"
        self.assertTrue(self.keep(b"HTTP/1.1 200 OK\r\n" + ok))
        self.assertFalse(
            self.keep(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\n" + ok)
        )
        self.assertFalse(self.keep(b"HTTP/1.0 200 OK\r\n" + ok))
        self.assertTrue(
            self.keep(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n" + ok)
        )
        both = CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n\r\n")
        self.assertFalse(self.keep(both + b"0\r\n\r\n"))
        self.assertFalse(self.keep(b"HTTP/1.1 200 OK\r\n" + ok + b"JUNK"))

    def test_next_answer(self) -> None:
        """
        After L{ResponseParser.expect} the same parser reads the next
        answer; bytes after an answer's end, unasked, are refused.
        """
        parser = ResponseParser()
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na")
        self.assertRaises(InvalidResponse, parser.feed, b"x")
        parser = ResponseParser()
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na")
        parser.expect()
        self.assertFalse(parser.started)
        found = Outcome(parser.feed(b"HTTP/1.1 404 No\r\nContent-Length: 1\r\n\r\nb"))
        assert found.head is not None
        self.assertEqual((found.head.status, found.body), (404, b"b"))


# (answer, a part of the error's message): each is refused whole and one
# byte at a time.
REFUSED: list[tuple[bytes, str]] = [
    (CHUNKED_HEAD + b"5\r\nhelloXY0\r\n\r\n", "not followed by CRLF"),
    (CHUNKED_HEAD + b"5\r\nhello\n0\r\n\r\n", "not followed by CRLF"),
    (CHUNKED_HEAD + b"5\nhello\r\n0\r\n\r\n", "not ended by CRLF"),
    (CHUNKED_HEAD + b"0\n\r\n", "not ended by CRLF"),
    (CHUNKED_HEAD + b"0x5\r\nhello\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"+5\r\nhello\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"-0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b" 5\r\nhello\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"5 \r\nhello\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"5;\x01\r\nhello\r\n0\r\n\r\n", "not a chunk size"),
    (CHUNKED_HEAD + b"f" * 16 + b"\r\n", "chunk size too large"),
    (CHUNKED_HEAD + b"0\r\nX Y: 1\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1 0\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0x5\r\n\r\n", "not a Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: \r\n\r\n", "not a Content-Length"),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 19 + b"\r\n\r\n",
        "Content-Length",
    ),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        "conflicting Content-Length",
    ),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok", "conflicting"),
    (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "HTTP/1.0"),
    (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip, chunked\r\n\r\n",
        "chunked not the last",
    ),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: \r\n\r\n", "not a Transfer-Encoding"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "101"),
    (b"HTTP/1.1 099 Low\r\nContent-Length: 0\r\n\r\n", "not a status code"),
    (b"HTTP/1.1 600 High\r\nContent-Length: 0\r\n\r\n", "not a status code"),
    (b"HTTP/1.1 2OO OK\r\n\r\n", "not a status line"),
    (b"HTTP/1.1 20 OK\r\n\r\n", "not a status line"),
    (b"HTTP/1.1 200 O\x00K\r\n\r\n", "not a status line"),
    (b"HTTP/2.0 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"ICY 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.x status line"),
    (b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nX Y: 1\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nX : 1\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nX\x00: 1\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\n: 1\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nX: a\rb\r\nContent-Length: 0\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\nNo colon\r\n\r\n", "not a header line"),
    (b"HTTP/1.1 200 OK\r\n folded first\r\n\r\n", "not a header line"),
]


class RefusalTests(SynchronousTestCase):
    def test_refused_whole_and_one_byte_at_a_time(self) -> None:
        for data, reason in REFUSED:
            for pieces in ([data], one_byte(data)):
                found = parse(pieces)
                self.assertIsNotNone(found.error, data)
                self.assertIn(reason, found.error or "", data)
                self.assertIsNone(found.end, data)

    def test_data_before_the_error_kept(self) -> None:
        """
        What a read held before the error comes with it, in order: the
        head, then the body data that was valid.
        """
        parser = ResponseParser()
        with self.assertRaises(InvalidResponse) as raised:
            parser.feed(CHUNKED_HEAD + b"5\r\nhelloXY0\r\n\r\n")
        events = raised.exception.events
        self.assertIsInstance(events[0], Head)
        self.assertEqual(events[1:], [b"hello"])

    def test_stays_failed(self) -> None:
        parser = ResponseParser()
        self.assertRaises(InvalidResponse, parser.feed, b"HTTP/1.1 2OO OK\r\n\r\n")
        for data in (b"", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"):
            with self.assertRaises(InvalidResponse) as raised:
                parser.feed(data)
            self.assertIn("not a status line", str(raised.exception))
        self.assertRaises(InvalidResponse, parser.expect)
        self.assertIsNone(parser.close())


class LimitTests(SynchronousTestCase):
    def assert_refused(self, pieces: list[bytes], reason: str) -> None:
        found = parse(pieces)
        self.assertIn(reason, found.error or "")

    def test_head(self) -> None:
        """
        A head over 64 KiB is refused, terminated or not, in one read or
        many; one of 64 KiB is read.
        """
        big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MAX_HEAD
        self.assert_refused([big], "head longer than 65536 bytes")
        whole = big + b"\r\nContent-Length: 2\r\n\r\nok"
        self.assert_refused([whole], "head longer than 65536 bytes")
        pieces = [whole[i : i + 1000] for i in range(0, len(whole), 1000)]
        self.assert_refused(pieces, "head longer than 65536 bytes")
        fits = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: "
        # 64 KiB before the blank line that ends the head, its CR included.
        fits += b"a" * (MAX_HEAD - 1 - len(fits))
        self.assertEqual(parse([fits + b"\r\n\r\nok"]).body, b"ok")

    def test_interim_answers(self) -> None:
        """
        Ten interim (1xx) answers before the final one are read past; an
        eleventh is refused, in one read or one byte at a time, and so are
        a thousand C{103 Early Hints} (once read to the end); the count
        starts again with each answer on the connection.
        """
        self.assertEqual(MAX_INTERIM, 10)
        hint = b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
        final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        self.assertEqual(parse([hint * 10 + final]).body, b"ok")
        self.assertEqual(parse(one_byte(hint * 10 + final)).body, b"ok")
        reason = "more than 10 interim (1xx) answers"
        self.assert_refused([hint * 11 + final], reason)
        self.assert_refused(one_byte(hint * 11 + final), reason)
        self.assert_refused([b"HTTP/1.1 100 Continue\r\n\r\n" * 11], reason)
        parser = ResponseParser()
        with self.assertRaises(InvalidResponse) as raised:
            parser.feed(hint * 1000 + final)
        self.assertEqual(raised.exception.what, reason)
        # Per answer, not per connection.
        parser = ResponseParser()
        for _ in range(3):
            events = parser.feed(hint * 10 + final)
            self.assertIsInstance(events[-1], End)
            parser.expect()

    def test_what_holds_no_answer_bytes(self) -> None:
        """
        An error's C{what}, which a client may be told, is its message
        without the engine's bytes; the message has them, for the log.
        """
        found = parse([b"HTTP/1.1 2x0 OK from 10.1.2.3\r\n\r\n"])
        self.assertIn("10.1.2.3", found.error or "")
        with self.assertRaises(InvalidResponse) as raised:
            ResponseParser().feed(b"HTTP/1.1 2x0 OK from 10.1.2.3\r\n\r\n")
        self.assertEqual(raised.exception.what, "not a status line")

    def test_chunk_line(self) -> None:
        line = b"2;x=" + b"y" * MAX_CHUNK_LINE + b"\r\n"
        self.assert_refused([CHUNKED_HEAD + line + b"ok\r\n0\r\n\r\n"], "too long")
        self.assert_refused([CHUNKED_HEAD, line[:-2]], "too long")
        fits = b"2;x=" + b"y" * (MAX_CHUNK_LINE - 4) + b"\r\n"
        self.assertEqual(parse([CHUNKED_HEAD + fits + b"ok\r\n0\r\n\r\n"]).body, b"ok")

    def test_trailers_total(self) -> None:
        """
        Trailer lines, each under the line limit, are refused together over
        16 KiB.
        """
        line = b"X-T: " + b"t" * 1000 + b"\r\n"
        many = line * (MAX_TRAILERS // len(line) + 1)
        self.assert_refused([CHUNKED_HEAD + b"0\r\n" + many + b"\r\n"], "trailers")
        few = line * (MAX_TRAILERS // len(line))
        found = parse([CHUNKED_HEAD + b"0\r\n" + few + b"\r\n"], close=False)
        self.assertIsNotNone(found.end)


# Valid answers, built by Hypothesis.
_token = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!~",
    min_size=1,
    max_size=12,
)
_value = st.binary(max_size=20).map(
    lambda b: bytes(c for c in b if 0x21 <= c <= 0x7E or c >= 0x80)
)


@st.composite
def valid_answers(draw: st.DrawFn) -> tuple[bytes, int, bytes]:
    """
    @return: an answer, its status and its body.
    """
    status = draw(st.sampled_from([200, 201, 204, 304, 404, 500, 503]))
    body = b"" if status in (204, 304) else draw(st.binary(max_size=200))
    headers = [
        (name.encode(), value)
        for name, value in draw(st.lists(st.tuples(_token, _value), max_size=4))
        if name.lower() not in ("content-length", "transfer-encoding", "connection")
    ]
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
        payload = body
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        ext = draw(st.sampled_from([b"", b";a=b", b';q="x y"']))
        trailers = draw(st.sampled_from([b"", b"T: 1\r\n"]))
        payload = chunked(body, draw(st.integers(1, 40)), ext, trailers)
    else:
        payload = body
    if status in (204, 304):
        payload = b""
    head = b"HTTP/1.1 %d Reason phrase" % status + eol
    head += b"".join(n + b": " + v + eol for n, v in headers) + eol
    return interim + head + payload, status, body


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = []
    at = 0
    for point in points + [len(data)]:
        pieces.append(data[at:point])
        at = point
    return pieces


class HypothesisTests(SynchronousTestCase):
    @settings(max_examples=300)
    @given(valid_answers(), st.lists(st.integers(0, 600), max_size=12))
    def test_any_split(self, answer: tuple[bytes, int, bytes], cuts: list[int]) -> None:
        """
        A valid answer cut anywhere, in any number of pieces, reads the same
        as in one piece.
        """
        data, status, body = answer
        whole = parse([data])
        split = parse(splits(data, cuts))
        self.assertIsNone(whole.error)
        self.assertIsNone(split.error)
        assert whole.head is not None and split.head is not None
        self.assertEqual((whole.head.status, whole.body), (status, body))
        self.assertEqual((split.head.status, split.body), (status, body))
        self.assertEqual(whole.head.headers, split.head.headers)
        self.assertIsNotNone(split.end)
