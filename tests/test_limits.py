"""
Limits across routers: several key rings, as several routers would hold
them, on one real Redis (L{tests.redis_support}) through their own
clients and thread pools; and without Redis, each ring its equal share.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.router.accounting import limits as limits_module
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.accounting.limits import RedisLimits
from llmgw.router.errors import APIError
from tests.redis_support import start_redis
from tests.support import closed_port


class _NoStore:
    def add_key(self, row: dict[str, Any]) -> Deferred[int]:
        raise NotImplementedError

    def revoke_key(self, key_id: int, when: float) -> Deferred[None]:
        raise NotImplementedError

    def update_key(self, key_id: int, changes: dict[str, Any]) -> Deferred[None]:
        raise NotImplementedError


def _row(**limits: Any) -> dict[str, Any]:
    return {
        "id": 7,
        "name": "app",
        "prefix": "sk-app",
        "hash": "h",
        "models": None,
        "rpm": None,
        "tpm": None,
        "budget_tokens": None,
        "admin": False,
        "created": 1e9,
        **limits,
    }


class RedisLimitsTests(TestCase):
    def rings(
        self,
        url: str,
        count: int,
        window: float = 60.0,
        share: int = 1,
        **limits: Any,
    ) -> list[KeyRing]:
        """
        C{count} rings on Redis at C{url}; C{share} 1 by default (each
        router would admit the whole limit by itself).
        """
        rings = []
        for _ in range(count):
            shared = RedisLimits(url, reactor, window=window)  # type: ignore[arg-type]
            self.addCleanup(shared.stop)
            ring = KeyRing(
                _NoStore(),
                clock=time.monotonic,
                wall_clock=time.time,
                limits=shared,
                share=share,
            )
            ring.load([_row(**limits)])
            rings.append(ring)
        return rings

    async def admit_all(
        self, rings: list[KeyRing], each: int, reserve: int = 0
    ) -> tuple[int, list[APIError]]:
        """
        C{each} admissions per ring, all in flight at once.

        @return: how many were admitted, and the refusals.
        """
        calls: list[Deferred[Any]] = []
        for _ in range(each):
            for ring in rings:
                (key,) = ring.keys()
                admitted = ring.admit(key, ["m"], reserve)
                assert admitted is not None
                calls.append(admitted)
        results = await DeferredList(calls, consumeErrors=True)
        refused = [r.value for ok, r in results if not ok]
        for error in refused:
            self.assertIsInstance(error, APIError)
        return sum(1 for ok, _ in results if ok), refused

    async def test_exactly_rpm_across_routers(self) -> None:
        """
        rpm = 60, three routers, 150 requests at once: exactly 60
        admitted; the others 429 with a Retry-After within the minute.
        """
        rings = self.rings(start_redis(self), 3, rpm=60)
        admitted, refused = await self.admit_all(rings, 50)
        self.assertEqual((admitted, len(refused)), (60, 90))
        self.assertEqual({e.code for e in refused}, {"rate_limit_exceeded"})
        self.assertTrue(
            all(e.retry_after is not None and 1 <= e.retry_after <= 60 for e in refused)
        )

    async def test_window_slides(self) -> None:
        """
        A 1 s window (rpm counted over it): full, then free again once
        it has passed.
        """
        rings = self.rings(start_redis(self), 2, window=1.0, rpm=5)
        self.assertEqual((await self.admit_all(rings, 4))[0], 5)
        await deferLater(reactor, 1.1, lambda: None)
        self.assertEqual((await self.admit_all(rings, 4))[0], 5)

    async def test_tokens_and_budget_shared(self) -> None:
        """
        Tokens one router counts hold for the other: held tokens count
        against tpm while in flight; a budget spent on one refuses on the
        other.
        """
        one, two = self.rings(start_redis(self), 2, tpm=100, budget_tokens=150)
        (k1,), (k2,) = one.keys(), two.keys()
        # 3 x 30 held: 90 < 100 admits the fourth (120), then none.
        admitted, refused = await self.admit_all([one, two], 3, reserve=30)
        self.assertEqual(admitted, 4)
        self.assertEqual({e.code for e in refused}, {"rate_limit_exceeded"})
        # Each finishes what it admitted (which ring got which of the four
        # is the race's), 20 tokens each: 80 in the window, nothing held.
        finished = 0
        for ring, key in ((one, k1), (two, k2)):
            for _ in range(len(ring._members.get(key.id, []))):
                ring.used(key, 20, 30)
                finished += 1
        self.assertEqual(finished, 4)
        await deferLater(reactor, 0.2, lambda: None)
        last = two.admit(k2, ["m"], 0)
        assert last is not None
        await last
        two.used(k2, 70, 0)
        await deferLater(reactor, 0.2, lambda: None)
        # 150 used in all (80 + 70): the budget is spent, whichever asks.
        for ring, key in ((one, k1), (two, k2)):
            refusal = ring.admit(key, ["m"], 0)
            assert refusal is not None
            with self.assertRaises(APIError) as raised:
                await refusal
            self.assertEqual(raised.exception.code, "insufficient_quota")

    async def test_held_tokens_of_a_dead_router_let_go(self) -> None:
        """
        A router that admitted a request holding the whole tpm and died
        (never said it finished): the others are refused until the
        reservation's time is up, then admitted.
        """
        self.patch(limits_module, "RESERVATION_TTL", 0.5)
        dead, alive = self.rings(start_redis(self), 2, window=0.5, tpm=100)
        held = dead.admit(dead.keys()[0], ["m"], 100)
        assert held is not None
        await held
        refused = alive.admit(alive.keys()[0], ["m"], 10)
        assert refused is not None
        with self.assertRaises(APIError):
            await refused
        await deferLater(reactor, 1.2, lambda: None)
        admitted = alive.admit(alive.keys()[0], ["m"], 10)
        assert admitted is not None
        await admitted

    async def test_redis_away_each_its_share(self) -> None:
        """
        Redis cannot be reached: each of three routers admits its share,
        20 of 60, and says so once.
        """
        url = f"redis://127.0.0.1:{closed_port()}/0"
        rings = self.rings(url, 3, share=3, rpm=60)
        admitted, _ = await self.admit_all(rings, 30)
        self.assertEqual(admitted, 60)
        for ring in rings:
            self.assertEqual(len(ring.keys()[0].requests), 20)

    def test_unlimited_key_never_asks(self) -> None:
        """
        A key without rpm, tpm or budget is admitted here, without a
        round trip (Redis away or not).
        """
        url = f"redis://127.0.0.1:{closed_port()}/0"
        (ring,) = self.rings(url, 1)
        (key,) = ring.keys()
        self.assertIsNone(ring.admit(key, ["m"], 10))
        ring.used(key, 5, 10)
        self.assertFalse(ring._redis_failing)


class SharedWithoutRedisTests(SynchronousTestCase):
    def rings(self, count: int, **limits: Any) -> list[KeyRing]:
        rings = []
        for _ in range(count):
            ring = KeyRing(
                _NoStore(), clock=lambda: 0.0, wall_clock=lambda: 0.0, share=count
            )
            ring.load([_row(**limits)])
            rings.append(ring)
        return rings

    def admitted(self, ring: KeyRing, tries: int) -> int:
        count = 0
        (key,) = ring.keys()
        for _ in range(tries):
            try:
                self.assertIsNone(ring.admit(key, ["m"]))
                count += 1
            except APIError:
                pass
        return count

    def test_equal_share(self) -> None:
        """
        rpm = 60 over three routers: 20 each, 60 in all; rpm = 10: 4
        each (ceil), 12 in all: at most routers - 1 over.
        """
        self.assertEqual(
            [self.admitted(r, 50) for r in self.rings(3, rpm=60)], [20] * 3
        )
        self.assertEqual([self.admitted(r, 50) for r in self.rings(3, rpm=10)], [4] * 3)

    def test_budget_share(self) -> None:
        """
        A budget of 100 with 40 used before start, two routers: each may
        spend 30 of the 60 left.
        """
        one, two = self.rings(2, budget_tokens=100, tokens_used=40)
        (key,) = one.keys()
        one.admit(key, ["m"])
        one.used(key, 29)
        one.admit(key, ["m"])
        one.used(key, 1)
        with self.assertRaises(APIError) as raised:
            one.admit(key, ["m"])
        self.assertEqual(raised.exception.code, "insufficient_quota")
        self.assertEqual(self.admitted(two, 1), 1)
