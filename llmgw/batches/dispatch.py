"""
One batch line sent to the server's own client API, over the loopback
listener the server opens for its runner alone
(L{llmgw.router.edge.internal}): the line takes the path a client's request
takes, as the key that made its batch.

Twisted's own HTTP/1.1 client, its connections kept (one per line in
flight at most), is enough here: the peer is this process's own router, on
loopback, and the lines' answers are whole JSON bodies (no stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError, ConnectionClosed, TimeoutError
from twisted.internet.interfaces import IConsumer, IReactorTCP
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from llmgw.router.edge.internal import runner_headers
from llmgw.router.edge.site import BatchLineId
from llmgw.twisted_private import HTTP11ClientFactory

_NOT_SENT = (
    ConnectError,
    ConnectionClosed,
    TimeoutError,
    ResponseFailed,
    ResponseNeverReceived,
    RequestTransmissionFailed,
)


class _QuietFactory(HTTP11ClientFactory):
    # Twisted logs a start and a stop line per connection's factory
    # otherwise.
    noisy = False


class _QuietPool(HTTPConnectionPool):
    _factory = _QuietFactory


@dataclass(frozen=True)
class Answer:
    """
    What the client API answered a line.

    @ivar status: the HTTP status.
    @ivar body: the body, whole.
    @ivar retry_after: its C{Retry-After}, seconds, or L{None}.
    """

    status: int
    body: bytes
    retry_after: float | None = None


class NotSent(Exception):
    """
    The line never got an answer: the connection to the loopback listener
    failed or closed first (the server is stopping, or the listener is
    gone).  The line goes back to pending.
    """


class LineSender:
    """
    Sends lines to the loopback listener at C{port}.

    @param reactor: the reactor, for connections.
    @param port: the loopback listener's port, on 127.0.0.1.
    @param secret: the runner's secret for this process.
    @param connections: connections kept at most (the runner's bound on
        lines in flight).
    """

    def __init__(
        self,
        reactor: IReactorTCP,
        port: int,
        secret: bytes,
        connections: int,
    ) -> None:
        self._secret = secret
        self._base = f"http://127.0.0.1:{port}"
        self.pool = _QuietPool(reactor, persistent=True)  # type: ignore[no-untyped-call]
        self.pool.maxPersistentPerHost = connections
        self.pool.retryAutomatically = False
        self._agent = Agent(reactor, connectTimeout=10, pool=self.pool)

    async def send(self, line: BatchLineId, url: str, body: bytes) -> Answer:
        """
        @param url: the line's path, C{/v1/chat/completions}.
        @param body: its request body, JSON.
        @return: the answer.
        @raise NotSent: no answer came.
        """
        sent = runner_headers(self._secret, line)
        headers = Headers({name: [value] for name, value in sent.items()})
        try:
            response: IResponse = await self._agent.request(
                b"POST", (self._base + url).encode("ascii"), headers, _Body(body)
            )
            data = await readBody(response)
        except _NOT_SENT as e:
            raise NotSent(str(e)) from e
        retry = response.headers.getRawHeaders(b"retry-after")
        return Answer(response.code, data, _seconds(retry[0] if retry else None))

    def close(self) -> Deferred[None]:
        """
        Close the kept connections.
        """
        return self.pool.closeCachedConnections()  # type: ignore[no-untyped-call,no-any-return]


def _seconds(value: bytes | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


@implementer(IBodyProducer)
class _Body:
    """
    A request body of known bytes (C{IBodyProducer}), written at once.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._data)
        done: Deferred[None] = Deferred()
        done.callback(None)
        return done

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass
