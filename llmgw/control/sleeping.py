"""
Whether a replica may sleep, and whether a sleeper has room to wake
(docs/catalog.md, "Sleep"): a replica of a model whose profile says
C{sleep} goes to sleep instead of stopping when its model scales down or
it is evicted, and is woken, rather than a replica cold-started, when its
model is wanted again and its GPUs have room.

Asleep, a replica's GPUs are free for placement but for what its engine
keeps (its agent reports the memory), and its host memory counts against
its node's C{sleep_memory} (C{Register.sleep_memory_bytes}).  A replica
that may not sleep (its engine refused sleep mode at start, the node's
budget is full, its agent is older than sleep, L{versions.SLEEP}) is
stopped instead.

L{SleepRoom} only reads the records and the inventory: the replica actions
(L{llmgw.control.actions}) put replicas to sleep and wake them.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.ledger import Ledger
from llmgw.control.placement import Fleet, Plan, ShardPlan, shares
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.wire import versions

GB = 1024**3

WAKE_REFUSALS = 3
"""
Wakes of one sleeper refused in a row for C{gpus_in_use} after which the
next refusal stops it (another engine holds its GPUs for good).
"""


class SleepRoom:
    """
    The room sleepers take and need: each node's C{sleep_memory}, and the
    GPU memory a wake takes back.

    @param inventory: the nodes.
    @param ledger: the records.
    """

    def __init__(self, inventory: Inventory, ledger: Ledger) -> None:
        self._inventory = inventory
        self._ledger = ledger

    def why_not_sleep(
        self, replica: ReplicaRecord, host: Mapping[str, float] | None = None
    ) -> str | None:
        """
        @param host: L{sleeping_host} now, when the caller has it (asking
            of many replicas at once: one pass over the replicas).
        @return: why C{replica} may not be put to sleep now, in words, or
            L{None} when it may: its profile says C{sleep}, it is ready,
            its engine did not refuse sleep mode, each of its nodes' agents
            speaks a protocol with sleep (L{versions.SLEEP}), and each of its
            nodes' C{sleep_memory} has room for what it would hold there.
        """
        profile = replica.profile
        if profile.sleep == "off":
            return f'profile {profile.name} of {replica.model} has sleep = "off"'
        for node_id in sorted({s.node for s in replica.shards}):
            node = self._inventory.get(node_id)
            if node is not None and not versions.supports(
                node.protocol, versions.SLEEP
            ):
                # It would leave a SleepShard unanswered (it has no such
                # message), so the replica stops instead.
                lacks = versions.lacks(node.protocol, versions.SLEEP, "agent")
                return f"node {node_id}: {lacks}"
        refused = next((s.sleep_refused for s in replica.shards if s.sleep_refused), "")
        if refused:
            return f"its engine refused sleep mode ({refused})"
        if replica.state != ReplicaState.READY:
            return f"it is {replica.state}"
        need = profile.sleep_host_memory_gb
        if host is None:
            host = self.sleeping_host()
        for node_id in {s.node for s in replica.shards}:
            budget = self.budget_gb(node_id)
            held = host.get(node_id, 0.0)
            if held + need > budget + 1e-9:
                return (
                    f"node {node_id}'s sleep_memory ({budget:.1f} GB) holds"
                    f" {held:.1f} GB of sleeping replicas; {need:.1f} GB more"
                    " does not fit"
                )
        return None

    def budget_gb(self, node_id: str) -> float:
        """
        @return: GB of host memory node C{node_id}'s sleeping engines may
            hold (its C{sleep_memory}); 0 for a node not known.
        """
        node = self._inventory.get(node_id)
        return (node.sleep_memory_bytes if node is not None else 0) / GB

    def sleeping_host(self) -> dict[str, float]:
        """
        @return: per node, GB of host memory its dormant replicas hold (or
            will, once asleep); nodes with none are left out.
        """
        held: dict[str, float] = {}
        for _, replicas in self._ledger.by_model():
            for replica in replicas:
                if replica.dormant:
                    for node_id in {s.node for s in replica.shards}:
                        gb = replica.profile.sleep_host_memory_gb
                        held[node_id] = held.get(node_id, 0.0) + gb
        return held

    def wake_room(self, replica: ReplicaRecord, fleet: Fleet) -> str | None:
        """
        @return: why C{replica} cannot be woken where it sleeps in
            C{fleet}, or L{None} when each of its GPUs has the memory it
            would take back and no other replica is placed there.  A node
            not heard since it went to sleep still counts its memory awake.
        """
        profile = replica.profile
        for shard in replica.shards:
            view = fleet.get(shard.node)
            if view is None or view.state != NodeState.READY:
                return f"node {shard.node} is not ready"
            node = self._inventory.get(shard.node)
            stale = (
                node is not None
                and replica.asleep_at is not None
                and node.heard <= replica.asleep_at
            )
            held = profile.gpu_memory_gb if stale else profile.sleep_gpu_memory_gb
            need_mib = int((profile.gpu_memory_gb - held) * 1024)
            for gpu in view.gpus:
                if gpu.index not in shard.gpus:
                    continue
                if gpu.allocated or (gpu.sharers and not shares(profile)):
                    return f"GPU {gpu.index} of {shard.node} is in use"
                if gpu.free_mib < need_mib:
                    return (
                        f"GPU {gpu.index} of {shard.node} has"
                        f" {gpu.free_mib / 1024:.1f} GB free, waking needs"
                        f" {need_mib / 1024:.1f} GB"
                    )
        return None


def held_plan(replica: ReplicaRecord) -> Plan:
    """
    @return: C{replica}'s shards as a placement L{Plan} (to count them
        taken in a snapshot).
    """
    shards = tuple(ShardPlan(s.node, s.gpus, s.port, s.rank) for s in replica.shards)
    return Plan(replica.profile, shards, replica.rendezvous_port)
