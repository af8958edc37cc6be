"""
Each request's share of its replica's GPUs (docs/cost.md), by processor
sharing: each second a replica serves n requests, each of them gets 1/n
of its GPU-seconds and of their price.

Kept as a running total per replica, the GPU-seconds one request in
flight would have got since the replica was first used: a request's
share is that total at its end less the total at its start, exact
whatever requests came and went meanwhile, at a constant cost per event
(no per-second work, no list of requests).
"""

from __future__ import annotations

from dataclasses import dataclass

HOUR = 3600.0


@dataclass(frozen=True)
class Mark:
    """
    Where a request came in: the running totals then.

    @ivar gpu_seconds: GPU-seconds per request in flight, since the first.
    @ivar cost: the same, priced.
    """

    gpu_seconds: float
    cost: float

    def __add__(self, other: Mark) -> Mark:
        return Mark(self.gpu_seconds + other.gpu_seconds, self.cost + other.cost)


NO_GPU = Mark(0.0, 0.0)
"""
No GPU time, and no cost.
"""


class GpuShare:
    """
    One replica's GPU time shared among the requests the router sends it.

    @param busy: the busy seconds counted before (by an earlier object for
        the same replica id).
    @ivar in_flight: its requests in flight, as this object counts them.
    @ivar busy: seconds during which at least one was in flight.
    """

    def __init__(self, busy: float = 0.0) -> None:
        self.in_flight = 0
        self.busy = busy
        self._last = 0.0
        self._per_request = 0.0
        self._cost_per_request = 0.0

    def _advance(self, now: float, gpus: float, gpu_hour: float) -> None:
        """
        Bring the running totals to C{now} at the rate of C{gpus} (held
        since the last event) and C{gpu_hour} (their price per hour).
        """
        elapsed = now - self._last
        if self.in_flight > 0 and elapsed > 0:
            self._per_request += elapsed * gpus / self.in_flight
            self._cost_per_request += elapsed * gpu_hour / HOUR / self.in_flight
            self.busy += elapsed
        self._last = max(self._last, now)

    def busy_at(self, now: float) -> float:
        """
        @return: L{busy} brought to C{now}: the seconds since the last
            event count when a request is in flight.
        """
        if self.in_flight > 0 and now > self._last:
            return self.busy + now - self._last
        return self.busy

    def enter(self, now: float, gpus: float, gpu_hour: float) -> Mark:
        """
        A request goes to the replica at C{now} (seconds).

        @param gpus: the GPUs the replica holds (L{Endpoint.gpus}).
        @param gpu_hour: their price per hour (L{Endpoint.gpu_hour}).
        @return: its mark, for L{leave}.
        """
        self._advance(now, gpus, gpu_hour)
        self.in_flight += 1
        return Mark(self._per_request, self._cost_per_request)

    def leave(self, now: float, gpus: float, gpu_hour: float, mark: Mark) -> Mark:
        """
        The request that entered with C{mark} ended at C{now}.

        @return: its share: GPU-seconds and their price.
        """
        self._advance(now, gpus, gpu_hour)
        self.in_flight = max(0, self.in_flight - 1)
        return Mark(
            self._per_request - mark.gpu_seconds, self._cost_per_request - mark.cost
        )
