"""
A batch's lines held for a model in the control plane (docs/batches.md,
"Batch work and interactive traffic"), on a L{Clock} (see
L{tests.plane_support}): a request held at L{BATCH_RANK} never evicts a
replica nor wakes a sleeper by evicting; a model only lines hold is
started or woken only where the fleet has free room, after every model
holding a client's request, and is never passed over for
C{swap_max_wait}.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.held_order import batch_only, held_order
from llmgw.router.interfaces import BATCH_RANK
from tests.test_plane_sleep import SleepCase, sleepy
from tests.test_plane_swaps import SwapCase, big


class HeldOrderTests(SynchronousTestCase):
    def test_lines_after_every_client(self) -> None:
        """
        A model holding only lines sorts after any holding a client's
        request, its lowest priority's too, however old its lines, and
        is never overdue; before models holding nothing.
        """
        lines = held_order(0.0, BATCH_RANK, overdue=True)
        self.assertLess(held_order(100.0, -5), lines)
        self.assertLess(held_order(100.0, 0), lines)
        self.assertLess(lines, held_order(None))
        self.assertLess(held_order(1.0, BATCH_RANK), held_order(2.0, BATCH_RANK))
        self.assertTrue(batch_only(BATCH_RANK))
        self.assertFalse(batch_only(0))
        self.assertFalse(batch_only(None))


class LineEvictsNothingTests(SwapCase):
    def test_line_waits_for_free_room(self) -> None:
        """
        C{a} idle on the only GPU, a line held for C{b}: nothing is
        evicted, even past C{swap_max_wait} (30 s); a client's request
        for C{b} then evicts C{a} at once.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.tick(10)
        line = self.plane.catalog.activate("b", priority=BATCH_RANK)
        for _ in range(40):
            self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(self.plane.swaps, {})
        self.assertEqual(self.of("b"), [])
        self.assertNoResult(line)
        self.plane.catalog.activate("b", priority=1)
        self.tick(1)
        self.assertIsNotNone(self.plane.replicas[a].draining_since)
        self.assertEqual(set(self.plane.swaps), {"b"})

    def test_line_started_where_free(self) -> None:
        """
        A free GPU elsewhere: the line's model is started there, its idle
        neighbour left alone.
        """
        self.make(big("a"), big("b"), nodes=("n1", "n2"))
        a = self.serve("a")
        self.tick(10)
        line = self.plane.catalog.activate("b", priority=BATCH_RANK)
        self.plane.reconcile()
        (b,) = self.of("b")
        self.assertNotEqual(
            self.plane.replicas[b].shards[0].node, self.plane.replicas[a].shards[0].node
        )
        self.ready_all()
        self.plane.reconcile()
        self.successResultOf(line)
        self.assertEqual(self.agents.stops(), [])

    def test_client_goes_first_even_behind_old_lines(self) -> None:
        """
        Lines held for C{c} for 40 s (past C{swap_max_wait}), then a
        client's request of the lowest named priority for C{b}: C{b} gets
        the room made, C{c} waits on.
        """
        self.make(big("a"), big("b"), big("c"), nodes=("n1",))
        self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("c", priority=BATCH_RANK, waited=40.0)
        self.clock.advance(1)
        self.plane.catalog.activate("b", priority=0)
        self.plane.reconcile()
        self.assertEqual(set(self.plane.swaps), {"b"})
        self.assertEqual(
            self.plane.catalog.where("c").words, "2nd in the swap queue, behind b"
        )


class LinesMakeNoReplicaBusyTests(SwapCase):
    def test_replica_serving_lines_goes_at_once(self) -> None:
        """
        C{a}'s only requests in flight are a batch's lines: a client's
        request for C{b} evicts it at once, as if idle (before
        C{swap_max_wait}); it stops once its lines end.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.in_flight[a] = self.lines[a] = 3
        self.tick(10)
        self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[a].draining_since)
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[a] = self.lines[a] = 0
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])

    def test_replica_serving_a_client_stays(self) -> None:
        """
        One of its requests is a client's: C{a} keeps its room until
        C{swap_max_wait}, as before.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.in_flight[a] = 3
        self.lines[a] = 2
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)


class LineWakesNothingByEvictingTests(SleepCase):
    def test_no_wake_by_evicting(self) -> None:
        """
        C{b} asleep where C{a} runs, idle: a line held for C{b} neither
        puts C{a} to sleep nor wakes C{b}; a client's request does both.
        """
        self.setup(sleepy("a"), sleepy("b"))
        self.serve("b")
        self.tick(10)
        self.serve_evicting("a")
        slept = self.sent("sleep_shard")
        line = self.plane.catalog.activate("b", priority=BATCH_RANK)
        for _ in range(40):
            self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), slept)
        self.assertEqual(self.sent("wake_shard"), [])
        self.assertNoResult(line)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(len(self.sent("sleep_shard")), len(slept) + 1)

    def serve_evicting(self, name: str) -> None:
        """
        A client's request for C{name} puts the other to sleep and
        starts C{name}.
        """
        waiter = self.plane.catalog.activate(name)
        self.tick(1)
        self.tick(1)
        self.ready_all()
        self.tick(1)
        self.successResultOf(waiter)
        self.tick(10)
