"""
The control plane as the admin API shows it: JSON-ready dicts, read from
the records and the catalog, never changing them (except that asking
for a model's desired count applies its idle rule, as a pass would).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmgw.control.inventory import Inventory
from llmgw.control.phases import start_phases, start_seconds
from llmgw.control.placement import NoFit, place
from llmgw.control.plane import ControlPlane
from llmgw.control.records import (
    SWAP_REASONS,
    ReplicaRecord,
    ReplicaState,
    ShardRecord,
)

GIB = 1024**3


def shard_json(shard: ShardRecord) -> dict[str, Any]:
    """
    @return: id, node, gpus, port, rank, state, pid, last_error,
        C{share} (the fraction of its GPU's memory its engine was given when
        it shares the GPU; 0 for whole GPUs) and C{output_tail}: the
        engine's last output lines (at most 50) when it failed or was
        stopped before it served, else C{[]}.
    """
    return {
        "id": shard.id,
        "node": shard.node,
        "gpus": list(shard.gpus),
        "port": shard.port,
        "rank": shard.rank,
        "state": shard.state,
        "pid": shard.pid,
        "last_error": shard.error or None,
        "share": round(shard.share, 4),
        "output_tail": list(shard.output),
    }


def replica_json(replica: ReplicaRecord, now: float | None = None) -> dict[str, Any]:
    """
    @param now: the reactor's seconds, for the times in a state; L{None}:
        none shown.
    @return: id, model, profile, engine, state, adopted, last_error (why
        it failed, or L{None}), leaving (why it drains once a replacement
        is ready, or that it goes to sleep once its requests end, or
        L{None}: L{_leaving}), C{sleeping_seconds} (how long since it was
        told to sleep, while C{sleeping}; else L{None}),
        C{waking_seconds} (since told to wake, while C{waking}),
        C{start_seconds} (placement to ready, or L{None}) and C{phases}
        (where the start spent them, L{llmgw.control.phases.start_phases}),
        C{gpu_memory_gb} (GB it is counted to hold on each of its GPUs:
        its profile's, or what it keeps asleep), C{gpu_share} (the
        fraction of its GPU's memory it was given when it shares the GPU,
        0 for whole GPUs) and its shards (L{shard_json}) by rank.
    """
    state = replica.state
    asleep = replica.sleep_at if state == ReplicaState.SLEEPING else None
    waking = replica.wake_at if state == ReplicaState.WAKING else None
    return {
        "sleeping_seconds": _since(asleep, now),
        "waking_seconds": _since(waking, now),
        "id": replica.id,
        "model": replica.model,
        "profile": replica.profile.name,
        "engine": replica.profile.engine,
        "state": state,
        "adopted": replica.adopted,
        "last_error": replica.error or None,
        "leaving": _leaving(replica, state),
        "start_seconds": start_seconds(replica),
        "phases": start_phases(replica),
        # What it is counted to hold on each of its GPUs now, and its share.
        "gpu_memory_gb": _held_gb(replica),
        "gpu_share": max((s.share for s in replica.shards), default=0.0),
        "shards": [shard_json(s) for s in sorted(replica.shards, key=lambda s: s.rank)],
    }


def _leaving(replica: ReplicaRecord, state: ReplicaState) -> str | None:
    """
    @return: why it drains once a replacement is ready, or, told to
        sleep, that its requests in flight end first (its engine is not
        asleep yet); else L{None}.
    """
    if state == ReplicaState.SLEEPING and replica.sleep_sent_at is None:
        return "goes to sleep once its requests in flight end"
    if replica.leaving_since is not None and replica.draining_since is None:
        return replica.leaving_reason
    return None


def _since(at: float | None, now: float | None) -> float | None:
    return None if at is None or now is None else round(max(0.0, now - at), 1)


def replicas_json(plane: ControlPlane | None) -> list[dict[str, Any]]:
    """
    @return: every replica (L{replica_json}), by model then id, with each
        model's last failed one until the model is served again.
    """
    replicas = (
        [*plane.replicas.values(), *plane.failed.values()] if plane is not None else []
    )
    now = plane.clock.seconds() if plane is not None else None
    ordered = sorted(replicas, key=lambda r: (r.model, r.id))
    return [replica_json(r, now) for r in ordered]


def nodes_json(
    inventory: Inventory, plane: ControlPlane | None
) -> list[dict[str, Any]]:
    """
    @return: each node as L{Node.to_json} gives it; with a control plane,
        its C{shards} from the plane's records (current, where the
        Register's list is as of the agent's last connection), each with
        its model and replica.
    """
    nodes = [node.to_json() for node in inventory.nodes()]
    allocated: dict[tuple[str, int], float] = {}
    if plane is not None:
        shards: dict[str, list[dict[str, Any]]] = {}
        for replica in plane.replicas.values():
            for shard in replica.shards:
                shards.setdefault(shard.node, []).append(
                    {
                        **shard_json(shard),
                        "model": replica.model,
                        "replica": replica.id,
                        "gpu_memory_gb": _held_gb(replica),
                    }
                )
        for node in nodes:
            node["shards"] = shards.get(node["id"], [])
        allocated = {
            where: memory / 1024**2
            for where, (memory, _) in gpu_allocations(plane).items()
        }
    for node in nodes:
        _allocations(node, allocated)
    return nodes


def gpu_allocations(plane: ControlPlane) -> dict[tuple[str, int], tuple[float, int]]:
    """
    What the replicas placed on each GPU asked for, as
    C{llmgw_gpu_memory_allocated_bytes} and C{llmgw_gpu_shards} report it:
    each live shard (not gone) counts what placement counts it to hold
    on every GPU it holds: its profile's C{gpu_memory_gb}, or its
    C{sleep_gpu_memory_gb} asleep (GB read as GiB, as placement reads
    it); several replicas sharing a GPU each count theirs.

    @return: per C{(node id, GPU index)}, C{(bytes allocated, shards)};
        GPUs nothing holds are absent.
    """
    placed: dict[tuple[str, int], tuple[float, int]] = {}
    for replica in plane.replicas.values():
        need = _held_gb(replica) * GIB
        for shard in replica.shards:
            if shard.state.gone:
                continue
            for index in shard.gpus:
                memory, count = placed.get((shard.node, index), (0.0, 0))
                placed[shard.node, index] = (memory + need, count + 1)
    return placed


def _held_gb(replica: ReplicaRecord) -> float:
    """
    @return: GB C{replica} is counted to hold on each of its GPUs now (as
        L{llmgw.control.snapshot} counts it).
    """
    profile = replica.profile
    return profile.sleep_gpu_memory_gb if replica.asleep else profile.gpu_memory_gb


def _allocations(node: dict[str, Any], allocated: dict[tuple[str, int], float]) -> None:
    """
    Add to each GPU of C{node} C{memory_allocated_mib} (what the shards
    placed on it asked for, in MiB, from L{gpu_allocations}) and
    C{allocated} (a shard
    is placed on it), and to the node C{free_gpus}: its GPUs with no
    shard and no problem, those a placement may take whole.
    """
    free = 0
    for gpu in node["gpus"]:
        where = (node["id"], gpu["index"])
        gpu["allocated"] = where in allocated
        gpu["memory_allocated_mib"] = round(allocated.get(where, 0.0))
        free += not gpu["allocated"] and not gpu["problems"]
    node["free_gpus"] = free


def count_states(states: Iterable[str]) -> dict[str, int]:
    """
    @return: how many of each state.
    """
    counts: dict[str, int] = {}
    for state in states:
        counts[state] = counts.get(state, 0) + 1
    return counts


def swaps_of(plane: ControlPlane, model: str) -> dict[str, int]:
    """
    @return: the model's replicas swapped out since the server started,
        by reason (L{SWAP_REASONS}: each, 0 until counted), as
        C{llmgw_swaps_total} counts them.
    """
    swaps = plane.counts.swaps
    return {reason: swaps.get((model, reason), 0) for reason in SWAP_REASONS}


def models_json(plane: ControlPlane) -> list[dict[str, Any]]:
    """
    @return: each catalog model with its desired, ready and sleeping
        counts, C{pinned}, C{priority} and C{min_resident} (seconds) as
        they are now, and its C{swaps} by reason (L{swaps_of}); after a
        base, each of its LoRA adapters with the base's counts and
        C{base}, C{adapter}, C{rank}.
    """
    now = plane.clock.seconds()
    out = []
    for state in plane.catalog.states():
        model = state.model
        replicas = [r for r in plane.replicas.values() if r.model == model.name]
        out.append(
            {
                "name": model.name,
                "aliases": list(model.aliases),
                "min_replicas": model.min_replicas,
                "max_replicas": model.max_replicas,
                "idle_timeout": model.idle_timeout,
                "pinned": model.pinned,
                "priority": model.priority,
                "min_resident": model.min_resident,
                "sleeping": sum(
                    1 for r in replicas if r.state == ReplicaState.SLEEPING
                ),
                "swaps": swaps_of(plane, model.name),
                "desired": plane.desired(state, now),
                "ready": sum(1 for r in replicas if r.state == ReplicaState.READY),
                "replicas": len(replicas),
                "waiting_requests": len(state.waiters),
                "failures_in_a_row": state.failures,
                "retry_in": max(0.0, round(state.retry_at - now, 1)),
                "last_error": state.last_error or None,
                "unplaceable": plane.catalog.unplaceable(model.name),
                "profiles": [p.name for p in model.profiles],
                "max_loras": model.max_loras,
            }
        )
        base = out[-1]
        for adapter in plane.catalog.adapters_of(model.name):
            # An adapter runs on its base's replicas: their counts.
            out.append(
                {
                    **base,
                    "name": adapter.name,
                    "aliases": list(adapter.aliases),
                    "base": model.name,
                    "adapter": adapter.adapter,
                    "rank": adapter.rank,
                    "profiles": [],
                }
            )
    return out


def explain(plane: ControlPlane, name: str) -> dict[str, Any]:
    """
    @return: where a replica of the model would go now, or why it cannot
        go anywhere: one line per profile and node; under C{"eviction"},
        what was last evicted to make room for it and why (C{""}: none),
        and C{"eviction_seconds_ago"} how long ago (L{None}: none).
    @raise KeyError: not a catalog name.
    """
    model = plane.catalog[name].model
    result = place(model.profiles, plane.snapshot().fleet, plane.ports)
    evicted, at = plane.evicted.get(model.name, ("", None))
    ago = _since(at, plane.clock.seconds())
    if isinstance(result, NoFit):
        return {
            "model": model.name,
            "fits": False,
            "reasons": result.lines(),
            "eviction": evicted,
            "eviction_seconds_ago": ago,
        }
    return {
        "eviction": evicted,
        "eviction_seconds_ago": ago,
        "model": model.name,
        "fits": True,
        "profile": result.profile.name,
        "shards": [
            {"node": s.node, "gpus": list(s.gpus), "port": s.port, "rank": s.rank}
            for s in result.shards
        ],
        "reasons": [],
    }
