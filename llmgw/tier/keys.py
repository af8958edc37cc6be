"""
API keys made, changed or revoked on the control plane, brought into a
router's key ring from the shared store when the watch's keys counter
moves.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmgw.router.accounting.auth import KeyRing
from llmgw.store.base import Store

log = Logger(namespace="llmgw.tier.keys")


def merge_keys(keys: KeyRing, rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """
    Add the keys C{keys} lacks, give known ones the models, limits and
    expiry the store has for them, and mark revoked those the store has
    revoked, keeping every known key's counters (rate windows, tokens).

    @param rows: every key as L{Store.prepare} reads them.
    @return: how many keys were added, changed and revoked.
    """
    known = {key.id: key for key in keys.keys()}
    new = [row for row in rows if row["id"] not in known]
    keys.load(new)
    changed = revoked = 0
    for row in rows:
        key = known.get(row["id"])
        if key is None:
            continue
        changed += keys.take_limits(key, row)
        if key.revoked is None and row.get("revoked") is not None:
            key.revoked = row["revoked"]
            revoked += 1
    return len(new), changed, revoked


class KeyFollower:
    """
    Reads the keys again on each move of the watch's counter (and once on
    the first state: a key made between the router's start and its watch
    is not missed); one read at a time, another after it when the counter
    moved meanwhile.
    """

    def __init__(self, keys: KeyRing, store: Store) -> None:
        self.keys = keys
        self.store = store
        self._seen: int | None = None
        self._reading: Deferred[Any] | None = None
        self._again = False

    def saw(self, counter: int) -> None:
        if counter == self._seen:
            return
        self._seen = counter
        if self._reading is not None:
            self._again = True
            return
        self._read()

    def _read(self) -> None:
        # The store's own read of the keys (the one prepare uses), off the
        # reactor thread.
        reading = self._reading = self.store.keys()

        def read(rows: list[dict[str, Any]]) -> None:
            added, changed, revoked = merge_keys(self.keys, rows)
            if added or changed or revoked:
                log.info(
                    "keys from the store: {added} added, {changed} changed,"
                    " {revoked} revoked",
                    added=added,
                    changed=changed,
                    revoked=revoked,
                )

        def failed(failure: Any) -> None:
            log.warn("cannot read the keys: {error}", error=failure.getErrorMessage())

        def done(_: object) -> None:
            self._reading = None
            if self._again:
                self._again = False
                self._read()

        reading.addCallbacks(read, failed).addBoth(done)
