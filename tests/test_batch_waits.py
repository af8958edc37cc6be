"""
A batch's lines where requests wait in the router (docs/batches.md,
"Batch work and interactive traffic"): at L{BATCH_RANK} they are the last
let go and the first refused, in the overload room and the activation
queue, in the first-come-first-served order too, and their activation
carries their rank to the control plane whatever the order.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.errors import APIError
from llmgw.router.interfaces import BATCH_RANK, Standing
from llmgw.router.routing.activation import ActivationQueues, ActivationWait
from llmgw.router.routing.fairness import FairQueue, FairShare, Tenant, priority_rank
from llmgw.router.routing.overload import Overload
from llmgw.router.settings import RouterConfig
from tests.test_activation import _Activator

LINE = Tenant("batch-owner", BATCH_RANK)
LOW = Tenant("low", priority_rank("batch"))
CHAT = Tenant("chat", priority_rank("interactive"))


class QueueTests(SynchronousTestCase):
    """
    L{FairQueue}: a line goes after every client's request, the lowest
    priority's too, and is refused first.
    """

    def setUp(self) -> None:
        self.shares = FairShare(Clock())

    def test_last_let_go(self) -> None:
        for fifo in (False, True):
            queue: FairQueue[str] = FairQueue(self.shares, fifo=fifo)
            queue.push(LINE, "line1")
            queue.push(LOW, "low")
            queue.push(LINE, "line2")
            queue.push(CHAT, "chat")
            order = [queue.pop()[1] for _ in range(4)]
            expected = ["low", "chat"] if fifo else ["chat", "low"]
            self.assertEqual(order, expected + ["line1", "line2"], f"fifo={fifo}")

    def test_first_refused(self) -> None:
        """
        A client's newcomer to a full room takes the newest line's place,
        in either order; a line newcomer is refused itself.
        """
        for fifo in (False, True):
            queue: FairQueue[str] = FairQueue(self.shares, fifo=fifo)
            queue.push(LINE, "line1")
            queue.push(LOW, "low")
            queue.push(LINE, "line2")
            self.assertEqual(queue.victim(LOW), "line2", f"fifo={fifo}")
            self.assertEqual(queue.victim(CHAT), "line2", f"fifo={fifo}")
            self.assertIsNone(queue.victim(LINE), f"fifo={fifo}")

    def test_fifo_ahead(self) -> None:
        """
        First come, first served: no line is ahead of a client's request;
        every request is ahead of a line.
        """
        queue: FairQueue[str] = FairQueue(self.shares, fifo=True)
        queue.push(LINE, "line")
        queue.push(LOW, "low")
        self.assertEqual(queue.ahead(CHAT), 1)
        self.assertEqual(queue.ahead(LINE), 2)


class OverloadTests(SynchronousTestCase):
    """
    The overload room, full of lines: a client's request takes a line's
    place and goes first.
    """

    def test_line_refused_for_a_client(self) -> None:
        for order in ("fair", "fifo"):
            self.refused_for_a_client(order)

    def refused_for_a_client(self, order: str) -> None:
        """
        Two lines fill the room; a client's request of the lowest named
        priority fails the newest line with a 429 and goes first.
        """
        clock = Clock()
        busy = [True]
        room = Overload(
            clock,
            lambda m: busy[0],
            lambda m: 1,
            30,
            2,
            0.25,
            1.0,
            fifo=order == "fifo",
        )
        first = room.admit("m", LINE)
        second = room.admit("m", LINE)
        low = room.admit("m", LOW)
        assert first is not None and second is not None and low is not None
        error = self.failureResultOf(second, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual(error.status, 429)
        with self.assertRaises(APIError):
            room.admit("m", LINE)
        busy[0] = False
        clock.advance(0.25)
        self.successResultOf(low)
        self.assertNoResult(first)
        clock.advance(0.25)
        self.successResultOf(first)
        self.assertEqual(clock.getDelayedCalls(), [], order)


class ActivationTests(SynchronousTestCase):
    """
    The activation queue: a line gives its place to a client's request,
    and asks the control plane at its own rank in either order.
    """

    def new(
        self, tenant: Tenant, order: str = "fair"
    ) -> tuple[ActivationWait, _Activator]:
        settings = RouterConfig(
            activation_queue=1, activation_keepalive=0, waiting_order=order
        )
        wait = ActivationWait(
            self.clock,
            settings,
            self.queues,
            self.activator,  # type: ignore[arg-type]
            "m",
            tenant,
        )
        return wait, self.activator

    def setUp(self) -> None:
        self.clock = Clock()
        self.queues = ActivationQueues()
        self.activator = _Activator()
        self.activator.standing = Standing("starting", 5.0)

    def test_rank_goes_with_the_line(self) -> None:
        """
        Under C{waiting_order = "fifo"} a client's request asks at
        C{standard}; a line still asks at L{BATCH_RANK}, so that the
        control plane never makes room for it.
        """
        for tenant in (LINE, CHAT):
            wait, activator = self.new(tenant, "fifo")
            wait.start(None).addErrback(_ended, wait)
            wait._ready.cancel()  # type: ignore[union-attr]
        self.assertEqual(self.activator.priorities, [BATCH_RANK, 1])

    def test_client_takes_a_lines_place(self) -> None:
        for order in ("fair", "fifo"):
            self.queues = ActivationQueues()
            line, _ = self.new(LINE, order)
            line.start(None).addErrback(_ended, line)
            low, _ = self.new(LOW, order)
            low.start(None)
            self.assertTrue(line.evicted, order)
            with self.assertRaises(APIError):
                self.new(LINE, order)[0].start(None)
            low.end()


def _ended(failure: Failure, wait: ActivationWait) -> None:
    failure.trap(CancelledError)
    wait.end()
