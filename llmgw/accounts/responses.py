"""
The router's kept Responses API responses in the store: the
L{llmgw.router.interfaces.ResponseStore} the server wires between
L{llmgw.router.api.app.Router} and the store's C{responses} table.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from llmgw.router.interfaces import KeptResponse
from llmgw.store.base import Store
from llmgw.store.responses import StoredResponse


def _kept(row: StoredResponse | None) -> KeptResponse | None:
    if row is None:
        return None
    return KeptResponse(
        row.id,
        row.key_id,
        row.model,
        row.created_at,
        row.previous_response_id,
        row.input_items,
        row.output_items,
        row.response,
    )


class StoreResponses:
    """
    A L{llmgw.router.interfaces.ResponseStore} on the store.

    @param store: SQLite or PostgreSQL, its C{responses} table.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    def put(self, kept: KeptResponse) -> Deferred[None]:
        """
        Keep C{kept}; fires when written.
        """
        return self._store.put_response(
            StoredResponse(
                kept.id,
                kept.key_id,
                kept.model,
                kept.created_at,
                kept.previous_response_id,
                kept.input_items,
                kept.output_items,
                kept.response,
            )
        )

    def get(
        self, response_id: str, key_id: int | None
    ) -> Deferred[KeptResponse | None]:
        """
        @return: fires with the response, or L{None} when it is unknown,
            expired or another key's.
        """
        return self._store.get_response(response_id, key_id).addCallback(_kept)
