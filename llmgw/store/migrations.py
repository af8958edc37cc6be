"""
The schema's migrations, what each one does to the rows already there,
and the plan both engines follow to apply them (docs/store.md).

A migration is I{additive} when it only adds (a table, a column with a
default, an index on a new table): it takes a moment whatever the size of
the database, and a server applies it at start.  One that I{rewrites} a
table's rows (drops duplicates, copies a table into partitions) takes
time in proportion to that table: a server finding one pending on a table
that has rows refuses to start, with one line naming
C{llmgw store migrate}, which applies it with progress while no server
runs (L{llmgw.cli.store}).  On a new database nothing is there to
rewrite: everything runs at start.

Each migration runs in one transaction with the bump of the schema
version, so that one interrupted (C{kill -9}, a lost connection) is rolled
back whole and runs again from its start the next time.  On PostgreSQL an
index on a table in use is built C{CONCURRENTLY} (which cannot run in a
transaction: U{https://www.postgresql.org/docs/15/sql-createindex.html},
"Building Indexes Concurrently"), after the migration's other statements
commit and before its version is bumped; those statements are written to
be run again, so an interrupted build is dropped (an interrupted
concurrent build leaves an C{INVALID} index) and done again.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


class StoreError(Exception):
    """
    The database cannot be used: a URL of no known engine, a folder or
    file that cannot be made or opened, a server that cannot be reached,
    not a database, or a schema newer than this code.  C{str(error)} is
    one line naming the path or URL.
    """


class MigrationPending(StoreError):
    """
    A migration that rewrites a table's rows is pending on a table that
    has rows: only C{llmgw store migrate} applies it.  C{str(error)} is
    one line naming the database, the migration and the command.
    """


Progress = Callable[[str], None]
"""
Where a migration says what it does, one line at a time (the CLI prints
them; a server at start passes L{quiet}).
"""


def quiet(line: str) -> None:
    """
    A L{Progress} that tells nobody.
    """


@dataclass(frozen=True)
class Migration:
    """
    One step of the schema.

    @ivar summary: what it does, for people (C{llmgw store migrate
        --dry-run} lists it).
    @ivar sql: its statements as SQLite takes them; PostgreSQL gets them
        through L{postgres_dialect} unless L{postgres} is given.
    @ivar rewrites: the table whose rows it rewrites, or L{None} for an
        additive one.
    @ivar postgres: PostgreSQL's own statements, when they differ;
        C{""}: none.
    @ivar concurrent: PostgreSQL: C{CREATE [UNIQUE] INDEX name ON ...}
        statements on a table in use, built C{CONCURRENTLY} after the
        others commit.
    @ivar postgres_rewrites: the table it rewrites on PostgreSQL when not
        L{rewrites} (a step that SQLite has nothing to do for).
    @ivar procedure: the name of a step done in code on PostgreSQL (it
        copies in batches and says how far it got), after L{postgres}.
    """

    summary: str
    sql: str
    rewrites: str | None = None
    postgres: str | None = None
    concurrent: tuple[str, ...] = ()
    postgres_rewrites: str | None = None
    procedure: str | None = None

    def rewritten(self, postgresql: bool) -> str | None:
        """
        @return: the table whose rows this rewrites on that engine, or
            L{None}.
        """
        if postgresql and self.postgres_rewrites is not None:
            return self.postgres_rewrites
        return self.rewrites

    def statements_for(self, postgresql: bool) -> list[str]:
        """
        @return: the statements to run in this migration's transaction on
            that engine (L{concurrent} and L{procedure} not included).
        """
        if not postgresql:
            return statements(self.sql)
        if self.postgres is not None:
            return statements(self.postgres)
        return statements(postgres_dialect(self.sql))


# In order: the schema version of a database is how many have run.  Written
# in SQLite's types; PostgreSQL gets them through postgres_dialect.  Both
# engines must accept every statement as translated (the store tests run
# them on both).
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "keys, usage and runtime models",
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
    ),
    Migration(
        "usage: token counts the router estimated (the engine's never came)",
        "ALTER TABLE usage ADD COLUMN estimated INTEGER NOT NULL DEFAULT 0;",
    ),
    # One record per request id, whoever writes it and however often (a
    # batch retried after a commit whose answer was lost; several
    # routers): duplicates from before are dropped, the first kept.
    Migration(
        "usage: one record per request id (duplicates dropped, a unique index)",
        """
        DELETE FROM usage WHERE id NOT IN
            (SELECT MIN(id) FROM usage GROUP BY request_id);
        CREATE UNIQUE INDEX usage_request_id ON usage (request_id);
        """,
        rewrites="usage",
        postgres="""
        DELETE FROM usage WHERE id NOT IN
            (SELECT MIN(id) FROM usage GROUP BY request_id);
        """,
        concurrent=("CREATE UNIQUE INDEX usage_request_id ON usage (request_id)",),
    ),
    Migration(
        "nodes an operator drained, kept across restarts",
        "CREATE TABLE node_drains (node_id TEXT PRIMARY KEY, since REAL NOT NULL);",
    ),
    Migration(
        "keys: an expiry (POSIX seconds; NULL: never)",
        "ALTER TABLE api_keys ADD COLUMN expires REAL;",
    ),
    # Usage older than [store] usage_retention, rolled into one row per
    # UTC day, key and model (llmgw.store.retention).  No key: key_id 0
    # and key_name '' (a primary key cannot hold NULL).  latency_sum and
    # ttft_sum are over the answered requests, those both means are over.
    Migration(
        "usage_daily: daily totals per key and model of usage past retention",
        """
        CREATE TABLE usage_daily (
            day REAL NOT NULL,
            key_id INTEGER NOT NULL,
            key_name TEXT NOT NULL,
            model TEXT NOT NULL,
            requests INTEGER NOT NULL,
            errors INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            answered INTEGER NOT NULL,
            latency_sum REAL NOT NULL,
            ttft_sum REAL NOT NULL,
            estimated INTEGER NOT NULL,
            PRIMARY KEY (day, key_id, key_name, model)
        );
        """,
    ),
    # PostgreSQL: the usage table partitioned by month (llmgw.store.pg_usage),
    # so that retention drops a month's table instead of deleting its
    # rows one by one.  SQLite has no partitions: nothing to do there.
    Migration(
        "usage: partitioned by month (PostgreSQL; nothing on SQLite)",
        "",
        postgres="",
        postgres_rewrites="usage",
        procedure="partition_usage",
    ),
    # Where requests wait in the router, a key's priority (a name or an
    # integer, llmgw.router.routing.fairness) goes first, then its weighted share.
    Migration(
        "keys: a priority and a weight for the router's waiting rooms",
        """
        ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'standard';
        ALTER TABLE api_keys ADD COLUMN weight REAL NOT NULL DEFAULT 1;
        """,
    ),
    # A usage row is keyed by llmgw's own id of its request (request_id,
    # unique, made per request by the router), no longer the client's
    # X-Request-ID: two requests sending the same one (a retry, two agents)
    # are two rows, where the unique index kept one and the other's tokens
    # went unbilled.  The client's id is kept beside it; rows written
    # before hold the client's id (or the one the router made) in
    # request_id, and NULL here.
    Migration(
        "usage: the client's own X-Request-ID beside llmgw's request id",
        "ALTER TABLE usage ADD COLUMN client_request_id TEXT;",
    ),
    # The Responses API's stored responses (llmgw.store.responses), read
    # by id and key, dropped by age past [store] responses_retention.  The
    # items and the Response object are JSON text.
    Migration(
        "responses: the Responses API's stored responses",
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            key_id INTEGER,
            model TEXT NOT NULL,
            created_at REAL NOT NULL,
            previous_response_id TEXT,
            input_items TEXT NOT NULL,
            output_items TEXT NOT NULL,
            response TEXT NOT NULL
        );
        CREATE INDEX responses_created_at ON responses (created_at);
        """,
    ),
    # Files and batches (llmgw.store.batches): a file's bytes in the
    # store, so that every server of a standby set reads them; a batch's
    # lines one row each, claimed by the runner lowest line first; and the
    # batch a usage row's request was a line of.
    Migration(
        "files, batches and batch_lines; usage: the batch of a batch line",
        """
        CREATE TABLE files (
            id TEXT PRIMARY KEY,
            key_id INTEGER,
            purpose TEXT NOT NULL,
            filename TEXT NOT NULL,
            bytes INTEGER NOT NULL,
            created_at REAL NOT NULL,
            content BLOB NOT NULL
        );
        CREATE INDEX files_key_created ON files (key_id, created_at);
        CREATE TABLE batches (
            id TEXT PRIMARY KEY,
            key_id INTEGER,
            key_name TEXT,
            endpoint TEXT NOT NULL,
            input_file_id TEXT,
            completion_window TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL,
            in_progress_at REAL,
            finalizing_at REAL,
            completed_at REAL,
            failed_at REAL,
            expired_at REAL,
            cancelling_at REAL,
            cancelled_at REAL,
            output_file_id TEXT,
            error_file_id TEXT,
            errors TEXT NOT NULL,
            metadata TEXT NOT NULL,
            api TEXT NOT NULL,
            total INTEGER NOT NULL,
            completed INTEGER NOT NULL,
            failed INTEGER NOT NULL
        );
        CREATE INDEX batches_key_created ON batches (key_id, created_at);
        CREATE INDEX batches_status ON batches (status);
        CREATE TABLE batch_lines (
            batch_id TEXT NOT NULL,
            line_no INTEGER NOT NULL,
            custom_id TEXT NOT NULL,
            model TEXT NOT NULL,
            url TEXT NOT NULL,
            body TEXT NOT NULL,
            state TEXT NOT NULL,
            owner TEXT,
            attempts INTEGER NOT NULL,
            status_code INTEGER,
            result TEXT,
            finished_at REAL,
            PRIMARY KEY (batch_id, line_no)
        );
        CREATE INDEX batch_lines_state ON batch_lines (state, batch_id, line_no);
        ALTER TABLE usage ADD COLUMN batch_id TEXT;
        """,
    ),
)


