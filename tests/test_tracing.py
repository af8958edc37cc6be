"""
The request spans' rules (W3C Trace Context's C{tracestate}, the HTTP
semantic conventions' span status and C{error.type}) on the SDK's
in-memory exporter.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from llmgw.router.api.failures import AnswerTooLarge, failure_type
from llmgw.router.errors import APIError, activation_timeout, upstream_failed
from llmgw.router.interfaces import RequestRecord
from llmgw.router.telemetry.tracing import (
    CLIENT_LEFT,
    OTHER,
    Tracing,
    error_type,
)
from llmgw.router.upstream.base import BadAnswer, NoAnswer, UpstreamConnectError
from llmgw.router.upstream.relay import StreamCut
from llmgw.router.upstream.sse import EventTooLarge

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def traced() -> tuple[Tracing, InMemorySpanExporter]:
    """
    @return: a router's tracing whose spans end in memory, and that memory.
    """
    memory = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return Tracing(provider.get_tracer("test")), memory


def record(status: int) -> RequestRecord:
    """
    @return: a request's record with C{status}.
    """
    return RequestRecord("r", "u", "m", "sim", status, True, 3, 2, 0.5, 0.1)


def named(memory: InMemorySpanExporter, name: str) -> ReadableSpan:
    """
    @return: the one finished span called C{name}.
    """
    [span] = [s for s in memory.get_finished_spans() if s.name == name]
    return span


async def fails(error: BaseException) -> None:
    raise error


class TraceContextTests(SynchronousTestCase):
    """
    W3C Trace Context: the client's C{tracestate} goes on with a valid
    C{traceparent}, and not with an invalid one.
    """

    def test_tracestate_goes_to_the_engine(self) -> None:
        """
        An attempt's headers carry the client's C{tracestate} (its lines
        joined as one list) beside a C{traceparent} in the client's trace.
        """
        tracing, _ = traced()
        headers = Headers(
            {b"traceparent": [PARENT.encode()], b"tracestate": [b"a=1", b"b=2"]}
        )
        trace = tracing.request(b"/v1/chat/completions", headers)
        sent: dict[bytes, bytes] = {}
        self.successResultOf(
            Deferred.fromCoroutine(
                trace.attempt("r1", _collect(trace, sent))  # type: ignore[arg-type]
            )
        )
        self.assertEqual(sent[b"tracestate"], b"a=1,b=2")
        self.assertEqual(sent[b"traceparent"].split(b"-")[1], TRACE_ID.encode())

    def test_invalid_traceparent_drops_tracestate(self) -> None:
        """
        With a C{traceparent} that is not valid, the C{tracestate} is not
        passed on: a new trace starts.
        """
        tracing, _ = traced()
        headers = Headers({b"traceparent": [b"00-zz-yy-01"], b"tracestate": [b"a=1"]})
        trace = tracing.request(b"/v1/chat/completions", headers)
        sent = dict(trace.headers())
        self.assertNotIn(b"tracestate", sent)
        self.assertNotIn(TRACE_ID.encode(), sent[b"traceparent"])


async def _collect(trace: Any, into: dict[bytes, bytes]) -> None:
    into.update(trace.headers())


class StatusTests(SynchronousTestCase):
    """
    The HTTP semantic conventions: a failed span has status ERROR and an
    C{error.type} from llmgw's documented list, never a class name.
    """

    def test_failed_attempt(self) -> None:
        """
        An attempt that raised has status ERROR and the C{error.type} its
        caller judged; a retry has C{http.request.resend_count}.
        """
        tracing, memory = traced()
        trace = tracing.request(b"/v1/chat/completions", Headers())
        work = fails(upstream_failed("x"))
        d: Deferred[None] = Deferred.fromCoroutine(
            trace.attempt("r1", work, 1, lambda e: "503")  # type: ignore[arg-type]
        )
        self.failureResultOf(d, APIError)
        span = named(memory, "llmgw.attempt")
        self.assertEqual(span.status.status_code, StatusCode.ERROR)
        assert span.attributes is not None
        self.assertEqual(span.attributes["error.type"], "503")
        self.assertEqual(span.attributes["http.request.resend_count"], 1)

    def test_handled_failure(self) -> None:
        """
        A step that returned but failed (a stream cut, its error event
        written) is ERROR too; one that did not fail is UNSET.
        """
        tracing, memory = traced()
        trace = tracing.request(b"/v1/chat/completions", Headers())
        self.successResultOf(
            Deferred.fromCoroutine(
                trace.step("relay", _nothing(), lambda e: "stream_incomplete")  # type: ignore[arg-type]
            )
        )
        self.successResultOf(
            Deferred.fromCoroutine(
                trace.step("overload", _nothing())  # type: ignore[arg-type]
            )
        )
        relay, wait = named(memory, "llmgw.relay"), named(memory, "llmgw.wait")
        self.assertEqual(relay.status.status_code, StatusCode.ERROR)
        assert relay.attributes is not None and wait.attributes is not None
        self.assertEqual(relay.attributes["error.type"], "stream_incomplete")
        self.assertEqual(wait.status.status_code, StatusCode.UNSET)
        self.assertNotIn("error.type", wait.attributes)

    def test_no_class_name(self) -> None:
        """
        Without a judgement, an exception is C{_OTHER} (the convention's
        fallback), an API error its code: never C{CancelledError}.
        """
        tracing, memory = traced()
        trace = tracing.request(b"/v1/chat/completions", Headers())
        d: Deferred[None] = Deferred.fromCoroutine(
            trace.step("overload", fails(CancelledError()))  # type: ignore[arg-type]
        )
        self.failureResultOf(d, CancelledError)
        span = named(memory, "llmgw.wait")
        assert span.attributes is not None
        self.assertEqual(span.attributes["error.type"], OTHER)

    def test_server_error(self) -> None:
        """
        A server span answered 5xx is ERROR with the status as its
        C{error.type}; a 4xx is not an error of a server span.
        """
        for status, code, kind in [
            (502, StatusCode.ERROR, "502"),
            (404, StatusCode.UNSET, None),
            (200, StatusCode.UNSET, None),
        ]:
            tracing, memory = traced()
            tracing.request(b"/v1/chat/completions", Headers()).end(record(status))
            span = named(memory, "POST /v1/chat/completions")
            assert span.attributes is not None
            self.assertEqual(span.status.status_code, code, status)
            self.assertEqual(span.attributes.get("error.type"), kind, status)
            self.assertEqual(span.attributes["http.response.status_code"], status)

    def test_client_left(self) -> None:
        """
        A client that left (the record's 499) is C{error.type}
        C{client_disconnected} with status ERROR; the status code is the
        one its answer's head said (200 for a stream begun), none when no
        head went.
        """
        for head_sent, sent in [(True, 200), (False, None)]:
            tracing, memory = traced()
            trace = tracing.request(b"/v1/chat/completions", Headers())
            trace.end(record(499), head_sent)
            span = named(memory, "POST /v1/chat/completions")
            assert span.attributes is not None
            self.assertEqual(span.status.status_code, StatusCode.ERROR)
            self.assertEqual(span.attributes["error.type"], CLIENT_LEFT)
            self.assertEqual(span.attributes.get("http.response.status_code"), sent)


async def _nothing() -> None:
    await succeed(None)


class ErrorTypeTests(SynchronousTestCase):
    """
    Which C{error.type} each failure is.
    """

    def test_error_type(self) -> None:
        """
        A client that left wins; then a failure the exchange noted; then a
        deadline; then an API error's code; else C{_OTHER}; nothing when
        the step returned without a failure.
        """
        table: list[tuple[dict[str, Any], str | None]] = [
            ({"error": None}, None),
            ({"error": None, "failure": "stream_incomplete"}, "stream_incomplete"),
            ({"error": CancelledError(), "client_left": True}, CLIENT_LEFT),
            ({"error": CancelledError(), "timed_out": True}, "timeout"),
            ({"error": activation_timeout("m", 3.0, "cold", 5)}, "activation_timeout"),
            ({"error": APIError(503, "x", "y")}, "503"),
            ({"error": KeyError("x")}, OTHER),
        ]
        for kwargs, expected in table:
            self.assertEqual(error_type(**kwargs), expected, kwargs)

    def test_failure_type(self) -> None:
        """
        An attempt's failure by its kind: a deadline and a replica gone
        first, then the exception's.
        """
        table: list[tuple[BaseException, str | None, str | None, str]] = [
            (CancelledError(), "first_byte", None, "timeout"),
            (CancelledError(), None, "drained", "replica_gone"),
            (UpstreamConnectError("x", timed_out=True), None, None, "timeout"),
            (
                UpstreamConnectError("x", timed_out=False, refused=True),
                None,
                None,
                "connection_refused",
            ),
            (UpstreamConnectError("x", timed_out=False), None, None, "connect_error"),
            (AnswerTooLarge("x"), None, None, "response_too_large"),
            (EventTooLarge("x"), None, None, "response_too_large"),
            (StreamCut("x"), None, None, "stream_incomplete"),
            (BadAnswer("x"), None, None, "invalid_response"),
            (NoAnswer("x", reused=False), None, None, "connection_closed"),
        ]
        for error, expired, cut, expected in table:
            self.assertEqual(failure_type(error, expired, cut), expected, error)
