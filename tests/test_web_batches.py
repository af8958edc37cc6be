"""
The dashboard's batches page (L{llmgw.web.batches}, C{/batches} of
L{llmgw.web.pages}) and the batch tokens a second the dashboard's sampler
reads (L{llmgw.web.history}), on a L{Clock}.  The browser test
(L{tests.test_e2e_dashboard_batches}) drives the same page through a
running server.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.batches.tally import BatchTally
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.web.batches import BatchesView
from llmgw.web.history import History
from llmgw.web.pages import CookieCsrf, Dashboard
from tests.test_batch_tally import _Store, batch
from tests.test_web import _Actions
from tests.typing_support import stub_treq


class BatchTokensSampledTests(SynchronousTestCase):
    def test_batch_tokens_per_second(self) -> None:
        """
        Each tick turns the batch lines' token counter into tokens a
        second since the last tick; a client's own request's tokens count
        in none.
        """
        clock = Clock()
        metrics = RouterMetrics(CollectorRegistry())
        history = History(clock, metrics, None, None, wall_clock=clock.seconds)
        history.startService()
        metrics.finished("m", 200, 0.1, None, 20, 30, batch=True)
        metrics.finished("m", 200, 0.1, None, 500, 500)
        clock.advance(5)
        self.assertEqual(history.points[-1].batch_tokens, 10.0)
        clock.advance(5)
        self.assertEqual(history.points[-1].batch_tokens, 0.0)
        history.stopService()
        self.assertEqual(clock.getDelayedCalls(), [])


class BatchesPageTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.store = _Store()
        self.store.batches = [batch("batch_a"), batch("batch_b", "cancelling", 2.0)]
        self.store.lines = {
            "batch_a": {"pending": 6, "running": 2, "done": 11, "failed": 1},
            "batch_b": {"cancelled": 4},
        }
        self.tally = BatchTally(self.clock, self.store, wall_clock=self.clock.seconds)
        self.metrics = RouterMetrics(CollectorRegistry())
        self.history = History(
            self.clock, self.metrics, None, None, wall_clock=self.clock.seconds
        )
        self.view = BatchesView(self.tally, self.history, self.clock.seconds)

    def tearDown(self) -> None:
        for service in (self.tally, self.history):
            if service.running:
                service.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_rows_and_tokens(self) -> None:
        """
        One row per active batch, the oldest first, with its key,
        endpoint, status, lines by state and progress (lines ended of
        all); every batch's lines together; the batch tokens a second
        over the last minute.
        """
        self.tally.startService()
        self.history.startService()
        self.metrics.finished("m", 200, 0.1, None, 100, 200, batch=True)
        self.clock.advance(5)
        page = self.view.page()
        first, second = page["batches"]
        self.assertEqual(
            (first["id"], first["key"], first["endpoint"], first["status"]),
            ("batch_a", "team", "/v1/chat/completions", "in_progress"),
        )
        progress = (first["ended"], first["total"], first["percent"])
        self.assertEqual(progress, (12, 20, 60))
        self.assertEqual(first["lines"]["running"], 2)
        self.assertEqual((second["id"], second["percent"]), ("batch_b", 100))
        self.assertEqual(page["lines"]["pending"], 6)
        self.assertEqual(page["lines"]["cancelled"], 4)
        self.assertEqual(page["tokens"], "60/s")
        self.assertEqual(page["read"], "read 0s ago")

    def call(self, dashboard: Dashboard, path: str) -> tuple[int, bytes]:
        treq = stub_treq(dashboard.app.resource())
        response = self.successResultOf(treq.request("GET", "http://admin" + path))
        return response.code, self.successResultOf(response.content())

    def test_page_served(self) -> None:
        """
        C{/batches} shows each batch's row with its counts and progress,
        and the fleet's batch tokens a second; its fragment is the main
        part alone; a dashboard without the view answers 404.
        """
        self.tally.startService()
        fleet: Any = None
        dashboard = Dashboard(fleet, _Actions(), CookieCsrf(), batches=self.view)
        code, body = self.call(dashboard, "/batches")
        self.assertEqual(code, 200)
        self.assertIn(b'<tr data-batch="batch_a">', body)
        self.assertIn(b'<td class="num pending">6</td>', body)
        self.assertIn(b'<td class="num done">11</td>', body)
        self.assertIn(b"12/20 \xc2\xb7 60%", body)
        self.assertIn(b'id="card-batch-tokens"', body)
        self.assertIn(b"<html", body)
        code, fragment = self.call(dashboard, "/batches?fragment=1")
        self.assertEqual(code, 200)
        self.assertNotIn(b"<html", fragment)
        self.assertIn(b'data-batch="batch_b"', fragment)
        code, _ = self.call(Dashboard(fleet, _Actions(), CookieCsrf()), "/batches")
        self.assertEqual(code, 404)
