"""
Usage accounting: the store's writer (batches, key counts, retries, the
final flush) on a L{Clock} with a store whose writes the test fires, and
the server's adapter from the router's records to the store's rows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import Logger, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from llmgw.accounts.usage import StoreUsageSink, usage_row
from llmgw.router.interfaces import RequestRecord
from llmgw.store.db import UsageRow
from llmgw.store.usage import UsageWriter
from tests.typing_support import collect


class _Store:
    """
    Records each C{add_usage} call; its Deferred fires when the test says.
    """

    database_errors = (sqlite3.Error,)

    def __init__(self) -> None:
        self.calls: list[
            tuple[list[tuple[float, UsageRow]], dict[int, tuple[int, float]]]
        ] = []
        self.writes: list[Deferred[None]] = []

    def add_usage(
        self,
        rows: Sequence[tuple[float, UsageRow]],
        key_use: dict[int, tuple[int, float]],
    ) -> Deferred[None]:
        self.calls.append((list(rows), dict(key_use)))
        d: Deferred[None] = Deferred()
        self.writes.append(d)
        return d


def _row(request_id: str, key_id: int | None = 7, tokens: int = 10) -> UsageRow:
    return UsageRow(
        request_id=request_id,
        key_id=key_id,
        key_name=None if key_id is None else f"key-{key_id}",
        model="m",
        replica="r-1",
        status=200,
        stream=False,
        prompt_tokens=tokens,
        completion_tokens=1,
        latency=0.5,
        time_to_first_token=0.1,
    )


class UsageWriterTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.now = 1000.0
        self.store = _Store()

    def writer(self, **options: Any) -> UsageWriter:
        writer = UsageWriter(
            self.store,  # type: ignore[arg-type]
            self.clock,
            interval=1.0,
            batch_size=3,
            wall_clock=lambda: self.now,
            **options,
        )
        writer.startService()
        return writer

    def test_batches_on_timer_and_when_full(self) -> None:
        """
        Rows wait for the interval, or go at once when a batch fills; each
        key's tokens are summed with its last use.
        """
        writer = self.writer()
        writer.add(_row("a"))
        self.now += 5
        writer.add(_row("b", tokens=20))
        self.assertEqual(self.store.calls, [])
        self.clock.advance(1)
        ((rows, key_use),) = self.store.calls
        self.assertEqual(
            [(when, r.request_id) for when, r in rows], [(1000, "a"), (1005, "b")]
        )
        self.assertEqual(key_use, {7: (32, 1005.0)})
        self.store.writes[0].callback(None)
        self.assertEqual(writer.written, 2)
        for name in ("c", "d", "e"):
            writer.add(_row(name, key_id=None))
        self.assertEqual(len(self.store.calls), 2)
        self.assertEqual(self.store.calls[1][1], {})
        self.store.writes[1].callback(None)
        self.successResultOf(writer.stopService())
        self.assertEqual(writer.written, 5)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_failed_write_kept_for_the_next(self) -> None:
        """
        A failed write is logged and its rows and key counts go back in
        front of those that came meanwhile.
        """
        writer = self.writer()
        writer.add(_row("a"))
        writer.flush()
        writer.add(_row("b"))
        self.store.writes[0].errback(OSError("disk full"))
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        writer.flush()
        rows, key_use = self.store.calls[1]
        self.assertEqual([r.request_id for _, r in rows], ["a", "b"])
        self.assertEqual(key_use, {7: (22, 1000.0)})
        self.store.writes[1].callback(None)
        self.successResultOf(writer.stopService())
        self.assertEqual(writer.written, 2)

    def test_stop_tries_three_times(self) -> None:
        """
        On stop, what is buffered is written: after the write in flight,
        up to three tries, and the stop ends even when all three fail.
        """
        writer = self.writer()
        writer.add(_row("a"))
        writer.flush()
        writer.add(_row("b"))
        stopped = writer.stopService()
        self.store.writes[0].callback(None)
        self.assertNoResult(stopped)
        for attempt in (1, 2, 3):
            self.assertEqual(len(self.store.calls), attempt + 1)
            self.assertEqual(
                [r.request_id for _, r in self.store.calls[attempt][0]], ["b"]
            )
            self.store.writes[attempt].errback(OSError("disk full"))
        self.successResultOf(stopped)
        self.assertEqual(len(self.store.calls), 4)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 3)
        self.assertEqual(writer.written, 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_locked_store_one_warning_per_episode(self) -> None:
        """
        Writes refused by the database (locked) are one warning naming the
        records pending, no traceback, however many tries fail; one line
        when a write goes through again; a new episode warns again.
        L{UsageWriter.flush_within} answers C{False} after its time while
        the write waits, C{True} once written.
        """
        events: list[dict[str, Any]] = []
        writer = UsageWriter(
            self.store,  # type: ignore[arg-type]
            self.clock,
            interval=1.0,
            wall_clock=lambda: self.now,
        )
        writer.startService()
        writer.log = Logger(observer=collect(events))
        writer.add(_row("a"))
        waited = writer.flush_within(0.5)
        self.assertEqual(writer.pending, 1)
        self.clock.advance(0.5)
        self.assertIs(self.successResultOf(waited), False)
        for attempt in range(3):
            self.store.writes[attempt].errback(
                sqlite3.OperationalError("database is locked")
            )
            writer.add(_row(f"b{attempt}"))
            self.clock.advance(1)
        self.assertEqual(self.flushLoggedErrors(), [])
        texts = [formatEvent(e) for e in events]
        self.assertEqual(
            texts,
            [
                "usage: cannot write to the store (database is locked); keeping"
                " 1 records and retrying every 1.0s"
            ],
        )
        self.assertEqual(writer.pending, 4)
        waited = writer.flush_within(0.5)
        self.store.writes[3].callback(None)
        self.assertTrue(self.successResultOf(waited))
        self.assertEqual(writer.pending, 0)
        self.assertIn("the store is writable again after 3.0s", formatEvent(events[1]))
        writer.add(_row("c"))
        self.clock.advance(1)
        self.store.writes[4].errback(sqlite3.OperationalError("database is locked"))
        self.assertEqual(len(events), 3)
        self.clock.advance(1)
        self.store.writes[5].callback(None)
        self.successResultOf(writer.stopService())
        self.assertEqual(writer.written, 5)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_without_rows_only_key_counts(self) -> None:
        """
        With C{record_usage = false}, no row is kept, but each key's
        tokens still are (budgets hold across restarts).
        """
        writer = self.writer(record_rows=False)
        for name in ("a", "b", "c", "d"):
            writer.add(_row(name))
        writer.add(_row("e", key_id=None))
        self.assertEqual(self.store.calls, [])
        self.clock.advance(1)
        self.assertEqual(self.store.calls, [([], {7: (44, 1000.0)})])
        self.store.writes[0].callback(None)
        self.successResultOf(writer.stopService())


def _record(**fields: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "request_id": "req-1",
        "upstream_request_id": "up-1",
        "model": "m",
        "replica": "r-1",
        "status": 200,
        "stream": True,
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "latency": 1.5,
        "time_to_first_token": 0.25,
        "key_id": 4,
        "key_name": "app",
        "usage_estimated": True,
        "reserved_tokens": 100,
        "client_request_id": "agent-7",
    }
    values.update(fields)
    return RequestRecord(**values)


class _Writer:
    def __init__(self, record_rows: bool = True) -> None:
        self.rows: list[UsageRow] = []
        self.record_rows = record_rows

    def add(self, row: UsageRow) -> None:
        self.rows.append(row)


class StoreUsageSinkTests(SynchronousTestCase):
    def test_row_from_record(self) -> None:
        """
        Every column of the store's row comes from the record; the
        estimate flag from C{usage_estimated}; the client's id beside
        llmgw's own.
        """
        self.assertEqual(
            usage_row(_record()),
            UsageRow(
                request_id="req-1",
                key_id=4,
                key_name="app",
                model="m",
                replica="r-1",
                status=200,
                stream=True,
                prompt_tokens=12,
                completion_tokens=3,
                latency=1.5,
                time_to_first_token=0.25,
                estimated=True,
                client_request_id="agent-7",
            ),
        )

    def test_row_keeps_batch(self) -> None:
        """
        A batch line's record gives its row the batch's id.
        """
        record = replace(_record(), request_id="batch_1-3", batch_id="batch_1")
        row = usage_row(record)
        self.assertEqual((row.request_id, row.batch_id), ("batch_1-3", "batch_1"))

    def test_unauthenticated_not_stored(self) -> None:
        """
        A 401 without a key is not stored (anyone could fill the store);
        other key-less requests and a key's 401 are.
        """
        writer = _Writer()
        sink = StoreUsageSink(writer)  # type: ignore[arg-type]
        sink.record(_record(key_id=None, key_name=None, status=401))
        sink.record(_record(request_id="b", key_id=None, key_name=None))
        sink.record(_record(request_id="c", status=401))
        self.assertEqual([r.request_id for r in writer.rows], ["b", "c"])

    def test_no_row_built_for_nothing(self) -> None:
        """
        With C{record_usage = false}, a request without a key has nothing
        to be written or counted: no row is made (a row per request is a
        cost on the router's hot path); a key's request still reaches the
        writer for its token count.
        """
        writer = _Writer(record_rows=False)
        sink = StoreUsageSink(writer)  # type: ignore[arg-type]
        sink.record(_record(request_id="a", key_id=None, key_name=None))
        sink.record(_record(request_id="b"))
        self.assertEqual([r.request_id for r in writer.rows], ["b"])
