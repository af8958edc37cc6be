"""
The connection edge: what a client may cost the router before its request
reaches the application.  Slow and greedy clients meet bounds here, each
answered in the client API's own format (an OpenAI error object) where an
answer can still be given:

  - the request line and headers must arrive within C{header_timeout} of
    the request's first byte (the deadline is not pushed back by each
    line; Twisted's own idle timeout is, so one header line every 5 s held
    a connection for ever): 408, then close;
  - the body must arrive at C{min_body_rate} bytes/s, checked over each
    C{body_rate_window}: 408, then close;
  - between requests a connection may stay idle C{keepalive_timeout}:
    closed without an answer (there is no request to answer);
  - a request line over C{max_request_line} bytes is a 414, headers over
    C{max_header_size} bytes (or over Twisted's 500 lines) a 431: Twisted
    dropped the connection with no answer at 16 KiB;
  - a request with both C{Content-Length} and C{Transfer-Encoding} (or
    either twice) is a 400 (RFC 9112 section 6.3; Twisted refused it with a
    bare 400 and no body), as is any request Twisted cannot parse;
  - at most C{max_connections} connections are open, at most
    C{max_connections_per_client} from one client address: more are closed
    at once (plain TCP gets a 503 first), with one log line per 10 s while
    the cap holds, never one per connection.

After an error answer the connection is closed in the way HTTP servers
call I{lingering close}: the write side is shut, what the client still
sends is read and dropped for up to L{LINGER} seconds, so that its kernel
does not reset the connection and discard the answer before it is read.

HTTP/2 (TLS with ALPN C{h2}) is handled by Twisted's C{H2Connection}: the
C{h2} library advertises C{SETTINGS_MAX_CONCURRENT_STREAMS} 100 and refuses
streams over it, and Twisted (since 23.10) closes a connection with GOAWAY
C{ENHANCE_YOUR_CALM} once its peer resets streams faster than a token
bucket allows (1000 at once, then 33/s), the CVE-2023-44487 defence; the
hostile-client suite checks both.  Over TLS that connection then stayed
open until the idle timeout (see L{EdgeProtocol.dataReceived}): the edge
aborts it L{LINGER} seconds after the GOAWAY.  C{keepalive_timeout} is its
idle timeout.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from h2.connection import ConnectionState
from twisted.internet.interfaces import IAddress, IDelayedCall, ISSLTransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web._http2 import H2Connection
from twisted.web.http import _GenericHTTPChannelProtocol
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from llmgw.router.errors import APIError
from llmgw.router.settings import RouterConfig

LINGER = 2.0
"""
Seconds a connection closed after an error answer keeps reading (and
dropping) what its client still sends, at most L{LINGER_BYTES} of it.
"""

LINGER_BYTES = 1024 * 1024
"""
Bytes a lingering connection reads and drops before it is aborted.
"""

CAP_LOG_INTERVAL = 10.0
"""
Seconds between two log lines about refused connections.
"""


def _error(status: int, message: str, code: str) -> APIError:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, message, kind, code)


def _response(error: APIError) -> bytes:
    """
    @return: a whole HTTP/1.1 response carrying C{error}, closing the
        connection.
    """
    body = error.body()
    reason = http.RESPONSES.get(error.status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % (error.status, reason, len(body))
    ) + body


class _Phase(Enum):
    """
    Where an HTTP/1.1 connection is, for the edge: which deadline runs.
    """

    IDLE = "idle"  # between requests: keepalive_timeout
    HEAD = "head"  # a request's line and headers: header_timeout
    BODY = "body"  # its body: min_body_rate
    BUSY = "busy"  # the application answers it: none of the edge's
    CLOSING = "closing"  # after an error answer: LINGER


class EdgeChannel(http.HTTPChannel):
    """
    An HTTP/1.1 channel that holds its client to the bounds of
    L{RouterConfig} (see the module's docstring), one L{_Phase} at a time:
    idle between requests, head from a request's first byte to the end of
    its headers, body while its body arrives, busy while the application
    answers it (no edge deadline: the router's own apply), and closing
    after an error answer.
    """

    def __init__(self, settings: RouterConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._settings = settings
        self._phase = _Phase.IDLE
        self._timer: IDelayedCall | None = None
        self._awaiting_request_line = True
        self._header_bytes = 0
        self._header_lines = 0
        self._window_bytes = 0
        self._lingered = 0
        self.MAX_LENGTH = max(settings.max_request_line, settings.max_header_size)
        # Ours fire first; Twisted's count the request line with the headers.
        self.totalHeadersSize = settings.max_request_line + settings.max_header_size + 4

    def _arm(self, seconds: float, call: Any) -> None:
        self._disarm()
        if seconds > 0:
            self._timer = self.callLater(seconds, call)  # type: ignore[no-untyped-call]

    def _disarm(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def connectionMade(self) -> None:
        # The edge's deadlines replace Twisted's idle timeout, which each
        # received byte pushed back.
        self.timeOut = None
        super().connectionMade()  # type: ignore[no-untyped-call]
        self._arm(self._settings.keepalive_timeout, self._idle_expired)

    def setTimeout(self, period: float | None) -> Any:
        # Twisted calls setTimeout(None) when the connection is lost and when
        # it hands the connection to HTTP/2: the edge's timers stop too.
        if period is None:
            self._disarm()
        return super().setTimeout(period)  # type: ignore[no-untyped-call]

    def dataReceived(self, data: bytes) -> None:
        if self._phase is _Phase.CLOSING:
            self._linger_read(data)
            return
        if self._phase is _Phase.IDLE:
            self._phase = _Phase.HEAD
            self._awaiting_request_line = True
            self._header_bytes = 0
            self._header_lines = 0
            self._arm(self._settings.header_timeout, self._head_expired)
        super().dataReceived(data)  # type: ignore[no-untyped-call]

    def lineReceived(self, line: bytes) -> None:
        if self._phase is _Phase.CLOSING:
            return
        if self._awaiting_request_line:
            if line:
                self._awaiting_request_line = False
                if len(line) > self._settings.max_request_line:
                    self._request_line_too_long()
                    return
        else:
            self._header_bytes += len(line) + 2
            if line:
                self._header_lines += 1
            if (
                self._header_bytes > self._settings.max_header_size
                or self._header_lines > self.maxHeaders
            ):
                self._headers_too_large()
                return
        super().lineReceived(line)  # type: ignore[no-untyped-call]

    def lineLengthExceeded(self, line: bytes) -> None:
        if self._awaiting_request_line:
            self._request_line_too_long()
        else:
            self._headers_too_large()

    def _request_line_too_long(self) -> None:
        limit = self._settings.max_request_line
        self._reject(
            _error(
                414,
                f"The request line is longer than {limit} bytes.",
                "uri_too_long",
            )
        )

    def _headers_too_large(self) -> None:
        self._reject(
            _error(
                431,
                f"The request headers are larger than"
                f" {self._settings.max_header_size} bytes or {self.maxHeaders}"
                f" lines.",
                "request_header_fields_too_large",
            )
        )

    def _maybeChooseTransferDecoder(self, header: bytes, data: bytes) -> bool:
        if (
            header in (b"Content-Length", b"Transfer-Encoding")
            and self._transferDecoder is not None
        ):
            # A front proxy may frame the body by the other header: the two
            # together are how requests are smuggled (RFC 9112 section 6.3).
            self._reject(
                _error(
                    400,
                    "A request may not carry both Content-Length and"
                    " Transfer-Encoding, nor either twice.",
                    "invalid_framing",
                )
            )
            self.length = None
            return False
        return super()._maybeChooseTransferDecoder(header, data)  # type: ignore[no-any-return,no-untyped-call]

    def _respondToBadRequestAndDisconnect(self) -> None:
        self._reject(
            _error(
                400,
                "The request is not valid HTTP/1.1: a malformed request line,"
                " header, length or chunk.",
                "invalid_http",
            )
        )

    def allHeadersReceived(self) -> None:
        super().allHeadersReceived()  # type: ignore[no-untyped-call]
        if self._phase is _Phase.HEAD and self.length != 0:
            self._phase = _Phase.BODY
            self._window_bytes = 0
            if self._settings.min_body_rate > 0:
                self._arm(self._settings.body_rate_window, self._body_window_ended)
            else:
                self._disarm()

    def rawDataReceived(self, data: bytes) -> None:
        if self._phase is _Phase.CLOSING:
            self._linger_read(data)
            return
        if self._phase is _Phase.BODY:
            self._window_bytes += len(data)
        super().rawDataReceived(data)

    def allContentReceived(self) -> None:
        self._phase = _Phase.BUSY
        self._disarm()
        super().allContentReceived()  # type: ignore[no-untyped-call]

    def requestDone(self, request: Request) -> None:
        if self.persistent and self._phase is _Phase.BUSY:
            # Set before Twisted replays pipelined bytes, which start the
            # next request's header deadline.
            self._phase = _Phase.IDLE
            self._arm(self._settings.keepalive_timeout, self._idle_expired)
        super().requestDone(request)  # type: ignore[no-untyped-call]

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self._disarm()
        super().connectionLost(reason)  # type: ignore[no-untyped-call]

    def _idle_expired(self) -> None:
        self._timer = None
        self.loseConnection()  # type: ignore[no-untyped-call]

    def _head_expired(self) -> None:
        self._timer = None
        seconds = self._settings.header_timeout
        self._reject(
            _error(
                408,
                f"The request line and headers did not arrive within {seconds:g}s.",
                "header_timeout",
            )
        )

    def _body_window_ended(self) -> None:
        self._timer = None
        rate = self._settings.min_body_rate
        window = self._settings.body_rate_window
        if self._window_bytes < rate * window:
            self._reject(
                _error(
                    408,
                    f"The request body arrived slower than {rate} bytes/s"
                    f" over {window:g}s.",
                    "body_timeout",
                )
            )
            return
        self._window_bytes = 0
        self._arm(window, self._body_window_ended)

    def _reject(self, error: APIError) -> None:
        """
        Answer C{error} and close the connection, lingering (see the
        module's docstring).  Whatever the client sends afterwards is
        dropped.
        """
        if self._phase is _Phase.CLOSING or self.transport is None:
            return
        self._phase = _Phase.CLOSING
        self.persistent = False
        self.clearLineBuffer()  # type: ignore[no-untyped-call]
        self.setRawMode()  # type: ignore[no-untyped-call]
        transport: Any = self.transport
        transport.write(_response(error))
        self._arm(LINGER, self._linger_ended)
        if ISSLTransport.providedBy(transport):
            # No half-close under TLS: close_notify, then the abort above.
            # Through the channel, which unregisters itself as the TLS
            # transport's producer (TLS closes only once none is left).
            self.loseConnection()  # type: ignore[no-untyped-call]
        else:
            transport.loseWriteConnection()

    def _linger_read(self, data: bytes) -> None:
        self._lingered += len(data)
        if self._lingered > LINGER_BYTES:
            self._linger_ended()

    def _linger_ended(self) -> None:
        self._disarm()
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()


class EdgeProtocol(_GenericHTTPChannelProtocol):
    """
    Twisted's switch between HTTP/1.1 and HTTP/2 (by ALPN), counting its
    connection against the caps of its L{EdgeSite}; the count lives here
    because the channel is replaced when HTTP/2 is negotiated.
    """

    _edge: EdgeSite
    _host: str | None = None
    _refused = False
    _goaway_abort: IDelayedCall | None = None

    def makeConnection(self, transport: Any) -> None:
        host = client_host(transport.getPeer())
        if not self._edge.admit(host):
            self._refused = True
            if ISSLTransport.providedBy(transport):
                transport.abortConnection()
            else:
                error = _error(
                    503,
                    "Too many connections; try again later.",
                    "too_many_connections",
                )
                transport.write(_response(error))
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
        # Twisted 26.10), with EdgeH2Connection in place of H2Connection.
        me: Any = self  # Twisted's private attributes, untyped
        old = me._channel
        producer = old._networkProducer
        producer.unregisterProducer()
        old.setTimeout(None)
        transport = old.transport
        channel: Any = EdgeH2Connection(self._edge.reactor)  # type: ignore[no-untyped-call]
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
        self._goaway_abort = None
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
    protocol = EdgeProtocol(EdgeChannel(factory.settings))
    protocol._edge = factory
    return protocol


class EdgeSite(Site):
    """
    A L{Site} whose connections are L{EdgeChannel}s, capped in number.

    @ivar open_connections: connections open now.
    @ivar refused_connections: connections refused by a cap since start.
    """

    # Not "log": Site.log is its access log.
    logger = Logger()
    protocol = _edge_protocol

    def __init__(
        self,
        resource: IResource,
        settings: RouterConfig,
        reactor: Any,
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
            self._refuse(f"{self.open_connections} open, the limit")
            return False
        mine = self._per_client.get(host, 0)
        if per_client and mine >= per_client:
            self._refuse(f"{mine} open from {host}, the per-client limit")
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

    def _refuse(self, which: str) -> None:
        self.refused_connections += 1
        self._unlogged += 1
        now = self.reactor.seconds()
        if self._logged_at is not None and now - self._logged_at < CAP_LOG_INTERVAL:
            return
        self.logger.warn(
            "connection cap reached ({which}): refused {refused} connection(s)"
            " since the last such line",
            which=which,
            refused=self._unlogged,
        )
        self._logged_at = now
        self._unlogged = 0
