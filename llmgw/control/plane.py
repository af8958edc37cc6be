"""
The control plane (docs/architecture.md, "The control loop"): desired
replicas per catalog
model against what the agents run, kept in step by one reconciler loop.
This module is the orchestration; the policy is in pure modules beside
it: L{scaling} (how many replicas), L{adoption} (what a Register's shards
become), L{placement} over a L{snapshot} (where), and the records in
L{records}.

Each pass: node states from their agents' silence; replicas whose shards
failed, whose nodes are lost or that never became ready are dropped (their
other shards stopped) and their model backs off; each model gets placed
what it lacks and drained what it has too many of; draining replicas are
stopped once their requests in flight are done; the ready replicas are
published to the router.

A drain is the server's alone: the replica is unpublished at once (no new
requests), and its shards are told C{StopShard} once the router counts
no request in flight to it, or after C{[control] drain_timeout}; only
the server knows what is in flight.  An operator's drain first lets the
replica I{leave} (L{drains}): it serves until a replacement placed
elsewhere is ready.

A pass looks at what changed, not at everything (L{changes}): the models
events named (a shard status, a drain, a scale, a request touching the
model), those not yet settled (placing, starting, draining, scaled by
traffic), the nodes that may have gone silent (by when they were last
heard) or were heard or changed; its placement snapshot is kept from pass
to pass and refreshed for the nodes that changed
(L{snapshot.LiveSnapshot}).  Catalog changes and the end of the start-up
grace make one pass over everything.

Shard statuses and registrations arrive from the agent links between
passes (L{ControlPlane.shard_status}, L{ControlPlane.node_registered}) and
kick a pass.  Nothing here blocks: commands to agents are sent and their
results handled when they come.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control import scaling
from llmgw.control.catalog import Model
from llmgw.control.changes import Changes
from llmgw.control.commands import Commands, ShardCommands
from llmgw.control.drains import Draining
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.loop import Loop
from llmgw.control.operating import Operating
from llmgw.control.placement import NodeView
from llmgw.control.placing import Placing
from llmgw.control.publishing import Publishing
from llmgw.control.records import (
    PlaneCounts,
    ReplicaRecord,
    ReplicaState,
    ShardRecord,
)
from llmgw.control.reports import AgentReports
from llmgw.control.runtime import ModelCatalog, check_bounds
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.snapshot import (
    LiveSnapshot,
    Snapshot,
    Strays,
    SuspectPorts,
    warn_ephemeral,
)
from llmgw.control.swaps import Swapping
from llmgw.control.weights import WeightsCollector
from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.wire.states import ShardState

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


def _gone_why(replica: ReplicaRecord) -> str:
    """
    @return: why a replica's requests in flight are cut, in words fit for a
        client (no node names or addresses).
    """
    states = {s.state for s in replica.shards}
    if ShardState.LOST in states:
        return "its node was lost"
    if ShardState.FAILED in states:
        return "its engine exited"
    return "it stopped"


class ControlPlane(AgentReports, Publishing, Draining, Operating, Swapping, Placing):
    """
    Keeps each catalog model's replicas running.

    @param clock: the reactor's clock.
    @param inventory: the nodes, as their agents describe them.
    @param commands: sends commands to agents.
    @param models: the catalog.
    @param settings: the C{[control]} table.
    @param publish: called with the router's new endpoint list when it
        changes.
    @param publish_shortfalls: called with the catalog models below their
        C{min_replicas} (L{Shortfall}s, by name) when they change.
    @param static: endpoints from the configuration, always published.
    @param outstanding: requests in flight to a replica id, by the router's
        count; a draining replica is stopped when it reaches 0.
    @param keys: a shard id's engine secret (L{ShardCommands}), "" for none.
    @param cut: ends the router's requests in flight to a replica id now,
        with a reason (L{llmgw.router.routing.balancer.Balancer.cut}): called when
        the replica is gone (its node lost, its engine exited) or its drain
        ran out of time.
    @param touched: whether the router touches a model
        (L{ModelCatalog.touch}) at each request's arrival and completion,
        as L{llmgw.router} does: then a pass reads requests in flight only
        for the models touched or unsettled (L{llmgw.control.changes});
        else it asks every replica's C{outstanding} each pass.
    @param leave_timeout: seconds a replica leaving by scale-down,
        eviction or sleep waits for its requests in flight to end (the
        router's C{total_timeout}; 0: no bound); an operator's drain
        waits C{[control] drain_timeout}.
    @param tracer: the control plane's spans (L{llmgw.control.spans}),
        or L{None} without C{[tracing]}.
    @ivar catalog: the catalog at run time, and the router's side.
    @ivar replicas: the records, by replica id; read-only outside.
    @ivar failed: each model's last failed replica, with its error and
        its engines' output, until the model has a ready replica again (or
        leaves the catalog); read-only outside.
    @ivar weights: finds and deletes model files nothing uses.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        inventory: Inventory,
        commands: Commands,
        models: Sequence[Model],
        settings: ControlConfig,
        publish: Callable[[list[Endpoint]], None],
        static: Sequence[Endpoint] = (),
        outstanding: Callable[[str], int] = lambda replica_id: 0,
        keys: Callable[[str], str] = lambda shard_id: "",
        cut: Callable[[str, str], object] = lambda replica_id, why: 0,
        touched: bool = False,
        publish_shortfalls: Callable[[tuple[Shortfall, ...]], None] = lambda s: None,
        leave_timeout: float = 1800.0,
        tracer: Tracer | None = None,
    ) -> None:
        self.clock = clock
        self.tracer = tracer
        self.leave_timeout = leave_timeout if leave_timeout > 0 else float("inf")
        self.inventory = inventory
        self.commands = commands
        self.settings = settings
        self._publish = publish
        self._publish_shortfalls = publish_shortfalls
        self._outstanding = outstanding
        self._cut = cut
        self.loop = Loop(clock, settings.interval, self.reconcile, name="reconciler")
        self._changes = Changes()
        self.catalog = ModelCatalog(
            clock, inventory, models, static, self._catalog_changed
        )
        self._touched = touched
        self.catalog.touched = self._changes.model
        self.replicas: dict[str, ReplicaRecord] = {}
        # Indexes of the records: by model, by node, and the order they
        # were made in.
        self._by_model: dict[str, dict[str, ReplicaRecord]] = {}
        self._on_node: dict[str, dict[str, tuple[ReplicaRecord, ShardRecord]]] = {}
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()
        self._live: LiveSnapshot | None = None
        self.failed: dict[str, ReplicaRecord] = {}
        self._shards: dict[str, tuple[ReplicaRecord, ShardRecord]] = {}
        self._published: tuple[Endpoint, ...] | None = None
        self._suspect = SuspectPorts()
        self._strays = Strays()
        self._commands = ShardCommands(
            clock, commands, self._suspect, self.loop.kick, strays=self._strays
        )
        self._commands.engine_key = keys
        self._views: dict[str, tuple[Any, NodeView]] = {}
        self.ports = range(settings.port_range[0], settings.port_range[1] + 1)
        warn_ephemeral(self.ports)
        self.started = clock.seconds()
        self.grace_over = settings.startup_grace <= 0
        self.weights = WeightsCollector(inventory, commands, self._weights_in_use)
        self.counts = PlaneCounts()
        self._init_publishing()
        self._init_swapping()

    def begin_grace(self) -> None:
        """
        The start-up grace begins afresh now (a standby taking the lead):
        no placements and no scale-down for C{[control] startup_grace},
        while the agents' Registers adopt their engines.
        """
        self.started = self.clock.seconds()
        self.grace_over = self.settings.startup_grace <= 0

    def _catalog_changed(self) -> None:
        self._changes.all()
        self.loop.kick()

    def _record(self, replica: ReplicaRecord, shard: ShardRecord | None) -> None:
        """
        Index C{replica} (and C{shard}, one of its shards) as recorded.
        """
        self.replicas[replica.id] = replica
        self._by_model.setdefault(replica.model, {})[replica.id] = replica
        if replica.id not in self._seq:
            self._seq[replica.id] = next(self._counter)
        self._changes.model(replica.model)
        if shard is not None:
            self._shards[shard.id] = (replica, shard)
            self._on_node.setdefault(shard.node, {})[shard.id] = (replica, shard)
            self._changes.nodes.add(shard.node)

    def _shards_on(self, node_id: str) -> Iterable[tuple[ReplicaRecord, ShardRecord]]:
        return self._on_node.get(node_id, {}).values()

    # The catalog at run time.

    def scale(self, name: str, min_replicas: int, max_replicas: int) -> Model:
        """
        Change a model's replica bounds.

        @raise KeyError: no such model.
        @raise ValueError: bounds out of order.
        """
        state = self.catalog.get(name)
        if state is None:
            raise KeyError(name)
        check_bounds(min_replicas, max_replicas)
        before = self.desired(state, self.clock.seconds())
        state.model = replace(
            state.model, min_replicas=min_replicas, max_replicas=max_replicas
        )
        # A lower min lets the model idle down (after idle_timeout); it
        # does not stop replicas in use now.  A lower max does.
        state.wanted = min(max(state.wanted, before), max_replicas)
        now = self.clock.seconds()
        # Idle time counts from the change.
        state.busy_at = max(state.busy_at, now)
        state.last_used = max(state.last_used, now)
        self._changes.model(name)
        self._bounds_changed(name)
        self.loop.kick()
        return state.model

    def _weights_in_use(self) -> Iterable[tuple[str, str]]:
        for state in self.catalog.states():
            for profile in state.model.profiles:
                yield profile.source, state.model.name
        for replica in self.replicas.values():
            yield replica.profile.source, replica.id

    # The pass.

    def reconcile(self) -> None:
        """
        One pass; see the module's docstring.  It looks at the models and
        nodes that changed, or that may change by themselves (see
        L{llmgw.control.changes}).
        """
        now = self.clock.seconds()
        changes = self._changes
        if not self.grace_over and now - self.started >= self.settings.startup_grace:
            self.grace_over = True
            changes.all()
        everything, changes.everything = changes.everything, False
        work, changes.models = changes.models | changes.unsettled, set()
        if everything:
            work.update(self._by_model)
            work.update(s.model.name for s in self.catalog.states())
            self._live = None
            self._unpublished = None
        for node_id in self._update_nodes(now, everything):
            work.update(r.model for r, _ in self._shards_on(node_id))
        if not self._touched:
            work.update(
                r.model for r in self.replicas.values() if self._outstanding(r.id)
            )
        replicas = sorted(
            (r for m in work for r in self._by_model.get(m, {}).values()),
            key=lambda r: self._seq[r.id],
        )
        for replica in replicas:
            changes.nodes.update(s.node for s in replica.shards)
            self._republish(replica.id)
            try:
                self._check(replica, now)
            except Exception:
                # One bad record must not stall every model.
                self.log.failure("checking replica {replica}", replica=replica.id)
        for name in [m for m in self.failed if m not in self.catalog]:
            del self.failed[name]
        snapshot: Snapshot | None = None
        # Models with requests held first, in swap queue order (held_order).
        for name in sorted(
            (m for m in work if m in self.catalog),
            key=lambda m: (self._held_order(m), self.catalog.position(m)),
        ):
            state = self.catalog[name]
            try:
                snapshot = self._scale(
                    state, now, snapshot, list(self._by_model.get(name, {}).values())
                )
            except Exception:
                self.log.failure("scaling model {model}", model=state.model.name)
                snapshot = None
                self._live = None
        for replica in replicas:
            if self.replicas.get(replica.id) is not replica:
                continue
            if replica.draining_since is None:
                why = self._drain_due(replica)
                if why is not None:
                    self._drain(replica, why)
            if replica.draining_since is not None:
                self._finish_drain(replica, now)
            elif replica.sleep_at is not None:
                self._finish_sleep(replica, now)
        self._publish_ready()
        changes.unsettled = {m for m in work if not self._settled(m)}

    def _settled(self, name: str) -> bool:
        """
        @return: whether a pass would leave model C{name} as it is while
            nothing happens to it (L{llmgw.control.changes}).
        """
        state = self.catalog.get(name)
        replicas = self._by_model.get(name)
        if state is None:
            return not replicas
        model = state.model
        if (
            not self.grace_over
            or state.waiters
            or state.no_fit is not None
            or state.wanted > model.min_replicas
        ):
            return False
        awake = [r for r in (replicas or {}).values() if not r.dormant]
        asleep = all(r.asleep for r in (replicas or {}).values() if r.dormant)
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

    def _update_nodes(self, now: float, everything: bool) -> list[str]:
        """
        Node states from their agents' silence: every node's, or those
        that may have gone silent, were heard or changed.

        @return: the ids of the nodes whose state changed.
        """
        settings = self.settings
        touched, self.inventory.touched = self.inventory.touched, set()
        self._changes.nodes.update(touched)
        if everything:
            nodes = self.inventory.nodes()
        else:
            # Silent for unreachable_after or more: heard at or before
            # now - unreachable_after (silence counts from start at most).
            silent = self.inventory.heard_by(now - settings.unreachable_after)
            if now - self.started < settings.unreachable_after:
                silent = []
            found = {n.id: n for n in silent}
            for node_id in touched:
                node = self.inventory.get(node_id)
                if node is not None:
                    found[node_id] = node
            nodes = [found[k] for k in sorted(found)]
        changed = []
        for node in nodes:
            silent_for = now - max(node.heard, self.started)
            state = NodeState.of_silence(
                silent_for, settings.unreachable_after, settings.lost_after
            )
            if state != node.state:
                log = self.log.warn if state != NodeState.READY else self.log.info
                log(
                    "node {node} is {state} (silent {seconds:.0f}s)",
                    node=node.id,
                    state=state,
                    seconds=silent_for,
                )
                node.state = state
                changed.append(node.id)
                self._changes.nodes.add(node.id)
        return changed

    def _check(self, replica: ReplicaRecord, now: float) -> None:
        for shard in replica.shards:
            node = self.inventory.get(shard.node)
            if not shard.state.gone and (node is None or node.state == NodeState.LOST):
                shard.state = ShardState.LOST
                shard.error = f"node {shard.node} is lost"
        if replica.draining_since is not None:
            if all(s.state.gone for s in replica.shards):
                self._forget(replica, _gone_why(replica))
            return
        model = self.catalog.get(replica.model)
        if replica.state == ReplicaState.READY:
            if replica.ready_at is None:
                replica.ready_at = now
                if not replica.adopted:
                    seconds = now - replica.created
                    self.counts.observed("cold_start", replica.model, seconds)
            if model is not None:
                scaling.recovered(model, replica.created)
            gone = self.failed.get(replica.model)
            if gone is not None and gone.created <= replica.created:
                # Replaced: the failure is history.
                del self.failed[replica.model]
            return
        error, lost = replica.fault(now, self.settings.start_timeout)
        if not error:
            return
        self.log.warn(
            "replica {replica} of {model} failed: {error}",
            replica=replica.id,
            model=replica.model,
            error=error,
        )
        self.counts.failed(replica.model)
        if model is not None:
            scaling.failed(
                model, now, f"replica {replica.id}: {error}", lost, self.settings
            )
        for shard in replica.shards:
            if not shard.state.gone:
                self._commands.stop(shard.node, shard.id, shard)
        self._forget(replica, _gone_why(replica))
        # Shown with its error and output until the model is served again.
        replica.error = error
        if model is not None:
            self.failed[replica.model] = replica

    def _forget(self, replica: ReplicaRecord, why: str = "it stopped") -> None:
        if self._outstanding(replica.id):
            # Its engine is gone or going: what is in flight to it ends
            # now, not at the router's idle deadline.
            self._cut(replica.id, why)
        self.replicas.pop(replica.id, None)
        models = self._by_model.get(replica.model, {})
        if models.get(replica.id) is replica:
            del models[replica.id]
            if not models:
                del self._by_model[replica.model]
            self._seq.pop(replica.id, None)
        self._changes.model(replica.model)
        self._republish(replica.id)
        for shard in replica.shards:
            self._changes.nodes.add(shard.node)
            if self._shards.get(shard.id, (None, None))[1] is shard:
                del self._shards[shard.id]
                self._on_node.get(shard.node, {}).pop(shard.id, None)

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
                replicas = [r for r in self.replicas.values() if r.model == model.name]
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
            self.started,
            self.settings.scale_up_in_flight,
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

    def snapshot(self) -> Snapshot:
        """
        @return: the inventory as placement sees it now.
        """
        return Snapshot(
            self.inventory.nodes(),
            self.replicas.values(),
            self._suspect.current(self.clock.seconds()),
            self._views,
            self._strays.held(self.clock.seconds()),
        )

    def _live_snapshot(self) -> Snapshot:
        """
        @return: the snapshot kept from pass to pass, its nodes that
            changed worked out again (L{LiveSnapshot}).
        """
        now = self.clock.seconds()
        changed, self._changes.nodes = self._changes.nodes, set()
        # Before they expire: a node whose mark expires changes too.
        changed |= self._suspect.nodes() | self._strays.nodes()
        suspect = self._suspect.current(now)
        strays = self._strays.held(now)
        live = self._live
        if live is None or not live.refresh(
            self.inventory, changed, self._shards_on, suspect, strays, self._views
        ):
            live = self._live = LiveSnapshot(
                self.inventory.nodes(),
                self.replicas.values(),
                suspect,
                self._views,
                strays,
            )
        return live

    def _scale(
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
        leaving = self._leaving(live)
        if not self.grace_over:
            return snapshot
        staying = [r for r in live if r.leaving_since is None]
        if len(staying) > want:
            for replica in scaling.surplus(staying, want, self._outstanding):
                # A stream on it is never cut: it sleeps or leaves once its
                # last request ends (up to the router's total_timeout).
                self._retire(
                    replica, f"{len(staying)} replicas, {want} wanted", "idle_sleep"
                )
        elif len(staying) == want:
            state.no_fit = None
        elif now >= state.retry_at:
            snapshot = self._place_or_wake(state, now, snapshot, live, want, dormant)
        self._dormant_over(state.model, live, dormant)
        if leaving:
            self._let_go(state, want, leaving)
        return snapshot
