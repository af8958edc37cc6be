"""
The control plane (docs/architecture.md, "The control loop"): desired
replicas per catalog model against what the agents run, kept in step by
one reconciler loop.  This module is the orchestration; the policy is in
pure modules beside it: L{scaling} (how many replicas), L{adoption} (what
a Register's shards become), L{placement} over a L{snapshot} (where), and
the records in L{records}.

Each pass: node states from their agents' silence; replicas whose shards
failed, whose nodes are lost or that never became ready are dropped (their
other shards stopped) and their model backs off; each model gets placed
what it lacks and drained what it has too many of; draining replicas are
stopped once their requests in flight are done; the ready replicas are
published to the router.

A drain is the server's alone (L{actions}): only it knows what is in
flight.  An operator's drain first lets the replica I{leave} (L{drains}).

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

The plane is built of parts, each constructed here with exactly the parts
it calls, in one-way layers (docs/architecture.md, "The control plane's
layers"; C{tests/test_architecture.py} checks the imports): the records
(L{ledger}), the publisher (L{publishing}) and what sleepers take
(L{sleeping}); the replica actions (L{actions}); making room (L{swaps});
bringing a model up (L{placing}); the operator's drains (L{drains}) and
sleep, wake and pin (L{operating}), and the agents' reports
(L{reports}).  This module is the wiring and the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control import scaling
from llmgw.control.actions import ReplicaActions
from llmgw.control.catalog import Model
from llmgw.control.commands import Commands, ShardCommands
from llmgw.control.drains import Drains
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.ledger import Grace, Ledger
from llmgw.control.loop import Loop
from llmgw.control.operating import Operator
from llmgw.control.placing import ScaleUp
from llmgw.control.publishing import Publisher
from llmgw.control.records import PlaneCounts, ReplicaRecord, ReplicaState
from llmgw.control.reports import AgentReports
from llmgw.control.runtime import ModelCatalog
from llmgw.control.scaler import Scaler
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.sleeping import SleepRoom
from llmgw.control.snapshot import Snapshot, Snapshots, warn_ephemeral
from llmgw.control.swaps import Swap, Swaps
from llmgw.control.weights import WeightsCollector
from llmgw.router.interfaces import Endpoint, Shortfall, Standing
from llmgw.wire import agent_pb2 as pb
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


class ControlPlane:
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
    @param interactive: of those, clients' (no batch line): what makes a
        replica busy for an eviction; by default all.
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
    @param held_bound: requests that may be held per model across the
        fleet (C{[router] activation_queue}); past it the lowest
        priority's newest is refused (L{ModelCatalog.activate}); L{None}
        for no bound.
    The wiring of its parts (docs/architecture.md, "The control plane's
    layers"), each built here with the parts it calls, plus the pass
    (L{reconcile}); its public methods are those of its parts.

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
        interactive: Callable[[str], int] | None = None,
        keys: Callable[[str], str] = lambda shard_id: "",
        cut: Callable[[str, str], object] = lambda replica_id, why: 0,
        touched: bool = False,
        publish_shortfalls: Callable[[tuple[Shortfall, ...]], None] = lambda s: None,
        leave_timeout: float = 1800.0,
        tracer: Tracer | None = None,
        held_bound: int | None = None,
    ) -> None:
        self.clock = clock
        self.inventory = inventory
        self.commands = commands
        self._settings = settings
        self._outstanding = outstanding
        self._interactive = interactive or outstanding
        self._cut = cut
        self._touched = touched
        self.ledger = ledger = Ledger(Grace(clock.seconds(), settings.startup_grace))
        self.loop = Loop(clock, settings.interval, self.reconcile, name="reconciler")
        self.catalog = catalog = ModelCatalog(
            clock,
            inventory,
            models,
            static,
            self._catalog_changed,
            touched=ledger.changes.model,
            adapters_changed=self._adapters_changed,
            standing=self._standing,
            bound=held_bound,
        )
        self._snapshots = snapshots = Snapshots(clock, inventory, ledger)
        self._commands = shard_commands = ShardCommands(
            clock,
            commands,
            snapshots.suspect,
            self.loop.kick,
            engine_key=keys,
            strays=snapshots.strays,
        )
        self._ports = range(settings.port_range[0], settings.port_range[1] + 1)
        warn_ephemeral(self._ports)
        self.weights = WeightsCollector(inventory, commands, self._weights_in_use)
        self._publisher = publisher = Publisher(
            inventory,
            catalog,
            ledger,
            keys,
            publish,
            publish_shortfalls,
        )
        self._build_parts(
            shard_commands, publisher, outstanding, cut, leave_timeout, tracer
        )

    def _build_parts(
        self,
        shard_commands: ShardCommands,
        publisher: Publisher,
        outstanding: Callable[[str], int],
        cut: Callable[[str, str], object],
        leave_timeout: float,
        tracer: Tracer | None,
    ) -> None:
        """
        Build the parts above the records and the publisher, lowest first,
        each with the parts it calls (docs/architecture.md, "The control
        plane's layers").
        """
        clock, settings, inventory = self.clock, self.settings, self.inventory
        catalog, ledger, snapshots = self.catalog, self.ledger, self._snapshots
        self._room = room = SleepRoom(inventory, ledger)
        self._actions = actions = ReplicaActions(
            clock,
            settings,
            inventory,
            catalog,
            ledger,
            publisher,
            shard_commands,
            room,
            self.loop.kick,
            outstanding,
            cut,
            leave_timeout if leave_timeout > 0 else float("inf"),
            tracer,
        )
        self._swaps = swaps = Swaps(
            clock,
            settings,
            inventory,
            catalog,
            ledger,
            self.ports,
            actions,
            room,
            self._interactive,
        )
        self._scale_up = ScaleUp(
            settings, ledger, self.ports, actions, swaps, room, snapshots
        )
        self._drains = Drains(
            clock,
            inventory,
            catalog,
            ledger,
            actions,
            snapshots,
            self.ports,
            self.loop.kick,
        )
        self._scaler = Scaler(
            clock,
            settings,
            catalog,
            ledger,
            publisher,
            actions,
            self._scale_up,
            self._drains,
            outstanding,
            self.loop.kick,
        )
        self._operator = Operator(
            clock, catalog, ledger, room, actions, swaps, snapshots, self.loop.kick
        )
        self._reports = AgentReports(
            clock,
            catalog,
            ledger,
            shard_commands,
            snapshots.strays,
            self.loop.kick,
            tracer,
        )

    # What the parts keep, read outside.

    @property
    def settings(self) -> ControlConfig:
        """The C{[control]} table its parts were built with."""
        return self._settings

    @property
    def ports(self) -> range:
        """The ports engines may listen on (C{[control] port_range})."""
        return self._ports

    @property
    def replicas(self) -> dict[str, ReplicaRecord]:
        """The records, by replica id; read-only outside."""
        return self.ledger.replicas

    @property
    def failed(self) -> dict[str, ReplicaRecord]:
        """
        Each model's last failed replica (L{Ledger.failed}); read-only
        outside.
        """
        return self.ledger.failed

    @property
    def counts(self) -> PlaneCounts:
        """What the plane did since it started."""
        return self.ledger.counts

    @property
    def swaps(self) -> dict[str, Swap]:
        """The evictions under way, by held model (L{Swaps.swaps})."""
        return self._swaps.swaps

    @property
    def evicted(self) -> dict[str, tuple[str, float]]:
        """Per held model, the words of its last eviction and when."""
        return self._swaps.evicted

    @property
    def started(self) -> float:
        """Reactor seconds when the start-up grace began."""
        return self.ledger.grace.started

    @property
    def grace_over(self) -> bool:
        """Whether the start-up grace is over."""
        return self.ledger.grace.over

    @property
    def leave_timeout(self) -> float:
        """
        Seconds a replica leaving by scale-down, eviction or sleep waits for
        its requests in flight to end.
        """
        return self._actions.leave_timeout

    def begin_grace(self) -> None:
        """
        The start-up grace begins afresh now (a standby taking the lead):
        no placements and no scale-down for C{[control] startup_grace},
        while the agents' Registers adopt their engines.
        """
        self.ledger.grace.begin(self.clock.seconds())

    # The parts' public methods.

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """See L{AgentReports.shard_status}."""
        self._reports.shard_status(node_id, status)

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        """See L{AgentReports.node_registered}."""
        self._reports.node_registered(node_id, register)

    def drain_node(self, node_id: str, force: bool = False) -> list[str]:
        """See L{Drains.drain_node}."""
        return self._drains.drain_node(node_id, force)

    def undrain_node(self, node_id: str) -> None:
        """See L{Drains.undrain_node}."""
        self._drains.undrain_node(node_id)

    def drain_replica(self, replica_id: str, force: bool = False) -> bool:
        """See L{Drains.drain_replica}."""
        return self._drains.drain_replica(replica_id, force)

    def stop_engines(self, node_ids: Sequence[str]) -> list[str]:
        """See L{Drains.stop_engines}."""
        return self._drains.stop_engines(node_ids)

    def start_engines(self, node_ids: Sequence[str]) -> None:
        """See L{Drains.start_engines}."""
        self._drains.start_engines(node_ids)

    def sleep_replica(self, replica_id: str) -> ReplicaRecord:
        """See L{Operator.sleep_replica}."""
        return self._operator.sleep_replica(replica_id)

    def wake_replica(self, replica_id: str) -> ReplicaRecord:
        """See L{Operator.wake_replica}."""
        return self._operator.wake_replica(replica_id)

    def pin(self, name: str, pinned: bool) -> Model:
        """See L{Operator.pin}."""
        return self._operator.pin(name, pinned)

    def scale(self, name: str, min_replicas: int, max_replicas: int) -> Model:
        """See L{Scaler.scale}."""
        return self._scaler.scale(name, min_replicas, max_replicas)

    def desired(self, state: ModelState, now: float) -> int:
        """See L{Scaler.desired}."""
        return self._scaler.desired(state, now)

    def why_not_sleep(self, replica: ReplicaRecord) -> str | None:
        """See L{SleepRoom.why_not_sleep}."""
        return self._room.why_not_sleep(replica)

    def snapshot(self) -> Snapshot:
        """@return: the inventory as placement sees it now."""
        return self._snapshots.snapshot()

    def live_snapshot(self) -> Snapshot:
        """
        @return: the snapshot the passes keep, refreshed for what changed
            (L{Snapshots.live}).
        """
        return self._snapshots.live()

    # Hooks the catalog was built with.

    def _catalog_changed(self) -> None:
        self.ledger.changes.all()
        self.loop.kick()

    def _adapters_changed(self, base: str) -> None:
        self._publisher.adapters_changed(base)

    def _standing(self, name: str) -> Standing:
        return self._swaps.standing(name)

    # The catalog at run time.

    def _weights_in_use(self) -> Iterable[tuple[str, str]]:
        for state in self.catalog.states():
            for profile in state.model.profiles:
                yield profile.source, state.model.name
        for replica in self.ledger.replicas.values():
            yield replica.profile.source, replica.id

    # The pass.

    def reconcile(self) -> None:
        """
        One pass; see the module's docstring.  It looks at the models and
        nodes that changed, or that may change by themselves (see
        L{llmgw.control.changes}).
        """
        now = self.clock.seconds()
        ledger = self.ledger
        changes = ledger.changes
        if ledger.grace.ends(now):
            changes.all()
            for state in self.catalog.states():
                # Declared in the config file: said once the fleet is known.
                self.catalog.unplaceable(state.model.name)
        everything, work = changes.take()
        if everything:
            work.update(ledger.models())
            work.update(s.model.name for s in self.catalog.states())
            self._snapshots.forget()
            self._publisher.republish_all()
        for node_id in self._update_nodes(now, everything):
            work.update(r.model for r, _ in ledger.shards_on(node_id))
        if not self._touched:
            work.update(
                r.model for r in ledger.replicas.values() if self._outstanding(r.id)
            )
        replicas = ledger.in_order(r for m in work for r in ledger.of_model(m))
        for replica in replicas:
            changes.nodes.update(s.node for s in replica.shards)
            self._publisher.republish(replica.id)
            try:
                self._check(replica, now)
            except Exception:
                # One bad record must not stall every model.
                self.log.failure("checking replica {replica}", replica=replica.id)
        for name in [m for m in ledger.failed if m not in self.catalog]:
            del ledger.failed[name]
        snapshot: Snapshot | None = None
        # Models with requests held first, in swap queue order (held_order).
        for name in sorted(
            (m for m in work if m in self.catalog),
            key=lambda m: (self._swaps.order_key(m), self.catalog.position(m)),
        ):
            state = self.catalog[name]
            try:
                snapshot = self._scaler.scale_model(
                    state, now, snapshot, list(ledger.of_model(name))
                )
            except Exception:
                self.log.failure("scaling model {model}", model=state.model.name)
                snapshot = None
                self._snapshots.forget()
        for replica in replicas:
            if ledger.replicas.get(replica.id) is not replica:
                continue
            if replica.draining_since is None:
                why = self._drains.drain_due(replica)
                if why is not None:
                    self._actions.drain(replica, why)
            if replica.draining_since is not None:
                self._actions.finish_drain(replica, now)
            elif replica.sleep_at is not None:
                self._actions.finish_sleep(replica, now)
        self._publisher.publish_ready()
        changes.settled({m for m in work if not self._scaler.settled(m)})
        # Memory given back in or before this pass is noted now, whoever looks.
        self._snapshots.live()

    def _update_nodes(self, now: float, everything: bool) -> list[str]:
        """
        Node states from their agents' silence: every node's, or those
        that may have gone silent, were heard or changed.

        @return: the ids of the nodes whose state changed.
        """
        settings = self.settings
        touched = self.inventory.take_touched()
        self.ledger.changes.nodes.update(touched)
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
                self.ledger.changes.nodes.add(node.id)
        return changed

    def _check(self, replica: ReplicaRecord, now: float) -> None:
        for shard in replica.shards:
            node = self.inventory.get(shard.node)
            if not shard.state.gone and (node is None or node.state == NodeState.LOST):
                shard.state = ShardState.LOST
                shard.error = f"node {shard.node} is lost"
        if replica.draining_since is not None:
            if all(s.state.gone for s in replica.shards):
                self._actions.forget(replica, _gone_why(replica))
            return
        model = self.catalog.get(replica.model)
        if replica.state == ReplicaState.READY:
            if replica.ready_at is None:
                replica.ready_at = now
                if not replica.adopted:
                    seconds = now - replica.created
                    self.ledger.counts.observed("cold_start", replica.model, seconds)
            if model is not None:
                scaling.recovered(model, replica.created)
            gone = self.ledger.failed.get(replica.model)
            if gone is not None and gone.created <= replica.created:
                # Replaced: the failure is history.
                del self.ledger.failed[replica.model]
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
        self.ledger.counts.failed(replica.model)
        if model is not None:
            scaling.failed(
                model, now, f"replica {replica.id}: {error}", lost, self.settings
            )
        for shard in replica.shards:
            if not shard.state.gone:
                self._commands.stop(shard.node, shard.id, shard)
        self._actions.forget(replica, _gone_why(replica))
        # Shown with its error and output until the model is served again.
        replica.error = error
        if model is not None:
            self.ledger.failed[replica.model] = replica
