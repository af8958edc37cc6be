"""
The admin API's routes that read the server's state and change nothing:
its status, the nodes, the replicas, where a model would be placed, the
metrics and liveness.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.iweb import IRequest

from llmgw import __version__
from llmgw.admin.http import error_answers, json_answer, need_plane, not_found
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.control.views import count_states, explain, nodes_json, replicas_json
from llmgw.router.accounting.auth import KeyRing


def _placement_state(plane: ControlPlane | None) -> dict[str, Any] | None:
    """
    @return: what holds placements back, as C{GET /api/v1/status} says it.
    """
    if plane is None:
        return None
    grace = plane.settings.startup_grace
    left = plane.started + grace - plane.clock.seconds()
    if plane.grace_over or left <= 0:
        # Over, or over at the next pass (which ends it).
        return {"waiting_for": None}
    return {
        "waiting_for": "startup_grace",
        "seconds_left": round(left, 1),
        "startup_grace": grace,
    }


class StatusRoutes:
    """
    C{/api/v1/status}, C{/api/v1/nodes}, C{/api/v1/replicas},
    C{/api/v1/placement/<model>}, C{/metrics} and C{/healthz}.

    @param registry: the metrics served on C{/metrics}.
    @param inventory: the nodes.
    @param plane: the control plane, when there is one.
    @param keys: the API keys, when there is a store.
    @param wall_clock: POSIX seconds now (C{time.time}); the uptime counts
        from its reading at construction.
    @param standby: with standbys (L{llmgw.server.standby}), whether this
        server leads and the leader's agent address (C{{"leading": bool,
        "leader": "HOST:PORT"}}); L{None} for a server alone.
    """

    app = error_answers(Klein())

    def __init__(
        self,
        registry: CollectorRegistry,
        inventory: Inventory,
        plane: ControlPlane | None,
        keys: KeyRing | None,
        *,
        wall_clock: Callable[[], float],
        standby: Callable[[], dict[str, object]] | None,
    ) -> None:
        self._registry = registry
        self._inventory = inventory
        self._plane = plane
        self._keys = keys
        self._wall_clock = wall_clock
        self._standby = standby
        self._started = wall_clock()

    @app.route("/api/v1/status", methods=["GET"])
    def status(self, request: IRequest) -> bytes:
        """
        Version, uptime (seconds), node and replica counts by state,
        catalog size, key count, whether clients need a key, with
        standbys C{{"leading": bool, "leader": "HOST:PORT"}} (else null),
        and C{placement}: C{{"waiting_for": "startup_grace",
        "seconds_left": S, "startup_grace": S}} while the start-up grace
        holds every placement and scale-down back (C{[control]
        startup_grace}, from the start or from taking the lead), else
        C{{"waiting_for": null}}; null without a control plane.
        """
        plane = self._plane
        keys = self._keys
        nodes = count_states(n.state for n in self._inventory.nodes())
        replicas = count_states(
            r.state for r in (plane.replicas.values() if plane is not None else ())
        )
        models = len(plane.catalog.states()) if plane is not None else 0
        return json_answer(
            request,
            {
                "version": __version__,
                "uptime_seconds": round(self._wall_clock() - self._started, 1),
                "nodes": nodes,
                "replicas": replicas,
                "models": models,
                "keys": sum(1 for k in keys.keys() if k.revoked is None)
                if keys is not None
                else 0,
                "static_endpoints": len(plane.catalog.static_endpoints())
                if plane is not None
                else 0,
                "auth_required": bool(keys is not None and keys.required),
                "standby": self._standby() if self._standby is not None else None,
                "placement": _placement_state(plane),
            },
        )

    @app.route("/api/v1/nodes", methods=["GET"])
    def nodes(self, request: IRequest) -> bytes:
        """
        C{{"nodes": [...]}}, each node as L{Node.to_json} gives it.
        """
        nodes = nodes_json(self._inventory, self._plane)
        return json_answer(request, {"nodes": nodes})

    @app.route("/api/v1/replicas", methods=["GET"])
    def replicas(self, request: IRequest) -> bytes:
        """
        C{{"replicas": [...]}}: id, model, profile, engine, state, adopted,
        shards (id, node, gpus, port, rank, state, pid, last_error).
        """
        return json_answer(request, {"replicas": replicas_json(self._plane)})

    @app.route("/api/v1/placement/<path:model>", methods=["GET"])
    def placement(self, request: IRequest, model: str) -> bytes:
        """
        Where a replica of C{model} would be placed now, or C{reasons}: one
        line per profile and node saying why not.
        """
        plane = need_plane(self._plane)
        if plane.catalog.resolve(model) is None:
            raise not_found(f"model {model[:200]!r} in the catalog")
        return json_answer(request, explain(plane, model))

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self._registry)

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'
