"""
L{llmgw.batches.tally.BatchTally} on a L{Clock} with a store that answers
at once (or fails, or holds its answer), and the metrics
L{llmgw.batches.metrics.BatchCollector} serves from it.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.batches.metrics import BatchCollector
from llmgw.batches.tally import INTERVAL, BatchTally
from llmgw.store.batches import BatchRow
from tests.test_metrics_registry import scrape


def batch(batch_id: str, status: str = "in_progress", at: float = 1.0) -> BatchRow:
    return BatchRow(
        id=batch_id,
        key_id=7,
        key_name="team",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        completion_window="24h",
        status=status,
        created_at=at,
    )


class _Store:
    """
    The store's batch reads, from what the test sets; C{hold} makes the
    next reads wait for the test to fire them.
    """

    def __init__(self) -> None:
        self.batches: list[BatchRow] = []
        self.lines: dict[str, dict[str, int]] = {}
        self.reads = 0
        self.broken = False
        self.held: list[Deferred[list[BatchRow]]] = []
        self.hold = False

    def active_batches(self) -> Deferred[list[BatchRow]]:
        self.reads += 1
        if self.broken:
            return fail(OSError("database is locked"))
        if self.hold:
            d: Deferred[list[BatchRow]] = Deferred()
            self.held.append(d)
            return d
        return succeed(list(self.batches))

    def batch_line_totals(self) -> Deferred[dict[str, int]]:
        totals: dict[str, int] = {}
        for counts in self.lines.values():
            for state, count in counts.items():
                totals[state] = totals.get(state, 0) + count
        return succeed(totals)

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        return succeed(dict(self.lines.get(batch_id, {})))


class TallyTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.store = _Store()
        self.tally = BatchTally(
            self.clock, self.store, wall_clock=lambda: 1000.0 + self.clock.seconds()
        )

    def tearDown(self) -> None:
        if self.tally.running:
            self.successResultOf(self.tally.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_reads_at_start_and_every_interval(self) -> None:
        """
        The figures are read at start, then every L{INTERVAL} seconds: the
        active batches oldest first, each with its lines by state (every
        state, 0 where none), every active batch's lines together, the
        batches by status and when they were read.
        """
        self.store.batches = [batch("b2", at=2.0), batch("b1", "cancelling", 1.0)]
        self.store.lines = {"b1": {"cancelled": 3, "done": 1}, "b2": {"pending": 4}}
        self.tally.startService()
        figures = self.tally.figures
        self.assertEqual([b.id for b, _ in figures.batches], ["b1", "b2"])
        self.assertEqual(
            figures.batches[0][1],
            {
                "pending": 0,
                "running": 0,
                "done": 1,
                "failed": 0,
                "cancelled": 3,
                "expired": 0,
            },
        )
        self.assertEqual(figures.lines["pending"], 4)
        self.assertEqual(figures.lines["cancelled"], 3)
        self.assertEqual(figures.statuses["in_progress"], 1)
        self.assertEqual(figures.statuses["cancelling"], 1)
        self.assertEqual(figures.statuses["finalizing"], 0)
        self.assertEqual(figures.read_at, 1000.0)
        self.store.lines["b2"] = {"pending": 1, "running": 3}
        self.clock.advance(INTERVAL - 0.1)
        self.assertEqual(self.store.reads, 1)
        self.clock.advance(0.1)
        self.assertEqual(self.store.reads, 2)
        self.assertEqual(self.tally.figures.lines["running"], 3)
        self.assertEqual(self.tally.figures.read_at, 1000.0 + INTERVAL)

    def test_failed_read_keeps_last_figures(self) -> None:
        """
        A read that fails is logged once, however many fail after it, and
        the last figures stay; the loop goes on, and the next good read
        replaces them.
        """
        self.store.batches = [batch("b1")]
        self.store.lines = {"b1": {"pending": 2}}
        self.tally.startService()
        self.store.broken = True
        self.clock.advance(INTERVAL)
        self.clock.advance(INTERVAL)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertEqual(self.tally.figures.lines["pending"], 2)
        self.assertEqual(self.tally.figures.read_at, 1000.0)
        self.store.broken = False
        self.store.lines = {"b1": {"done": 2}}
        self.clock.advance(INTERVAL)
        self.assertEqual(self.tally.figures.lines["done"], 2)
        self.assertEqual(self.tally.figures.lines["pending"], 0)

    def test_stop_waits_for_read_in_flight(self) -> None:
        """
        Reads never overlap (none starts while one waits for the store),
        and stopping waits for the read in flight.
        """
        self.store.hold = True
        self.tally.startService()
        self.clock.advance(3 * INTERVAL)
        self.assertEqual(self.store.reads, 1)
        stopped = self.tally.stopService()
        self.assertNoResult(stopped)
        self.store.held[0].callback([])
        self.successResultOf(stopped)

    def test_many_batches_counted_apart_up_to_a_bound(self) -> None:
        """
        Past L{MOST_SHOWN} active batches, the oldest are counted one by
        one and the rest only said to be there (C{more}); the totals
        count them all.
        """
        from llmgw.batches.tally import MOST_SHOWN

        count = MOST_SHOWN + 3
        self.store.batches = [batch(f"b{i:04}", at=float(i)) for i in range(count)]
        self.store.lines = {f"b{i:04}": {"pending": 1} for i in range(count)}
        self.tally.startService()
        figures = self.tally.figures
        self.assertEqual(len(figures.batches), MOST_SHOWN)
        self.assertEqual(figures.batches[0][0].id, "b0000")
        self.assertEqual(figures.more, 3)
        self.assertEqual(figures.lines["pending"], count)
        self.assertEqual(figures.statuses["in_progress"], count)


class CollectorTests(SynchronousTestCase):
    def test_series_from_first_scrape(self) -> None:
        """
        Before the first read: every line state and active status at 0,
        the figures' age NaN; after one, the lines and statuses read and
        the seconds since.
        """
        clock = Clock()
        store = _Store()
        now = [500.0]
        tally = BatchTally(clock, store, wall_clock=lambda: now[0])
        registry = CollectorRegistry()
        registry.register(BatchCollector(tally, lambda: now[0]))
        found = scrape(registry)
        lines = {
            dict(labels)["state"]: value
            for (name, labels), value in found.items()
            if name == "llmgw_batch_lines"
        }
        self.assertEqual(
            lines,
            dict.fromkeys(
                ("pending", "running", "done", "failed", "cancelled", "expired"), 0
            ),
        )
        statuses = {
            dict(labels)["status"]: value
            for (name, labels), value in found.items()
            if name == "llmgw_batches"
        }
        self.assertEqual(
            statuses,
            dict.fromkeys(("validating", "in_progress", "finalizing", "cancelling"), 0),
        )
        self.assertTrue(math.isnan(found[("llmgw_batch_figures_age_seconds", ())]))
        store.batches = [batch("b1")]
        store.lines = {"b1": {"pending": 5, "running": 2, "done": 9, "failed": 1}}
        tally.startService()
        now[0] = 503.0
        found = scrape(registry)
        self.assertEqual(found[("llmgw_batch_lines", (("state", "pending"),))], 5)
        self.assertEqual(found[("llmgw_batch_lines", (("state", "running"),))], 2)
        self.assertEqual(found[("llmgw_batch_lines", (("state", "done"),))], 9)
        self.assertEqual(found[("llmgw_batch_lines", (("state", "failed"),))], 1)
        self.assertEqual(found[("llmgw_batches", (("status", "in_progress"),))], 1)
        self.assertEqual(found[("llmgw_batch_figures_age_seconds", ())], 3.0)
        self.successResultOf(tally.stopService())
