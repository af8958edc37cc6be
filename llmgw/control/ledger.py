"""
The control plane's records as one object (docs/architecture.md, "The
control plane's layers"): the replicas by id with their indexes (by model,
by node, by shard id, and the order they were made in), what changed since
the last pass (L{Changes}), what the plane did (L{PlaneCounts}), each
model's last failed replica, and the start-up grace.

It is the bottom layer: every other part of the plane is handed this one
object and reads or indexes the records through it; it calls nothing
above it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from llmgw.control.changes import Changes
from llmgw.control.records import PlaneCounts, ReplicaRecord, ShardRecord


class Grace:
    """
    The start-up grace: after the server starts (or a standby takes the
    lead), no placements and no scale-down for C{[control]
    startup_grace}, while the agents' Registers adopt their engines.

    @ivar started: reactor seconds when the grace began.
    @ivar over: whether it is over.
    """

    def __init__(self, now: float, seconds: float) -> None:
        """
        @param now: reactor seconds.
        @param seconds: C{[control] startup_grace}.
        """
        self.seconds = seconds
        self.started = now
        self.over = seconds <= 0

    def begin(self, now: float) -> None:
        """
        The grace begins afresh at C{now} (reactor seconds).
        """
        self.started = now
        self.over = self.seconds <= 0

    def ends(self, now: float) -> bool:
        """
        @return: whether the grace ends at C{now} (it was not over and its
            time is up); it is over from then on.
        """
        if self.over or now - self.started < self.seconds:
            return False
        self.over = True
        return True


class Ledger:
    """
    The records of the replicas the plane placed or adopted, indexed.

    @ivar replicas: the records, by replica id; read-only outside: change
        them through L{record} and L{forget}.
    @ivar changes: what changed since the last pass.
    @ivar counts: what the plane did since it started.
    @ivar failed: each model's last failed replica, with its error and its
        engines' output, until the model has a ready replica again (or
        leaves the catalog).
    @ivar grace: the start-up grace.
    """

    def __init__(self, grace: Grace) -> None:
        self.replicas: dict[str, ReplicaRecord] = {}
        self.changes = Changes()
        self.counts = PlaneCounts()
        self.failed: dict[str, ReplicaRecord] = {}
        self.grace = grace
        self._by_model: dict[str, dict[str, ReplicaRecord]] = {}
        self._on_node: dict[str, dict[str, tuple[ReplicaRecord, ShardRecord]]] = {}
        self._shards: dict[str, tuple[ReplicaRecord, ShardRecord]] = {}
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()

    def record(self, replica: ReplicaRecord, shard: ShardRecord | None) -> None:
        """
        Index C{replica} (and C{shard}, one of its shards) as recorded; its
        model (and the shard's node) changed.
        """
        self.replicas[replica.id] = replica
        self._by_model.setdefault(replica.model, {})[replica.id] = replica
        if replica.id not in self._seq:
            self._seq[replica.id] = next(self._counter)
        self.changes.model(replica.model)
        if shard is not None:
            self._shards[shard.id] = (replica, shard)
            self._on_node.setdefault(shard.node, {})[shard.id] = (replica, shard)
            self.changes.nodes.add(shard.node)

    def forget(self, replica: ReplicaRecord) -> None:
        """
        Drop C{replica} and its shards from the records; its model and its
        shards' nodes changed.
        """
        self.replicas.pop(replica.id, None)
        models = self._by_model.get(replica.model, {})
        if models.get(replica.id) is replica:
            del models[replica.id]
            if not models:
                del self._by_model[replica.model]
            self._seq.pop(replica.id, None)
        self.changes.model(replica.model)
        for shard in replica.shards:
            self.changes.nodes.add(shard.node)
            if self._shards.get(shard.id, (None, None))[1] is shard:
                del self._shards[shard.id]
                self._on_node.get(shard.node, {}).pop(shard.id, None)

    def of_model(self, name: str) -> Iterable[ReplicaRecord]:
        """
        @return: model C{name}'s replicas, in no set order.
        """
        return self._by_model.get(name, {}).values()

    def models(self) -> Iterator[str]:
        """
        @return: the names of the models with replicas recorded.
        """
        return iter(self._by_model)

    def by_model(self) -> Iterable[tuple[str, Iterable[ReplicaRecord]]]:
        """
        @return: (model name, its replicas) for every model with replicas.
        """
        return ((name, r.values()) for name, r in self._by_model.items())

    def shards_on(self, node_id: str) -> Iterable[tuple[ReplicaRecord, ShardRecord]]:
        """
        @return: (replica, shard) for each shard recorded on C{node_id}.
        """
        return self._on_node.get(node_id, {}).values()

    def shard(self, shard_id: str) -> tuple[ReplicaRecord, ShardRecord] | None:
        """
        @return: the replica and the shard recorded as C{shard_id}, or
            L{None}.
        """
        return self._shards.get(shard_id)

    def shards(self) -> Iterable[tuple[ReplicaRecord, ShardRecord]]:
        """
        @return: (replica, shard) for every shard recorded.
        """
        return self._shards.values()

    def order(self, replica_id: str) -> int:
        """
        @return: where C{replica_id} comes in the order replicas were
            recorded (0 for one not recorded).
        """
        return self._seq.get(replica_id, 0)

    def in_order(self, replicas: Iterable[ReplicaRecord]) -> list[ReplicaRecord]:
        """
        @return: C{replicas} (recorded ones) in the order they were made.
        """
        return sorted(replicas, key=lambda r: self._seq[r.id])
