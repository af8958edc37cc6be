"""
Migrations out of the boot path, on both engines (a SQLite file and a
real PostgreSQL, L{tests.pg_support}): a database whose pending migration
rewrites rows is refused at start and left as it was; C{migrate} with
C{dry_run} tells and changes nothing; C{migrate} applies it; additive ones
and a new database still migrate at start; a migration that fails halfway
leaves nothing of itself; on PostgreSQL the usage table ends partitioned
by month, with the rows it had.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from typing import TYPE_CHECKING, Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.store import migrations
from llmgw.store.base import MIGRATIONS, Store, StoreError
from llmgw.store.db import open_store
from llmgw.store.migrations import Migration, MigrationPending
from tests.pg_support import fresh_database

ROWS = 1000
DUPLICATES = 100

if TYPE_CHECKING:
    _Base = SynchronousTestCase
else:
    _Base = object


class _Migrations(_Base):
    """
    The tests; a subclass gives the engine.
    """

    postgresql = False

    def make_store(self) -> Store:
        raise NotImplementedError

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def schema_version(self) -> int:
        raise NotImplementedError

    def set_schema_version(self, version: int) -> None:
        raise NotImplementedError

    def store(self) -> Store:
        store = self.make_store()
        self.addCleanup(store.close)
        return store

    def old_database(self, version: int, rows: int = ROWS) -> None:
        """
        A database at schema C{version} (as an older llmgw left it) with
        C{rows} usage rows, the last L{DUPLICATES} of them repeating
        request ids.
        """
        for migration in MIGRATIONS[:version]:
            for statement in migration.statements_for(self.postgresql):
                self.raw(statement)
            for statement in migration.concurrent if self.postgresql else ():
                self.raw(statement)
        self.set_schema_version(version)
        unique = rows - DUPLICATES
        for start in range(0, rows, 500):
            values = ",".join(
                f"({1.7e9 + i}, 'r{i % unique}', 1, 'k', 'm', 'r1', 200, 0, 3, 4,"
                " 0.5, 0.25)"
                for i in range(start, min(start + 500, rows))
            )
            self.raw(
                "INSERT INTO usage (time, request_id, key_id, key_name, model,"
                " replica, status, stream, prompt_tokens, completion_tokens,"
                f" latency, time_to_first_token) VALUES {values}"
            )

    def count(self) -> int:
        return int(self.raw("SELECT COUNT(*) FROM usage")[0][0])

    def test_rewrite_refused_at_start(self) -> None:
        """
        A pending migration that rewrites the usage table's rows: start
        (L{Store.prepare}) refuses with one line naming C{llmgw store
        migrate}, and the database is left at its version with its rows.
        """
        self.old_database(2)
        with self.assertRaises(MigrationPending) as raised:
            self.store().prepare()
        message = str(raised.exception)
        self.assertIn("migration 3 (", message)
        self.assertIn("`llmgw store migrate`", message)
        self.assertNotIn("\n", message)
        self.assertEqual(self.schema_version(), 2)
        self.assertEqual(self.count(), ROWS)

    def test_dry_run_then_migrate(self) -> None:
        """
        C{dry_run} tells each pending migration (with the rows it rewrites)
        and its statements, and changes nothing; C{migrate} then applies
        them with progress, and start reads the result.
        """
        self.old_database(2)
        told: list[str] = []
        self.assertEqual(self.store().migrate(told.append, dry_run=True), 2)
        self.assertEqual(self.schema_version(), 2)
        self.assertEqual(self.count(), ROWS)
        self.assertIn(f"[rewrites usage: {ROWS:,} rows]", told[0])
        self.assertTrue(told[0].startswith("migration 3: "))
        self.assertTrue(any(line.strip().startswith("DELETE FROM") for line in told))
        numbers = [line.split(":")[0] for line in told if line.startswith("migration")]
        self.assertEqual(
            numbers, [f"migration {n}" for n in range(3, len(MIGRATIONS) + 1)]
        )
        progress: list[str] = []
        self.assertEqual(self.store().migrate(progress.append), len(MIGRATIONS))
        self.assertEqual(self.schema_version(), len(MIGRATIONS))
        self.assertEqual(self.count(), ROWS - DUPLICATES)
        self.assertIn("migration 3: done in ", "\n".join(progress))
        self.assertEqual(self.store().prepare(), ([], []))

    def test_additive_at_start(self) -> None:
        """
        Only additive migrations pending (or a rewrite of a table without
        rows): start applies them.
        """
        self.old_database(2, rows=0)
        self.store().prepare()
        self.assertEqual(self.schema_version(), len(MIGRATIONS))

    def test_failure_halfway_rolled_back(self) -> None:
        """
        A migration whose second statement fails leaves nothing of its
        first (the rows it deleted are back) and the version where it was;
        the error is one line.
        """
        self.old_database(2)
        broken = Migration(
            "drops rows, then fails",
            "DELETE FROM usage; INSERT INTO no_such_table VALUES (1);",
            rewrites="usage",
            postgres="DELETE FROM usage; INSERT INTO no_such_table VALUES (1);",
        )
        self.patch(migrations, "MIGRATIONS", (*MIGRATIONS[:2], broken))
        with self.assertRaises(StoreError) as raised:
            self.store().migrate(lambda line: None)
        self.assertIn("no_such_table", str(raised.exception))
        self.assertNotIn("\n", str(raised.exception))
        self.assertEqual(self.schema_version(), 2)
        self.assertEqual(self.count(), ROWS)


class SQLiteMigrationTests(_Migrations, SynchronousTestCase):
    def setUp(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="llmgw-store-"), "llmgw.db")

    def make_store(self) -> Store:
        return open_store(f"sqlite://{self.path}", "/nonexistent")

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        connection = sqlite3.connect(self.path)
        try:
            rows = connection.execute(sql, params).fetchall()
            connection.commit()
        finally:
            connection.close()
        return rows

    def schema_version(self) -> int:
        return int(self.raw("PRAGMA user_version")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw(f"PRAGMA user_version = {version}")


class PostgresMigrationTests(_Migrations, SynchronousTestCase):
    postgresql = True

    def setUp(self) -> None:
        self.url = fresh_database(self)

    def make_store(self) -> Store:
        return open_store(self.url, "/nonexistent")

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as connection:
            cursor = connection.execute(sql.replace("?", "%s").encode(), params)
            return cursor.fetchall() if cursor.description else []

    def schema_version(self) -> int:
        return int(self.raw("SELECT version FROM llmgw_schema")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw("CREATE TABLE IF NOT EXISTS llmgw_schema (version BIGINT NOT NULL)")
        self.raw("DELETE FROM llmgw_schema")
        self.raw("INSERT INTO llmgw_schema (version) VALUES (?)", (version,))

    def test_partitioned_by_month(self) -> None:
        """
        From schema 5 with rows over three months: the partitioning
        migration is refused at start, then C{migrate} copies every row
        into a table partitioned by month (one partition per month of the
        rows and the months ahead), and new rows get new ids.
        """
        self.old_database(5, rows=0)
        month = 31 * 86400
        for i in range(300):
            self.raw(
                "INSERT INTO usage (time, request_id, model, status, stream,"
                " prompt_tokens, completion_tokens, latency)"
                " VALUES (?, ?, 'm', 200, 0, 1, 2, 0.1)",
                (1.7e9 + (i % 3) * month, f"p{i}"),
            )
        with self.assertRaises(MigrationPending):
            self.store().prepare()
        told: list[str] = []
        self.store().migrate(told.append)
        self.assertIn("swapped in the partitioned table", "\n".join(told))
        kind = self.raw("SELECT relkind FROM pg_class WHERE relname = 'usage'")
        self.assertEqual(kind, [("p",)])
        parts = self.raw(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c"
            " ON c.oid = i.inhrelid WHERE i.inhparent = 'usage'::regclass"
        )
        names = {name for (name,) in parts}
        self.assertTrue({"usage_p202311", "usage_p202312", "usage_p202401"} <= names)
        self.assertIn("usage_default", names)
        self.assertEqual(self.count(), 300)
        self.assertEqual(self.raw("SELECT COUNT(*) FROM usage_default"), [(0,)])
        self.raw(
            "INSERT INTO usage (time, request_id, model, status, stream,"
            " prompt_tokens, completion_tokens, latency)"
            " VALUES (1.7e9, 'new', 'm', 200, 0, 1, 2, 0.1)"
        )
        (top,) = self.raw("SELECT MAX(id) FROM usage")[0]
        self.assertEqual(
            self.raw("SELECT id FROM usage WHERE request_id = 'new'"), [(top,)]
        )
        self.assertGreater(top, 300)
