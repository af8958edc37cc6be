"""
The GPU meter's clock and its writes (docs/cost.md): while this server
leads, the meter (L{llmgw.control.meter.GpuMeter}) counts every second,
and what it counted is added to the store's C{gpu_time} rows every
L{WRITE_EVERY} seconds and at the server's stop; a standby counts
nothing, and a server that takes the lead begins counting then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import astuple
from typing import Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.control.meter import Counted, GpuMeter
from llmgw.store.gpu_time import GpuTimeRow

TICK = 0.25
"""
Seconds between two of the meter's looks at the fleet: a state found is
counted until the next look, so a change is counted at most this late.
"""

WRITE_EVERY = 10.0
"""
Seconds between two writes of what the meter counted: what a crash may
lose at most.
"""


class GpuTimeStore(Protocol):
    """
    Where the meter's counts go (L{llmgw.store.base.Store.add_gpu_time}).
    """

    def add_gpu_time(self, rows: Sequence[GpuTimeRow]) -> Deferred[None]:
        """
        Add C{rows} to their hours' GPU time.
        """


class MeterService(Service):
    """
    Ticks the meter while C{leading()} says this server leads, and adds
    what it counted to the store.

    @param clock: the reactor's clock (POSIX seconds in the server).
    @param meter: the GPU meter.
    @param store: where the counts go.
    @param leading: whether this server leads now (its reconciler runs).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        meter: GpuMeter,
        store: GpuTimeStore,
        leading: Callable[[], bool],
    ) -> None:
        self._clock = clock
        self._meter = meter
        self._store = store
        self._leading = leading
        self._pending: dict[tuple[float, str, int, str, str], list[float]] = {}
        self._names: dict[tuple[str, int], str] = {}
        self._written_at = 0.0
        self._writing: Deferred[None] | None = None
        self._call = LoopingCall(self._tick)
        self._call.clock = clock

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._written_at = self._clock.seconds()
        self._call.start(TICK, now=True).addErrback(
            lambda f: self.log.failure("the GPU meter stopped", f)
        )

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._call.running:
            self._call.stop()
        # Up to now, if this server was counting: it stops with the
        # reconciler, whose step it is in.
        if self._meter.counting:
            self._add(self._meter.tick(self._clock.seconds()))
        return self._write()

    def _tick(self) -> None:
        now = self._clock.seconds()
        if not self._leading():
            # A standby counts nothing; one that lost the lead stops here.
            self._meter.stop()
            return
        self._add(self._meter.tick(now))
        if now - self._written_at >= WRITE_EVERY and self._writing is None:
            self._written_at = now
            self._write()

    def _add(self, counted: list[Counted]) -> None:
        for c in counted:
            key = (c.hour, c.node, c.gpu, c.model, c.state)
            self._names[c.node, c.gpu] = c.gpu_name
            part = self._pending.setdefault(key, [0.0] * 4)
            for i, value in enumerate((c.seconds, c.busy, c.cost, c.busy_cost)):
                part[i] += value

    def _write(self) -> Deferred[None]:
        """
        Add what is pending to the store; what a failed write held is
        added again to the next.
        """
        if not self._pending:
            return succeed(None)
        pending, self._pending = self._pending, {}
        rows = [
            GpuTimeRow(hour, node, gpu, self._names[node, gpu], model, state, *part)
            for (hour, node, gpu, model, state), part in pending.items()
        ]

        def failed(failure: Failure) -> None:
            self.log.failure("GPU time not written; kept for the next write", failure)
            self._add([Counted(*astuple(row)) for row in rows])

        def done(_: object) -> None:
            self._writing = None

        # Known as in flight before its callbacks: a write that fired at
        # once is no longer in flight once they ran.
        self._writing = d = self._store.add_gpu_time(rows)
        d.addErrback(failed).addBoth(done)
        return d
