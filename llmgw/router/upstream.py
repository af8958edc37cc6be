"""
The HTTP client the router uses to reach engine replicas.

An L{Agent} over a persistent pool, whose endpoints report connection failures
as L{UpstreamConnectError}, so the router can tell "the request never left"
(safe to send to another replica) from "the replica broke the exchange" (not
safe).

The Agent is used directly rather than through treq (as DESIGN.md first had
it): treq re-encodes every URL through hyperlink and wraps every request in a
cookie agent and a content-decoder agent, features the router does not use,
and together they cost a tenth of the router's CPU per request
(C{bench/router_bench.py}, py-spy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import error
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IConsumer,
    IProtocol,
    IProtocolFactory,
    IPushProducer,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from llmgw.httpclient import QuietConnectionPool


def upstream_headers(accept: bytes | None, request_id: bytes, api_key: str) -> Headers:
    """
    The headers of a request to a replica: built anew, so that nothing of
    the client's (its C{Authorization} or C{api-key} above all) reaches an
    engine.

    @param accept: the client's C{Accept}, if any.
    @param request_id: the upstream request id, C{X-Request-ID}.
    @param api_key: the replica's own secret (L{Endpoint.api_key}), sent as
        C{Authorization: Bearer}; C{""} sends none.
    """
    headers = Headers(
        {
            b"content-type": [b"application/json"],
            b"accept": [accept or b"*/*"],
            b"x-request-id": [request_id],
        }
    )
    if api_key:
        headers.setRawHeaders(b"authorization", [b"Bearer " + api_key.encode("utf-8")])
    return headers


class UpstreamConnectError(Exception):
    """
    No connection could be made to a replica: the request was not sent.

    @ivar timed_out: true when the connect deadline passed, false when the
        connection was refused or failed otherwise.
    """

    def __init__(self, reason: str, timed_out: bool) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


class NoAnswer(Exception):
    """
    The connection closed before any byte of an answer came (the request
    may have reached the engine).

    @ivar reused: whether the connection was an idle one taken from the
        pool, which the engine may have closed while it sat there, rather
        than a new one.
    """

    def __init__(self, reason: str, reused: bool) -> None:
        super().__init__(reason)
        self.reused = reused


@implementer(IStreamClientEndpoint)
class _ClassifyingEndpoint:
    def __init__(self, wrapped: IStreamClientEndpoint) -> None:
        self._wrapped = wrapped

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        def classify(failure: Failure) -> Failure:
            if failure.check(CancelledError, error.ConnectingCancelledError):
                return failure
            timed_out = failure.check(error.TimeoutError, TimeoutError) is not None
            raise UpstreamConnectError(failure.getErrorMessage(), timed_out=timed_out)

        return self._wrapped.connect(factory).addErrback(classify)


# Endpoints kept per (scheme, host, port): more replicas than this in a
# router's life start the cache again.
MAX_CACHED_ENDPOINTS = 4096


@implementer(IAgentEndpointFactory)
class _EndpointFactory:
    def __init__(self, reactor: Any, connect_timeout: float) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout or 30.0
        self._tls = BrowserLikePolicyForHTTPS()
        self._endpoints: dict[tuple[bytes, bytes, int], _ClassifyingEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        # The Agent asks on every request, pooled connection or not; an
        # endpoint holds no per-connection state, and building one (host
        # name checks, IDNA) was 5% of the router's time per request
        # (pyinstrument, bench/router_bench.py's load).
        key = (uri.scheme, uri.host, uri.port)
        cached = self._endpoints.get(key)
        if cached is not None:
            return cached
        endpoint: IStreamClientEndpoint = HostnameEndpoint(
            self._reactor, uri.host, uri.port, timeout=self._timeout
        )
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(
                self._tls.creatorForNetloc(uri.host, uri.port), endpoint
            )
        if len(self._endpoints) >= MAX_CACHED_ENDPOINTS:
            self._endpoints.clear()
        classifying = self._endpoints[key] = _ClassifyingEndpoint(endpoint)
        return classifying


@implementer(IBodyProducer)
class BytesProducer:
    """
    A request body already in memory, written in one call (Twisted's
    L{FileBodyProducer} writes from a cooperator task, one reactor turn
    later).
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.length = len(data)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._data)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def make_upstream_client(
    reactor: Any,
    connect_timeout: float,
    max_idle_connections: int,
    idle_connection_timeout: float = 4.0,
) -> tuple[IAgent, QuietConnectionPool]:
    """
    Build the HTTP client for engine traffic: no redirects, no cookies, no
    content decoding; bodies pass through as the engine sent them.

    @param reactor: the reactor (TCP, time and name resolution).
    @param connect_timeout: seconds to establish a TCP connection.
    @param max_idle_connections: idle keep-alive connections kept per
        replica; Twisted's default of 2 would make most requests under load
        pay for a new connection.
    @param idle_connection_timeout: seconds an idle connection is kept.
        Below uvicorn's default keep-alive of 5 s (vLLM, SGLang and
        C{llama_cpp.server} run on uvicorn), so the router does not pick a
        connection the engine is closing: a POST on such a connection fails
        and is not safely retried.
    @return: the agent and its pool (close the pool on shutdown).
    """
    pool = QuietConnectionPool(reactor, persistent=True)  # type: ignore[no-untyped-call]
    pool.maxPersistentPerHost = max_idle_connections
    pool.cachedConnectionTimeout = idle_connection_timeout  # type: ignore[assignment]
    pool.retryAutomatically = False
    agent = Agent.usingEndpointFactory(
        reactor, _EndpointFactory(reactor, connect_timeout), pool=pool
    )
    return agent, pool


