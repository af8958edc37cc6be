"""
Bringing a model up to the replicas it wants (docs/catalog.md, "Sleep"
and "Eviction"): wake a replica asleep where its GPUs have room (preferred
to a cold start); else, with requests held, make room (L{llmgw.control.swaps});
else place the replicas it lacks on the pass's snapshot, each taken at
once, and start them.  A model that fits nowhere keeps its L{NoFit}
(logged when it changes) and tries again after C{[control] base_backoff}.

The layer above making room; the plane's pass calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean

from twisted.logger import Logger

from llmgw.control.actions import ReplicaActions
from llmgw.control.catalog import Model
from llmgw.control.ledger import Ledger
from llmgw.control.placement import NoFit, Plan, place
from llmgw.control.records import ReplicaRecord
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.sleeping import SleepRoom, held_plan
from llmgw.control.snapshot import Snapshot, Snapshots
from llmgw.control.swaps import Swaps


class ScaleUp:
    """
    Brings models up: wakes, makes room, places.

    @param settings: the C{[control]} table.
    @param ledger: the records.
    @param ports: ports engines may listen on.
    @param actions: starts and wakes replicas, drains sleepers of no use.
    @param swaps: makes room for held models.
    @param room: whether a sleeper has room to wake.
    @param snapshots: the pass's placement snapshot.
    """

    log = Logger()

    def __init__(
        self,
        settings: ControlConfig,
        ledger: Ledger,
        ports: range,
        actions: ReplicaActions,
        swaps: Swaps,
        room: SleepRoom,
        snapshots: Snapshots,
    ) -> None:
        self._settings = settings
        self._ledger = ledger
        self._ports = ports
        self._actions = actions
        self._swaps = swaps
        self._room = room
        self._snapshots = snapshots

    def _wake_missing(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        asleep: Sequence[ReplicaRecord],
        missing: int,
    ) -> list[ReplicaRecord]:
        """
        Wake up to C{missing} of C{asleep} (its model's replicas asleep)
        where their GPUs have room, the most recently resident first.

        @return: those woken.
        """
        woken: list[ReplicaRecord] = []
        name = state.model.name
        for replica in sorted(asleep, key=lambda r: -r.resident_since):
            if len(woken) >= missing:
                break
            if (
                self._room.wake_room(replica, self._swaps.fleet_for(name, snapshot))
                is not None
            ):
                continue
            self._actions.wake(
                replica, now, "its model is wanted and its GPUs have room"
            )
            snapshot.take(held_plan(replica))
            woken.append(replica)
        if woken:
            state.no_fit = None
            self._swaps.done(name, placed=True)
        return woken

    def bring_up(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot | None,
        live: list[ReplicaRecord],
        want: int,
        dormant: list[ReplicaRecord],
    ) -> Snapshot:
        """
        Bring C{state}'s model up to C{want} replicas: wake those asleep
        whose GPUs have room (preferred to a cold start); with requests
        held and none of them with room, evict what lets one wake
        (L{llmgw.control.swaps}); place the rest (L{_place_missing}).
        """
        name = state.model.name
        if self._swaps.waits(name, now):
            return snapshot or self._snapshots.live()
        if snapshot is None:
            snapshot = self._snapshots.live()
        staying = sum(1 for r in live if r.leaving_since is None)
        # Those whose last wake was refused (gpus_in_use) wait their turn.
        refused = [r for r in dormant if r.asleep and now < r.wake_refused_until]
        asleep = [r for r in dormant if r.asleep and r not in refused]
        woken = self._wake_missing(state, now, snapshot, asleep, want - staying)
        if woken:
            live = live + woken
        elif asleep and self._snapshots.releases.pending(now) & {
            s.node for r in asleep for s in r.shards
        }:
            # Memory given back where it sleeps is not reported free yet: a
            # heartbeat or two, and it may wake (beats a cold start).
            return snapshot
        elif asleep and state.waiters and self._settings.evict:
            latest = max(asleep, key=lambda r: r.resident_since)
            # With a free place, only idle replicas are evicted for a wake,
            # and the model never waits for busy ones.
            spread = frozenset(s.node for r in live for s in r.shards)
            free = place(
                state.model.profiles,
                self._swaps.fleet_for(name, snapshot),
                self._ports,
                spread,
            )
            if self._swaps.evict_for_wake(
                state, now, snapshot, latest, idle_only=isinstance(free, Plan)
            ):
                return snapshot
        elif (
            not asleep
            and any(not r.asleep for r in dormant)
            and state.waiters
            and self._falling_asleep(state, now)
        ):
            # Going to sleep (evicted, its requests ending): a wake once it
            # sleeps beats a cold start, as above.
            return snapshot
        elif (
            refused
            and not woken
            and self._refused_in_the_way(state, snapshot, live, refused)
        ):
            # Its GPUs are held by an engine placement does not see: a start
            # going there would be refused too; its wake is tried again.
            return snapshot
        if staying + len(woken) >= want:
            return snapshot
        return self._place_missing(state, now, snapshot, live, want)

    def _refused_in_the_way(
        self,
        state: ModelState,
        snapshot: Snapshot,
        live: list[ReplicaRecord],
        refused: list[ReplicaRecord],
    ) -> bool:
        """
        @param refused: C{state}'s model's sleepers whose wake was refused
            and who wait to be tried again.
        @return: whether a replica of the model placed now would go on
            GPUs of one of C{refused} (they look free to placement), or
            has no place: then the model waits for their next try rather
            than start one.
        """
        held = {(s.node, g) for r in refused for s in r.shards for g in s.gpus}
        spread = frozenset(s.node for r in live for s in r.shards)
        fleet = self._swaps.fleet_for(state.model.name, snapshot)
        plan = place(state.model.profiles, fleet, self._ports, spread)
        if not isinstance(plan, Plan):
            return True
        return any((s.node, g) in held for s in plan.shards for g in s.gpus)

    def _falling_asleep(self, state: ModelState, now: float) -> bool:
        """
        @return: whether C{state}'s model, whose replicas are dormant but
            none asleep yet, waits for one to fall asleep: its oldest held
            request has waited less than the model's mean cold start.
        """
        starts = self._ledger.counts.cold_start_seconds.get(state.model.name)
        oldest = state.oldest_wait()
        if not starts or oldest is None:
            return False
        return now - oldest < mean(starts)

    def dormant_over(
        self, model: Model, live: list[ReplicaRecord], dormant: list[ReplicaRecord]
    ) -> None:
        """
        Stop the dormant replicas of C{model} that are of no use: all of
        them when its C{max_replicas} is 0, and those on GPUs where one of
        its replicas is awake or a more recently resident one sleeps.
        """
        taken = {(s.node, g) for r in live for s in r.shards for g in s.gpus}
        for replica in sorted(dormant, key=lambda r: -r.resident_since):
            places = {(s.node, g) for s in replica.shards for g in s.gpus}
            if model.max_replicas == 0 or places & taken:
                self._actions.drain(replica, "asleep where it is not needed")
            taken |= places

    def _place_missing(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot | None,
        live: list[ReplicaRecord],
        want: int,
    ) -> Snapshot:
        """
        Place the replicas C{state}'s model lacks: C{want} less those of
        C{live} staying (not leaving).  One with requests held that fits
        nowhere has room made for it (L{llmgw.control.swaps}), and waits
        for its eviction's victims to go.
        """
        name = state.model.name
        if self._swaps.waits(name, now):
            return snapshot or self._snapshots.live()
        if snapshot is None:
            snapshot = self._snapshots.live()
        spread = {s.node for r in live for s in r.shards}
        staying = sum(1 for r in live if r.leaving_since is None)
        for _ in range(want - staying):
            result = place(
                state.model.profiles,
                self._swaps.fleet_for(name, snapshot),
                self._ports,
                frozenset(spread),
            )
            if isinstance(result, NoFit):
                if self._swaps.releasing(name, now, snapshot.fleet) or (
                    state.waiters and self._snapshots.releases.pending(now)
                ):
                    # Its victims are gone, or memory was given back, and
                    # the GPUs have not said so yet: nothing is evicted for
                    # a held request for a heartbeat or two.
                    state.retry_at = now + self._settings.interval
                    break
                self._swaps.done(name, placed=False)
                if self._swaps.evict_for(
                    state, now, snapshot, frozenset(spread), result
                ):
                    state.no_fit = result
                    break
                self._ledger.counts.no_fit(result.lines())
                if state.no_fit != result:
                    state.last_error = "no place for a replica: " + "; ".join(
                        result.lines()[:3]
                    )
                    self.log.warn(
                        "model {model}: no place for a replica: {why}",
                        model=state.model.name,
                        why="; ".join(result.lines()),
                    )
                state.no_fit = result
                backoff = self._settings.base_backoff
                if state.waiters and self._settings.evict:
                    # Room may be made soon (min_resident, a stream ending).
                    backoff = min(backoff, self._settings.interval)
                state.retry_at = now + backoff
                break
            state.no_fit = None
            self._swaps.done(name, placed=True)
            self._actions.start(state.model, result, now)
            snapshot.take(result)
            spread.update(s.node for s in result.shards)
        return snapshot
