"""
Replica choice: least outstanding, weights, random ties, ejection.
"""

from __future__ import annotations

import random
from collections import Counter

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.balancer import Balancer


def balancer(*endpoints: Endpoint, cooldown: float = 10.0) -> tuple[Balancer, Clock]:
    clock = Clock()
    b = Balancer(clock, cooldown, random.Random(7))
    b.set_endpoints(endpoints)
    return b, clock


A = Endpoint("a", "http://a", ("m",))
B = Endpoint("b", "http://b", ("m",))


class BalancerTests(SynchronousTestCase):
    def test_least_outstanding(self) -> None:
        """
        The replica with fewer requests in flight is chosen.
        """
        b, _ = balancer(A, B)
        replicas = {r.id: r for r in b.replicas()}
        replicas["a"].outstanding = 3
        replicas["b"].outstanding = 1
        self.assertEqual(b.pick("m", set()), replicas["b"])

    def test_ties_random(self) -> None:
        """
        Equal replicas are chosen at random, so idle traffic spreads.
        """
        b, _ = balancer(A, B)
        picks = Counter(b.pick("m", set()).id for _ in range(1000))  # type: ignore[union-attr]
        self.assertTrue(400 < picks["a"] < 600, picks)

    def test_concurrent_split_even(self) -> None:
        """
        Requests that stay in flight alternate between equal replicas.
        """
        b, _ = balancer(A, B)
        for _ in range(200):
            replica = b.pick("m", set())
            assert replica is not None
            replica.outstanding += 1
        self.assertEqual(sorted(r.outstanding for r in b.replicas()), [100, 100])

    def test_weights(self) -> None:
        """
        A replica of weight 3 carries three times the in-flight requests of
        one of weight 1.
        """
        b, _ = balancer(Endpoint("a", "http://a", ("m",), 3.0), B)
        for _ in range(400):
            replica = b.pick("m", set())
            assert replica is not None
            replica.outstanding += 1
        counts = {r.id: r.outstanding for r in b.replicas()}
        self.assertEqual(counts, {"a": 300, "b": 100})

    def test_exclude_and_unknown(self) -> None:
        """
        Replicas already tried are skipped; nothing is left for an unknown
        model or when all were tried.
        """
        b, _ = balancer(A, B)
        self.assertEqual(b.pick("m", {"a"}).id, "b")  # type: ignore[union-attr]
        self.assertIsNone(b.pick("m", {"a", "b"}))
        self.assertIsNone(b.pick("other", set()))

    def test_ejection_cooldown(self) -> None:
        """
        An ejected replica is passed over until its cooldown ends.
        """
        b, clock = balancer(A, B, cooldown=10)
        a = next(r for r in b.replicas() if r.id == "a")
        b.eject(a)
        self.assertEqual({b.pick("m", set()).id for _ in range(50)}, {"b"})  # type: ignore[union-attr]
        self.assertTrue(b.available("m"))
        clock.advance(10)
        self.assertIn("a", {b.pick("m", set()).id for _ in range(50)})  # type: ignore[union-attr]

    def test_all_ejected(self) -> None:
        """
        When every replica is ejected, the one whose cooldown ends first is
        tried rather than refusing the request.
        """
        b, clock = balancer(A, B, cooldown=10)
        replicas = {r.id: r for r in b.replicas()}
        b.eject(replicas["a"])
        clock.advance(1)
        b.eject(replicas["b"])
        self.assertFalse(b.available("m"))
        self.assertEqual(b.pick("m", set()), replicas["a"])

    def test_set_endpoints_keeps_counters(self) -> None:
        """
        Replacing the list keeps the in-flight count of a replica that stays,
        so requests in flight still decrement the count they incremented.
        """
        b, _ = balancer(A, B)
        a = next(r for r in b.replicas() if r.id == "a")
        a.outstanding = 5
        b.set_endpoints([A])
        self.assertEqual(b.replicas()[0].outstanding, 5)
        self.assertEqual(b.models(), ["m"])


class InFlightAcrossRepublishTests(SynchronousTestCase):
    def test_count_survives(self) -> None:
        """
        A replica unpublished with requests in flight and published again
        (an agent restart), or republished at another URL, keeps counting
        the requests it carries.
        """
        from twisted.internet.task import Clock

        balancer = Balancer(Clock(), 10)
        first = Endpoint("r1", "http://10.0.0.1:1", ("m",))
        balancer.set_endpoints([first])
        replica = balancer.pick("m", set())
        assert replica is not None
        replica.outstanding += 3
        balancer.set_endpoints([])
        self.assertEqual(balancer.outstanding("r1"), 3)
        balancer.set_endpoints([first])
        self.assertEqual(balancer.outstanding("r1"), 3)
        balancer.set_endpoints([Endpoint("r1", "http://10.0.0.2:1", ("m",))])
        self.assertEqual(balancer.outstanding("r1"), 3)
        replica.outstanding -= 3
        self.assertEqual(balancer.outstanding("r1"), 0)


class BatchLinesCountedApartTests(SynchronousTestCase):
    def test_interactive_outstanding(self) -> None:
        """
        A batch's lines sent to a replica count in its requests in flight
        but not in its clients' (L{Balancer.interactive_outstanding}),
        after it is unpublished too.
        """
        balancer = Balancer(Clock(), 10)
        balancer.set_endpoints([Endpoint("r1", "http://10.0.0.1:1", ("m",))])
        replica = balancer.pick("m", set())
        assert replica is not None
        marks = [replica.enter(0.0, batch) for batch in (True, True, False)]
        self.assertEqual(balancer.outstanding("r1"), 3)
        self.assertEqual(balancer.interactive_outstanding("r1"), 1)
        balancer.set_endpoints([])
        self.assertEqual(balancer.interactive_outstanding("r1"), 1)
        replica.leave(1.0, marks[2], batch=False)
        self.assertEqual(balancer.interactive_outstanding("r1"), 0)
        self.assertEqual(balancer.outstanding("r1"), 2)
        replica.leave(1.0, marks[0], batch=True)
        replica.leave(1.0, marks[1], batch=True)
        self.assertEqual(balancer.outstanding("r1"), 0)
