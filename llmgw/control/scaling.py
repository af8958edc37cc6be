"""
Scaling policy as pure functions: how many replicas a model wants, how
that count follows load, which replicas go first when there are too
many, and how long a failing model waits.  No clock and no I/O: the
reconciler (L{llmgw.control.plane}) passes the time and the counts, and
applies and logs the answers.

How many replicas a model wants: C{min_replicas}, raised by traffic
(the first request for a model at zero activates it; requests in flight
per ready replica over C{scale_up_in_flight} add one, up to
C{max_replicas}) and lowered again by idleness (C{idle_timeout}).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from twisted.internet.defer import Deferred

from llmgw.control.catalog import Model
from llmgw.control.placement import NoFit
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.control.settings import ControlConfig


@dataclass
class ModelState:
    """
    What the control plane keeps per catalog model besides its replicas.

    @ivar wanted: replicas asked for by traffic (scale from zero, load),
        above C{min_replicas}.
    @ivar last_used: reactor seconds of the last use: a request's arrival
        or completion (the router touches the model at both).
    @ivar busy_at: reactor seconds when the load was last over half the
        scale-up threshold.
    @ivar failed_at: reactor seconds of the last failed replica.
    @ivar failures: replicas failed in a row.
    @ivar retry_at: reactor seconds before which nothing is placed.
    @ivar waiters: requests waiting for a ready replica.
    @ivar held: per one of C{waiters}, the reactor seconds its request
        came at and its priority number (L{llmgw.router.routing.fairness}: higher
        goes first).
    """

    model: Model
    wanted: int = 0
    last_used: float = 0.0
    busy_at: float = 0.0
    failed_at: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    no_fit: NoFit | None = None
    waiters: list[Deferred[None]] = field(default_factory=list)
    held: dict[Deferred[None], tuple[float, int]] = field(default_factory=dict)

    def oldest_wait(self) -> float | None:
        """
        @return: reactor seconds when the oldest request waiting came, or
            L{None} when none waits.
        """
        times = [self.held[d][0] for d in self.waiters if d in self.held]
        return min(times) if times else None

    def top_rank(self) -> int | None:
        """
        @return: the highest priority number among the requests waiting,
            or L{None} when none waits.
        """
        ranks = [self.held[d][1] for d in self.waiters if d in self.held]
        return max(ranks) if ranks else None


def bounded(model: Model, wanted: int) -> int:
    """
    @return: C{wanted} within the model's C{min_replicas} and
        C{max_replicas}.
    """
    return min(max(model.min_replicas, wanted), model.max_replicas)


def gone_idle(state: ModelState, now: float, busy: bool) -> bool:
    """
    @param now: reactor seconds.
    @param busy: whether any of the model's replicas has a request in
        flight.
    @return: whether the replicas traffic asked for are no longer wanted:
        above C{min_replicas}, nobody waiting, nothing in flight, and no
        request for C{idle_timeout} seconds (0: never idle).
    """
    model = state.model
    return (
        state.wanted > model.min_replicas
        and not state.waiters
        and model.idle_timeout > 0
        and now - state.last_used >= model.idle_timeout
        and not busy
    )


@dataclass(frozen=True)
class LoadStep:
    """
    What L{follow_load} decided.

    @ivar wanted: the model's new C{wanted}.
    @ivar busy_at: its new C{busy_at}.
    @ivar change: +1 (scale up), -1 (light load: scale down) or 0.
    """

    wanted: int
    busy_at: float
    change: int


def follow_load(
    state: ModelState,
    now: float,
    started: float,
    threshold: float,
    live: int,
    ready: int,
    in_flight: int,
) -> LoadStep:
    """
    Scale with traffic between C{min_replicas} and C{max_replicas}: one
    replica more while the requests in flight per ready replica are over
    C{threshold} (and none is still starting); one fewer after
    C{idle_timeout} with them under half of it.

    @param now: reactor seconds.
    @param started: reactor seconds when the control plane started (load
        is not light before it ran for C{idle_timeout}).
    @param threshold: C{[control] scale_up_in_flight}.
    @param live: the model's replicas not draining.
    @param ready: those of them ready.
    @param in_flight: requests in flight on the live replicas.
    """
    model = state.model
    wanted = min(state.wanted, model.max_replicas)
    busy_at = state.busy_at
    per_replica = in_flight / ready if ready else 0.0
    if per_replica > threshold / 2:
        busy_at = now
    current = max(model.min_replicas, wanted)
    if (
        per_replica > threshold
        and ready == live
        and live >= current
        and current < model.max_replicas
    ):
        return LoadStep(current + 1, busy_at, +1)
    if (
        wanted > max(model.min_replicas, 1)
        and model.idle_timeout > 0
        and now - max(busy_at, started) >= model.idle_timeout
    ):
        return LoadStep(wanted - 1, now, -1)
    return LoadStep(wanted, busy_at, 0)


def surplus(
    live: Sequence[ReplicaRecord], want: int, outstanding: Callable[[str], int]
) -> list[ReplicaRecord]:
    """
    @param live: a model's replicas not draining.
    @param want: how many it wants.
    @param outstanding: requests in flight by replica id.
    @return: the replicas to drain: those not ready first, then the least
        loaded, then the newest; none when C{live} is not over C{want}.
    """
    if len(live) <= want:
        return []
    order = sorted(
        live,
        key=lambda r: (r.state == ReplicaState.READY, outstanding(r.id), -r.created),
    )
    return order[: len(live) - want]


def recovered(state: ModelState, created: float) -> None:
    """
    A replica of the model created at C{created} (reactor seconds) is
    ready: if it started after the last failure, the failures are
    history.
    """
    if created >= state.failed_at:
        state.failures = 0
        state.last_error = ""


def failed(
    state: ModelState, now: float, error: str, lost: bool, settings: ControlConfig
) -> None:
    """
    A replica of the model failed at C{now} (reactor seconds) with
    C{error}.  A replica lost with its node is the node's fault: it is
    replaced at once.  Otherwise the model backs off (see L{backoff}).
    """
    state.last_error = error
    if lost:
        return
    state.failures += 1
    state.failed_at = now
    state.retry_at = now + backoff(
        settings.base_backoff, settings.max_backoff, state.failures
    )


def backoff(base: float, most: float, failures: int) -> float:
    """
    @param base: C{[control] base_backoff}, seconds.
    @param most: C{[control] max_backoff}, seconds.
    @param failures: failures in a row, at least 1.
    @return: seconds to wait before the next placement: C{base} doubled
        per failure after the first, at most C{most}.
    """
    # The exponent is capped: 2 ** 1024 overflows a float.
    return min(most, base * 2.0 ** min(failures - 1, 40))


def kept_after_adoption(model: Model, wanted: int, live: int) -> int:
    """
    @param wanted: the model's C{wanted} before.
    @param live: its replicas not draining, the adopted one included.
    @return: its C{wanted} after: what ran before a restart was wanted,
        so it is kept (not drained as surplus over C{min_replicas}) and
        left to the idle and load rules from now on.
    """
    return min(model.max_replicas, max(wanted, live))
