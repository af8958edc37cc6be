"""
The server's admin API and dashboard as it builds them: the admin API's
route groups, the dashboard's pages (on the admin listener, and at
C{/admin} of the client listener behind a login), their history and the
batches' figures, and the client listener's site.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from twisted.web.resource import Resource
from twisted.web.server import Site

from llmgw.admin.api import Admin
from llmgw.batches.api import with_batches
from llmgw.batches.metrics import BatchCollector
from llmgw.batches.settings import BatchesConfig
from llmgw.batches.tally import BatchTally
from llmgw.reactors import IDaemonReactor
from llmgw.router.api.app import Router
from llmgw.router.api.batch_api import upload_paths
from llmgw.router.edge.site import make_site
from llmgw.router.telemetry.reports import Reports
from llmgw.server.build import Plane, State
from llmgw.tier.build import Accounts
from llmgw.web.batches import BatchesView
from llmgw.web.fleet import Fleet
from llmgw.web.history import FailureTap, History
from llmgw.web.login import LoginGate, Mount, Sessions, Split
from llmgw.web.pages import CookieCsrf, Dashboard
from llmgw.web.profiling import Profiling
from llmgw.web.traffic import Traffic


@dataclass(frozen=True)
class Pages:
    """
    What the server's two listeners serve beside the router.

    @ivar router_site: the client API, the dashboard at C{/admin} behind a
        login.
    @ivar admin_resource: the admin listener's API, metrics, profiling, the
        dashboard at every other path.
    """

    admin: Admin
    history: History
    batches: BatchTally
    router_site: Site
    admin_resource: Resource


def pages(
    reactor: IDaemonReactor,
    registry: CollectorRegistry,
    parts: Plane,
    account: Accounts,
    state: State,
    router: Router,
    traffic: Traffic,
    standby: Callable[[], dict[str, object]] | None,
    batches: BatchesConfig,
) -> Pages:
    """
    @param traffic: the dashboard's figures per model and replica, which
        C{router} counts each finished request into.
    @param standby: with standbys, whether this server leads and the
        leader, for the admin API's status.
    @param batches: C{[batches]}: the Files and Batches APIs served beside
        the router (L{with_batches}).
    @return: the admin API, the dashboards' history, the batches'
        figures (their metrics registered on C{registry}), the client
        listener's site (the router, the dashboard at C{/admin} behind a
        login) and the admin listener's resource.
    """
    keys = account.keys
    admin = _admin(registry, parts, account, state, router, traffic, standby)
    history = History(reactor, router.metrics, parts.plane, keys, wall_clock=time.time)
    failures = FailureTap(
        parts.plane, time.time, lambda: history.record_states(time.time())
    )
    # The tap is built on the plane, which sends through the hub: the hub
    # is told of it once it is.  No link is heard before the reactor runs.
    parts.hub.listen(failures)
    fleet = Fleet(
        parts.inventory,
        parts.plane,
        keys,
        history,
        failures,
        router.load,
        traffic,
        wall_clock=time.time,
        load_clock=reactor.seconds,
    )
    tally, batch_page = _batch_views(reactor, registry, state, history)
    sessions = Sessions(keys, time.monotonic)
    client_dashboard = Dashboard(
        fleet, admin, sessions, "/admin", logout=True, batches=batch_page
    )
    gate = LoginGate(client_dashboard.app.resource(), sessions, "/admin")
    client = with_batches(
        reactor, router, state.store, keys, parts.plane.catalog.resolve, batches
    )
    router_site = make_site(
        Mount(client, b"admin", gate),
        router.settings,
        reactor,
        router.cors,
        upload_paths(batches.max_file_size),
    )
    api = admin.resource()
    admin_resource = Split(
        {
            b"api": api,
            b"metrics": api,
            b"healthz": api,
            b"debug": Profiling(reactor).app.resource(),
        },
        Dashboard(fleet, admin, CookieCsrf(), batches=batch_page).app.resource(),
    )
    return Pages(admin, history, tally, router_site, admin_resource)


def _admin(
    registry: CollectorRegistry,
    parts: Plane,
    account: Accounts,
    state: State,
    router: Router,
    traffic: Traffic,
    standby: Callable[[], dict[str, object]] | None,
) -> Admin:
    """
    @return: the admin API, reporting on C{registry}.
    """
    return Admin(
        registry,
        parts.inventory,
        parts.plane,
        keys=account.keys,
        store=state.store,
        usage=account.usage,
        config_models=state.config_names,
        wall_clock=time.time,
        watch=parts.watch,
        standby=standby,
        # The routers of a tier (--router-workers too) count their traffic
        # into this server's metrics and figures.
        reports=Reports(router.metrics.reported, traffic),
        adapter_refusals=router.services.adapters.refusals,
    )


def _batch_views(
    reactor: IDaemonReactor,
    registry: CollectorRegistry,
    state: State,
    history: History,
) -> tuple[BatchTally, BatchesView]:
    """
    @return: the batches' figures read from the store (their metrics
        registered on C{registry}), and the dashboard's page of them.
    """
    tally = BatchTally(reactor, state.store, wall_clock=time.time)
    registry.register(BatchCollector(tally, time.time))
    return tally, BatchesView(tally, history, time.time)
