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


class StorePasses(Service):
    """
    One periodic job of the server's on its store: a pass at start and one
    every C{interval} seconds; a pass still running when the next is due is
    not started twice (L{LoopingCall} waits for the Deferred it is given); a
    pass the store refuses (one of its C{database_errors}) is logged as a
    warning and tried again at the next, any other failure logged with its
    traceback.  On stop, waits for the pass in flight.

    @param name: the job's name, first in its log lines (C{"usage
        retention"}).
    @param clock: when passes run.
    @param interval: seconds between passes.
    @param database_errors: what the store's driver raises when it refuses.
    @param work: one pass: fires with how many rows it changed.
    @param told: called with that count and the pass's seconds, after a
        pass that did not fail.
    """

    log = Logger()

    def __init__(
        self,
        name: str,
        clock: IReactorTime,
        interval: float,
        database_errors: tuple[type[Exception], ...],
        work: Callable[[], Deferred[int]],
        told: Callable[[int, float], None],
    ) -> None:
        self._name = name
        self._clock = clock
        self.interval = interval
        self._database_errors = database_errors
        self._work = work
        self._told = told
        self._timer: LoopingCall | None = None
        self._pass: Deferred[None] | None = None

    def run_once(self) -> Deferred[None]:
        """
        One pass (or the one in flight).

        @return: fires when it is done; never fails (failures are logged).
        """
        if self._pass is not None:
            return self._pass
        began = time.monotonic()

        def done(count: int) -> None:
            self._told(count, time.monotonic() - began)

        def failed(reason: Failure) -> None:
            if reason.check(*self._database_errors):
                self.log.warn(
                    "{name}: the store refused ({error}); trying again in {interval}s",
                    name=self._name,
                    error=reason.getErrorMessage(),
                    interval=self.interval,
                )
            else:
                self.log.failure("{name}: a pass failed", reason, name=self._name)

        def finished(_: object) -> None:
            self._pass = None

        one = self._work().addCallbacks(done, failed)
        self._pass = one
        one.addBoth(finished)
        return one

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._timer = LoopingCall(self.run_once)
        self._timer.clock = self._clock
        self._timer.start(self.interval, now=True)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.running:
            self._timer.stop()
        return Deferred.fromCoroutine(self._wait())

    async def _wait(self) -> None:
        if self._pass is not None:
            await self._pass


class UsageRetention(StorePasses):
    """
    Rolls old usage records into daily totals, in L{StorePasses}.

    @param retention: C{[store] usage_retention}, seconds: a record older
        than the start of the UTC day this long ago is rolled.
    @param interval: seconds between passes.
    @param wall_clock: POSIX seconds now.
    @ivar rolled: records rolled since start.
    """

    def __init__(
        self,
        store: Store,
        clock: IReactorTime,
        retention: float,
        interval: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            "usage retention",
            clock,
            interval,
            store.database_errors,
            self._roll,
            self._rolled,
        )
        self._store = store
        self.retention = retention
        self._wall_clock = wall_clock
        self._cutoff = 0.0
        self.rolled = 0

    def cutoff(self) -> float:
        """
        @return: POSIX seconds: the records before it are past retention.
        """
        return day_start(self._wall_clock() - self.retention)

    def _roll(self) -> Deferred[int]:
        self._cutoff = self.cutoff()
        return self._store.roll_usage(self._cutoff)

    def _rolled(self, count: int, seconds: float) -> None:
        self.rolled += count
        if count:
            self.log.info(
                "usage retention: rolled {count} records from before"
                " {cutoff} into daily totals in {seconds:.1f}s",
                count=count,
                cutoff=time.strftime("%Y-%m-%d", time.gmtime(self._cutoff)),
                seconds=seconds,
            )
