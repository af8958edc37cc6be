"""
Keys shared through PostgreSQL: two key rings, each on its own store and
listener as two processes would have them, on one real database
(L{tests.pg_support}).  A key made on one is known to the other; a key
revoked on one is refused by the other within 1 s; what a listener missed
while disconnected is read again when it reconnects.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from llmgw.accounts.keysync import key_events
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.errors import APIError
from llmgw.store.pg import KeyEvents, PostgresStore
from tests.pg_support import fresh_database


async def _until(
    check: Callable[[], bool], timeout: float, step: float = 0.005
) -> float:
    """
    @return: seconds until C{check()} held.
    @raise AssertionError: it did not within C{timeout} seconds.
    """
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"not within {timeout} s")
        await deferLater(reactor, step, lambda: None)
    return time.monotonic() - began


def _refused(ring: KeyRing, secret: str) -> bool:
    try:
        ring.authenticate(b"Bearer " + secret.encode())
    except APIError as e:
        return e.status == 401
    return False


class KeyEventsTests(TestCase):
    async def ring(self, url: str) -> tuple[KeyRing, KeyEvents, PostgresStore]:
        store = PostgresStore(url, max_connections=2)
        self.addCleanup(store.close)
        rows, _ = store.prepare()
        ring = KeyRing(store, clock=time.monotonic, wall_clock=time.time)
        ring.load(rows)
        events = key_events(store, ring, reactor)  # type: ignore[arg-type]
        assert isinstance(events, KeyEvents)
        events.startService()
        self.addCleanup(events.stopService)
        await _until(lambda: events.listening, 10.0)
        return ring, events, store

    async def test_revoked_everywhere_within_a_second(self) -> None:
        url = fresh_database(self)
        (one, _, _), (two, _, _) = [await self.ring(url) for _ in range(2)]
        key, secret = await one.create("app", rpm=5)
        await _until(lambda: two.find("app") is not None, 1.0)
        self.assertIsNotNone(two.authenticate(b"Bearer " + secret.encode()))
        revoking: Deferred[None] = Deferred.fromCoroutine(one.revoke(key))
        seconds = await _until(lambda: _refused(two, secret), 1.0)
        await revoking
        self.assertTrue(_refused(one, secret))
        self.assertLess(seconds, 1.0)

    async def test_missed_while_disconnected(self) -> None:
        """
        The listener's connection is cut (the database restarted, say);
        a key revoked before it listens again is refused once it does.
        """
        url = fresh_database(self)
        one, _, _ = await self.ring(url)
        two, events, store = await self.ring(url)
        key, secret = await one.create("app")
        await _until(lambda: two.find("app") is not None, 1.0)
        # Cut the listener off, and revoke by SQL alone while it is away:
        # no notification reaches it.
        import psycopg

        with psycopg.connect(url, autocommit=True) as c:
            c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE query LIKE 'LISTEN%%' AND pid <> pg_backend_pid()"
            )
            c.execute("UPDATE api_keys SET revoked = 5 WHERE id = %s", (key.id,))
        await _until(lambda: not events.listening, 5.0)
        self.assertFalse(_refused(two, secret))
        await _until(lambda: events.listening, 10.0)
        await _until(lambda: _refused(two, secret), 2.0)
        self.flushLoggedErrors()
        del store

    async def test_changed_everywhere_within_a_second(self) -> None:
        """
        A key's models, limits and expiry changed on one process reach the
        other's ring within 1 s, its counters kept.
        """
        url = fresh_database(self)
        (one, _, _), (two, _, _) = [await self.ring(url) for _ in range(2)]
        key, secret = await one.create("app", models=["a"], rpm=5)
        await _until(lambda: two.find("app") is not None, 1.0)
        theirs = two.find("app")
        assert theirs is not None
        theirs.tokens_used = 17
        changes = {"models": ["a", "b"], "rpm": None, "tpm": 9, "expires": 4e9}
        await one.update(key, changes)
        seconds = await _until(lambda: theirs.models == ("a", "b"), 1.0)
        self.assertEqual(
            (theirs.rpm, theirs.tpm, theirs.expires, theirs.tokens_used),
            (None, 9, 4e9, 17),
        )
        self.assertLess(seconds, 1.0)
        # An expiry in the past: refused there too.
        await one.update(key, {"expires": time.time() - 1})
        await _until(lambda: _refused(two, secret), 1.0)
        self.assertTrue(_refused(one, secret))
