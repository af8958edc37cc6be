"""
OpenTelemetry traces of client requests (C{[tracing]}, off by default).

A traced request gets a server span named after its route, with the GenAI
semantic conventions' attributes (C{gen_ai.operation.name},
C{gen_ai.request.model}, C{gen_ai.response.model},
C{gen_ai.usage.input_tokens}, C{gen_ai.usage.output_tokens}, from
U{https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/}) and
its time to first token in seconds (C{gen_ai.server.time_to_first_token},
the convention's metric of that name), and child spans: C{llmgw.wait} for
each wait (the activation queue, the overload room), C{llmgw.attempt} for
each replica tried (its W3C C{traceparent}, and the client's C{tracestate}
with it, go to the engine, which vLLM continues with
C{--otlp-traces-endpoint}; a retry's has C{http.request.resend_count}) and
C{llmgw.relay} for a stream's relay.  No prompt, answer or key is ever an
attribute.

Errors follow the HTTP semantic conventions
(U{https://opentelemetry.io/docs/specs/semconv/http/http-spans/}, "Status",
and the example "HTTP server call: connection dropped before response body
was sent"): a span that failed has status ERROR and an C{error.type} of
L{ERROR_TYPES}: an HTTP status as a string (C{"503"}: the replica's answer
on an attempt, the client's on the server span, where only a 5xx is an
error), or a short word for a failure without one.  A client that left
before its answer ended is C{error.type} C{client_disconnected} on every
span it cut, with C{http.response.status_code} the status its answer's
head said (200 for a stream already started; none when no head went), not
nginx's 499 (which the request's record and metrics keep).

Spans go through the OpenTelemetry SDK's batch processor and its OTLP/HTTP
exporter, on the SDK's own thread, so the reactor never waits for a
collector (L{llmgw.router.telemetry.export}: its failures logged once and
counted, a stop that does not wait past a second).  With tracing off nothing
of the SDK is imported and every call of L{NO_TRACE} is a no-op returning
its argument: a request pays a few attribute lookups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from llmgw.reactors import IThreadedClockReactor
from llmgw.router.errors import APIError
from llmgw.router.settings_toml import TracingConfig
from llmgw.router.telemetry.export import (
    QUEUE_SIZE,
    AdmittingProcessor,
    ExportWatch,
    SdkRecords,
    dropped_spans,
    stop_within,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from llmgw.router.interfaces import RequestRecord

_T = TypeVar("_T")

OPERATIONS = {
    b"/v1/chat/completions": "chat",
    b"/v1/messages": "chat",
    b"/v1/completions": "text_completion",
    b"/v1/embeddings": "embeddings",
}
"""
The GenAI convention's C{gen_ai.operation.name} of each route.
"""

CLIENT_LEFT = "client_disconnected"
TIMEOUT = "timeout"
CONNECTION_REFUSED = "connection_refused"
CONNECT_ERROR = "connect_error"
CONNECTION_CLOSED = "connection_closed"
INVALID_RESPONSE = "invalid_response"
RESPONSE_TOO_LARGE = "response_too_large"
REPLICA_GONE = "replica_gone"
STREAM_INCOMPLETE = "stream_incomplete"
OTHER = "_OTHER"

ERROR_TYPES = {
    "4xx, 5xx": "the HTTP status: the replica's on an attempt (a 4xx is an"
    " error of the attempt, not of the server span), the client's on the"
    " server span (5xx only)",
    CLIENT_LEFT: "the client closed its connection before its answer ended",
    TIMEOUT: "a deadline passed (connect, first byte, idle, total)",
    CONNECTION_REFUSED: "the replica refused the connection",
    CONNECT_ERROR: "no connection could be made to the replica otherwise",
    CONNECTION_CLOSED: "the replica closed the connection before its answer ended",
    INVALID_RESPONSE: "the replica's answer was not valid HTTP",
    RESPONSE_TOO_LARGE: "the answer passed max_response_size or an event"
    " max_event_size",
    REPLICA_GONE: "the replica left the fleet (drained, stopped, lost)",
    STREAM_INCOMPLETE: "the replica's stream ended inside an event or before"
    " any choice finished",
    "<code>": "a wait refused or timed out: the error's code"
    " (activation_timeout, activation_queue_full, model_overloaded)",
    OTHER: "anything else (the convention's fallback)",
}
"""
Every C{error.type} llmgw's spans carry, and what it means (the
conventions ask an instrumentation to document its list).
"""

CLIENT_CLOSED = 499
"""
The status a request's record gives a client that left (nginx's).
"""

ErrorType = Callable[[BaseException | None], "str | None"]
"""
How a step or attempt ended: given what it raised (L{None}: it returned),
the C{error.type} it failed with, or L{None} when it did not fail.
"""


def error_type(
    error: BaseException | None,
    client_left: bool = False,
    timed_out: bool = False,
    failure: str | None = None,
) -> str | None:
    """
    The C{error.type} of a step or attempt, by what the request saw.

    @param error: what the step raised, or L{None} when it returned.
    @param client_left: the client's connection is gone.
    @param timed_out: one of the request's deadlines passed.
    @param failure: the type the exchange noted for a failure it handled
        (an error event written to a started stream, a retry).
    @return: one of L{ERROR_TYPES}, or L{None}: no failure.
    """
    if client_left:
        return CLIENT_LEFT
    if failure is not None:
        return failure
    if error is None:
        return None
    if timed_out:
        return TIMEOUT
    if isinstance(error, APIError):
        return error.code or str(error.status)
    return OTHER


def _default_error_type(error: BaseException | None) -> str | None:
    return error_type(error)


class NoTrace:
    """
    A request not traced: every method does nothing.
    """

    def step(
        self, name: str, work: Awaitable[_T], failed: ErrorType = _default_error_type
    ) -> Awaitable[_T]:
        """
        @return: C{work} itself.
        """
        return work

    def attempt(
        self,
        replica: str,
        work: Awaitable[_T],
        resend: int = 0,
        failed: ErrorType = _default_error_type,
    ) -> Awaitable[_T]:
        """
        @return: C{work} itself.
        """
        return work

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        @return: no header.
        """
        return []

    def end(self, record: RequestRecord, head_sent: bool = False) -> None:
        """
        Nothing to end.
        """


