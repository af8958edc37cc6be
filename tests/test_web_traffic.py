"""
The dashboard's numbers on a L{Clock}: traffic counted per model and
replica in slots and read over windows (L{llmgw.web.traffic}), the
charts' axes (L{llmgw.web.history.chart}) and the GPU rows' memory
(L{llmgw.web.fleet}) against the metrics'.  The browser test
(L{tests.test_e2e_dashboard_numbers}) reads the same through a running
fleet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.inventory import Inventory
from llmgw.control.metrics import FleetCollector
from llmgw.control.views import gpu_allocations
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.web.fleet import Fleet
from llmgw.web.history import History, chart, nice_top
from llmgw.web.traffic import KEPT, OTHER, RATIO, SLOT, Traffic, bucket, percentile
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase
from tests.test_web import _keys


@dataclass(frozen=True)
class _Record:
    model: str
    replica: str | None
    status: int = 200
    stream: bool = True
    time_to_first_token: float | None = 0.1
    usage_estimated: bool = False


def _resolve(name: str) -> str | None:
    return {"m": "m", "m-alias": "m", "n": "n"}.get(name)


class TrafficTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.traffic = Traffic(self.clock.seconds, _resolve)

    def test_window_figures(self) -> None:
        """
        Over a window: requests per second of the seconds covered, the
        share answered 5xx, and the streams' times to first token at p50
        and p95; per model (aliases under their model, unknown names
        under L{OTHER}) and per replica (none for a request no replica
        answered).
        """
        t = self.traffic
        for i in range(60):
            # One a second for a minute, every tenth a 502 from r2.
            t.record(
                _Record(
                    "m-alias" if i % 2 else "m",
                    "r2" if i % 10 == 0 else "r1",
                    502 if i % 10 == 0 else 200,
                    time_to_first_token=2.0 if i % 20 == 5 else 0.2,
                )
            )
            self.clock.advance(0.9)
        t.record(_Record("nosuch", None, 404, time_to_first_token=None))
        t.record(_Record("n", None, 503, stream=False, time_to_first_token=None))
        m = t.figures(t.models["m"], 60)
        self.assertEqual((m.requests, m.errors), (60, 6))
        self.assertAlmostEqual(m.covered, 54.0)
        self.assertAlmostEqual(m.rate, 60 / 54)
        self.assertEqual(m.error_rate, 0.1)
        # Streams answered 5xx have no time to first token here.
        self.assertEqual(m.streams, 54)
        assert m.ttft_p50 is not None and m.ttft_p95 is not None
        self.assertLess(abs(m.ttft_p50 / 0.2 - 1), RATIO - 1)
        self.assertLess(abs(m.ttft_p95 / 2.0 - 1), RATIO - 1)
        r2 = t.figures(t.replicas["r2"], 60)
        self.assertEqual((r2.requests, r2.error_rate, r2.ttft_p50), (6, 1.0, None))
        self.assertEqual(t.figures(t.replicas["r1"], 60).requests, 54)
        self.assertEqual(set(t.models), {"m", "n", OTHER})
        self.assertEqual(set(t.replicas), {"r1", "r2"})
        fleet = t.figures(t.fleet, 60)
        self.assertEqual((fleet.requests, fleet.errors), (62, 7))
        nothing = t.figures(None, 60)
        self.assertEqual((nothing.rate, nothing.error_rate), (0.0, None))

    def test_window_is_the_last_slots(self) -> None:
        """
        A window holds the current slot and the ones before it back to
        its length; the covered seconds count from the start while the
        record is younger than the window.
        """
        t = self.traffic
        t.record(_Record("m", "r1"))
        self.clock.advance(30)
        first = t.figures(t.fleet, 60)
        self.assertEqual(first.requests, 1)
        self.assertAlmostEqual(first.covered, 30)
        self.clock.advance(60)
        t.record(_Record("m", "r1"))
        later = t.figures(t.fleet, 60)
        self.assertEqual(later.requests, 1)
        self.assertTrue(60 - SLOT <= later.covered <= 60, later.covered)
        self.assertEqual(t.figures(t.fleet, 300).requests, 2)

    def test_reads_follow_new_requests(self) -> None:
        """
        A window read twice in one slot counts the requests finished in
        between, and again once the next slot has begun; a clock that went
        back counts into the newest slot.
        """
        t = self.traffic
        t.record(_Record("m", "r1"))
        self.clock.advance(SLOT)
        t.record(_Record("m", "r1"))
        self.assertEqual([f.requests for f in t.windows(t.fleet)], [2, 2])
        t.record(_Record("m", "r1", 500))
        self.assertEqual([f.errors for f in t.windows(t.fleet)], [1, 1])
        self.clock.advance(SLOT)
        t.record(_Record("m", "r1"))
        self.assertEqual([f.requests for f in t.windows(t.fleet)], [4, 4])
        self.clock.advance(-3 * SLOT)
        t.record(_Record("m", "r1"))
        self.clock.advance(3 * SLOT)
        self.assertEqual(t.figures(t.fleet, 60).requests, 5)
        indexes = [s.index for s in t.fleet.slots]
        self.assertEqual(indexes, sorted(indexes))

    def test_old_slots_and_series_go(self) -> None:
        """
        Slots older than L{KEPT} go; a replica (or model) with none left
        is forgotten at the next slot's first request.
        """
        t = self.traffic
        t.record(_Record("m", "gone"))
        self.clock.advance(KEPT + SLOT)
        t.record(_Record("n", "r1"))
        self.assertNotIn("gone", t.replicas)
        self.assertNotIn("m", t.models)
        self.assertLessEqual(len(t.fleet.slots), KEPT / SLOT)

    def test_timeline(self) -> None:
        """
        The timeline has one point per complete slot since the start,
        oldest first, each with its age: L{None} for a slot with nothing.
        """
        t = self.traffic
        t.record(_Record("m", "r1"))
        self.clock.advance(3 * SLOT)
        t.record(_Record("m", "r1"))
        line = t.timeline(t.models["m"])
        self.assertEqual(len(line), 3)
        ages = [age for age, _ in line]
        self.assertEqual(ages, sorted(ages, reverse=True))
        self.assertEqual([s.requests if s else 0 for _, s in line], [1, 0, 0])

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.floats(0.001, 600.0), min_size=1, max_size=300),
        st.sampled_from([0.5, 0.95, 0.99]),
    )
    def test_percentile_within_a_bucket(self, times: list[float], share: float) -> None:
        """
        A percentile read from the buckets is within half a bucket (the
        square root of L{RATIO}: 2.5 %) of the exact nearest-rank one.
        """
        counts: dict[int, int] = {}
        for seconds in times:
            counts[bucket(seconds)] = counts.get(bucket(seconds), 0) + 1
        exact = sorted(times)[max(1, math.ceil(share * len(times))) - 1]
        found = percentile(counts, share)
        assert found is not None
        half = math.sqrt(RATIO) * 1.000001
        self.assertLessEqual(found / exact, half)
        self.assertGreaterEqual(found / exact, 1 / half)


class ChartTests(SynchronousTestCase):
    def test_axes_and_labels(self) -> None:
        """
        A chart labels its time axis from -10m to now and its value axis
        at 0, half and a round top above the largest value; a L{None}
        breaks the line.
        """
        svg = chart(
            [(540.0, 1.0), (480.0, None), (300.0, 3.2), (5.0, 3.0)],
            lambda v: f"{v:g}/s",
        )
        labels = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
        for label in ("-10m", "-8m", "-2m", "now", "0/s", "2.5/s", "5/s"):
            self.assertIn(label, labels)
        # The lone point before the gap is a dot; the rest one line.
        self.assertEqual(svg.count("<circle"), 1)
        self.assertEqual(svg.count("<polyline"), 1)
        self.assertIn("&lt;b&gt;", chart([(1.0, 1.0)], lambda v: "<b>"))

    def test_nice_top(self) -> None:
        """
        The top line is the least of 1, 2, 2.5, 5 times a power of ten
        at or above the value.
        """
        self.assertEqual(
            [nice_top(v) for v in (0, 0.07, 1, 1.2, 2.2, 3, 7, 10.5, 430)],
            [1, 0.1, 1, 2, 2.5, 5, 10, 20, 500],
        )


class KeyChartTests(SynchronousTestCase):
    def test_key_rows_chart_tokens_with_axes(self) -> None:
        """
        The keys page charts each key's tokens per sample with its axes:
        -10m to now, 0 to a round top above the most tokens in a sample.
        """
        clock = Clock()
        keys = _keys()
        history = History(
            clock,
            RouterMetrics(CollectorRegistry()),
            None,
            keys,
            wall_clock=clock.seconds,
        )
        key = keys.find("app")
        assert key is not None
        for used in (0, 40, 40, 130):
            key.tokens_used = used
            history.sample_keys(keys)
        fleet = Fleet(Inventory(), None, keys, history, None)
        (row,) = [r for r in fleet.key_rows() if r["name"] == "app"]
        labels = re.findall(r"<text[^>]*>([^<]*)</text>", row["svg"])
        for label in ("-10m", "now", "0", "50", "100"):
            self.assertIn(label, labels)


class _Hub:
    reconnects = 0


class GpuRowTests(PlaneCase):
    def test_allocated_as_the_metrics_have_it(self) -> None:
        """
        Each GPU's allocated memory is what C{llmgw_gpu_memory_allocated_bytes}
        reports for it; a measured GPU shows what its agent measured in use,
        a simulated one nothing.
        """
        self.make(nodes=())
        self.register("n1", gpus=2)
        message = pb.Register(
            node_id="n2",
            gpus=[
                pb.Gpu(
                    index=0,
                    name="H100",
                    memory_total_mib=80 * 1024,
                    memory_used_mib=30 * 1024,
                ),
                pb.Gpu(index=1, name="sim", memory_total_mib=80 * 1024, simulated=True),
            ],
        )
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered("n2", message)
        self.plane.reconcile()
        self.ready_all()
        metric = {
            (s.labels["node"], int(s.labels["gpu"])): s.value
            for family in FleetCollector(self.plane, _Hub()).collect()  # type: ignore[arg-type]
            if family.name == "llmgw_gpu_memory_allocated_bytes"
            for s in family.samples
        }
        held = gpu_allocations(self.plane)
        self.assertEqual(
            {k: v for k, v in metric.items() if v}, {k: b for k, (b, _) in held.items()}
        )
        self.assertTrue(held)
        history = History(
            self.clock,
            RouterMetrics(CollectorRegistry()),
            self.plane,
            None,
            wall_clock=self.clock.seconds,
        )
        fleet = Fleet(self.inventory, self.plane, None, history, None)
        rows = {
            (n["id"], g["index"]): g
            for n in fleet.overview()["nodes"]
            for g in n["gpus"]
        }
        for key, gpu in rows.items():
            self.assertEqual(gpu["allocated_gib"] * 1024**3, metric[key])
            self.assertEqual(gpu["allocated"], metric[key] > 0)
        self.assertEqual(rows["n2", 0]["used_gib"], 30)
        self.assertEqual(rows["n2", 0]["used_percent"], 38)
        self.assertIsNone(rows["n2", 1]["used_gib"])
        self.assertTrue(rows["n2", 1]["simulated"])
