"""
One HTTP/1.1 response parser, without I/O: bytes in (L{ResponseParser.feed}),
events out: the answer's L{Head}, its body as C{bytes}, and its L{End}.  It
imports nothing of Twisted; the router's engine client
(L{llmgw.router.upstream.http1}) and the load poller's C{/metrics} client
(L{llmgw.router.upstream.scrape}) both read their answers through it; the head is
read by L{llmgw.router.upstream.response_head}.

Strict by RFC 9112, and where it chooses among what the RFC allows it says
so here:

  - Status line (section 4): C{HTTP/1.}I{digit}, a space, three digits from
    100 to 599, then a space and a reason phrase of HTAB, SP, VCHAR or
    obs-text (the space and phrase may be missing, as h11 also allows).
    C{HTTP/1.0} is HTTP/1.0; any other minor version reads as HTTP/1.1.
  - Line ends: the head and the trailers accept a bare LF as well as CRLF
    (section 2.2 lets a recipient do so for the start line and fields; h11
    does too); a bare CR anywhere in them is refused.  Where the grammar
    requires CRLF, after a chunk-size line and after chunk data (section
    7.1), only CRLF is taken.
  - Fields (section 5): a name is a token, with no space before the colon;
    a value holds no control byte but HTAB; obs-fold lines are joined to
    the value before them with one space (section 5.2, what a user agent
    must do).
  - Interim answers (section 15.2 of RFC 9110): 1xx answers are skipped,
    but C{101 Switching Protocols}, which no request here asks for: it is
    refused, since the bytes after it would be another protocol.  The RFC
    sets no bound on how many may come; here at most C{max_interim}
    (L{MAX_INTERIM}) come before the final answer, and one more is refused.
  - Framing (section 6.3): no body after 1xx, 204 and 304, nor for a
    C{HEAD} request.  C{Transfer-Encoding} in an HTTP/1.0 answer is refused
    (section 6.1: its framing is faulty).  With C{chunked} last, the body is
    chunked; with other codings last, it ends with the connection; a
    C{chunked} anywhere but last is refused.  With both
    C{Transfer-Encoding} and C{Content-Length}, the first wins and the
    connection is not kept (section 6.3 item 3).  C{Content-Length} is
    digits only (no sign, C{_} nor space inside), at most 18 of them;
    repeated values, in one field or several, are accepted when all are
    the same (RFC 9110 section 8.6 allows it; h11 does the same) and
    refused otherwise.  Without either, the body ends with the connection.
  - Chunks (section 7.1): the size is hexadecimal digits only (no C{0x},
    sign, C{_} nor space before them); extensions follow the grammar, with
    the optional whitespace around C{;} and C{=} (BWS); the two bytes after
    chunk data must be CRLF.  Trailer fields are checked as header fields
    and dropped.
  - Persistence (section 9.3): an HTTP/1.1 answer keeps the connection
    unless C{Connection: close}; an HTTP/1.0 one only with
    C{Connection: keep-alive} (L{Head.keep_alive}; L{Head.http11} lets a
    caller that keeps HTTP/1.1 connections only decide).  A body ended by
    the close, or bytes past the end of the answer, do not keep it.
  - Sizes: the head at most C{max_head} bytes (64 KiB), each interim
    head too, a chunk-size or trailer line at most C{max_chunk_line}
    (4 KiB), all trailers at most C{max_trailers} (16 KiB).

After an error the parser stays failed: each later L{ResponseParser.feed}
raises the same L{InvalidResponse}.
"""

from __future__ import annotations

import re

from llmgw.router.upstream.response_head import (
    TOKEN_CHARS,
    End,
    Event,
    Framing,
    Head,
    InvalidResponse,
    parse_fields,
    parse_head,
)

__all__ = [
    "MAX_CHUNK_LINE",
    "MAX_HEAD",
    "MAX_INTERIM",
    "MAX_TRAILERS",
    "End",
    "Event",
    "Framing",
    "Head",
    "InvalidResponse",
    "ResponseParser",
    "parse_head",
]

MAX_HEAD = 64 * 1024
"""
Bytes an answer's status line and header lines may take.
"""

MAX_CHUNK_LINE = 4096
"""
Bytes a chunk-size line (with its extensions) or a trailer line may take.
"""

MAX_TRAILERS = 16 * 1024
"""
Bytes all the trailer lines of a chunked body may take together.
"""

MAX_INTERIM = 10
"""
Interim (1xx) answers read before an answer's final one; one more and the
answer is refused.  RFC 9110 section 15.2 bounds neither their number nor
the time they take, and the router never sends C{Expect: 100-continue}:
an engine has one C{103 Early Hints} to send, perhaps a C{102 Processing};
ten leave room for a proxy's own.  Without a bound an engine (or anything
on its port) that sends interim heads without end holds the request and
the router's CPU until a deadline passes: an answer of 1,000 C{103} heads
was read to the end, on chats and on C{/metrics}.
"""


