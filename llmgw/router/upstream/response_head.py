"""
The head of an HTTP/1.1 answer: its status line and header fields read
into a L{Head}, with the body's framing they say, by the rules that
L{llmgw.router.upstream.response_parser} lists; that module reads the rest.

The parser's events (L{Event}: a L{Head}, body bytes, an L{End}) are
declared here, below the parser, because L{InvalidResponse} carries
them: the parser imports this module and this module imports nothing of
it.
"""

from __future__ import annotations

import re
from enum import Enum

MAX_LENGTH_DIGITS = 18
"""
Digits a C{Content-Length} may have (under 2**63).
"""


class InvalidResponse(ValueError):
    """
    The bytes are not a valid HTTP/1.1 answer; the message says why:
    C{what}, then the offending bytes when there are some
    (C{"not a status line: b'HTTP/1.1 2x0'"}), for the operator's log.

    @ivar what: what was wrong, in words that carry none of the answer's
        bytes (C{"not a status line"}): what a client may be told, since
        an engine's bytes may hold its addresses or paths.
    @ivar events: what the same L{ResponseParser.feed} parsed before the
        error, in order (a L{Head}, body data), to be handled before it.
    """

    def __init__(self, what: str, detail: str = "") -> None:
        super().__init__(f"{what}: {detail}" if detail else what)
        self.what = what
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


TOKEN_CHARS = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
"""
The bytes of a token (RFC 9110 section 5.6.2), for a regular expression.
"""
_TOKEN_CHARS = TOKEN_CHARS
_FIELD = re.compile(rb"([" + _TOKEN_CHARS + rb"]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)")
_FOLD = re.compile(rb"[ \t]+([^\x00-\x08\x0a-\x1f\x7f]*)")
_TOKEN = re.compile(rb"[" + _TOKEN_CHARS + rb"]+")
_CRLF_FIELDS = re.compile(
    rb"[" + _TOKEN_CHARS + rb"]+:[^\x00-\x08\x0a-\x1f\x7f]*"
    rb"(?:\r\n[" + _TOKEN_CHARS + rb"]+:[^\x00-\x08\x0a-\x1f\x7f]*)*"
)
_STATUS_LINE = re.compile(
    rb"HTTP/1\.([0-9]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?"
)
_NO_BODY = frozenset({204, 304})


def parse_fields(lines: list[bytes], headers: dict[bytes, list[bytes]]) -> None:
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
                raise InvalidResponse("not a header line", repr(line[:100]))
            more = folded.group(1).rstrip(b" \t")
            if more:
                last[-1] = (last[-1] + b" " + more) if last[-1] else more
            continue
        match = _FIELD.fullmatch(line)
        if match is None:
            raise InvalidResponse("not a header line", repr(line[:100]))
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
    if block[-1:] == b"\r":
        block = block[:-1]
    status_line, _, rest = block.partition(b"\n")
    if status_line[-1:] == b"\r":
        status_line = status_line[:-1]
    match = _STATUS_LINE.fullmatch(status_line)
    if match is None:
        if not status_line.startswith(b"HTTP/1."):
            raise InvalidResponse(
                "not an HTTP/1.x status line", repr(status_line[:100])
            )
        raise InvalidResponse("not a status line", repr(status_line[:100]))
    status = int(match.group(2))
    if not 100 <= status <= 599:
        raise InvalidResponse("not a status code", str(status))
    if status == 101:
        raise InvalidResponse("101 Switching Protocols, and no upgrade was asked")
    headers: dict[bytes, list[bytes]] = {}
    if rest:
        if b"\n " in rest or b"\n\t" in rest or _CRLF_FIELDS.fullmatch(rest) is None:
            # Bare LFs, folded lines, or an invalid line: line by line.
            parse_fields(rest.split(b"\n"), headers)
        else:
            # The common case, every line a field ending in CRLF, checked
            # by one regular expression above.
            for line in rest.split(b"\r\n"):
                name, _, value = line.partition(b":")
                name = name.lower()
                values = headers.get(name)
                if values is None:
                    headers[name] = [value.strip(b" \t")]
                else:
                    values.append(value.strip(b" \t"))
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
            raise InvalidResponse("not a Transfer-Encoding", f"{encoding!r:.100}")
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
    if len(lengths) == 1:
        value = lengths[0]
        if value.isdigit() and len(value) <= MAX_LENGTH_DIGITS:
            return int(value)
    values = {v.strip(b" \t") for value in lengths for v in value.split(b",")}
    if len(values) != 1:
        raise InvalidResponse("conflicting Content-Length values", repr(sorted(values)))
    (value,) = values
    if not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
        raise InvalidResponse("not a Content-Length", repr(value[:30]))
    return int(value)
