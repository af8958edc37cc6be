"""
PostgreSQL's schema: the migrations applied (L{llmgw.store.migrations}),
indexes on tables in use built C{CONCURRENTLY}, the usage table
partitioned by month and the partitions made ahead, and retention (rows
past C{[store] usage_retention} rolled into C{usage_daily}: a month wholly
past it by dropping its partition, the rest one day at a time).

The usage table is partitioned by range of C{time} (POSIX seconds), one
partition per UTC month named C{usage_pYYYYMM}, and a C{usage_default}
for rows outside them (U{https://www.postgresql.org/docs/15/ddl-partitioning.html}).
A unique index on a partitioned table must hold the partition key, so
the one per request id is on C{(request_id, time)}: a batch retried keeps
its rows' times, and L{llmgw.store.pg.PostgresStore.add_usage} skips the
request ids already there.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

import psycopg

from llmgw.store.base import DAY, ROLLUP_COLUMNS, ROLLUP_UPSERT, rollup_select
from llmgw.store.migrations import (
    Migration,
    MigrationPending,
    Progress,
    describe,
    pending,
    quiet,
    refusal,
)

# Any constant both sides agree on: migrations of two processes starting at
# once run one after the other.
MIGRATION_LOCK = 0x6C6C6D67  # "llmg"

MONTHS_AHEAD = 2
"""
Partitions made ahead of the current month (at start, on every retention
pass): a row is never written to the default one in practice.
"""

COPY_BATCH = 1_000_000
"""
Ids copied per transaction while partitioning the usage table.
"""


def _version(connection: psycopg.Connection[Any], create: bool) -> int:
    exists = connection.execute("SELECT to_regclass('llmgw_schema')").fetchone()
    if exists is None or exists[0] is None:
        if not create:
            return 0
        connection.execute("CREATE TABLE llmgw_schema (version BIGINT NOT NULL)")
    row = connection.execute("SELECT version FROM llmgw_schema").fetchone()
    if row is None:
        if create:
            connection.execute("INSERT INTO llmgw_schema (version) VALUES (0)")
        return 0
    return int(row[0])


def migrate(
    connection: psycopg.Connection[Any],
    path: str,
    progress: Progress,
    dry_run: bool,
    at_start: bool,
) -> int:
    """
    Apply the pending migrations under the migration lock (another
    process migrating: this waits).

    @param connection: in autocommit mode, of this call's own.
    @param path: the database for people, in the refusal.
    @param at_start: refuse (L{MigrationPending}) rather than rewrite a
        table that has rows.
    @return: the schema version after (with C{dry_run}, before).
    """
    connection.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    try:
        with connection.transaction():
            version = _version(connection, create=not dry_run)
        steps = pending(version)
        for number, migration in steps:
            table = migration.rewritten(True)
            if at_start and table is not None and version > 0:
                if _rows(connection, table, exact=False):
                    raise MigrationPending(refusal(path, number, migration, table))
        for number, migration in steps:
            table = migration.rewritten(True)
            rows = 0
            if not at_start and table is not None and version > 0:
                rows = _rows(connection, table, exact=True)
            progress(describe(number, migration, True, rows))
            if dry_run:
                for statement in _planned(migration):
                    progress(f"  {statement}")
            else:
                _apply(connection, number, migration, progress)
        if dry_run:
            return version
        if _partitioned(connection):
            with connection.transaction():
                ensure_partitions(connection, time.time())
        return version + len(steps)
    finally:
        connection.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


def _rows(connection: psycopg.Connection[Any], table: str, exact: bool) -> int:
    if not exact:
        row = connection.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()
        return int(bool(row and row[0]))
    row = connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def _planned(migration: Migration) -> list[str]:
    planned = migration.statements_for(True)
    planned += [_concurrently(s) for s in migration.concurrent]
    if migration.procedure == "partition_usage":
        planned.append(
            "(copy usage into usage_new, partitioned by month, in batches of"
            f" {COPY_BATCH:,} ids; then swap them under an EXCLUSIVE lock)"
        )
    return planned


def _bump(connection: psycopg.Connection[Any], number: int) -> None:
    connection.execute("UPDATE llmgw_schema SET version = %s", (number,))


def _apply(
    connection: psycopg.Connection[Any],
    number: int,
    migration: Migration,
    progress: Progress,
) -> None:
    """
    One migration: its statements and (when it has nothing else to do)
    the version's bump in one transaction; then its concurrent indexes
    and its procedure, each able to run again; then the bump.
    """
    began = time.monotonic()
    later = bool(migration.concurrent or migration.procedure)
    with connection.transaction():
        if _version(connection, create=True) >= number:
            return
        for statement in migration.statements_for(True):
            _timed(connection, statement, progress)
        if not later:
            _bump(connection, number)
    for statement in migration.concurrent:
        _build_concurrently(connection, statement, progress)
    if migration.procedure == "partition_usage":
        partition_usage(connection, progress)
    if later:
        with connection.transaction():
            _bump(connection, number)
    if progress is not quiet:
        progress(f"migration {number}: done in {time.monotonic() - began:.1f}s")


def _timed(
    connection: psycopg.Connection[Any], statement: str, progress: Progress
) -> None:
    began = time.monotonic()
    connection.execute(statement.encode())
    if progress is not quiet:
        progress(f"  {statement[:72]}: {time.monotonic() - began:.1f}s")


_INDEX = re.compile(r"^CREATE (UNIQUE )?INDEX (\w+) ON (.+)$")


def _concurrently(statement: str) -> str:
    match = _INDEX.match(statement)
    assert match is not None, statement
    unique, name, rest = match.groups()
    return f"CREATE {unique or ''}INDEX CONCURRENTLY {name} ON {rest}"


def _build_concurrently(
    connection: psycopg.Connection[Any], statement: str, progress: Progress
) -> None:
    """
    Build an index without blocking writes; one left C{INVALID} by an
    interrupted build is dropped and built again; a valid one is kept.
    """
    match = _INDEX.match(statement)
    assert match is not None, statement
    name = match.group(2)
    found = connection.execute(
        "SELECT i.indisvalid FROM pg_class c JOIN pg_index i"
        " ON i.indexrelid = c.oid WHERE c.relname = %s",
        (name,),
    ).fetchone()
    if found is not None and found[0]:
        return
    if found is not None:
        connection.execute(f"DROP INDEX CONCURRENTLY {name}".encode())
    _timed(connection, _concurrently(statement), progress)


def _partitioned(connection: psycopg.Connection[Any]) -> bool:
    row = connection.execute(
        "SELECT relkind FROM pg_class WHERE relname = 'usage'"
        " AND relnamespace = 'public'::regnamespace"
    ).fetchone()
    return row is not None and row[0] == "p"


def month_start(when: float, months: int = 0) -> float:
    """
    @return: the start of the UTC month C{months} after C{when}'s, POSIX
        seconds.
    """
    day = datetime.fromtimestamp(when, UTC)
    index = day.year * 12 + day.month - 1 + months
    return datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC).timestamp()


def partition_name(start: float) -> str:
    """
    @return: the name of the partition of the month starting at C{start}.
    """
    return datetime.fromtimestamp(start, UTC).strftime("usage_p%Y%m")


def _exists(connection: Any, name: str) -> bool:
    row = connection.execute("SELECT to_regclass(%s)", (name,)).fetchone()
    return row is not None and row[0] is not None


def add_month(connection: Any, start: float, parent: str = "usage") -> bool:
    """
    Make the partition of the month from C{start} unless it is there,
    taking its rows out of the default partition first (attaching it
    otherwise fails on them).

    @param connection: a connection or a cursor, in a transaction.
    @return: whether it was made.
    """
    name = partition_name(start)
    if _exists(connection, name):
        return False
    end = month_start(start, 1)
    default = f"{parent}_default"
    connection.execute(f"CREATE TABLE {name} (LIKE {parent} INCLUDING DEFAULTS)")
    connection.execute(
        f"WITH moved AS (DELETE FROM {default} WHERE time >= %s AND time < %s"
        f" RETURNING *) INSERT INTO {name} SELECT * FROM moved",
        (start, end),
    )
    connection.execute(
        f"ALTER TABLE {parent} ATTACH PARTITION {name}"
        f" FOR VALUES FROM ({start!r}) TO ({end!r})"
    )
    return True


def ensure_partitions(connection: Any, now: float) -> None:
    """
    The partitions of this month and L{MONTHS_AHEAD} more, in the
    caller's transaction.
    """
    for months in range(MONTHS_AHEAD + 1):
        add_month(connection, month_start(now, months))


_NEW_USAGE = """
CREATE TABLE usage_new (
    id BIGINT NOT NULL DEFAULT nextval('usage_rows_id_seq'),
    time DOUBLE PRECISION NOT NULL,
    request_id TEXT NOT NULL,
    key_id BIGINT,
    key_name TEXT,
    model TEXT NOT NULL,
    replica TEXT,
    status BIGINT NOT NULL,
    stream BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    latency DOUBLE PRECISION NOT NULL,
    time_to_first_token DOUBLE PRECISION,
    estimated BIGINT NOT NULL DEFAULT 0,
    CONSTRAINT usage_new_pkey PRIMARY KEY (id, time)
) PARTITION BY RANGE (time)
"""

_COLUMNS = (
    "id, time, request_id, key_id, key_name, model, replica, status, stream,"
    " prompt_tokens, completion_tokens, latency, time_to_first_token, estimated"
)


def partition_usage(connection: psycopg.Connection[Any], progress: Progress) -> None:
    """
    Replace the usage table by one partitioned by month: a copy made in
    batches of L{COPY_BATCH} ids, each its own transaction (interrupted,
    it goes on from the last id copied), indexed, then swapped for the
    old table under an C{EXCLUSIVE} lock (reads go on; the rows written
    meanwhile are copied in that transaction).
    """
    if _partitioned(connection):
        return
    with connection.transaction():
        if not _exists(connection, "usage_new"):
            first = connection.execute("SELECT MIN(time) FROM usage").fetchone()
            now = time.time()
            oldest = first[0] if first and first[0] is not None else now
            connection.execute("CREATE SEQUENCE IF NOT EXISTS usage_rows_id_seq")
            connection.execute(_NEW_USAGE)
            connection.execute(
                "CREATE TABLE usage_new_default PARTITION OF usage_new DEFAULT"
            )
            start = month_start(min(oldest, now))
            while start < month_start(now, MONTHS_AHEAD + 1):
                add_month(connection, start, parent="usage_new")
                start = month_start(start, 1)
    last = _max_id(connection, "usage_new")
    top = _max_id(connection, "usage")
    began = time.monotonic()
    while last < top:
        high = min(last + COPY_BATCH, top)
        with connection.transaction():
            _copy(connection, last, high)
        last = high
        progress(
            f"  copied ids up to {last:,} of {top:,} ({time.monotonic() - began:.1f}s)"
        )
    for statement in (
        "CREATE INDEX IF NOT EXISTS usage_new_time ON usage_new (time)",
        "CREATE UNIQUE INDEX IF NOT EXISTS usage_new_request_id"
        " ON usage_new (request_id, time)",
    ):
        _timed(connection, statement, progress)
    with connection.transaction():
        connection.execute("LOCK TABLE usage IN EXCLUSIVE MODE")
        _copy(connection, _max_id(connection, "usage_new"), None)
        connection.execute(
            "SELECT setval('usage_rows_id_seq',"
            " GREATEST((SELECT MAX(id) FROM usage_new), 1))"
        )
        for statement in (
            "DROP TABLE usage",
            "ALTER TABLE usage_new RENAME TO usage",
            "ALTER TABLE usage_new_default RENAME TO usage_default",
            "ALTER INDEX usage_new_time RENAME TO usage_time",
            "ALTER INDEX usage_new_request_id RENAME TO usage_request_id",
            "ALTER TABLE usage RENAME CONSTRAINT usage_new_pkey TO usage_pkey",
            "ALTER SEQUENCE usage_rows_id_seq OWNED BY usage.id",
        ):
            connection.execute(statement)
    progress(f"  swapped in the partitioned table ({time.monotonic() - began:.1f}s)")


def _max_id(connection: psycopg.Connection[Any], table: str) -> int:
    row = connection.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def _copy(connection: psycopg.Connection[Any], after: int, upto: int | None) -> None:
    if upto is None:
        connection.execute(
            f"INSERT INTO usage_new ({_COLUMNS}) SELECT {_COLUMNS} FROM usage"
            " WHERE id > %s",
            (after,),
        )
    else:
        connection.execute(
            f"INSERT INTO usage_new ({_COLUMNS}) SELECT {_COLUMNS} FROM usage"
            " WHERE id > %s AND id <= %s",
            (after, upto),
        )


# Retention


DAY_SQL = "floor(time / 86400) * 86400"
"""
A row's UTC day start from its C{time}, in PostgreSQL's SQL.
"""


def old_partitions(cursor: psycopg.Cursor[Any], before: float) -> list[str]:
    """
    @return: the usage partitions whose month ends by C{before}, oldest
        first.
    """
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'usage'::regclass AND c.relname ~ '^usage_p[0-9]{6}$'"
        " ORDER BY c.relname"
    )
    names = [r[0] for r in cursor.fetchall()]
    old = []
    for name in names:
        start = datetime.strptime(name[7:], "%Y%m").replace(tzinfo=UTC)
        if month_start(start.timestamp(), 1) <= before:
            old.append(name)
    return old


def roll_partition(cursor: psycopg.Cursor[Any], name: str) -> int:
    """
    Add a whole month's partition to the daily totals and drop it, in
    this transaction; its writers wait (C{EXCLUSIVE}) rather than write
    into a table being rolled.

    @return: the rows rolled.
    """
    cursor.execute(f"LOCK TABLE {name} IN EXCLUSIVE MODE")
    cursor.execute(f"SELECT COUNT(*) FROM {name}")
    got = cursor.fetchone()
    cursor.execute(
        f"INSERT INTO usage_daily ({ROLLUP_COLUMNS})"
        f" {rollup_select(DAY_SQL, name, 'TRUE')}{ROLLUP_UPSERT}"
    )
    cursor.execute(f"DROP TABLE {name}")
    return int(got[0]) if got else 0


def next_day(cursor: psycopg.Cursor[Any], since: float, before: float) -> float | None:
    """
    @return: the start of the day of the oldest row in C{[since,
        before)}, or L{None}.
    """
    cursor.execute(
        "SELECT MIN(time) FROM usage WHERE time >= %s AND time < %s", (since, before)
    )
    got = cursor.fetchone()
    return None if got is None or got[0] is None else (got[0] // DAY) * DAY


def roll_day(cursor: psycopg.Cursor[Any], day: float) -> int:
    """
    One day's rows into its totals: deleted and added up in one
    statement, so exactly the rows deleted are counted (a row committed
    meanwhile is in neither or both).

    @return: the rows rolled.
    """
    cursor.execute(
        "WITH moved AS (DELETE FROM usage WHERE time >= %s AND time < %s"
        f" RETURNING *), counted AS (INSERT INTO usage_daily ({ROLLUP_COLUMNS})"
        f" {rollup_select(DAY_SQL, 'moved', 'TRUE')}{ROLLUP_UPSERT})"
        " SELECT COUNT(*) FROM moved",
        (day, day + DAY),
    )
    got = cursor.fetchone()
    return int(got[0]) if got else 0


__all__ = [
    "COPY_BATCH",
    "MIGRATION_LOCK",
    "MONTHS_AHEAD",
    "add_month",
    "ensure_partitions",
    "migrate",
    "month_start",
    "next_day",
    "old_partitions",
    "partition_name",
    "partition_usage",
    "roll_day",
    "roll_partition",
]
