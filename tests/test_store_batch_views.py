"""
The operator's reads of batches (L{llmgw.store.batch_tables.BatchTables}'s
C{find_batch} and C{all_batches}, which the admin API serves): every key's
batches, the same on both engines, as L{tests.test_store_batches} runs
them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from twisted.trial.unittest import TestCase

from llmgw.store.base import Store
from tests import test_store_backends as backends
from tests.test_store_batches import _batch, _lines

if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object


class _OperatorViews(_Base):
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

    async def fill(self, store: Store) -> None:
        """
        Five batches: two of key 7, two of key 8 (one of them completed),
        one of a server without keys.
        """
        for bid, key_id, created in (
            ("batch_a", 7, 10.0),
            ("batch_b", 8, 20.0),
            ("batch_c", 7, 30.0),
            ("batch_d", None, 40.0),
            ("batch_e", 8, 50.0),
        ):
            await store.add_batch(_batch(bid, key_id, created), _lines(bid, 2))
        await store.update_batch("batch_b", {"status": "completed"})

    async def test_find_any_keys_batch(self) -> None:
        """
        C{find_batch} reads a batch whichever key made it (C{get_batch}
        answers only its own key); an unknown id is L{None}.
        """
        store = self.store()
        await self.fill(store)
        found = await store.find_batch("batch_b")
        assert found is not None
        self.assertEqual((found.key_id, found.status), (8, "completed"))
        self.assertIsNone(await store.get_batch("batch_b", 7))
        keyless = await store.find_batch("batch_d")
        assert keyless is not None
        self.assertIsNone(keyless.key_id)
        self.assertIsNone(await store.find_batch("batch_z"))

    async def test_all_batches_filtered_and_paged(self) -> None:
        """
        C{all_batches}: every key's, newest first; by status, by key, both;
        paged by C{after} and C{limit}.
        """
        store = self.store()
        await self.fill(store)

        async def ids(**kwargs: object) -> list[str]:
            return [b.id for b in await store.all_batches(**kwargs)]  # type: ignore[arg-type]

        self.assertEqual(
            await ids(), ["batch_e", "batch_d", "batch_c", "batch_b", "batch_a"]
        )
        self.assertEqual(await ids(status="completed"), ["batch_b"])
        self.assertEqual(await ids(key_id=8), ["batch_e", "batch_b"])
        self.assertEqual(await ids(key_id=8, status="in_progress"), ["batch_e"])
        self.assertEqual(await ids(limit=2), ["batch_e", "batch_d"])
        self.assertEqual(await ids(after="batch_d", limit=2), ["batch_c", "batch_b"])
        self.assertEqual(await ids(after="batch_b", key_id=7), ["batch_a"])
        self.assertEqual(await ids(status="cancelled"), [])
        # Same time, two batches: the id breaks the tie, in pages too.
        await store.add_batch(replace(_batch("batch_f", 7, 50.0)), _lines("batch_f", 1))
        self.assertEqual(await ids(limit=2), ["batch_f", "batch_e"])
        self.assertEqual(await ids(after="batch_f", limit=1), ["batch_e"])


class SQLiteOperatorViewTests(_OperatorViews, TestCase):
    setUp = backends.SQLiteStoreTests.setUp
    make_store = backends.SQLiteStoreTests.make_store


class PostgresOperatorViewTests(_OperatorViews, TestCase):
    setUp = backends.PostgresStoreTests.setUp
    make_store = backends.PostgresStoreTests.make_store
