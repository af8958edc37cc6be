"""
The admin listener (docs/catalog.md, docs/keys.md): metrics, liveness and the admin
API under C{/api/v1}, loopback-only by default; bound elsewhere, the API
wants an admin key.

Answers are JSON; errors C{{"error": {"message", "code"}}} with 400 (bad
body or parameter), 401 (admin key needed), 404, 409 (conflict; a drain
refused adds C{"models"}, those it would leave below C{min_replicas}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.web.resource import IResource

from llmgw.admin.batches import BatchRoutes
from llmgw.admin.drains import DrainRoutes
from llmgw.admin.http import AdminError, Composed
from llmgw.admin.keys import KeyRoutes
from llmgw.admin.models import ModelRoutes
from llmgw.admin.status import StatusRoutes
from llmgw.admin.swaps import SwapRoutes
from llmgw.admin.watch import WatchRoutes
from llmgw.admin.weights import WeightRoutes
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.router.accounting.api_key import ApiKey
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.telemetry.reports import Reports
from llmgw.store.db import Store
from llmgw.store.usage import UsageWriter
from llmgw.tier.watch import Watch

__all__ = ["Admin", "AdminError"]


class Admin:
    """
    The admin API: its route groups, each built with the collaborators it
    calls and each with its own Klein app, served as one resource
    (L{resource}); and the changes the dashboard offers
    (L{llmgw.web.pages.Actions}).  The API reads the control plane's views
    (L{llmgw.control.views}) and calls its methods; it changes no record
    itself.

    @param registry: the metrics served on C{/metrics}.
    @param inventory: the nodes.
    @param plane: the control plane, when there is one.
    @param keys: the API keys, when there is a store.
    @param store: the database.
    @param usage: the usage writer, flushed before usage is read.
    @param config_models: names of the config file's models (not
        removable at run time).
    @param wall_clock: POSIX seconds now (C{time.time}).
    @param watch: what a router tier follows, when there is a control
        plane.
    @param standby: with standbys (L{llmgw.server.standby}), whether this
        server leads and the leader's agent address (C{{"leading": bool,
        "leader": "HOST:PORT"}}); L{None} for a server alone.
    @param reports: where the routers of a tier report their traffic
        (C{POST /api/v1/report}), when there is a router here.
    @param adapter_refusals: the loads of an adapter its engines refused,
        from this server's router (shown on the adapter in
        C{GET /api/v1/models}).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        inventory: Inventory,
        plane: ControlPlane | None = None,
        keys: KeyRing | None = None,
        store: Store | None = None,
        usage: UsageWriter | None = None,
        config_models: frozenset[str] = frozenset(),
        *,
        wall_clock: Callable[[], float],
        watch: Watch | None = None,
        standby: Callable[[], dict[str, object]] | None = None,
        reports: Reports | None = None,
        adapter_refusals: Callable[[str], list[dict[str, Any]]] | None = None,
    ) -> None:
        status = StatusRoutes(
            registry,
            inventory,
            plane,
            keys,
            wall_clock=wall_clock,
            standby=standby,
        )
        self._models = ModelRoutes(
            plane,
            store,
            config_models,
            wall_clock=wall_clock,
            watch=watch,
            adapter_refusals=adapter_refusals,
        )
        weights = WeightRoutes(plane, inventory)
        self._keys = KeyRoutes(
            keys,
            store,
            usage,
            plane.catalog if plane is not None else None,
            wall_clock=wall_clock,
            watch=watch,
        )
        routers = WatchRoutes(plane, watch, standby=standby, reports=reports)
        self._drains = DrainRoutes(plane, inventory, store, wall_clock=wall_clock)
        swaps = SwapRoutes(plane, config_models)
        batches = BatchRoutes(store, keys, wall_clock=wall_clock)
        self._resource = Composed(
            [
                status.app,
                self._models.app,
                weights.app,
                self._keys.app,
                routers.app,
                self._drains.app,
                swaps.app,
                batches.app,
            ]
        )

    def resource(self) -> IResource:
        """
        @return: the resource that serves C{/api/v1}, C{/metrics} and
            C{/healthz}, each path seen whole.
        """
        return self._resource

    async def set_scale(self, name: str, low: int, high: int) -> str:
        """
        As L{ModelRoutes.set_scale}.
        """
        return await self._models.set_scale(name, low, high)

    async def revoke(self, name: str) -> ApiKey:
        """
        As L{KeyRoutes.revoke}.
        """
        return await self._keys.revoke(name)

    async def usage(
        self, by: str, since: float, until: float | None
    ) -> dict[str, Any] | None:
        """
        As L{KeyRoutes.usage}, for the dashboard: L{None} when there is no
        store, or it cannot be read now.
        """
        try:
            return await self._keys.usage(by, since, until)
        except AdminError:
            return None

    async def keep_drain(self, node_id: str, draining: bool) -> bool:
        """
        As L{DrainRoutes.keep_drain}.
        """
        return await self._drains.keep_drain(node_id, draining)
