"""
The router's connections as a whole: the caps on how many are open, and
Twisted's switch between HTTP/1.1 (L{llmgw.router.edge.channel.EdgeChannel}) and
HTTP/2 by ALPN.

At most C{max_connections} connections are open, at most
C{max_connections_per_client} from one client address: more are closed at
once (plain TCP gets a 503 error object first; under TLS the protocol is
not known yet), with one log line per 10 s while a cap holds, never one per
connection.

HTTP/2 (TLS with ALPN C{h2}) is Twisted's C{H2Connection}: the C{h2}
library advertises C{SETTINGS_MAX_CONCURRENT_STREAMS} 100 and ends the
connection of a client that opens more, and Twisted closes a connection
with GOAWAY C{ENHANCE_YOUR_CALM} once its peer resets streams faster than
a token bucket allows (1000 at once, then 33/s), the CVE-2023-44487
defence, new in Twisted 26.10 (26.4 has none): hence setup.cfg's floor,
and the check in L{llmgw.twisted_private}.  The
hostile-client suite (C{tests.test_e2e_edge_h2}) checks both, and found two
faults mended here: the connection stayed open after its GOAWAY until the
idle timeout (L{EdgeProtocol.dataReceived}), and answers to streams reset
in the same read logged a traceback each (L{EdgeH2Connection}).
C{keepalive_timeout} is an HTTP/2 connection's idle timeout; a request
body must keep up C{min_body_rate} over each C{body_rate_window}, as over
HTTP/1.1, or its stream is reset (L{EdgeH2Connection}).
"""

from __future__ import annotations

from typing import Any

from h2.connection import ConnectionState
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IReactorTime,
    ISSLTransport,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import Request
from twisted.web.resource import IResource
from twisted.web.server import Site

from llmgw.router.edge.channel import LINGER, EdgeChannel, edge_error, error_response
from llmgw.router.settings import RouterConfig
from llmgw.twisted_private import GenericHTTPChannelProtocol, H2Connection

CAP_LOG_INTERVAL = 10.0
"""
Seconds between two log lines about refused connections.
"""


class EdgeProtocol(GenericHTTPChannelProtocol):
    """
    Twisted's switch between HTTP/1.1 and HTTP/2 (by ALPN), counting its
    connection against the caps of its L{EdgeSite}; the count lives here
    because the channel is replaced when HTTP/2 is negotiated.
    """

    _host: str | None = None
    _refused = False
    _goaway_abort: IDelayedCall | None = None

    def __init__(self, channel: EdgeChannel, edge: EdgeSite) -> None:
        super().__init__(channel)
        self._edge = edge

    def makeConnection(self, transport: Any) -> None:
        host = client_host(transport.getPeer())
        if not self._edge.admit(host):
            self._refused = True
            if ISSLTransport.providedBy(transport):
                transport.abortConnection()
            else:
                error = edge_error(
                    503,
                    "Too many connections; try again later.",
                    "too_many_connections",
                    # Connections close within seconds: try again soon.
                    retry_after=1,
                )
                transport.write(error_response(error))
                transport.loseConnection()
            return
        self._host = host
        super().makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        if self._refused or self._goaway_abort is not None:
            # Refused, or HTTP/2 after GOAWAY: h2 answers every later read
            # with one more GOAWAY, for a client that is on its way out.
            return
        if self._negotiatedProtocol is None and (
            getattr(self._channel.transport, "negotiatedProtocol", None) == b"h2"
        ):
            self._switch_to_h2()
        super().dataReceived(data)  # type: ignore[no-untyped-call]
        channel = self._channel
        if (
            self._goaway_abort is None
            and isinstance(channel, H2Connection)
            and channel.conn.state_machine.state is ConnectionState.CLOSED
        ):
            # Twisted sent GOAWAY (a protocol error, a rapid-reset flood)
            # and asked TLS to close, but TLS waits for H2Connection to
            # unregister as its producer, which it does not: the client
            # kept the connection until the idle timeout.  It gets LINGER
            # seconds to read the GOAWAY.
            self._goaway_abort = self._edge.reactor.callLater(
                LINGER, self._abort_after_goaway
            )

    def _switch_to_h2(self) -> None:
        # Twisted's own switch (_GenericHTTPChannelProtocol.dataReceived,
        # Twisted 26.4 and 26.10), with EdgeH2Connection in place of
        # H2Connection; the private names it uses are listed, and checked
        # against Twisted, in llmgw.twisted_private.
        me: Any = self  # Twisted's private attributes, untyped
        old = me._channel
        producer = old._networkProducer
        producer.unregisterProducer()
        old.setTimeout(None)
        transport = old.transport
        channel: Any = EdgeH2Connection(self._edge.reactor, self._edge.settings)
        channel.requestFactory = me._requestFactory
        channel.site = me._site
        channel.factory = me._factory
        channel.timeOut = me._timeOut
        channel.callLater = me._callLater
        me._channel = channel
        channel.makeConnection(transport)
        producer.registerProducer(channel, True)
        me._negotiatedProtocol = b"h2"

    def _abort_after_goaway(self) -> None:
        # _goaway_abort stays set: what arrives before connectionLost is
        # still dropped.
        transport: Any = self._channel.transport
        if transport is not None:
            transport.abortConnection()

    def connectionLost(self, reason: Failure) -> None:
        if self._goaway_abort is not None and self._goaway_abort.active():
            self._goaway_abort.cancel()
        self._goaway_abort = None
        if self._refused:
            return
        if self._host is not None:
            self._edge.release(self._host)
            self._host = None
        super().connectionLost(reason)


