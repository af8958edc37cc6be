"""
L{llmgw.router.routing.activation}: one request's wait for a replica to start, on
a L{Clock}.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.errors import APIError
from llmgw.router.interfaces import Standing
from llmgw.router.routing.activation import (
    ActivationQueues,
    ActivationWait,
    keepalive_line,
    retry_seconds,
)
from llmgw.router.settings import RouterConfig


class _Activator:
    """
    Hands out one Deferred per activation, fired by the test; stands
    where the test says.
    """

    def __init__(self) -> None:
        self.asked: list[Deferred[None]] = []
        self.priorities: list[int] = []
        self.standing = Standing()

    def where(self, name: str) -> Standing:
        return self.standing

    def why_not(self, name: str) -> str:
        return self.why

    why = ""

    def activate(self, name: str, priority: int = 1) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self.asked.append(d)
        self.priorities.append(priority)
        return d


def _wait(
    clock: Clock,
    queues: ActivationQueues,
    activator: _Activator | None = None,
    **settings: float,
) -> tuple[ActivationWait, _Activator]:
    activator = activator or _Activator()
    config = RouterConfig(**settings)  # type: ignore[arg-type]
    wait = ActivationWait(clock, config, queues, activator, "m")  # type: ignore[arg-type]
    return wait, activator


def _queued(clock: Clock, count: int) -> ActivationQueues:
    queues = ActivationQueues()
    for _ in range(count):
        queues.join("m", clock.seconds())
    return queues


class ActivationWaitTests(SynchronousTestCase):
    def test_ready_leaves_the_queue(self) -> None:
        """
        While waiting the request holds a place in its model's queue; once
        a replica is ready and the wait ends, it holds none, and no timer
        is left behind.
        """
        clock = Clock()
        queues = _queued(clock, 1)
        wait, activator = _wait(clock, queues, activation_timeout=10.0)
        ready = wait.start(None)
        self.assertEqual(queues.waiting(), {"m": 2})
        activator.asked[0].callback(None)
        self.assertIsNone(self.successResultOf(ready))
        wait.end()
        self.assertEqual(queues.waiting(), {"m": 1})
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertFalse(wait.timed_out)

    def test_queue_full(self) -> None:
        """
        A request past C{activation_queue} is refused with a 503, and takes
        no place in the queue nor asks for an activation.
        """
        clock = Clock()
        queues = _queued(clock, 2)
        wait, activator = _wait(clock, queues, activation_queue=2)
        with self.assertRaises(APIError) as caught:
            wait.start(None)
        self.assertEqual(caught.exception.status, 503)
        self.assertEqual(queues.waiting(), {"m": 2})
        self.assertEqual(activator.asked, [])

    def test_timeout_cancels(self) -> None:
        """
        At C{activation_timeout} the wait is cancelled and says it timed
        out; the last request to leave removes the model from the queue.
        """
        clock, queues = Clock(), ActivationQueues()
        wait, _ = _wait(clock, queues, activation_timeout=5.0)
        ready = wait.start(None)
        clock.advance(4.9)
        self.assertNoResult(ready)
        clock.advance(0.1)
        self.failureResultOf(ready, CancelledError)
        self.assertTrue(wait.timed_out)
        wait.end()
        self.assertEqual(queues.waiting(), {})
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_keepalive(self) -> None:
        """
        A stream's keep-alive is called every C{activation_keepalive}
        seconds, not at once, and not after the wait ended.
        """
        clock = Clock()
        wait, activator = _wait(
            clock,
            ActivationQueues(),
            activation_timeout=0.0,
            activation_keepalive=2.0,
        )
        calls: list[float] = []
        wait.start(lambda line: calls.append(clock.seconds()))
        clock.pump([1.0] * 7)
        self.assertEqual(calls, [2.0, 4.0, 6.0])
        activator.asked[0].callback(None)
        wait.end()
        clock.advance(10)
        self.assertEqual(calls, [2.0, 4.0, 6.0])
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_keepalive_says_where(self) -> None:
        """
        Each keep-alive comment says where the request stands as the
        activator says it then; with no words of where, why not.
        """
        clock = Clock()
        wait, activator = _wait(
            clock, ActivationQueues(), activation_timeout=0.0, activation_keepalive=1.0
        )
        lines: list[bytes] = []
        wait.start(lines.append)
        clock.advance(1)
        activator.standing = Standing("evicting a (idle 12s) to make room", 3.0)
        clock.advance(1)
        activator.standing = Standing("2nd in the swap queue, behind b")
        clock.advance(1)
        activator.standing = Standing("", 5.0)
        activator.why = "no node is connected"
        clock.advance(1)
        self.assertEqual(
            lines,
            [
                b": waiting for a replica to start\n\n",
                b": waiting for model m: evicting a (idle 12s) to make room\n\n",
                b": waiting for model m: 2nd in the swap queue, behind b\n\n",
                b": waiting for model m: no node is connected\n\n",
            ],
        )
        activator.asked[0].callback(None)
        wait.end()

    def test_queue_full_retry_after_from_history(self) -> None:
        """
        Refused while the queue is full, a request is told to come back when
        the activation under way is expected to end: the median of the
        model's recent activations less what the oldest waiter waited.
        """
        clock, queues = Clock(), ActivationQueues()
        for took in (10.0, 20.0, 12.0):
            queues.leave("m", 0.0, took)
        queues.join("m", 0.0)
        clock.advance(4.5)
        wait, _ = _wait(clock, queues, activation_queue=1)
        with self.assertRaises(APIError) as caught:
            wait.start(None)
        self.assertEqual(caught.exception.retry_after, 8)

    def test_retry_after_from_standing(self) -> None:
        """
        The control plane's estimate comes first.
        """
        clock = Clock()
        queues = _queued(clock, 1)
        activator = _Activator()
        activator.standing = Standing("waking replica r-3", 2.2)
        wait, _ = _wait(clock, queues, activator, activation_queue=1)
        with self.assertRaises(APIError) as caught:
            wait.start(None)
        self.assertEqual(caught.exception.retry_after, 3)

    def test_ready_wait_is_remembered(self) -> None:
        """
        A wait that ended ready counts in the model's typical activation;
        one that timed out does not.
        """
        clock, queues = Clock(), ActivationQueues()
        wait, activator = _wait(clock, queues, activation_timeout=30.0)
        wait.start(None)
        clock.advance(7)
        activator.asked[0].callback(None)
        wait.end()
        wait, _ = _wait(clock, queues, activation_timeout=5.0)
        late = wait.start(None)
        clock.advance(5)
        self.failureResultOf(late, CancelledError)
        wait.end()
        self.assertEqual(queues.typical("m"), 7.0)
        self.assertEqual(queues.typical("other"), 7.0)
        self.assertEqual(queues.waiting(), {})


class RetrySecondsTests(SynchronousTestCase):
    """
    L{retry_seconds}: whole seconds, at least 1, never a fixed number.
    """

    def test_rules(self) -> None:
        """
        The estimate when known; else what is left of a typical activation
        (a whole one when it runs late); else what the queue waited.
        """
        self.assertEqual(retry_seconds(2.2, 60.0, 5.0), 3)
        self.assertEqual(retry_seconds(0.0, None, 5.0), 1)
        self.assertEqual(retry_seconds(None, 20.0, 5.5), 15)
        self.assertEqual(retry_seconds(None, 20.0, 25.0), 20)
        self.assertEqual(retry_seconds(None, None, 30.0), 30)
        self.assertEqual(retry_seconds(None, None, 0.0), 1)
        self.assertEqual(retry_seconds(float("inf"), None, 9.0), 9)

    def test_line_is_one_line(self) -> None:
        """
        Words with line breaks cannot end the comment early (an SSE event
        ends at a blank line).
        """
        line = keepalive_line("m", Standing("a\n\ndata: x\r\n"))
        self.assertEqual(line, b": waiting for model m: a data: x\n\n")
