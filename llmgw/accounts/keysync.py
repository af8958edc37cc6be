"""
Keys shared by every process on one PostgreSQL database: a key made,
changed or revoked by any of them reaches the others' key rings through the store's
C{LISTEN}/C{NOTIFY} channel (L{llmgw.store.pg.KeyEvents}), within the
time a notification takes (milliseconds on one network), and what was
missed while the listener was disconnected is read again when it
reconnects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from twisted.application.service import IService, Service
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.accounts.settings import AuthConfig, LimitsConfig
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.accounting.limits import RedisLimits
from llmgw.store.base import Store

log = Logger()


class LimitsService(Service):
    """
    Lets the shared limits' Redis connections and threads go on stop.
    """

    def __init__(self, limits: RedisLimits) -> None:
        self._limits = limits

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._limits.start()

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        self._limits.stop()


def key_ring(
    store: Store,
    limits_table: LimitsConfig,
    auth: AuthConfig,
    reactor: IReactorFromThreads,
    resolve: Callable[[str], str | None] = lambda name: None,
) -> tuple[KeyRing, list[IService]]:
    """
    The server's key ring on C{store}, with C{[limits]} (C{limits_table})
    and C{[auth] require_api_key} (C{auth}).

    @param resolve: the catalog's model for a name or alias, or L{None}.

    @return: the ring (its keys not loaded yet), and the services to stop
        before the store closes: the listener of key changes (PostgreSQL)
        and the shared limits' connections (Redis).
    """
    url = limits_table.url
    limits = RedisLimits(url, reactor) if url else None
    keys = KeyRing(
        store,
        clock=time.monotonic,
        wall_clock=time.time,
        required=auth.require_api_key,
        limits=limits,
        share=limits_table.routers,
        resolve=resolve,
    )
    services: list[IService] = []
    events = key_events(store, keys, reactor)
    if events is not None:
        services.append(events)
    if limits is not None:
        services.append(LimitsService(limits))
    return keys, services


def key_events(
    store: Store, keys: KeyRing, reactor: IReactorFromThreads
) -> IService | None:
    """
    @return: the service that keeps C{keys} current with the shared
        store, or L{None} for a store of one process (SQLite).
    """
    from llmgw.store.pg import KeyEvents, PostgresStore

    if not isinstance(store, PostgresStore):
        return None
    pg = store

    def failed(reason: Failure, what: str) -> None:
        if reason.check(*pg.database_errors):
            # The database away or refusing: one line, no traceback (the
            # outage itself is reported by the key events' listener).
            message = reason.getErrorMessage()
            log.warn(
                "keys: cannot read {what} from the store: {error}",
                what=what,
                error=message.splitlines()[0] if message else "database error",
            )
            return
        log.failure("keys: cannot read {what} from the store", reason, what=what)

    def on_event(event: dict[str, Any]) -> None:
        if "revoked" in event:
            if keys.revoked_elsewhere(int(event["revoked"]), float(event["when"])):
                log.info("keys: key {id} revoked elsewhere", id=event["revoked"])
        elif "added" in event or "updated" in event:
            # A change is read whole: the row as the store has it now.
            key_id = int(event["added"] if "added" in event else event["updated"])
            d = pg.key(key_id)
            d.addCallback(learn_one)
            d.addErrback(failed, f"key {key_id}")

    def learn_all(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            keys.learn(row)

    def learn_one(row: dict[str, Any] | None) -> None:
        if row is not None:
            keys.learn(row)

    def on_listening() -> None:
        d = pg.keys()
        d.addCallback(learn_all)
        d.addErrback(failed, "the keys")

    return KeyEvents(pg.url, reactor, on_event, on_listening)
