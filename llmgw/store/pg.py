"""
The store on PostgreSQL, through psycopg 3 and its connection pool
(U{https://www.psycopg.org/psycopg3/docs/advanced/pool.html}): the same
tables, migrations and behaviour as the SQLite store, for several
processes (servers, routers) on one database.  Queries run on a Twisted
thread pool as large as the connection pool, off the reactor thread.

Key changes are announced on the channel L{CHANNEL} by C{NOTIFY}, in the
transaction that makes them (PostgreSQL delivers a notification only when
its transaction commits:
U{https://www.postgresql.org/docs/15/sql-notify.html}); L{KeyEvents}
listens on a connection of its own and hands them to the reactor thread.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from llmgw.store import pg_schema
from llmgw.store.base import (
    DAY,
    USAGE_COLUMNS,
    MigrationPending,
    Progress,
    Store,
    StoreError,
    UsageRow,
    key_row,
    key_update,
    shape_usage,
    usage_marks,
    usage_query,
    usage_values,
)
from llmgw.store.migrations import quiet
from llmgw.store.responses import (
    RESPONSE_COLUMNS,
    StoredResponse,
    owned,
    put_response_sql,
    response_row,
    response_values,
)

T = TypeVar("T")

CHANNEL = "llmgw_keys"
"""
The C{NOTIFY} channel of key changes.  Payloads are JSON:
C{{"added": ID}}, C{{"revoked": ID, "when": POSIX SECONDS}} and
C{{"updated": ID}} (its models, limits or expiry changed).
"""


def redact(url: str) -> str:
    """
    @return: C{url} without its password, for logs and messages.
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def quiet_pool_warnings() -> None:
    """
    Keep psycopg_pool's warnings out of the log: it warns (stdlib
    C{logging}, which twistd shows as C{stderr} errors, two lines each) at
    every failed reconnection attempt and every connection it discards,
    several a second while PostgreSQL is away.  The store's users say so
    once per outage, with the database's own reason (the usage writer's
    "cannot write to the store", L{KeyEvents}' "key changes: ..."), and
    once when it is back; the pool's errors still show.
    """
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)


