"""
One HTTP/1.1 connection of the router to an engine replica
(L{EngineConnection}), one request at a time, and the answer it reads
(L{Response}); L{llmgw.router.engine_client.EngineClient} keeps them per
replica.

Written for the one exchange the router makes, a POST whose body is already
in memory, answered with a status, headers and a body of a known length,
chunked (streams) or ended by the close: the request goes out in one write,
the head of the answer is parsed in one pass, and the body is handed on as
it arrives.  Twisted's L{twisted.web.client.Agent}, which it replaces here,
parses the URL, builds header objects and runs a line parser and several
Deferreds per request: on C{bench/router_bench.py}'s load that was a fifth
of the router's CPU per request (cProfile).

The framing follows RFC 9112: section 6.3 for the body's length (a
C{Transfer-Encoding} overrides a C{Content-Length}; no body after 1xx, 204
and 304; otherwise the body ends with the connection), section 7.1 for
chunks, section 9.3 for persistence (HTTP/1.1 keeps the connection unless
C{Connection: close}).  Interim 1xx answers are skipped.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IProtocol,
    IPushProducer,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

from llmgw.router.upstream import BadAnswer, NoAnswer

MAX_HEAD = 64 * 1024
"""
Bytes an answer's status line and headers may take.
"""

MAX_CHUNK_LINE = 4096
"""
Bytes a chunk-size line (with its extensions) or a trailer line may take.
"""


class AnswerBroken(Exception):
    """
    The connection closed in the middle of an answer's head or body.
    """


class ResponseHeaders:
    """
    An answer's headers, names lower-cased: the reading side of
    L{twisted.web.http_headers.Headers} that the router uses.
    """

    def __init__(self, raw: dict[bytes, list[bytes]]) -> None:
        self._raw = raw

    def getRawHeaders(
        self, name: bytes, default: list[bytes] | None = None
    ) -> list[bytes] | None:
        """
        @return: the values of the header C{name} (any case), in order,
            or C{default} when there is none.
        """
        return self._raw.get(name.lower(), default)

    def hasHeader(self, name: bytes) -> bool:
        return name.lower() in self._raw


@implementer(IPushProducer)
class _BodyTransport:
    """
    What a body protocol sees as its transport: the connection's flow
    control for this answer only; once the answer ended it does nothing.
    """

    def __init__(self, connection: EngineConnection, answer: int) -> None:
        self._connection = connection
        self._answer = answer

    def _mine(self) -> bool:
        return self._connection.answer_count == self._answer and (
            self._connection.body is not None
        )

    def pauseProducing(self) -> None:
        if self._mine():
            self._connection.pause()

    def resumeProducing(self) -> None:
        if self._mine():
            self._connection.resume()

    def stopProducing(self) -> None:
        if self._mine():
            self._connection.abort()


@implementer(IResponse)
class Response:
    """
    A replica's answer, once its head came; its body is handed to the
    protocol given to L{deliverBody}, chunk by chunk, and ends with that
    protocol's C{connectionLost}: L{ResponseDone} when the body is whole,
    L{PotentialDataLoss} when it was ended by the close, another failure
    when it broke.
    """

    version = (b"HTTP", 1, 1)
    request = None
    previousResponse = None

    def __init__(
        self,
        code: int,
        phrase: bytes,
        headers: ResponseHeaders,
        length: int | object,
        transport: _BodyTransport,
    ) -> None:
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.length = length
        self._transport = transport
        self._protocol: IProtocol | None = None
        self._buffered: list[bytes] = []
        self._ended: Failure | None = None

    def deliverBody(self, protocol: IProtocol) -> None:
        self._protocol = protocol
        protocol.makeConnection(self._transport)  # type: ignore[arg-type]
        buffered, self._buffered = self._buffered, []
        for data in buffered:
            protocol.dataReceived(data)
        if self._ended is not None:
            protocol.connectionLost(self._ended)

    def setPreviousResponse(self, response: IResponse) -> None:
        self.previousResponse = response

    def _data(self, data: bytes) -> None:
        if self._protocol is not None:
            self._protocol.dataReceived(data)
        else:
            self._buffered.append(data)

    def _end(self, reason: Failure) -> None:
        if self._protocol is not None:
            self._protocol.connectionLost(reason)
        else:
            self._ended = reason


# What a connection is doing.
_IDLE = 0  # in the pool, or not yet sent anything
_HEAD = 1  # request sent, reading the answer's head
_BODY = 2  # reading the answer's body
_CLOSED = 3

# How the body is framed.
_LENGTH = 0
_CHUNKED = 1
_UNTIL_CLOSE = 2

# Where a chunked body is.
_SIZE = 0
_DATA = 1
_DATA_END = 2
_TRAILER = 3

_NO_BODY_STATUSES = frozenset({204, 304})
_HEX = b"0123456789abcdefABCDEF"


def _parse_head(
    head: bytes,
) -> tuple[int, bytes, dict[bytes, list[bytes]], bool]:
    """
    @param head: the status line and header lines, without the blank line
        that ends them; lines end in CRLF or a bare LF.
    @return: status, reason phrase, headers (names lower-cased) and whether
        the answer is HTTP/1.1 (HTTP/1.0 answers do not keep the
        connection).
    @raise BadAnswer: when it is not an HTTP/1.x head.
    """
    lines = head.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise BadAnswer(f"not an HTTP/1.x status line: {status_line[:100]!r}")
    code_bytes = parts[1]
    if len(code_bytes) != 3 or not code_bytes.isdigit():
        raise BadAnswer(f"not a status code: {code_bytes[:100]!r}")
    headers: dict[bytes, list[bytes]] = {}
    last: list[bytes] | None = None
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):
            # An obsolete folded line continues the header before it.
            if last is None:
                raise BadAnswer("a folded line before any header")
            last[-1] += b" " + line.strip()
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadAnswer(f"not a header line: {line[:100]!r}")
        last = headers.setdefault(name.lower(), [])
        last.append(value.strip(b" \t"))
    return (
        int(code_bytes),
        parts[2] if len(parts) > 2 else b"",
        headers,
        (parts[0] == b"HTTP/1.1"),
    )


def _framing(code: int, headers: dict[bytes, list[bytes]]) -> tuple[int, int, bool]:
    """
    @return: the body's framing (C{_LENGTH}, C{_CHUNKED}, C{_UNTIL_CLOSE}),
        its length (for C{_LENGTH}) and whether the framing allows the
        connection to be kept.
    @raise BadAnswer: for an invalid or conflicting C{Content-Length}.
    """
    if code in _NO_BODY_STATUSES:
        return _LENGTH, 0, True
    encoding = headers.get(b"transfer-encoding")
    if encoding is not None:
        codings = b",".join(encoding).lower().split(b",")
        chunked = codings[-1].strip() == b"chunked"
        # Both headers at once: RFC 9112 section 6.3 says to close after.
        keep = b"content-length" not in headers
        return (_CHUNKED, 0, keep) if chunked else (_UNTIL_CLOSE, 0, False)
    lengths = headers.get(b"content-length")
    if lengths is None:
        return _UNTIL_CLOSE, 0, False
    values = {v.strip() for value in lengths for v in value.split(b",")}
    if len(values) != 1:
        raise BadAnswer(f"conflicting Content-Length values: {sorted(values)!r}")
    (value,) = values
    if not value.isdigit() or len(value) > 18:
        raise BadAnswer(f"not a Content-Length: {value[:30]!r}")
    return _LENGTH, int(value), True


class ConnectionPool(TypingProtocol):
    """
    Where a connection goes back when its answer ended and it may be kept
    (L{llmgw.router.engine_client.EngineClient}).
    """

    def put(self, connection: EngineConnection) -> None: ...

    def forget(self, connection: EngineConnection) -> None: ...


class EngineConnection(Protocol):
    """
    One connection to a replica.  L{send} writes a request and returns the
    Deferred of its answer's head; the body goes to the L{Response}.  When
    an answer ends and the connection may be kept, it goes back to C{pool}.
    """

    log = Logger()

    def __init__(self, pool: ConnectionPool, key: bytes) -> None:
        self._pool = pool
        self.key = key
        self.state = _IDLE
        self.idle_since = 0.0
        self.answer_count = 0
        self.answer: Deferred[IResponse] | None = None
        self.body: Response | None = None
        self._reused = False
        self._received_any = False
        self._buffer = b""
        self._keep = True
        self._framing = _LENGTH
        self._remaining = 0
        self._chunk_state = _SIZE
        self._paused = False

    def send(
        self, head: bytes, body: bytes, answer: Deferred[IResponse], reused: bool
    ) -> None:
        """
        Write a request; C{answer} fires with its L{Response}, fails with
        L{NoAnswer} when the connection closes before any byte of an
        answer, with L{BadAnswer} or L{AnswerBroken} otherwise.
        """
        self.state = _HEAD
        self.answer = answer
        self.answer_count += 1
        self._reused = reused
        self._received_any = False
        self._buffer = b""
        self._keep = True
        assert self.transport is not None
        self.transport.writeSequence([head, body])

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state == _CLOSED:
            return
        if state == _BODY:
            self._body_data(data)
        elif state == _HEAD:
            self._received_any = True
            self._head_data(data)
        elif state == _IDLE:
            # Bytes no request asked for: the connection is out of step.
            self._pool.forget(self)
            self.abort()

    def _head_data(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        while True:
            end = buffer.find(b"\n\r\n")
            lf = buffer.find(b"\n\n")
            if lf != -1 and (end == -1 or lf < end):
                end, skip = lf, 2
            else:
                skip = 3
            # The limit holds whether or not the head's end came in the
            # same read as the bytes past it.
            if (end == -1 and len(buffer) > MAX_HEAD) or end > MAX_HEAD:
                self._fail_head(BadAnswer(f"head longer than {MAX_HEAD} bytes"))
                return
            if end == -1:
                self._buffer = buffer
                return
            try:
                code, phrase, headers, http11 = _parse_head(buffer[:end])
                rest = buffer[end + skip :]
                if 100 <= code < 200:
                    # Interim (100 Continue, 103 Early Hints): the answer
                    # follows.
                    buffer = rest
                    continue
                framing, length, keep = _framing(code, headers)
            except BadAnswer as e:
                self._fail_head(e)
                return
            break
        self._buffer = b""
        connection = headers.get(b"connection")
        if connection is not None:
            tokens = b",".join(connection).lower().split(b",")
            if b"close" in (t.strip() for t in tokens):
                keep = False
        self._keep = keep and http11
        self._framing = framing
        self._remaining = length
        self._chunk_state = _SIZE
        response = self.body = Response(
            code,
            phrase,
            ResponseHeaders(headers),
            length if framing == _LENGTH else UNKNOWN_LENGTH,
            _BodyTransport(self, self.answer_count),
        )
        self.state = _BODY
        answer, self.answer = self.answer, None
        assert answer is not None
        answer.callback(response)
        if self.state != _BODY or self.body is not response:
            return  # aborted meanwhile
        if framing == _LENGTH and length == 0:
            self._body_done(rest)
        elif rest:
            self._body_data(rest)

    def _refused(self, error: BadAnswer) -> None:
        # The client is only told that the answer was not valid HTTP.
        self.log.warn(
            "replica {replica}: its answer is not valid HTTP/1.1 ({reason});"
            " connection closed",
            replica=self.key.decode("ascii", "replace"),
            reason=str(error),
        )

    def _fail_head(self, error: BadAnswer) -> None:
        self._refused(error)
        answer, self.answer = self.answer, None
        self.state = _CLOSED
        self._pool.forget(self)
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]
        if answer is not None:
            answer.errback(Failure(error))

    def _body_data(self, data: bytes) -> None:
        body = self.body
        assert body is not None
        framing = self._framing
        if framing == _LENGTH:
            remaining = self._remaining
            if len(data) < remaining:
                self._remaining = remaining - len(data)
                body._data(data)
                return
            self._remaining = 0
            if remaining:
                body._data(data[:remaining])
            if self.state == _BODY:
                self._body_done(data[remaining:])
        elif framing == _UNTIL_CLOSE:
            body._data(data)
        else:
            self._chunked_data(body, data)

    def _chunked_data(self, body: Response, data: bytes) -> None:
        # The chunks decoded from one read go on as one piece: an engine
        # that sends faster than the router reads (events queued while
        # the router was busy) costs one relay step and one write to the
        # client, not one per event.
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        out: list[bytes] = []
        error: BadAnswer | None = None
        rest: bytes | None = None  # the bytes after the body, once it ended
        while buffer:
            state = self._chunk_state
            if state == _DATA:
                remaining = self._remaining
                if len(buffer) < remaining:
                    self._remaining = remaining - len(buffer)
                    out.append(buffer)
                    break
                out.append(buffer[:remaining])
                buffer = buffer[remaining:]
                self._remaining = 0
                self._chunk_state = _DATA_END
                continue
            line_end = buffer.find(b"\n")
            if (line_end == -1 and len(buffer) > MAX_CHUNK_LINE) or (
                line_end > MAX_CHUNK_LINE
            ):
                error = BadAnswer("chunk line too long")
                break
            if line_end == -1:
                self._buffer = buffer
                break
            line, buffer = buffer[:line_end].rstrip(b"\r"), buffer[line_end + 1 :]
            if state == _SIZE:
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if not size_text or size_text.strip(_HEX) or len(size_text) > 15:
                    error = BadAnswer(f"not a chunk size: {line[:40]!r}")
                    break
                size = int(size_text, 16)
                if size == 0:
                    self._chunk_state = _TRAILER
                else:
                    self._remaining = size
                    self._chunk_state = _DATA
            elif state == _DATA_END:
                if line:
                    error = BadAnswer("chunk data longer than its size")
                    break
                self._chunk_state = _SIZE
            elif not line:  # _TRAILER: a blank line ends the body
                rest = buffer
                break
        if out:
            body._data(out[0] if len(out) == 1 else b"".join(out))
            if self.state != _BODY or self.body is not body:
                return  # the body's reader stopped it
        if error is not None:
            self._body_failed(error)
        elif rest is not None:
            self._body_done(rest)

    def _body_done(self, extra: bytes) -> None:
        body = self.body
        assert body is not None
        self.body = None
        if self._paused:
            self.resume()
        if self._keep and not extra:
            self.state = _IDLE
            self._pool.put(self)
        else:
            # Bytes after the answer, or a connection not to keep.
            self.state = _CLOSED
            assert self.transport is not None
            self.transport.loseConnection()
        body._end(Failure(ResponseDone("Response body fully received")))

    def _body_failed(self, error: BadAnswer) -> None:
        self._refused(error)
        body, self.body = self.body, None
        self.abort()
        if body is not None:
            body._end(Failure(error))

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def abort(self) -> None:
        """
        Close the connection now; the answer in progress fails.
        """
        if self.state == _CLOSED:
            return
        self.state = _CLOSED
        self._pool.forget(self)
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.state = _CLOSED
        self._pool.forget(self)
        answer, self.answer = self.answer, None
        if answer is not None and not answer.called:
            message = reason.getErrorMessage()
            if self._received_any:
                answer.errback(Failure(AnswerBroken(f"in the head: {message}")))
            else:
                answer.errback(Failure(NoAnswer(message, self._reused)))
        body, self.body = self.body, None
        if body is not None:
            if self._framing == _UNTIL_CLOSE and reason.check(
                type(connectionDone.value)
            ):
                body._end(Failure(PotentialDataLoss()))
            else:
                body._end(Failure(AnswerBroken(reason.getErrorMessage())))
