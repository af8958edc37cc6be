"""
The store's files, batches and batch lines (L{llmgw.store.batch_tables}),
the same on both engines: each test runs on a SQLite file and on a real
PostgreSQL (L{tests.pg_support}), as L{tests.test_store_backends} does.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from twisted.internet.defer import gatherResults
from twisted.trial.unittest import TestCase

from llmgw.store.base import Store, UsageRow
from llmgw.store.batches import BatchLine, BatchRow, BatchUsage, FileRow
from tests import test_store_backends as backends
from tests.pg_support import fresh_database

if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object


def _file(
    fid: str, key_id: int | None, created: float, purpose: str = "batch"
) -> FileRow:
    return FileRow(fid, key_id, purpose, fid + ".jsonl", 3, created)


def _batch(
    bid: str, key_id: int | None, created: float, api: str = "openai"
) -> BatchRow:
    return BatchRow(
        id=bid,
        key_id=key_id,
        key_name=None if key_id is None else "k",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        completion_window="24h",
        status="in_progress",
        created_at=created,
        expires_at=created + 86400,
        metadata={"team": "eval"},
        api=api,
        total=3,
    )


def _lines(bid: str, count: int) -> list[BatchLine]:
    return [
        BatchLine(bid, n, f"c{n}", "m", "/v1/chat/completions", json.dumps({"n": n}))
        for n in range(1, count + 1)
    ]


class _BatchBehaviour(_Base):
    """
    The tests; a subclass gives the engine (L{make_store}, L{setUp}).
    """

    def make_store(self) -> Store:
        raise NotImplementedError

    def store(self) -> Store:
        store = self.make_store()
        self.addCleanup(store.close)
        store.prepare()
        return store

    async def test_files_per_key(self) -> None:
        """
        A file is read back with its bytes by the key that added it only;
        listing pages newest first (or oldest first), by purpose; a delete
        takes it away for its key only.
        """
        store = self.store()
        content = b'{"a": 1}\n\x00\xff'
        await store.add_file(_file("file-1", 7, 10.0), content)
        await store.add_file(_file("file-2", 7, 20.0), b"two")
        await store.add_file(_file("file-3", 7, 30.0, "batch_output"), b"out")
        await store.add_file(_file("file-4", None, 40.0), b"none")
        self.assertEqual(await store.get_file("file-1", 7), _file("file-1", 7, 10.0))
        self.assertEqual(await store.file_content("file-1", 7), content)
        self.assertIsNone(await store.get_file("file-1", 8))
        self.assertIsNone(await store.file_content("file-1", 8))
        self.assertIsNone(await store.get_file("file-1", None))
        self.assertEqual(await store.file_content("file-4", None), b"none")
        listed = await store.list_files(7)
        self.assertEqual([f.id for f in listed], ["file-3", "file-2", "file-1"])
        page = await store.list_files(7, after="file-3", limit=1)
        self.assertEqual([f.id for f in page], ["file-2"])
        oldest = await store.list_files(7, order="asc", after="file-1")
        self.assertEqual([f.id for f in oldest], ["file-2", "file-3"])
        batch = await store.list_files(7, purpose="batch")
        self.assertEqual([f.id for f in batch], ["file-2", "file-1"])
        self.assertFalse(await store.delete_file("file-1", 8))
        self.assertTrue(await store.delete_file("file-1", 7))
        self.assertFalse(await store.delete_file("file-1", 7))
        self.assertIsNone(await store.file_content("file-1", 7))

    async def test_batches_per_key(self) -> None:
        """
        A batch and its lines are kept together; it reads back whole for its
        key, JSON fields included; a list pages newest first, by API; an
        update changes only the fields named, and only from the statuses
        given; the active ones are every key's not over.
        """
        store = self.store()
        await store.add_batch(_batch("batch_1", 7, 10.0), _lines("batch_1", 3))
        await store.add_batch(_batch("batch_2", 7, 20.0, "anthropic"), [])
        await store.add_batch(_batch("batch_3", 8, 30.0), [])
        self.assertEqual(
            await store.get_batch("batch_1", 7), _batch("batch_1", 7, 10.0)
        )
        self.assertIsNone(await store.get_batch("batch_1", 8))
        listed = await store.list_batches(7)
        self.assertEqual([b.id for b in listed], ["batch_2", "batch_1"])
        self.assertEqual(
            [b.id for b in await store.list_batches(7, after="batch_2")], ["batch_1"]
        )
        self.assertEqual(
            [b.id for b in await store.list_batches(7, api="openai")], ["batch_1"]
        )
        errors = [{"code": "invalid_request", "line": 2, "message": "x", "param": None}]
        changed = await store.update_batch(
            "batch_1", {"status": "cancelling", "cancelling_at": 11.0, "errors": errors}
        )
        self.assertTrue(changed)
        row = await store.get_batch("batch_1", 7)
        assert row is not None
        self.assertEqual(
            (row.status, row.cancelling_at, row.errors), ("cancelling", 11.0, errors)
        )
        self.assertFalse(
            await store.update_batch(
                "batch_1", {"status": "completed"}, ["in_progress"]
            )
        )
        await store.update_batch("batch_3", {"status": "completed"})
        active = await store.active_batches()
        self.assertEqual([b.id for b in active], ["batch_1", "batch_2"])
        with self.assertRaises(ValueError):
            await store.update_batch("batch_1", {"id": "other"})
        self.assertTrue(await store.delete_batch("batch_1", 7))
        self.assertEqual(await store.batch_lines("batch_1"), [])
        self.assertFalse(await store.delete_batch("batch_3", 7))

    async def test_line_life(self) -> None:
        """
        Lines are claimed lowest first, each once; a finish takes only a line
        still running under its owner; a release and a requeue put lines
        back to pending; a cancel ends the pending ones; the counts follow.
        """
        store = self.store()
        await store.add_batch(_batch("batch_1", 7, 10.0), _lines("batch_1", 5))
        first = await store.claim_lines("batch_1", "a", 2)
        self.assertEqual(
            [(x.line_no, x.state, x.owner, x.attempts) for x in first],
            [(1, "running", "a", 1), (2, "running", "a", 1)],
        )
        self.assertEqual(
            [x.line_no for x in await store.claim_lines("batch_1", "b", 1)], [3]
        )
        self.assertTrue(
            await store.finish_line("batch_1", 1, "a", "done", 200, "{}", 50.0)
        )
        self.assertFalse(await store.finish_line("batch_1", 1, "a", "done", 200, "{}"))
        self.assertFalse(await store.finish_line("batch_1", 3, "a", "done", 200, "{}"))
        self.assertTrue(await store.release_line("batch_1", 2, "a"))
        self.assertFalse(await store.release_line("batch_1", 3, "a"))
        self.assertEqual(await store.requeue_lines("a"), 1)  # b's line 3
        again = await store.claim_lines("batch_1", "a", 10)
        self.assertEqual(
            [(x.line_no, x.attempts) for x in again], [(2, 2), (3, 2), (4, 1), (5, 1)]
        )
        self.assertFalse(
            await store.finish_line("batch_1", 3, "b", "failed", 400, "{}")
        )
        self.assertTrue(
            await store.finish_line("batch_1", 3, "a", "failed", 400, '{"e":1}')
        )
        await store.release_line("batch_1", 5, "a")
        self.assertEqual(await store.cancel_lines("batch_1"), 1)
        counts = await store.line_counts("batch_1")
        self.assertEqual(
            counts,
            {
                "pending": 0,
                "running": 2,
                "done": 1,
                "failed": 1,
                "cancelled": 1,
                "expired": 0,
            },
        )
        self.assertEqual(await store.batch_line_totals(), counts)
        await store.update_batch("batch_1", {"status": "cancelled"})
        self.assertEqual(sum((await store.batch_line_totals()).values()), 0)
        lines = await store.batch_lines("batch_1")
        self.assertEqual(
            [x.state for x in lines],
            ["done", "running", "failed", "running", "cancelled"],
        )
        self.assertEqual(
            (lines[0].status_code, lines[0].result, lines[0].finished_at),
            (200, "{}", 50.0),
        )
        with self.assertRaises(ValueError):
            await store.finish_line("batch_1", 2, "a", "pending", None, None)

    async def test_batch_usage(self) -> None:
        """
        A batch's usage is the sum of its lines' usage rows: not another
        batch's (one whose id begins with this one's included), nor a
        client's request; a batch with none used nothing.
        """
        await batch_usage_summed(self, self.store())

    async def test_two_claimers_never_share_a_line(self) -> None:
        """
        Two stores on one database (two servers), claiming at once in many
        small claims: every line is taken exactly once.
        """
        one, two = self.store(), self.store()
        await one.add_batch(_batch("batch_1", None, 10.0), _lines("batch_1", 200))
        claims = [
            store.claim_lines("batch_1", name, 7)
            for _ in range(20)
            for store, name in ((one, "one"), (two, "two"))
        ]
        taken = [line.line_no for got in await gatherResults(claims) for line in got]
        self.assertEqual(sorted(taken), list(range(1, 201)))
        self.assertEqual((await one.line_counts("batch_1"))["running"], 200)


async def batch_usage_summed(case: TestCase, store: Store) -> None:
    """
    The check of L{_BatchBehaviour.test_batch_usage} on C{store}.
    """

    def row(request_id: str, batch_id: str | None, tokens: int) -> UsageRow:
        return UsageRow(
            request_id=request_id,
            key_id=None,
            key_name=None,
            model="m",
            replica="r",
            status=200,
            stream=False,
            prompt_tokens=tokens,
            completion_tokens=2 * tokens,
            latency=0.1,
            time_to_first_token=0.05,
            batch_id=batch_id,
            gpu_seconds=tokens / 4,
            cost=tokens / 8,
        )

    await store.add_batch(_batch("batch_1", None, 10.0), _lines("batch_1", 12))
    await store.add_batch(_batch("batch_10", None, 10.0), _lines("batch_10", 1))
    await store.add_batch(_batch("batch_3", None, 10.0), _lines("batch_3", 1))
    await store.add_usage(
        [
            (100.0, row("batch_1-1", "batch_1", 4)),
            (101.0, row("batch_1-2", "batch_1", 8)),
            (102.0, row("batch_1-10", "batch_1", 16)),
            (103.0, row("batch_10-1", "batch_10", 32)),
            (104.0, row("batch_1-11", None, 64)),
            (105.0, row("batch_2-1", "batch_2", 128)),
        ],
        {},
    )
    case.assertEqual(
        await store.batch_usage("batch_1", 10.0), BatchUsage(3, 28, 56, 7.0, 3.5)
    )
    case.assertEqual(
        await store.batch_usage("batch_10", 10.0), BatchUsage(1, 32, 64, 8.0, 4.0)
    )
    case.assertEqual(await store.batch_usage("batch_3", 10.0), BatchUsage())
    case.assertEqual(await store.batch_usage("batch_9", 10.0), BatchUsage())


class SQLiteBatchStoreTests(_BatchBehaviour, TestCase):
    setUp = backends.SQLiteStoreTests.setUp
    make_store = backends.SQLiteStoreTests.make_store


class PostgresBatchStoreTests(_BatchBehaviour, TestCase):
    setUp = backends.PostgresStoreTests.setUp
    make_store = backends.PostgresStoreTests.make_store

    async def test_batch_usage_any_collation(self) -> None:
        """
        The same sums on a database whose collation ignores punctuation
        (ICU's C{und-u-ka-shifted}; glibc's C{en_US.UTF-8}, the default
        of many clusters, does so too): C{batch_1-10} sorts there as
        C{batch110}, outside any range of ids beginning C{batch_1-}.
        """
        self.url = fresh_database(
            self,
            "--template=template0",
            "--locale-provider=icu",
            "--icu-locale=und-u-ka-shifted",
            "--locale=C",
        )
        await batch_usage_summed(self, self.store())