NO_TRACE = NoTrace()


class RequestTrace(NoTrace):
    """
    One traced request: its server span and the children of it.

    @param traceparent: the client's W3C C{traceparent}, if any.
    @param tracestate: the client's C{tracestate} header lines, kept with
        a valid C{traceparent} (and dropped with an invalid one, as W3C
        Trace Context says), passed on to the engine with the attempt's.
    """

    def __init__(
        self,
        tracer: Tracer,
        path: bytes,
        traceparent: bytes | None,
        tracestate: Sequence[bytes] = (),
    ):
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        # A client's own trace is continued (W3C Trace Context).
        parent = None
        if traceparent:
            carrier = {"traceparent": traceparent.decode("latin-1")}
            if tracestate:
                # Several lines are one list (RFC 9110's field lines).
                carrier["tracestate"] = ",".join(
                    line.decode("latin-1") for line in tracestate
                )
            parent = TraceContextTextMapPropagator().extract(carrier)
        self._tracer = tracer
        route = path.decode("latin-1")
        self.span: Span = tracer.start_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": route,
                "gen_ai.operation.name": OPERATIONS.get(path, "chat"),
            },
        )
        self._context = set_span_in_context(self.span)
        self._attempt: Span | None = None

    def _child(self, name: str, **attributes: Any) -> Span:
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = self._attempt if name == "llmgw.relay" else None
        context = set_span_in_context(parent) if parent else self._context
        kind = SpanKind.CLIENT if name == "llmgw.attempt" else SpanKind.INTERNAL
        return self._tracer.start_span(
            name, context=context, kind=kind, attributes=attributes
        )

    def step(
        self, name: str, work: Awaitable[_T], failed: ErrorType = _default_error_type
    ) -> Awaitable[_T]:
        """
        @param name: C{activation} or C{overload} (a C{llmgw.wait} span),
            or C{relay} (C{llmgw.relay}, under the attempt).
        @param failed: the C{error.type} it ended with, if any.
        @return: C{work}, within the span.
        """
        if name == "relay":
            return self._run(self._child("llmgw.relay"), work, failed)
        span = self._child("llmgw.wait", **{"llmgw.wait": name})
        return self._run(span, work, failed)

    def attempt(
        self,
        replica: str,
        work: Awaitable[_T],
        resend: int = 0,
        failed: ErrorType = _default_error_type,
    ) -> Awaitable[_T]:
        """
        @param replica: the replica's id.
        @param resend: how many attempts came before this one.
        @param failed: the C{error.type} it ended with, if any.
        @return: C{work}, within a C{llmgw.attempt} span whose context
            L{headers} gives the engine meanwhile.
        """
        attributes: dict[str, Any] = {"llmgw.replica": replica}
        if resend:
            attributes["http.request.resend_count"] = resend
        self._attempt = self._child("llmgw.attempt", **attributes)
        return self._run(self._attempt, work, failed)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        @return: the attempt's W3C C{traceparent}, and C{tracestate} when
            the client sent one, for the engine.
        """
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        carrier: dict[str, str] = {}
        span = self._attempt if self._attempt is not None else self.span
        TraceContextTextMapPropagator().inject(
            carrier, context=set_span_in_context(span)
        )
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    def end(self, record: RequestRecord, head_sent: bool = False) -> None:
        """
        End the server span with what the request's record says: status,
        the model asked and answered, the replica, the engine's usage and
        the time to first token (seconds).

        @param head_sent: whether the client got the answer's head (a
            stream's 200), whatever the record's status became after.
        """
        span = self.span
        status = record.status
        left = status == CLIENT_CLOSED
        if head_sent:
            span.set_attribute("http.response.status_code", 200)
        elif not left:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("gen_ai.request.model", record.model)
        if status < 400:
            span.set_attribute("gen_ai.response.model", record.model)
        span.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
        if record.time_to_first_token is not None:
            ttft = record.time_to_first_token
            span.set_attribute("gen_ai.server.time_to_first_token", ttft)
        if record.replica is not None:
            span.set_attribute("llmgw.replica", record.replica)
        if left:
            _failed(span, CLIENT_LEFT)
        elif status >= 500:
            _failed(span, str(status))
        span.end()

    async def _run(self, span: Span, work: Awaitable[_T], failed: ErrorType) -> _T:
        # The span ends however the work ends, with its error.type.
        try:
            result = await work
        except BaseException as e:
            _failed(span, failed(e) or OTHER)
            raise
        else:
            kind = failed(None)
            if kind is not None:
                _failed(span, kind)
            return result
        finally:
            span.end()
            if span is self._attempt:
                self._attempt = None


def _failed(span: Span, kind: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR))


class Tracing:
    """
    A router's tracer: a L{RequestTrace} for each request, sampled.
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def request(self, path: bytes, headers: Headers) -> RequestTrace:
        """
        @param path: the route (C{/v1/chat/completions}).
        @param headers: the client's request headers, for its W3C
            C{traceparent} and C{tracestate}.
        """
        parents = headers.getRawHeaders(b"traceparent")
        return RequestTrace(
            self.tracer,
            path,
            parents[-1] if parents else None,
            headers.getRawHeaders(b"tracestate", []),
        )


