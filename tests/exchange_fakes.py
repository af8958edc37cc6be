"""
Fakes for in-process router tests: an engine client (the router's
L{llmgw.router.upstream.base.Upstream}) whose answers a test gives, a response
whose body a test writes, and a client request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer


@implementer(IPushProducer)
class FakeTransport:
    """
    The transport of a response body: stopping it closes the connection.
    """

    def __init__(self) -> None:
        self.paused = False
        self.stopped = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.stopped = True


@implementer(IResponse)
class FakeResponse:
    """
    A replica's answer; the test writes its body with L{write} and ends it
    with L{end} or L{lose}.
    """

    version = (b"HTTP", 1, 1)
    phrase = b"OK"
    request = None
    previousResponse = None

    def __init__(
        self, code: int, content_type: bytes, length: int | object = UNKNOWN_LENGTH
    ) -> None:
        self.code = code
        self.headers = Headers({b"content-type": [content_type]})
        self.length = length
        self.transport = FakeTransport()
        self.protocol: Protocol | None = None

    def deliverBody(self, protocol: Protocol) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)

    def write(self, data: bytes) -> None:
        assert self.protocol is not None
        self.protocol.dataReceived(data)

    def end(self) -> None:
        assert self.protocol is not None
        self.protocol.connectionLost(Failure(ResponseDone()))

    def lose(self, reason: Exception) -> None:
        assert self.protocol is not None
        self.protocol.connectionLost(Failure(reason))

    def setPreviousResponse(self, response: IResponse) -> None:
        pass


@dataclass
class Sent:
    """
    One request the agent was asked to send.
    """

    uri: bytes
    headers: Headers
    body: bytes
    answer: Deferred[IResponse]
    cancelled: bool = False
    fresh: bool = False
    method: str = "POST"


class FakeAgent:
    """
    An L{llmgw.router.upstream.base.Upstream} that records each request; its
    answer waits for the test (a L{FakeResponse}, or a failure such as
    L{llmgw.router.upstream.base.NoAnswer}).
    """

    def __init__(self) -> None:
        self.sent: list[Sent] = []

    def post(
        self,
        base: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        fresh: bool = False,
    ) -> Deferred[IResponse]:
        def cancel(d: Deferred[IResponse]) -> None:
            sent.cancelled = True

        table = Headers()
        for name, value in headers:
            table.addRawHeader(name, value)
        sent = Sent(base + path, table, body, Deferred(cancel), fresh=fresh)
        self.sent.append(sent)
        return sent.answer

    def get(
        self, base: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> Deferred[IResponse]:
        """
        Recorded as a POST with no body is (C{Sent.method} C{GET}).
        """
        answer = self.post(base, path, headers, b"")
        self.sent[-1].method = "GET"
        return answer


@dataclass
class FakeClientTransport:
    """
    The unsent bytes of a client's connection, as Twisted's
    C{FileDescriptor} keeps them.
    """

    dataBuffer: bytes = b""
    offset: int = 0
    _tempDataLen: int = 0


@dataclass
class FakeChannel:
    """
    A client's HTTP connection: its transport, and whether it was aborted.
    """

    transport: FakeClientTransport = field(default_factory=FakeClientTransport)
    aborted: bool = False

    def abortConnection(self) -> None:
        self.aborted = True


@dataclass
class FakeRequest:
    """
    A client request as the exchange uses it.
    """

    headers: dict[bytes, bytes] = field(default_factory=dict)
    code: int | None = None
    response_headers: dict[bytes, bytes] = field(default_factory=dict)
    written: list[bytes] = field(default_factory=list)
    producer: Any = None
    _disconnected: bool = False
    channel: FakeChannel = field(default_factory=lambda: FakeChannel())

    def getClientAddress(self) -> IPv4Address:
        return IPv4Address("TCP", "10.0.0.9", 4321)

    def getHeader(self, name: bytes) -> bytes | None:
        return self.headers.get(name.lower())

    def setResponseCode(self, code: int) -> None:
        self.code = code

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.response_headers[name.lower()] = value

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        assert self.producer is None
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None
