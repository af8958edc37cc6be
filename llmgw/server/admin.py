"""
The admin listener: metrics and liveness, loopback-only by default.
"""

from __future__ import annotations

from klein import Klein
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.iweb import IRequest


class Admin:
    """
    C{GET /metrics} (Prometheus text format) and C{GET /healthz}.
    """

    app = Klein()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return b'{"status":"ok"}'
