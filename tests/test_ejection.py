"""
Outlier ejection for answers (issue 11 item 3), on a clock: failures in a
row eject with growing cooldowns, a half-open probe brings the replica
back, and never all of a model's replicas go at once.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.balancer import Balancer, Replica
from llmgw.router.routing.ejection import MAX_DOUBLINGS, cooldown, outcome
from llmgw.router.settings import RouterConfig

A = Endpoint("a", "http://a", ("m",))
B = Endpoint("b", "http://b", ("m",))
C = Endpoint("c", "http://c", ("m",))
SETTINGS = RouterConfig(eject_after=3, eject_base_cooldown=10.0)


def setup(*endpoints: Endpoint) -> tuple[Balancer, Clock, dict[str, Replica]]:
    clock = Clock()
    b = Balancer(clock, 10.0, settings=SETTINGS)
    b.set_endpoints(endpoints)
    return b, clock, {r.id: r for r in b.replicas()}


def fail(b: Balancer, replica: Replica, times: int) -> None:
    for _ in range(times):
        b.report(replica, True)


class EjectionTests(SynchronousTestCase):
    def test_failures_in_a_row_eject(self) -> None:
        """
        C{eject_after} failed answers in a row eject the replica; a good
        answer between them starts the count again.
        """
        b, _, r = setup(A, B)
        fail(b, r["a"], 2)
        b.report(r["a"], False)
        fail(b, r["a"], 2)
        self.assertEqual({b.pick("m", set()).id for _ in range(4)}, {"a", "b"})  # type: ignore[union-attr]
        fail(b, r["a"], 1)
        self.assertEqual({b.pick("m", set()).id for _ in range(4)}, {"b"})  # type: ignore[union-attr]

    def test_half_open_probe_brings_back(self) -> None:
        """
        After the cooldown one request goes to the replica (the probe);
        others skip it while the probe is in flight; a good answer brings
        it back into the rotation.
        """
        b, clock, r = setup(A, B)
        fail(b, r["a"], 3)
        clock.advance(9.9)
        self.assertEqual(b.pick("m", set()).id, "b")  # type: ignore[union-attr]
        clock.advance(0.2)
        probe = b.pick("m", set())
        self.assertEqual(probe.id, "a")  # type: ignore[union-attr]
        self.assertEqual({b.pick("m", set()).id for _ in range(3)}, {"b"})  # type: ignore[union-attr]
        b.report(r["a"], False)
        self.assertEqual({b.pick("m", set()).id for _ in range(4)}, {"a", "b"})  # type: ignore[union-attr]
        # Back in full: the next ejection starts from the base cooldown.
        fail(b, r["a"], 3)
        clock.advance(10.1)
        self.assertEqual(b.pick("m", set()).id, "a")  # type: ignore[union-attr]

    def test_failed_probe_doubles(self) -> None:
        """
        A failed probe ejects the replica again, for twice as long.
        """
        b, clock, r = setup(A, B)
        fail(b, r["a"], 3)
        clock.advance(10.1)
        self.assertEqual(b.pick("m", set()).id, "a")  # type: ignore[union-attr]
        b.report(r["a"], True)
        clock.advance(19.9)
        self.assertEqual(b.pick("m", set()).id, "b")  # type: ignore[union-attr]
        clock.advance(0.2)
        self.assertEqual(b.pick("m", set()).id, "a")  # type: ignore[union-attr]

    def test_probe_without_verdict(self) -> None:
        """
        A probe whose client left says nothing: the next request probes.
        """
        b, clock, r = setup(A, B)
        fail(b, r["a"], 3)
        clock.advance(10.1)
        self.assertEqual(b.pick("m", set()).id, "a")  # type: ignore[union-attr]
        b.report(r["a"], None)
        self.assertEqual(b.pick("m", set()).id, "a")  # type: ignore[union-attr]

    def test_never_all(self) -> None:
        """
        The last replica of a model in service is not ejected, however it
        fails; with three, two may go.
        """
        b, _, r = setup(A, B)
        fail(b, r["a"], 3)
        fail(b, r["b"], 10)
        self.assertEqual({b.pick("m", set()).id for _ in range(4)}, {"b"})  # type: ignore[union-attr]
        b, _, r = setup(A, B, C)
        fail(b, r["a"], 3)
        fail(b, r["b"], 3)
        fail(b, r["c"], 3)
        self.assertEqual({b.pick("m", set()).id for _ in range(4)}, {"c"})  # type: ignore[union-attr]

    def test_cooldown_grows_to_a_cap(self) -> None:
        """
        Base, twice, four times... up to 2 ** MAX_DOUBLINGS times the base.
        """
        self.assertEqual([cooldown(10, n) for n in (1, 2, 3)], [10, 20, 40])
        self.assertEqual(cooldown(10, 50), 10 * 2**MAX_DOUBLINGS)

    def test_outcome(self) -> None:
        """
        5xx and deadlines fail; 4xx and answers do not; a client that left
        or no answer say nothing.
        """
        self.assertTrue(outcome(500, False, False))
        self.assertTrue(outcome(None, True, False))
        self.assertFalse(outcome(429, False, False))
        self.assertFalse(outcome(200, False, False))
        self.assertIsNone(outcome(None, False, False))
        self.assertIsNone(outcome(500, True, True))
