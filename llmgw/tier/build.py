"""
The client API as every daemon serving it builds it: the server
(C{llmgw.server.tap}, the router in its own process) and each router of
the tier (L{llmgw.tier.tap}).  Both build it in the same two steps, their
own control side between them:

  1. L{client_api}: the engines' side (the metrics, the engine client, the
     engine load, the balancer that counts into and reads them) and the
     tracing, which the control side publishes to and traces with;
  2. L{serve}: once the control side's L{Activator} exists (the control
     plane's catalog, or a router's L{llmgw.tier.activate.RemoteActivator}),
     the keys and usage, resolving aliases by it, and the router over all
     of them.

Each step takes what it needs and returns what it built: nothing is
assigned to an object after it is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService

from llmgw.accounts.keysync import key_ring
from llmgw.accounts.responses import StoreResponses
from llmgw.accounts.settings import AuthConfig, LimitsConfig
from llmgw.accounts.usage import StoreUsageSink
from llmgw.config import ServerConfig
from llmgw.daemon.fdlimit import raise_open_file_limit
from llmgw.reactors import IDaemonReactor
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.accounting.usage_log import LogUsageSink, UsageSinks
from llmgw.router.api.app import Router
from llmgw.router.interfaces import Activator, Readiness, UsageSink
from llmgw.router.routing.adapters import AdapterLoads
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.load import LoadBoard, LoadCollector, make_scraper
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import MetricsRegistry, RouterMetrics
from llmgw.router.telemetry.tracing import TracingService, tracing_service
from llmgw.router.upstream.engine_client import EngineClient
from llmgw.store.base import Store
from llmgw.store.usage import UsageWriter


@dataclass(frozen=True)
class ClientAPI:
    """
    The engines' side of the client API, and its tracing.

    @ivar settings: C{[router]}.
    @ivar registry: the metrics registry, the engine load's collector and
        the router's metrics in it.
    @ivar metrics: the router's traffic metrics.
    @ivar pool: the client forwarding requests to replicas.
    @ivar load: engine load, polled on connections of its own so that polls
        never wait on traffic.
    @ivar balancer: the replicas and the choice among them, counting into
        C{metrics}, reading C{load} when it is polled.
    @ivar tracing: the service exporting spans, or L{None} when
        C{[tracing]} is off.
    """

    settings: RouterConfig
    registry: CollectorRegistry
    metrics: RouterMetrics
    pool: EngineClient
    load: LoadBoard
    balancer: Balancer
    tracing: TracingService | None


def client_api(
    reactor: IDaemonReactor, config: ServerConfig, program: str
) -> ClientAPI:
    """
    @param program: the daemon's name, the spans' C{service.name}.
    @return: the engines' side of C{config.router} (C{connect_timeout},
        C{max_idle_connections}, C{load_poll_interval}, C{eject_cooldown}
        and the balancing policy) and the tracing of C{config.tracing}.
    """
    settings = config.router
    registry = MetricsRegistry()
    pool = EngineClient(
        reactor, settings.connect_timeout, settings.max_idle_connections
    )
    interval = settings.load_poll_interval
    scraper = make_scraper(reactor, settings.connect_timeout, interval)
    load = LoadBoard(reactor, scraper, interval)
    registry.register(LoadCollector(load))
    metrics = RouterMetrics(registry)
    loads = metrics.adapter_loads
    # The LoRA adapters' loads go through the engine client, counted.
    adapters = AdapterLoads(
        pool,
        settings.affinity_epsilon,
        lambda adapter, outcome: loads.labels(adapter, outcome).inc(),
    )
    balancer = Balancer(
        reactor,
        settings.eject_cooldown,
        settings=settings,
        metrics=metrics,
        # Unpolled, the board has no readings to balance by.
        load=load if interval > 0 else None,
        adapters=adapters,
    )
    tracing = tracing_service(reactor, config.tracing, program, registry)
    return ClientAPI(settings, registry, metrics, pool, load, balancer, tracing)


@dataclass(frozen=True)
class Accounts:
    """
    Keys and usage on the store.

    @ivar keys: the key ring, its keys loaded.
    @ivar services: what to stop before the store closes (key changes'
        listener, shared limits' connections).
    @ivar usage: the batched writer of usage records.
    """

    keys: KeyRing
    services: list[IService]
    usage: UsageWriter


def serve(
    reactor: IDaemonReactor,
    api: ClientAPI,
    config: ServerConfig,
    store: Store,
    key_rows: list[dict[str, Any]],
    activator: Activator,
    readiness: Readiness,
    usage: tuple[UsageSink, ...] = (),
) -> tuple[Accounts, Router]:
    """
    The keys and usage on C{store}, and the router over C{api}; the
    process's open files raised for its C{max_connections}.

    @param key_rows: the keys' rows, from C{store.prepare()}.
    @param activator: scales from zero and resolves a model's aliases, for
        the router and the keys (a key allowed a model is allowed its
        aliases).
    @param readiness: what the control plane publishes of the models
        below their C{min_replicas}.
    @param usage: where each finished request goes besides the log and
        the store.
    @return: the accounts, and the router: its usage to the log, the
        store and C{usage}, its keys from the accounts, its stored
        responses on the store, its engine load and tracing from C{api}.
    """
    account = _accounts(reactor, store, config, key_rows, activator.resolve)
    balancer = api.balancer
    router = Router(
        reactor,
        balancer,
        api.pool,
        api.settings,
        api.metrics,
        UsageSinks(LogUsageSink(), StoreUsageSink(account.usage), *usage),
        wall_clock=time.time,
        activator=activator,
        auth=account.keys,
        readiness=readiness,
        load=api.load,
        tracing=api.tracing.tracing if api.tracing is not None else None,
        responses=StoreResponses(store, config.responses_retention),
    )
    router.metrics.follow(
        router.models, lambda: [replica.id for replica in balancer.replicas()]
    )
    raise_open_file_limit(api.settings.max_connections)
    return account, router


def _accounts(
    reactor: IDaemonReactor,
    store: Store,
    config: ServerConfig,
    key_rows: list[dict[str, Any]],
    resolve: Callable[[str], str | None],
) -> Accounts:
    # [limits] and, on PostgreSQL, revocations pushed by NOTIFY.
    keys, services = key_ring(
        store,
        LimitsConfig(url=config.limits_url, routers=config.limits_routers),
        AuthConfig(require_api_key=config.require_api_key),
        reactor,
        resolve,
    )
    keys.load(key_rows)
    usage = UsageWriter(
        store, reactor, config.usage_flush_interval, record_rows=config.record_usage
    )
    return Accounts(keys, services, usage)
