"""
Usage accounting: one row per request, buffered and written to the store
in batches, with each key's token count; on stop, everything buffered is
written before the process ends.  The router's records become rows in the
server's wiring (L{llmgw.accounts.usage}).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

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
    next; everything on stop.  A store that cannot be written (another
    process holds the lock) is one warning per episode, with the records
    pending, and one line when the writes go through again.

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
        self._in_flight = 0
        self._timer: LoopingCall | None = None
        self.written = 0
        self.dropped = 0
        # When the current episode of failed writes began (clock seconds),
        # or None while writes go through.
        self._failing_since: float | None = None
        # Batch writes done (or failed) and their seconds, wall clock from
        # the call to the store's answer (its thread's queue included).
        self.writes = 0
        self.write_seconds = 0.0

    @property
    def pending(self) -> int:
        """
        Records buffered, not yet written to the store (those of a write in
        progress included).
        """
        return len(self._rows) + (self._in_flight if self._writing else 0)

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
        self._in_flight = len(rows)
        began = time.perf_counter()
        writing = self._writing = self._store.add_usage(rows, key_use)

        def written(_: object) -> None:
            self.written += len(rows)
            if self._failing_since is not None:
                self.log.info(
                    "usage: the store is writable again after {seconds:.1f}s;"
                    " {count} records written",
                    seconds=self._clock.seconds() - self._failing_since,
                    count=len(rows),
                )
                self._failing_since = None

        def failed(reason: Failure) -> None:
            self._episode(reason, len(rows) + len(self._rows))
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

    def _episode(self, reason: Failure, pending: int) -> None:
        """
        Log a failed write.  The database refusing it (locked by another
        process, busy, disk full) is one warning per episode: every later
        one until a write goes through is kept quiet (retried on the timer,
        the records kept).  Anything else is not expected: logged with its
        traceback every time.
        """
        if not reason.check(*self._store.database_errors):
            self.log.failure(
                "usage: cannot write {count} records; keeping them",
                reason,
                count=pending,
            )
            return
        if self._failing_since is not None:
            return
        self._failing_since = self._clock.seconds()
        # The database says what in one line; a traceback adds nothing.
        self.log.warn(
            "usage: cannot write to the store ({error}); keeping {count}"
            " records and retrying every {interval}s",
            error=reason.getErrorMessage(),
            count=pending,
            interval=self._interval,
        )

    def flush_within(self, seconds: float) -> Deferred[bool]:
        """
        Flush (L{flush}), waiting for it at most C{seconds}.

        @param seconds: how long to wait for the write, seconds.
        @return: fires with C{True} once everything buffered now is written,
            or C{False} after C{seconds} or when the write failed (the
            records stay pending: see L{pending}); never fails.
        """
        done: Deferred[bool] = Deferred()

        def late() -> None:
            if not done.called:
                done.callback(False)

        timer = self._clock.callLater(seconds, late)

        def flushed(_: object) -> None:
            if timer.active():
                timer.cancel()
            if not done.called:
                done.callback(self._failing_since is None and not self._rows)

        self.flush().addBoth(flushed)
        return done

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
