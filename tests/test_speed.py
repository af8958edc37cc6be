"""
Replica speed learnt from answers (L{llmgw.router.routing.speed}) and its use by
the balancer: shares of fresh picks, prefix key ownership and the
bounded-load capacity, recovery.
"""

from __future__ import annotations

import random
from collections import Counter

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.interfaces import Endpoint, RequestRecord
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.speed import HALF_LIFE
from llmgw.router.settings import RouterConfig

ITL = 0.01
"""
Seconds between tokens on a replica of speed 1.
"""


def _record(
    replica: str,
    speed: float,
    tokens: int = 24,
    stream: bool = True,
    status: int = 200,
    model: str = "m",
) -> RequestRecord:
    """
    A finished request's record: 0.1 s to the first token, then
    C{tokens - 1} gaps of C{ITL / speed}.
    """
    decode = (tokens - 1) * ITL / speed
    return RequestRecord(
        request_id="r",
        upstream_request_id="u",
        model=model,
        replica=replica,
        status=status,
        stream=stream,
        prompt_tokens=100,
        completion_tokens=tokens,
        latency=0.1 + decode,
        time_to_first_token=0.1,
    )


def _balancer(
    ids: list[str], affinity: bool = False, balance: str = "load"
) -> tuple[Clock, Balancer]:
    clock = Clock()
    balancer = Balancer(
        clock,
        5.0,
        random.Random(7),
        RouterConfig(balance=balance, prefix_affinity=affinity),
    )
    balancer.set_endpoints(Endpoint(i, f"http://{i}", ("m",)) for i in ids)
    return clock, balancer


def _answer(
    clock: Clock, balancer: Balancer, speeds: dict[str, float], rounds: int
) -> None:
    """
    Each replica answers C{rounds} times, 0.1 s apart.
    """
    for _ in range(rounds):
        for replica, speed in speeds.items():
            balancer.observe(_record(replica, speed))
        clock.advance(0.1)


def _keys(n: int) -> list[bytes]:
    return [b"p" + i.to_bytes(4, "big") for i in range(n)]


def _owners(balancer: Balancer, keys: list[bytes]) -> dict[bytes, str]:
    """
    Each key's replica on idle replicas (the owner: every bound holds).
    """
    owners = {}
    for key in keys:
        replica = balancer.pick("m", set(), key)
        assert replica is not None
        owners[key] = replica.id
    return owners


SPEEDS = {"fast-1": 1.0, "fast-2": 1.0, "slow-1": 1 / 3, "slow-2": 1 / 3}


class SpeedShareTests(SynchronousTestCase):
    def test_slow_replica_a_third(self) -> None:
        """
        A replica three times slower than the others ends up with about a
        third of a fast one's weight, and so of its share of keys.
        """
        clock, balancer = _balancer(list(SPEEDS), affinity=True)
        _answer(clock, balancer, SPEEDS, 20)
        shares = Counter(_owners(balancer, _keys(4000)).values())
        for slow in ("slow-1", "slow-2"):
            for fast in ("fast-1", "fast-2"):
                ratio = shares[slow] / shares[fast]
                self.assertTrue(0.25 < ratio < 0.45, (slow, fast, ratio))

    def test_idle_picks_go_fast(self) -> None:
        """
        Without affinity, on idle replicas the fast ones are chosen (ties
        rotating between them), where equal weights would rotate over all
        four.
        """
        clock, balancer = _balancer(list(SPEEDS))
        _answer(clock, balancer, SPEEDS, 20)
        picks = Counter(
            r.id for r in (balancer.pick("m", set()) for _ in range(40)) if r
        )
        self.assertEqual(picks, Counter({"fast-1": 20, "fast-2": 20}))

    def test_keys_move_off_slow_owner(self) -> None:
        """
        Prefix keys move off a slow owner in proportion, and only off it:
        a key owned by a fast replica stays.  Before any answer, ownership
        is even.
        """
        clock, balancer = _balancer(list(SPEEDS), affinity=True)
        keys = _keys(4000)
        before = _owners(balancer, keys)
        even = Counter(before.values())
        self.assertTrue(all(900 < even[r] < 1100 for r in SPEEDS), even)
        _answer(clock, balancer, SPEEDS, 20)
        after = _owners(balancer, keys)
        moved = [k for k in keys if before[k] != after[k]]
        self.assertTrue(all(before[k].startswith("slow") for k in moved))
        self.assertTrue(all(after[k].startswith("fast") for k in moved))
        # Weights 2**0.5 and 2**-1: a slow replica keeps about 0.5 / 3.83
        # of the keys (13%) of its 25%.
        kept = Counter(after.values())
        for slow in ("slow-1", "slow-2"):
            self.assertTrue(400 < kept[slow] < 650, kept)

    def test_bound_shrinks_for_slow_owner(self) -> None:
        """
        The bounded-load capacity is per unit of learnt weight: with three
        requests in flight on each of two replicas, a key owned by the
        slow one stays there while speeds are unknown (bound 5) and spills
        to the fast one once it is known three times slower (bound 3).
        """
        clock, balancer = _balancer(["fast", "slow"], affinity=True)
        key = next(k for k in _keys(100) if _owners(balancer, [k])[k] == "slow")
        for replica in balancer.replicas():
            replica.outstanding = 3
        chosen = balancer.pick("m", set(), key)
        assert chosen is not None
        self.assertEqual(chosen.id, "slow")
        _answer(clock, balancer, {"fast": 1.0, "slow": 1 / 3}, 20)
        chosen = balancer.pick("m", set(), key)
        assert chosen is not None
        self.assertEqual(chosen.id, "fast")


