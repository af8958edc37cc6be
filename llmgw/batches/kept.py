"""
The router's L{FileStore} and L{BatchStore} on the store
(L{llmgw.store.batch_tables}): the records of each side turned into the
other's, field for field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from twisted.internet.defer import Deferred

from llmgw.router.batch_interfaces import KeptBatch, KeptFile, KeptLine, KeptUsage
from llmgw.store.base import Store
from llmgw.store.batches import BatchLine, BatchRow, FileRow


def _fields(row: Any) -> dict[str, Any]:
    # Shallow, not dataclasses.asdict: the JSON fields are handed on as
    # they are, not copied.
    return {f.name: getattr(row, f.name) for f in fields(row)}


def _kept_file(row: FileRow | None) -> KeptFile | None:
    return None if row is None else KeptFile(**_fields(row))


def _kept_batch(row: BatchRow | None) -> KeptBatch | None:
    return None if row is None else KeptBatch(**_fields(row))


class StoreFiles:
    """
    A L{llmgw.router.batch_interfaces.FileStore} on the store's C{files}.

    @param store: SQLite or PostgreSQL.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    def add(self, kept: KeptFile, content: bytes) -> Deferred[None]:
        return self._store.add_file(FileRow(**_fields(kept)), content)

    def get(self, file_id: str, key_id: int | None) -> Deferred[KeptFile | None]:
        return self._store.get_file(file_id, key_id).addCallback(_kept_file)

    def content(self, file_id: str, key_id: int | None) -> Deferred[bytes | None]:
        return self._store.file_content(file_id, key_id)

    def page(
        self,
        key_id: int | None,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: str,
    ) -> Deferred[list[KeptFile]]:
        d = self._store.list_files(key_id, purpose, after, limit, order)
        return d.addCallback(lambda rows: [KeptFile(**_fields(r)) for r in rows])

    def delete(self, file_id: str, key_id: int | None) -> Deferred[bool]:
        return self._store.delete_file(file_id, key_id)


class StoreBatches:
    """
    A L{llmgw.router.batch_interfaces.BatchStore} on the store's
    C{batches} and C{batch_lines}.

    @param store: SQLite or PostgreSQL.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    def add(self, batch: KeptBatch, lines: Sequence[KeptLine]) -> Deferred[None]:
        return self._store.add_batch(
            BatchRow(**_fields(batch)), [BatchLine(**_fields(x)) for x in lines]
        )

    def get(self, batch_id: str, key_id: int | None) -> Deferred[KeptBatch | None]:
        return self._store.get_batch(batch_id, key_id).addCallback(_kept_batch)

    def page(
        self, key_id: int | None, after: str | None, limit: int, api: str
    ) -> Deferred[list[KeptBatch]]:
        d = self._store.list_batches(key_id, after, limit, api)
        return d.addCallback(lambda rows: [KeptBatch(**_fields(r)) for r in rows])

    def update(
        self, batch_id: str, changes: dict[str, Any], statuses: Sequence[str]
    ) -> Deferred[bool]:
        return self._store.update_batch(batch_id, changes, statuses)

    def cancel_lines(self, batch_id: str) -> Deferred[int]:
        return self._store.cancel_lines(batch_id)

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        return self._store.line_counts(batch_id)

    def lines(self, batch_id: str) -> Deferred[list[KeptLine]]:
        d = self._store.batch_lines(batch_id)
        return d.addCallback(lambda rows: [KeptLine(**_fields(r)) for r in rows])

    def usage(self, batch: KeptBatch) -> Deferred[KeptUsage]:
        d = self._store.batch_usage(batch.id, batch.created_at)
        return d.addCallback(lambda row: KeptUsage(**_fields(row)))

    def delete(self, batch_id: str, key_id: int | None) -> Deferred[bool]:
        return self._store.delete_batch(batch_id, key_id)


__all__ = ["StoreBatches", "StoreFiles"]
