"""
The spans' way out (C{[tracing]} on): the OpenTelemetry SDK's batch
processor and OTLP/HTTP exporter, with what an operator needs around them.

 - One line at start says where spans go.
 - A collector that stops taking spans (down, refusing, answering an error)
   is one warning when exports start failing and one line when they succeed
   again, not the SDK's own lines: its exporter logs each retry and each
   failed batch through Python's C{logging}, which twistd prints as one
   C{stderr#error} line each (seen: 6 a minute with the collector down).
   Those records are kept from the log while the service runs; the first of
   a failed export is the reason the warning gives.
 - Every span lost is counted in C{llmgw_trace_spans_dropped_total{reason}}:
   C{export_failed} (the collector did not take its batch), C{queue_full}
   (more spans waited than L{QUEUE_SIZE} while exports were slow or failing)
   and C{stopped} (still waiting when the stop gave up on them).
 - A stop waits for the last export at most L{STOP_BUDGET}: with the
   collector unreachable, the SDK's shutdown waited for its retries (its
   exporter's 10 s deadline, twice: the batch in flight, then the rest), and
   SIGTERM took 12 to 14 s in "connection pools closed".  Past the budget
   the exporter is shut down (which ends its retries) and what is left is
   counted dropped; the SDK's threads are daemon threads, so a request still
   blocked on a dead collector does not hold the process.

The SDK reads its standard environment variables (C{OTEL_BSP_SCHEDULE_DELAY},
C{OTEL_EXPORTER_OTLP_TRACES_TIMEOUT}, ...) as it does elsewhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.reactors import IThreadedClockReactor

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = Logger(namespace="llmgw.tracing")

STOP_BUDGET = 1.0
"""
Seconds a stop waits for the spans still to export: with C{[router]
drain_timeout} before it, a stop is never delayed past the drain plus this.
"""

QUEUE_SIZE = 2048
"""
Spans that may wait for export (the SDK's default queue); past it a new
span is dropped and counted.
"""

EXPORT_FAILED = "export_failed"
QUEUE_FULL = "queue_full"
STOPPED = "stopped"
DROP_REASONS = (EXPORT_FAILED, QUEUE_FULL, STOPPED)

SDK_LOGGER = "opentelemetry.exporter"
"""
The parent of the loggers the SDK's OTLP exporters log through.
"""

_REASON_LIMIT = 300


def dropped_spans(registry: CollectorRegistry) -> Counter:
    """
    @return: C{llmgw_trace_spans_dropped_total{reason}} in C{registry}, each
        reason of L{DROP_REASONS} at 0.
    """
    counter = Counter(
        "llmgw_trace_spans_dropped",
        "Spans never exported, by reason: export_failed (the collector did"
        " not take them), queue_full (more waited than the queue holds),"
        " stopped (still waiting when the stop gave up on them).",
        ["reason"],
        registry=registry,
    )
    for reason in DROP_REASONS:
        counter.labels(reason)
    return counter


class ExportWatch:
    """
    The SDK's exporter, watched: its outages logged once, the spans it lost
    counted, and a stop that gives up on it.

    It is the exporter the SDK's batch processor calls (L{export} on the
    SDK's thread; L{admit} on whatever thread ends a span); L{SdkRecords}
    gives it the SDK exporter's own log records (L{note}), the first of
    each export kept as its failure's reason.

    @param inner: the SDK's OTLP exporter.
    @param destination: where spans go, for the log lines (a URL).
    @param dropped: L{dropped_spans}.
    @param report: runs a callable on the reactor's thread (the log lines);
        C{reactor.callFromThread} in a daemon.
    @param queue_size: spans that may wait (admitted, not yet handed to
        L{export}).
    """

    def __init__(
        self,
        inner: SpanExporter,
        destination: str,
        dropped: Counter,
        report: Callable[[Callable[[], None]], None],
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        self._inner = inner
        self._destination = destination
        self._dropped = dropped
        self._report = report
        self._queue_size = queue_size
        self._lock = threading.Lock()
        self._pending = 0
        self._abandoned = False
        self._inner_shut = False
        self._failing = False
        self._lost_in_outage = 0
        self._reason: str | None = None

    # The SDK's SpanExporter interface; the class is one by duck typing,
    # so that importing this module imports nothing of the SDK.

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """
        Hand C{spans} to the SDK's exporter, unless the stop gave up.

        @return: the SDK's result (C{FAILURE} when the spans were dropped).
        """
        from opentelemetry.sdk.trace.export import SpanExportResult

        count = len(spans)
        with self._lock:
            self._pending = max(0, self._pending - count)
            abandoned = self._abandoned
        if abandoned:  # counted when the stop gave up, as still waiting
            return SpanExportResult.FAILURE
        self._reason = None
        try:
            result = self._inner.export(spans)
        except Exception as e:  # the SDK would log it per batch
            self._reason = self._reason or f"{type(e).__name__}: {e}"
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._succeeded()
        elif self._abandoned:
            self._drop(count, STOPPED)
        else:
            self._drop(count, EXPORT_FAILED)
            self._failed(count)
        return result

    def shutdown(self) -> None:
        """
        Shut the SDK's exporter down, once (it ends a retry's wait).
        """
        with self._lock:
            if self._inner_shut:
                return
            self._inner_shut = True
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """
        @return: the SDK's exporter's answer.
        """
        return self._inner.force_flush(timeout_millis)

    def admit(self) -> bool:
        """
        Count one more span waiting for export, unless L{QUEUE_SIZE} wait
        already (then it is counted dropped).

        @return: whether the span may be queued.
        """
        with self._lock:
            if self._pending < self._queue_size and not self._abandoned:
                self._pending += 1
                return True
        self._drop(1, STOPPED if self._abandoned else QUEUE_FULL)
        return False

    @property
    def abandoned(self) -> bool:
        """
        Whether the stop gave up on the exporter.
        """
        return self._abandoned

    def abandon(self) -> int:
        """
        The stop gives up: no more exports, the SDK's exporter shut down
        (its retries end), the spans still waiting counted dropped.

        @return: how many were still waiting.
        """
        with self._lock:
            self._abandoned = True
            left, self._pending = self._pending, 0
        self._drop(left, STOPPED)
        self.shutdown()
        return left

    def note(self, message: str) -> None:
        """
        The SDK's exporter logged C{message}: the first of an export is its
        failure's reason.
        """
        if self._reason is None:
            self._reason = message[:_REASON_LIMIT]

    def _drop(self, count: int, reason: str) -> None:
        if count:
            self._dropped.labels(reason).inc(count)

    def _failed(self, count: int) -> None:
        self._lost_in_outage += count
        if self._failing:
            return
        self._failing = True
        reason = self._reason or "the exporter gave no reason"
        destination = self._destination
        self._report(
            lambda: log.warn(
                "spans cannot be exported to {destination}: {reason}; they are"
                " dropped (llmgw_trace_spans_dropped_total) until it takes them"
                " again",
                destination=destination,
                reason=reason,
            )
        )

    def _succeeded(self) -> None:
        if not self._failing:
            return
        self._failing = False
        lost, self._lost_in_outage = self._lost_in_outage, 0
        destination = self._destination
        self._report(
            lambda: log.info(
                "spans are exported to {destination} again; {lost} were dropped"
                " while it failed",
                destination=destination,
                lost=lost,
            )
        )


class SdkRecords(logging.Handler):
    """
    The records of the SDK's exporters (L{SDK_LOGGER}), kept from the log
    and given to the watch while tracing runs (L{attach}, L{detach}): the
    watch logs an outage once instead.
    """

    def __init__(self, watch: ExportWatch) -> None:
        super().__init__()
        self._watch = watch
        self._propagated = True

    def emit(self, record: logging.LogRecord) -> None:
        """
        Give C{record}'s message to the watch.
        """
        try:
            message = record.getMessage()
        except Exception:  # a bad format from the SDK: its template
            message = str(record.msg)
        self._watch.note(message)

    def attach(self) -> None:
        """
        Take the SDK exporters' records from now on.
        """
        logger = logging.getLogger(SDK_LOGGER)
        self._propagated = logger.propagate
        logger.addHandler(self)
        logger.propagate = False

    def detach(self) -> None:
        """
        Leave them to Python's C{logging} again.
        """
        logger = logging.getLogger(SDK_LOGGER)
        logger.removeHandler(self)
        logger.propagate = self._propagated


class AdmittingProcessor:
    """
    The SDK's batch processor behind L{ExportWatch.admit}: a span the queue
    has no room for is counted, not dropped silently by the SDK's queue (it
    is as long as the watch's count, which is never shorter than the queue).

    @param batch: the SDK's C{BatchSpanProcessor}, exporting to the watch.
    @param watch: the L{ExportWatch} it exports to.
    """

    def __init__(self, batch: SpanProcessor, watch: ExportWatch) -> None:
        self._batch = batch
        self._watch = watch

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """
        The SDK's hook: passed on.
        """
        self._batch.on_start(span, parent_context=parent_context)

    def _on_ending(self, span: Span) -> None:
        # The SDK calls it on every processor since 1.35.
        self._batch._on_ending(span)

    def on_end(self, span: ReadableSpan) -> None:
        """
        Queue C{span} for export if the watch admits it.
        """
        if self._watch.admit():
            self._batch.on_end(span)

    def shutdown(self) -> None:
        """
        Export what waits and stop the SDK's thread (blocks: run it off the
        reactor's thread).
        """
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """
        @return: the SDK's answer.
        """
        return self._batch.force_flush(timeout_millis)


def stop_within(
    reactor: IThreadedClockReactor,
    shutdown: Callable[[], None],
    watch: ExportWatch,
    budget: float = STOP_BUDGET,
) -> Deferred[None]:
    """
    Run C{shutdown} (the SDK's, which blocks) on a daemon thread, and fire
    when it returned or C{budget} seconds passed, whichever is first; past
    the budget the watch gives up (L{ExportWatch.abandon}) and the spans
    still waiting are counted and logged.

    @return: a Deferred that fires with L{None}, within C{budget} seconds.
    """
    done: Deferred[None] = Deferred()

    def finished() -> None:
        if not done.called:
            timer.cancel()
            done.callback(None)

    def give_up() -> None:
        if done.called:
            return
        left = watch.abandon()
        log.info(
            "spans: stopped waiting for the collector after {budget:g}s;"
            " {left} not exported",
            budget=budget,
            left=left,
        )
        done.callback(None)

    def run() -> None:
        try:
            shutdown()
        except Exception:
            failure = Failure()
            reactor.callFromThread(
                lambda: log.failure("stopping the span exporter", failure)
            )
        reactor.callFromThread(finished)

    timer = reactor.callLater(budget, give_up)
    threading.Thread(target=run, name="llmgw-spans-stop", daemon=True).start()
    return done
