"""
One simulated generation's exchange: its faults, its wait for a slot, its
timed events (time to first token, inter-token latency) and the client's
departure.  L{llmgw.sim.web} builds one per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure
from twisted.web.server import Request

from llmgw.sim.api import DONE_EVENT, ApiError, error_body, error_type_for
from llmgw.sim.core import engine_dead_body
from llmgw.sim.engine import (
    FOREVER,
    QueueFull,
    Simulator,
)
from llmgw.sim.faults import (
    Faults,
)
from llmgw.sim.kvcache import SequenceBlocks

BYTE_GAP = 0.002
"""
Seconds between single-byte writes under the C{byte_writes} fault.
"""

DROP_DELAY = 0.01
"""
Seconds between the last event before a C{drop_after_chunks} fault and the
abort, for the events to leave the transport's buffer.
"""

JSON = [b"application/json"]
"""
The C{content-type} of a JSON answer, as C{Headers.setRawHeaders} takes it.
"""

_SSE = [b"text/event-stream"]
_NO_CACHE = [b"no-cache"]


class Exchange:
    """
    Drives one response through its faults, its wait for a slot, its timed
    events and the client's departure.

    The body is a list of events (SSE events for a stream, one JSON body
    otherwise).  Event C{0} waits C{first_delay} seconds after admission;
    token events after the first wait C{itl}; the others follow at once.
    """

    __slots__ = (
        "_sim",
        "_request",
        "_faults",
        "_events",
        "_stream",
        "_uses_slot",
        "_first",
        "_count",
        "_first_delay",
        "_itl",
        "_prompt_tokens",
        "_blocks",
        "_kv_tokens",
        "_finished_reason",
        "_prefill",
        "_arrival",
        "_admitted_at",
        "_last_token",
        "_index",
        "_waited",
        "_stall_at",
        "_drop_at",
        "_bytes",
        "_pos",
        "_call",
        "_waiter",
        "_watching",
        "_holding",
        "_done",
    )

    def __init__(
        self,
        sim: Simulator,
        request: Request,
        faults: Faults,
        events: list[bytes],
        *,
        stream: bool,
        uses_slot: bool,
        first: int,
        count: int,
        first_delay: float,
        itl: float,
        prompt_tokens: int,
        blocks: SequenceBlocks | None = None,
        kv_tokens: int = 0,
        finished_reason: str = "length",
    ) -> None:
        """
        @param events: the response body, in events.
        @param stream: an event stream (headers go out before the first
            event; the stream counters apply).
        @param uses_slot: take a concurrency slot (chat and completions).
        @param first: the index of the first token's event.
        @param count: completion tokens, one event each from C{first}.
        @param first_delay: seconds from admission to event 0.
        @param itl: seconds between token events.
        @param prompt_tokens: for the metrics.
        @param blocks: the request's KV blocks, looked up in the prefix cache
            at admission (their uncached part adds prefill time to event 0)
            and cached after event 0 (the prompt) and at the end (prompt
            and completion); None: no cache, no prefill cost.
        @param kv_tokens: KV tokens the sequence holds while it runs.
        @param finished_reason: why the generation ended, C{"length"} or
            C{"stop"}: the label of C{vllm:request_success} it counts in.
        """
        self._sim = sim
        self._request = request
        self._faults = faults
        self._events = events
        self._stream = stream
        self._uses_slot = uses_slot
        self._first = first
        self._count = count
        self._first_delay = first_delay
        self._itl = itl
        self._prompt_tokens = prompt_tokens
        self._blocks = blocks
        self._kv_tokens = kv_tokens
        self._finished_reason = finished_reason
        self._prefill = 0.0
        self._arrival = sim.clock.seconds()
        self._admitted_at = self._arrival
        self._last_token = self._arrival
        self._index = 0
        self._waited = -1
        self._stall_at = (
            -1 if faults.stall_after_chunks is None else faults.stall_after_chunks
        )
        self._drop_at = (
            -1 if faults.drop_after_chunks is None else faults.drop_after_chunks
        )
        self._bytes: bytes | None = None
        self._pos = 0
        self._call: IDelayedCall | None = None
        self._waiter: Deferred[None] | None = None
        self._watching = False
        self._holding = False
        self._done = False

    def start(self) -> None:
        """
        Begin: stall if asked, then answer.
        """
        stall = self._faults.stall_before_first_byte
        if stall > 0:
            self._later(stall, self._begin)
            return
        self._begin()

    def _watch(self) -> None:
        # Only responses that outlive render() need to hear of the client
        # leaving; the hot path (no delays) finishes inside render().
        if not self._watching:
            self._watching = True
            self._request.notifyFinish().addErrback(self._lost)

    def _later(self, delay: float, f: Callable[[], None]) -> None:
        self._watch()
        if delay < FOREVER:
            self._call = self._sim.clock.callLater(delay, f)

    def _begin(self) -> None:
        self._call = None
        request = self._request
        status = self._faults.status
        if status is not None:
            self._fail(
                status,
                error_body(
                    f"simulated fault: status {status}",
                    error_type_for(status),
                    None,
                    "llmgw_sim_fault",
                ),
            )
            return
        waiter = None
        if self._uses_slot:
            try:
                waiter = self._sim.scheduler.acquire(self._kv_tokens)
            except QueueFull:
                self._fail(
                    503,
                    ApiError(
                        503,
                        "the simulated engine's queue is full",
                        type="server_error",
                        code="queue_full",
                    ).body(),
                )
                return
            if waiter is None:
                self._holding = True
                self._prefill_at_admission()
        headers = request.responseHeaders
        if self._stream:
            headers.setRawHeaders(b"content-type", _SSE)
            headers.setRawHeaders(b"cache-control", _NO_CACHE)
            request.write(b"")
            self._sim.stats.streams_started += 1
        else:
            headers.setRawHeaders(b"content-type", JSON)
            headers.setRawHeaders(b"content-length", [b"%d" % len(self._events[0])])
        if waiter is None:
            self._step()
        else:
            self._watch()
            self._waiter = waiter
            waiter.addCallbacks(self._admitted, self._not_admitted)

    def _fail(self, status: int, body: bytes) -> None:
        self._done = True
        request = self._request
        request.setResponseCode(status)
        request.responseHeaders.setRawHeaders(b"content-type", JSON)
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
        request.write(body)
        request.finish()

    def _admitted(self, _: None) -> None:
        self._waiter = None
        self._holding = True
        self._admitted_at = self._sim.clock.seconds()
        self._prefill_at_admission()
        self._step()

    def _prefill_at_admission(self) -> None:
        # vLLM looks the prompt up when it schedules it, not when it comes.
        if self._blocks is not None:
            self._prefill = self._sim.prefill_delay(self._blocks)
            self._first_delay += self._prefill

    def _not_admitted(self, failure: Failure) -> None:
        failure.trap(CancelledError)

    def _delay(self, i: int) -> float:
        if i == 0:
            return self._first_delay
        if self._first < i < self._first + self._count:
            return self._itl
        return 0.0

    def _step(self) -> None:
        """
        Write events until the next delay, stall, drop or the end.
        """
        self._call = None
        events = self._events
        while True:
            chunk = self._bytes
            if chunk is not None:
                pos = self._pos
                self._request.write(chunk[pos : pos + 1])
                pos += 1
                if pos >= len(chunk):
                    self._bytes = None
                    self._index += 1
                else:
                    self._pos = pos
                self._later(BYTE_GAP, self._step)
                return
            i = self._index
            if i >= len(events):
                self._complete()
                return
            if self._uses_slot and self._sim.core.dead:
                self._engine_dead()
                return
            if i == self._drop_at:
                self._drop()
                return
            if i == self._stall_at:
                self._stall_at = -1
                stall = self._faults.stall_seconds
                self._later(FOREVER if stall is None else stall, self._step)
                return
            if i != self._waited:
                delay = self._delay(i)
                if delay > 0:
                    self._waited = i
                    self._later(delay, self._step)
                    return
            self._observe(i)
            if i == 0 and self._blocks is not None and self._holding:
                # Prefill done: the prompt's blocks are computed.
                self._sim.cache.insert(self._blocks.prompt)
            if self._faults.byte_writes:
                self._bytes = events[i]
                self._pos = 0
                continue
            self._request.write(events[i])
            self._index = i + 1

    def _observe(self, i: int) -> None:
        if not self._stream:
            return
        first = self._first
        if i == 0 or (first <= i < first + self._count):
            now = self._sim.clock.seconds()
            if i == 0:
                self._sim.metrics.time_to_first_token.observe(now - self._arrival)
            if i > first:
                self._sim.metrics.inter_token_latency.observe(now - self._last_token)
            self._last_token = now

    def _tokens_sent(self) -> int:
        if not self._stream:
            return self._count if self._index > 0 else 0
        return max(0, min(self._index - self._first, self._count))

    def _complete(self) -> None:
        self._done = True
        sim = self._sim
        if self._stream:
            sim.stats.streams_completed += 1
        self._request.finish()
        if self._uses_slot:
            metrics = sim.metrics
            now = sim.clock.seconds()
            if not self._stream:
                # The first token of an answer sent whole: admission + ttft.
                metrics.time_to_first_token.observe(
                    self._admitted_at
                    + (sim.config.ttft / sim.config.speed + self._prefill)
                    - self._arrival
                )
            metrics.e2e_request_latency.observe(now - self._arrival)
            metrics.prompt_tokens.inc(self._prompt_tokens)
            metrics.generation_tokens.inc(self._count)
            metrics.successes[self._finished_reason].inc()
            if self._blocks is not None:
                sim.cache.insert(self._blocks.whole)
        self._release()

    def _engine_dead(self) -> None:
        """
        Its engine core died while it ran (L{llmgw.sim.core}), seen at its
        next event: vLLM ends a stream with the error object as an event
        and C{[DONE]} (its stream generators catch the C{EngineDeadError}),
        and answers a request not yet answered with its 500, which ends its
        server (C{terminate_if_errored}); a stream's does not.
        """
        self._done = True
        self._release()
        body = engine_dead_body()
        if self._stream:
            self._request.write(b"data: " + body + b"\n\n" + DONE_EVENT)
            self._request.finish()
            return
        self._fail(500, body)
        self._sim.core.terminate_if_errored()

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._sim.scheduler.release(self._kv_tokens)

    def _cancel_pending(self) -> None:
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter.cancel()

    def _drop(self) -> None:
        self._done = True
        if self._stream:
            self._sim.stats.streams_dropped += 1
        if self._uses_slot:
            self._sim.metrics.generation_tokens.inc(self._tokens_sent())
        self._release()
        # Aborting discards what the transport has not sent yet: let the N
        # events leave first.
        self._watch()
        self._call = self._sim.clock.callLater(DROP_DELAY, self._abort)

    def _abort(self) -> None:
        self._call = None
        transport: Any = self._request.transport
        transport.abortConnection()

    def _lost(self, failure: Failure) -> None:
        """
        The client went away before the end: stop at once and free the slot.
        """
        self._cancel_pending()
        if self._done:
            return
        self._done = True
        stats = self._sim.stats
        stats.requests_cancelled += 1
        stats.last_cancel_time = self._sim.clock.seconds()
        if self._stream:
            stats.streams_cancelled += 1
        if self._uses_slot:
            self._sim.metrics.generation_tokens.inc(self._tokens_sent())
        self._release()
