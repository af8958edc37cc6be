"""
Scaling a model (docs/catalog.md, "Scaling"): how many replicas it wants
now (L{scaling}: its bounds, its traffic, its idle time), and getting
there in a pass: surplus replicas retired (asleep or drained), missing
ones brought up (L{llmgw.control.placing}), leaving ones let go
(L{llmgw.control.drains}).  Also the operator's change of a model's
bounds.

The layer above bringing models up and the operator's drains; the plane's
pass calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control import scaling
from llmgw.control.actions import ReplicaActions
from llmgw.control.catalog import Model
from llmgw.control.drains import Drains
from llmgw.control.ledger import Ledger
from llmgw.control.placing import ScaleUp
from llmgw.control.publishing import Publisher
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.control.runtime import ModelCatalog, check_bounds
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.snapshot import Snapshot


class Scaler:
    """
    Keeps each model at the replicas it wants.

    @param clock: the reactor's clock.
    @param settings: the C{[control]} table.
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param publisher: told when a model's C{min_replicas} changed.
    @param actions: retires surplus replicas.
    @param scale_up: brings a model up.
    @param drains: lets leaving replicas go.
    @param outstanding: requests in flight to a replica id, by the
        router's count.
    @param kick: asks for one more pass.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        settings: ControlConfig,
        catalog: ModelCatalog,
        ledger: Ledger,
        publisher: Publisher,
        actions: ReplicaActions,
        scale_up: ScaleUp,
        drains: Drains,
        outstanding: Callable[[str], int],
        kick: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._catalog = catalog
        self._ledger = ledger
        self._publisher = publisher
        self._actions = actions
        self._scale_up = scale_up
        self._drains = drains
        self._outstanding = outstanding
        self._kick = kick

    def scale(self, name: str, min_replicas: int, max_replicas: int) -> Model:
        """
        Change a model's replica bounds.

        @raise KeyError: no such model.
        @raise ValueError: bounds out of order.
        """
        state = self._catalog.get(name)
        if state is None:
            raise KeyError(name)
        check_bounds(min_replicas, max_replicas)
        before = self.desired(state, self._clock.seconds())
        state.model = replace(
            state.model, min_replicas=min_replicas, max_replicas=max_replicas
        )
        # A lower min lets the model idle down (after idle_timeout); it
        # does not stop replicas in use now.  A lower max does.
        state.wanted = min(max(state.wanted, before), max_replicas)
        now = self._clock.seconds()
        # Idle time counts from the change.
        state.busy_at = max(state.busy_at, now)
        state.last_used = max(state.last_used, now)
        self._ledger.changes.model(name)
        self._publisher.bounds_changed(name)
        self._kick()
        return state.model

    def settled(self, name: str) -> bool:
        """
        @return: whether a pass would leave model C{name} as it is while
            nothing happens to it (L{llmgw.control.changes}).
        """
        state = self._catalog.get(name)
        replicas = list(self._ledger.of_model(name))
        if state is None:
            return not replicas
        model = state.model
        if (
            not self._ledger.grace.over
            or state.waiters
            or state.no_fit is not None
            or state.wanted > model.min_replicas
        ):
            return False
        awake = [r for r in replicas if not r.dormant]
        asleep = all(r.asleep for r in replicas if r.dormant)
        return (
            asleep
            and len(awake) == scaling.bounded(model, state.wanted)
            and all(
                r.draining_since is None
                and r.leaving_since is None
                and r.state == ReplicaState.READY
                and not self._outstanding(r.id)
                for r in awake
            )
        )

    def desired(
        self,
        state: ModelState,
        now: float,
        replicas: Sequence[ReplicaRecord] | None = None,
    ) -> int:
        """
        @param replicas: the model's replicas, when the caller has them.
        @return: the replicas C{state}'s model should have now (see
            L{scaling}); a model gone idle falls back to C{min_replicas}.
        """
        model = state.model
        if state.wanted > model.min_replicas and not state.waiters:
            if replicas is None:
                replicas = list(self._ledger.of_model(model.name))
            busy = any(self._outstanding(r.id) for r in replicas)
            if scaling.gone_idle(state, now, busy):
                self.log.info(
                    "model {model} idle for {seconds:g}s: scaling down to {count}",
                    model=model.name,
                    seconds=model.idle_timeout,
                    count=model.min_replicas,
                )
                state.wanted = 0
        return scaling.bounded(model, state.wanted)

    def _follow_load(
        self, state: ModelState, now: float, live: list[ReplicaRecord]
    ) -> None:
        model = state.model
        ready = sum(1 for r in live if r.state == ReplicaState.READY)
        in_flight = sum(self._outstanding(r.id) for r in live)
        step = scaling.follow_load(
            state,
            now,
            self._ledger.grace.started,
            self._settings.scale_up_in_flight,
            len(live),
            ready,
            in_flight,
        )
        state.wanted, state.busy_at = step.wanted, step.busy_at
        if step.change > 0:
            self.log.info(
                "model {model}: {in_flight} requests in flight on {ready} replicas:"
                " scaling up to {count}",
                model=model.name,
                in_flight=in_flight,
                ready=ready,
                count=state.wanted,
            )
        elif step.change < 0:
            self.log.info(
                "model {model}: light load for {seconds:g}s: scaling down to {count}",
                model=model.name,
                seconds=model.idle_timeout,
                count=max(model.min_replicas, state.wanted),
            )

    def scale_model(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot | None,
        replicas: list[ReplicaRecord],
    ) -> Snapshot | None:
        live = [r for r in replicas if r.draining_since is None and not r.dormant]
        dormant = [r for r in replicas if r.dormant]
        self._follow_load(state, now, live)
        want = self.desired(state, now, replicas)
        # Replicas leaving (L{drains}) serve on until replaced: placement
        # counts without them, and lets them go once it may.
        leaving = self._drains.leaving(live)
        if not self._ledger.grace.over:
            return snapshot
        staying = [r for r in live if r.leaving_since is None]
        if len(staying) > want:
            for replica in scaling.surplus(staying, want, self._outstanding):
                # A stream on it is never cut: it sleeps or leaves once its
                # last request ends (up to the router's total_timeout).
                self._actions.retire(
                    replica, f"{len(staying)} replicas, {want} wanted", "idle_sleep"
                )
        elif len(staying) == want:
            state.no_fit = None
        elif now >= state.retry_at:
            snapshot = self._scale_up.bring_up(
                state, now, snapshot, live, want, dormant
            )
        self._scale_up.dormant_over(state.model, live, dormant)
        if leaving:
            self._drains.let_go(state, want, leaving)
        return snapshot
