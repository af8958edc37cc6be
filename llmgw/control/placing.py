"""
Placing (L{llmgw.control.plane}): the replicas a model lacks placed on the
pass's snapshot, each taken at once, and started; a model that fits
nowhere keeps its L{NoFit} (logged when it changes) and tries again after
C{[control] base_backoff}.  Part of L{llmgw.control.plane.ControlPlane},
kept apart by job.
"""

from __future__ import annotations

from twisted.logger import Logger

from llmgw.control.catalog import Model
from llmgw.control.commands import ShardCommands
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Fleet, NoFit, Plan, place
from llmgw.control.publishing import host
from llmgw.control.records import PlaneCounts, ReplicaRecord, ShardRecord
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.snapshot import Snapshot


class Placing:
    """
    The placing half of L{llmgw.control.plane.ControlPlane}, which provides
    the attributes declared here.
    """

    log: Logger
    inventory: Inventory
    settings: ControlConfig
    ports: range
    counts: PlaneCounts
    _commands: ShardCommands

    def _record(self, replica: ReplicaRecord, shard: ShardRecord | None) -> None:
        raise NotImplementedError()

    def _live_snapshot(self) -> Snapshot:
        raise NotImplementedError()

    def _fleet_for(self, name: str, snapshot: Snapshot) -> Fleet:
        raise NotImplementedError()

    def _swap_waits(self, name: str, now: float) -> bool:
        raise NotImplementedError()

    def _swap_done(self, name: str, placed: bool) -> None:
        raise NotImplementedError()

    def _evict_for(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        spread: frozenset[str],
        no_fit: NoFit,
    ) -> bool:
        raise NotImplementedError()

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
        if self._swap_waits(name, now):
            return snapshot or self._live_snapshot()
        if snapshot is None:
            snapshot = self._live_snapshot()
        spread = {s.node for r in live for s in r.shards}
        staying = sum(1 for r in live if r.leaving_since is None)
        for _ in range(want - staying):
            result = place(
                state.model.profiles,
                self._fleet_for(name, snapshot),
                self.ports,
                frozenset(spread),
            )
            if isinstance(result, NoFit):
                self._swap_done(name, placed=False)
                if self._evict_for(state, now, snapshot, frozenset(spread), result):
                    state.no_fit = result
                    break
                self.counts.no_fit(result.lines())
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
                backoff = self.settings.base_backoff
                if state.waiters and self.settings.evict:
                    # Room may be made soon (min_resident, a stream ending).
                    backoff = min(backoff, self.settings.interval)
                state.retry_at = now + backoff
                break
            state.no_fit = None
            self._swap_done(name, placed=True)
            self._start(state.model, result, now)
            snapshot.take(result)
            spread.update(s.node for s in result.shards)
        return snapshot

    def _start(self, model: Model, plan: Plan, now: float) -> None:
        leader = plan.shards[0]
        node = self.inventory.get(leader.node)
        port = plan.rendezvous_port or leader.port
        address = f"{host(node.address)}:{port}" if node is not None else ""
        replica = self._commands.start(model.name, plan, now, address)
        self.counts.started(model.name)
        self._record(replica, None)
        for shard in replica.shards:
            self._record(replica, shard)
