"""
Usage kept for C{[store] usage_retention}: a periodic job of the server
rolling the usage records older than that into daily totals per key and
model (L{llmgw.store.base.Store.roll_usage}), which the usage API still
reads; at start, then every L{UsageRetention.interval} seconds.
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

from llmgw.store.base import Store, day_start


class UsageRetention(Service):
    """
    Rolls old usage records into daily totals: a pass at start and one
    every C{interval} seconds; a pass still running when the next is due
    is not started twice; a failed pass is logged and tried again at the
    next.  On stop, waits for the pass in flight.

    @param retention: C{[store] usage_retention}, seconds: a record older
        than the start of the UTC day this long ago is rolled.
    @param interval: seconds between passes.
    @param wall_clock: POSIX seconds now.
    @ivar rolled: records rolled since start.
    """

    log = Logger()

    def __init__(
        self,
        store: Store,
        clock: IReactorTime,
        retention: float,
        interval: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._clock = clock
        self.retention = retention
        self.interval = interval
        self._wall_clock = wall_clock
        self._timer: LoopingCall | None = None
        self._pass: Deferred[None] | None = None
        self.rolled = 0

    def cutoff(self) -> float:
        """
        @return: POSIX seconds: the records before it are past retention.
        """
        return day_start(self._wall_clock() - self.retention)

    def run_once(self) -> Deferred[None]:
        """
        One pass (or the one in flight).

        @return: fires when it is done; never fails (failures are logged).
        """
        if self._pass is not None:
            return self._pass
        cutoff = self.cutoff()
        began = time.monotonic()

        def rolled(count: int) -> None:
            self.rolled += count
            if count:
                self.log.info(
                    "usage retention: rolled {count} records from before"
                    " {cutoff} into daily totals in {seconds:.1f}s",
                    count=count,
                    cutoff=time.strftime("%Y-%m-%d", time.gmtime(cutoff)),
                    seconds=time.monotonic() - began,
                )

        def failed(reason: Failure) -> None:
            if reason.check(*self._store.database_errors):
                self.log.warn(
                    "usage retention: the store refused ({error}); trying"
                    " again in {interval}s",
                    error=reason.getErrorMessage(),
                    interval=self.interval,
                )
            else:
                self.log.failure("usage retention: a pass failed", reason)

        def finished(_: object) -> None:
            self._pass = None

        done = self._store.roll_usage(cutoff).addCallbacks(rolled, failed)
        self._pass = done
        done.addBoth(finished)
        return done

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._timer = LoopingCall(self.run_once)
        self._timer.clock = self._clock
        # LoopingCall waits for a Deferred it is given: never two passes.
        self._timer.start(self.interval, now=True)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.running:
            self._timer.stop()
        return Deferred.fromCoroutine(self._wait())

    async def _wait(self) -> None:
        if self._pass is not None:
            await self._pass
