"""
Where a replica's start spent its time: C{placed} (placement until its
start command went out, on the server), then what its leader shard's agent
measured (C{launched}, C{port_open}, C{model_listed}, C{ready}, from
L{llmgw.agent.phases}) and the details of vLLM's log (loading the weights,
compiling), inside those phases.  The phases add up to the start time the
server measured (placement to ready), but for the link's transit and the
reconcile pass that saw it ready.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from llmgw.control.records import ReplicaRecord, ShardRecord
from llmgw.wire import agent_pb2 as pb

PHASES = ("placed", "launched", "port_open", "model_listed", "ready")
"""
A start's phases, in order.
"""

PHASE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""
The bounds of L{phases_histogram}, seconds.
"""


def agent_phases(status: pb.ShardStatus) -> tuple[tuple[str, float, bool], ...]:
    """
    @return: a C{ShardStatus}'s phases as (name, seconds, detail).
    """
    return tuple((p.name, p.seconds, p.detail) for p in status.phases)


def start_phases(replica: ReplicaRecord) -> list[dict[str, Any]]:
    """
    @return: C{{"phase", "seconds", "detail"}} for each phase of the
        replica's start, in order, then the details; empty until its leader
        shard's agent reported them (an adopted replica: never).
    """
    leader = replica.leader
    if leader is None or not leader.phases:
        return []
    placed = max(0.0, leader.sent_at - replica.created) if leader.sent_at else 0.0
    out = [{"phase": "placed", "seconds": placed, "detail": False}]
    out.extend(
        {"phase": name, "seconds": seconds, "detail": detail}
        for name, seconds, detail in leader.phases
    )
    return out


def start_seconds(replica: ReplicaRecord) -> float | None:
    """
    @return: seconds from placement to ready as the server saw them, or
        L{None} (not ready yet, or adopted).
    """
    if replica.ready_at is None or replica.adopted:
        return None
    return replica.ready_at - replica.created


def observe(
    observed: dict[tuple[str, str], list[float]],
    replica: ReplicaRecord,
    shard: ShardRecord,
) -> None:
    """
    Count a start's phases (not its details) once its leader reported
    them, per (model, phase) in C{observed}.
    """
    if shard is not replica.leader:
        return
    for phase in start_phases(replica):
        if not phase["detail"]:
            key = (replica.model, phase["phase"])
            observed.setdefault(key, []).append(phase["seconds"])


def phases_histogram(
    observed: dict[tuple[str, str], list[float]], models: Iterable[str]
) -> HistogramMetricFamily:
    """
    @param observed: per (model, phase), each start's seconds.
    @param models: the catalog's models, each shown with every phase.
    @return: C{llmgw_engine_start_phase_seconds}, labelled C{model} and
        C{phase}, with L{PHASE_BUCKETS} and C{+Inf}.
    """
    family = HistogramMetricFamily(
        "llmgw_engine_start_phase_seconds",
        "Seconds each phase of a replica's start took (placed, launched,"
        " port_open, model_listed, ready), by model.",
        labels=["model", "phase"],
    )
    keys = {(m, p) for m in models for p in PHASES} | set(observed)
    for model, phase in sorted(keys):
        values = observed.get((model, phase), [])
        buckets = [
            (floatToGoString(bound), sum(1 for v in values if v <= bound))
            for bound in PHASE_BUCKETS
        ]
        buckets.append(("+Inf", len(values)))
        family.add_metric([model, phase], buckets, sum(values))
    return family
