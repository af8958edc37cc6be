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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred


class StoreError(Exception):
    """
    The database cannot be used: not a SQLite URL, a folder or file that
    cannot be made or opened, not a database, or a schema newer than this
    code.  C{str(error)} is one line naming the path or URL.
    """


@dataclass(frozen=True)
class UsageRow:
    """
    One request's row of the C{usage} table.

    @ivar key_id: the API key's id, L{None} without a key.
    @ivar replica: the replica that answered, L{None} when none did.
    @ivar status: the HTTP status the client got.
    @ivar latency: seconds from receipt to the last byte.
    @ivar time_to_first_token: seconds from receipt to the first byte of
        the replica's answer; L{None} when none came.
    @ivar estimated: the token counts are an estimate (the engine's never
        came).
    """

    request_id: str
    key_id: int | None
    key_name: str | None
    model: str
    replica: str | None
    status: int
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    latency: float
    time_to_first_token: float | None
    estimated: bool = False


# Each migration runs once, in order, in one transaction with the bump of
# user_version; a database newer than this code is refused.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE api_keys (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        models TEXT,
        rpm INTEGER,
        tpm INTEGER,
        budget_tokens INTEGER,
        admin INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        last_used REAL,
        tokens_used INTEGER NOT NULL DEFAULT 0,
        revoked REAL
    );
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY,
        time REAL NOT NULL,
        request_id TEXT NOT NULL,
        key_id INTEGER,
        key_name TEXT,
        model TEXT NOT NULL,
        replica TEXT,
        status INTEGER NOT NULL,
        stream INTEGER NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        latency REAL NOT NULL,
        time_to_first_token REAL
    );
    CREATE INDEX usage_time ON usage (time);
    CREATE TABLE models (
        name TEXT PRIMARY KEY,
        spec TEXT NOT NULL,
        added REAL NOT NULL
    );
    """,
    # 2: token counts the router estimated (the engine's never came).
    """
    ALTER TABLE usage ADD COLUMN estimated INTEGER NOT NULL DEFAULT 0;
    """,
)


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
            f"store.url: {url!r}: expected sqlite:///absolute/path.db or"
            " sqlite:relative/path.db (only SQLite in this version)"
        )
    return os.path.expanduser(parts.path)


READ_BUSY_TIMEOUT_MS = 1000
"""
How long a read waits for a lock, milliseconds, before failing with
L{sqlite3.OperationalError}.  A WAL reader needs none in the common case;
this bounds the rare ones (another process recovering the WAL index).
"""


class Store:
    """
    The database.  Every method returns a Deferred fired from the pool's
    thread's result, on the reactor thread.

    @param path: the SQLite file, made (with its folder) if missing.
    @raise StoreError: the folder cannot be made.
    """

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

    def prepare(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """
        At start, before the reactor runs: migrate, then read the keys and
        the runtime models, on this thread.

        @return: every key, revoked ones included, as dicts of the
            C{api_keys} columns (C{models} decoded: a list or L{None});
            and the runtime models, as L{models} gives them.
        @raise StoreError: the database cannot be opened or migrated (not
            a database, or newer than this code).
        """
        try:
            connection = sqlite3.connect(self.path, isolation_level="DEFERRED")
        except sqlite3.Error as e:
            raise StoreError(f"store: cannot open {self.path!r}: {e}") from None
        try:
            self._opened(connection)
            cursor = connection.cursor()
            self._migrate(cursor)
            connection.commit()
            keys = self._keys(cursor)
            models = cursor.execute(
                "SELECT name, spec FROM models ORDER BY added"
            ).fetchall()
            return keys, [(name, spec) for name, spec in models]
        except (sqlite3.Error, RuntimeError) as e:
            raise StoreError(f"store: {self.path!r}: {e}") from None
        finally:
            connection.close()

    @staticmethod
    def _migrate(cursor: sqlite3.Cursor) -> int:
        version = int(cursor.execute("PRAGMA user_version").fetchone()[0])
        if version > len(MIGRATIONS):
            raise RuntimeError(
                f"the database is at schema version {version}; this llmgw knows"
                f" up to {len(MIGRATIONS)}"
            )
        for number in range(version, len(MIGRATIONS)):
            for statement in MIGRATIONS[number].split(";"):
                if statement.strip():
                    cursor.execute(statement)
            cursor.execute(f"PRAGMA user_version = {number + 1}")
        return len(MIGRATIONS)

    def close(self) -> None:
        self.reader.close()
        self.pool.close()

    # Keys

    @staticmethod
    def _keys(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
        cursor.execute("SELECT * FROM api_keys ORDER BY id")
        names = [d[0] for d in cursor.description]
        rows = []
        for values in cursor.fetchall():
            row = dict(zip(names, values, strict=True))
            row["models"] = json.loads(row["models"]) if row["models"] else None
            row["admin"] = bool(row["admin"])
            rows.append(row)
        return rows

    def add_key(self, row: dict[str, Any]) -> Deferred[int]:
        """
        @param row: name, prefix, hash, models (list or None), rpm, tpm,
            budget_tokens, admin, created.
        @return: fires with the new key's id; fails with
            L{sqlite3.IntegrityError} for a name already used.
        """

        def add(cursor: sqlite3.Cursor) -> int:
            cursor.execute(
                "INSERT INTO api_keys (name, prefix, hash, models, rpm, tpm,"
                " budget_tokens, admin, created) VALUES (?,?,?,?,?,?,?,?,?)",
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
                ),
            )
            return int(cursor.lastrowid or 0)

        return self.pool.runInteraction(add)  # type: ignore[no-any-return]

    def revoke_key(self, key_id: int, when: float) -> Deferred[None]:
        return self.pool.runOperation(  # type: ignore[no-any-return]
            "UPDATE api_keys SET revoked = ? WHERE id = ?", (when, key_id)
        )

    # Usage

    def add_usage(
        self,
        rows: Sequence[tuple[float, UsageRow]],
        key_use: dict[int, tuple[int, float]],
    ) -> Deferred[None]:
        """
        Write usage records and add to the keys' token counts, in one
        transaction.

        @param rows: C{(POSIX seconds, row)} per request.
        @param key_use: per key id, C{(tokens, last used)}.
        """

        def add(cursor: sqlite3.Cursor) -> None:
            cursor.executemany(
                "INSERT INTO usage (time, request_id, key_id, key_name, model,"
                " replica, status, stream, prompt_tokens, completion_tokens,"
                " latency, time_to_first_token, estimated)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        when,
                        r.request_id,
                        r.key_id,
                        r.key_name,
                        r.model,
                        r.replica,
                        r.status,
                        int(r.stream),
                        r.prompt_tokens,
                        r.completion_tokens,
                        r.latency,
                        r.time_to_first_token,
                        int(r.estimated),
                    )
                    for when, r in rows
                ],
            )
            cursor.executemany(
                "UPDATE api_keys SET tokens_used = tokens_used + ?,"
                " last_used = MAX(COALESCE(last_used, 0), ?) WHERE id = ?",
                [(tokens, last, key_id) for key_id, (tokens, last) in key_use.items()],
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
        column = {"key": "COALESCE(key_name, '')", "model": "model"}[by]
        query = (
            f"SELECT {column} AS name, COUNT(*), SUM(status >= 400),"
            " SUM(prompt_tokens), SUM(completion_tokens), AVG(latency),"
            " AVG(time_to_first_token), SUM(estimated)"
            " FROM usage WHERE time >= ? AND time < ?"
            f" GROUP BY {column} ORDER BY {column}"
        )

        def shape(rows: Iterable[tuple[Any, ...]]) -> list[dict[str, Any]]:
            return [
                {
                    by: name if name != "" else None,
                    "requests": count,
                    "errors": errors or 0,
                    "prompt_tokens": prompt or 0,
                    "completion_tokens": completion or 0,
                    "mean_latency": latency,
                    "mean_time_to_first_token": ttft,
                    "estimated_requests": estimated or 0,
                }
                for (
                    name,
                    count,
                    errors,
                    prompt,
                    completion,
                    latency,
                    ttft,
                    estimated,
                ) in rows
            ]

        d = self.reader.runQuery(query, (since, until))
        return d.addCallback(shape)  # type: ignore[no-any-return]

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
