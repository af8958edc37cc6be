"""
The routers' traffic reported to their server (L{llmgw.router.telemetry.reports},
L{llmgw.tier.report}): a router's metrics and finished requests, as its
reports carry them, added to the server's scrape, its dashboard history's
samples and its dashboard figures; counted once however often a report is
sent again, and never going back when a router restarts.  The processes'
test is L{tests.test_e2e_tier_metrics}.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogEvent, LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.interfaces import RequestRecord
from llmgw.router.telemetry.metrics import MetricsRegistry, RouterMetrics
from llmgw.router.telemetry.reports import (
    LIVE,
    MAX_BATCHES,
    Reporter,
    Reports,
)
from llmgw.tier.report import LAST_REPORT_TIMEOUT, TrafficReports
from llmgw.web.history import History
from llmgw.web.traffic import Traffic
from tests.typing_support import collect


def _record(
    model: str = "m", status: int = 200, ttft: float | None = 0.25
) -> RequestRecord:
    return RequestRecord(
        request_id="r",
        upstream_request_id="u",
        model=model,
        replica="rep-1",
        status=status,
        stream=True,
        prompt_tokens=3,
        completion_tokens=2,
        latency=0.5,
        time_to_first_token=ttft,
    )


def _scrape(registry: MetricsRegistry) -> dict[tuple[str, tuple[Any, ...]], float]:
    """
    @return: every sample of a scrape, as Prometheus' text parser reads it.
    """
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _requests(registry: MetricsRegistry, status: str) -> float:
    key = ("llmgw_requests_total", (("model", "m"), ("status", status)))
    return _scrape(registry).get(key, 0.0)


class _Router:
    """
    A router's metrics and its reporter, counting as its router does.
    """

    def __init__(self) -> None:
        self.metrics = RouterMetrics(MetricsRegistry())
        self.reporter = Reporter(
            self.metrics.collectors(), lambda name: name if name == "m" else None
        )

    def finish(self, status: int = 200, ttft: float | None = 0.25) -> None:
        self.metrics.finished("m", status, 0.5, ttft, 3, 2)
        self.reporter.record(_record(status=status, ttft=ttft))

    def report(self) -> dict[str, Any]:
        payload = self.reporter.payload()
        assert payload is not None
        # What the wire carries.
        sent: dict[str, Any] = json.loads(json.dumps(payload))
        return sent


class ReportsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.registry = MetricsRegistry()
        self.server = RouterMetrics(self.registry)
        self.server.follow(lambda: ["m"], lambda: ["rep-1"])
        self.traffic = Traffic(self.clock.seconds, lambda n: n if n == "m" else None)
        self.reports = Reports(self.server.reported, self.traffic)

    def test_counted_on_the_servers_scrape(self) -> None:
        """
        A router's requests, by status, its tokens and its histograms'
        buckets, count on the server's scrape beside the server's own,
        as new samples where the server had none (status 500); the scrape
        still parses.
        """
        router = _Router()
        for status in (200, 200, 500):
            router.finish(status)
        self.server.finished("m", 200, 0.5, 0.25, 3, 2)
        self.assertGreater(self.reports.take(router.report()), 0)
        found = _scrape(self.registry)
        self.assertEqual(_requests(self.registry, "200"), 3.0)
        self.assertEqual(_requests(self.registry, "500"), 1.0)
        tokens = ("llmgw_tokens_total", (("kind", "prompt"), ("model", "m")))
        self.assertEqual(found[tokens], 12.0)
        count = ("llmgw_time_to_first_token_seconds_count", (("model", "m"),))
        self.assertEqual(found[count], 4.0)
        bucket = (
            "llmgw_time_to_first_token_seconds_bucket",
            (("le", "0.25"), ("model", "m")),
        )
        self.assertEqual(found[bucket], 4.0)

    def test_again_adds_nothing(self) -> None:
        """
        A report sent again (its answer lost) counts nothing more; what
        the router counts next is counted once.
        """
        router = _Router()
        router.finish()
        first = router.report()
        self.reports.take(first)
        self.reports.take(first)
        self.assertEqual(_requests(self.registry, "200"), 1.0)
        router.finish()
        again = router.report()
        self.reports.take(again)
        self.reports.take(again)
        self.assertEqual(_requests(self.registry, "200"), 2.0)
        self.assertEqual(self.traffic.figures(self.traffic.fleet, 60).requests, 2)

    def test_restart_goes_on(self) -> None:
        """
        A router that restarts (a new reporter counting from 0) adds to
        what the one before reported: the server's counter never goes
        back.
        """
        before = _Router()
        for _ in range(5):
            before.finish()
        self.reports.take(before.report())
        after = _Router()
        after.finish()
        self.reports.take(after.report())
        self.assertEqual(_requests(self.registry, "200"), 6.0)

    def test_only_changes_sent(self) -> None:
        """
        Once the server took a report, the next says only what changed;
        with nothing new, there is no report.
        """
        router = _Router()
        router.finish()
        payload = router.report()
        router.reporter.delivered(payload)
        self.assertIsNone(router.reporter.payload())
        router.metrics.retries.labels("m").inc()
        (family,) = router.report()["metrics"]
        self.assertEqual(family["family"], "llmgw_retries")
        self.assertEqual(
            family["samples"], [["llmgw_retries_total", {"model": "m"}, 1.0]]
        )

    def test_unacknowledged_said_again(self) -> None:
        """
        A report the server did not take is said again in the next, with
        the traffic batches since (at most L{MAX_BATCHES}).
        """
        router = _Router()
        router.finish()
        router.report()
        router.finish(500)
        payload = router.report()
        self.assertEqual([b["seq"] for b in payload["traffic"]], [1, 2])
        self.reports.take(payload)
        self.assertEqual(_requests(self.registry, "500"), 1.0)
        figures = self.traffic.figures(self.traffic.models["m"], 60)
        self.assertEqual((figures.requests, figures.errors), (2, 1))
        for _ in range(MAX_BATCHES + 5):
            router.finish()
            payload = router.report()
        self.assertEqual(len(payload["traffic"]), MAX_BATCHES)

    def test_dashboard_figures(self) -> None:
        """
        The dashboard's figures and its history's samples count what the
        routers reported: requests, the 5xx share, times to first token.
        """
        history = History(
            self.clock, self.server, None, None, wall_clock=self.clock.seconds
        )
        history.sample()
        router = _Router()
        for status in [200] * 9 + [500]:
            router.finish(status)
        self.reports.take(router.report())
        figures = self.traffic.figures(self.traffic.replicas["rep-1"], 60)
        self.assertEqual((figures.requests, figures.errors), (10, 1))
        self.assertEqual(figures.error_rate, 0.1)
        self.assertEqual(figures.streams, 9)
        assert figures.ttft_p50 is not None
        self.assertTrue(abs(figures.ttft_p50 - 0.25) < 0.25 * 0.05, figures)
        self.clock.advance(5)
        history.sample()
        (point,) = history.points
        self.assertEqual((point.rate, point.error_rate), (2.0, 0.1))
        self.assertEqual(point.ttft, 0.25)

    def test_gauges_while_live(self) -> None:
        """
        A router's requests in flight count while it reported within
        L{LIVE} seconds.
        """
        clock = Clock()
        metrics = RouterMetrics(MetricsRegistry())
        registry = MetricsRegistry()
        reports = Reports(RouterMetrics(registry, clock.seconds).reported, None)
        metrics.in_flight.inc(3)
        reporter = Reporter(metrics.collectors(), lambda n: n)
        reports.take(json.loads(json.dumps(reporter.payload())))
        key = ("llmgw_requests_in_flight", ())
        self.assertEqual(_scrape(registry)[key], 3.0)
        clock.advance(LIVE + 1)
        self.assertEqual(_scrape(registry)[key], 0.0)

    def test_ejections_of_replicas_gone_dropped(self) -> None:
        """
        The ejections reported for a replica are dropped with the
        replica, as the server's own are.
        """
        router = _Router()
        router.metrics.ejections.labels("rep-2").inc()
        replicas = ["rep-1", "rep-2"]
        self.server.follow(lambda: ["m"], lambda: replicas)
        self.reports.take(router.report())
        key = ("llmgw_replica_ejections_total", (("replica", "rep-2"),))
        self.assertEqual(_scrape(self.registry)[key], 1.0)
        replicas.remove("rep-2")
        self.assertNotIn(key, _scrape(self.registry))

    def test_not_a_report(self) -> None:
        """
        A body that is not a report is refused with what is wrong, and
        nothing of it is counted.
        """
        router = _Router()
        router.finish()
        good = router.report()
        bad: list[tuple[Any, str]] = [
            ([], "JSON object"),
            ({**good, "reporter": ""}, "reporter"),
            (
                {**good, "metrics": [{"family": "llmgw_nodes", "type": "gauge"}]},
                "no 'gauge' family 'llmgw_nodes'",
            ),
            (
                {
                    **good,
                    "metrics": [
                        {
                            "family": "llmgw_retries",
                            "type": "counter",
                            "samples": [["llmgw_retries_total", {"model": "m"}, -1]],
                        }
                    ],
                },
                "finite number, 0 or more",
            ),
            (
                {**good, "traffic": [{"seq": 1, "series": [{"model": "m"}]}]},
                "requests",
            ),
        ]
        for body, words in bad:
            with self.assertRaises(ValueError) as raised:
                self.reports.take(body)
            self.assertIn(words, str(raised.exception))
        self.assertEqual(_requests(self.registry, "200"), 0.0)


class _Control:
    """
    The admin client's C{post}, answered by the test.
    """

    url = "http://control"

    def __init__(self) -> None:
        self.posts: list[tuple[str, Any, Deferred[tuple[int, Any]]]] = []

    def post(self, path: str, body: Any) -> Deferred[tuple[int, Any]]:
        answer: Deferred[tuple[int, Any]] = Deferred()
        self.posts.append((path, body, answer))
        return answer


class TrafficReportsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.control = _Control()
        self.router = _Router()
        self.service = TrafficReports(
            self.clock,
            self.control,  # type: ignore[arg-type]
            self.router.reporter,
        )
        self.logged: list[LogEvent] = []
        observer = collect(self.logged)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def warnings(self) -> list[LogEvent]:
        return [e for e in self.logged if e.get("log_level") == LogLevel.warn]

    def test_reports_each_interval(self) -> None:
        """
        A report each second while there is something to say, one at a
        time; none while a post is unanswered.
        """
        self.service.startService()
        self.router.finish()
        self.clock.advance(1)
        ((path, body, answer),) = self.control.posts
        self.assertEqual(path, "/api/v1/report")
        self.assertEqual(body["traffic"][0]["series"][0]["requests"], 1)
        self.clock.advance(1)
        self.assertEqual(len(self.control.posts), 1)
        answer.callback((200, {"taken": 1}))
        self.clock.advance(1)
        self.assertEqual(len(self.control.posts), 1)
        self.service.stopService()

    def test_failing_logged_once(self) -> None:
        """
        Reports that fail give one warning however many follow, and one
        line when one is taken again; what they said is said again.
        """
        self.service.startService()
        self.router.finish()
        for _ in range(3):
            self.clock.advance(1)
            self.control.posts[-1][2].errback(ConnectionRefusedError("refused"))
        self.assertEqual(len(self.warnings()), 1)
        self.assertIn("cannot report traffic", self.warnings()[0]["log_format"])
        self.clock.advance(1)
        _, body, answer = self.control.posts[-1]
        self.assertEqual(body["traffic"][0]["series"][0]["requests"], 1)
        answer.callback((200, {"taken": 1}))
        self.assertIn("taken again", self.logged[-1]["log_format"])
        self.service.stopService()

    def test_stop_sends_the_last(self) -> None:
        """
        The stop sends what is left and waits for its answer, at most
        L{LAST_REPORT_TIMEOUT} seconds.
        """
        self.service.startService()
        self.router.finish()
        stopped = self.service.stopService()
        self.assertEqual(len(self.control.posts), 1)
        self.assertNoResult(stopped)
        self.control.posts[0][2].callback((200, {}))
        self.successResultOf(stopped)

        self.router.finish()
        self.service.startService()
        stopped = self.service.stopService()
        self.assertNoResult(stopped)
        self.clock.advance(LAST_REPORT_TIMEOUT)
        self.successResultOf(stopped)
        self.assertEqual(self.clock.getDelayedCalls(), [])
