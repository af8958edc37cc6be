"""
The router as every daemon serving the client API builds it: the server
(C{llmgw.server.tap}, the router in its own process) and each router of
the tier (L{llmgw.tier.tap}).  Each builder takes what it needs and
returns what it built; the caller wires the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService
from twisted.internet.interfaces import IReactorTime

from llmgw.accounts.keysync import key_ring
from llmgw.accounts.settings import AuthConfig, LimitsConfig
from llmgw.accounts.usage import StoreUsageSink
from llmgw.config import ServerConfig
from llmgw.reactors import IConnectingReactor, IDaemonReactor
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.accounting.usage_log import LogUsageSink, UsageSinks
from llmgw.router.api.app import Router
from llmgw.router.interfaces import Activator, Readiness
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.load import LoadBoard, LoadCollector, make_scraper
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import MetricsRegistry, RouterMetrics
from llmgw.router.upstream.engine_client import EngineClient
from llmgw.store.base import Store
from llmgw.store.usage import UsageWriter


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


def accounts(
    reactor: IDaemonReactor,
    store: Store,
    config: ServerConfig,
    key_rows: list[dict[str, Any]],
) -> Accounts:
    """
    @param key_rows: the keys' rows, from C{store.prepare()}.
    """
    # [limits] and, on PostgreSQL, revocations pushed by NOTIFY.
    keys, services = key_ring(
        store,
        LimitsConfig(url=config.limits_url, routers=config.limits_routers),
        AuthConfig(require_api_key=config.require_api_key),
        reactor,
    )
    keys.load(key_rows)
    usage = UsageWriter(
        store, reactor, config.usage_flush_interval, record_rows=config.record_usage
    )
    return Accounts(keys, services, usage)


@dataclass(frozen=True)
class Engines:
    """
    The router's side of the engines.

    @ivar registry: the metrics registry, the engine load's collector in it.
    @ivar pool: the client forwarding requests to replicas.
    @ivar load: engine load, polled on connections of its own so that polls
        never wait on traffic.
    """

    registry: CollectorRegistry
    pool: EngineClient
    load: LoadBoard


def engines(reactor: IConnectingReactor, settings: RouterConfig) -> Engines:
    """
    @return: the metrics registry, the engine client and the load board of
        C{settings} (C{connect_timeout}, C{max_idle_connections},
        C{load_poll_interval}).
    """
    registry = MetricsRegistry()
    pool = EngineClient(
        reactor, settings.connect_timeout, settings.max_idle_connections
    )
    interval = settings.load_poll_interval
    scraper = make_scraper(reactor, settings.connect_timeout, interval)
    load = LoadBoard(reactor, scraper, interval)
    registry.register(LoadCollector(load))
    return Engines(registry, pool, load)


def router(
    clock: IReactorTime,
    settings: RouterConfig,
    balancer: Balancer,
    built: Engines,
    account: Accounts,
    activator: Activator,
    readiness: Readiness | None = None,
) -> Router:
    """
    @param readiness: what the control plane publishes of the models
        below their C{min_replicas}.
    @return: the router, its usage to the log and the store, its keys from
        C{account}, its engine load from C{built}.
    """
    result = Router(
        clock,
        balancer,
        built.pool,
        settings,
        RouterMetrics(built.registry),
        UsageSinks(LogUsageSink(), StoreUsageSink(account.usage)),
        wall_clock=time.time,
        activator=activator,
        auth=account.keys,
        readiness=readiness,
    )
    result.load = built.load
    result.metrics.follow(
        result.models, lambda: [replica.id for replica in balancer.replicas()]
    )
    return result
