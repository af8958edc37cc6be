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

from typing import Any

from twisted.internet import error
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IConsumer,
    IProtocol,
    IProtocolFactory,
    IStreamClientEndpoint,
)
from twisted.python.failure import Failure
from twisted.web.client import (
    URI,
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
)
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer
from zope.interface import implementer

from llmgw.httpclient import QuietConnectionPool


class UpstreamConnectError(Exception):
    """
    No connection could be made to a replica: the request was not sent.

    @ivar timed_out: true when the connect deadline passed, false when the
        connection was refused or failed otherwise.
    """

    def __init__(self, reason: str, timed_out: bool) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


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


@implementer(IAgentEndpointFactory)
class _EndpointFactory:
    def __init__(self, reactor: Any, connect_timeout: float) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout or 30.0
        self._tls = BrowserLikePolicyForHTTPS()

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        endpoint: IStreamClientEndpoint = HostnameEndpoint(
            self._reactor, uri.host, uri.port, timeout=self._timeout
        )
        if uri.scheme == b"https":
            endpoint = wrapClientTLS(
                self._tls.creatorForNetloc(uri.host, uri.port), endpoint
            )
        return _ClassifyingEndpoint(endpoint)


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
) -> tuple[IAgent, HTTPConnectionPool]:
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