class EdgeH2Connection(H2Connection):
    """
    Twisted's HTTP/2 connection, quiet about answers to streams that are
    gone.  When a client sends a request and its RST_STREAM in one read (a
    rapid-reset flood does), h2 closes the stream before Twisted hands the
    request to the router; an answer written at once then raised from h2
    (StreamClosedError, StreamIDTooLowError, or a ProtocolError once the
    connection is closed) and Twisted logged a traceback per stream.  The
    answer has no reader: it is dropped, as Twisted drops writes to a lost
    HTTP/1.1 connection; Twisted cleans the stream up when it handles the
    reset.
    """

    def __init__(
        self, reactor: IReactorTime, settings: RouterConfig | None = None
    ) -> None:
        super().__init__(reactor)  # type: ignore[no-untyped-call]
        self._settings = settings
        # Streams whose body is arriving: bytes in this window, its timer.
        self._bodies: dict[int, tuple[int, IDelayedCall]] = {}

    # A request body's minimum rate, as EdgeChannel keeps it for HTTP/1.1:
    # without it, one byte per stream every few seconds held a stream (and
    # the connection, whose idle timeout each byte pushed back) for ever.

    def _requestReceived(self, event: Any) -> None:
        super()._requestReceived(event)  # type: ignore[no-untyped-call]
        settings = self._settings
        if (
            settings is not None
            and settings.min_body_rate > 0
            and getattr(event, "stream_ended", None) is None
        ):
            self._body_window(event.stream_id, 0)

    def _body_window(self, stream_id: int, received: int) -> None:
        assert self._settings is not None
        timer = self._reactor.callLater(
            self._settings.body_rate_window, self._body_window_ended, stream_id
        )
        self._bodies[stream_id] = (received, timer)

    def _requestDataReceived(self, event: Any) -> None:
        body = self._bodies.get(event.stream_id)
        if body is not None:
            self._bodies[event.stream_id] = (body[0] + len(event.data), body[1])
        super()._requestDataReceived(event)  # type: ignore[no-untyped-call]

    def _requestEnded(self, event: Any) -> None:
        self._body_done(event.stream_id)
        super()._requestEnded(event)  # type: ignore[no-untyped-call]

    def _requestAborted(self, event: Any) -> None:
        self._body_done(event.stream_id)
        super()._requestAborted(event)  # type: ignore[no-untyped-call]

    def connectionLost(  # type: ignore[override]
        self, reason: Any, _cancelTimeouts: bool = True
    ) -> None:
        for stream_id in list(self._bodies):
            self._body_done(stream_id)
        super().connectionLost(reason, _cancelTimeouts)  # type: ignore[no-untyped-call]

    def _body_done(self, stream_id: int) -> None:
        body = self._bodies.pop(stream_id, None)
        if body is not None and body[1].active():
            body[1].cancel()

    def _body_window_ended(self, stream_id: int) -> None:
        assert self._settings is not None
        received, _ = self._bodies.pop(stream_id, (None, None))
        if received is None:
            return
        rate, window = self._settings.min_body_rate, self._settings.body_rate_window
        if received >= rate * window:
            self._body_window(stream_id, 0)
            return
        # Too slow: the stream is reset (RST_STREAM), its request never
        # reaches the router; the connection's other streams go on.
        if stream_id in self.streams and not self._gone(stream_id):
            self.abortRequest(stream_id)  # type: ignore[no-untyped-call]

    def _gone(self, stream_id: int) -> bool:
        if self.conn.state_machine.state is ConnectionState.CLOSED:
            return True
        stream = self.conn.streams.get(stream_id)
        return stream is None or bool(stream.closed)

    def writeHeaders(
        self, version: bytes, code: bytes, reason: bytes, headers: Any, streamID: int
    ) -> None:
        if not self._gone(streamID):
            super().writeHeaders(version, code, reason, headers, streamID)  # type: ignore[no-untyped-call]

    def writeDataToStream(self, streamID: int, data: bytes) -> None:
        if not self._gone(streamID):
            super().writeDataToStream(streamID, data)  # type: ignore[no-untyped-call]

    def endRequest(self, streamID: int) -> None:
        if not self._gone(streamID):
            super().endRequest(streamID)  # type: ignore[no-untyped-call]


