"""
Priorities and weighted fair shares where requests wait (issue 22 item
1), on a clock: the order of L{FairQueue}, the overload room's and the
activation queue's refusals, and the priority and weight of a key.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.admin.http import AdminError
from llmgw.admin.keys import _order_fields
from llmgw.control.catalog import Model
from llmgw.control.held_order import held_order, refused_first, release_turns
from llmgw.control.inventory import Inventory
from llmgw.control.runtime import RELEASE_GAP, ModelCatalog
from llmgw.router.errors import APIError
from llmgw.router.interfaces import ActivationRefused, Standing
from llmgw.router.routing.activation import ActivationQueues, ActivationWait
from llmgw.router.routing.fairness import (
    HALF_LIFE,
    FairQueue,
    FairShare,
    Tenant,
    check_weight,
    priority_rank,
    retry_from_rate,
)
from llmgw.router.routing.overload import Overload
from llmgw.router.settings import RouterConfig
from tests.test_activation import _Activator

BATCH = Tenant("bulk", priority_rank("batch"))
CHAT = Tenant("chat", priority_rank("interactive"))


class PriorityTests(SynchronousTestCase):
    def test_names_and_numbers(self) -> None:
        """
        Names map to numbers, higher first; integers and their digits
        stand; anything else is a ValueError naming what is expected.
        """
        self.assertGreater(priority_rank("interactive"), priority_rank("standard"))
        self.assertGreater(priority_rank("standard"), priority_rank("batch"))
        self.assertEqual(priority_rank(None), priority_rank("standard"))
        self.assertEqual(priority_rank("7"), 7)
        self.assertEqual(priority_rank(-3), -3)
        for bad in ("urgent", True, "1.5"):
            with self.assertRaises(ValueError) as caught:
                priority_rank(bad)
            self.assertIn("interactive, standard, batch", str(caught.exception))

    def test_weight(self) -> None:
        self.assertEqual(check_weight(2), 2.0)
        for bad in (0, -1, float("inf"), "2", None, True):
            with self.assertRaises(ValueError):
                check_weight(bad)


class FairQueueTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.shares = FairShare(self.clock)

    def test_priority_then_share_then_arrival(self) -> None:
        """
        A higher priority goes first; within one, the key served fewer
        tokens (per weight); then arrival.
        """
        queue: FairQueue[str] = FairQueue(self.shares)
        heavy, light = Tenant("heavy"), Tenant("light")
        self.shares.served(heavy, 1000)
        self.shares.served(light, 100)
        for tenant, item in ((heavy, "h1"), (heavy, "h2"), (light, "l1")):
            queue.push(tenant, item)
        queue.push(BATCH, "b1")
        queue.push(CHAT, "c1")
        order = [queue.pop()[1] for _ in range(5)]
        self.assertEqual(order, ["c1", "l1", "h1", "h2", "b1"])

    def test_same_tenant_oldest_first(self) -> None:
        """
        One tenant's requests go oldest first even on a clock that moves
        while the queue is read (the share's decay read at different
        instants once made the newest go first).
        """
        moving = _MovingClock()
        shares = FairShare(moving)
        tenant = Tenant("t")
        shares.served(tenant, 1000)
        queue: FairQueue[int] = FairQueue(shares)
        for n in range(5):
            queue.push(tenant, n)
        self.assertEqual([queue.pop()[1] for _ in range(5)], [0, 1, 2, 3, 4])

    def test_weight_scales_share(self) -> None:
        """
        A key of weight 10 served 10 times the tokens of a key of weight 1
        goes before one served more than a tenth of its tokens.
        """
        queue: FairQueue[str] = FairQueue(self.shares)
        big, small = Tenant("big", weight=10), Tenant("small")
        self.shares.served(big, 900)
        self.shares.served(small, 100)
        queue.push(small, "s")
        queue.push(big, "b")
        self.assertEqual(queue.pop()[1], "b")

    def test_share_decays(self) -> None:
        """
        Tokens served count half after L{HALF_LIFE}.
        """
        tenant = Tenant("t")
        self.shares.served(tenant, 1000)
        self.clock.advance(HALF_LIFE)
        self.assertAlmostEqual(self.shares.share(tenant), 500, places=3)

    def test_fifo(self) -> None:
        queue: FairQueue[str] = FairQueue(self.shares, fifo=True)
        queue.push(BATCH, "b")
        queue.push(CHAT, "c")
        self.assertEqual(queue.pop()[1], "b")
        self.assertIsNone(queue.victim(CHAT))

    def test_victim_lowest_newest(self) -> None:
        """
        The lowest priority's newest request is refused first; a newcomer
        of the lowest priority is refused itself.
        """
        queue: FairQueue[str] = FairQueue(self.shares)
        queue.push(BATCH, "b1")
        queue.push(BATCH, "b2")
        queue.push(Tenant("std"), "s1")
        self.assertEqual(queue.victim(CHAT), "b2")
        self.assertIsNone(queue.victim(BATCH))
        self.assertEqual(queue.ahead(BATCH), 3)
        self.assertEqual(queue.ahead(CHAT), 0)

    def test_retry_from_rate(self) -> None:
        """
        Ten requests let go over 5 s: the fourth in line waits 2 s.
        """
        self.assertEqual(retry_from_rate(lambda: (10, 5.0), 3, 9), 2)
        self.assertEqual(retry_from_rate(lambda: (0, 0.0), 3, 9), 9)


class OverloadFairTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.busy = True
        self.room = Overload(
            self.clock, lambda m: self.busy, lambda m: 1, 30, 2, 0.25, 1.0
        )

    def test_higher_priority_takes_place(self) -> None:
        """
        A full room of batch requests: an interactive one takes the newest
        one's place (it fails with 429 and C{Retry-After}) and goes first.
        """
        first = self.room.admit("m", BATCH)
        second = self.room.admit("m", BATCH)
        chat = self.room.admit("m", CHAT)
        assert first is not None and second is not None and chat is not None
        error = self.failureResultOf(second, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual((error.status, error.retry_after), (429, 1))
        with self.assertRaises(APIError):
            self.room.admit("m", BATCH)
        self.busy = False
        self.clock.advance(0.25)
        self.successResultOf(chat)
        self.assertNoResult(first)
        self.clock.advance(0.25)
        self.successResultOf(first)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_retry_after_from_queue(self) -> None:
        """
        The room let a request go every second: a refused request with
        two ahead of it is told 3 s.
        """
        waiting = [self.room.admit("m", BATCH) for _ in range(2)]
        self.busy = False
        for _ in range(2):
            self.clock.advance(0.25)
            self.busy = True
            waiting.append(self.room.admit("m", BATCH))
            self.clock.advance(0.75)
            self.busy = False
        self.busy = True
        with self.assertRaises(APIError) as caught:
            self.room.admit("m", BATCH)
        self.assertEqual(caught.exception.retry_after, 3)
        for d in waiting:
            assert d is not None
            d.cancel()
            d.addErrback(lambda f: None)


class ActivationFairTests(SynchronousTestCase):
    def test_full_queue_evicts_lower(self) -> None:
        """
        A full activation queue of batch requests: an interactive one ends
        the newest batch wait (L{ActivationWait.evicted}) and joins; a
        batch newcomer is refused.
        """
        clock, queues, activator = Clock(), ActivationQueues(), _Activator()
        activator.standing = Standing("starting", 5.0)
        settings = RouterConfig(activation_queue=2, activation_keepalive=0)

        def new(tenant: Tenant) -> ActivationWait:
            return ActivationWait(
                clock,
                settings,
                queues,
                activator,  # type: ignore[arg-type]
                "m",
                tenant,
            )

        waits = [new(BATCH), new(BATCH)]
        for wait in waits:
            wait.start(None).addErrback(_ended, wait)
        chat = new(CHAT)
        chat.start(None)
        self.assertEqual([w.evicted for w in waits], [False, True])
        self.assertEqual(queues.length("m"), 2)
        with self.assertRaises(APIError) as caught:
            new(BATCH).start(None)
        self.assertEqual(caught.exception.retry_after, 5)
        for d in activator.asked[:1] + activator.asked[2:]:
            d.callback(None)
        waits[0].end()
        chat.end()
        self.assertEqual(queues.length("m"), 0)


def _ended(failure: Failure, wait: ActivationWait) -> None:
    failure.trap(CancelledError)
    wait.end()


class _MovingClock(Clock):
    """
    A clock one millisecond later at each reading, as a busy reactor's.
    """

    def seconds(self) -> float:
        self.advance(0.001)
        return super().seconds()


class HeldOrderTests(SynchronousTestCase):
    def test_priority_then_oldest(self) -> None:
        """
        Models holding requests first; among them the highest priority
        held, then the oldest; without priorities, today's order.
        """
        models = {
            "idle": held_order(None),
            "old-batch": held_order(1.0, priority_rank("batch")),
            "new-chat": held_order(5.0, priority_rank("interactive")),
            "old-chat": held_order(2.0, priority_rank("interactive")),
        }
        self.assertEqual(
            sorted(models, key=models.__getitem__),
            ["old-chat", "new-chat", "old-batch", "idle"],
        )
        self.assertLess(held_order(1.0), held_order(2.0))
        self.assertLess(held_order(9.0), held_order(None))

    def test_passed_over_first(self) -> None:
        """
        A model whose request was passed over for C{swap_max_wait} goes
        before a higher priority, so no request waits unbounded.
        """
        self.assertLess(
            held_order(3.0, priority_rank("batch"), overdue=True),
            held_order(1.0, priority_rank("interactive")),
        )
        self.assertLess(
            held_order(1.0, priority_rank("batch"), overdue=True),
            held_order(2.0, priority_rank("interactive"), overdue=True),
        )

    def test_any_integer(self) -> None:
        """
        A priority past a float's range (an admin API body may say
        C{10**400}) orders as any other, and raises nothing.
        """
        self.assertLess(held_order(2.0, 10**400), held_order(1.0, 5))
        self.assertLess(held_order(1.0, 5), held_order(1.0, -(10**400)))


class ReleaseOrderTests(SynchronousTestCase):
    def test_turns_by_priority_then_arrival(self) -> None:
        """
        The requests held for a model go in one turn per priority, the
        highest first, the oldest first within a turn, whatever the order
        they were held in (the order routers posted them).
        """
        batch, standard, chat = (
            priority_rank(p) for p in ("batch", "standard", "interactive")
        )
        held = [(1.0, chat), (0.5, batch), (3.0, standard), (2.0, chat), (0.1, chat)]
        self.assertEqual(release_turns(held), [[4, 0, 3], [2], [1]])
        self.assertEqual(release_turns([(2.0, 1), (1.0, 1)]), [[1, 0]])
        self.assertEqual(release_turns([]), [])

    def test_release_across_routers(self) -> None:
        """
        A batch request held first and an interactive one held later (as
        two routers of a tier post them): once a replica is ready the
        interactive one is let go at once and the batch one
        L{RELEASE_GAP} later; one that stopped waiting meanwhile is
        skipped; no delayed call is left.
        """
        clock = Clock()
        catalog = ModelCatalog(
            clock, Inventory(), [Model("m", (), 0, 1, 0.0, ())], (), lambda: None
        )
        batch = catalog.activate("m", priority_rank("batch"))
        clock.advance(1)
        gone = catalog.activate("m", priority_rank("batch"), waited=0.5)
        chat = catalog.activate("m", priority_rank("interactive"))
        fired: list[str] = []
        batch.addCallback(lambda _: fired.append("batch"))
        chat.addCallback(lambda _: fired.append("chat"))
        catalog.release("m")
        self.assertEqual(fired, ["chat"])
        gone.cancel()
        self.failureResultOf(gone, CancelledError)
        clock.advance(RELEASE_GAP - 0.01)
        self.assertEqual(fired, ["chat"])
        clock.advance(0.01)
        self.assertEqual(fired, ["chat", "batch"])
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(catalog["m"].held, {})


class FleetRefusalTests(SynchronousTestCase):
    """
    Who is refused first when the fleet holds more requests for a model
    than its bound (L{refused_first}, L{ModelCatalog.activate}): the
    lowest priority's newest, whichever router holds it.
    """

    def test_lowest_priority_newest(self) -> None:
        """
        The lowest priority's newest arrival is refused, whatever the
        order the requests were held in; of two that arrived together,
        the one held last; none of none.
        """
        batch, standard, chat = (
            priority_rank(p) for p in ("batch", "standard", "interactive")
        )
        held = [(1.0, chat), (2.0, batch), (3.0, standard), (0.5, batch)]
        self.assertEqual(refused_first(held), 1)
        self.assertEqual(refused_first([(1.0, chat), (5.0, chat), (2.0, chat)]), 1)
        self.assertEqual(refused_first([(1.0, batch), (1.0, batch)]), 1)
        self.assertEqual(refused_first([(9.0, chat), (1.0, standard)]), 1)
        self.assertIsNone(refused_first([]))

    def catalog(self, bound: int | None) -> tuple[Clock, ModelCatalog]:
        clock = Clock()
        model = Model("m", ("m-alias",), 0, 1, 0.0, ())
        catalog = ModelCatalog(
            clock, Inventory(), [model], (), lambda: None, bound=bound
        )
        return clock, catalog

    def test_higher_priority_takes_the_place(self) -> None:
        """
        With a bound of 1, a batch request held first (on one router) is
        refused with L{ActivationRefused} when an interactive one comes
        (on another): the interactive one holds the place and is let go
        when a replica is ready; the refusal is counted per model.
        """
        clock, catalog = self.catalog(1)
        batch = catalog.activate("m", priority_rank("batch"))
        clock.advance(1)
        chat = catalog.activate("m-alias", priority_rank("interactive"))
        refused = self.failureResultOf(batch, ActivationRefused).value
        assert isinstance(refused, ActivationRefused)
        self.assertEqual(refused.model, "m")
        self.assertNoResult(chat)
        self.assertEqual(
            list(catalog["m"].held.values()), [(1.0, priority_rank("interactive"))]
        )
        self.assertEqual(catalog.refused, {"m": 1})
        catalog.release("m")
        self.successResultOf(chat)
        self.assertEqual((catalog["m"].waiters, catalog["m"].held), ([], {}))
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_newcomer_refused_at_once(self) -> None:
        """
        A request of no higher priority than those held, past the bound,
        is refused at once: the newest of the lowest priority is itself.
        Its arrival is counted back by the seconds it waited on its
        router, so a request posted later that has waited longer is the
        older one.
        """
        clock, catalog = self.catalog(2)
        first = catalog.activate("m", priority_rank("standard"))
        clock.advance(1)
        second = catalog.activate("m", priority_rank("standard"))
        clock.advance(1)
        third = catalog.activate("m", priority_rank("batch"))
        self.failureResultOf(third, ActivationRefused)
        older = catalog.activate("m", priority_rank("standard"), waited=1.5)
        self.failureResultOf(second, ActivationRefused)
        self.assertNoResult(first)
        self.assertNoResult(older)
        self.assertEqual(catalog.refused, {"m": 2})
        for waiting in (first, older):
            waiting.cancel()
            self.failureResultOf(waiting, CancelledError)
        self.assertEqual((catalog["m"].waiters, catalog["m"].held), ([], {}))

    def test_no_bound(self) -> None:
        """
        Without a bound (a catalog built without one), nothing is refused.
        """
        _, catalog = self.catalog(None)
        held = [catalog.activate("m", priority_rank("batch")) for _ in range(300)]
        for waiting in held:
            self.assertNoResult(waiting)
        self.assertEqual(catalog.refused, {})
        catalog.release("m")
        for waiting in held:
            self.successResultOf(waiting)


class OrderFieldsTests(SynchronousTestCase):
    def test_bad_priority_or_weight(self) -> None:
        """
        The admin API's key fields: a priority that is neither a name nor
        an integer, or a weight not above 0, is a 400 naming the field.
        """
        self.assertEqual(
            _order_fields({"priority": "batch", "weight": 2}),
            {"priority": "batch", "weight": 2.0},
        )
        self.assertEqual(_order_fields({"priority": 5}), {"priority": "5"})
        for body, field in (
            ({"priority": "urgent"}, "priority"),
            ({"priority": [1]}, "priority"),
            ({"weight": 0}, "weight"),
            ({"weight": "x"}, "weight"),
        ):
            with self.assertRaises(AdminError) as caught:
                _order_fields(body)
            self.assertEqual(caught.exception.status, 400)
            self.assertIn(field, str(caught.exception.message))
