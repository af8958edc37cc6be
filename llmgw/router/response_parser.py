"""
One HTTP/1.1 response parser, without I/O: bytes in (L{ResponseParser.feed}),
events out: the answer's L{Head}, its body as C{bytes}, and its L{End}.  It
imports nothing of Twisted; the router's engine client
(L{llmgw.router.http1}) and the load poller's C{/metrics} client
(L{llmgw.router.scrape}) both read their answers through it.

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
    refused, since the bytes after it would be another protocol.
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
  - Sizes: the head at most C{max_head} bytes (64 KiB), a chunk-size or
    trailer line at most C{max_chunk_line} (4 KiB), all trailers at most
    C{max_trailers} (16 KiB).

After an error the parser stays failed: each later L{ResponseParser.feed}
raises the same L{InvalidResponse}.
"""

from __future__ import annotations

import re
from enum import Enum

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

MAX_LENGTH_DIGITS = 18
"""
Digits a C{Content-Length} may have (under 2**63).
"""


class InvalidResponse(ValueError):
    """
    The bytes are not a valid HTTP/1.1 answer; the message says why.

    @ivar events: what the same L{ResponseParser.feed} parsed before the
        error, in order (a L{Head}, body data), to be handled before it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.events: list[Event] = []


class Framing(Enum):
    """
    How an answer's body is delimited (RFC 9112 section 6.3).
    """

    LENGTH = "length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until close"


class Head:
    """
    An answer's status line and headers (not an interim 1xx answer).

    @ivar status: the status code, 200 to 599 (or a 1xx never: skipped).
    @ivar reason: the reason phrase, maybe empty.
    @ivar headers: each header's values in order, names lower-cased.
    @ivar http11: whether the answer is HTTP/1.1 (or a later 1.x).
    @ivar framing: how the body is delimited.
    @ivar length: the body's bytes for L{Framing.LENGTH}, else L{None}.
    @ivar keep_alive: whether the connection may carry another request
        after this answer's end, as far as its head says (RFC 9112 9.3).
    """

    __slots__ = (
        "status",
        "reason",
        "headers",
        "http11",
        "framing",
        "length",
        "keep_alive",
    )

    def __init__(
        self,
        status: int,
        reason: bytes,
        headers: dict[bytes, list[bytes]],
        http11: bool,
        framing: Framing,
        length: int | None,
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.http11 = http11
        self.framing = framing
        self.length = length
        self.keep_alive = keep_alive

    def __repr__(self) -> str:
        return (
            f"<Head {self.status} {self.framing.value} length={self.length}"
            f" keep_alive={self.keep_alive}>"
        )


class End:
    """
    The end of an answer's body.

    @ivar keep_alive: whether the connection may carry another request:
        the head allowed it, the body was not ended by the close, and no
        byte came after the answer.
    """

    __slots__ = ("keep_alive",)

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive

    def __repr__(self) -> str:
        return f"<End keep_alive={self.keep_alive}>"


Event = Head | bytes | End
"""
What L{ResponseParser.feed} returns, in order: one L{Head}, body data
(never empty), one L{End}.
"""

_TOKEN_CHARS = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
_FIELD = re.compile(rb"([" + _TOKEN_CHARS + rb"]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)")
_FOLD = re.compile(rb"[ \t]+([^\x00-\x08\x0a-\x1f\x7f]*)")
_TOKEN = re.compile(rb"[" + _TOKEN_CHARS + rb"]+")
_STATUS_LINE = re.compile(
    rb"HTTP/1\.([0-9]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?"
)
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]+)(?:[ \t]*;[ \t]*[" + _TOKEN_CHARS + rb"]+"
    rb"(?:[ \t]*=[ \t]*(?:[" + _TOKEN_CHARS + rb"]+|" + _QUOTED + rb"))?)*"
)
_HEX = b"0123456789abcdefABCDEF"
_MAX_CHUNK = 1 << 62
_NO_BODY = frozenset({204, 304})

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


def _fields(lines: list[bytes], headers: dict[bytes, list[bytes]]) -> None:
    """
    Add the field lines C{lines} (line ends removed) to C{headers}.

    @raise InvalidResponse: a line is not a field line.
    """
    last: list[bytes] | None = None
    for line in lines:
        if line[-1:] == b"\r":
            line = line[:-1]
        if line[:1] in (b" ", b"\t"):
            folded = _FOLD.fullmatch(line)
            if last is None or folded is None:
                raise InvalidResponse(f"not a header line: {line[:100]!r}")
            more = folded.group(1).rstrip(b" \t")
            if more:
                last[-1] = (last[-1] + b" " + more) if last[-1] else more
            continue
        match = _FIELD.fullmatch(line)
        if match is None:
            raise InvalidResponse(f"not a header line: {line[:100]!r}")
        name = match.group(1).lower()
        last = headers.get(name)
        if last is None:
            last = headers[name] = []
        last.append(match.group(2).rstrip(b" \t"))


def _tokens(values: list[bytes]) -> list[bytes]:
    """
    @return: the lower-cased elements of a comma-separated list header
        (RFC 9110 section 5.6.1: empty elements dropped).
    """
    return [
        t
        for t in b",".join(values).lower().replace(b"\t", b" ").split(b",")
        if t.strip()
    ]


def parse_head(block: bytes, head_request: bool = False) -> Head | None:
    """
    Parse an answer's head.

    @param block: the status line and header lines, without the blank line
        that ends them; lines end in CRLF or a bare LF.
    @param head_request: whether the answer is to a C{HEAD} request.
    @return: the head, or L{None} for an interim (1xx) answer.
    @raise InvalidResponse: the head is not valid, or its framing is not.
    """
    status_line, _, rest = block.partition(b"\n")
    if status_line[-1:] == b"\r":
        status_line = status_line[:-1]
    match = _STATUS_LINE.fullmatch(status_line)
    if match is None:
        if not status_line.startswith(b"HTTP/1."):
            raise InvalidResponse(f"not an HTTP/1.x status line: {status_line[:100]!r}")
        raise InvalidResponse(f"not a status line: {status_line[:100]!r}")
    status = int(match.group(2))
    if not 100 <= status <= 599:
        raise InvalidResponse(f"not a status code: {status}")
    if status == 101:
        raise InvalidResponse("101 Switching Protocols, and no upgrade was asked")
    headers: dict[bytes, list[bytes]] = {}
    if rest:
        _fields(rest.split(b"\n"), headers)
    if status < 200:
        return None
    http11 = match.group(1) != b"0"
    framing, length, keep = _framing(status, headers, http11, head_request)
    connection = headers.get(b"connection")
    if connection is not None:
        options = {t.strip() for t in _tokens(connection)}
        if b"close" in options:
            keep = False
        elif not http11 and b"keep-alive" not in options:
            keep = False
    elif not http11:
        keep = False
    return Head(status, match.group(3) or b"", headers, http11, framing, length, keep)


def _framing(
    status: int, headers: dict[bytes, list[bytes]], http11: bool, head_request: bool
) -> tuple[Framing, int | None, bool]:
    """
    @return: the body's framing, its length for L{Framing.LENGTH}, and
        whether the framing lets the connection be kept.
    @raise InvalidResponse: for a faulty C{Transfer-Encoding} or an invalid
        or conflicting C{Content-Length}.
    """
    encoding = headers.get(b"transfer-encoding")
    lengths = headers.get(b"content-length")
    if encoding is not None and not http11:
        raise InvalidResponse("Transfer-Encoding in an HTTP/1.0 answer")
    length = None if lengths is None else _content_length(lengths)
    if head_request or status in _NO_BODY:
        return Framing.LENGTH, 0, True
    if encoding is not None:
        codings = [t.split(b";", 1)[0].strip(b" ") for t in _tokens(encoding)]
        if not codings or not all(_TOKEN.fullmatch(c) for c in codings):
            raise InvalidResponse(f"not a Transfer-Encoding: {encoding!r:.100}")
        if b"chunked" in codings[:-1]:
            raise InvalidResponse("chunked not the last Transfer-Encoding")
        if codings[-1] == b"chunked":
            return Framing.CHUNKED, None, lengths is None
        return Framing.UNTIL_CLOSE, None, False
    if length is None:
        return Framing.UNTIL_CLOSE, None, False
    return Framing.LENGTH, length, True


def _content_length(lengths: list[bytes]) -> int:
    """
    @return: the length the C{Content-Length} values say.
    @raise InvalidResponse: they are not digits, or not all the same.
    """
    values = {v.strip(b" \t") for value in lengths for v in value.split(b",")}
    if len(values) != 1:
        raise InvalidResponse(f"conflicting Content-Length values: {sorted(values)!r}")
    (value,) = values
    if not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
        raise InvalidResponse(f"not a Content-Length: {value[:30]!r}")
    return int(value)


class ResponseParser:
    """
    Reads the answers on one connection, one after another: L{expect}
    before each (but the first), then L{feed} with what the connection
    reads, and L{close} when it closes.

    @param max_head: bytes a head may take.
    @param max_chunk_line: bytes a chunk-size or trailer line may take.
    @param max_trailers: bytes all trailer lines may take.
    """

    def __init__(
        self,
        max_head: int = MAX_HEAD,
        max_chunk_line: int = MAX_CHUNK_LINE,
        max_trailers: int = MAX_TRAILERS,
    ) -> None:
        self.max_head = max_head
        self.max_chunk_line = max_chunk_line
        self.max_trailers = max_trailers
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
        try:
            self._parse(data, events)
        except InvalidResponse as e:
            e.events = events
            self._fail(e)
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

    def _parse(self, data: bytes, events: list[Event]) -> None:
        out: list[bytes] = []  # body data, one event at the end
        try:
            self._parse_into(data, events, out)
        finally:
            if out:
                events.append(out[0] if len(out) == 1 else b"".join(out))

    def _parse_into(self, data: bytes, events: list[Event], out: list[bytes]) -> None:
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
            elif state == _DATA_END:
                two = data[pos : pos + 2]
                if two == b"\r\n":
                    pos += 2
                    self._state = _SIZE
                elif two == b"\r":
                    self._buffer = two
                    break
                else:
                    raise InvalidResponse(
                        f"chunk data not followed by CRLF: {data[pos : pos + 2]!r}"
                    )
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
        if head is None:
            return pos  # an interim answer: the answer follows
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
                f"chunk-size line not ended by CRLF: {data[pos : lf + 1][:40]!r}"
            )
        line = data[pos : lf - 1]
        if line and not line.strip(_HEX):
            digits = line
        else:
            match = _CHUNK_LINE.fullmatch(line)
            if match is None:
                raise InvalidResponse(f"not a chunk size: {line[:40]!r}")
            digits = match.group(1)
        size = int(digits, 16)
        if size >= _MAX_CHUNK:
            raise InvalidResponse(f"chunk size too large: {line[:40]!r}")
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
            self._state = _DONE
            return lf + 1
        self._trailer_bytes += lf + 1 - pos
        if self._trailer_bytes > self.max_trailers:
            raise InvalidResponse(f"trailers longer than {self.max_trailers} bytes")
        _fields([line], {})
        return lf + 1
