"""
What the router's exchanges need of an HTTP client to reach engine replicas:
the L{Upstream} interface, the headers of a request, the failures it tells
apart, and the reader of an answer's body.
L{llmgw.router.upstream.engine_client.EngineClient} is the client the servers use.

The failures tell "the request never left" (L{UpstreamConnectError}: safe to
send to another replica) from "the replica broke the exchange" (not safe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from twisted.internet import error
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import (
    IProtocol,
    IProtocolFactory,
    IPushProducer,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.iweb import IResponse
from zope.interface import implementer

from llmgw.reactors import IConnectingReactor
from llmgw.router.errors import APIError, error_message, upstream_failed


def upstream_headers(
    accept: bytes | None, request_id: bytes, api_key: str
) -> list[tuple[bytes, bytes]]:
    """
    The headers of a request to a replica, but C{Host} and
    C{Content-Length}: built anew, so that nothing of the client's (its
    C{Authorization} or C{api-key} above all) reaches an engine.

    @param accept: the client's C{Accept}, if any.
    @param request_id: the upstream request id, C{X-Request-ID}.
    @param api_key: the replica's own secret (L{Endpoint.api_key}), sent as
        C{Authorization: Bearer}; C{""} sends none.
    @return: (name, value) pairs, in order.
    """
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Accept", accept or b"*/*"),
        (b"X-Request-ID", request_id),
    ]
    if api_key:
        headers.append((b"Authorization", b"Bearer " + api_key.encode("utf-8")))
    return headers


class Upstream(Protocol):
    """
    Sends requests to replicas (L{llmgw.router.upstream.engine_client.EngineClient}).
    """

    def post(
        self,
        base: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        fresh: bool = False,
    ) -> Deferred[IResponse]:
        """
        POST C{body} to C{path} of the replica whose base URL is C{base}.

        @param fresh: send it on a new connection, not on a kept one.

        @return: fires with the response once its head came; cancellable.
            Fails with L{UpstreamConnectError} when no connection could be
            made (the request was not sent), with L{NoAnswer} when the
            connection closed before any answer byte, or with another
            exception when the exchange broke otherwise.
        """

    def get(
        self, base: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> Deferred[IResponse]:
        """
        GET C{path} of the replica whose base URL is C{base}.

        @return: as L{post}'s.
        """


class UpstreamConnectError(Exception):
    """
    No connection could be made to a replica: the request was not sent.

    @ivar timed_out: true when the connect deadline passed, false when the
        connection was refused or failed otherwise.
    @ivar refused: true when the replica's host refused it (nothing listens).
    """

    def __init__(self, reason: str, timed_out: bool, refused: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out
        self.refused = refused


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


class BadAnswer(Exception):
    """
    The replica's answer is not valid HTTP/1.1 (its head, its length or a
    chunk); the connection is closed.  C{str(error)} says why with the
    offending bytes, for the log.

    @ivar what: why, without the answer's bytes: what the client may read
        (L{refused_answer}).
    """

    def __init__(self, reason: str, what: str | None = None) -> None:
        super().__init__(reason)
        self.what = what or reason


def refused_answer(
    log: Logger, request_id: bytes, replica: str, address: str, error: Exception
) -> APIError:
    """
    The router refused a replica's answer (not valid HTTP/1.1, or over a
    size limit): log it for the operator, with the replica's address and
    the answer's offending bytes, and make the client's 502, which names
    the replica by its id only and what was wrong (L{APIError.message}
    never carries an upstream address; an engine's bytes may).

    @param request_id: the client request's id, ASCII.
    @param replica: the replica's id.
    @param address: its base URL, for the log only.
    @param error: a L{BadAnswer}, or the limit's error (its message one
        sentence of llmgw's, such as C{"it is over max_response_size,
        1048576 bytes"}).
    @return: the 502 to answer (or to end a stream with).
    """
    invalid = isinstance(error, BadAnswer)
    verdict = "not valid HTTP/1.1" if invalid else "refused"
    log.warn(
        "request {request_id}: replica {replica} ({address}): its answer is"
        " {verdict} ({reason}); connection closed",
        request_id=request_id.decode("ascii"),
        replica=replica,
        address=address,
        verdict=verdict,
        reason=str(error),
    )
    what = error.what if isinstance(error, BadAnswer) else str(error)
    return upstream_failed(f"Replica {replica}'s answer was {verdict}: {what}.")


@implementer(IStreamClientEndpoint)
class _ClassifyingEndpoint:
    def __init__(self, wrapped: IStreamClientEndpoint) -> None:
        self._wrapped = wrapped

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        def classify(failure: Failure) -> Failure:
            if failure.check(CancelledError, error.ConnectingCancelledError):
                return failure
            timed_out = failure.check(error.TimeoutError, TimeoutError) is not None
            refused = failure.check(error.ConnectionRefusedError) is not None
            raise UpstreamConnectError(
                failure.getErrorMessage(), timed_out=timed_out, refused=refused
            )

        return self._wrapped.connect(factory).addErrback(classify)


def endpoint_for(
    reactor: IConnectingReactor,
    scheme: bytes,
    host: bytes,
    port: int,
    connect_timeout: float,
) -> IStreamClientEndpoint:
    """
    @return: the endpoint connecting to a replica: TCP, or TLS over TCP
        for C{https} (certificates checked as a browser would); its
        failures to connect are L{UpstreamConnectError}s.
    @raise ValueError: for a scheme other than C{http} and C{https}.
    """
    if scheme not in (b"http", b"https"):
        raise ValueError(f"not an HTTP URL scheme: {scheme!r}")
    endpoint: IStreamClientEndpoint = HostnameEndpoint(
        reactor, host, port, timeout=connect_timeout
    )
    if scheme == b"https":
        endpoint = wrapClientTLS(
            BrowserLikePolicyForHTTPS().creatorForNetloc(host, port), endpoint
        )
    return _ClassifyingEndpoint(endpoint)


class BodyReader(TwistedProtocol):
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


def log_engine_failure(
    log: Logger, request_id: bytes, replica: str | None, status: int, body: bytes
) -> None:
    """
    Log a replica's failed answer (a 5xx) with the engine's message.

    @param request_id: the client request's id, ASCII.
    @param body: the answer's body, an error object or anything.
    """
    # An engine's 5xx message can hold its traceback, file paths and
    # addresses: the operator gets it in the log, the client only the
    # status.
    log.warn(
        "request {request_id}: replica {replica} answered status {status}: {message}",
        request_id=request_id.decode("ascii"),
        replica=replica,
        status=status,
        message=(error_message(body) or body[:500].decode("utf-8", "replace")),
    )
