"""
The reconciler's loop, on a Clock.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.loop import Loop


class LoopTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.calls = 0
        self.pending: list[Deferred[None]] = []

    def slow_pass(self) -> Deferred[None]:
        self.calls += 1
        d: Deferred[None] = Deferred()
        self.pending.append(d)
        return d

    def test_interval(self) -> None:
        """
        A pass at start, then one per interval.
        """
        loop = Loop(self.clock, 5, lambda: None)
        loop.startService()
        self.clock.advance(0)
        self.assertEqual(loop.passes, 1)
        self.clock.advance(5)
        self.clock.advance(5)
        self.assertEqual(loop.passes, 3)
        self.successResultOf(loop.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_no_overlap_and_kicks_fold(self) -> None:
        """
        Passes never overlap; three kicks during a pass make one more pass
        right after it, not three.
        """
        loop = Loop(self.clock, 60, self.slow_pass)
        loop.startService()
        self.clock.advance(0)
        self.assertEqual(self.calls, 1)
        loop.kick()
        loop.kick()
        loop.kick()
        self.clock.advance(100)
        self.assertEqual(self.calls, 1)
        self.pending.pop().callback(None)
        self.clock.advance(0)
        self.assertEqual(self.calls, 2)
        self.pending.pop().callback(None)
        self.clock.advance(0)
        self.assertEqual(self.calls, 2)
        self.successResultOf(loop.stopService())

    def test_failure_logged_and_loop_goes_on(self) -> None:
        """
        A pass that raises is logged and the next one still comes.
        """

        def broken() -> None:
            raise RuntimeError("boom")

        loop = Loop(self.clock, 1, broken, name="reconciler")
        loop.startService()
        with capturedLogs() as events:
            self.clock.advance(0)
            self.clock.advance(1)
        self.assertEqual(loop.passes, 2)
        self.assertEqual(len([e for e in events if "log_failure" in e]), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)
        self.successResultOf(loop.stopService())

    def test_stop_waits_for_pass(self) -> None:
        """
        stopService fires only once the pass in flight ends, and no pass
        comes after.
        """
        loop = Loop(self.clock, 1, self.slow_pass)
        loop.startService()
        self.clock.advance(0)
        stopped = loop.stopService()
        self.assertNoResult(stopped)
        self.pending.pop().callback(None)
        self.successResultOf(stopped)
        self.clock.advance(10)
        self.assertEqual(self.calls, 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])
