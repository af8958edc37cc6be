"""
The dashboard's traffic figures for the fleet, each model and each
replica: every finished request, as the router records it (a usage sink
beside the log line and the store) or as the routers of a tier report
theirs (L{Traffic.add}: L{llmgw.router.telemetry.reports}), counted into
slots of L{SLOT} seconds kept for L{KEPT} seconds; the pages read windows
of them (L{WINDOWS}: the last minute and the last five minutes) and draw
the slots as charts.

Why not the metrics registry, as L{llmgw.web.history} reads it for the
fleet's sparklines: its counters name no replica, and its
time-to-first-token histogram's buckets (50, 100, 250, 500 ms, 1 s...)
are too wide for a p50 an operator can read.  Here each time to first
token lands in a bucket L{RATIO} wide on a log scale, so a percentile is
within 2.5 % of the one the exact times give.

Cost per request: three slot updates (fleet, model, replica), a few
dictionary operations each.  Memory: at most C{KEPT / SLOT} slots per
model and replica seen in the last C{KEPT} seconds, each with one count
per distinct bucket.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

SLOT = 5.0
"""
Seconds per slot.
"""

KEPT = 600.0
"""
Seconds of slots kept (the charts' span).
"""

WINDOWS = (60.0, 300.0)
"""
The windows the pages state figures over, seconds.
"""

RATIO = 1.05
"""
The ratio between two neighbouring time-to-first-token buckets.
"""

OTHER = "other"
"""
Where requests for names no catalog model has are counted (a client must
not grow the figures by inventing names).
"""

_LOG_RATIO = math.log(RATIO)
_SHORTEST = 1e-4  # seconds: every shorter time to first token is counted here


class Finished(Protocol):
    """
    A finished request as the router records it
    (C{llmgw.router.interfaces.RequestRecord}).
    """

    @property
    def model(self) -> str: ...

    @property
    def replica(self) -> str | None: ...

    @property
    def status(self) -> int: ...

    @property
    def stream(self) -> bool: ...

    @property
    def time_to_first_token(self) -> float | None: ...

    @property
    def usage_estimated(self) -> bool: ...


@dataclass
class Slot:
    """
    The requests that finished within one slot.

    @ivar index: the slot's start divided by L{SLOT}.
    @ivar errors: those answered 5xx.
    @ivar ttft: the times to first token of the streams answered (status
        under 400), as bucket -> count (see L{bucket}).
    """

    index: int
    requests: int = 0
    errors: int = 0
    ttft: dict[int, int] = field(default_factory=dict)


def bucket(seconds: float) -> int:
    """
    @return: the bucket of a time to first token of C{seconds}: C{b} holds
        the times from C{RATIO ** b} to C{RATIO ** (b + 1)}.
    """
    return math.floor(math.log(max(seconds, _SHORTEST)) / _LOG_RATIO)


def percentile(counts: dict[int, int], share: float) -> float | None:
    """
    @param counts: bucket -> count (L{bucket}).
    @param share: 0.5 for the median, 0.95 for p95.
    @return: seconds, the middle (geometric) of the bucket that holds the
        time C{share} of the counted times are at or under; L{None} when
        none were counted.
    """
    total = sum(counts.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(share * total))
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return float(RATIO ** (index + 0.5))
    raise AssertionError("unreachable: the ranks add up to the total")


@dataclass(frozen=True)
class Figures:
    """
    The figures of one series over one window.

    @ivar seconds: the window's length, as stated on the page.
    @ivar covered: the seconds it covers (shorter than C{seconds} while
        the server has run for less).
    @ivar rate: requests finished per second.
    @ivar error_rate: the share of them answered 5xx (0 to 1); L{None}
        when none finished.
    @ivar streams: the streams among them that had a first token.
    @ivar ttft_p50: seconds, the median time to first token; L{None} for
        no stream.
    @ivar ttft_p95: seconds, the 95th percentile.
    """

    seconds: float
    covered: float
    requests: int
    errors: int
    rate: float
    error_rate: float | None
    streams: int
    ttft_p50: float | None
    ttft_p95: float | None


class Series:
    """
    One model's, replica's or the fleet's slots, oldest first.
    """

    def __init__(self) -> None:
        self.slots: deque[Slot] = deque(maxlen=int(KEPT / SLOT))
        self._sums: (
            tuple[int, tuple[float, ...], list[tuple[int, int, dict[int, int]]]] | None
        ) = None

    def slot(self, index: int) -> Slot:
        """
        @return: the slot of C{index}, new when it is past the newest.
        """
        slots = self.slots
        if slots and slots[-1].index >= index:
            # The current one; or the clock (wall time) went back: the
            # newest, so that the slots stay in order.
            return slots[-1]
        new = Slot(index)
        slots.append(new)
        return new

    def sums(
        self, index: int, windows: tuple[float, ...]
    ) -> list[tuple[int, int, dict[int, int]]]:
        """
        @return: per window (shortest first), the requests, errors and
            time-to-first-token buckets of its complete slots (before
            C{index}, the current one); computed once per slot.
        """
        cached = self._sums
        if cached is not None and cached[0] == index and cached[1] == windows:
            return cached[2]
        slots = self.since(index - int(windows[-1] / SLOT) + 1)
        sums = []
        for seconds in windows:
            first = index - int(seconds / SLOT) + 1
            held = [s for s in slots if first <= s.index < index]
            sums.append(
                (
                    sum(s.requests for s in held),
                    sum(s.errors for s in held),
                    _merged(s.ttft for s in held),
                )
            )
        self._sums = (index, windows, sums)
        return sums

    def since(self, first: int) -> list[Slot]:
        """
        @return: the slots from index C{first} on, newest first.
        """
        found = []
        for slot in reversed(self.slots):
            if slot.index < first:
                break
            found.append(slot)
        return found


def _merged(counts: Iterable[dict[int, int]]) -> dict[int, int]:
    """
    @return: bucket counts added up (a new dictionary).
    """
    total: dict[int, int] = {}
    for one in counts:
        for b, n in one.items():
            total[b] = total.get(b, 0) + n
    return total


def _count(slot: Slot, error: bool, ttft: float | None) -> None:
    slot.requests += 1
    if error:
        slot.errors += 1
    if ttft is not None:
        b = bucket(ttft)
        slot.ttft[b] = slot.ttft.get(b, 0) + 1


class Traffic:
    """
    The figures, fed one record per finished request (L{record}: the
    router's C{UsageSink}).

    @param clock: seconds now (the reactor's C{seconds}).
    @param resolve: a name's catalog model (aliases resolved), or
        L{None}: those requests count under L{OTHER}.

    @ivar estimated: per model, the requests since the start whose token
        counts are the router's estimate (the engine's never came: a client
        that left mid-stream, a broken stream, or an engine that sends no
        usage in streams).
    @ivar answered_estimated: those of them answered 200: streams that
        ended whole without the engine's usage, which only an engine that
        ignores C{stream_options.include_usage} gives.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        resolve: Callable[[str], str | None],
    ) -> None:
        self._clock = clock
        self._resolve = resolve
        self.started = clock()
        self.fleet = Series()
        self.models: dict[str, Series] = {}
        self.replicas: dict[str, Series] = {}
        # Per catalog model since the start, not per slot: an engine that
        # sends no usage in streams (llama-cpp-python's server) is a fact
        # about the model's engine, to be seen whenever one looks.
        self.estimated: dict[str, int] = {}
        self.answered_estimated: dict[str, int] = {}

    def record(self, record: Finished) -> None:
        """
        Count one finished request in the fleet's, its model's and its
        replica's (if one answered) current slot.
        """
        index = math.floor(self._clock() / SLOT)
        error = record.status >= 500
        # Streams answered: an error's first byte is no token.
        ttft = (
            record.time_to_first_token
            if record.stream and not 400 <= record.status
            else None
        )
        for slot in self._slots(index, record.model, record.replica):
            _count(slot, error, ttft)
        if record.usage_estimated:
            model = self._resolve(record.model) or OTHER
            self.estimated[model] = self.estimated.get(model, 0) + 1
            if record.status == 200:
                # Answered whole, yet no count: the engine sends none.
                count = self.answered_estimated.get(model, 0) + 1
                self.answered_estimated[model] = count

    def add(
        self,
        model: str,
        replica: str | None,
        requests: int,
        errors: int,
        ttft: dict[float, int],
    ) -> None:
        """
        Count what a router of the tier reported
        (L{llmgw.router.telemetry.reports.TrafficSink}) in the current
        slots, as L{record} counts one request.

        @param model: the name asked for (resolved as L{record} does).
        @param replica: the replica that answered, or L{None}.
        @param requests: requests finished.
        @param errors: those of them answered 5xx.
        @param ttft: the times to first token of the streams answered,
            seconds -> count.
        """
        index = math.floor(self._clock() / SLOT)
        buckets: dict[int, int] = {}
        for seconds, count in ttft.items():
            b = bucket(seconds)
            buckets[b] = buckets.get(b, 0) + count
        for slot in self._slots(index, model, replica):
            slot.requests += requests
            slot.errors += errors
            for b, count in buckets.items():
                slot.ttft[b] = slot.ttft.get(b, 0) + count

    def _slots(self, index: int, name: str, replica: str | None) -> list[Slot]:
        """
        @return: the fleet's, C{name}'s model's and C{replica}'s (if any)
            slots of C{index}.
        """
        fleet = self.fleet
        if not fleet.slots or fleet.slots[-1].index != index:
            self._forget(index)
        slots = [fleet.slot(index)]
        model = self._resolve(name) or OTHER
        series = self.models.get(model)
        if series is None:
            series = self.models[model] = Series()
        slots.append(series.slot(index))
        if replica is not None:
            series = self.replicas.get(replica)
            if series is None:
                series = self.replicas[replica] = Series()
            slots.append(series.slot(index))
        return slots

    def _forget(self, index: int) -> None:
        """
        Drop the series with no slot left within L{KEPT} (replicas gone,
        models no longer asked for); once per slot.
        """
        oldest = index - int(KEPT / SLOT)
        for named in (self.models, self.replicas):
            for name in [n for n, s in named.items() if s.slots[-1].index <= oldest]:
                del named[name]

    def figures(self, series: Series | None, seconds: float) -> Figures:
        """
        @param series: L{fleet}, one of L{models} or L{replicas}, or
            L{None} (nothing seen: zeros).
        @param seconds: the window, a multiple of L{SLOT} up to L{KEPT}.
        @return: the figures over the last C{seconds}: the current slot
            and the C{seconds / SLOT - 1} before it.
        """
        (found,) = self.windows(series, (seconds,))
        return found

    def windows(
        self, series: Series | None, windows: tuple[float, ...] = WINDOWS
    ) -> list[Figures]:
        """
        @return: L{figures} over each of C{windows} (shortest first): the
            complete slots' sums, kept per series until the next slot
            begins, plus the current slot's.
        """
        now = self._clock()
        index = math.floor(now / SLOT)
        sums = series.sums(index, windows) if series is not None else None
        current = series.slots[-1] if series is not None and series.slots else None
        if current is not None and current.index != index:
            current = None
        out = []
        for i, seconds in enumerate(windows):
            requests, errors, ttft = sums[i] if sums is not None else (0, 0, {})
            if current is not None:
                requests += current.requests
                errors += current.errors
                ttft = _merged([ttft, current.ttft])
            first = index - int(seconds / SLOT) + 1
            covered = max(now - max(first * SLOT, self.started), 1e-6)
            out.append(
                Figures(
                    seconds=seconds,
                    covered=covered,
                    requests=requests,
                    errors=errors,
                    rate=requests / covered,
                    error_rate=errors / requests if requests else None,
                    streams=sum(ttft.values()),
                    ttft_p50=percentile(ttft, 0.5),
                    ttft_p95=percentile(ttft, 0.95),
                )
            )
        return out

    def timeline(self, series: Series | None) -> list[tuple[float, Slot | None]]:
        """
        @return: for each complete slot of the last L{KEPT} seconds since
            the start, oldest first: C{(seconds ago its end was, the slot
            or L{None} when nothing finished in it)}; the newest ended
            less than L{SLOT} seconds ago (the charts' points).
        """
        now = self._clock()
        index = math.floor(now / SLOT)
        first = max(index - int(KEPT / SLOT), math.floor(self.started / SLOT))
        held = {s.index: s for s in series.slots} if series is not None else {}
        return [(now - (i + 1) * SLOT, held.get(i)) for i in range(first, index)]
