"""
Drains (L{llmgw.control.plane}) and engines stopped on purpose
(docs/catalog.md, "Drains"; docs/agents.md, "Stopping engines").

An operator's drain keeps models up: a replica on a drained node, or one
drained by its id, first I{leaves}: it serves on while a replacement is
placed elsewhere (over C{max_replicas} for the while), and drains once its
replacement is ready.  A drain that would leave a model below its
C{min_replicas} with no room for a replacement is refused
(L{DrainRefused}) unless forced; a forced drain is the drain of old: every
replica drains at once, replaced after it is gone.  A replica with a
shard on a node found draining later (a drain kept across a restart, a
node back with engines) leaves the same way, but is not held up when
there is no room: its drain was checked when it was asked.

A drain proper (L{llmgw.control.actions.ReplicaActions.drain}): the
replica unpublished at once, and stopped once the router counts no request
in flight to it, or after C{[control] drain_timeout}.  The operator's
actions and the reconciler's (surplus, a model gone, a node's engines
stopped) all end there.

Stopping a node's engines (L{Drains.stop_engines}) drains every replica
on it at once and places nothing there until they are started again or
the server restarts; unlike a drain it is not kept in the store.

The layer above the replica actions (L{llmgw.control.actions}).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.actions import ReplicaActions
from llmgw.control.inventory import Inventory, Node
from llmgw.control.ledger import Ledger
from llmgw.control.placement import NoFit, Plan, place
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.control.runtime import ModelCatalog
from llmgw.control.scaling import ModelState
from llmgw.control.snapshot import Snapshot, Snapshots


class DrainRefused(Exception):
    """
    A drain would leave models with fewer replicas than their
    C{min_replicas} and no room for replacements.

    @ivar models: those models' names.
    """

    def __init__(self, what: str, short: Sequence[tuple[str, int, int]]) -> None:
        """
        @param what: the drain, in words (C{"draining node gpu-01"}).
        @param short: per model: its name, the replicas it would keep, its
            C{min_replicas}.
        """
        self.models = [name for name, _, _ in short]
        models = ", ".join(
            f"model {name!r} with {kept} of its min_replicas {low}"
            for name, kept, low in short
        )
        super().__init__(
            f"{what} would leave {models}: no room elsewhere for a replacement"
        )


class Drains:
    """
    The operator's drains and engines stopped on purpose, and what a pass
    does with leaving replicas.  The layer above the replica actions,
    which drain what it lets go; it calls nothing above it.

    @param clock: the reactor's clock.
    @param inventory: the nodes.
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param actions: drains replicas.
    @param snapshots: the placement snapshot a drain's check places
        replacements on.
    @param ports: ports engines may listen on.
    @param kick: asks for one more pass.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        inventory: Inventory,
        catalog: ModelCatalog,
        ledger: Ledger,
        actions: ReplicaActions,
        snapshots: Snapshots,
        ports: range,
        kick: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._inventory = inventory
        self._catalog = catalog
        self._ledger = ledger
        self._actions = actions
        self._snapshots = snapshots
        self._ports = ports
        self._kick = kick

    def drain_due(self, replica: ReplicaRecord) -> str | None:
        """
        @return: why C{replica}, not draining, must drain now (its model
            left the catalog, or it has a shard on a node whose engines are
            stopped: adopted after the stop, when the node's link came
            back), or L{None}.  One on a draining node leaves instead
            (L{leaving}).
        """
        if replica.model not in self._catalog:
            return "its model left the catalog"
        for shard in replica.shards:
            node = self._inventory.get(shard.node)
            if node is not None and node.engines_stopped:
                return f"the engines of node {shard.node} are stopped"
        return None

    def _on(self, node_id: str) -> list[ReplicaRecord]:
        """
        @return: the replicas with a shard on C{node_id}, not draining, in
            the order they were made.
        """
        found = {r.id: r for r, _ in self._ledger.shards_on(node_id)}
        return sorted(
            (r for r in found.values() if r.draining_since is None),
            key=lambda r: self._ledger.order(r.id),
        )

    # Drains an operator asks for.

    def drain_node(self, node_id: str, force: bool = False) -> list[str]:
        """
        No new placements on C{node_id}; its replicas leave: each is
        replaced elsewhere and drains once its replacement is ready, or at
        once where there is no room for one.

        @param force: drain every replica now, unchecked and not replaced
            first (a model may go below its C{min_replicas}).
        @return: the ids of the replicas going (now or once replaced).
        @raise KeyError: no such node.
        @raise DrainRefused: a model would be left below its
            C{min_replicas}, and not C{force}; nothing changed.
        """
        node = self._inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        going = self._on(node_id)
        was = node.draining
        # Placement leaves a draining node out: the replacements' check
        # needs it so.
        node.draining = True
        try:
            room = self._check_drain(f"draining node {node_id}", going, force)
        except DrainRefused:
            node.draining = was
            raise
        self._inventory.drained.add(node_id)
        self._ledger.changes.nodes.add(node_id)
        why = f"node {node_id} is draining"
        now = "; forced" if force else "; no room for a replacement"
        for replica in going:
            if replica.id in room:
                self._leave(replica, why, hold=True)
            else:
                self._actions.drain(replica, why + now)
        self._kick()
        return [r.id for r in going]

    def undrain_node(self, node_id: str) -> None:
        """
        Take a node back: placements may use it again (replicas already
        moved stay where they are; those still waiting for a replacement
        stay on).

        @raise KeyError: no such node.
        """
        node = self._inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        node.draining = False
        self._inventory.drained.discard(node_id)
        node.version += 1
        self._ledger.changes.nodes.add(node_id)
        for replica in self._on(node_id):
            # Those leaving for this node's drain; not those drained by id.
            if replica.leaving_reason == f"node {node_id} is draining":
                replica.leaving_since = None
                replica.leaving_reason = ""
                self._ledger.changes.model(replica.model)
        self._kick()

    def drain_replica(self, replica_id: str, force: bool = False) -> bool:
        """
        Drain one replica: it is replaced first (and drains once its
        replacement is ready), or drains at once where there is no room.

        @param force: drain it now, unchecked and not replaced first.
        @return: whether it started leaving or draining (was not already).
        @raise KeyError: no such replica.
        @raise DrainRefused: its model would be left below its
            C{min_replicas}, and not C{force}.
        """
        replica = self._ledger.replicas[replica_id]
        if replica.draining_since is not None or replica.leaving_since is not None:
            return False
        room = self._check_drain(f"draining replica {replica_id}", [replica], force)
        why = "an operator asked"
        if replica.id in room:
            started = self._leave(replica, why, hold=True)
        else:
            now = "; forced" if force else "; no room for a replacement"
            started = self._actions.drain(replica, why + now)
        self._kick()
        return started

    def _check_drain(
        self, what: str, going: Sequence[ReplicaRecord], force: bool
    ) -> set[str]:
        """
        @param what: the drain, in words, for its refusal.
        @param going: the replicas it takes away.
        @return: the ids of those for which a replacement fits now (each
            placed in turn on one snapshot: two do not count one place);
            none when C{force}.
        @raise DrainRefused: a model would keep fewer replicas than its
            C{min_replicas}, and not C{force}.
        """
        if force:
            return set()
        snapshot = self._snapshots.snapshot()
        room = set()
        for replica in going:
            state = self._catalog.get(replica.model)
            if state is None or replica.dormant:
                # A sleeper serves nothing: it stops, not replaced.
                continue
            spread = frozenset(
                s.node for r in self._ledger.of_model(replica.model) for s in r.shards
            )
            plan = _place(state, snapshot, self._ports, spread)
            if plan is not None:
                snapshot.take(plan)
                room.add(replica.id)
        leaving = {r.id for r in going}
        short = []
        for name in sorted({r.model for r in going}, key=self._catalog.position):
            state = self._catalog.get(name)
            if state is None:
                continue
            staying = sum(
                1
                for r in self._ledger.of_model(name)
                if r.draining_since is None
                and r.leaving_since is None
                and not r.dormant
                and r.id not in leaving
            )
            kept = staying + sum(1 for r in going if r.model == name and r.id in room)
            if kept < state.model.min_replicas:
                short.append((name, kept, state.model.min_replicas))
        if short:
            raise DrainRefused(what, short)
        return room

    def _leave(self, replica: ReplicaRecord, why: str, hold: bool) -> bool:
        """
        C{replica} serves on until a replacement is ready, then drains.

        @param hold: keep it while its model is below C{min_replicas} with
            no room for a replacement.
        @return: whether it started leaving (was neither leaving nor
            draining).
        """
        if replica.draining_since is not None or replica.leaving_since is not None:
            return False
        if replica.dormant:
            # Asleep, it serves nothing a replacement must take over.
            return self._actions.drain(replica, why)
        replica.leaving_since = self._clock.seconds()
        replica.leaving_reason = why
        replica.leaving_hold = hold
        self._ledger.changes.model(replica.model)
        self.log.info(
            "replica {replica} of {model} leaves once a replacement is ready: {why}",
            replica=replica.id,
            model=replica.model,
            why=why,
        )
        return True

    # What a pass does with leaving replicas.

    def leaving(self, live: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """
        Those of C{live} (a model's replicas not draining) with a shard on
        a draining node leave, if not already.

        @return: the leaving ones, in the order they were made.
        """
        for replica in live:
            if replica.leaving_since is None:
                node = _draining_node(self._inventory, replica)
                if node is not None:
                    self._leave(replica, f"node {node} is draining", hold=False)
        return sorted(
            (r for r in live if r.leaving_since is not None),
            key=lambda r: self._ledger.order(r.id),
        )

    def let_go(
        self, state: ModelState, want: int, leaving: Sequence[ReplicaRecord]
    ) -> None:
        """
        Drain the leaving replicas the model can spare now: one not ready
        at once; a ready one once the ready replicas staying are as many
        as the model wants.  Where there is no room for the rest
        (C{state.no_fit}), one held (L{_leave}) is kept while the model is
        below C{min_replicas}; the others go.
        """
        ready = sum(
            1
            for r in self._ledger.of_model(state.model.name)
            if r.draining_since is None
            and r.leaving_since is None
            and r.state == ReplicaState.READY
        )
        kept = 0
        for replica in leaving:
            if state.no_fit is None:
                target = want
            elif replica.leaving_hold:
                target = min(want, state.model.min_replicas)
            else:
                target = 0
            if replica.state == ReplicaState.READY and ready + kept < target:
                kept += 1
                continue
            if replica.state != ReplicaState.READY:
                why = "it was not serving"
            elif ready + kept >= want:
                why = "its replacement is ready"
            else:
                why = "no room for a replacement"
            self._actions.drain(replica, f"{replica.leaving_reason}; {why}")

    # Engines stopped on purpose.

    def stop_engines(self, node_ids: Sequence[str]) -> list[str]:
        """
        Stop every engine of the nodes C{node_ids} on purpose: their
        replicas drain now (requests in flight finish, up to C{[control]
        drain_timeout}), nothing is placed on them until L{start_engines}
        or the server's next start, and no drain is kept.

        @return: the ids of the replicas stopping.
        @raise KeyError: a node not known (then nothing changed).
        """
        nodes = [self._node(node_id) for node_id in node_ids]
        stopping = []
        for node in nodes:
            node.engines_stopped = True
            self._inventory.stopped.add(node.id)
            self._ledger.changes.nodes.add(node.id)
            self.log.info("node {node}: stopping its engines", node=node.id)
            for replica in self._on(node.id):
                self._actions.drain(
                    replica, f"the engines of node {node.id} are stopped"
                )
                stopping.append(replica.id)
        self._kick()
        return stopping

    def start_engines(self, node_ids: Sequence[str]) -> None:
        """
        Placements may use the nodes C{node_ids} again, after
        L{stop_engines}.

        @raise KeyError: a node not known (then nothing changed).
        """
        nodes = [self._node(node_id) for node_id in node_ids]
        for node in nodes:
            node.engines_stopped = False
            self._inventory.stopped.discard(node.id)
            node.version += 1
            self._ledger.changes.nodes.add(node.id)
        # New capacity: models waiting for a place try again now.
        for state in self._catalog.states():
            if state.no_fit is not None:
                state.retry_at = 0.0
        self._ledger.changes.all()
        self._kick()

    def _node(self, node_id: str) -> Node:
        node = self._inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        return node


def _draining_node(inventory: Inventory, replica: ReplicaRecord) -> str | None:
    """
    @return: the id of a draining node C{replica} has a shard on, or
        L{None}.
    """
    for shard in replica.shards:
        node = inventory.get(shard.node)
        if node is not None and node.draining:
            return shard.node
    return None


def _place(
    state: ModelState, snapshot: Snapshot, ports: range, spread: frozenset[str]
) -> Plan | None:
    """
    @return: a plan for one more replica of C{state}'s model, or L{None}
        when none fits.
    """
    result = place(state.model.profiles, snapshot.fleet, ports, spread)
    return None if isinstance(result, NoFit) else result