class TracingService(Service):
    """
    The SDK's provider exporting to C{config.otlp_endpoint}, watched
    (L{llmgw.router.telemetry.export}): started with a line saying where
    spans go; shut down (its last spans exported, within a second) when the
    daemon stops.

    @param reactor: brings the exporter's log lines to the reactor's thread
        and bounds the stop.
    @param service: the C{service.name} resource attribute (C{llmgw-server}).
    @param registry: where the dropped spans are counted.
    @ivar tracing: what the router and the control plane trace with.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IThreadedClockReactor,
        config: TracingConfig,
        service: str,
        registry: CollectorRegistry,
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self._reactor = reactor
        self.destination = config.otlp_endpoint + "/v1/traces"
        self.sample_ratio = config.sample_ratio
        # The stop is this service's (bounded); the SDK's own at exit would
        # wait for a dead collector again.
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            shutdown_on_exit=False,
        )
        self.watch = ExportWatch(
            OTLPSpanExporter(endpoint=self.destination),
            self.destination,
            dropped_spans(registry),
            reactor.callFromThread,
        )
        batch = BatchSpanProcessor(self.watch, max_queue_size=QUEUE_SIZE)  # type: ignore[arg-type]
        self.provider.add_span_processor(AdmittingProcessor(batch, self.watch))  # type: ignore[arg-type]
        self._records = SdkRecords(self.watch)
        self.tracing = Tracing(self.provider.get_tracer("llmgw"))

    def startService(self) -> None:
        Service.startService(self)
        self._records.attach()
        self.log.info(
            "tracing: spans go to {destination} over OTLP/HTTP; {percent:g}%"
            " of requests sampled (a client's traceparent decides for its own)",
            destination=self.destination,
            percent=self.sample_ratio * 100,
        )

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        stopped = stop_within(self._reactor, self.provider.shutdown, self.watch)

        def detach(result: None) -> None:
            # Given up on, the SDK's thread may still log its last failure:
            # it stays out of the log.
            if not self.watch.abandoned:
                self._records.detach()

        return stopped.addCallback(detach)


def tracing_service(
    reactor: IThreadedClockReactor,
    config: TracingConfig,
    service: str,
    registry: CollectorRegistry,
) -> TracingService | None:
    """
    @param service: the C{service.name} of the spans (C{llmgw-server}).
    @param registry: where the dropped spans are counted.
    @return: the service exporting spans, or L{None} when tracing is off
        (nothing of the SDK imported, no thread started).
    """
    if not config.otlp_endpoint:
        return None
    return TracingService(reactor, config, service, registry)
