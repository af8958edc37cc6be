"""
Usage accounting: one row per request, buffered and written to the store
in batches, with each key's token count; on stop, everything buffered is
written before the process ends.  The router's records become rows in the
server's wiring (L{llmgw.server.usage}).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.store.db import Store, UsageRow

MAX_BUFFERED = 200_000
"""
Records kept while the store cannot be written; beyond, the oldest are
dropped (and counted in the log).
"""


class UsageWriter(Service):
    """
    Writes usage rows and key token counts to the store: in batches, on a
    timer and when a batch fills, keeping what a failed write had for the
    next; everything on stop.

    @param interval: seconds between batch writes.
    @param batch_size: a batch is written early once this many wait.
    @param record_rows: false keeps no record per request, only each
        key's token count (budgets hold across restarts either way).
    @ivar record_rows: C{record_rows}, for callers that would build a row
        only to have it dropped.
    """

    log = Logger()

    def __init__(
        self,
        store: Store,
        clock: IReactorTime,
        interval: float = 1.0,
        batch_size: int = 1000,
        wall_clock: Callable[[], float] = time.time,
        record_rows: bool = True,
    ) -> None:
        self._store = store
        self.record_rows = record_rows
        self._clock = clock
        self._interval = interval
        self._batch_size = batch_size
        self._wall_clock = wall_clock
        self._rows: list[tuple[float, UsageRow]] = []
        self._key_use: dict[int, tuple[int, float]] = {}
        self._writing: Deferred[None] | None = None
        self._timer: LoopingCall | None = None
        self.written = 0
        self.dropped = 0
        # Batch writes done (or failed) and their seconds, wall clock from
        # the call to the store's answer (its thread's queue included).
        self.writes = 0
        self.write_seconds = 0.0

    @property
    def pending(self) -> int:
        """
        Records buffered, not written yet.
        """
        return len(self._rows)

    def add(self, row: UsageRow) -> None:
        """
        Buffer one request's row (timed now, by the wall clock) and add its
        tokens to its key's count.
        """
        now = self._wall_clock()
        if not self.record_rows:
            if row.key_id is not None:
                self._count_key(row, now)
            return
        self._rows.append((now, row))
        if row.key_id is not None:
            self._count_key(row, now)
        if len(self._rows) > MAX_BUFFERED:
            drop = len(self._rows) - MAX_BUFFERED
            del self._rows[:drop]
            self.dropped += drop
            self.log.error(
                "usage: the store is not keeping up; dropped {count} records",
                count=drop,
            )
        if len(self._rows) >= self._batch_size and self._writing is None:
            self.flush()

    def _count_key(self, row: UsageRow, now: float) -> None:
        assert row.key_id is not None
        tokens, _ = self._key_use.get(row.key_id, (0, 0.0))
        self._key_use[row.key_id] = (
            tokens + row.prompt_tokens + row.completion_tokens,
            now,
        )

    def flush(self) -> Deferred[None]:
        """
        Write what is buffered now (after the write in progress).

        @return: fires when it is written or failed (failures are logged
            and the records kept for the next try).
        """
        if self._writing is not None:
            done: Deferred[None] = Deferred()
            self._writing.addBoth(lambda _: self.flush().chainDeferred(done))
            return done
        if not self._rows and not self._key_use:
            return Deferred.fromCoroutine(_nothing())
        rows, self._rows = self._rows, []
        key_use, self._key_use = self._key_use, {}
        began = time.perf_counter()
        writing = self._writing = self._store.add_usage(rows, key_use)

        def written(_: object) -> None:
            self.written += len(rows)

        def failed(reason: object) -> None:
            self.log.failure(
                "usage: cannot write {count} records; keeping them",
                reason,  # type: ignore[arg-type]
                count=len(rows),
            )
            self._rows[:0] = rows
            for key_id, (tokens, last) in key_use.items():
                more, later = self._key_use.get(key_id, (0, 0.0))
                self._key_use[key_id] = (tokens + more, max(last, later))

        def finished(_: object) -> None:
            self._writing = None
            self.writes += 1
            self.write_seconds += time.perf_counter() - began

        writing.addCallbacks(written, failed)
        writing.addBoth(finished)
        return writing

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._timer = LoopingCall(self.flush)
        self._timer.clock = self._clock
        self._timer.start(self._interval, now=False)

    def stopService(self) -> Deferred[None]:
        """
        Stop the timer and write everything buffered.
        """
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.running:
            self._timer.stop()
        return Deferred.fromCoroutine(self._final())

    async def _final(self) -> None:
        # Up to three tries (each after the write in flight, if any): a
        # failed write keeps its rows for the next.
        for _ in range(3):
            await self.flush()
            if not self._rows:
                break
        self.log.info(
            "usage: {written} records written{dropped}",
            written=self.written,
            dropped=f", {self.dropped} dropped" if self.dropped else "",
        )


async def _nothing() -> None:
    return None
