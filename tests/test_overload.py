"""
The overload waiting room (issue 11 item 4), on a clock.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.errors import APIError
from llmgw.router.routing.overload import Overload


class OverloadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.busy = {"m": True}

    def gate(self, wait: float, size: int = 3) -> Overload:
        self.counted: list[tuple[str, str]] = []
        return Overload(
            self.clock,
            lambda model: self.busy.get(model, False),
            lambda m: 2,
            wait,
            size,
            0.25,
            1.0,
            lambda model, outcome: self.counted.append((model, outcome)),
        )

    def waits(self, gate: Overload) -> Deferred[None]:
        """
        @return: what C{gate} answers a request for C{m} that must wait.
        """
        waiting = gate.admit("m")
        assert waiting is not None
        return waiting

    def assert429(self, d: Deferred[None]) -> APIError:
        error = self.failureResultOf(d, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual(error.status, 429)
        self.assertEqual(error.retry_after, 1)
        return error

    def test_not_overloaded(self) -> None:
        """
        A model whose engines keep up goes on at once.
        """
        self.busy["m"] = False
        self.assertIsNone(self.gate(5).admit("m"))

    def test_zero_wait_refuses(self) -> None:
        """
        C{overload_wait = "0s"}: a 429 with C{Retry-After} at once.
        """
        with self.assertRaises(APIError) as caught:
            self.gate(0).admit("m")
        self.assertEqual(
            (caught.exception.status, caught.exception.retry_after), (429, 1)
        )

    def test_wait_then_go_in_order(self) -> None:
        """
        Requests wait while the model is overloaded and go on, oldest
        first and as many per check as the model has replicas, when it is
        not; a newcomer queues behind those waiting.
        """
        gate = self.gate(5, size=4)
        waiting = [self.waits(gate) for _ in range(3)]
        self.clock.advance(0.25)
        for d in waiting:
            self.assertNoResult(d)
        self.busy["m"] = False
        late = self.waits(gate)
        self.assertNoResult(late)
        self.clock.advance(0.25)
        self.successResultOf(waiting[0])
        self.successResultOf(waiting[1])
        self.assertNoResult(waiting[2])
        self.clock.advance(0.25)
        self.successResultOf(waiting[2])
        self.successResultOf(late)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertIsNone(gate.admit("m"))
        self.assertEqual(self.counted, [("m", "waited")] * 4)

    def test_queue_bounded(self) -> None:
        """
        Past C{overload_queue_size} waiting, a 429 at once.
        """
        gate = self.gate(5, size=2)
        waiting = [self.waits(gate) for _ in range(2)]
        with self.assertRaises(APIError):
            gate.admit("m")
        for d in waiting:
            d.cancel()
            self.failureResultOf(d)
        self.assertEqual(gate.waiting("m"), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_wait_times_out(self) -> None:
        """
        After C{overload_wait}, a 429.
        """
        gate = self.gate(5)
        d = self.waits(gate)
        self.clock.advance(5)
        self.assert429(d)
        self.assertEqual(self.counted, [("m", "refused")])
        self.assertEqual(gate.waiting("m"), 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])
