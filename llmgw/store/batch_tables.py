"""
The work on the C{files}, C{batches} and C{batch_lines} tables
(L{llmgw.store.batches}), written once for both engines: L{BatchTables} is
the base of L{llmgw.store.base.Store}, each engine handing it, from its
C{__init__}, how it runs a transaction, its parameter marker and its row
lock.

Claiming lines is one C{UPDATE} whose subquery picks the lowest pending
lines: on PostgreSQL the subquery locks them C{FOR UPDATE SKIP LOCKED}, so
that two claimers at once take different lines and neither waits for the
other (PostgreSQL's manual, "The Locking Clause"); SQLite runs one writer
at a time, and one statement is one transaction, so there the statement
alone is atomic.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred

from llmgw.store.batches import (
    ACTIVE_STATUSES,
    BATCH_COLUMNS,
    FILE_COLUMNS,
    LINE_COLUMNS,
    LINE_STATES,
    BatchLine,
    BatchRow,
    BatchUsage,
    FileRow,
    batch_changes,
    batch_row,
    batch_values,
    file_row,
    line_row,
    line_values,
    marks,
    owned_by,
)

T = TypeVar("T")


class Transact(Protocol):
    """
    How an engine runs C{work(cursor)} in one transaction on a thread:
    committed when it returns, rolled back when it raises.
    """

    def __call__(self, work: Callable[[Any], T]) -> Deferred[T]: ...


class BatchTables:
    """
    The files, batches and batch lines of one database.

    @param write: runs a transaction that writes.
    @param read: runs one that only reads (SQLite's reading connection).
    @param placeholder: the driver's parameter marker, C{?} or C{%s}.
    @param lock: what follows the claim's subquery to lock the rows it
        picks: C{" FOR UPDATE SKIP LOCKED"} on PostgreSQL, empty on SQLite.
    """

    def __init__(
        self, write: Transact, read: Transact, placeholder: str, lock: str
    ) -> None:
        self._write = write
        self._read = read
        self._p = placeholder
        self._lock = lock

    def _rows(self, sql: str, params: Sequence[Any]) -> Deferred[list[Any]]:
        def read(cursor: Any) -> list[Any]:
            cursor.execute(sql, tuple(params))
            return list(cursor.fetchall())

        return self._read(read)

    def _count(self, sql: str, params: Sequence[Any]) -> Deferred[int]:
        def write(cursor: Any) -> int:
            cursor.execute(sql, tuple(params))
            return int(cursor.rowcount)

        return self._write(write)

    # Files

    def add_file(self, row: FileRow, content: bytes) -> Deferred[None]:
        """
        Keep one file and its bytes.

        @raise: fails with the engine's integrity error for an id used.
        """
        p = self._p

        def add(cursor: Any) -> None:
            cursor.execute(
                f"INSERT INTO files ({FILE_COLUMNS}, content) VALUES ({marks(p, 7)})",
                (*(getattr(row, n) for n in FILE_COLUMNS.split(", ")), content),
            )

        return self._write(add)

    def get_file(self, file_id: str, key_id: int | None) -> Deferred[FileRow | None]:
        """
        @return: fires with the file, or L{None} when unknown or another
            key's.
        """
        where, params = owned_by(key_id, self._p)
        d = self._rows(
            f"SELECT {FILE_COLUMNS} FROM files WHERE id = {self._p} AND {where}",
            (file_id, *params),
        )
        return d.addCallback(lambda rows: file_row(rows[0]) if rows else None)

    def file_content(self, file_id: str, key_id: int | None) -> Deferred[bytes | None]:
        """
        @return: fires with the file's bytes, or L{None} as L{get_file}.
        """
        where, params = owned_by(key_id, self._p)
        d = self._rows(
            f"SELECT content FROM files WHERE id = {self._p} AND {where}",
            (file_id, *params),
        )
        return d.addCallback(lambda rows: bytes(rows[0][0]) if rows else None)

    def list_files(
        self,
        key_id: int | None,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        order: str = "desc",
    ) -> Deferred[list[FileRow]]:
        """
        @param purpose: only files of this purpose; L{None}: all.
        @param after: a file id: only those past it in C{order} (a cursor
            to page on; an unknown one gives none).
        @param order: C{"desc"} (newest first) or C{"asc"}, by creation.
        @return: fires with at most C{limit} of C{key_id}'s files.
        """
        p, where, params = self._p, *owned_by(key_id, self._p)
        sign, direction = {"desc": ("<", "DESC"), "asc": (">", "ASC")}[order]
        values: list[Any] = list(params)
        if purpose is not None:
            where += f" AND purpose = {p}"
            values.append(purpose)
        if after is not None:
            where += (
                f" AND (created_at, id) {sign}"
                f" (SELECT created_at, id FROM files WHERE id = {p})"
            )
            values.append(after)
        d = self._rows(
            f"SELECT {FILE_COLUMNS} FROM files WHERE {where}"
            f" ORDER BY created_at {direction}, id {direction} LIMIT {p}",
            (*values, limit),
        )
        return d.addCallback(lambda rows: [file_row(r) for r in rows])

    def delete_file(self, file_id: str, key_id: int | None) -> Deferred[bool]:
        """
        @return: fires with whether C{key_id} had that file.
        """
        where, params = owned_by(key_id, self._p)
        d = self._count(
            f"DELETE FROM files WHERE id = {self._p} AND {where}", (file_id, *params)
        )
        return d.addCallback(lambda n: n > 0)

    # Batches

    def add_batch(self, row: BatchRow, lines: Sequence[BatchLine]) -> Deferred[None]:
        """
        Keep a batch and its lines, in one transaction.
        """
        p = self._p

        def add(cursor: Any) -> None:
            cursor.execute(
                f"INSERT INTO batches ({BATCH_COLUMNS})"
                f" VALUES ({marks(p, len(batch_values(row)))})",
                batch_values(row),
            )
            if lines:
                cursor.executemany(
                    f"INSERT INTO batch_lines ({LINE_COLUMNS}) VALUES ({marks(p, 12)})",
                    [line_values(line) for line in lines],
                )

        return self._write(add)

    def get_batch(self, batch_id: str, key_id: int | None) -> Deferred[BatchRow | None]:
        """
        @return: fires with the batch, or L{None} when unknown or another
            key's.
        """
        where, params = owned_by(key_id, self._p)
        d = self._rows(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = {self._p} AND {where}",
            (batch_id, *params),
        )
        return d.addCallback(lambda rows: batch_row(rows[0]) if rows else None)

    def list_batches(
        self,
        key_id: int | None,
        after: str | None = None,
        limit: int = 10000,
        api: str | None = None,
    ) -> Deferred[list[BatchRow]]:
        """
        @param after: a batch id: only those made before it (newest first).
        @param api: C{"openai"} or C{"anthropic"}: only that API's; L{None}:
            both.
        @return: fires with at most C{limit} of C{key_id}'s batches, newest
            first.
        """
        p, where, params = self._p, *owned_by(key_id, self._p)
        values: list[Any] = list(params)
        if api is not None:
            where += f" AND api = {p}"
            values.append(api)
        if after is not None:
            where += (
                f" AND (created_at, id) < (SELECT created_at, id FROM batches"
                f" WHERE id = {p})"
            )
            values.append(after)
        d = self._rows(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE {where}"
            f" ORDER BY created_at DESC, id DESC LIMIT {p}",
            (*values, limit),
        )
        return d.addCallback(lambda rows: [batch_row(r) for r in rows])

    def update_batch(
        self,
        batch_id: str,
        changes: dict[str, Any],
        statuses: Sequence[str] | None = None,
    ) -> Deferred[bool]:
        """
        @param changes: fields of L{BatchRow} (not C{id}) to new values.
        @param statuses: change it only while its status is one of these
            (a cancel racing the runner's end changes one of them);
            L{None}: whatever its status.
        @return: fires with whether the batch was changed.
        @raise ValueError: an unknown field (before any write).
        """
        sets, values = batch_changes(changes, self._p)
        where = f"id = {self._p}"
        values.append(batch_id)
        if statuses is not None:
            where += f" AND status IN ({marks(self._p, len(statuses))})"
            values.extend(statuses)
        d = self._count(f"UPDATE batches SET {sets} WHERE {where}", values)
        return d.addCallback(lambda n: n > 0)

    def delete_batch(self, batch_id: str, key_id: int | None) -> Deferred[bool]:
        """
        Delete a batch and its lines (Anthropic's delete; the files stay).

        @return: fires with whether C{key_id} had that batch.
        """
        where, params = owned_by(key_id, self._p)
        p = self._p

        def delete(cursor: Any) -> bool:
            cursor.execute(
                f"DELETE FROM batches WHERE id = {p} AND {where}", (batch_id, *params)
            )
            if cursor.rowcount == 0:
                return False
            cursor.execute(f"DELETE FROM batch_lines WHERE batch_id = {p}", (batch_id,))
            return True

        return self._write(delete)

    def active_batches(self) -> Deferred[list[BatchRow]]:
        """
        @return: fires with every key's batches that are not over (one of
            L{ACTIVE_STATUSES}), oldest first.
        """
        d = self._rows(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN"
            f" ({marks(self._p, len(ACTIVE_STATUSES))}) ORDER BY created_at, id",
            ACTIVE_STATUSES,
        )
        return d.addCallback(lambda rows: [batch_row(r) for r in rows])

    # The operator's view (the admin API): every key's batches.

    def find_batch(self, batch_id: str) -> Deferred[BatchRow | None]:
        """
        @return: fires with the batch, whichever key made it, or L{None}
            when unknown.
        """
        d = self._rows(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = {self._p}", (batch_id,)
        )
        return d.addCallback(lambda rows: batch_row(rows[0]) if rows else None)

    def all_batches(
        self,
        status: str | None = None,
        key_id: int | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> Deferred[list[BatchRow]]:
        """
        @param status: only the batches in this status; L{None}: any.
        @param key_id: only this key's; L{None}: every key's (and those of
            a server without keys).
        @param after: a batch id: only those made before it.
        @return: fires with at most C{limit} batches, newest first.
        """
        p = self._p
        conditions: list[str] = []
        values: list[Any] = []
        for column, value in (("status", status), ("key_id", key_id)):
            if value is not None:
                conditions.append(f"{column} = {p}")
                values.append(value)
        if after is not None:
            conditions.append(
                f"(created_at, id) < (SELECT created_at, id FROM batches"
                f" WHERE id = {p})"
            )
            values.append(after)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        d = self._rows(
            f"SELECT {BATCH_COLUMNS} FROM batches{where}"
            f" ORDER BY created_at DESC, id DESC LIMIT {p}",
            (*values, limit),
        )
        return d.addCallback(lambda rows: [batch_row(r) for r in rows])

    # Lines

    def claim_lines(
        self, batch_id: str, owner: str, limit: int
    ) -> Deferred[list[BatchLine]]:
        """
        Take up to C{limit} pending lines of a batch, lowest C{line_no}
        first: each becomes C{running} under C{owner}, its C{attempts} one
        more.  Two claimers at once never get the same line.

        @return: fires with the lines taken, by C{line_no}.
        """
        p = self._p

        def claim(cursor: Any) -> list[BatchLine]:
            # Materialized: picked once.  As a plain subquery PostgreSQL
            # may run it again per row updated, each time past the rows
            # this transaction already locked, and take more than limit.
            cursor.execute(
                "WITH picked AS MATERIALIZED (SELECT line_no FROM batch_lines"
                f" WHERE batch_id = {p} AND state = 'pending' ORDER BY line_no"
                f" LIMIT {p}{self._lock})"
                " UPDATE batch_lines SET state = 'running',"
                f" owner = {p}, attempts = attempts + 1"
                f" WHERE batch_id = {p} AND state = 'pending'"
                " AND line_no IN (SELECT line_no FROM picked)"
                f" RETURNING {LINE_COLUMNS}",
                (batch_id, limit, owner, batch_id),
            )
            return sorted(
                (line_row(r) for r in cursor.fetchall()), key=lambda x: x.line_no
            )

        return self._write(claim)

    def requeue_lines(self, owner: str) -> Deferred[int]:
        """
        Put every running line not claimed by C{owner} back to pending: a
        runner starting, or taking the lead, takes over what a runner
        before it left running.

        @return: fires with the lines put back.
        """
        return self._count(
            "UPDATE batch_lines SET state = 'pending'"
            f" WHERE state = 'running' AND (owner IS NULL OR owner <> {self._p})",
            (owner,),
        )

    def release_line(self, batch_id: str, line_no: int, owner: str) -> Deferred[bool]:
        """
        Put one line C{owner} runs back to pending (the fleet had no room
        for it); its C{attempts} stays counted.

        @return: fires with whether it was running under C{owner}.
        """
        p = self._p
        d = self._count(
            f"UPDATE batch_lines SET state = 'pending' WHERE batch_id = {p}"
            f" AND line_no = {p} AND state = 'running' AND owner = {p}",
            (batch_id, line_no, owner),
        )
        return d.addCallback(lambda n: n > 0)

    def finish_line(
        self,
        batch_id: str,
        line_no: int,
        owner: str,
        state: str,
        status_code: int | None,
        result: str | None,
        when: float | None = None,
    ) -> Deferred[bool]:
        """
        End one line with its answer, only while it is still running under
        C{owner}: a stale runner's answer (the line requeued meanwhile) is
        dropped, and a line ends once.

        @param state: C{"done"}, C{"failed"} or C{"expired"}.
        @param result: the answer's body or the error, JSON text.
        @param when: POSIX seconds; now by default.
        @return: fires with whether the line was ended by this call.
        @raise ValueError: C{state} is not an end state.
        """
        if state not in LINE_STATES[2:]:
            raise ValueError(f"finish_line: state {state!r}")
        p = self._p
        d = self._count(
            f"UPDATE batch_lines SET state = {p}, status_code = {p}, result = {p},"
            f" finished_at = {p} WHERE batch_id = {p} AND line_no = {p}"
            f" AND state = 'running' AND owner = {p}",
            (
                state,
                status_code,
                result,
                time.time() if when is None else when,
                batch_id,
                line_no,
                owner,
            ),
        )
        return d.addCallback(lambda n: n > 0)

    def cancel_lines(self, batch_id: str) -> Deferred[int]:
        """
        Cancel a batch's pending lines (those running end as they end).

        @return: fires with the lines cancelled.
        """
        return self._count(
            "UPDATE batch_lines SET state = 'cancelled'"
            f" WHERE batch_id = {self._p} AND state = 'pending'",
            (batch_id,),
        )

    def batch_lines(self, batch_id: str) -> Deferred[list[BatchLine]]:
        """
        @return: fires with the batch's lines, by C{line_no}.
        """
        d = self._rows(
            f"SELECT {LINE_COLUMNS} FROM batch_lines WHERE batch_id = {self._p}"
            " ORDER BY line_no",
            (batch_id,),
        )
        return d.addCallback(lambda rows: [line_row(r) for r in rows])

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        """
        @return: fires with the batch's lines per state, every state of
            L{LINE_STATES} present.
        """
        d = self._rows(
            "SELECT state, COUNT(*) FROM batch_lines"
            f" WHERE batch_id = {self._p} GROUP BY state",
            (batch_id,),
        )
        return d.addCallback(_per_state)

    def batch_usage(self, batch_id: str, created_at: float) -> Deferred[BatchUsage]:
        """
        @param created_at: when the batch was made, POSIX seconds: its
            lines' rows are none older.
        @return: fires with the sums of the batch's lines' usage rows, as
            far as they are kept (C{[store] usage_retention}: rows rolled
            into daily totals no longer count).
        """
        # Each line's row looked up by its exact request id (BATCH-LINE)
        # on the index the usage table has on request ids: an equality,
        # whatever the database's collation (a range over the prefix is
        # not one under a collation that ignores punctuation, as glibc's
        # en_US.UTF-8 does), and no index on batch_id, which a table this
        # large would need a rewrite to add.  The time bound, a value,
        # lets PostgreSQL leave out the monthly partitions older than the
        # batch (a day of slack for servers' clocks).
        p = self._p
        d = self._rows(
            "SELECT COUNT(u.id), COALESCE(SUM(u.prompt_tokens), 0),"
            " COALESCE(SUM(u.completion_tokens), 0),"
            " COALESCE(SUM(u.gpu_seconds), 0), COALESCE(SUM(u.cost), 0)"
            " FROM batch_lines l JOIN usage u"
            " ON u.request_id = l.batch_id || '-' || l.line_no"
            f" AND u.batch_id = l.batch_id WHERE l.batch_id = {p} AND u.time >= {p}",
            (batch_id, created_at - 86400),
        )

        def summed(rows: list[Any]) -> BatchUsage:
            ((requests, prompt, completion, seconds, cost),) = rows
            return BatchUsage(
                int(requests), int(prompt), int(completion), float(seconds), float(cost)
            )

        return d.addCallback(summed)

    def batch_line_totals(self) -> Deferred[dict[str, int]]:
        """
        @return: fires with the lines per state over the batches not over
            (L{active_batches}), every state present: for the metrics.
        """
        d = self._rows(
            "SELECT l.state, COUNT(*) FROM batch_lines l JOIN batches b"
            " ON b.id = l.batch_id WHERE b.status IN"
            f" ({marks(self._p, len(ACTIVE_STATUSES))}) GROUP BY l.state",
            ACTIVE_STATUSES,
        )
        return d.addCallback(_per_state)


def _per_state(rows: list[Any]) -> dict[str, int]:
    counts = dict.fromkeys(LINE_STATES, 0)
    counts.update({str(state): int(n) for state, n in rows})
    return counts


__all__ = ["BatchTables", "Transact"]