class Upstream:
    """
    Sends requests to replicas: an L{IAgent} and, when it has one, its
    L{QuietConnectionPool}, whose reuse signal it turns into L{NoAnswer}'s
    C{reused}.

    @param agent: the HTTP client (see L{make_upstream_client}).
    @param pool: the agent's pool, or L{None} when reuse cannot be told
        (every connection counts as new).
    """

    def __init__(self, agent: IAgent, pool: QuietConnectionPool | None = None):
        self._agent = agent
        self._pool = pool

    def post(self, url: bytes, headers: Headers, body: bytes) -> Deferred[IResponse]:
        """
        POST C{body} to C{url}.

        @return: fires with the response once its headers came;
            cancellable.  Fails with L{UpstreamConnectError} when no
            connection could be made (the request was not sent), with
            L{NoAnswer} when the connection closed before any answer byte,
            or with another exception when the exchange broke otherwise.
        """
        d = self._agent.request(b"POST", url, headers, BytesProducer(body))
        # Agent.request takes its connection from the pool synchronously.
        reused = self._pool is not None and self._pool.last_reused

        def classify(failure: Failure) -> Failure:
            if failure.check(ResponseNeverReceived, RequestTransmissionFailed):
                raise NoAnswer(failure.getErrorMessage(), reused)
            return failure

        return d.addErrback(classify)


class BodyReader(Protocol):
    """
    Receives a replica's response body chunk by chunk.  C{done} fires when
    the body ends, fails when the exchange breaks or C{on_data} raises, and
    cancelling it closes the upstream connection, so the engine stops
    generating.

    @param on_data: called with each chunk; what it raises ends the
        exchange with that failure.
    """

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self._on_data = on_data
        self.done: Deferred[None] = Deferred(self._cancel)
        self.finished = False

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return
        try:
            self._on_data(data)
        except Exception:
            # The answer broke a limit (or a bug): end the exchange with it.
            failure = Failure()
            self.abort()
            self.done.errback(failure)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.finished:
            return
        self.finished = True
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)

    def abort(self) -> None:
        """
        Close the upstream connection now, unless the body already ended.
        """
        if not self.finished:
            self.finished = True
            if self.transport is not None:
                # The response's transport is a producer; stopping it closes
                # the connection, so the engine sees the client go.
                IPushProducer(self.transport).stopProducing()

    def _cancel(self, d: Deferred[None]) -> None:
        self.abort()
