"""
The Responses API's stored responses between the router and the store:
L{StoreResponses}, the router's L{llmgw.router.interfaces.ResponseStore} on
the store's C{responses} table, and L{ResponseRetention}, the server's job
deleting those past C{[store] responses_retention}.

A response is read only by the key that made it (the store names the key
in every lookup), and one past retention reads as unknown from the moment
it passes it, whether or not the job has deleted it yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmgw.accounts.retention import StorePasses
from llmgw.router.interfaces import KeptResponse
from llmgw.store.base import Store
from llmgw.store.responses import StoredResponse


def _shallow(row: KeptResponse | StoredResponse) -> dict[str, Any]:
    """
    @return: C{row}'s fields by name, their values as they are: not
        C{dataclasses.asdict}, which copies the items' JSON recursively
        and raised C{RecursionError} on a client's object nested 900 deep,
        losing the response.
    """
    return {f.name: getattr(row, f.name) for f in fields(row)}


class StoreResponses:
    """
    A L{llmgw.router.interfaces.ResponseStore} on the store.

    @param store: SQLite or PostgreSQL, its C{responses} table.
    @param retention: C{[store] responses_retention}, seconds: a response
        made longer ago reads as unknown.
    @param wall_clock: POSIX seconds now.
    """

    def __init__(
        self,
        store: Store,
        retention: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._retention = retention
        self._wall_clock = wall_clock

    def put(self, kept: KeptResponse) -> Deferred[None]:
        """
        Keep C{kept}; fires when written.
        """
        return self._store.put_response(StoredResponse(**_shallow(kept)))

    def get(
        self, response_id: str, key_id: int | None
    ) -> Deferred[KeptResponse | None]:
        """
        @return: fires with the response, or L{None} when it is unknown,
            past retention or another key's.
        """
        cutoff = self._wall_clock() - self._retention

        def shape(row: StoredResponse | None) -> KeptResponse | None:
            if row is None or row.created_at < cutoff:
                return None
            return KeptResponse(**_shallow(row))

        return self._store.get_response(response_id, key_id).addCallback(shape)

    def delete(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        """
        @return: fires with whether one of C{key_id}'s was deleted.
        """
        return self._store.delete_response(response_id, key_id)


class ResponseRetention(StorePasses):
    """
    Deletes the stored responses past retention, in L{StorePasses}.

    @param retention: C{[store] responses_retention}, seconds.
    @param interval: seconds between passes.
    @param wall_clock: POSIX seconds now.
    @ivar dropped: responses deleted since start.
    """

    def __init__(
        self,
        store: Store,
        clock: IReactorTime,
        retention: float,
        interval: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            "responses retention",
            clock,
            interval,
            store.database_errors,
            self._drop,
            self._dropped,
        )
        self._store = store
        self._retention = retention
        self._wall_clock = wall_clock
        self._cutoff = 0.0
        self.dropped = 0

    def _drop(self) -> Deferred[int]:
        self._cutoff = self._wall_clock() - self._retention
        return self._store.drop_responses(self._cutoff)

    def _dropped(self, count: int, seconds: float) -> None:
        self.dropped += count
        if count:
            self.log.info(
                "responses retention: deleted {count} stored responses"
                " made before {cutoff}",
                count=count,
                cutoff=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self._cutoff)),
            )
