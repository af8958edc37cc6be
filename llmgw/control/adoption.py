"""
Adoption as pure functions: after a server restart (or an agent's), what
a node's Register lists is matched against the catalog and the records.
A shard the catalog still claims becomes (or stays) part of a replica;
the others are stopped.  The reconciler (L{llmgw.control.plane}) acts on
the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from llmgw.control.catalog import Model
from llmgw.control.placement import Profile
from llmgw.control.records import ReplicaRecord, ReplicaState, ShardRecord
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState


def claim(
    running: pb.RunningShard,
    models: Mapping[str, Model],
    shard_node: Callable[[str], str | None],
    replicas: Mapping[str, ReplicaRecord],
    settled: bool = False,
) -> str:
    """
    @param running: a shard a node lists that the records do not hold
        on that node.
    @param models: the catalog by model name.
    @param shard_node: the node a recorded shard id is on, or L{None}.
    @param replicas: the recorded replicas by id.
    @param settled: the server's startup grace is over: a replica not
        recorded by now is gone, and a follower of it (rank > 0) is an
        orphan, never a replica on its own.  During the grace its leader
        may register after it.
    @return: why the catalog does not claim C{running}, or C{""} when it
        is to be adopted.
    """
    model = models.get(running.model)
    if model is None:
        return f"model {running.model!r} is not in the catalog"
    if not any(p.name == running.profile for p in model.profiles):
        return f"model {running.model!r} has no profile {running.profile!r}"
    if running.state in (
        pb.SHARD_STATE_DRAINING,
        pb.SHARD_STATE_STOPPED,
        pb.SHARD_STATE_FAILED,
    ):
        return "it is stopping or failed"
    profile = next(p for p in model.profiles if p.name == running.profile)
    if (running.engine, running.source) != (profile.engine, profile.source) and (
        running.engine or running.source
    ):
        # The catalog changed the profile since (another checkpoint):
        # the old engine would serve the old weights under the name.
        return (
            f"profile {profile.name!r} is now {profile.engine} {profile.source!r},"
            f" it runs {running.engine} {running.source!r}"
        )
    if running.rank >= profile.nodes:
        return f"rank {running.rank} in a profile of {profile.nodes} nodes"
    other = shard_node(running.shard_id)
    if other is not None:
        return f"shard id {running.shard_id!r} is already on node {other}"
    replica = replicas.get(running.replica_id)
    if replica is None and running.rank > 0 and settled:
        return (
            f"rank {running.rank} of replica {running.replica_id}, which is gone"
            " (an orphan of its gang)"
        )
    if replica is not None:
        if replica.state in (ReplicaState.DRAINING, ReplicaState.FAILED):
            return f"its replica {replica.id} is {replica.state}"
        if replica.model != running.model or replica.profile.name != profile.name:
            return f"replica {replica.id} is of another model or profile"
        if any(s.rank == running.rank for s in replica.shards):
            return f"replica {replica.id} has a rank {running.rank} already"
    return ""


def listed_state(running: pb.RunningShard) -> ShardState:
    """
    @return: the state a Register lists a shard in; C{starting} when it
        names none this version knows.
    """
    return ShardState.from_pb(running.state) or ShardState.STARTING


def reprobed(shard: ShardRecord, running: pb.RunningShard) -> bool:
    """
    @param shard: a recorded shard its node lists again (the agent
        registered anew).
    @return: whether the listing is a restarted agent probing an engine
        the server knows is ready (the same pid, listed C{starting}): the
        record stays as it is, and the router keeps sending.
    """
    return (
        shard.state == ShardState.READY
        and listed_state(running) == ShardState.STARTING
        and bool(running.pid)
        and running.pid == shard.pid
    )


def relisted(shard: ShardRecord, running: pb.RunningShard) -> ShardState | None:
    """
    @param shard: a recorded shard its node lists again, not L{reprobed}.
    @return: its new state, or L{None} to keep it: a shard gone stays
        gone, and one listed gone is left to its status.
    """
    state = listed_state(running)
    if shard.state.gone or state.gone:
        return None
    return state


def replica_record(
    running: pb.RunningShard, profile: Profile, now: float
) -> ReplicaRecord:
    """
    @return: the record of the replica C{running} is a shard of, made on
        its adoption at C{now} (reactor seconds), with no shard yet.
    """
    return ReplicaRecord(
        id=running.replica_id,
        model=running.model,
        profile=profile,
        shards=[],
        created=now,
        adopted=True,
    )


def shard_record(node_id: str, running: pb.RunningShard) -> ShardRecord:
    """
    @return: the record of C{running}, adopted on C{node_id}.
    """
    return ShardRecord(
        id=running.shard_id,
        node=node_id,
        gpus=tuple(running.gpu_indices),
        port=running.port,
        rank=running.rank,
        state=listed_state(running),
        pid=running.pid,
    )
