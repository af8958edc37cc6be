"""
The metrics-only listener (C{--metrics-listen}, C{metrics_listen}): C{GET
/metrics} and nothing else, so that it can be opened to a Prometheus
server on another machine without opening the admin API.  The admin
listener keeps its own C{/metrics}.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.http import Request
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site


class MetricsOnly(Resource):
    """
    C{GET} (or C{HEAD}) C{/metrics}: the registry in Prometheus text format;
    any other path 404, any other method on it 405.
    """

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.registry = registry

    def render(self, request: Request) -> bytes:
        request.setHeader(b"cache-control", b"no-store")
        if request.path != b"/metrics":
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"not found: this listener serves /metrics only\n"
        if request.method not in (b"GET", b"HEAD"):
            request.setResponseCode(405)
            request.setHeader(b"allow", b"GET, HEAD")
            return b""
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        return generate_latest(self.registry)


class QuietSite(Site):
    """
    A site that logs no access line per request (a scrape every few
    seconds, the admin API's polls).
    """

    def __init__(self, resource: IResource) -> None:
        super().__init__(resource)  # type: ignore[no-untyped-call]

    def log(self, request: Request) -> None:
        """
        No access line.
        """


def metrics_site(registry: CollectorRegistry) -> Site:
    """
    @return: the metrics-only listener's site, which logs no access line
        per scrape.
    """
    return QuietSite(MetricsOnly(registry))
