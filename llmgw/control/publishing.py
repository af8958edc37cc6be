"""
Publishing (L{llmgw.control.plane}): the router's endpoint list, the
configured endpoints then each ready replica's leader, kept by replica and
worked out again only for the replicas a pass or an event named; beside
it, the catalog models with fewer published replicas than their
C{min_replicas} (the router's C{/readyz} lists them as unavailable),
worked out again for the models whose count changed; requests waiting
for a model are let go once it has a published replica, in the fleet's
order (L{ModelCatalog.release}).

A layer above the records (L{llmgw.control.ledger}): the replica actions
and the plane's pass tell it what changed; it calls nothing above it.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.control.inventory import Inventory
from llmgw.control.ledger import Ledger
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.control.runtime import ModelCatalog
from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.wire.engines import MESSAGES_ENGINES


def host(address: str) -> str:
    """
    @return: C{address} as the host part of a URL (an IPv6 one bracketed).
    """
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class Publisher:
    """
    Publishes the router's endpoint list and the models short of their
    C{min_replicas}.

    @param inventory: the nodes (an endpoint's address).
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param engine_key: a shard id's engine secret (the endpoint's
        C{api_key}), C{""} for none.
    @param publish: called with the router's new endpoint list when it
        changes.
    @param publish_shortfalls: called with the catalog models below their
        C{min_replicas} (L{Shortfall}s, by name) when they change.
    """

    def __init__(
        self,
        inventory: Inventory,
        catalog: ModelCatalog,
        ledger: Ledger,
        engine_key: Callable[[str], str],
        publish: Callable[[list[Endpoint]], None],
        publish_shortfalls: Callable[[tuple[Shortfall, ...]], None],
    ) -> None:
        self._inventory = inventory
        self._catalog = catalog
        self._ledger = ledger
        self._engine_key = engine_key
        self._publish = publish
        self._publish_shortfalls = publish_shortfalls
        self._published: tuple[Endpoint, ...] | None = None
        # Published replicas' endpoints and models, by replica id.
        self._endpoints: dict[str, tuple[Endpoint, str]] = {}
        self._ready_count: dict[str, int] = {}
        # Replicas whose endpoint is to be worked out again; all of them
        # when None.
        self._unpublished: set[str] | None = None
        # Models below their min_replicas; the models to look at again
        # (all of them when None), and the list last published.
        self._short: dict[str, Shortfall] = {}
        self._short_stale: set[str] | None = None
        self._shortfalls: tuple[Shortfall, ...] | None = None

    def adapters_changed(self, base: str) -> None:
        """
        An adapter of C{base} was added or removed: its replicas' endpoints
        (which list its adapters) are worked out again.
        """
        for replica in self._ledger.of_model(base):
            self.republish(replica.id)

    def bounds_changed(self, model: str) -> None:
        """
        C{model}'s C{min_replicas} changed: the next publishing looks at it.
        """
        if self._short_stale is not None:
            self._short_stale.add(model)

    def republish(self, replica_id: str) -> None:
        """
        The replica C{replica_id} changed (or went): the next publishing
        looks at it.
        """
        if self._unpublished is not None:
            self._unpublished.add(replica_id)

    def republish_all(self) -> None:
        """
        The next publishing works every replica's endpoint out again.
        """
        self._unpublished = None

    def _endpoint(self, replica: ReplicaRecord | None) -> tuple[Endpoint, str] | None:
        if replica is None or replica.state != ReplicaState.READY:
            return None
        leader = replica.leader
        node = self._inventory.get(leader.node) if leader is not None else None
        state = self._catalog.get(replica.model)
        if leader is None or node is None or state is None:
            return None
        adapters = self._catalog.adapters_of(replica.model)
        endpoint = Endpoint(
            replica.id,
            f"http://{host(node.address)}:{leader.port}",
            (*state.model.names, *(n for a in adapters for n in a.names)),
            api_key=self._engine_key(leader.id),
            messages=replica.profile.engine in MESSAGES_ENGINES,
            adapters=tuple((a.name, a.adapter or "") for a in adapters),
            max_loras=state.model.max_loras,
        )
        return endpoint, replica.model

    def publish_ready(self) -> None:
        """
        Publish the endpoints of the replicas that changed, when the list
        changed; publish the models short of their C{min_replicas}; let go
        the requests waiting for a model that has a published replica now.
        """
        replicas = self._ledger.replicas
        changed = self._published is None or self._unpublished is None
        if self._unpublished is None:
            self._endpoints = {}
            self._ready_count = {}
            self._short_stale = None
            look: set[str] = set(replicas)
        else:
            look = self._unpublished
        self._unpublished = set()
        for replica_id in look:
            new = self._endpoint(replicas.get(replica_id))
            old = self._endpoints.get(replica_id)
            if new == old:
                continue
            changed = True
            if old is not None:
                self._ready_count[old[1]] -= 1
                self.bounds_changed(old[1])
            if new is None:
                del self._endpoints[replica_id]
            else:
                self._endpoints[replica_id] = new
                self._ready_count[new[1]] = self._ready_count.get(new[1], 0) + 1
                self.bounds_changed(new[1])
        catalog = self._catalog
        if changed:
            ordered = sorted(self._endpoints, key=self._ledger.order)
            published = (
                *catalog.static_endpoints(),
                *(self._endpoints[r][0] for r in ordered),
            )
            if published != self._published:
                self._published = published
                self._publish(list(published))
        self._publish_short()
        for name in list(catalog.waiting):
            state = catalog.get(name)
            if state is None or not state.waiters:
                catalog.waiting.discard(name)
                continue
            if not self._ready_count.get(name):
                continue
            catalog.waiting.discard(name)
            # Their requests go on now: the next pass reads their load.
            catalog.touched(name)
            catalog.release(name)

    def _publish_short(self) -> None:
        """
        Work out again the models below their C{min_replicas} that may
        have changed, and publish the list when it did.
        """
        stale, self._short_stale = self._short_stale, set()
        if stale is None:
            self._short = {}
            stale = {s.model.name for s in self._catalog.states()}
        for name in stale:
            state = self._catalog.get(name)
            ready = self._ready_count.get(name, 0)
            if state is not None and ready < state.model.min_replicas:
                self._short[name] = Shortfall(name, ready, state.model.min_replicas)
            else:
                self._short.pop(name, None)
        shortfalls = tuple(self._short[name] for name in sorted(self._short))
        if shortfalls != self._shortfalls:
            self._shortfalls = shortfalls
            self._publish_shortfalls(shortfalls)
