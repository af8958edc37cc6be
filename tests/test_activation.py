"""
L{llmgw.router.activation}: one request's wait for a replica to start, on
a L{Clock}.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.activation import ActivationWait
from llmgw.router.errors import APIError
from llmgw.router.settings import RouterConfig


class _Activator:
    """
    Hands out one Deferred per activation, fired by the test.
    """

    def __init__(self) -> None:
        self.asked: list[Deferred[None]] = []

    def activate(self, name: str) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self.asked.append(d)
        return d


def _wait(
    clock: Clock, activating: dict[str, int], **settings: float
) -> tuple[ActivationWait, _Activator]:
    activator = _Activator()
    config = RouterConfig(**settings)  # type: ignore[arg-type]
    wait = ActivationWait(clock, config, activating, activator, "m")  # type: ignore[arg-type]
    return wait, activator


class ActivationWaitTests(SynchronousTestCase):
    def test_ready_leaves_the_queue(self) -> None:
        """
        While waiting the request holds a place in its model's queue; once
        a replica is ready and the wait ends, it holds none, and no timer
        is left behind.
        """
        clock, activating = Clock(), {"m": 1}
        wait, activator = _wait(clock, activating, activation_timeout=10.0)
        ready = wait.start(None)
        self.assertEqual(activating, {"m": 2})
        activator.asked[0].callback(None)
        self.assertIsNone(self.successResultOf(ready))
        wait.end()
        self.assertEqual(activating, {"m": 1})
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertFalse(wait.timed_out)

    def test_queue_full(self) -> None:
        """
        A request past C{activation_queue} is refused with a 503, and takes
        no place in the queue nor asks for an activation.
        """
        clock, activating = Clock(), {"m": 2}
        wait, activator = _wait(clock, activating, activation_queue=2)
        with self.assertRaises(APIError) as caught:
            wait.start(None)
        self.assertEqual(caught.exception.status, 503)
        self.assertEqual(activating, {"m": 2})
        self.assertEqual(activator.asked, [])

    def test_timeout_cancels(self) -> None:
        """
        At C{activation_timeout} the wait is cancelled and says it timed
        out; the last request to leave removes the model from the queue.
        """
        clock, activating = Clock(), dict[str, int]()
        wait, _ = _wait(clock, activating, activation_timeout=5.0)
        ready = wait.start(None)
        clock.advance(4.9)
        self.assertNoResult(ready)
        clock.advance(0.1)
        self.failureResultOf(ready, CancelledError)
        self.assertTrue(wait.timed_out)
        wait.end()
        self.assertEqual(activating, {})
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_keepalive(self) -> None:
        """
        A stream's keep-alive is called every C{activation_keepalive}
        seconds, not at once, and not after the wait ended.
        """
        clock, activating = Clock(), dict[str, int]()
        wait, activator = _wait(
            clock, activating, activation_timeout=0.0, activation_keepalive=2.0
        )
        calls: list[float] = []
        wait.start(lambda: calls.append(clock.seconds()))
        clock.pump([1.0] * 7)
        self.assertEqual(calls, [2.0, 4.0, 6.0])
        activator.asked[0].callback(None)
        wait.end()
        clock.advance(10)
        self.assertEqual(calls, [2.0, 4.0, 6.0])
        self.assertEqual(clock.getDelayedCalls(), [])