class SpeedChangeTests(SynchronousTestCase):
    def test_recovered_replica_regains_share(self) -> None:
        """
        A slow replica that becomes as fast as the others is seen within
        a few half-lives of its answers, and owns its share again.
        """
        clock, balancer = _balancer(list(SPEEDS), affinity=True)
        keys = _keys(4000)
        # Slow for ten half-lives (ten answers a second each), then as
        # fast as the others for four: old answers weigh 1/16.
        _answer(clock, balancer, SPEEDS, int(10 * HALF_LIFE * 10))
        self.assertLess(Counter(_owners(balancer, keys).values())["slow-1"], 650)
        recovered = dict(SPEEDS, **{"slow-1": 1.0})
        _answer(clock, balancer, recovered, int(4 * HALF_LIFE * 10))
        shares = Counter(_owners(balancer, keys).values())
        self.assertGreater(shares["slow-1"], shares["slow-2"] * 2)
        self.assertGreater(shares["slow-1"], 900)

    def test_silence_returns_to_equal(self) -> None:
        """
        When answers stop, the samples decay away and every replica counts
        as the mean again: a slow replica that got nothing is tried again.
        """
        clock, balancer = _balancer(list(SPEEDS), affinity=True)
        _answer(clock, balancer, SPEEDS, 20)
        self.assertIsNotNone(balancer.speeds.factors("m"))
        clock.advance(10 * HALF_LIFE)
        self.assertIsNone(balancer.speeds.factors("m"))
        shares = Counter(_owners(balancer, _keys(4000)).values())
        self.assertTrue(all(900 < shares[r] < 1100 for r in SPEEDS), shares)

    def test_equal_replicas_alternate(self) -> None:
        """
        Replicas of equal speed measured a few percent apart keep equal
        factors (steps with hysteresis): sequential requests still
        alternate between them instead of all going to the one measured
        faster.
        """
        clock, balancer = _balancer(["a", "b"])
        _answer(clock, balancer, {"a": 1.04, "b": 0.96}, 20)
        picks = Counter(
            r.id for r in (balancer.pick("m", set()) for _ in range(40)) if r
        )
        self.assertEqual(picks, Counter({"a": 20, "b": 20}))

    def test_ignored_records(self) -> None:
        """
        Non-streamed answers (the body in one piece: no decode to see),
        failed ones, one-token ones and any under another policy teach
        nothing.
        """
        clock, balancer = _balancer(["a", "b"])
        for _ in range(20):
            balancer.observe(_record("b", 0.2, stream=False))
            balancer.observe(_record("b", 0.2, status=500))
            balancer.observe(_record("b", 0.2, tokens=1))
            balancer.observe(_record("a", 1.0))
        self.assertIsNone(balancer.speeds.factors("m"))
        clock, balancer = _balancer(["a", "b"], balance="least_in_flight")
        _answer(clock, balancer, {"a": 1.0, "b": 0.2}, 20)
        self.assertIsNone(balancer.speeds.factors("m"))

    def test_removed_replica_forgotten(self) -> None:
        """
        A replica taken out of the list loses its rate and its factor;
        the mean is over the replicas left.
        """
        clock, balancer = _balancer(["a", "b", "c"])
        _answer(clock, balancer, {"a": 1.0, "b": 0.3, "c": 1.0}, 20)
        self.assertIsNotNone(balancer.speeds.factors("m"))
        balancer.set_endpoints(Endpoint(i, f"http://{i}", ("m",)) for i in ("a", "c"))
        balancer.observe(_record("a", 1.0))
        self.assertEqual(balancer.speeds.factors("m"), {"a": 1.0, "c": 1.0})
