"""
What every store backend shares: the L{Store} API (SQLite in
L{llmgw.store.db}, PostgreSQL in L{llmgw.store.pg}), the row types, the
schema migrations (written once, in SQL both engines accept, with the
column types translated for PostgreSQL by L{postgres_dialect}) and the
usage report's query.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred

from llmgw.store.batch_tables import BatchTables
from llmgw.store.batches import BatchLine, BatchRow, FileRow
from llmgw.store.migrations import (
    MIGRATIONS,
    MigrationPending,
    Progress,
    StoreError,
    newer_than_code,
    postgres_dialect,
    statements,
)
from llmgw.store.responses import StoredResponse


@dataclass(frozen=True)
class UsageRow:
    """
    One request's row of the C{usage} table.

    @ivar request_id: llmgw's own id of the request, unique: the row's key
        (a write of the same row again, a batch retried, stores it once).
    @ivar client_request_id: the client's own C{X-Request-ID}, L{None}
        when it sent none; not unique (a retry, two agents).
    @ivar key_id: the API key's id, L{None} without a key.
    @ivar replica: the replica that answered, L{None} when none did.
    @ivar status: the HTTP status the client got.
    @ivar latency: seconds from receipt to the last byte.
    @ivar time_to_first_token: seconds from receipt to the first byte of
        the replica's answer; L{None} when none came.
    @ivar estimated: the token counts are an estimate (the engine's never
        came).
    @ivar batch_id: the batch whose line the request was; L{None} for one
        a client sent.
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
    client_request_id: str | None = None
    batch_id: str | None = None


KEY_LIMITS = (
    "models",
    "rpm",
    "tpm",
    "budget_tokens",
    "expires",
    "priority",
    "weight",
)
"""
The columns of a key that L{Store.update_key} may change: what it may use,
its limits, its expiry, and its priority and weight where requests wait.
"""


USAGE_COLUMNS = (
    "time, request_id, key_id, key_name, model, replica, status, stream,"
    " prompt_tokens, completion_tokens, latency, time_to_first_token, estimated,"
    " client_request_id, batch_id"
)


def usage_values(when: float, row: UsageRow) -> tuple[Any, ...]:
    """
    @return: the values of L{USAGE_COLUMNS} for one row.
    """
    return (
        when,
        row.request_id,
        row.key_id,
        row.key_name,
        row.model,
        row.replica,
        row.status,
        int(row.stream),
        row.prompt_tokens,
        row.completion_tokens,
        row.latency,
        row.time_to_first_token,
        int(row.estimated),
        row.client_request_id,
        row.batch_id,
    )


def usage_marks(placeholder: str) -> str:
    """
    @return: the C{VALUES} list of one row of L{USAGE_COLUMNS}.
    """
    count = len(USAGE_COLUMNS.split(","))
    return "(" + ",".join([placeholder] * count) + ")"


def usage_query(by: str, placeholder: str) -> str:
    """
    The usage report's query, for either engine: the rows of C{usage} in
    the range, and the daily totals of C{usage_daily} (rows past
    C{[store] usage_retention}, L{rollup_statements}) of the days that
    start in it, added together per group.

    Both means are over the same requests, those a replica answered (a
    first byte came): a refusal (401, 429, an unknown model) or a
    request that never reached a replica takes milliseconds and has no
    time to first token, and averaged into the latency alone it pulled
    the mean latency below the mean time to first token.  Sums are
    selected, the means made of them in L{shape_usage}, so that a total
    counts as the rows it was made of.

    @param by: C{"key"} or C{"model"}.
    @param placeholder: the driver's parameter marker, C{?} or C{%s}.
    @return: SQL taking C{(since, until, since, until)}.
    """
    column = {"key": "COALESCE(key_name, '')", "model": "model"}[by]
    total = {"key": "key_name", "model": "model"}[by]
    p = placeholder
    return (
        "SELECT name, SUM(requests), SUM(errors), SUM(prompt_tokens),"
        " SUM(completion_tokens), SUM(latency_sum), SUM(ttft_sum),"
        " SUM(estimated), SUM(answered) FROM ("
        f"SELECT {column} AS name, COUNT(*) AS requests,"
        " SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors,"
        " SUM(prompt_tokens) AS prompt_tokens,"
        " SUM(completion_tokens) AS completion_tokens,"
        " SUM(CASE WHEN time_to_first_token IS NOT NULL THEN latency END)"
        " AS latency_sum, SUM(time_to_first_token) AS ttft_sum,"
        " SUM(estimated) AS estimated, COUNT(time_to_first_token) AS answered"
        f" FROM usage WHERE time >= {p} AND time < {p} GROUP BY {column}"
        f" UNION ALL SELECT {total}, SUM(requests), SUM(errors),"
        " SUM(prompt_tokens), SUM(completion_tokens), SUM(latency_sum),"
        " SUM(ttft_sum), SUM(estimated), SUM(answered) FROM usage_daily"
        f" WHERE day >= {p} AND day < {p} GROUP BY {total}"
        ") AS parts GROUP BY name ORDER BY name"
    )