def client_host(address: IAddress) -> str:
    """
    @return: the address the per-client cap counts: the IP address of a
        TCP peer, C{"local"} for any other (a UNIX socket).
    """
    host = getattr(address, "host", None)
    return host if isinstance(host, str) else "local"


def _edge_protocol(factory: EdgeSite) -> EdgeProtocol:
    return EdgeProtocol(EdgeChannel(factory.settings), factory)


class EdgeSite(Site):
    """
    A L{Site} whose connections are L{EdgeChannel}s, capped in number.

    @ivar open_connections: connections open now.
    @ivar refused_connections: connections refused by a cap since start.
    """

    # Not "log": Site.log is its access log.
    logger = Logger()
    protocol = _edge_protocol

    def log(self, request: Request) -> None:
        """
        No access log: the router logs each request itself.
        """

    def __init__(
        self,
        resource: IResource,
        settings: RouterConfig,
        reactor: IReactorTime,
        **kwargs: Any,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            resource,
            reactor=reactor,
            timeout=settings.keepalive_timeout or None,
            **kwargs,
        )
        self.settings = settings
        self.open_connections = 0
        self.refused_connections = 0
        self._per_client: dict[str, int] = {}
        self._unlogged = 0
        self._logged_at: float | None = None

    def admit(self, host: str) -> bool:
        """
        Count a new connection from C{host}, unless a cap is reached.

        @return: whether it may stay open.
        """
        total = self.settings.max_connections
        per_client = self.settings.max_connections_per_client
        if total and self.open_connections >= total:
            self._refuse(self.open_connections, total, None)
            return False
        mine = self._per_client.get(host, 0)
        if per_client and mine >= per_client:
            self._refuse(mine, per_client, host)
            return False
        self.open_connections += 1
        self._per_client[host] = mine + 1
        return True

    def release(self, host: str) -> None:
        """
        Count a connection from C{host} as closed.
        """
        self.open_connections -= 1
        mine = self._per_client.get(host, 0) - 1
        if mine > 0:
            self._per_client[host] = mine
        else:
            self._per_client.pop(host, None)

    def _refuse(self, count: int, limit: int, host: str | None) -> None:
        """
        Count a refused connection; log at most one line per
        L{CAP_LOG_INTERVAL}, with how many were refused since the last.

        @param count: connections open (from C{host}, if given).
        @param limit: the cap reached.
        @param host: the client address for the per-client cap, or L{None}
            for the global one.
        """
        self.refused_connections += 1
        self._unlogged += 1
        now = self.reactor.seconds()
        if self._logged_at is not None and now - self._logged_at < CAP_LOG_INTERVAL:
            return
        if host is None:
            self.logger.warn(
                "connection cap reached: {count} connections open, the limit"
                " (router.max_connections {limit}); refused {refused}"
                " connection(s) since the last such line",
                count=count,
                limit=limit,
                refused=self._unlogged,
            )
        else:
            self.logger.warn(
                "per-client connection cap reached: {count} connections open"
                " from {host}, the limit (router.max_connections_per_client"
                " {limit}); refused {refused} connection(s) since the last"
                " such line",
                count=count,
                host=host,
                limit=limit,
                refused=self._unlogged,
            )
        self._logged_at = now
        self._unlogged = 0
