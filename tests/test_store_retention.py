"""
Usage kept for C{[store] usage_retention}, on both engines: rows past it
rolled into daily totals that the usage report still counts (its sums
unchanged), rows written during a roll neither lost nor counted twice, a
late row added to its day's total; on PostgreSQL a month wholly past it
goes with its partition.  And the setting itself, and the server's job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from llmgw.accounts.retention import UsageRetention
from llmgw.accounts.settings import parse_store
from llmgw.config_checks import ConfigError
from llmgw.store.base import DAY, Store, UsageRow
from tests import test_store_backends

START = 1_700_006_400.0  # 2023-11-15 00:00 UTC
DAYS = 40
ROWS = 2000


def _rows(
    prefix: str, count: int, start: float, step: float
) -> list[tuple[float, UsageRow]]:
    rows = []
    for i in range(count):
        key = i % 3
        rows.append(
            (
                start + i * step,
                UsageRow(
                    request_id=f"{prefix}{i}",
                    key_id=key or None,
                    key_name=f"key{key}" if key else None,
                    model=("a", "b")[i % 2],
                    replica="r1",
                    status=(200, 200, 200, 429)[i % 4],
                    stream=False,
                    prompt_tokens=i % 17,
                    completion_tokens=i % 5,
                    latency=0.5 + (i % 7) / 10,
                    time_to_first_token=None if i % 4 == 3 else 0.1 + (i % 3) / 10,
                    estimated=i % 11 == 0,
                ),
            )
        )
    return rows


def _sums(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    The report with its means rounded (a mean of sums is not bit for bit
    the mean of the rows).
    """
    return [
        {k: round(v, 9) if isinstance(v, float) else v for k, v in group.items()}
        for group in groups
    ]


if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object


class _Retention(_Base):
    """
    The tests; a subclass gives the engine (as L{test_store_backends}).
    """

    def store(self) -> Store:
        raise NotImplementedError

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    async def report(self, store: Store) -> tuple[list[Any], list[Any]]:
        by_key = await store.usage("key", 0.0, 4e9)
        by_model = await store.usage("model", 0.0, 4e9)
        return _sums(by_key), _sums(by_model)

    async def test_sums_unchanged(self) -> None:
        """
        Rows over 40 days, those of the first 30 rolled: the report by key
        and by model over the whole time is the same, sums exact and means
        to 1e-9; no row before the cutoff is left; the totals are one per
        day, key and model; a second roll rolls nothing.
        """
        store = self.store()
        store.prepare()
        await store.add_usage(_rows("r", ROWS, START, DAYS * DAY / ROWS), {})
        before = await self.report(store)
        cutoff = START + 30 * DAY
        rolled = await store.roll_usage(cutoff)
        self.assertEqual(rolled, 1500)
        self.assertEqual(await self.report(store), before)
        self.assertEqual(
            self.raw("SELECT COUNT(*) FROM usage WHERE time < ?", (cutoff,)), [(0,)]
        )
        self.assertEqual(self.raw("SELECT COUNT(*) FROM usage_daily"), [(30 * 6,)])
        self.assertEqual(await store.roll_usage(cutoff), 0)
        # A day's totals count when the day starts in the range.
        day = await store.usage("model", START, START + DAY)
        self.assertEqual(sum(g["requests"] for g in day), 50)

    async def test_writes_during_a_roll(self) -> None:
        """
        Rows written while a roll runs (new ones, and late ones from a
        day being rolled) are each counted once: the requests reported
        are all of them, and a late row rolled by the next pass adds to
        its day's total.
        """
        store = self.store()
        store.prepare()
        await store.add_usage(_rows("old", 1000, START, 20 * DAY / 1000), {})
        cutoff = START + 20 * DAY
        writes = [
            store.add_usage(_rows(f"new{n}-", 50, cutoff + n, 1.0), {})
            for n in range(5)
        ]
        late = store.add_usage(_rows("late", 20, START + 5 * DAY, 1.0), {})
        roll = store.roll_usage(cutoff)
        pending: list[Deferred[Any]] = [*writes, late, roll]
        await DeferredList(pending, fireOnOneErrback=True)
        await store.roll_usage(cutoff)
        groups = await store.usage("model", 0.0, 4e9)
        self.assertEqual(sum(g["requests"] for g in groups), 1000 + 250 + 20)
        self.assertEqual(
            self.raw("SELECT COUNT(*) FROM usage WHERE time < ?", (cutoff,)), [(0,)]
        )


