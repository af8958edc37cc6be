"""
Phase deadlines on a fake clock.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.upstream.deadlines import (
    FIRST_BYTE_TOKENS,
    Deadlines,
    first_byte_seconds,
)


class DeadlinesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.fired: list[str | None] = []

    def deadlines(
        self, first_byte: float = 10, idle: float = 3, total: float = 100
    ) -> Deadlines:
        deadlines = Deadlines(
            self.clock,
            lambda: self.fired.append(deadlines.expired),
            connect=5,
            first_byte=first_byte,
            idle=idle,
            total=total,
        )
        self.addCleanup(deadlines.stop)
        return deadlines

    def test_first_byte(self) -> None:
        """
        The first-byte phase expires after its seconds; the 504 names it.
        """
        deadlines = self.deadlines()
        deadlines.start_total()
        deadlines.start("first_byte")
        self.clock.advance(9.9)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.1)
        self.assertEqual(self.fired, ["first_byte"])
        error = deadlines.error()
        self.assertEqual((error.status, error.code), (504, "first_byte_timeout"))
        self.assertIn("10s", error.message)

    def test_idle_restarts_on_bytes(self) -> None:
        """
        The idle phase starts over at each L{Deadlines.touch}; it ends the
        first-byte phase.
        """
        deadlines = self.deadlines()
        deadlines.start("first_byte")
        self.clock.advance(5)
        deadlines.start("idle")
        for _ in range(5):
            self.clock.advance(2.9)
            deadlines.touch()
        self.assertEqual(self.fired, [])
        self.clock.advance(3)
        self.assertEqual(self.fired, ["idle"])
        self.assertEqual(deadlines.error().code, "idle_timeout")
        self.assertIn("3s", deadlines.error().message)
        # Touching after expiry is harmless.
        deadlines.touch()

    def test_total(self) -> None:
        """
        The total deadline runs across phases.
        """
        deadlines = self.deadlines(first_byte=60, idle=60, total=50)
        deadlines.start_total()
        deadlines.start("first_byte")
        self.clock.advance(30)
        deadlines.start("idle")
        self.clock.advance(20)
        self.assertEqual(self.fired, ["total"])
        self.assertEqual(deadlines.error().code, "total_timeout")
        self.assertIn("50s", deadlines.error().message)

    def test_zero_is_off(self) -> None:
        """
        A duration of 0 sets no timer.
        """
        deadlines = self.deadlines(first_byte=0, idle=0, total=0)
        deadlines.start_total()
        deadlines.start("first_byte")
        deadlines.start("idle")
        deadlines.touch()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop(self) -> None:
        """
        L{Deadlines.stop} leaves no delayed call behind.
        """
        deadlines = self.deadlines()
        deadlines.start_total()
        deadlines.start("first_byte")
        deadlines.stop()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(1000)
        self.assertEqual(self.fired, [])

    def test_pause(self) -> None:
        """
        A paused phase does not run (llmgw, not the replica, stopped
        reading); resumed, it starts over; a phase started while paused
        waits for the resume; the total deadline runs on; after stop, a
        resume starts nothing.
        """
        deadlines = self.deadlines(idle=3, total=100)
        deadlines.start_total()
        deadlines.start("idle")
        self.clock.advance(2)
        deadlines.pause()
        deadlines.touch()
        self.clock.advance(50)
        deadlines.start("idle")
        self.clock.advance(20)
        self.assertEqual(self.fired, [])
        deadlines.resume()
        deadlines.resume()
        self.clock.advance(2.9)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.1)
        self.assertEqual(self.fired, ["idle"])
        self.clock.advance(30)
        self.assertEqual(self.fired, ["idle", "total"])
        deadlines.pause()
        deadlines.stop()
        deadlines.resume()
        self.assertEqual(self.clock.getDelayedCalls(), [])


class FirstByteScaleTests(SynchronousTestCase):
    def test_scales_with_the_request(self) -> None:
        """
        The first-byte deadline is C{first_byte_timeout} up to
        L{FIRST_BYTE_TOKENS} tokens and in proportion beyond: an agent's
        prompt of 49,152 tokens gets six times it; an answer not streamed
        counts its C{max_tokens} too; 0 stays off.
        """
        self.assertEqual(first_byte_seconds(300, 100), 300)
        self.assertEqual(first_byte_seconds(300, 6 * FIRST_BYTE_TOKENS), 1800)
        self.assertEqual(
            first_byte_seconds(10, FIRST_BYTE_TOKENS, FIRST_BYTE_TOKENS), 20
        )
        self.assertEqual(first_byte_seconds(0, 100_000, 32_000), 0)
