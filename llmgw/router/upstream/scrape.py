"""
A small HTTP/1.1 client for one thing: C{GET} a small page (an engine's
C{/metrics}) again and again over one kept-alive connection per engine.

Why not L{twisted.web.client.Agent} as for traffic: per request, Agent
parses the URL, makes an endpoint (IDNA-encoding the host), looks up its
pool and runs Twisted's general response parser: polling 200 replicas a
second through it cost the server 0.55 ms of CPU per poll, 11% of a core;
through this client 0.22 ms, 4.4% (bench/load_poll_bench.py, parsing
included, on a shared two-core machine).  Here the request is a few
formatted lines and the answer is read, as it comes, by
L{llmgw.router.upstream.response_parser.ResponseParser}, the parser the engine
client uses too.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import optionsForClientTLS
from twisted.python.failure import Failure

from llmgw.reactors import IConnectingReactor
from llmgw.router.upstream.response_parser import (
    End,
    Event,
    Head,
    InvalidResponse,
    ResponseParser,
)

_DONE = Failure(ConnectionDone())


class ScrapeError(Exception):
    """
    The answer could not be read: bad framing, too large, or the connection
    closed before its end.
    """


def build_request(host: str, port: int, path: str, bearer: str | None) -> bytes:
    """
    @return: the bytes of C{GET path} for C{host:port}, asking for a
        kept-alive connection, with C{Authorization: Bearer} when given.
    """
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Accept: text/plain",
        "User-Agent: llmgw-load",
    ]
    if bearer:
        lines.append(f"Authorization: Bearer {bearer}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _QuietFactory(Factory):
    """
    Hands out one protocol, without twisted's "Starting factory" and
    "Stopping factory" log lines for every connection
    (L{twisted.internet.endpoints.connectProtocol} logs both, each time a
    poll connects).
    """

    noisy = False

    def __init__(self, protocol: PageProtocol) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: object) -> PageProtocol:
        return self._protocol


class PageProtocol(Protocol):
    """
    One connection to an engine; L{get} sends a request and fires with
    C{(status, body)}.  One request at a time.

    @param max_size: the most bytes of an answer, head and body.
    @ivar reusable: whether another request may follow on this connection
        (connected, and the last answer did not say C{Connection: close}).
    """

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.reusable = False
        self._parser = ResponseParser()
        self._waiting: Deferred[tuple[int, bytes]] | None = None
        self._status = 0
        self._body: list[bytes] = []
        self._received = 0

    def close(self) -> None:
        """
        Close the connection; no request follows on it.
        """
        self.reusable = False
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionMade(self) -> None:
        self.reusable = True

    def get(self, request: bytes) -> Deferred[tuple[int, bytes]]:
        """
        @return: fires with the status and body; fails with L{ScrapeError}
            or the connection's loss; cancelling it aborts the connection.
        """
        assert self._waiting is None and self.transport is not None
        transport: Any = self.transport

        def cancel(_: Deferred[tuple[int, bytes]]) -> None:
            # The Deferred fails with CancelledError itself: forget it
            # first, so that the loss of the connection aborted here does
            # not fail it a second time.
            self._waiting = None
            self.reusable = False
            transport.abortConnection()

        self._waiting = Deferred(cancel)
        self._parser.expect()
        self._body = []
        self._received = 0
        transport.write(request)
        return self._waiting

    def dataReceived(self, data: bytes) -> None:
        if self._waiting is None:
            # Nothing was asked: the engine speaks out of turn.
            self.reusable = False
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        self._received += len(data)
        try:
            if self._received > self.max_size:
                raise ScrapeError(f"answer over {self.max_size} bytes")
            try:
                events = self._parser.feed(data)
            except InvalidResponse as e:
                raise ScrapeError(f"not valid HTTP/1.1: {e}") from None
            self._events(events)
        except ScrapeError as e:
            self._fail(Failure(e))

    def _events(self, events: list[Event]) -> None:
        for event in events:
            if type(event) is bytes:
                self._body.append(event)
            elif isinstance(event, Head):
                self._status = event.status
                if event.length is not None and event.length > self.max_size:
                    raise ScrapeError(f"answer over {self.max_size} bytes")
            else:
                assert isinstance(event, End)
                self._finish(event.keep_alive)

    def _finish(self, keep: bool) -> None:
        waiting, self._waiting = self._waiting, None
        if not keep:
            self.reusable = False
            self.transport.loseConnection()  # type: ignore[union-attr]
        if waiting is not None:
            waiting.callback((self._status, b"".join(self._body)))

    def _fail(self, reason: Failure) -> None:
        self.reusable = False
        waiting, self._waiting = self._waiting, None
        self.transport.abortConnection()  # type: ignore[union-attr]
        if waiting is not None:
            waiting.errback(reason)

    def connectionLost(self, reason: Failure = _DONE) -> None:
        self.reusable = False
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        if self._parser.close() is not None:
            waiting.callback((self._status, b"".join(self._body)))
        else:
            waiting.errback(
                Failure(ScrapeError("connection closed before the answer's end"))
            )


class Scraper:
    """
    C{GET}s one path of many engines, one connection per key, kept alive
    while the engine allows and C{keep_alive} is set.

    @param reactor: TCP and time.
    @param connect_timeout: seconds to connect.
    @param path: the path asked for, such as C{/metrics}.
    @param max_size: the most bytes of an answer.
    @param keep_alive: keep connections between requests (set it when they
        come more often than engines close idle ones: uvicorn after 5 s).
    """

    def __init__(
        self,
        reactor: IConnectingReactor,
        connect_timeout: float,
        path: str,
        max_size: int,
        keep_alive: bool = True,
    ) -> None:
        self.reactor = reactor
        self.connect_timeout = connect_timeout or 30.0
        self.path = path
        self.max_size = max_size
        self.keep_alive = keep_alive
        self._protocols: dict[str, tuple[str, PageProtocol]] = {}
        self._requests: dict[tuple[str, str | None], tuple[str, str, int, bytes]] = {}

    async def get(self, key: str, url: str, bearer: str | None) -> tuple[int, bytes]:
        """
        @param key: whose connection (a replica id).
        @param url: the engine's base URL, C{http://host:port} or https.
        @return: the status and body.
        @raise ScrapeError: the answer could not be read.
        """
        kept = self._protocols.pop(key, None)
        if kept is not None and (kept[0] != url or not kept[1].reusable):
            kept[1].close()
            kept = None
        scheme, host, port, request = self._request(url, bearer)
        protocol = (
            kept[1] if kept is not None else await self._connect(scheme, host, port)
        )
        try:
            result = await protocol.get(request)
        except BaseException:
            protocol.close()
            raise
        if self.keep_alive and protocol.reusable:
            self._protocols[key] = (url, protocol)
        else:
            protocol.close()
        return result

    def _request(self, url: str, bearer: str | None) -> tuple[str, str, int, bytes]:
        # Parsed once per URL and secret: urlsplit costs as much as the
        # rest of a poll's request side.
        found = self._requests.get((url, bearer))
        if found is None:
            if len(self._requests) >= 4096:
                self._requests.clear()
            parts = urlsplit(url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            request = build_request(host, port, self.path, bearer)
            found = self._requests[url, bearer] = (parts.scheme, host, port, request)
        return found

    async def _connect(self, scheme: str, host: str, port: int) -> PageProtocol:
        endpoint: Any = HostnameEndpoint(
            self.reactor, host.encode("idna"), port, timeout=self.connect_timeout
        )
        if scheme == "https":
            endpoint = wrapClientTLS(optionsForClientTLS(host), endpoint)
        factory = _QuietFactory(PageProtocol(self.max_size))
        protocol: PageProtocol = await endpoint.connect(factory)
        return protocol

    def forget(self, key: str) -> None:
        """
        Close C{key}'s idle connection, if any.
        """
        kept = self._protocols.pop(key, None)
        if kept is not None:
            kept[1].close()

    def close_all(self) -> None:
        """
        Close every idle connection.
        """
        for key in list(self._protocols):
            self.forget(key)