class PostgresStore(Store):
    """
    The database on a PostgreSQL server.

    @param url: C{postgresql://user[:password]@host[:port]/database}
        (libpq's URI: U{https://www.postgresql.org/docs/15/libpq-connect.html}).
    @param reactor: where results are delivered; the global one by
        default.
    @param max_connections: connections (and threads) at most.
    """

    database_errors = (psycopg.Error, PoolTimeout)
    integrity_errors = (psycopg.errors.UniqueViolation,)

    def __init__(
        self,
        url: str,
        reactor: IReactorFromThreads | None = None,
        max_connections: int = 4,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as global_reactor

            reactor = global_reactor  # type: ignore[assignment]
        assert reactor is not None
        self.url = url
        self.path = redact(url)
        self._reactor = reactor
        self._threads = ThreadPool(0, max_connections, "llmgw-store")
        quiet_pool_warnings()
        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            open=False,
            timeout=10.0,
            name="llmgw-store",
        )
        self._open = False
        super().__init__(self._run, self._run, "%s", " FOR UPDATE SKIP LOCKED")

    def _start(self) -> None:
        if self._open:
            return
        try:
            # One connection first: its error says why (the pool's says
            # only that it timed out).
            psycopg.connect(self.url, connect_timeout=10).close()
            self.pool.open(wait=True, timeout=10.0)
        except (psycopg.Error, PoolTimeout) as e:
            self.pool.close()
            raise StoreError(
                f"store: cannot connect to {self.path}: {_one_line(e)}"
            ) from None
        self._threads.start()
        self._open = True

    def _run(self, work: Callable[[psycopg.Cursor[Any]], T]) -> Deferred[T]:
        """
        C{work(cursor)} in one transaction on a pooled connection, on a
        thread: committed when it returns, rolled back when it raises.
        """

        def transaction() -> T:
            with self.pool.connection() as connection:
                with connection.cursor() as cursor:
                    return work(cursor)

        return deferToThreadPool(self._reactor, self._threads, transaction)

    def prepare(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        self._start()
        try:
            self._migrate(quiet, dry_run=False, at_start=True)
            with self.pool.connection() as connection:
                with connection.cursor() as cursor:
                    keys = self._keys(cursor)
                    cursor.execute("SELECT name, spec FROM models ORDER BY added")
                    models = [(name, spec) for name, spec in cursor.fetchall()]
                    cursor.execute("SELECT node_id, since FROM node_drains")
                    self.drained = dict(cursor.fetchall())
            return keys, models
        except MigrationPending:
            raise
        except (psycopg.Error, PoolTimeout, StoreError) as e:
            raise StoreError(f"store: {self.path}: {_one_line(e)}") from None

    def migrate(self, progress: Progress, dry_run: bool = False) -> int:
        try:
            return self._migrate(progress, dry_run, at_start=False)
        except psycopg.Error as e:
            raise StoreError(f"store: {self.path}: {_one_line(e)}") from None

    def _migrate(self, progress: Progress, dry_run: bool, at_start: bool) -> int:
        # A connection of its own, in autocommit: each migration runs its
        # own transactions, and CREATE INDEX CONCURRENTLY none.
        try:
            connection = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.Error as e:
            raise StoreError(
                f"store: cannot connect to {self.path}: {_one_line(e)}"
            ) from None
        with connection:
            return pg_schema.migrate(connection, self.path, progress, dry_run, at_start)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._threads.stop()
        self.pool.close()

    # Keys

    @staticmethod
    def _keys(cursor: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
        cursor.execute("SELECT * FROM api_keys ORDER BY id")
        assert cursor.description is not None
        names = [d.name for d in cursor.description]
        return [key_row(names, values) for values in cursor.fetchall()]

    def keys(self) -> Deferred[list[dict[str, Any]]]:
        """
        @return: every key, as L{prepare} gives them (for a process that
            missed notifications while its listener was disconnected).
        """
        return self._run(self._keys)

    def key(self, key_id: int) -> Deferred[dict[str, Any] | None]:
        """
        @return: one key as L{prepare} gives them, or L{None}.
        """

        def read(cursor: psycopg.Cursor[Any]) -> dict[str, Any] | None:
            cursor.execute("SELECT * FROM api_keys WHERE id = %s", (key_id,))
            values = cursor.fetchone()
            if values is None:
                return None
            assert cursor.description is not None
            return key_row([d.name for d in cursor.description], values)

        return self._run(read)

    def add_key(self, row: dict[str, Any]) -> Deferred[int]:
        def add(cursor: psycopg.Cursor[Any]) -> int:
            cursor.execute(
                "INSERT INTO api_keys (name, prefix, hash, models, rpm, tpm,"
                " budget_tokens, admin, created, expires, priority, weight)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) RETURNING id",
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
            got = cursor.fetchone()
            assert got is not None
            key_id = int(got[0])
            _notify(cursor, {"added": key_id})
            return key_id

        return self._run(add)

    def revoke_key(self, key_id: int, when: float) -> Deferred[None]:
        def revoke(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute(
                "UPDATE api_keys SET revoked = %s WHERE id = %s", (when, key_id)
            )
            _notify(cursor, {"revoked": key_id, "when": when})

        return self._run(revoke)

    def update_key(self, key_id: int, changes: dict[str, Any]) -> Deferred[None]:
        clause, values = key_update(changes, "%s")

        def update(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute(
                f"UPDATE api_keys SET {clause} WHERE id = %s",
                (*values, key_id),
            )
            _notify(cursor, {"updated": key_id})

        return self._run(update)

    # Usage

    def add_usage(
        self,
        rows: Sequence[tuple[float, UsageRow]],
        key_use: dict[int, tuple[int, float]],
    ) -> Deferred[None]:
        def add(cursor: psycopg.Cursor[Any]) -> None:
            use = dict(key_use)
            if rows:
                cursor.execute(
                    "SELECT request_id FROM usage WHERE request_id = ANY(%s)",
                    ([r.request_id for _, r in rows],),
                )
                seen = {r[0] for r in cursor.fetchall()}
                fresh = []
                for when, r in rows:
                    if r.request_id not in seen:
                        seen.add(r.request_id)
                        fresh.append(usage_values(when, r))
                    elif r.key_id in use:
                        tokens, last = use[r.key_id]
                        use[r.key_id] = (
                            max(0, tokens - r.prompt_tokens - r.completion_tokens),
                            last,
                        )
                # The unique index is on (request_id, time) (the table is
                # partitioned by time, llmgw.store.pg_schema): the ids seen
                # are skipped above; this covers another writer's commit
                # of the same batch meanwhile.
                cursor.executemany(
                    f"INSERT INTO usage ({USAGE_COLUMNS})"
                    f" VALUES {usage_marks('%s')}"
                    " ON CONFLICT DO NOTHING",
                    fresh,
                )
            if use:
                cursor.executemany(
                    "UPDATE api_keys SET tokens_used = tokens_used + %s,"
                    " last_used = GREATEST(COALESCE(last_used, 0), %s)"
                    " WHERE id = %s",
                    [(tokens, last, key_id) for key_id, (tokens, last) in use.items()],
                )

        return self._run(add)

    def usage(
        self, by: str, since: float, until: float
    ) -> Deferred[list[dict[str, Any]]]:
        query = usage_query(by, "%s")

        def read(cursor: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
            cursor.execute(query.encode(), (since, until, since, until))
            return shape_usage(by, cursor.fetchall())

        return self._run(read)

    def roll_usage(self, before: float) -> Deferred[int]:
        return Deferred.fromCoroutine(self._roll(before))

    async def _roll(self, before: float) -> int:
        await self._run(partial(pg_schema.ensure_partitions, now=time.time()))
        rolled = 0
        # Whole months first, a partition dropped each; then the rest of
        # the rows past retention (the month it ends in, the default
        # partition) a day per transaction.
        old = await self._run(partial(pg_schema.old_partitions, before=before))
        for name in old:
            rolled += await self._run(partial(pg_schema.roll_partition, name=name))
        day = await self._run(partial(pg_schema.next_day, since=0.0, before=before))
        while day is not None:
            rolled += await self._run(partial(pg_schema.roll_day, day=day))
            day = await self._run(
                partial(pg_schema.next_day, since=day + DAY, before=before)
            )
        return rolled

    # Runtime models

    def models(self) -> Deferred[list[tuple[str, str]]]:
        def read(cursor: psycopg.Cursor[Any]) -> list[tuple[str, str]]:
            cursor.execute("SELECT name, spec FROM models ORDER BY added")
            return [(name, spec) for name, spec in cursor.fetchall()]

        return self._run(read)

    def put_model(self, name: str, spec: str, when: float) -> Deferred[None]:
        def put(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute(
                "INSERT INTO models (name, spec, added) VALUES (%s,%s,%s)"
                " ON CONFLICT (name) DO UPDATE SET spec = excluded.spec",
                (name, spec, when),
            )

        return self._run(put)

    def delete_model(self, name: str) -> Deferred[None]:
        def delete(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute("DELETE FROM models WHERE name = %s", (name,))

        return self._run(delete)

    # Drained nodes

    def drains(self) -> Deferred[dict[str, float]]:
        def read(cursor: psycopg.Cursor[Any]) -> dict[str, float]:
            cursor.execute("SELECT node_id, since FROM node_drains")
            return dict(cursor.fetchall())

        return self._run(read)

    def set_drain(self, node_id: str, since: float) -> Deferred[None]:
        def put(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute(
                "INSERT INTO node_drains (node_id, since) VALUES (%s,%s)"
                " ON CONFLICT (node_id) DO NOTHING",
                (node_id, since),
            )

        return self._run(put)

    def clear_drain(self, node_id: str) -> Deferred[None]:
        def delete(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute("DELETE FROM node_drains WHERE node_id = %s", (node_id,))

        return self._run(delete)

    # Stored responses (llmgw.store.responses)

    def put_response(self, row: StoredResponse) -> Deferred[None]:
        def put(cursor: psycopg.Cursor[Any]) -> None:
            cursor.execute(put_response_sql("%s").encode(), response_values(row))

        return self._run(put)

    def get_response(
        self, response_id: str, key_id: int | None
    ) -> Deferred[StoredResponse | None]:
        where, params = owned(response_id, key_id, "%s")

        def read(cursor: psycopg.Cursor[Any]) -> StoredResponse | None:
            cursor.execute(
                f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE {where}".encode(),
                params,
            )
            values = cursor.fetchone()
            return None if values is None else response_row(values)

        return self._run(read)

    def delete_response(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        where, params = owned(response_id, key_id, "%s")

        def delete(cursor: psycopg.Cursor[Any]) -> bool:
            cursor.execute(f"DELETE FROM responses WHERE {where}".encode(), params)
            return cursor.rowcount > 0

        return self._run(delete)

    def drop_responses(self, before: float) -> Deferred[int]:
        def drop(cursor: psycopg.Cursor[Any]) -> int:
            cursor.execute("DELETE FROM responses WHERE created_at < %s", (before,))
            return int(cursor.rowcount)

        return self._run(drop)


def _notify(cursor: psycopg.Cursor[Any], payload: dict[str, Any]) -> None:
    # pg_notify rather than NOTIFY: a channel and payload as parameters.
    cursor.execute("SELECT pg_notify(%s, %s)", (CHANNEL, json.dumps(payload)))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class KeyEvents(Service):
    """
    Key changes made by any process on the database, as they commit:
    C{LISTEN} on a connection of its own, on a thread of its own (it
    waits on the socket), each notification handed to C{on_event} on the
    reactor thread.  A lost connection is retried (every 0.5 s, doubling
    to 5 s); each time it listens again C{on_listening} is called, so the
    caller can read what it missed.

    @param url: the database's URL.
    @param reactor: where the callbacks run.
    @param on_event: called with each payload (see L{CHANNEL}).
    @param on_listening: called once listening (again).
    @ivar listening: whether the connection listens now.
    """

    log = Logger()
    POLL = 0.25
    """
    Seconds the listening thread waits for a notification before looking
    whether it should stop: the bound on L{stopService}'s wait.
    """

    def __init__(
        self,
        url: str,
        reactor: IReactorFromThreads,
        on_event: Callable[[dict[str, Any]], None],
        on_listening: Callable[[], None] = lambda: None,
    ) -> None:
        self._url = url
        self._reactor = reactor
        self._on_event = on_event
        self._on_listening = on_listening
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._done: Deferred[None] | None = None
        self.listening = False

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._stopping.clear()
        self._done = Deferred()
        self._thread = threading.Thread(
            target=self._listen, name="llmgw-key-events", daemon=True
        )
        self._thread.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        self._stopping.set()
        assert self._done is not None
        return self._done

    def _listen(self) -> None:
        delay = 0.5
        call = self._reactor.callFromThread
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._url, autocommit=True, connect_timeout=5
                ) as connection:
                    connection.execute(f"LISTEN {CHANNEL}".encode())
                    call(self._listened)
                    delay = 0.5
                    while not self._stopping.is_set():
                        for note in connection.notifies(timeout=self.POLL):
                            call(self._deliver, note.payload)
            except psycopg.Error as e:
                call(self._lost, _one_line(e), delay)
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)
        call(self._finished)

    def _listened(self) -> None:
        self.listening = True
        self.log.info("store: listening for key changes on {channel}", channel=CHANNEL)
        try:
            self._on_listening()
        except Exception:
            self.log.failure("store: key changes: on_listening failed")

    def _lost(self, error: str, delay: float) -> None:
        if self.listening or delay == 0.5:
            self.log.warn(
                "store: key changes: {error}; listening again in {delay}s",
                error=error,
                delay=delay,
            )
        self.listening = False

    def _deliver(self, payload: str) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            self.log.warn("store: key changes: not JSON: {payload!r}", payload=payload)
            return
        try:
            self._on_event(event)
        except Exception:
            self.log.failure("store: key change {event} not applied", event=event)

    def _finished(self) -> None:
        self.listening = False
        if self._done is not None and not self._done.called:
            self._done.callback(None)


__all__ = ["CHANNEL", "KeyEvents", "PostgresStore", "redact"]
