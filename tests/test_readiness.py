"""
C{/readyz} and the models below their min_replicas: what the control
plane publishes reaches the router in the server (L{Readiness}) and a
router of a tier (the watch's C{below_min}, read by the follower); the
processes are in C{tests.test_e2e_drains}.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from llmgw.router.api.app import Router
from llmgw.router.interfaces import Endpoint, Readiness, RequestRecord, Shortfall
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.tier.follow import Follower
from llmgw.tier.watch import Watch
from tests.exchange_fakes import FakeAgent
from tests.typing_support import as_request, stub_treq

SHORT = Shortfall("chat", 0, 1)


class _Sink:
    def record(self, record: RequestRecord) -> None:
        pass


class ReadyzTests(SynchronousTestCase):
    def setUp(self) -> None:
        clock = Clock()
        self.balancer = Balancer(clock, 10.0)
        self.balancer.set_endpoints([Endpoint("r1", "http://a:1", ("other",))])
        self.readiness = Readiness()
        router = Router(
            clock,
            self.balancer,
            FakeAgent(),
            RouterConfig(),
            RouterMetrics(CollectorRegistry()),
            _Sink(),
            wall_clock=lambda: 0.0,
            readiness=self.readiness,
        )
        self.stub = stub_treq(router.resource())

    def readyz(self) -> tuple[int, Any]:
        d = self.stub.get("http://gw/readyz")
        self.stub.flush()
        response = self.successResultOf(d)
        body = self.successResultOf(response.content())
        return response.code, json.loads(body)

    def test_below_min_unavailable(self) -> None:
        """
        A model below its min_replicas (none of its replicas published) is
        listed as unavailable, with its counts, and the router is not
        ready; once it has them, ready again.
        """
        self.assertEqual(
            self.readyz(),
            (200, {"status": "ready", "unavailable": [], "below_min_replicas": []}),
        )
        self.readiness.set([SHORT])
        self.assertEqual(
            self.readyz(),
            (
                503,
                {
                    "status": "not ready",
                    "unavailable": ["chat"],
                    "below_min_replicas": [
                        {"model": "chat", "ready": 0, "min_replicas": 1}
                    ],
                },
            ),
        )
        self.readiness.set([])
        self.assertEqual(self.readyz()[0], 200)


def _lines(request: DummyRequest) -> list[Any]:
    data = b"".join(request.written)
    return [json.loads(line) for line in data.split(b"\n")[:-1] if line]


class TierTests(SynchronousTestCase):
    def test_watch_carries_below_min(self) -> None:
        """
        The watch pushes the models below their min_replicas when they
        change, and a follower hands them to its router's readiness; a
        line without them (an older server) means none.
        """
        clock = Clock()
        watch = Watch(clock, lambda: {"chat": "chat"})
        watch.startService()
        self.addCleanup(watch.stopService)
        request = DummyRequest([b""])
        watch.watch(as_request(request))
        watch.set_shortfalls([SHORT])
        watch.set_shortfalls([SHORT])
        first, second = _lines(request)
        self.assertEqual(first["below_min"], [])
        self.assertEqual(
            second["below_min"], [{"model": "chat", "ready": 0, "min_replicas": 1}]
        )
        readiness = Readiness()
        applied: list[object] = []
        follower = Follower(
            clock,
            None,  # type: ignore[arg-type]
            lambda e, n, k: applied.append(e),
            readiness.set,
        )
        follower._line(json.dumps(second).encode())
        self.assertEqual(readiness.below_min, (SHORT,))
        del second["below_min"]
        follower._line(json.dumps(second).encode())
        self.assertEqual(readiness.below_min, ())
        self.assertEqual(len(applied), 2)
