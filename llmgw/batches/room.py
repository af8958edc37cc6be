"""
How many batch lines a model may take now beside its interactive traffic
(the router's L{BatchRoom}), by its engines' load, not a fixed rate
(docs/batches.md, "Batch work and interactive traffic").

What an interactive request's time to first token is made of, in a
continuous-batching engine (vLLM's scheduler; the simulator's
L{llmgw.sim.engine.Scheduler} does the same): its wait for a sequence slot
and KV cache blocks, its prefill, and its first step beside whatever else
runs.  Batch lines cost it the first (a line holding the slot it would
have taken) and the last (a larger batch makes each step longer), so the
rule has two parts:

  1. I{No interactive request waits for a batch line.}  Per ready replica
     (not ejected), with a fresh engine reading
     (L{llmgw.router.routing.load}), its capacity in sequences is learnt
     from the engine itself: the sequences that fit in L{KV_FULL} of its
     KV cache at the cache use each running one takes now (running x
     L{KV_FULL} / cache use), and no more than it ran while it queued
     over two readings in a row (its slots, vLLM's C{max_num_seqs}; one
     reading's queue may be a request caught between two steps).  The
     model's room is the sum of its replicas' capacities, less the most
     requests its interactive traffic had in flight over the last
     L{WINDOW} seconds, less a reserve for that traffic to grow (the
     stated share of its peak, and one sequence per replica), less the
     batch lines in flight (sent and not yet said ended).  The
     interactive requests are the router's own count, at once
     (L{Replica.outstanding} less its C{batch_outstanding}: the runner
     sends its lines through this router), plus what the engine held
     beyond it at its last two readings, the smaller (a tier's routers'
     requests; a reading lags a poll, and one taken as a wave of lines
     ended still counts them).  Any replica whose engine queues a
     request, or whose KV cache is L{KV_FULL} used, gives the model no
     room at all until it drains: batch lines are the first to wait.
  2. I{The share is measured, and kept.}  The records of finished
     interactive requests (this object is also a L{UsageSink}) give their
     time to first token with batch lines in flight and without.  When the
     median of the last L{WINDOW} seconds' with them passes (1 + share)
     times the median of those without, the lines in flight become the
     model's limit, halved; the limit doubles after each L{WINDOW} without
     a breach, and is lifted once past the capacity.  The interactive
     requests' own time to first token is the judge, whatever made it
     longer: a slower step, prefill beside batch prefills.

Part 1 is what keeps the share on an engine whose step time does not grow
with its batch (the simulator's); part 2 on one whose does (vLLM's, where
the decode step grows with the batch).  A model without a ready replica
gets room for one line: it waits at L{BATCH_RANK} in the activation queue
and asks the control plane for the model, which starts it only where the
fleet has free room (L{llmgw.control.held_order}).  A replica whose engine
serves no load metrics gives one line while the router counts nothing in
flight to it; one whose reading is stale, none.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from statistics import median
from typing import Protocol

from twisted.internet.interfaces import IReactorTime

from llmgw.router.interfaces import RequestRecord
from llmgw.router.routing.balancer import KV_FULL, Replica
from llmgw.router.routing.load import EngineLoad

WINDOW = 10.0
"""
Seconds of the interactive traffic's peak kept, and of the time to first
token judged: a few load polls, and a few of a chat's turns.
"""

SAMPLES = 64
"""
Times to first token kept per model, with batch lines and without.
"""

LEAST_SAMPLES = 5
"""
Times to first token needed on each side before the share is judged.
"""


class Readings(Protocol):
    """
    The engines' load, as polled (L{llmgw.router.routing.load.LoadBoard}).
    """

    def reading(self, replica_id: str) -> EngineLoad | None: ...

    def stale(self, replica_id: str, now: float) -> bool: ...

    def has_metrics(self, replica_id: str) -> bool | None: ...


class _Model:
    """
    What the room keeps of one model.

    @ivar in_flight: batch lines sent and not yet ended.
    @ivar last_line: reactor seconds when a batch line last ended or was
        sent.
    @ivar peaks: (reactor seconds, interactive requests in flight) as
        seen at each question, the last L{WINDOW} seconds.
    @ivar alone: times to first token of interactive requests that ran
        with no batch line in flight, seconds.
    @ivar beside: (reactor seconds, time to first token) of those that ran
        beside batch lines.
    @ivar limit: the most lines in flight after a breach of the share, or
        L{None} when there is none.
    @ivar limit_at: reactor seconds when the limit last changed.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_line = -math.inf
        self.peaks: deque[tuple[float, int]] = deque()
        self.alone: deque[float] = deque(maxlen=SAMPLES)
        self.beside: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self.limit: int | None = None
        self.limit_at = -math.inf


