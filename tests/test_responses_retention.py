"""
Stored responses kept for C{[store] responses_retention}: the setting, the
router's view of the store (a response past retention reads as unknown
before any pass deletes it) and the server's job deleting them.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.accounts.responses import ResponseRetention, StoreResponses
from llmgw.accounts.settings import parse_store
from llmgw.config_checks import ConfigError
from llmgw.router.interfaces import KeptResponse
from llmgw.store.db import SQLiteStore

DAY = 86400.0


def _state(rid: str, key_id: int | None, created: float) -> KeptResponse:
    return KeptResponse(
        id=rid,
        key_id=key_id,
        model="m",
        created_at=created,
        previous_response_id=None,
        input_items=[{"role": "user", "content": "hi"}],
        output_items=[],
        response={"id": rid, "object": "response"},
    )


class SettingTests(SynchronousTestCase):
    def test_default_and_read(self) -> None:
        """
        Thirty days unless set; a duration with a unit is read as seconds.
        """
        self.assertEqual(parse_store({}).responses_retention, 30 * DAY)
        self.assertEqual(
            parse_store({"responses_retention": "12h"}).responses_retention, 43200.0
        )

    def test_refused(self) -> None:
        """
        Zero, or not a duration, is a config error naming the key.
        """
        for value in ("0s", "soon"):
            with self.assertRaises(ConfigError) as raised:
                parse_store({"responses_retention": value})
            self.assertIn("store.responses_retention", str(raised.exception))


class StoreResponsesTests(TestCase):
    """
    The router's L{llmgw.router.interfaces.ResponseStore} on a SQLite store.
    """

    def setUp(self) -> None:
        path = os.path.join(tempfile.mkdtemp(prefix="llmgw-responses-"), "llmgw.db")
        self.store = SQLiteStore(path)
        self.addCleanup(self.store.close)
        self.store.prepare()
        self.now = 10 * DAY
        self.responses = StoreResponses(self.store, DAY, lambda: self.now)

    async def test_round_trip_per_key(self) -> None:
        """
        A response put is read back whole by its key, not by another, and
        deleted by its key.
        """
        state = _state("resp_1", 7, self.now - 10)
        await self.responses.put(state)
        self.assertEqual(await self.responses.get("resp_1", 7), state)
        self.assertIsNone(await self.responses.get("resp_1", 8))
        self.assertFalse(await self.responses.delete("resp_1", 8))
        self.assertTrue(await self.responses.delete("resp_1", 7))
        self.assertIsNone(await self.responses.get("resp_1", 7))

    async def test_deeply_nested_kept(self) -> None:
        """
        A client's object nested 900 deep (a tool's parameters, as the
        JSON parser takes it) is kept and read back: copying the record
        raised RecursionError and the response was lost.
        """
        nested: object = 1
        for _ in range(900):
            nested = {"a": nested}
        state = KeptResponse(
            **{
                **_state("resp_deep", 7, self.now - 10).__dict__,
                "input_items": [{"role": "user", "content": "hi", "x": nested}],
            }
        )
        await self.responses.put(state)
        self.assertEqual(await self.responses.get("resp_deep", 7), state)

    async def test_past_retention_unknown(self) -> None:
        """
        Once older than the retention, a response reads as unknown though
        no pass has deleted it yet.
        """
        await self.responses.put(_state("resp_1", None, self.now - 10))
        self.assertIsNotNone(await self.responses.get("resp_1", None))
        self.now += DAY
        self.assertIsNone(await self.responses.get("resp_1", None))
        self.assertEqual(await self.store.drop_responses(self.now - DAY), 1)


class FakeStore:
    """
    What L{ResponseRetention} calls of a store, answered from a list.
    """

    database_errors = (sqlite3.OperationalError,)

    def __init__(self) -> None:
        self.cutoffs: list[float] = []
        self.answers: list[Deferred[int]] = []

    def drop_responses(self, before: float) -> Deferred[int]:
        self.cutoffs.append(before)
        return self.answers.pop(0) if self.answers else succeed(0)


class RetentionJobTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.store = FakeStore()
        self.now = 100 * DAY
        self.job = ResponseRetention(
            self.store,  # type: ignore[arg-type]
            self.clock,
            30 * DAY,
            interval=3600.0,
            wall_clock=lambda: self.now + self.clock.seconds(),
        )

    def test_passes(self) -> None:
        """
        A pass at start and one every interval, each deleting what is
        older than the retention then; a refused pass is tried again at the
        next, and the count is of what was deleted.
        """
        self.store.answers = [
            succeed(3),
            fail(sqlite3.OperationalError("database is locked")),
            succeed(2),
        ]
        self.job.startService()
        self.clock.advance(3600)
        self.clock.advance(3600)
        self.assertEqual(
            self.store.cutoffs,
            [70 * DAY, 70 * DAY + 3600, 70 * DAY + 7200],
        )
        self.assertEqual(self.job.dropped, 5)
        self.successResultOf(self.job.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_waits_for_the_pass(self) -> None:
        """
        Stopping waits for the pass in flight, and no pass starts while one
        runs.
        """
        running: Deferred[int] = Deferred()
        self.store.answers = [running]
        self.job.startService()
        self.clock.advance(3600)
        self.assertEqual(len(self.store.cutoffs), 1)
        stopped = self.job.stopService()
        self.assertNoResult(stopped)
        running.callback(4)
        self.successResultOf(stopped)
        self.assertEqual(self.job.dropped, 4)
