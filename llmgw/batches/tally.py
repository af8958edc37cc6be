"""
What batch work looks like now (docs/batches.md, "Watching batches"): the
active batches with their lines by state, and every active batch's lines
by state together, read from the store every L{INTERVAL} seconds and kept
for the metrics' scrapes (L{llmgw.batches.metrics}) and the dashboard's
batches page (L{llmgw.web.batches}).

Why a periodic read, not a read at each scrape: a scrape is answered from
memory (prometheus_client's collectors are synchronous, and a store read
is a thread's or a pool's round trip that a slow database makes seconds
long); however many scrapers and dashboards look, the store is read
C{2 + A} times per interval for C{A} active batches (at most
L{MOST_SHOWN} of them per-batch), and the figures are at most one
interval old plus the read's own time.  Every server of a standby set
reads them alike (the lines live in the shared store).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.store.batches import ACTIVE_STATUSES, LINE_STATES, BatchRow

INTERVAL = 5.0
"""
Seconds between two reads of the store.
"""

MOST_SHOWN = 100
"""
The active batches whose lines are counted one by one each read (the
oldest first); the totals count every active batch's.
"""


class BatchReads(Protocol):
    """
    What the tally reads of the store (L{llmgw.store.base.Store}).
    """

    def active_batches(self) -> Deferred[list[BatchRow]]:
        """
        Every key's batches not over (validating, in_progress, finalizing,
        cancelling).
        """

    def batch_line_totals(self) -> Deferred[dict[str, int]]:
        """
        The lines of every active batch, by state.
        """

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        """
        One batch's lines, by state.
        """


ENDED_STATES = ("done", "failed", "cancelled", "expired")
"""
The line states that are a line's end (of L{LINE_STATES}): the others,
C{pending} and C{running}, are still to be answered.
"""


def progress(lines: dict[str, int]) -> tuple[int, int]:
    """
    @param lines: a batch's lines by state.
    @return: its lines ended (L{ENDED_STATES}), and all its lines.
    """
    return sum(lines.get(s, 0) for s in ENDED_STATES), sum(lines.values())


def every_state(counts: dict[str, int]) -> dict[str, int]:
    """
    @return: C{counts} with each of L{LINE_STATES} (0 where missing), in
        their order.
    """
    return {state: int(counts.get(state, 0)) for state in LINE_STATES}


@dataclass(frozen=True)
class Figures:
    """
    One read of the store.

    @ivar batches: the active batches (the oldest first, at most
        L{MOST_SHOWN}), each with its lines by state.
    @ivar more: active batches left out of C{batches}.
    @ivar lines: every active batch's lines by state (each of
        L{LINE_STATES}).
    @ivar statuses: the active batches by status (each of
        L{ACTIVE_STATUSES}).
    @ivar read_at: POSIX seconds the read ended; L{None} before the first.
    """

    batches: list[tuple[BatchRow, dict[str, int]]] = field(default_factory=list)
    more: int = 0
    lines: dict[str, int] = field(default_factory=lambda: every_state({}))
    statuses: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(ACTIVE_STATUSES, 0)
    )
    read_at: float | None = None


class BatchTally(Service):
    """
    Reads L{Figures} every C{interval} seconds while running; reads never
    overlap, a failed one is logged (once until one succeeds again) and
    the last figures are kept; stopping waits for the read in flight.

    @param clock: the reactor's clock (a L{twisted.internet.task.Clock} in
        tests).
    @param store: the database.
    @param wall_clock: POSIX seconds now.
    @param interval: seconds between reads.
    @ivar figures: the last read's figures.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        store: BatchReads,
        *,
        wall_clock: Callable[[], float],
        interval: float = INTERVAL,
    ) -> None:
        self._store = store
        self._wall_clock = wall_clock
        self._loop = LoopingCall(self._read)
        self._loop.clock = clock
        self._interval = interval
        self._reading: Deferred[None] | None = None
        self._failing = False
        self.figures = Figures()

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop.start(self._interval, now=True)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop.running:
            self._loop.stop()
        return self._reading if self._reading is not None else succeed(None)

    def _read(self) -> Deferred[None]:
        reading = Deferred.fromCoroutine(self.read())
        self._reading = reading

        def done(result: None) -> None:
            self._reading = None

        reading.addBoth(done)
        return reading

    async def read(self) -> None:
        """
        Read the figures now; a failure is logged, never raised (the loop
        must not die of a database outage).
        """
        try:
            active = await self._store.active_batches()
            lines = await self._store.batch_line_totals()
            shown = sorted(active, key=lambda b: (b.created_at, b.id))[:MOST_SHOWN]
            batches = [
                (batch, every_state(await self._store.line_counts(batch.id)))
                for batch in shown
            ]
        except Exception:
            if not self._failing:
                self._failing = True
                self.log.failure(
                    "batch figures: the store cannot be read; the metrics and"
                    " the dashboard show the last read's until it can"
                )
            return
        if self._failing:
            self._failing = False
            self.log.info("batch figures: the store is read again")
        statuses = dict.fromkeys(ACTIVE_STATUSES, 0)
        for batch in active:
            statuses[batch.status] = statuses.get(batch.status, 0) + 1
        self.figures = Figures(
            batches,
            len(active) - len(shown),
            every_state(lines),
            statuses,
            self._wall_clock(),
        )
