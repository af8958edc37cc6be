"""
Publishing (L{llmgw.control.plane}): the router's endpoint list, the
configured endpoints then each ready replica's leader, kept by replica and
worked out again only for the replicas a pass or an event named; beside
it, the catalog models with fewer published replicas than their
C{min_replicas} (the router's C{/readyz} lists them as unavailable),
worked out again for the models whose count changed; requests waiting
for a model are let go once it has a published replica.  Part of
L{llmgw.control.plane.ControlPlane}, kept apart by job.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.control.commands import ShardCommands
from llmgw.control.inventory import Inventory
from llmgw.control.records import ReplicaRecord, ReplicaState
from llmgw.control.runtime import ModelCatalog
from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.wire.engines import MESSAGES_ENGINES


def host(address: str) -> str:
    """
    @return: C{address} as the host part of a URL (an IPv6 one bracketed).
    """
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class Publishing:
    """
    The publishing half of L{llmgw.control.plane.ControlPlane}, which
    provides the attributes declared here and calls L{_init_publishing}.
    """

    inventory: Inventory
    catalog: ModelCatalog
    replicas: dict[str, ReplicaRecord]
    _commands: ShardCommands
    _publish: Callable[[list[Endpoint]], None]
    _publish_shortfalls: Callable[[tuple[Shortfall, ...]], None]
    _published: tuple[Endpoint, ...] | None
    # The order replicas were recorded in: the list's order.
    _seq: dict[str, int]

    def _init_publishing(self) -> None:
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
        self.catalog.adapters_changed = self._adapters_changed

    def _adapters_changed(self, base: str) -> None:
        """
        An adapter of C{base} was added or removed: its replicas' endpoints
        (which list its adapters) are worked out again.
        """
        for replica in self.replicas.values():
            if replica.model == base:
                self._republish(replica.id)

    def _bounds_changed(self, model: str) -> None:
        """
        C{model}'s C{min_replicas} changed: the next publishing looks at it.
        """
        if self._short_stale is not None:
            self._short_stale.add(model)

    def _republish(self, replica_id: str) -> None:
        """
        The replica C{replica_id} changed (or went): the next publishing
        looks at it.
        """
        if self._unpublished is not None:
            self._unpublished.add(replica_id)

    def _endpoint(self, replica: ReplicaRecord | None) -> tuple[Endpoint, str] | None:
        if replica is None or replica.state != ReplicaState.READY:
            return None
        leader = replica.leader
        node = self.inventory.get(leader.node) if leader is not None else None
        state = self.catalog.get(replica.model)
        if leader is None or node is None or state is None:
            return None
        adapters = self.catalog.adapters_of(replica.model)
        endpoint = Endpoint(
            replica.id,
            f"http://{host(node.address)}:{leader.port}",
            (*state.model.names, *(n for a in adapters for n in a.names)),
            api_key=self._commands.engine_key(leader.id),
            messages=replica.profile.engine in MESSAGES_ENGINES,
            adapters=tuple((a.name, a.adapter or "") for a in adapters),
            max_loras=state.model.max_loras,
        )
        return endpoint, replica.model

    def _publish_ready(self) -> None:
        changed = self._published is None or self._unpublished is None
        if self._unpublished is None:
            self._endpoints = {}
            self._ready_count = {}
            self._short_stale = None
            look = set(self.replicas)
        else:
            look = self._unpublished
        self._unpublished = set()
        for replica_id in look:
            new = self._endpoint(self.replicas.get(replica_id))
            old = self._endpoints.get(replica_id)
            if new == old:
                continue
            changed = True
            if old is not None:
                self._ready_count[old[1]] -= 1
                self._bounds_changed(old[1])
            if new is None:
                del self._endpoints[replica_id]
            else:
                self._endpoints[replica_id] = new
                self._ready_count[new[1]] = self._ready_count.get(new[1], 0) + 1
                self._bounds_changed(new[1])
        if changed:
            ordered = sorted(self._endpoints, key=self._seq.__getitem__)
            published = (
                *self.catalog.static_endpoints(),
                *(self._endpoints[r][0] for r in ordered),
            )
            if published != self._published:
                self._published = published
                self._publish(list(published))
        self._publish_short()
        for name in list(self.catalog.waiting):
            state = self.catalog.get(name)
            if state is None or not state.waiters:
                self.catalog.waiting.discard(name)
                continue
            if not self._ready_count.get(name):
                continue
            self.catalog.waiting.discard(name)
            # Their requests go on now: the next pass reads their load.
            self.catalog.touched(name)
            waiters, state.waiters = state.waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def _publish_short(self) -> None:
        """
        Work out again the models below their C{min_replicas} that may
        have changed, and publish the list when it did.
        """
        stale, self._short_stale = self._short_stale, set()
        if stale is None:
            self._short = {}
            stale = {s.model.name for s in self.catalog.states()}
        for name in stale:
            state = self.catalog.get(name)
            ready = self._ready_count.get(name, 0)
            if state is not None and ready < state.model.min_replicas:
                self._short[name] = Shortfall(name, ready, state.model.min_replicas)
            else:
                self._short.pop(name, None)
        shortfalls = tuple(self._short[name] for name in sorted(self._short))
        if shortfalls != self._shortfalls:
            self._shortfalls = shortfalls
            self._publish_shortfalls(shortfalls)
