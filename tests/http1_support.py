"""
A scripted raw-TCP server on loopback for L{llmgw.router.upstream.http1}'s tests: it
records the requests it reads and answers each with exact bytes, in as many
writes as the test asks for; and the test case that posts to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Protocol, ServerFactory, connectionDone
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.iweb import IResponse
from zope.interface import directlyProvides, providedBy

from llmgw.router.upstream.base import BodyReader
from llmgw.router.upstream.engine_client import EngineClient
from tests.typing_support import tcp_port

Answer = bytes | Sequence[bytes] | Callable[["ServerConnection"], None] | None
"""
What the server does with a request: write these bytes (a sequence: one
write each, a short pause between), call this, or nothing (C{None}).
"""

GAP = 0.004
"""
Seconds between two writes of an answer given in pieces, so that the client
reads them apart.
"""


async def sleep(seconds: float) -> None:
    await deferLater(reactor, seconds, lambda: None)


async def until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """
    @raise AssertionError: C{check()} did not hold within C{timeout} seconds.
    """
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {check}")
        await sleep(0.005)


async def bounded(d: Deferred[Any], timeout: float = 3.0) -> Any:
    """
    @return: what C{d} fires with, or fail with C{TimeoutError} after
        C{timeout} seconds (C{d} is cancelled).
    """
    return await d.addTimeout(timeout, reactor)


class Reader(BodyReader):
    """
    A L{BodyReader} that keeps the body and the reason it ended with.
    """

    def __init__(self, on_data: Callable[[Reader, bytes], None] | None = None) -> None:
        self.chunks: list[bytes] = []
        self.reason: Failure | None = None
        self._hook = on_data
        super().__init__(self._got)

    def _got(self, data: bytes) -> None:
        self.chunks.append(data)
        if self._hook is not None:
            self._hook(self, data)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason
        super().connectionLost(reason)


async def read_body(response: IResponse, timeout: float = 3.0) -> Reader:
    """
    @return: the reader once the body ended well (C{done} fired).
    """
    reader = Reader()
    response.deliverBody(reader)
    await bounded(reader.done, timeout)
    return reader


class ServerConnection(Protocol):
    """
    One connection the server accepted: the requests read on it, each
    answered with the server's next answer.
    """

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.received = b""
        self.requests: list[bytes] = []
        self.closed = False
        self._pending = b""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.setTcpNoDelay(True)  # type: ignore[attr-defined]
        self.server.connections.append(self)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        self._pending += data
        while True:
            end = self._pending.find(b"\r\n\r\n")
            if end == -1:
                return
            length = 0
            for line in self._pending[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            total = end + 4 + length
            if len(self._pending) < total:
                return
            request, self._pending = self._pending[:total], self._pending[total:]
            self.requests.append(request)
            self.server.requests.append(request)
            self.answer(self.server.next_answer())

    def answer(self, answer: Answer) -> None:
        if answer is None:
            return
        if callable(answer):
            answer(self)
        elif isinstance(answer, bytes):
            self.write(answer)
        else:
            self.write_pieces(list(answer))

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.closed:
            self.transport.write(data)

    def write_pieces(self, pieces: list[bytes], gap: float = GAP) -> None:
        if pieces and not self.closed:
            self.write(pieces[0])
            reactor.callLater(gap, self.write_pieces, pieces[1:], gap)

    def close(self) -> None:
        assert self.transport is not None
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = True


class ScriptedServer(ServerFactory):
    """
    Listens on loopback; answers the requests, in the order they come, with
    C{answers}.
    """

    noisy = False

    def __init__(self, answers: Sequence[Answer] = ()) -> None:
        self.answers: list[Answer] = list(answers)
        self.connections: list[ServerConnection] = []
        self.requests: list[bytes] = []
        self.port: IListeningPort | None = None

    def buildProtocol(self, addr: Any) -> ServerConnection:
        return ServerConnection(self)

    def next_answer(self) -> Answer:
        return self.answers.pop(0) if self.answers else None

    def listen(self, interface: str = "127.0.0.1") -> bytes:
        """
        @return: the base URL to post to.
        """
        self.port = reactor.listenTCP(0, self, interface=interface)
        host = f"[{interface}]" if ":" in interface else interface
        return f"http://{host}:{tcp_port(self.port)}".encode()

    def open_connections(self) -> list[ServerConnection]:
        return [c for c in self.connections if not c.closed]

    async def stop(self) -> None:
        """
        Stop listening, close every connection and wait until they closed.
        """
        if self.port is not None:
            stopped = self.port.stopListening()
            if stopped is not None:
                await stopped
        for connection in self.open_connections():
            assert connection.transport is not None
            connection.transport.abortConnection()  # type: ignore[attr-defined]
        await until(lambda: not self.open_connections())
        # The client's side reads the close on a later turn of the reactor.
        await sleep(0.02)


class ShiftedClock:
    """
    The reactor, but its C{seconds()} runs C{shift} seconds ahead: the
    client sees time pass without its timers firing.
    """

    def __init__(self) -> None:
        self.shift = 0.0
        directlyProvides(self, providedBy(reactor))

    def seconds(self) -> float:
        return reactor.seconds() + self.shift

    def __getattr__(self, name: str) -> Any:
        return getattr(reactor, name)


class EngineClientTestCase(TestCase):
    """
    A scripted server and an L{EngineClient} posting to it, on the real
    reactor; every wait bounded.
    """

    timeout = 20

    def start(
        self, *answers: Answer, idle: int = 4, idle_timeout: float = 4.0
    ) -> bytes:
        """
        Start a scripted server and a client; both stop with the test.

        @return: the server's base URL.
        """
        self.server = ScriptedServer(answers)
        base = self.server.listen()
        self.client = self.new_client(idle, idle_timeout)
        self.addCleanup(self.server.stop)
        return base

    def new_client(
        self, idle: int, idle_timeout: float, clock: Any = reactor
    ) -> EngineClient:
        client = EngineClient(clock, 5.0, idle, idle_timeout)
        self.addCleanup(client.closeCachedConnections)
        return client

    async def post(
        self, base: bytes, body: bytes = b"{}", client: EngineClient | None = None
    ) -> IResponse:
        d = (client or self.client).post(base, b"/v1/x", [(b"X-A", b"1")], body)
        response: IResponse = await bounded(d)
        return response

    async def exchange(self, base: bytes) -> Reader:
        return await read_body(await self.post(base))

    async def failure_of(self, d: Any, *errors: type[BaseException]) -> BaseException:
        try:
            await bounded(d)
        except errors as e:
            return e
        raise AssertionError(f"{d} did not fail with {errors}")

    async def closed_by_client(self, connection: ServerConnection) -> None:
        await until(lambda: connection.closed)
        self.assertEqual(self.client.idle_connections(), 0)