_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]+)(?:[ \t]*;[ \t]*[" + TOKEN_CHARS + rb"]+"
    rb"(?:[ \t]*=[ \t]*(?:[" + TOKEN_CHARS + rb"]+|" + _QUOTED + rb"))?)*"
)
_HEX = b"0123456789abcdefABCDEF"
_MAX_CHUNK = 1 << 62

# Where the parser is.
_HEAD = 0  # reading a head (interim ones too)
_LENGTH = 1  # a body of known length
_SIZE = 2  # a chunk-size line
_DATA = 3  # chunk data
_DATA_END = 4  # the CRLF after chunk data
_TRAILER = 5  # trailer lines, up to the blank one
_UNTIL_CLOSE = 6  # a body that ends with the connection
_DONE = 7  # the answer ended
_FAILED = 8


class ResponseParser:
    """
    Reads the answers on one connection, one after another: L{expect}
    before each (but the first), then L{feed} with what the connection
    reads, and L{close} when it closes.

    @param max_head: bytes a head may take.
    @param max_chunk_line: bytes a chunk-size or trailer line may take.
    @param max_trailers: bytes all trailer lines may take.
    @param max_interim: interim (1xx) answers taken before the final one.
    """

    def __init__(
        self,
        max_head: int = MAX_HEAD,
        max_chunk_line: int = MAX_CHUNK_LINE,
        max_trailers: int = MAX_TRAILERS,
        max_interim: int = MAX_INTERIM,
    ) -> None:
        self.max_head = max_head
        self.max_chunk_line = max_chunk_line
        self.max_trailers = max_trailers
        self.max_interim = max_interim
        self._error: InvalidResponse | None = None
        self.expect()

    def expect(self, head_request: bool = False) -> None:
        """
        Read a new answer from here on (the last one ended, or none came).

        @param head_request: the answer is to a C{HEAD} request: no body.
        @raise InvalidResponse: the parser failed before.
        """
        if self._error is not None:
            raise self._error
        self._state = _HEAD
        self._head_request = head_request
        self._buffer = b""
        self._scan = 0  # where to look for the head's end in the buffer
        self._remaining = 0
        self._keep = False
        self._trailer_bytes = 0
        self._trailer_lines: list[bytes] = []
        self._interim = 0
        self.started = False

    @property
    def in_head(self) -> bool:
        """
        Whether the answer's head has not been read whole yet.
        """
        return self._state == _HEAD

    def feed(self, data: bytes) -> list[Event]:
        """
        Parse the next bytes of the connection.

        @return: the events they complete, in order; body data read in one
            call comes as one piece.
        @raise InvalidResponse: they are not valid HTTP/1.1 (its C{events}
            holds what came before the error), or the parser failed
            before, or the answer had ended.
        """
        state = self._state
        remaining = self._remaining
        if state == _LENGTH and 0 < len(data) < remaining:
            # The common case of a long body: nothing to look at.
            self._remaining = remaining - len(data)
            return [data]
        if state == _FAILED:
            assert self._error is not None
            raise self._error
        if not data:
            return []
        if state == _DONE:
            self._fail(InvalidResponse("bytes after the end of the answer"))
        self.started = True
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        events: list[Event] = []
        out: list[bytes] = []  # body data, one event
        try:
            self._parse(data, events, out)
        except InvalidResponse as e:
            if out:
                events.append(out[0] if len(out) == 1 else b"".join(out))
            e.events = events
            self._fail(e)
        if out:
            events.append(out[0] if len(out) == 1 else b"".join(out))
        return events

    def close(self) -> End | None:
        """
        The connection closed.

        @return: the answer's L{End} when its body ends with the connection,
            else L{None} (no answer in progress, or one cut short).
        """
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return End(False)
        return None

    def _fail(self, error: InvalidResponse) -> None:
        self._state = _FAILED
        self._error = error
        self._buffer = b""
        raise error

    def _parse(self, data: bytes, events: list[Event], out: list[bytes]) -> None:
        pos = 0
        end = len(data)
        while pos < end:
            state = self._state
            if state == _HEAD:
                pos = self._read_head(data, pos, events)
                if pos < 0:
                    return
            elif state == _DATA or state == _LENGTH:
                remaining = self._remaining
                if end - pos <= remaining:
                    out.append(data if pos == 0 else data[pos:])
                    self._remaining = remaining - (end - pos)
                    pos = end
                else:
                    out.append(data[pos : pos + remaining])
                    pos += remaining
                    self._remaining = 0
                if self._remaining == 0:
                    if state == _LENGTH:
                        self._end(data, pos, out, events)
                        return
                    self._state = _DATA_END
            elif state == _SIZE:
                pos = self._read_size(data, pos)
                if pos < 0:
                    break
                stop = pos + self._remaining
                if self._state == _DATA and data.startswith(b"\r\n", stop):
                    # The whole chunk and its CRLF came: one step (a stream's
                    # reads are mostly whole chunks).
                    out.append(data[pos:stop])
                    pos = stop + 2
                    self._remaining = 0
                    self._state = _SIZE
            elif state == _DATA_END:
                if data.startswith(b"\r\n", pos):
                    pos += 2
                    self._state = _SIZE
                    continue
                two = data[pos : pos + 2]
                if two != b"\r":
                    raise InvalidResponse("chunk data not followed by CRLF", repr(two))
                self._buffer = two
                break
            elif state == _TRAILER:
                pos = self._read_trailer(data, pos)
                if pos < 0:
                    break
                if self._state == _DONE:  # the blank line that ends them
                    self._end(data, pos, out, events)
                    return
            else:  # _UNTIL_CLOSE
                out.append(data if pos == 0 else data[pos:])
                pos = end

    def _end(
        self, data: bytes, pos: int, out: list[bytes], events: list[Event]
    ) -> None:
        if out:
            events.append(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        self._state = _DONE
        events.append(End(self._keep and pos == len(data)))

    def _read_head(self, data: bytes, pos: int, events: list[Event]) -> int:
        """
        @return: where the body starts in C{data}, or -1 when the head is not
            whole yet (or the answer ended with it).
        """
        scan = max(pos, self._scan)
        lf_crlf = data.find(b"\n\r\n", scan)
        lf_lf = data.find(b"\n\n", scan, lf_crlf + 2 if lf_crlf >= 0 else len(data))
        if lf_lf >= 0 and (lf_crlf < 0 or lf_lf < lf_crlf):
            at, skip = lf_lf, 2
        else:
            at, skip = lf_crlf, 3
        # The limit holds whether or not the head's end came in the same
        # read as the bytes past it.
        if (at < 0 and len(data) - pos > self.max_head) or at - pos > self.max_head:
            raise InvalidResponse(f"head longer than {self.max_head} bytes")
        if at < 0:
            self._buffer = data[pos:]
            self._scan = max(0, len(self._buffer) - 2)
            return -1
        self._scan = 0
        head = parse_head(data[pos:at], self._head_request)
        pos = at + skip
        if head is None:  # an interim answer: the answer follows
            self._interim += 1
            if self._interim > self.max_interim:
                raise InvalidResponse(
                    f"more than {self.max_interim} interim (1xx) answers"
                )
            return pos
        self._keep = head.keep_alive
        events.append(head)
        framing = head.framing
        if framing is Framing.LENGTH:
            assert head.length is not None
            self._remaining = head.length
            if head.length == 0:
                self._end(data, pos, [], events)
                return -1
            self._state = _LENGTH
        elif framing is Framing.CHUNKED:
            self._state = _SIZE
        else:
            self._keep = False
            self._state = _UNTIL_CLOSE
        return pos

    def _line(self, data: bytes, pos: int) -> int:
        """
        @return: where the line at C{pos} ends (its LF), or -1 when it has
            not come yet (kept in the buffer).
        @raise InvalidResponse: the line is longer than C{max_chunk_line}.
        """
        limit = self.max_chunk_line
        lf = data.find(b"\n", pos, pos + limit + 2)
        if lf < 0:
            if len(data) - pos > limit + 1:
                raise InvalidResponse("chunk line too long")
            self._buffer = data[pos:]
            return -1
        return lf

    def _read_size(self, data: bytes, pos: int) -> int:
        lf = self._line(data, pos)
        if lf < 0:
            return -1
        if data[lf - 1 : lf] != b"\r" or lf == pos:
            raise InvalidResponse(
                "chunk-size line not ended by CRLF", repr(data[pos : lf + 1][:40])
            )
        line = data[pos : lf - 1]
        if line and not line.strip(_HEX):
            digits = line
        else:
            match = _CHUNK_LINE.fullmatch(line)
            if match is None:
                raise InvalidResponse("not a chunk size", repr(line[:40]))
            digits = match.group(1)
        size = int(digits, 16)
        if size >= _MAX_CHUNK:
            raise InvalidResponse("chunk size too large", repr(line[:40]))
        if size == 0:
            self._state = _TRAILER
        else:
            self._remaining = size
            self._state = _DATA
        return lf + 1

    def _read_trailer(self, data: bytes, pos: int) -> int:
        lf = self._line(data, pos)
        if lf < 0:
            return -1
        line = data[pos:lf]
        if line == b"" or line == b"\r":
            # Checked together, as the head's fields are, so that a folded
            # line (obs-fold, RFC 9112 section 5.2) continues the one before.
            lines, self._trailer_lines = self._trailer_lines, []
            parse_fields(lines, {})
            self._state = _DONE
            return lf + 1
        self._trailer_bytes += lf + 1 - pos
        if self._trailer_bytes > self.max_trailers:
            raise InvalidResponse(f"trailers longer than {self.max_trailers} bytes")
        self._trailer_lines.append(line)
        return lf + 1