def _mean(total: Any, count: int) -> float | None:
    return float(total) / count if count and total is not None else None


def shape_usage(by: str, rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """
    @return: L{Store.usage}'s dicts from L{usage_query}'s rows (sums as
        C{int}: PostgreSQL's C{SUM} of a C{BIGINT} is a C{numeric});
        C{answered} counts the requests both means are over.
    """
    shaped = []
    for row in rows:
        name, count, errors, prompt, completion, latency, ttft, estimated, done = row
        answered = int(done or 0)
        shaped.append(
            {
                by: name if name != "" else None,
                "requests": int(count),
                "errors": int(errors or 0),
                "prompt_tokens": int(prompt or 0),
                "completion_tokens": int(completion or 0),
                "mean_latency": _mean(latency, answered),
                "mean_time_to_first_token": _mean(ttft, answered),
                "estimated_requests": int(estimated or 0),
                "answered": answered,
            }
        )
    return shaped


DAY = 86400.0
"""
Seconds in a day of the daily totals: UTC days, from the POSIX epoch.
"""

ROLLUP_COLUMNS = (
    "day, key_id, key_name, model, requests, errors, prompt_tokens,"
    " completion_tokens, answered, latency_sum, ttft_sum, estimated"
)


def rollup_select(day: str, source: str, where: str) -> str:
    """
    @param day: the engine's expression of a row's day start from C{time}.
    @param source: the rows: a table, or a C{WITH} query's name.
    @param where: their condition (C{"TRUE"}: all of them).
    @return: the C{SELECT} of L{ROLLUP_COLUMNS} adding up C{source}'s rows
        per day, key and model.
    """
    return (
        f"SELECT {day}, COALESCE(key_id, 0), COALESCE(key_name, ''), model,"
        " COUNT(*), SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END),"
        " SUM(prompt_tokens), SUM(completion_tokens),"
        " COUNT(time_to_first_token),"
        " COALESCE(SUM(CASE WHEN time_to_first_token IS NOT NULL"
        " THEN latency END), 0),"
        " COALESCE(SUM(time_to_first_token), 0), SUM(estimated)"
        f" FROM {source} WHERE {where}"
        f" GROUP BY {day}, COALESCE(key_id, 0), COALESCE(key_name, ''), model"
    )


ROLLUP_UPSERT = (
    " ON CONFLICT (day, key_id, key_name, model) DO UPDATE SET"
    " requests = usage_daily.requests + excluded.requests,"
    " errors = usage_daily.errors + excluded.errors,"
    " prompt_tokens = usage_daily.prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = usage_daily.completion_tokens"
    " + excluded.completion_tokens,"
    " answered = usage_daily.answered + excluded.answered,"
    " latency_sum = usage_daily.latency_sum + excluded.latency_sum,"
    " ttft_sum = usage_daily.ttft_sum + excluded.ttft_sum,"
    " estimated = usage_daily.estimated + excluded.estimated"
)
"""
What makes a day's rows rolled in two passes (a late row, an interrupted
pass) add to the day's total instead of replacing it.
"""


def day_start(when: float) -> float:
    """
    @return: the start of C{when}'s UTC day, POSIX seconds.
    """
    return (when // DAY) * DAY


def key_update(changes: dict[str, Any], placeholder: str) -> tuple[str, list[Any]]:
    """
    The C{SET} clause of L{Store.update_key}'s statement, for either engine.

    @param changes: as L{Store.update_key} takes them.
    @param placeholder: the engine's parameter mark, C{?} or C{%s}.
    @return: the clause (C{"rpm = ?, models = ?"}) and its parameters.
    @raise ValueError: a column not in L{KEY_LIMITS}, or none at all.
    """
    unknown = sorted(set(changes) - set(KEY_LIMITS))
    if unknown or not changes:
        raise ValueError(f"key update: cannot change {unknown or 'nothing'}")
    columns = [c for c in KEY_LIMITS if c in changes]
    values = [
        json.dumps(changes[c])
        if c == "models" and changes[c] is not None
        else changes[c]
        for c in columns
    ]
    return ", ".join(f"{c} = {placeholder}" for c in columns), values


def key_row(names: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
    """
    @return: a key's dict as L{Store.prepare} gives it, from a row of
        C{SELECT * FROM api_keys}.
    """
    row = dict(zip(names, values, strict=True))
    row["models"] = json.loads(row["models"]) if row["models"] else None
    row["admin"] = bool(row["admin"])
    return row


class Store(BatchTables):
    """
    The database, whichever engine holds it.  Every method but L{prepare}
    and L{close} returns a Deferred fired on the reactor thread, the work
    done on a thread off it.  The files, batches and batch lines are
    L{BatchTables}'s, which each engine's C{__init__} gives how it runs a
    transaction.

    @cvar database_errors: what the engine's driver raises when the
        database refuses or cannot be reached (a write kept for a retry).
    @cvar integrity_errors: what it raises for a name already used.
    @ivar path: where the data is, for people: a file's path, or a URL
        without its password.
    """

    database_errors: tuple[type[Exception], ...] = ()
    integrity_errors: tuple[type[Exception], ...] = ()
    path: str = ""
    #: The drained nodes L{prepare} read: node id to POSIX seconds.
    drained: dict[str, float]

    def prepare(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """
        At start, before the reactor runs: migrate, then read the keys and
        the runtime models, on this thread.

        @return: every key, revoked ones included, as dicts of the
            C{api_keys} columns (C{models} decoded: a list or L{None});
            and the runtime models, as L{models} gives them.  The drained
            nodes go to L{drained}.
        @raise StoreError: the database cannot be opened or migrated (not
            a database, or newer than this code).
        @raise MigrationPending: a pending migration rewrites a table that
            has rows (nothing was changed): C{llmgw store migrate} first.
        """
        raise NotImplementedError

    def migrate(self, progress: Progress, dry_run: bool = False) -> int:
        """
        Apply every pending migration, those that rewrite rows included,
        on this thread (C{llmgw store migrate}; no reactor needed).  Each
        runs in its own transaction with the bump of the schema version:
        one interrupted is rolled back and runs whole again next time.

        @param progress: told each migration as it starts (with the rows
            it rewrites), each statement with its seconds, and each step
            of a long copy.
        @param dry_run: only tell what would run (each migration and its
            statements); change nothing.
        @return: the schema version the database is at after (with
            C{dry_run}, the one it is at).
        @raise StoreError: the database cannot be opened, is newer than
            this code, or a statement failed (its migration rolled back).
        """
        raise NotImplementedError

    def roll_usage(self, before: float) -> Deferred[int]:
        """
        Move the usage rows older than C{before} into the daily totals of
        C{usage_daily} (per UTC day, key and model), one day at a time,
        each day's rows added to its total and deleted in one
        transaction: a row written meanwhile is either rolled with its
        day or stays a row, never both nor neither.  L{usage} reads the
        totals with the rows, so its sums over whole days do not change.

        @param before: POSIX seconds, the start of a UTC day
            (L{llmgw.store.base.day_start}).
        @return: fires with the rows rolled.
        """
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def keys(self) -> Deferred[list[dict[str, Any]]]:
        """
        @return: every key, as L{prepare} gives them, read again (a router
            whose watch says keys changed; a listener that reconnected).
        """
        raise NotImplementedError

    def add_key(self, row: dict[str, Any]) -> Deferred[int]:
        """
        @param row: name, prefix, hash, models (list or None), rpm, tpm,
            budget_tokens, admin, created.
        @return: fires with the new key's id; fails with one of
            L{integrity_errors} for a name already used.
        """
        raise NotImplementedError

    def revoke_key(self, key_id: int, when: float) -> Deferred[None]:
        """
        Mark a key revoked at C{when}, POSIX seconds.
        """
        raise NotImplementedError

    def update_key(self, key_id: int, changes: dict[str, Any]) -> Deferred[None]:
        """
        Change a key's models, limits or expiry.

        @param changes: some of L{KEY_LIMITS}, each to its new value:
            C{models} a list of names or L{None} (all), C{rpm}, C{tpm} and
            C{budget_tokens} an integer or L{None} (no limit), C{expires}
            POSIX seconds or L{None} (never), C{priority} a name or an
            integer's digits (L{llmgw.router.routing.fairness}), C{weight} a
            number above 0.
        @raise ValueError: a column not in L{KEY_LIMITS} (before any write).
        """
        raise NotImplementedError

    def add_usage(
        self,
        rows: Sequence[tuple[float, UsageRow]],
        key_use: dict[int, tuple[int, float]],
    ) -> Deferred[None]:
        """
        Write usage records and add to the keys' token counts, in one
        transaction.  A row whose request id is already there is not
        written again (nor counted twice in its key's tokens, when
        C{key_use} is what those rows add up to).

        @param rows: C{(POSIX seconds, row)} per request.
        @param key_use: per key id, C{(tokens, last used)}.
        """
        raise NotImplementedError

    def usage(
        self, by: str, since: float, until: float
    ) -> Deferred[list[dict[str, Any]]]:
        """
        @param by: C{"key"} or C{"model"}.
        @param since: POSIX seconds, inclusive.
        @param until: POSIX seconds, exclusive; daily totals (rows past
            retention, L{roll_usage}) count when their day starts in
            C{[since, until)}.
        @return: one dict per group (see L{shape_usage}), read from what
            is committed; fails with one of L{database_errors} when the
            database cannot be read now.
        """
        raise NotImplementedError

    def models(self) -> Deferred[list[tuple[str, str]]]:
        """
        @return: C{(name, spec JSON)} of the models added at run time.
        """
        raise NotImplementedError

    def put_model(self, name: str, spec: str, when: float) -> Deferred[None]:
        raise NotImplementedError

    def drains(self) -> Deferred[dict[str, float]]:
        """
        @return: the drained nodes, node id to when (POSIX seconds); at
            start L{prepare} reads them into L{drained}.
        """
        raise NotImplementedError

    def set_drain(self, node_id: str, since: float) -> Deferred[None]:
        """
        Keep C{node_id} drained (its first C{since} kept when already).
        """
        raise NotImplementedError

    def clear_drain(self, node_id: str) -> Deferred[None]:
        """
        Forget C{node_id}'s drain (none: nothing to do).
        """
        raise NotImplementedError

    def delete_model(self, name: str) -> Deferred[None]:
        raise NotImplementedError

    def put_response(self, row: StoredResponse) -> Deferred[None]:
        """
        Keep one response of the Responses API under its key (a response
        put again replaces its row).

        @return: fires once committed.
        """
        raise NotImplementedError

    def get_response(
        self, response_id: str, key_id: int | None
    ) -> Deferred[StoredResponse | None]:
        """
        @param key_id: the key asking; L{None} on a server without keys.
        @return: fires with the response, or L{None} when it is unknown,
            already dropped by L{drop_responses}, or made by another key
            (a key never reads another key's: without a key only the
            responses made without one).
        """
        raise NotImplementedError

    def delete_response(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        """
        Delete one response of C{key_id}'s (as L{get_response} finds it).

        @return: fires with whether there was one to delete.
        """
        raise NotImplementedError

    def drop_responses(self, before: float) -> Deferred[int]:
        """
        Delete the responses made before C{before} (POSIX seconds), of
        every key (C{[store] responses_retention}).

        @return: fires with how many were deleted.
        """
        raise NotImplementedError


__all__ = [
    "DAY",
    "BatchLine",
    "BatchRow",
    "FileRow",
    "KEY_LIMITS",
    "MIGRATIONS",
    "ROLLUP_COLUMNS",
    "ROLLUP_UPSERT",
    "USAGE_COLUMNS",
    "MigrationPending",
    "Progress",
    "Store",
    "StoreError",
    "StoredResponse",
    "UsageRow",
    "day_start",
    "key_row",
    "key_update",
    "newer_than_code",
    "postgres_dialect",
    "rollup_select",
    "shape_usage",
    "statements",
    "usage_marks",
    "usage_query",
    "usage_values",
]
