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
  - the caps on open connections and HTTP/2 are in
    L{llmgw.router.edge.connections}.

After an error answer the connection is closed in the way HTTP servers
call I{lingering close}: the write side is shut, what the client still
sends is read and dropped for up to L{LINGER} seconds, so that its kernel
does not reset the connection and discard the answer before it is read.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from twisted.internet.interfaces import IDelayedCall, ISSLTransport
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.server import Request

from llmgw.router.errors import APIError, reason_phrase
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


def edge_error(
    status: int, message: str, code: str, retry_after: int | None = None
) -> APIError:
    """
    @param status: the HTTP status, 4xx or 5xx.
    @param code: the error object's machine-readable C{code}.
    @param retry_after: seconds for C{Retry-After}, for a refusal the
        client may try again after; L{None} for its own mistakes.
    @return: an OpenAI error object: C{invalid_request_error} for 4xx,
        C{server_error} for 5xx.
    """
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, message, kind, code, retry_after=retry_after)


def error_response(error: APIError) -> bytes:
    """
    @return: a whole HTTP/1.1 response carrying C{error} (and its
        C{Retry-After}, if any), closing the connection.
    """
    body = error.body()
    reason = reason_phrase(error.status)
    retry = b""
    if error.retry_after is not None:
        retry = b"Retry-After: %d\r\n" % error.retry_after
    return (
        b"HTTP/1.1 %d %s\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n"
        b"%sConnection: close\r\n\r\n" % (error.status, reason, len(body), retry)
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
                super().lineReceived(line)  # type: ignore[no-untyped-call]
                self._tell_request_line(line)
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

    def _tell_request_line(self, line: bytes) -> None:
        """
        Tell the request just made its method and target, so that its body
        limit (L{llmgw.router.edge.site.LimitedRequest.headed}) is the
        route's before the body comes: twisted.web sets them on the
        request only once the body has been read.
        """
        parts = line.split()
        headed = getattr(self.requests[-1], "headed", None) if self.requests else None
        if headed is not None and len(parts) == 3:
            headed(parts[0], parts[1])

    def lineLengthExceeded(self, line: bytes) -> None:
        if self._awaiting_request_line:
            self._request_line_too_long()
        else:
            self._headers_too_large()

    def _request_line_too_long(self) -> None:
        limit = self._settings.max_request_line
        self._reject(
            edge_error(
                414,
                f"The request line is longer than {limit} bytes.",
                "uri_too_long",
            )
        )

    def _headers_too_large(self) -> None:
        self._reject(
            edge_error(
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
                edge_error(
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
            edge_error(
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
            edge_error(
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
                edge_error(
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
        transport.write(error_response(error))
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
