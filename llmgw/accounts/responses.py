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
from dataclasses import asdict

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.router.interfaces import KeptResponse
from llmgw.store.base import Store
from llmgw.store.responses import StoredResponse


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
        return self._store.put_response(StoredResponse(**asdict(kept)))

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
            return KeptResponse(**asdict(row))

        return self._store.get_response(response_id, key_id).addCallback(shape)

    def delete(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        """
        @return: fires with whether one of C{key_id}'s was deleted.
        """
        return self._store.delete_response(response_id, key_id)


class ResponseRetention(Service):
    """
    Deletes the stored responses past retention: a pass at start and one
    every C{interval} seconds (a pass still running when the next is due
    is not started twice); a failed pass is logged and tried again at the
    next.  On stop, waits for the pass in flight.

    @param retention: C{[store] responses_retention}, seconds.
    @param interval: seconds between passes.
    @param wall_clock: POSIX seconds now.
    @ivar dropped: responses deleted since start.
    """

    log = Logger()

    def __init__(
        self,
        store: Store,
        clock: IReactorTime,
        retention: float,
        interval: float = 3600.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._clock = clock
        self._retention = retention
        self._interval = interval
        self._wall_clock = wall_clock
        self._timer: LoopingCall | None = None
        self._pass: Deferred[None] | None = None
        self.dropped = 0

    def run_once(self) -> Deferred[None]:
        """
        One pass (or the one in flight).

        @return: fires when it is done; never fails (failures are logged).
        """
        if self._pass is not None:
            return self._pass
        cutoff = self._wall_clock() - self._retention

        def dropped(count: int) -> None:
            self.dropped += count
            if count:
                self.log.info(
                    "responses retention: deleted {count} stored responses"
                    " made before {cutoff}",
                    count=count,
                    cutoff=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(cutoff)),
                )

        def failed(reason: Failure) -> None:
            if reason.check(*self._store.database_errors):
                self.log.warn(
                    "responses retention: the store refused ({error}); trying"
                    " again in {interval}s",
                    error=reason.getErrorMessage(),
                    interval=self._interval,
                )
            else:
                self.log.failure("responses retention: a pass failed", reason)

        def finished(_: object) -> None:
            self._pass = None

        done = self._store.drop_responses(cutoff).addCallbacks(dropped, failed)
        self._pass = done
        done.addBoth(finished)
        return done

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._timer = LoopingCall(self.run_once)
        self._timer.clock = self._clock
        # LoopingCall waits for a Deferred it is given: never two passes.
        self._timer.start(self._interval, now=True)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.running:
            self._timer.stop()
        return Deferred.fromCoroutine(self._wait())

    async def _wait(self) -> None:
        if self._pass is not None:
            await self._pass