class EngineRoom:
    """
    The L{BatchRoom} by the engines' load, and the L{UsageSink} that
    judges the share (the module's docstring says the rule).

    @param clock: the reactor's clock.
    @param replicas: a model's replicas as the router holds them, with
        its count of requests in flight to each
        (L{llmgw.router.routing.balancer.Balancer.replicas_of}).
    @param board: the engines' load readings, or L{None} when the server
        polls none (then every replica counts as one without metrics).
    @param share: C{[batches] interactive_ttft_share}: how much longer,
        as a share, an interactive request's time to first token may be
        beside batch lines than without them.
    """

    def __init__(
        self,
        clock: IReactorTime,
        replicas: Callable[[str], Sequence[Replica]],
        board: Readings | None,
        share: float,
    ) -> None:
        self._clock = clock
        self._replicas = replicas
        self._board = board
        self._share = share
        self._models: dict[str, _Model] = {}
        # Per replica id: the most sequences its engine ran while it
        # queued over two readings in a row (its slots), and when its
        # last reading that queued was read.
        self._slots: dict[str, float] = {}
        # Per replica id: the sequences its KV cache held at its last
        # reading with some running.
        self._fits: dict[str, float] = {}
        # Per replica id: its last reading's time, and the requests its
        # engine held beyond the router's count at the reading before and
        # at that one.
        self._excess: dict[str, tuple[float, float, float]] = {}
        self._queued: dict[str, float] = {}

    def _model(self, model: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model()
        return state

    # BatchRoom

    def room(self, model: str) -> int:
        """
        @return: how many more lines of C{model} may be in flight now, by
            the rule of the module's docstring.
        """
        state = self._model(model)
        now = self._clock.seconds()
        every = self._replicas(model)
        replicas = [r for r in every if r.ejected_until <= now and not r.health.probing]
        if not every:
            # Asks the control plane for the model; it waits behind all.
            return 1 if state.in_flight == 0 else 0
        measured = self.capacity(replicas, now)
        if measured is None:
            return 0
        capacity, read = measured
        interactive = sum(
            r.outstanding - r.batch_outstanding + self._others(r, now) for r in replicas
        )
        peak = self._peak(state, now, interactive)
        reserve = math.ceil(peak * self._share) + read
        free = math.floor(capacity) - peak - reserve - state.in_flight
        limit = self._limit(model, state, now, capacity)
        if limit is not None:
            free = min(free, limit - state.in_flight)
        return max(0, free)

    def sent(self, model: str) -> None:
        """
        One line of C{model} was sent.
        """
        state = self._model(model)
        state.in_flight += 1
        state.last_line = self._clock.seconds()

    def ended(self, model: str) -> None:
        """
        A line of C{model} sent earlier ended.
        """
        state = self._model(model)
        state.in_flight = max(0, state.in_flight - 1)
        state.last_line = self._clock.seconds()

    def in_flight(self, model: str) -> int:
        """
        @return: lines of C{model} sent and not yet ended.
        """
        state = self._models.get(model)
        return state.in_flight if state is not None else 0

    # The engines' load

    def capacity(
        self, replicas: Sequence[Replica], now: float
    ) -> tuple[float, int] | None:
        """
        @param replicas: a model's replicas in service.
        @param now: reactor seconds.
        @return: the sequences their engines can run without queueing,
            by their readings (the module's docstring, part 1), and how
            many of them were read (those the reserve keeps a sequence
            on); L{None} when one of them queues or its KV cache is full.
        """
        board = self._board
        total = 0.0
        read = 0
        for replica in replicas:
            rid = replica.endpoint.id
            if board is None or board.has_metrics(rid) is False:
                # No load to read: one line while idle by the router's count.
                total += replica.outstanding or 1
                continue
            read += 1
            reading = board.reading(rid)
            if reading is None or board.stale(rid, now):
                total += replica.outstanding
                continue
            cache = reading.kv_cache_usage
            if reading.waiting > 0:
                self._queued_at(rid, reading)
                return None
            self._queued.pop(rid, None)
            if cache is not None and cache >= KV_FULL:
                return None
            known = [self._slots[rid]] if rid in self._slots else []
            if cache is not None and cache > 0 and reading.running > 0:
                self._fits[rid] = reading.running * KV_FULL / cache
            if rid in self._fits:
                # An idle engine's last figure holds until it runs again.
                known.append(self._fits[rid])
            if known:
                total += min(known)
            else:
                # Nothing says yet: one more than it runs and the
                # reserve's one, to learn (its slots, once it queues).
                total += max(reading.running, replica.outstanding) + 2
        return total, read

    def _queued_at(self, rid: str, reading: EngineLoad) -> None:
        """
        C{rid}'s engine queues: when it did at the reading before too (a
        request caught between two scheduler steps is no queue), it runs
        as many sequences as it can: learn its slots.
        """
        before = self._queued.get(rid)
        if before is not None and before < reading.read_at:
            self._slots[rid] = max(self._slots.get(rid, 0.0), reading.running)
        self._queued[rid] = reading.read_at

    def _others(self, replica: Replica, now: float) -> int:
        """
        @return: the requests C{replica}'s engine holds that this router
            did not send (a tier's routers'): what its last two readings
            both showed beyond the router's count, the smaller (a reading
            lags a poll: the lines that just ended are in one of them).
        """
        board = self._board
        rid = replica.endpoint.id
        reading = board.reading(rid) if board is not None else None
        if reading is None or board is None or board.stale(rid, now):
            self._excess.pop(rid, None)
            return 0
        excess = reading.running + reading.waiting - replica.outstanding
        last = self._excess.get(rid)
        if last is None or last[0] != reading.read_at:
            before = last[2] if last is not None else excess
            self._excess[rid] = last = (reading.read_at, before, excess)
        return max(0, math.floor(min(last[1], last[2])))

    @staticmethod
    def _peak(state: _Model, now: float, interactive: int) -> int:
        """
        @return: the most interactive requests in flight seen over the
            last L{WINDOW} seconds, C{interactive} (now) counted.
        """
        peaks = state.peaks
        peaks.append((now, interactive))
        while peaks and peaks[0][0] < now - WINDOW:
            peaks.popleft()
        return max(n for _, n in peaks)

    # The share

    def record(self, record: RequestRecord) -> None:
        """
        A request finished: an interactive one's time to first token is
        kept, as run beside batch lines or without (a line in flight, or
        one that ended or was sent after it came).
        """
        if record.batch_id is not None:
            return
        ttft = record.time_to_first_token
        if record.status != 200 or ttft is None:
            return
        state = self._model(record.model)
        now = self._clock.seconds()
        if state.in_flight > 0 or state.last_line >= now - record.latency:
            state.beside.append((now, ttft))
        else:
            state.alone.append(ttft)

    def breached(self, model: str) -> bool:
        """
        @return: whether C{model}'s interactive requests of the last
            L{WINDOW} seconds took longer to their first token, at the
            median, than (1 + share) times those run without batch lines.
        """
        state = self._models.get(model)
        if state is None or len(state.alone) < LEAST_SAMPLES:
            return False
        since = self._clock.seconds() - WINDOW
        recent = [t for at, t in state.beside if at >= since]
        if len(recent) < LEAST_SAMPLES:
            return False
        return median(recent) > (1 + self._share) * median(state.alone)

    def _limit(
        self, model: str, state: _Model, now: float, capacity: float
    ) -> int | None:
        """
        @return: C{model}'s limit on lines in flight after the share's
            breaches (the module's docstring, part 2), or L{None}.
        """
        breached = False
        if now - state.limit_at >= WINDOW / 2 and self.breached(model):
            breached = True
            state.limit = state.in_flight // 2
            state.limit_at = now
            state.beside.clear()
        if not breached and state.limit is not None and now - state.limit_at >= WINDOW:
            state.limit = max(1, state.limit * 2)
            state.limit_at = now
            if state.limit > capacity:
                state.limit = None
        return state.limit
