"""
Drains (L{llmgw.control.plane}): a replica unpublished at once, and stopped
once the router counts no request in flight to it, or after C{[control]
drain_timeout} (or its own, longer patience), when what is still in
flight is cut.  The operator's actions (a node, a replica) and the
reconciler's (surplus, a model gone) both end here.  Part of
L{llmgw.control.plane.ControlPlane}, kept apart by job.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.changes import Changes
from llmgw.control.commands import STOP_GRACE, ShardCommands
from llmgw.control.inventory import Inventory
from llmgw.control.loop import Loop
from llmgw.control.records import ReplicaRecord
from llmgw.control.runtime import ModelCatalog
from llmgw.control.settings import ControlConfig
from llmgw.wire.states import ShardState


class Draining:
    """
    The drain half of L{llmgw.control.plane.ControlPlane}, which provides
    the attributes declared here.
    """

    log: Logger
    clock: IReactorTime
    inventory: Inventory
    settings: ControlConfig
    replicas: dict[str, ReplicaRecord]
    loop: Loop
    _commands: ShardCommands
    _outstanding: Callable[[str], int]
    _cut: Callable[[str, str], object]
    _changes: Changes
    catalog: ModelCatalog

    def _publish_ready(self) -> None:
        raise NotImplementedError()

    def _republish(self, replica_id: str) -> None:
        raise NotImplementedError()

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

    def drain_node(self, node_id: str) -> list[str]:
        """
        No new placements on C{node_id}; its replicas drain and are placed
        elsewhere.

        @return: the ids of the replicas now draining.
        @raise KeyError: no such node.
        """
        node = self.inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        node.draining = True
        self.inventory.drained.add(node_id)
        self._changes.nodes.add(node_id)
        drained = []
        for replica in list(self.replicas.values()):
            if any(s.node == node_id for s in replica.shards):
                if self._drain(replica, f"node {node_id} is draining"):
                    drained.append(replica.id)
        self.loop.kick()
        return drained

    def undrain_node(self, node_id: str) -> None:
        """
        Take a node back: placements may use it again (replicas already
        moved stay where they are).

        @raise KeyError: no such node.
        """
        node = self.inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        node.draining = False
        self.inventory.drained.discard(node_id)
        node.version += 1
        self._changes.nodes.add(node_id)
        self.loop.kick()

    def drain_replica(self, replica_id: str) -> bool:
        """
        Drain one replica (a new one is placed if the model needs it).

        @return: whether it started draining (not already draining).
        @raise KeyError: no such replica.
        """
        replica = self.replicas[replica_id]
        started = self._drain(replica, "an operator asked")
        self.loop.kick()
        return started

    def _drain(self, replica: ReplicaRecord, why: str, patience: float = 0.0) -> bool:
        """
        Unpublish C{replica} now and stop it once nothing is in flight to
        it.

        @param patience: seconds its requests in flight may take, when
            more than C{[control] drain_timeout} (a scale-down waits out a
            model's C{idle_timeout} rather than cut a stream).
        @return: whether it started draining (was not already).
        """
        if replica.draining_since is not None:
            return False
        replica.draining_since = self.clock.seconds()
        replica.drain_reason = why
        replica.drain_patience = patience
        self._changes.model(replica.model)
        self._republish(replica.id)
        self.log.info(
            "draining replica {replica} of {model}: {why}",
            replica=replica.id,
            model=replica.model,
            why=why,
        )
        # No new requests from now on.
        self._publish_ready()
        return True

    def _finish_drain(self, replica: ReplicaRecord, now: float) -> None:
        assert replica.draining_since is not None
        if replica.stop_sent_at is not None:
            if now - replica.stop_sent_at > STOP_GRACE + 10:
                # Not gone after SIGKILL's time: the stop was lost (a link
                # down); again.
                replica.stop_sent_at = now
                for shard in replica.shards:
                    if not shard.state.gone:
                        self._commands.stop(shard.node, shard.id)
            return
        in_flight = self._outstanding(replica.id)
        timeout = max(self.settings.drain_timeout, replica.drain_patience)
        late = now - replica.draining_since >= timeout
        if in_flight and not late:
            return
        if in_flight:
            self.log.warn(
                "replica {replica}: {count} requests still in flight after"
                " {seconds:g}s of draining; stopping it",
                replica=replica.id,
                count=in_flight,
                seconds=timeout,
            )
            # Its engine may never close them (a lost node sends no FIN).
            self._cut(replica.id, f"its drain ran out of time ({timeout:g}s)")
        replica.stop_sent_at = now
        for shard in replica.shards:
            if not shard.state.gone:
                shard.state = ShardState.DRAINING
                self._commands.stop(shard.node, shard.id)
