"""
SQLite through L{twisted.enterprise.adbapi}: one writing connection on its
own thread (SQLite serializes writers anyway), and one reading connection on
another, so that a read never queues behind a write waiting for the lock
(in WAL mode readers see the last commit and are not blocked by a writer:
U{https://www.sqlite.org/wal.html}, "Concurrency"); WAL journal, versioned
schema migrations applied at start.

A leaf, as the whole store: it imports nothing from the rest of llmgw.  Its
callers hand it its own row types and turn L{StoreError} into their own
errors.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred

from llmgw.store.base import (
    DAY,
    MIGRATIONS,
    ROLLUP_COLUMNS,
    ROLLUP_UPSERT,
    USAGE_COLUMNS,
    MigrationPending,
    Progress,
    Store,
    StoreError,
    UsageRow,
    key_row,
    key_update,
    rollup_select,
    shape_usage,
    usage_marks,
    usage_query,
    usage_values,
)
from llmgw.store.migrations import Migration, describe, pending, quiet, refusal
from llmgw.store.responses import (
    RESPONSE_COLUMNS,
    StoredResponse,
    owned,
    put_response_sql,
    response_row,
    response_values,
)

__all__ = [
    "MIGRATIONS",
    "READ_BUSY_TIMEOUT_MS",
    "SQLiteStore",
    "Store",
    "StoreError",
    "UsageRow",
    "open_store",
    "sqlite_path",
]


def sqlite_path(url: str, state_dir: str) -> str:
    """
    @param url: C{[store] url}: C{sqlite:///ABSOLUTE/PATH} or
        C{sqlite:RELATIVE/PATH}; empty for the default,
        C{STATE_DIR/llmgw.db}.
    @return: the database file's path.
    @raise StoreError: not a SQLite URL.
    """
    if not url:
        return os.path.join(os.path.expanduser(state_dir), "llmgw.db")
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc or not parts.path:
        raise StoreError(
            f"store.url: {url!r}: expected sqlite:///absolute/path.db,"
            " sqlite:relative/path.db or postgresql://user@host:port/db"
        )
    return os.path.expanduser(parts.path)


READ_BUSY_TIMEOUT_MS = 1000
"""
How long a read waits for a lock, milliseconds, before failing with
L{sqlite3.OperationalError}.  A WAL reader needs none in the common case;
this bounds the rare ones (another process recovering the WAL index).
"""


def open_store(url: str, state_dir: str) -> Store:
    """
    The store C{[store] url} names, not yet prepared.

    @param url: empty (C{STATE_DIR/llmgw.db}), C{sqlite:...} or
        C{postgresql://...} (also C{postgres://}).
    @raise StoreError: a URL of neither engine, or a folder that cannot
        be made.
    """
    if urlsplit(url).scheme in ("postgresql", "postgres"):
        from llmgw.store.pg import PostgresStore

        return PostgresStore(url)
    return SQLiteStore(sqlite_path(url, state_dir))


class SQLiteStore(Store):
    """
    The database in one SQLite file.  Every method returns a Deferred
    fired from the pool's thread's result, on the reactor thread.

    @param path: the SQLite file, made (with its folder) if missing.
    @raise StoreError: the folder cannot be made.
    """

    database_errors = (sqlite3.Error,)
    integrity_errors = (sqlite3.IntegrityError,)

    def __init__(self, path: str) -> None:
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StoreError(f"store: cannot make {folder!r}: {e.strerror}") from None
        self.pool = adbapi.ConnectionPool(
            "sqlite3",
            path,
            check_same_thread=False,
            cp_min=1,
            cp_max=1,
            cp_openfun=self._opened,
            # Autocommit off: each interaction is one transaction.
            isolation_level="DEFERRED",
        )
        # Reads on their own connection and thread: a write waiting out
        # another process's lock (busy_timeout) holds only the writer's.
        self.reader = adbapi.ConnectionPool(
            "sqlite3",
            path,
            check_same_thread=False,
            cp_min=1,
            cp_max=1,
            cp_openfun=self._opened_reader,
            isolation_level="DEFERRED",
        )
        # One writer at a time: a claim's one UPDATE is atomic as it is.
        super().__init__(
            self.pool.runInteraction,  # type: ignore[arg-type]
            self.reader.runInteraction,  # type: ignore[arg-type]
            "?",
            "",
        )

    @staticmethod
    def _opened(connection: sqlite3.Connection) -> None:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.execute("PRAGMA busy_timeout=5000")

    @staticmethod
    def _opened_reader(connection: sqlite3.Connection) -> None:
        # The journal mode is the file's (set by prepare); this connection
        # only reads, and waits little for what a WAL reader rarely needs.
        connection.execute("PRAGMA query_only=1")
        connection.execute(f"PRAGMA busy_timeout={READ_BUSY_TIMEOUT_MS}")

    def _connect(self) -> sqlite3.Connection:
        """
        @return: a connection of this thread's own, in autocommit mode
            (transactions begun and ended explicitly).
        @raise StoreError: the file cannot be opened.
        """
        try:
            connection = sqlite3.connect(self.path, isolation_level=None)
            self._opened(connection)
        except sqlite3.Error as e:
            raise StoreError(f"store: cannot open {self.path!r}: {e}") from None
        return connection

    def prepare(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """
        At start, before the reactor runs: apply the additive migrations
        (refusing one that rewrites rows), then read the keys and the
        runtime models, on this thread.

        @return: every key, revoked ones included, as dicts of the
            C{api_keys} columns (C{models} decoded: a list or L{None});
            and the runtime models, as L{models} gives them.  The drained
            nodes go to L{drained}.
        @raise StoreError: the database cannot be opened or migrated (not
            a database, or newer than this code).
        @raise MigrationPending: a migration that rewrites rows is pending
            (nothing changed).
        """
        connection = self._connect()
        try:
            self._migrate(connection, quiet, dry_run=False, at_start=True)
            cursor = connection.cursor()
            keys = self._keys(cursor)
            models = cursor.execute(
                "SELECT name, spec FROM models ORDER BY added"
            ).fetchall()
            self.drained = dict(
                cursor.execute("SELECT node_id, since FROM node_drains").fetchall()
            )
            return keys, [(name, spec) for name, spec in models]
        except MigrationPending:
            raise
        except (sqlite3.Error, StoreError) as e:
            raise StoreError(f"store: {self.path!r}: {e}") from None
        finally:
            connection.close()

    def migrate(self, progress: Progress, dry_run: bool = False) -> int:
        connection = self._connect()
        try:
            return self._migrate(connection, progress, dry_run, at_start=False)
        except sqlite3.Error as e:
            raise StoreError(f"store: {self.path!r}: {e}") from None
        finally:
            connection.close()

    def _migrate(
        self,
        connection: sqlite3.Connection,
        progress: Progress,
        dry_run: bool,
        at_start: bool,
    ) -> int:
        version = _version(connection)
        steps = pending(version)
        for number, migration in steps:
            table = migration.rewritten(False)
            if at_start and table is not None and version > 0:
                if connection.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone():
                    raise MigrationPending(
                        refusal(repr(self.path), number, migration, table)
                    )
        for number, migration in steps:
            table = migration.rewritten(False)
            rows = 0
            if not at_start and table is not None and version > 0:
                rows = connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            progress(describe(number, migration, False, rows))
            if dry_run:
                for statement in migration.statements_for(False):
                    progress(f"  {statement}")
            else:
                _apply(connection, number, migration, progress)
        return version if dry_run else version + len(steps)

    def close(self) -> None:
        self.reader.close()
        self.pool.close()

    # Keys

    @staticmethod
    def _keys(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
        cursor.execute("SELECT * FROM api_keys ORDER BY id")
        names = [d[0] for d in cursor.description]
        return [key_row(names, values) for values in cursor.fetchall()]

    def keys(self) -> Deferred[list[dict[str, Any]]]:
        return self.reader.runInteraction(self._keys)  # type: ignore[no-any-return]

    def add_key(self, row: dict[str, Any]) -> Deferred[int]:
        """
        @param row: name, prefix, hash, models (list or None), rpm, tpm,
            budget_tokens, admin, created.
        @return: fires with the new key's id; fails with
            L{sqlite3.IntegrityError} for a name already used.
        """
        # Shared with PostgresStore: its docstring is Store.add_key's.

        def add(cursor: sqlite3.Cursor) -> int:
            cursor.execute(
                "INSERT INTO api_keys (name, prefix, hash, models, rpm, tpm,"
                " budget_tokens, admin, created, expires, priority, weight)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row["name"],
                    row["prefix"],
                    row["hash"],
                    json.dumps(row["models"]) if row["models"] is not None else None,
                    row["rpm"],
                    row["tpm"],
                    row["budget_tokens"],
                    int(row["admin"]),
                    row["created"],
                    row.get("expires"),
                    str(row.get("priority") or "standard"),
                    float(row.get("weight") or 1.0),
                ),
            )
            return int(cursor.lastrowid or 0)

        return self.pool.runInteraction(add)  # type: ignore[no-any-return]

    def revoke_key(self, key_id: int, when: float) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "UPDATE api_keys SET revoked = ? WHERE id = ?", (when, key_id)
        )

    def update_key(self, key_id: int, changes: dict[str, Any]) -> Deferred[None]:
        clause, values = key_update(changes, "?")
        return self.pool.runOperation(  # type: ignore[no-any-return]
            f"UPDATE api_keys SET {clause} WHERE id = ?", (*values, key_id)
        )

    # Usage

    def add_usage(
        self,
        rows: Sequence[tuple[float, UsageRow]],
        key_use: dict[int, tuple[int, float]],
    ) -> Deferred[None]:
        def add(cursor: sqlite3.Cursor) -> None:
            ids = [r.request_id for _, r in rows]
            seen: set[str] = set()
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor.execute(
                    "SELECT request_id FROM usage WHERE request_id IN"
                    f" ({','.join('?' * len(chunk))})",
                    chunk,
                )
                seen.update(r[0] for r in cursor.fetchall())
            use = dict(key_use)
            for _, r in rows:
                if r.request_id in seen and r.key_id in use:
                    tokens, last = use[r.key_id]
                    use[r.key_id] = (
                        max(0, tokens - r.prompt_tokens - r.completion_tokens),
                        last,
                    )
                # A second row of one request in this write (a batch line
                # run again) is not inserted: its tokens are not counted.
                seen.add(r.request_id)
            cursor.executemany(
                f"INSERT INTO usage ({USAGE_COLUMNS})"
                f" VALUES {usage_marks('?')}"
                " ON CONFLICT (request_id) DO NOTHING",
                [usage_values(when, r) for when, r in rows],
            )
            cursor.executemany(
                "UPDATE api_keys SET tokens_used = tokens_used + ?,"
                " last_used = MAX(COALESCE(last_used, 0), ?) WHERE id = ?",
                [(tokens, last, key_id) for key_id, (tokens, last) in use.items()],
            )

        return self.pool.runInteraction(add)  # type: ignore[no-any-return]

    def usage(
        self, by: str, since: float, until: float
    ) -> Deferred[list[dict[str, Any]]]:
        """
        @param by: C{"key"} or C{"model"}.
        @param since: POSIX seconds, inclusive.
        @param until: POSIX seconds, exclusive.
        @return: one dict per group: the group's name, requests, errors
            (status >= 400), prompt and completion tokens, mean latency
            and mean time to first token (seconds), and how many requests'
            counts the router estimated; read from what is committed, on
            the reading connection (not behind a write in progress).  Fails
            with L{sqlite3.OperationalError} when the file stays locked
            past L{READ_BUSY_TIMEOUT_MS}.
        """
        query = usage_query(by, "?")

        def shape(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
            return shape_usage(by, rows)

        d = self.reader.runQuery(query, (since, until, since, until))
        return d.addCallback(shape)  # type: ignore[no-any-return]

    def roll_usage(self, before: float) -> Deferred[int]:
        return Deferred.fromCoroutine(self._roll(before))

    async def _roll(self, before: float) -> int:
        rolled = 0
        # One day per transaction on the writing connection: usage writes
        # queue behind one day's roll, not behind the whole of it.
        day = await self.pool.runInteraction(_next_day, 0.0, before)
        while day is not None:
            rolled += await self.pool.runInteraction(_roll_day, day)
            day = await self.pool.runInteraction(_next_day, day + DAY, before)
        return rolled

    # Runtime models

    def models(self) -> Deferred[list[tuple[str, str]]]:
        """
        @return: C{(name, spec JSON)} of the models added at run time.
        """
        return self.pool.runQuery(  # type: ignore[no-any-return]
            "SELECT name, spec FROM models ORDER BY added"
        )

    def put_model(self, name: str, spec: str, when: float) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "INSERT INTO models (name, spec, added) VALUES (?,?,?)"
            " ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
            (name, spec, when),
        )

    def delete_model(self, name: str) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "DELETE FROM models WHERE name = ?", (name,)
        )

    # Drained nodes

    def drains(self) -> Deferred[dict[str, float]]:
        d = self.reader.runQuery("SELECT node_id, since FROM node_drains")
        return d.addCallback(dict)  # type: ignore[no-any-return]

    def set_drain(self, node_id: str, since: float) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "INSERT INTO node_drains (node_id, since) VALUES (?,?)"
            " ON CONFLICT (node_id) DO NOTHING",
            (node_id, since),
        )

    def clear_drain(self, node_id: str) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "DELETE FROM node_drains WHERE node_id = ?", (node_id,)
        )

    # Stored responses (llmgw.store.responses)

    def put_response(self, row: StoredResponse) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            put_response_sql("?"), response_values(row)
        )

    def get_response(
        self, response_id: str, key_id: int | None
    ) -> Deferred[StoredResponse | None]:
        where, params = owned(response_id, key_id, "?")

        def shape(rows: list[tuple[Any, ...]]) -> StoredResponse | None:
            return response_row(rows[0]) if rows else None

        d = self.reader.runQuery(
            f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE {where}", params
        )
        return d.addCallback(shape)  # type: ignore[no-any-return]

    def delete_response(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        where, params = owned(response_id, key_id, "?")

        def delete(cursor: sqlite3.Cursor) -> bool:
            cursor.execute(f"DELETE FROM responses WHERE {where}", params)
            return cursor.rowcount > 0

        return self.pool.runInteraction(delete)  # type: ignore[no-any-return]

    def drop_responses(self, before: float) -> Deferred[int]:
        def drop(cursor: sqlite3.Cursor) -> int:
            cursor.execute("DELETE FROM responses WHERE created_at < ?", (before,))
            return int(cursor.rowcount)

        return self.pool.runInteraction(drop)  # type: ignore[no-any-return]


def _version(connection: sqlite3.Connection) -> int:
    return int(connection.execute("PRAGMA user_version").fetchone()[0])


_SLOW_NOTE = 10.0
"""
Seconds between the "still running" lines of one long statement.
"""


def _apply(
    connection: sqlite3.Connection,
    number: int,
    migration: Migration,
    progress: Progress,
) -> None:
    """
    Run one migration and the bump of C{user_version} in one transaction
    (SQLite's DDL is transactional): interrupted, nothing of it stays.
    """
    began = time.monotonic()
    connection.execute("BEGIN IMMEDIATE")
    try:
        if _version(connection) >= number:
            # Another process ran it meanwhile.
            connection.execute("ROLLBACK")
            return
        for statement in migration.statements_for(False):
            _timed(connection, statement, progress)
        connection.execute(f"PRAGMA user_version = {number}")
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise
    if progress is not quiet:
        progress(f"migration {number}: done in {time.monotonic() - began:.1f}s")


def _timed(connection: sqlite3.Connection, statement: str, progress: Progress) -> None:
    began = time.monotonic()
    last = [began]
    if progress is not quiet:

        def note() -> int:
            now = time.monotonic()
            if now - last[0] >= _SLOW_NOTE:
                last[0] = now
                progress(f"  ... {now - began:.0f}s")
            return 0

        connection.set_progress_handler(note, 1_000_000)
    try:
        connection.execute(statement)
    finally:
        connection.set_progress_handler(None, 0)
    if progress is not quiet:
        progress(f"  {statement[:72]}: {time.monotonic() - began:.1f}s")


def _next_day(cursor: sqlite3.Cursor, since: float, before: float) -> float | None:
    """
    @return: the start of the day of the oldest row in C{[since,
        before)}, or L{None} when there is none.
    """
    (first,) = cursor.execute(
        "SELECT MIN(time) FROM usage WHERE time >= ? AND time < ?", (since, before)
    ).fetchone()
    return None if first is None else (first // DAY) * DAY


_DAY_SQL = "CAST(time / 86400 AS INTEGER) * 86400.0"


def _roll_day(cursor: sqlite3.Cursor, day: float) -> int:
    """
    Add one day's rows to its totals and delete them, in this transaction.

    @return: the rows rolled.
    """
    where = "time >= ? AND time < ?"
    bounds = (day, day + DAY)
    cursor.execute(
        f"INSERT INTO usage_daily ({ROLLUP_COLUMNS})"
        f" {rollup_select(_DAY_SQL, 'usage', where)}{ROLLUP_UPSERT}",
        bounds,
    )
    cursor.execute(f"DELETE FROM usage WHERE {where}", bounds)
    return int(cursor.rowcount)
