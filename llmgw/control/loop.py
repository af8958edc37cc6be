"""
The loop the reconciler runs in (L{llmgw.control.plane}): passes never
overlap; a pass that fails is logged and the loop goes on; a kick during a
pass becomes exactly one more pass; stopping waits for the pass in flight.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger


class Loop(Service):
    """
    Runs C{work} every C{interval} seconds, and soon after each L{kick}.

    @param clock: the reactor's clock (a L{twisted.internet.task.Clock} in
        tests).
    @param interval: seconds between passes when nothing kicks.
    @param work: one pass; may return an awaitable.
    @param name: for the log.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        interval: float,
        work: Callable[[], Awaitable[None] | None],
        name: str = "loop",
    ) -> None:
        self._clock = clock
        self._interval = interval
        self._work = work
        self.name = name
        self._timer: IDelayedCall | None = None
        self._running_pass: Deferred[None] | None = None
        self._again = False
        self.passes = 0
        # Seconds (wall clock) of the passes done, and of the last one.
        self.pass_seconds = 0.0
        self.last_pass_seconds = 0.0

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._schedule(0)

    def kick(self) -> None:
        """
        Ask for a pass soon: now if idle, right after the current one if a
        pass is running (several kicks during a pass make one more pass).
        """
        if not self.running:
            return
        if self._running_pass is not None:
            self._again = True
            return
        self._schedule(0)

    def _schedule(self, delay: float) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = self._clock.callLater(delay, self._run)

    def _run(self) -> None:
        self._timer = None
        self._again = False
        self.passes += 1
        self._running_pass = ensureDeferred(self._one_pass())
        self._running_pass.addBoth(self._done)

    async def _one_pass(self) -> None:
        began = time.perf_counter()
        try:
            result = self._work()
            if result is not None:
                await result
        except Exception:
            self.log.failure("{name}: pass failed; next pass as usual", name=self.name)
        self.last_pass_seconds = time.perf_counter() - began
        self.pass_seconds += self.last_pass_seconds

    def _done(self, _: object) -> None:
        self._running_pass = None
        if self.running:
            self._schedule(0 if self._again else self._interval)

    def stopService(self) -> Deferred[None]:
        """
        Stop scheduling; fires when the pass in flight, if any, is over.
        """
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._running_pass is None:
            return succeed(None)
        finished: Deferred[None] = Deferred()
        self._running_pass.addBoth(lambda _: finished.callback(None))
        return finished