class SQLiteRetentionTests(_Retention, TestCase):
    def setUp(self) -> None:
        self.engine = test_store_backends.SQLiteStoreTests()
        self.engine.setUp()

    def store(self) -> Store:
        store = self.engine.make_store()
        self.addCleanup(store.close)
        return store

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.engine.raw(sql, params)


class PostgresRetentionTests(_Retention, TestCase):
    def setUp(self) -> None:
        from tests.pg_support import fresh_database

        self.url = fresh_database(self)

    def store(self) -> Store:
        from llmgw.store.pg import PostgresStore

        store = PostgresStore(self.url)
        self.addCleanup(store.close)
        return store

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as connection:
            cursor = connection.execute(sql.replace("?", "%s").encode(), params)
            return cursor.fetchall() if cursor.description else []

    async def test_month_dropped_whole(self) -> None:
        """
        A month wholly past retention goes with its partition (the table
        is dropped, its rows counted in the totals); the month the cutoff
        falls in keeps its partition, rolled by day.
        """
        from llmgw.store import pg_schema

        store = self.store()
        store.prepare()
        import psycopg

        with psycopg.connect(self.url) as connection:
            for months in range(3):
                pg_schema.add_month(connection, pg_schema.month_start(START, months))
        await store.add_usage(_rows("m", 900, START, 45 * DAY / 900), {})
        before = await self.report(store)
        cutoff = pg_schema.month_start(START, 1) + 5 * DAY
        self.assertEqual(
            await store.roll_usage(cutoff), int((cutoff - START) / (45 * DAY / 900))
        )
        self.assertEqual(await self.report(store), before)
        names = {
            n
            for (n,) in self.raw(
                "SELECT relname FROM pg_class WHERE relname LIKE 'usage_p2%%'"
            )
        }
        self.assertNotIn(pg_schema.partition_name(START), names)
        self.assertIn(pg_schema.partition_name(cutoff), names)


class _Store:
    """
    A store whose rolls the test answers.
    """

    database_errors = (OSError,)

    def __init__(self) -> None:
        self.rolls: list[tuple[float, Deferred[int]]] = []

    def roll_usage(self, before: float) -> Deferred[int]:
        d: Deferred[int] = Deferred()
        self.rolls.append((before, d))
        return d


class RetentionJobTests(SynchronousTestCase):
    def test_passes(self) -> None:
        """
        A pass at start with the cutoff at the start of the UTC day
        C{retention} ago, the next every C{interval}, never two at once,
        a failed one logged and tried again; stop waits for the pass in
        flight.
        """
        clock = Clock()
        store = _Store()
        job = UsageRetention(
            store,  # type: ignore[arg-type]
            clock,
            retention=365 * DAY,
            interval=3600.0,
            wall_clock=lambda: START + 365 * DAY + 3 * 3600 + clock.seconds(),
        )
        job.startService()
        self.assertEqual([before for before, _ in store.rolls], [START])
        clock.advance(3600)
        self.assertEqual(len(store.rolls), 1)
        store.rolls[0][1].callback(7)
        self.assertEqual(job.rolled, 7)
        clock.advance(3600)
        self.assertEqual(len(store.rolls), 2)
        store.rolls[1][1].errback(OSError("disk I/O error"))
        self.assertEqual(len(self.flushLoggedErrors()), 0)
        clock.advance(3600)
        stopped = job.stopService()
        self.assertNoResult(stopped)
        store.rolls[2][1].callback(0)
        self.successResultOf(stopped)
        self.assertEqual(clock.getDelayedCalls(), [])


class SettingTests(SynchronousTestCase):
    def test_usage_retention(self) -> None:
        """
        C{[store] usage_retention}: a year by default; a duration of a day
        or more; less than a day, or not a duration, is a config error
        naming the key.
        """
        self.assertEqual(parse_store({}).usage_retention, 365 * DAY)
        self.assertEqual(
            parse_store({"usage_retention": "90d"}).usage_retention, 90 * DAY
        )
        for bad in ("12h", "a year", -1, True):
            with self.assertRaises(ConfigError) as raised:
                parse_store({"usage_retention": bad})
            self.assertIn("store.usage_retention", str(raised.exception))
