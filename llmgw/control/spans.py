"""
The control plane's OpenTelemetry spans (C{[tracing]}, L{llmgw.router.telemetry.tracing}
makes the tracer): C{llmgw.start} for each replica started, placement to
ready, with a child span per phase (C{llmgw.placement} for its placement,
then the agent's C{launched}, C{port_open}, C{model_listed}, C{ready}, from
L{llmgw.control.phases}), and C{llmgw.drain} for each drain, its start to
the stop of its engines.  Spans are made once a start or drain is over,
with the times it had (reactor seconds, the wall clock's in production);
nothing is made when tracing is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.control.phases import start_phases
from llmgw.control.records import ReplicaRecord

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _attributes(replica: ReplicaRecord) -> dict[str, str]:
    leader = replica.leader
    return {
        "llmgw.replica": replica.id,
        "llmgw.model": replica.model,
        "llmgw.profile": replica.profile.name,
        "llmgw.engine": replica.profile.engine,
        "llmgw.node": leader.node if leader is not None else "",
    }


def trace_start(tracer: Tracer | None, replica: ReplicaRecord, now: float) -> None:
    """
    Export C{replica}'s start as C{llmgw.start} from its placement to
    C{now} (reactor seconds), a child span per phase laid end to end from
    the placement; nothing without a tracer or phases.
    """
    phases = start_phases(replica)
    if tracer is None or not phases:
        return
    from opentelemetry.trace import set_span_in_context

    start = tracer.start_span(
        "llmgw.start",
        start_time=_ns(replica.created),
        attributes=_attributes(replica),
    )
    context = set_span_in_context(start)
    at = replica.created
    for phase in phases:
        if phase["detail"]:
            continue
        name = "llmgw.placement" if phase["phase"] == "placed" else "llmgw.phase"
        span = tracer.start_span(
            name,
            context=context,
            start_time=_ns(at),
            attributes={"llmgw.phase": phase["phase"]},
        )
        at += phase["seconds"]
        span.end(end_time=_ns(at))
    for phase in phases:
        if phase["detail"]:
            start.set_attribute(f"llmgw.{phase['phase']}_seconds", phase["seconds"])
    start.end(end_time=_ns(max(now, at)))


def trace_drain(
    tracer: Tracer | None, replica: ReplicaRecord, now: float, in_flight: int
) -> None:
    """
    Export C{replica}'s drain as C{llmgw.drain}, from its start to C{now}
    (reactor seconds), when its engines are told to stop, with its reason
    and the requests still in flight then (cut).
    """
    if tracer is None or replica.draining_since is None:
        return
    span = tracer.start_span(
        "llmgw.drain",
        start_time=_ns(replica.draining_since),
        attributes={
            **_attributes(replica),
            "llmgw.drain.reason": replica.drain_reason,
            "llmgw.drain.cut_requests": in_flight,
        },
    )
    span.end(end_time=_ns(now))
