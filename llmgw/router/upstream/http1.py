"""
One HTTP/1.1 connection of the router to an engine replica
(L{EngineConnection}), one request at a time, and the answer it reads
(L{Response}); L{llmgw.router.upstream.engine_client.EngineClient} keeps them per
replica.

Written for the one exchange the router makes, a POST whose body is already
in memory, answered with a status, headers and a body of a known length,
chunked (streams) or ended by the close: the request goes out in one write,
the head of the answer is parsed in one pass, and the body is handed on as
it arrives.  Twisted's L{twisted.web.client.Agent}, which it replaces here,
parses the URL, builds header objects and runs a line parser and several
Deferreds per request: on C{bench/router_bench.py}'s load that was a fifth
of the router's CPU per request (cProfile).

The answer is read by L{llmgw.router.upstream.response_parser.ResponseParser}, which
holds the rules of RFC 9112 (framing, chunks, persistence, limits); this
module turns its events into a L{Response} and keeps the connection when
the answer allows it and is HTTP/1.1.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IProtocol,
    IPushProducer,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

from llmgw.router.upstream.base import BadAnswer, NoAnswer
from llmgw.router.upstream.response_parser import (
    MAX_CHUNK_LINE,
    MAX_HEAD,
    End,
    Framing,
    Head,
    InvalidResponse,
    ResponseParser,
)

__all__ = [
    "MAX_CHUNK_LINE",
    "MAX_HEAD",
    "AnswerBroken",
    "BadAnswer",
    "EngineConnection",
    "Response",
]


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


class ConnectionPool(TypingProtocol):
    """
    Where a connection goes back when its answer ended and it may be kept
    (L{llmgw.router.upstream.engine_client.EngineClient}).
    """

    def put(self, connection: EngineConnection) -> None: ...

    def forget(self, connection: EngineConnection) -> None: ...


class EngineConnection(Protocol):
    """
    One connection to a replica.  L{send} writes a request and returns the
    Deferred of its answer's head; the body goes to the L{Response}.  When
    an answer ends and the connection may be kept, it goes back to C{pool}.
    """

    def __init__(self, pool: ConnectionPool, key: bytes) -> None:
        self._pool = pool
        self.key = key
        self.state = _IDLE
        # Reactor seconds since when it waits in its pool (went_idle).
        self.idle_since = 0.0
        self.answer_count = 0
        self.answer: Deferred[IResponse] | None = None
        self.body: Response | None = None
        self._reused = False
        self._parser = ResponseParser()
        self._keep = True
        self._paused = False

    def went_idle(self, now: float) -> None:
        """
        It went back to its pool at C{now} (reactor seconds), idle.
        """
        self.idle_since = now

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
        self._parser.expect()
        assert self.transport is not None
        self.transport.writeSequence([head, body])

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state == _CLOSED:
            return
        if state == _IDLE:
            # Bytes no request asked for: the connection is out of step.
            self._pool.forget(self)
            self.abort()
            return
        try:
            events = self._parser.feed(data)
        except InvalidResponse as e:
            self._events(e.events)
            if self.state == _HEAD:
                self._fail_head(BadAnswer(str(e), e.what))
            elif self.state == _BODY:
                self._body_failed(BadAnswer(str(e), e.what))
            return
        self._events(events)

    def _events(self, events: list[bytes | Head | End]) -> None:
        # The body data of one read comes as one piece: an engine that
        # sends faster than the router reads (events queued while the
        # router was busy) costs one relay step and one write to the
        # client, not one per event.
        for event in events:
            body = self.body
            if type(event) is bytes:
                assert body is not None
                body._data(event)
            elif isinstance(event, Head):
                self._head(event)
            else:
                assert isinstance(event, End)
                self._body_done(event.keep_alive)
            if self.state == _CLOSED or (body is not None and self.body is not body):
                return  # aborted meanwhile, or the answer ended

    def _head(self, head: Head) -> None:
        self._keep = head.keep_alive and head.http11
        response = self.body = Response(
            head.status,
            head.reason,
            ResponseHeaders(head.headers),
            head.length if head.framing is Framing.LENGTH else UNKNOWN_LENGTH,
            _BodyTransport(self, self.answer_count),
        )
        self.state = _BODY
        answer, self.answer = self.answer, None
        assert answer is not None
        answer.callback(response)

    def _fail_head(self, error: BadAnswer) -> None:
        # Logged by whoever asked (llmgw.router.upstream.base.refused_answer),
        # which knows the replica's id and the request's.
        answer, self.answer = self.answer, None
        self.state = _CLOSED
        self._pool.forget(self)
        assert self.transport is not None
        self.transport.abortConnection()  # type: ignore[attr-defined]
        if answer is not None:
            answer.errback(Failure(error))

    def _body_done(self, keep: bool) -> None:
        body = self.body
        assert body is not None
        self.body = None
        if self._paused:
            self.resume()
        if self._keep and keep:
            self.state = _IDLE
            self._pool.put(self)
        else:
            # Bytes after the answer, or a connection not to keep.
            self.state = _CLOSED
            assert self.transport is not None
            self.transport.loseConnection()
        body._end(Failure(ResponseDone("Response body fully received")))

    def _body_failed(self, error: BadAnswer) -> None:
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
            if self._parser.started:
                answer.errback(Failure(AnswerBroken(f"in the head: {message}")))
            else:
                answer.errback(Failure(NoAnswer(message, self._reused)))
        body, self.body = self.body, None
        if body is not None:
            ended = self._parser.close()
            if ended is not None and reason.check(type(connectionDone.value)):
                body._end(Failure(PotentialDataLoss()))
            else:
                body._end(Failure(AnswerBroken(reason.getErrorMessage())))