_PG_TYPES = (
    # An auto-numbered key: SQLite's rowid alias, PostgreSQL's identity
    # column (https://www.postgresql.org/docs/15/ddl-identity-columns.html).
    (
        re.compile(r"\bINTEGER PRIMARY KEY\b"),
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    # SQLite's REAL is 8 bytes; PostgreSQL's is 4 (about 6 digits: a POSIX
    # time would lose its seconds), so DOUBLE PRECISION.
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    # SQLite's INTEGER holds 8 bytes; PostgreSQL's 4 (token counts outgrow).
    (re.compile(r"\bINTEGER\b(?! PRIMARY)"), "BIGINT"),
    # Bytes: SQLite's BLOB, PostgreSQL's bytea.
    (re.compile(r"\bBLOB\b"), "BYTEA"),
)


def postgres_dialect(migration: str) -> str:
    """
    @param migration: a migration's statements, as SQLite takes them.
    @return: the same for PostgreSQL: the column types of the same size.
    """
    for pattern, replacement in _PG_TYPES:
        migration = pattern.sub(replacement, migration)
    return migration


def statements(migration: str) -> list[str]:
    """
    @return: the statements of one migration (split on C{;}: none of
        them holds a C{;} of its own).
    """
    return [" ".join(s.split()) for s in migration.split(";") if s.strip()]


def newer_than_code(version: int) -> str:
    """
    @return: the line refusing a database at schema C{version}.
    """
    return (
        f"the database is at schema version {version}; this llmgw knows"
        f" up to {len(MIGRATIONS)}"
    )


def pending(version: int) -> list[tuple[int, Migration]]:
    """
    @param version: the database's schema version.
    @return: C{(number, migration)} of those to run, in order (numbered
        from 1: the version the database is at once it ran).
    @raise StoreError: the database is newer than this code.
    """
    if version > len(MIGRATIONS):
        raise StoreError(newer_than_code(version))
    return [(n + 1, MIGRATIONS[n]) for n in range(version, len(MIGRATIONS))]


def refusal(path: str, number: int, migration: Migration, table: str) -> str:
    """
    @return: the one line a server (or router) refusing to start says.
    """
    return (
        f"store: {path}: migration {number} ({migration.summary}) rewrites"
        f" the {table} table's rows: stop every server and router on this"
        " database, then run `llmgw store migrate` (with the same --config"
        " and --state-dir), and start again"
    )


def describe(number: int, migration: Migration, postgresql: bool, rows: int) -> str:
    """
    @param rows: the rows of the table it rewrites (ignored for an
        additive one).
    @return: the line C{--dry-run} and the progress give for one migration.
    """
    table = migration.rewritten(postgresql)
    kind = "additive" if table is None else f"rewrites {table}: {rows:,} rows"
    return f"migration {number}: {migration.summary} [{kind}]"


__all__ = [
    "MIGRATIONS",
    "Migration",
    "MigrationPending",
    "Progress",
    "StoreError",
    "describe",
    "newer_than_code",
    "pending",
    "postgres_dialect",
    "quiet",
    "refusal",
    "statements",
]
