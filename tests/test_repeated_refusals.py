"""
The server's refusals of agent links that repeat, on a Clock: each reason
is warned of at once, then at most once a minute, that line counting those
not logged (L{llmgw.control.repeats}, used by L{llmgw.control.agents}).  An
agent refused for the same mistake retries every 1 to 30 s: before, the
server logged every attempt (seven lines a reason in 68 s).
"""

from __future__ import annotations

from typing import Any

from OpenSSL import SSL
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.agents import AgentHub, AgentLink
from llmgw.control.inventory import Inventory
from llmgw.control.repeats import MAX_REASONS, REPEAT_INTERVAL, Repeats
from tests.test_refusals import _register, _TLSTransport

# An agent's delays between attempts (llmgw.agent.service): 1 s doubling
# to 30 s, as in the trial; 68 s hold 7 attempts.
DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class RepeatsTests(SynchronousTestCase):
    """
    L{Repeats} alone: which occurrences are logged, and what their line
    ends with.
    """

    def test_once_a_minute_per_reason(self) -> None:
        clock = Clock()
        repeats = Repeats(clock)
        self.assertEqual(REPEAT_INTERVAL, 60.0)
        seen = [repeats.admit("a")]
        for delay in DELAYS:
            clock.advance(delay)
            seen.append(repeats.admit("a"))
        # 61 s after the first: its line counts the five held back.
        self.assertEqual(
            seen,
            [""] + [None] * 5 + [" (5 more like it in the last 61s, not logged)"],
        )
        self.assertEqual(repeats.admit("b"), "")
        clock.advance(8)
        self.assertIsNone(repeats.admit("a"))
        clock.advance(60)
        self.assertEqual(
            repeats.admit("a"), " (1 more like it in the last 68s, not logged)"
        )
        clock.advance(60)
        self.assertEqual(repeats.admit("a"), "")

    def test_reasons_bounded(self) -> None:
        """
        Past L{MAX_REASONS} reasons, those whose minute ended are
        forgotten; when none has, all are.
        """
        clock = Clock()
        repeats = Repeats(clock)
        for i in range(MAX_REASONS):
            self.assertEqual(repeats.admit(i), "")
        self.assertEqual(repeats.admit("new"), "")
        self.assertEqual(len(repeats._seen), 1)
        clock.advance(61)
        self.assertEqual(repeats.admit("new"), "")


class RepeatedRefusalTests(SynchronousTestCase):
    """
    Through the hub's links: the agent is told every time, the server's log
    says it once a minute per reason.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.hub = AgentHub(self.clock, Inventory(), unreachable_after=15)
        self.port = 40000

    def connect(self, cn: str) -> tuple[AgentLink, _TLSTransport]:
        self.port += 1
        link = self.hub.buildProtocol(None)
        transport = _TLSTransport(cn, self.port)
        link.makeConnection(transport)
        return link, transport

    def attempts(self, attempt: Any) -> list[str]:
        """
        Call C{attempt} now and after each of L{DELAYS}, then 8 s later.

        @return: the warnings logged, formatted.
        """
        lines = []
        for delay in (0.0, *DELAYS, 8.0):
            self.clock.advance(delay)
            with capturedLogs() as events:
                attempt()
            lines += [formatEvent(e) for e in events if e["log_level"].name == "warn"]
        return lines

    def test_certificate_mismatch(self) -> None:
        """
        gpu-01's certificate claiming gpu-02, eight times in 69 s: every
        attempt gets its C{Refused}; the server warns twice, the second
        line (61 s after the first) counting the five held back.  Another
        node's mistake is warned of at once.
        """
        told = []

        def attempt(cn: str = "gpu-01", claim: str = "gpu-02") -> None:
            link, transport = self.connect(cn)
            link.dataReceived(_register(claim))
            told.append(
                transport.disconnecting and b"certificate_mismatch" in transport.value()
            )
            link.connectionLost()

        lines = self.attempts(attempt)
        reason = "certificate CN 'gpu-01' claims to be node 'gpu-02'"
        self.assertEqual(
            lines,
            [
                f"refusing agent connection from 10.0.0.9:40001: {reason}",
                f"refusing agent connection from 10.0.0.9:40007: {reason}"
                " (5 more like it in the last 61s, not logged)",
            ],
        )
        self.assertEqual(told, [True] * 8)
        with capturedLogs() as events:
            attempt("gpu-03", "gpu-04")
        self.assertEqual(len(events), 1)

    def test_failed_handshakes(self) -> None:
        """
        A link lost in its TLS handshake (another CA's certificate), eight
        times in 69 s: two warnings, the second counting the five held
        back; a handshake failing for another reason is warned of at once.
        """

        def attempt(why: str = "tlsv1 alert unknown ca") -> None:
            link, _ = self.connect("gpu-01")
            link.connectionLost(Failure(SSL.Error([("SSL routines", "", why)])))

        lines = self.attempts(attempt)
        self.assertEqual(len(lines), 2, lines)
        self.assertIn("tlsv1 alert unknown ca", lines[0])
        self.assertTrue(
            lines[1].endswith("(5 more like it in the last 61s, not logged)"),
            lines[1],
        )
        with capturedLogs() as events:
            attempt("certificate unknown")
        self.assertEqual(len(events), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])
