"""
The router's client to engine replicas: L{EngineClient} keeps HTTP/1.1
connections (L{llmgw.router.upstream.http1.EngineConnection}) per replica and sends
each POST on one, new or kept.

Connections are kept per replica, the most recently used handed out first
(the others age out), at most C{max_idle_connections} each, none handed
out after C{idle_connection_timeout}; one sweep timer closes the stale
ones, instead of a timer per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import (
    IDelayedCall,
    IProtocol,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure
from twisted.web.client import URI
from twisted.web.iweb import IResponse

from llmgw.reactors import IConnectingReactor
from llmgw.router.upstream.base import endpoint_for
from llmgw.router.upstream.http1 import EngineConnection


class EngineConnectionFactory(Factory):
    noisy = False

    def __init__(self, pool: EngineClient, key: bytes) -> None:
        self._pool = pool
        self._key = key

    def buildProtocol(self, addr: Any) -> EngineConnection:
        return EngineConnection(self._pool, self._key)


class _Target:
    """
    A replica's base URL, parsed once: where to connect and what to send.
    """

    def __init__(
        self, base: bytes, reactor: IConnectingReactor, connect_timeout: float
    ) -> None:
        uri = URI.fromBytes(base)
        self.prefix = uri.path.rstrip(b"/")
        host = uri.host
        if b":" in host:
            host = b"[" + host + b"]"
        default_port = {b"http": 80, b"https": 443}.get(uri.scheme)
        self.host_line = b"Host: " + (
            host if uri.port == default_port else host + b":%d" % uri.port
        )
        self.endpoint: IStreamClientEndpoint = endpoint_for(
            reactor, uri.scheme, uri.host, uri.port, connect_timeout
        )


def _clean(value: bytes) -> bytes:
    # A header value must not end the line early (CR, LF) nor carry NUL.
    if b"\r" in value or b"\n" in value or b"\0" in value:
        return value.replace(b"\r", b" ").replace(b"\n", b" ").replace(b"\0", b" ")
    return value


# Replicas' base URLs kept parsed: more than this in a router's life start
# the cache again.
MAX_TARGETS = 4096


class EngineClient:
    """
    POSTs to replicas over kept-alive HTTP/1.1 connections.

    @param reactor: TCP, time and name resolution.
    @param connect_timeout: seconds to establish a connection.
    @param max_idle_connections: idle connections kept per replica.
    @param idle_connection_timeout: seconds an idle connection is kept;
        below uvicorn's default keep-alive of 5 s (vLLM, SGLang and
        C{llama_cpp.server} run on uvicorn), so that the router never
        picks a connection the engine is closing.
    """

    def __init__(
        self,
        reactor: IConnectingReactor,
        connect_timeout: float,
        max_idle_connections: int,
        idle_connection_timeout: float = 4.0,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = reactor
        self._connect_timeout = connect_timeout or 30.0
        self.max_idle_connections = max_idle_connections
        self.idle_connection_timeout = idle_connection_timeout
        self._targets: dict[bytes, _Target] = {}
        self._idle: dict[bytes, list[EngineConnection]] = {}
        self._sweep: IDelayedCall | None = None

    def post(
        self,
        base: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        fresh: bool = False,
    ) -> Deferred[IResponse]:
        """
        POST C{body} to C{path} of the replica at C{base}.

        @param base: the replica's base URL (C{http://host:port}, maybe with
            a path prefix), ASCII.
        @param headers: the request's headers but C{Host} and
            C{Content-Length}, which are added.
        @param fresh: send it on a new connection, not on a kept one (a
            retry after a kept one was found closed: the others kept for
            the replica may be closed too).
        @return: fires with the L{Response} once its head came;
            cancellable (the connection is closed).  Fails with
            L{llmgw.router.upstream.base.UpstreamConnectError} when no
            connection could be made (the request was not sent), with
            L{NoAnswer} when the connection closed before any byte of an
            answer, with L{BadAnswer} or L{AnswerBroken} otherwise.
        """
        return self._request(b"POST ", base, path, headers, body, fresh)

    def get(
        self, base: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> Deferred[IResponse]:
        """
        GET C{path} of the replica at C{base} (its C{/v1/models}: the
        adapters it holds, L{llmgw.router.routing.adapter_state}).

        @return: as L{post}'s.
        """
        return self._request(b"GET ", base, path, headers, b"", False)

    def _request(
        self,
        method: bytes,
        base: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        fresh: bool,
    ) -> Deferred[IResponse]:
        target = self._targets.get(base)
        if target is None:
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            target = self._targets[base] = _Target(
                base, self._reactor, self._connect_timeout
            )
        lines = [
            method,
            target.prefix,
            path,
            b" HTTP/1.1\r\n",
            target.host_line,
            b"\r\nContent-Length: %d\r\n" % len(body),
        ]
        for name, value in headers:
            lines += (name, b": ", _clean(value), b"\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        connection = None if fresh else self._take(base)
        if connection is not None:
            answer: Deferred[IResponse] = Deferred(lambda d: connection.abort())
            connection.send(head, body, answer, reused=True)
            return answer
        return self._connect_and_send(base, target, head, body)

    def _connect_and_send(
        self, base: bytes, target: _Target, head: bytes, body: bytes
    ) -> Deferred[IResponse]:
        connecting = target.endpoint.connect(EngineConnectionFactory(self, base))
        sent: list[EngineConnection] = []
        cancelled = False

        def cancel(d: Deferred[IResponse]) -> None:
            nonlocal cancelled
            if sent:
                sent[0].abort()
            else:
                # HostnameEndpoint fails a cancelled connect with what it
                # was doing (DNSLookupError while resolving, even an IP
                # address): that is not the replica's failure.  Deferred
                # fails the answer with CancelledError once this returns.
                cancelled = True
                connecting.cancel()

        answer: Deferred[IResponse] = Deferred(cancel)

        def connected(protocol: IProtocol) -> None:
            assert isinstance(protocol, EngineConnection)
            if answer.called:  # cancelled while the connection was made
                protocol.abort()
                return
            sent.append(protocol)
            protocol.send(head, body, answer, reused=False)

        def failed(reason: Failure) -> None:
            if not answer.called and not cancelled:
                answer.errback(reason)

        connecting.addCallbacks(connected, failed)
        return answer

    def _take(self, key: bytes) -> EngineConnection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_kept = self._clock.seconds() - self.idle_connection_timeout
        while idle:
            # The most recently used first: the others age out.
            connection = idle.pop()
            if connection.idle_since > oldest_kept:
                return connection
            connection.abort()
        return None

    def put(self, connection: EngineConnection) -> None:
        """
        Keep an idle connection for the next request to its replica.
        """
        if self.max_idle_connections <= 0:
            connection.abort()
            return
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle_connections:
            idle.pop(0).abort()
        connection.went_idle(self._clock.seconds())
        idle.append(connection)
        if self._sweep is None:
            self._sweep = self._clock.callLater(
                self.idle_connection_timeout / 2, self._close_stale
            )

    def forget(self, connection: EngineConnection) -> None:
        """
        A connection closed or went out of step: it is not handed out.
        """
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def _close_stale(self) -> None:
        self._sweep = None
        oldest_kept = self._clock.seconds() - self.idle_connection_timeout
        left = False
        for key, idle in list(self._idle.items()):
            stale = [c for c in idle if c.idle_since <= oldest_kept]
            for connection in stale:
                connection.abort()
            if idle:
                left = True
            else:
                del self._idle[key]
        if left:
            self._sweep = self._clock.callLater(
                self.idle_connection_timeout / 2, self._close_stale
            )

    def idle_connections(self) -> int:
        """
        @return: the connections kept idle now, all replicas together.
        """
        return sum(len(idle) for idle in self._idle.values())

    def closeCachedConnections(self) -> Deferred[None]:
        """
        Close every idle connection (on shutdown).

        @return: fires once they are closed.
        """
        if self._sweep is not None and self._sweep.active():
            self._sweep.cancel()
        self._sweep = None
        for idle in list(self._idle.values()):
            for connection in list(idle):
                connection.abort()
        self._idle.clear()
        return succeed(None)
