"""
The control plane (DESIGN.md section 3): desired replicas per catalog
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
the server knows what is in flight.

Shard statuses and registrations arrive from the agent links between
passes (L{ControlPlane.shard_status}, L{ControlPlane.node_registered}) and
kick a pass.  Nothing here blocks: commands to agents are sent and their
results handled when they come.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.config import ControlConfig
from llmgw.control import adoption, scaling
from llmgw.control.catalog import Model
from llmgw.control.commands import Commands, ShardCommands
from llmgw.control.drains import Draining
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.loop import Loop
from llmgw.control.placement import NodeView, NoFit, Plan, place
from llmgw.control.records import (
    PlaneCounts,
    ReplicaRecord,
    ReplicaState,
    ShardRecord,
    output_summary,
)
from llmgw.control.runtime import ModelCatalog, check_bounds
from llmgw.control.scaling import ModelState
from llmgw.control.snapshot import Snapshot, Strays, SuspectPorts, warn_ephemeral
from llmgw.control.weights import WeightsCollector
from llmgw.router.interfaces import Endpoint
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


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


class ControlPlane(Draining):
    """
    Keeps each catalog model's replicas running.

    @param clock: the reactor's clock.
    @param inventory: the nodes, as their agents describe them.
    @param commands: sends commands to agents.
    @param models: the catalog.
    @param settings: the C{[control]} table.
    @param publish: called with the router's new endpoint list when it
        changes.
    @param static: endpoints from the configuration, always published.
    @param outstanding: requests in flight to a replica id, by the router's
        count; a draining replica is stopped when it reaches 0.
    @param keys: a shard id's engine secret (L{ShardCommands}), "" for none.
    @param cut: ends the router's requests in flight to a replica id now,
        with a reason (L{llmgw.router.balancer.Balancer.cut}): called when
        the replica is gone (its node lost, its engine exited) or its drain
        ran out of time.
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
    ) -> None:
        self.clock = clock
        self.inventory = inventory
        self.commands = commands
        self.settings = settings
        self._publish = publish
        self._outstanding = outstanding
        self._cut = cut
        self.loop = Loop(clock, settings.interval, self.reconcile, name="reconciler")
        self.catalog = ModelCatalog(clock, inventory, models, static, self.loop.kick)
        self.replicas: dict[str, ReplicaRecord] = {}
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

    # What the agents say.

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        Record a shard's transition; unknown shards are ignored here (a
        Register lists them all).
        """
        found = self._shards.get(status.shard_id)
        if found is None or found[1].node != node_id:
            if (ShardState.from_pb(status.state) or ShardState.PENDING).gone:
                self._strays.gone(node_id, status.shard_id)
            self._late_output(node_id, status)
            return
        replica, shard = found
        state = ShardState.from_pb(status.state) or shard.state
        if shard.state.gone:
            return
        shard.state = state
        if status.pid:
            shard.pid = status.pid
        if status.output_tail:
            shard.output = tuple(status.output_tail)
        if state == ShardState.FAILED:
            shard.error = status.error + output_summary(shard.output)
        self.loop.kick()

    def _late_output(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        The output of a shard of a failed replica, sent when its engine
        stopped (one the server gave up waiting for): kept with the
        replica, and its summary added to the model's last error.
        """
        if not status.output_tail:
            return
        for replica in self.failed.values():
            for shard in replica.shards:
                if shard.id == status.shard_id and shard.node == node_id:
                    if shard.output:
                        return
                    shard.output = tuple(status.output_tail)
                    state = self.catalog.get(replica.model)
                    if state is not None and state.last_error.startswith(
                        f"replica {replica.id}: "
                    ):
                        state.last_error += output_summary(shard.output)
                    return

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        """
        Adoption (see L{adoption}): shards the catalog still claims become
        (or stay) replicas, the others are stopped; shards recorded on
        this node that it no longer lists are gone.
        """
        listed = {s.shard_id for s in register.shards}
        self._strays.listed(node_id, listed)
        for _, shard in list(self._shards.values()):
            if shard.node == node_id and shard.id not in listed:
                if not shard.state.gone:
                    shard.state = ShardState.FAILED
                    shard.error = f"not running on {node_id} after its agent registered"
        models = {s.model.name: s.model for s in self.catalog.states()}
        for running in register.shards:
            found = self._shards.get(running.shard_id)
            if found is not None and found[1].node == node_id:
                self._relisted(found[0], found[1], running)
                continue
            reason = adoption.claim(
                running, models, self._shard_node, self.replicas, self.grace_over
            )
            if reason:
                self.log.info(
                    "stopping shard {shard} on {node}: {reason}",
                    shard=running.shard_id,
                    node=node_id,
                    reason=reason,
                )
                self._commands.stop(node_id, running.shard_id)
                now = self.clock.seconds()
                self._strays.add(node_id, running.shard_id, (), running.port, now)
                continue
            self._adopt(node_id, running)
        for waiting in self.catalog.states():
            # New capacity: models waiting for a place try again now.
            if waiting.no_fit is not None:
                waiting.retry_at = 0.0
        self.loop.kick()

    def _relisted(
        self, replica: ReplicaRecord, shard: ShardRecord, running: pb.RunningShard
    ) -> None:
        if adoption.reprobed(shard, running):
            return
        state = adoption.relisted(shard, running)
        if state is not None:
            shard.state = state
            shard.pid = running.pid or shard.pid
        if replica.stop_sent_at is not None and not adoption.listed_state(running).gone:
            # The stop may have been lost with the old link.
            self._commands.stop(shard.node, shard.id)

    def _shard_node(self, shard_id: str) -> str | None:
        found = self._shards.get(shard_id)
        return found[1].node if found is not None else None

    def _adopt(self, node_id: str, running: pb.RunningShard) -> None:
        counts = self.catalog[running.model]
        model = counts.model
        profile = next(p for p in model.profiles if p.name == running.profile)
        replica = self.replicas.get(running.replica_id)
        if replica is None:
            now = self.clock.seconds()
            replica = adoption.replica_record(running, profile, now)
            self.replicas[replica.id] = replica
            live = sum(
                1
                for r in self.replicas.values()
                if r.model == model.name and r.draining_since is None
            )
            counts.wanted = scaling.kept_after_adoption(model, counts.wanted, live)
            counts.last_used = counts.busy_at = now
        shard = adoption.shard_record(node_id, running)
        replica.shards.append(shard)
        self._shards[shard.id] = (replica, shard)
        self.log.info(
            "adopted shard {shard} of model {model} on {node} (engine pid {pid})",
            shard=shard.id,
            model=model.name,
            node=node_id,
            pid=running.pid,
        )

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
        One pass; see the module's docstring.
        """
        now = self.clock.seconds()
        if not self.grace_over and now - self.started >= self.settings.startup_grace:
            self.grace_over = True
        self._update_nodes(now)
        for replica in list(self.replicas.values()):
            try:
                self._check(replica, now)
            except Exception:
                # One bad record must not stall every model.
                self.log.failure("checking replica {replica}", replica=replica.id)
        for name in [m for m in self.failed if m not in self.catalog]:
            del self.failed[name]
        by_model: dict[str, list[ReplicaRecord]] = {}
        for replica in self.replicas.values():
            by_model.setdefault(replica.model, []).append(replica)
        snapshot: Snapshot | None = None
        for state in self.catalog.states():
            try:
                snapshot = self._scale(
                    state, now, snapshot, by_model.get(state.model.name, [])
                )
            except Exception:
                self.log.failure("scaling model {model}", model=state.model.name)
                snapshot = None
        for replica in list(self.replicas.values()):
            if replica.draining_since is None:
                why = self._drain_due(replica)
                if why is not None:
                    self._drain(replica, why)
            if replica.draining_since is not None:
                self._finish_drain(replica, now)
        self._publish_ready()

    def _drain_due(self, replica: ReplicaRecord) -> str | None:
        """
        @return: why C{replica}, not draining, must drain (its model left
            the catalog, or it has a shard on a draining node: adopted
            after the drain began, when the node's link came back), or
            L{None}.
        """
        if replica.model not in self.catalog:
            return "its model left the catalog"
        for shard in replica.shards:
            node = self.inventory.get(shard.node)
            if node is not None and node.draining:
                return f"node {shard.node} is draining"
        return None

    def _update_nodes(self, now: float) -> None:
        settings = self.settings
        for node in self.inventory.nodes():
            silent = now - max(node.heard, self.started)
            state = NodeState.of_silence(
                silent, settings.unreachable_after, settings.lost_after
            )
            if state != node.state:
                log = self.log.warn if state != NodeState.READY else self.log.info
                log(
                    "node {node} is {state} (silent {seconds:.0f}s)",
                    node=node.id,
                    state=state,
                    seconds=silent,
                )
                node.state = state

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
        for shard in replica.shards:
            if self._shards.get(shard.id, (None, None))[1] is shard:
                del self._shards[shard.id]

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

    def _scale(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot | None,
        replicas: list[ReplicaRecord],
    ) -> Snapshot | None:
        live = [r for r in replicas if r.draining_since is None]
        self._follow_load(state, now, live)
        want = self.desired(state, now, replicas)
        if not self.grace_over:
            return snapshot
        if len(live) > want:
            for replica in scaling.surplus(live, want, self._outstanding):
                # A stream on it is waited for up to idle_timeout.
                self._drain(
                    replica,
                    f"{len(live)} replicas, {want} wanted",
                    state.model.idle_timeout,
                )
            return snapshot
        if len(live) == want:
            state.no_fit = None
            return snapshot
        if now < state.retry_at:
            return snapshot
        if snapshot is None:
            snapshot = self.snapshot()
        spread = {s.node for r in live for s in r.shards}
        for _ in range(want - len(live)):
            result = place(
                state.model.profiles, snapshot.fleet, self.ports, frozenset(spread)
            )
            if isinstance(result, NoFit):
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
                state.retry_at = now + self.settings.base_backoff
                break
            state.no_fit = None
            self._start(state.model, result, now)
            snapshot.take(result)
            spread.update(s.node for s in result.shards)
        return snapshot

    # Commands and publishing.

    def _start(self, model: Model, plan: Plan, now: float) -> None:
        leader = plan.shards[0]
        node = self.inventory.get(leader.node)
        port = plan.rendezvous_port or leader.port
        address = f"{_host(node.address)}:{port}" if node is not None else ""
        replica = self._commands.start(model.name, plan, now, address)
        self.counts.started(model.name)
        self.replicas[replica.id] = replica
        for shard in replica.shards:
            self._shards[shard.id] = (replica, shard)

    def _publish_ready(self) -> None:
        endpoints = list(self.catalog.static_endpoints())
        ready_models: set[str] = set()
        for replica in self.replicas.values():
            if replica.state != ReplicaState.READY:
                continue
            leader = replica.leader
            node = self.inventory.get(leader.node) if leader is not None else None
            state = self.catalog.get(replica.model)
            if leader is None or node is None or state is None:
                continue
            endpoints.append(
                Endpoint(
                    replica.id,
                    f"http://{_host(node.address)}:{leader.port}",
                    state.model.names,
                    api_key=self._commands.engine_key(leader.id),
                )
            )
            ready_models.add(replica.model)
        published = tuple(endpoints)
        if published != self._published:
            self._published = published
            self._publish(endpoints)
        for name in ready_models:
            state = self.catalog[name]
            waiters, state.waiters = state.waiters, []
            for waiter in waiters:
                waiter.callback(None)
