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


class Admin:
    """
    C{GET /metrics} (Prometheus text format), C{GET /healthz}, and
    C{GET /api/v1/nodes}.
    """

    app = Klein()

    def __init__(self, registry: CollectorRegistry, inventory: Inventory) -> None:
        self.registry = registry
        self.inventory = inventory

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
