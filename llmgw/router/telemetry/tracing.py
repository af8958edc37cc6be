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
each replica tried (its W3C C{traceparent} goes to the engine, which vLLM
continues with C{--otlp-traces-endpoint}) and C{llmgw.relay} for a
stream's relay.  No prompt, answer or key is ever an attribute.

Spans go through the OpenTelemetry SDK's batch processor and its OTLP/HTTP
exporter, on the SDK's own thread, so the reactor never waits for a
collector.  With tracing off nothing of the SDK is imported and every call
of L{NO_TRACE} is a no-op returning its argument: a request pays a few
attribute lookups.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from llmgw.router.settings_toml import TracingConfig

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


def provider(config: TracingConfig, service: str) -> TracerProvider | None:
    """
    The SDK's tracer provider exporting to C{config.otlp_endpoint}, or
    L{None} when tracing is off (nothing imported, no thread started).

    @param service: the C{service.name} resource attribute (C{llmgw-server}).
    """
    if not config.otlp_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    tracer_provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint + "/v1/traces")
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    return tracer_provider


class NoTrace:
    """
    A request not traced: every method does nothing.
    """

    def step(self, name: str, work: Awaitable[_T]) -> Awaitable[_T]:
        """
        @return: C{work} itself.
        """
        return work

    def attempt(self, replica: str, work: Awaitable[_T]) -> Awaitable[_T]:
        """
        @return: C{work} itself.
        """
        return work

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        @return: no header.
        """
        return []

    def end(self, record: RequestRecord) -> None:
        """
        Nothing to end.
        """


NO_TRACE = NoTrace()


class RequestTrace(NoTrace):
    """
    One traced request: its server span and the children of it.
    """

    def __init__(self, tracer: Tracer, path: bytes, traceparent: bytes | None):
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, set_span_in_context

        # A client's own trace is continued (W3C Trace Context).
        parent = (
            extract({"traceparent": traceparent.decode("latin-1")})
            if traceparent
            else None
        )
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

    def step(self, name: str, work: Awaitable[_T]) -> Awaitable[_T]:
        """
        @param name: C{activation} or C{overload} (a C{llmgw.wait} span),
            or C{relay} (C{llmgw.relay}, under the attempt).
        @return: C{work}, within the span.
        """
        if name == "relay":
            return self._run(self._child("llmgw.relay"), work)
        return self._run(self._child("llmgw.wait", **{"llmgw.wait": name}), work)

    def attempt(self, replica: str, work: Awaitable[_T]) -> Awaitable[_T]:
        """
        @param replica: the replica's id.
        @return: C{work}, within a C{llmgw.attempt} span whose context
            L{headers} gives the engine meanwhile.
        """
        self._attempt = self._child("llmgw.attempt", **{"llmgw.replica": replica})
        return self._run(self._attempt, work)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """
        @return: the attempt's W3C C{traceparent}, for the engine.
        """
        from opentelemetry.propagate import inject
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        span = self._attempt if self._attempt is not None else self.span
        inject(carrier, context=set_span_in_context(span))
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    def end(self, record: RequestRecord) -> None:
        """
        End the server span with what the request's record says: status,
        the model asked and answered, the replica, the engine's usage and
        the time to first token (seconds).
        """
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        span.set_attribute("http.response.status_code", record.status)
        span.set_attribute("gen_ai.request.model", record.model)
        if record.status < 400:
            span.set_attribute("gen_ai.response.model", record.model)
        span.set_attribute("gen_ai.usage.input_tokens", record.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", record.completion_tokens)
        if record.time_to_first_token is not None:
            ttft = record.time_to_first_token
            span.set_attribute("gen_ai.server.time_to_first_token", ttft)
        if record.replica is not None:
            span.set_attribute("llmgw.replica", record.replica)
        if record.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    async def _run(self, span: Span, work: Awaitable[_T]) -> _T:
        # The span ends however the work ends; an exception's type is noted.
        try:
            return await work
        except BaseException as e:
            span.set_attribute("error.type", type(e).__name__)
            raise
        finally:
            span.end()
            if span is self._attempt:
                self._attempt = None


class Tracing:
    """
    A router's tracer: a L{RequestTrace} for each request, sampled.
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def request(self, path: bytes, traceparent: bytes | None) -> RequestTrace:
        """
        @param path: the route (C{/v1/chat/completions}).
        @param traceparent: the client's W3C C{traceparent}, if any.
        """
        return RequestTrace(self.tracer, path, traceparent)


class TracingService(Service):
    """
    The SDK's provider, shut down (its last spans exported, its thread
    ended) when the daemon stops.

    @ivar tracing: what the router and the control plane trace with.
    """

    def __init__(self, tracer_provider: TracerProvider) -> None:
        self.provider = tracer_provider
        self.tracing = Tracing(tracer_provider.get_tracer("llmgw"))

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return deferToThread(self.provider.shutdown)


def tracing_service(config: TracingConfig, service: str) -> TracingService | None:
    """
    @param service: the C{service.name} of the spans (C{llmgw-server}).
    @return: the service exporting spans, or L{None} when tracing is off.
    """
    tracer_provider = provider(config, service)
    return TracingService(tracer_provider) if tracer_provider is not None else None
