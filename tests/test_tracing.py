"""
The request spans' rules (W3C Trace Context's C{tracestate}, the HTTP
semantic conventions' span status and C{error.type}) on the SDK's
in-memory exporter, and the exporter's watch (one warning per outage, the
dropped spans counted, a stop bounded in time) on a fake exporter and a
L{Clock}.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers
from zope.interface import implementer

from llmgw.reactors import IThreadedClockReactor
from llmgw.router.api.failures import AnswerTooLarge, failure_type
from llmgw.router.errors import APIError, activation_timeout, upstream_failed
from llmgw.router.interfaces import RequestRecord
from llmgw.router.telemetry.export import (
    SDK_LOGGER,
    ExportWatch,
    SdkRecords,
    dropped_spans,
    stop_within,
)
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


class FakeExporter:
    """
    The SDK's exporter as the watch sees it: answers from C{results}, and
    logs C{message} through the SDK's logger when it fails.
    """

    def __init__(self, results: list[SpanExportResult], message: str = "") -> None:
        self.results = results
        self.message = message
        self.shut = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.results.pop(0)
        if result is SpanExportResult.FAILURE and self.message:
            logging.getLogger(SDK_LOGGER + ".otlp.proto.http.trace_exporter").warning(
                "Transient error %s encountered while exporting span batch",
                self.message,
            )
        return result

    def shutdown(self) -> None:
        self.shut += 1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def value(registry: CollectorRegistry, reason: str) -> float:
    """
    @return: C{llmgw_trace_spans_dropped_total{reason}}.
    """
    got = registry.get_sample_value(
        "llmgw_trace_spans_dropped_total", {"reason": reason}
    )
    assert got is not None
    return got


def watched(
    results: list[SpanExportResult], message: str = "", queue_size: int = 10
) -> tuple[ExportWatch, FakeExporter, CollectorRegistry]:
    """
    @return: a watch over a fake exporter answering C{results}, whose
        reports run at once, the fake, and the registry it counts in.
    """
    registry = CollectorRegistry()
    inner = FakeExporter(results, message)
    watch = ExportWatch(
        inner,  # type: ignore[arg-type]
        "http://collector:4318/v1/traces",
        dropped_spans(registry),
        lambda f: f(),
        queue_size,
    )
    return watch, inner, registry


SPANS: list[ReadableSpan] = [ReadableSpan("a"), ReadableSpan("b")]
FAIL, OK = SpanExportResult.FAILURE, SpanExportResult.SUCCESS


class ExportWatchTests(SynchronousTestCase):
    """
    The exporter watched: an outage is one warning and one line when it
    ends, its spans counted, the SDK's own records kept from the log.
    """

    def test_one_warning_per_outage(self) -> None:
        """
        Three failed exports give one warning naming the collector and the
        SDK's reason, and count their spans; the next success gives one
        line with what was lost; a second outage warns again.
        """
        watch, _, registry = watched(
            [FAIL, FAIL, FAIL, OK, OK, FAIL], "Connection refused"
        )
        records = SdkRecords(watch)
        records.attach()
        self.addCleanup(records.detach)
        with capturedLogs() as events:
            for _ in range(5):
                watch.export(SPANS)
        warnings = [e for e in events if e["log_level"] == LogLevel.warn]
        infos = [e for e in events if e["log_level"] == LogLevel.info]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["destination"], "http://collector:4318/v1/traces")
        self.assertIn("Connection refused", warnings[0]["reason"])
        self.assertEqual(len(infos), 1)
        self.assertEqual(infos[0]["lost"], 6)
        self.assertEqual(value(registry, "export_failed"), 6)
        with capturedLogs() as events:
            watch.export(SPANS)
        self.assertEqual([e["log_level"] for e in events], [LogLevel.warn])

    def test_sdk_records_kept_from_the_log(self) -> None:
        """
        While attached, the SDK exporters' records reach no handler of
        Python's C{logging} above them (twistd would print each as a
        C{stderr#error} line); detached, they do again.
        """
        watch, _, _ = watched([FAIL, FAIL], "boom")
        seen: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record)

        keep = Keep()
        logging.getLogger("opentelemetry").addHandler(keep)
        self.addCleanup(logging.getLogger("opentelemetry").removeHandler, keep)
        records = SdkRecords(watch)
        records.attach()
        with capturedLogs():
            watch.export(SPANS)
        self.assertEqual(seen, [])
        records.detach()
        with capturedLogs():
            watch.export(SPANS)
        self.assertEqual(len(seen), 1)

    def test_queue_full_counted(self) -> None:
        """
        Past the queue's size a span is refused and counted; once a batch
        went to the exporter there is room again.
        """
        watch, _, registry = watched([OK], queue_size=2)
        self.assertEqual([watch.admit() for _ in range(3)], [True, True, False])
        self.assertEqual(value(registry, "queue_full"), 1)
        watch.export(SPANS)
        self.assertTrue(watch.admit())

    def test_abandon(self) -> None:
        """
        Given up, the watch counts what still waits (once, when the SDK
        hands it over after), shuts the SDK's exporter down once, and drops
        and counts a span that ends after, without a warning.
        """
        watch, inner, registry = watched([])
        watch.admit()
        watch.admit()
        watch.admit()
        with capturedLogs() as events:
            self.assertEqual(watch.abandon(), 3)
            self.assertIs(watch.export(SPANS), FAIL)
            watch.shutdown()
        self.assertEqual(events, [])
        self.assertEqual(inner.shut, 1)
        self.assertEqual(value(registry, "stopped"), 3)
        self.assertFalse(watch.admit())
        self.assertEqual(value(registry, "stopped"), 4)


@implementer(IThreadedClockReactor)
class ThreadedClock(Clock):
    """
    A L{Clock} whose calls from threads wait in a list until L{run}.
    """

    def __init__(self) -> None:
        super().__init__()
        self.from_threads: list[Any] = []
        self.lock = threading.Lock()

    def callFromThread(
        self, callable: Callable[..., Any], *args: object, **kwargs: object
    ) -> None:
        with self.lock:
            self.from_threads.append(lambda: callable(*args, **kwargs))

    def run(self) -> None:
        with self.lock:
            calls, self.from_threads = self.from_threads, []
        for call in calls:
            call()


class StopTests(SynchronousTestCase):
    """
    A stop waits for the SDK's shutdown at most its budget.
    """

    def test_shutdown_in_time(self) -> None:
        """
        A shutdown that returns within the budget fires the stop, with no
        timer left.
        """
        clock = ThreadedClock()
        watch, _, _ = watched([])
        returned = threading.Event()
        d = stop_within(clock, returned.set, watch, budget=1.0)
        self.assertTrue(returned.wait(10))
        for _ in range(100):
            clock.run()
            if d.called:
                break
            returned.wait(0.01)
        self.successResultOf(d)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_shutdown_hung(self) -> None:
        """
        A shutdown still blocked after the budget (a collector that never
        answers) is given up on: the stop fires, what waited is counted
        and logged in one line, and the SDK's exporter is shut down (its
        retries end).
        """
        clock = ThreadedClock()
        watch, inner, registry = watched([])
        watch.admit()
        release = threading.Event()
        self.addCleanup(release.set)

        def hang() -> None:
            release.wait(10)

        d = stop_within(clock, hang, watch, budget=1.0)
        clock.advance(0.9)
        self.assertNoResult(d)
        with capturedLogs() as events:
            clock.advance(0.1)
        self.successResultOf(d)
        self.assertEqual([e["left"] for e in events], [1])
        self.assertEqual(value(registry, "stopped"), 1)
        self.assertEqual(inner.shut, 1)
