"""
The router's choice of replica, explained: for a request whose client asks
with C{X-LLMGW-Explain: 1}, or for every request with C{[router]
log_candidates = true} (the log at debug level), the candidates the
balancer weighed and what it weighed, in the request's JSON log line
(field C{candidates}, L{llmgw.router.accounting.usage_log}).

A candidate is a dict: C{replica} (its id), C{in_flight} (the router's own
count), C{waiting} and C{kv_use} (its engine's last fresh reading, L{None}
without one), C{speed} (the learnt speed factor, 1 before any),
C{weight} (configured), C{load} and C{score} (the C{load} policy's
C{(load + 1) / (weight x speed)}, lower is chosen), C{affinity_owner}
(whether the request's affinity key maps to it), C{ejected} and
C{chosen}.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from llmgw.router.routing.affinity import owner
from llmgw.router.routing.balancer import Balancer, Replica

HEADER = b"x-llmgw-explain"
"""
The request header asking for the candidates in the log line (any value
but C{0} or empty).
"""


def wanted(request: IRequest, always: bool) -> bool:
    """
    @param always: C{log_candidates}.
    @return: whether the request's log line carries the candidates.
    """
    if always:
        return True
    value = request.getHeader(HEADER)
    return value is not None and value.strip() not in (b"", b"0")


def candidates(
    balancer: Balancer,
    model: str,
    key: bytes | None,
    chosen: Replica | None,
    now: float,
) -> list[dict[str, Any]]:
    """
    @param key: the request's affinity key, or L{None}.
    @param chosen: the replica picked.
    @param now: the reactor's seconds.
    @return: one dict per replica of C{model} (see the module).
    """
    replicas = balancer.replicas_of(model)
    factors = balancer.speeds.factors(model) or {}
    board = balancer.load
    weights = [r.endpoint.weight * factors.get(r.id, 1.0) for r in replicas]
    owner_id = None
    if key is not None and balancer.affinity and replicas:
        i = owner(key, [(r.id, w) for r, w in zip(replicas, weights, strict=True)])
        owner_id = replicas[i].id
    out = []
    for replica, weight in zip(replicas, weights, strict=True):
        reading = board.reading(replica.id) if board is not None else None
        fresh = (
            reading is not None
            and board is not None
            and not board.stale(replica.id, now)
        )
        load = balancer.load_of(replica, now)
        out.append(
            {
                "replica": replica.id,
                "in_flight": replica.outstanding,
                "waiting": reading.waiting if fresh and reading else None,
                "kv_use": reading.kv_cache_usage if fresh and reading else None,
                "speed": round(factors.get(replica.id, 1.0), 3),
                "weight": replica.endpoint.weight,
                "load": load,
                "score": round((load + 1) / weight, 3) if weight > 0 else None,
                "affinity_owner": replica.id == owner_id,
                "ejected": replica.ejected_until > now,
                "chosen": replica is chosen,
            }
        )
    return out
