"""
The admin listener: metrics, liveness and the admin API, loopback-only by
default.
"""

from __future__ import annotations

import json

from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.iweb import IRequest

from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane


def _json(request: IRequest, value: object, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(value).encode("utf-8")


def _not_found(request: IRequest, what: str) -> bytes:
    return _json(
        request, {"error": {"message": f"no {what}", "code": "not_found"}}, 404
    )


class Admin:
    """
    C{GET /metrics} (Prometheus text format), C{GET /healthz}, and the
    admin API under C{/api/v1}: nodes, replicas, models, placement, drain.
    Errors are C{{"error": {"message", "code"}}}.
    """

    app = Klein()

    def __init__(
        self,
        registry: CollectorRegistry,
        inventory: Inventory,
        plane: ControlPlane | None = None,
    ) -> None:
        self.registry = registry
        self.inventory = inventory
        self.plane = plane

    @app.route("/api/v1/replicas", methods=["GET"])
    def replicas(self, request: IRequest) -> bytes:
        """
        C{{"replicas": [...]}}: id, model, profile, engine, state, adopted,
        shards (id, node, gpus, port, rank, state, pid, last_error).
        """
        replicas = self.plane.replicas.values() if self.plane is not None else ()
        return _json(
            request,
            {
                "replicas": [
                    r.to_json() for r in sorted(replicas, key=lambda r: (r.model, r.id))
                ]
            },
        )

    @app.route("/api/v1/models", methods=["GET"])
    def models(self, request: IRequest) -> bytes:
        """
        C{{"models": [...]}}: each catalog model with C{desired} and
        C{ready} replica counts.
        """
        plane = self.plane
        return _json(request, {"models": plane.models_json() if plane else []})

    @app.route("/api/v1/placement/<path:model>", methods=["GET"])
    def placement(self, request: IRequest, model: str) -> bytes:
        """
        Where a replica of C{model} would be placed now, or C{reasons}: one
        line per profile and node saying why not.
        """
        if self.plane is None or self.plane.resolve(model) is None:
            return _not_found(request, f"model {model!r} in the catalog")
        return _json(request, self.plane.explain(model))

    @app.route("/api/v1/nodes/<node_id>/drain", methods=["POST"])
    def drain_node(self, request: IRequest, node_id: str) -> bytes:
        """
        Drain a node: no new placements on it; its replicas stop taking
        requests, finish those in flight (up to C{[control]
        drain_timeout}), then stop, and are placed elsewhere.
        """
        if self.plane is None:
            return _not_found(request, f"node {node_id!r}")
        try:
            drained = self.plane.drain_node(node_id)
        except KeyError:
            return _not_found(request, f"node {node_id!r}")
        return _json(request, {"node": node_id, "draining_replicas": drained})

    @app.route("/api/v1/replicas/<replica_id>/drain", methods=["POST"])
    def drain_replica(self, request: IRequest, replica_id: str) -> bytes:
        """
        Drain one replica; its model gets another if it needs one.
        """
        if self.plane is None:
            return _not_found(request, f"replica {replica_id!r}")
        try:
            started = self.plane.drain_replica(replica_id)
        except KeyError:
            return _not_found(request, f"replica {replica_id!r}")
        return _json(
            request,
            {"replica": replica_id, "draining": True, "was_draining": not started},
        )

    @app.route("/api/v1/nodes", methods=["GET"])
    def nodes(self, request: IRequest) -> bytes:
        """
        C{{"nodes": [...]}}, each node as L{Node.to_json} gives it.
        """
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(
            {"nodes": [node.to_json() for node in self.inventory.nodes()]}
        ).encode("utf-8")

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'
