"""
The builders of C{twistd llmgw-server}'s service tree (L{llmgw.server.tap}
calls them in order): its state and store, the control plane, the
dashboards and admin API, the listeners, the local agent.  Each takes what
it needs and returns what it built; a start failure ends the process with
one line (L{llmgw.daemon.wiring.fail}).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import Service
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.resource import Resource
from twisted.web.server import Site

from llmgw.admin.guard import AdminGuard
from llmgw.admin.metrics_site import QuietSite, metrics_site
from llmgw.config import ServerConfig
from llmgw.config_checks import ConfigError
from llmgw.control.agents import HEARTBEAT_INTERVAL, AgentHub
from llmgw.control.catalog import Model, parse_models
from llmgw.control.inventory import Inventory
from llmgw.control.meter import GpuMeter
from llmgw.control.plane import ControlPlane
from llmgw.control.prices import Prices
from llmgw.control.settings import ControlConfig
from llmgw.daemon.listen import ListenError, listen
from llmgw.daemon.wiring import fail
from llmgw.reactors import IDaemonReactor
from llmgw.router.interfaces import Endpoint, Readiness, Shortfall
from llmgw.server.engine_keys import EngineKeys
from llmgw.server.local import (
    LocalEngines,
    default_catalog,
    local_agent,
    local_certificates,
    local_listener_factory,
    local_node_id,
    simulated_catalog,
)
from llmgw.store.base import Store
from llmgw.store.db import SQLiteStore, StoreError, open_store
from llmgw.store.migrations import MigrationPending
from llmgw.tier.build import Accounts, ClientAPI
from llmgw.tier.watch import Watch
from llmgw.tier.workers import Workers, make_workers, reserve_port
from llmgw.wire.certs import CertsError
from llmgw.wire.tls import server_options

log = Logger(namespace="llmgw.server")

PROGRAM = "llmgw-server"

_held_locks: list[Any] = []


def _lock(folder: str, name: str) -> None:
    """
    Hold C{folder/name} locked for the life of the process: two servers
    on one state directory would share its certificates and (with --local)
    adopt and stop each other's engines; two on one database would each
    enforce keys and budgets from their own memory.

    @raise ConfigError: another server holds it, or it cannot be made.
    """
    import fcntl

    path = os.path.join(folder, name)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        handle = open(path, "a+")
    except OSError as e:
        raise ConfigError(f"state_dir: cannot use {folder!r}: {e.strerror}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"{path!r} is held by llmgw-server pid {holder}: one server per"
            " state directory and per database (see --state-dir, [store] url)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _held_locks.append(handle)


def _runtime_models(
    stored: list[tuple[str, str]], config_models: tuple[Model, ...]
) -> tuple[Model, ...]:
    """
    The models added at run time, from the store; one whose name the
    config file now uses is skipped (the file wins), with a warning.
    """
    taken = {name for m in config_models for name in m.names}
    added = []
    for name, spec in stored:
        try:
            (model,) = parse_models([json.loads(spec)], check_bases=False)
        except (ConfigError, ValueError) as e:
            log.warn("stored model {name} is not valid: {error}", name=name, error=e)
            continue
        if taken & set(model.names):
            log.warn(
                "stored model {name} is skipped: the config file uses its name",
                name=name,
            )
            continue
        taken.update(model.names)
        added.append(model)
    return tuple(added)


def _agent_factory(config: ServerConfig, hub: AgentHub) -> IProtocolFactory:
    """
    The agent links' factory, inside TLS from C{[agent_tls]} unless agents
    are insecure.

    @raise ConfigError: a certificate file cannot be read.
    """
    if config.agent_tls is None:
        return hub
    tls = config.agent_tls
    try:
        options = server_options(tls.ca, tls.cert, tls.key)
    except (OSError, ValueError) as e:
        raise ConfigError(f"agent_tls: cannot load the certificates: {e}") from None
    return TLSMemoryBIOFactory(options, False, hub)


def control_settings(config: ServerConfig) -> tuple[tuple[Model, ...], ControlConfig]:
    """
    @return: the configured models (with C{--local} and none configured,
        the bundled one, or with C{--simulated-gpus} the sim models of
        L{simulated_catalog}) and the control plane's settings.
    """
    control, models = config.control, config.models
    if config.local and not models and config.simulated_gpus:
        models = simulated_catalog(config.simulated_gpus)
    elif config.local and not models:
        try:
            models = default_catalog()
        except ConfigError as e:
            fail(PROGRAM, f"config error: {e}", 2)
    if config.local and not config.accepts_agents:
        # The in-process agent is the only one: its Register, with the
        # engines it adopted, comes before any node exists to place on.
        control = replace(control, startup_grace=0.0)
    return tuple(models), control


@dataclass(frozen=True)
class State:
    """
    What the server keeps across restarts, opened and locked.

    @ivar key_rows: the keys' rows, for the key ring.
    @ivar models: the configured models, then those added at run time.
    @ivar config_names: the configured models' names.
    """

    store: Store
    engine_keys: EngineKeys
    key_rows: list[dict[str, Any]]
    models: tuple[Model, ...]
    config_names: frozenset[str]


def open_state(config: ServerConfig, models: tuple[Model, ...]) -> State:
    """
    Lock the state directory (and a SQLite database), open and migrate the
    store, read the keys, the runtime models and the engines' secrets.
    """
    try:
        _lock(os.path.expanduser(config.state_dir), "server.lock")
        store = open_store(config.store_url, config.state_dir)
        if isinstance(store, SQLiteStore):
            # Keys, budgets and limits live in each server's memory: one
            # server per SQLite file, wherever its state directory is.
            # (On PostgreSQL several processes share the database.)
            database = store.path
            _lock(
                os.path.dirname(os.path.abspath(database)),
                os.path.basename(database) + ".lock",
            )
        key_rows, stored_models = store.prepare()
        engine_keys = EngineKeys(config.state_dir)
    except MigrationPending as e:
        # Not a mistake in the configuration: an upgrade half done.
        fail(PROGRAM, str(e), 2)
    except (ConfigError, StoreError, OSError, ValueError) as e:
        fail(PROGRAM, f"config error: {e}", 2)
    names = frozenset(m.name for m in models)
    every = models + _runtime_models(stored_models, models)
    return State(store, engine_keys, key_rows, every, names)


@dataclass(frozen=True)
class Plane:
    """
    The control plane, what it publishes to, and its agents' listener.

    @ivar watch: the state routers of the tier follow.
    @ivar readiness: the models below their C{min_replicas}, for the
        router's C{/readyz}.
    @ivar agents: the agent listener, open, unless agents are not
        accepted.
    @ivar meter: every GPU's seconds counted and priced (docs/cost.md).
    """

    inventory: Inventory
    hub: AgentHub
    plane: ControlPlane
    watch: Watch
    readiness: Readiness
    agents: IListeningPort | None
    meter: GpuMeter


def control_plane(
    reactor: IDaemonReactor,
    config: ServerConfig,
    control: ControlConfig,
    state: State,
    api: ClientAPI,
) -> Plane:
    """
    @return: the control plane, publishing its endpoints (and the static
        ones) to C{api}'s balancer and engine load and to the tier's
        watch, and the models below their C{min_replicas} to the router's
        readiness and the watch, tracing with C{api}'s tracer; and its
        agents' listener, open now (before the other listeners: a standby
        names its address), so that a port in use ends the process at
        start.
    """
    balancer, load = api.balancer, api.load

    def set_endpoints(endpoints: list[Endpoint]) -> None:
        balancer.set_endpoints(endpoints)
        load.set_endpoints(endpoints)
        watch.set_endpoints(endpoints)

    def publish(endpoints: list[Endpoint]) -> None:
        # Each replica's GPUs and their price, for its requests' shares.
        set_endpoints(meter.priced(endpoints))

    def publish_shortfalls(shortfalls: tuple[Shortfall, ...]) -> None:
        readiness.set(shortfalls)
        watch.set_shortfalls(shortfalls)

    readiness = Readiness()

    watch = Watch(
        reactor,
        lambda: {n: plane.catalog.resolve(n) or n for n in plane.catalog.names()},
        lambda: plane.catalog.adapter_names(),
    )
    inventory = Inventory(drained=state.store.drained)
    meter = GpuMeter(
        inventory, lambda: plane.ledger.shards(), Prices(config.cost), balancer.busy
    )
    static = list(config.endpoints)
    set_endpoints(static)  # no replica of the plane's among them
    hub = _agent_hub(reactor, config, control, inventory)
    plane = ControlPlane(
        reactor,
        inventory,
        hub,
        state.models,
        control,
        publish,
        static=static,
        outstanding=balancer.outstanding,
        # A replica serving only a batch's lines goes for a held request.
        interactive=balancer.interactive_outstanding,
        keys=state.engine_keys.for_shard,
        cut=balancer.cut,
        # The router touches each model at a request's arrival and end.
        touched=True,
        publish_shortfalls=publish_shortfalls,
        # Scale-down, eviction and sleep wait for streams as long as the
        # router lets one run.
        leave_timeout=config.router.total_timeout,
        tracer=api.tracing.tracing.tracer if api.tracing is not None else None,
        # Each router's bound on the requests it holds per model is also
        # the fleet's: who is refused past it is decided here, for all.
        held_bound=config.router.activation_queue,
    )
    agents = _agent_listener(reactor, config, hub)
    return Plane(inventory, hub, plane, watch, readiness, agents, meter)


def _agent_hub(
    reactor: IDaemonReactor,
    config: ServerConfig,
    control: ControlConfig,
    inventory: Inventory,
) -> AgentHub:
    """
    @return: the server's end of the agents' links.
    """
    return AgentHub(
        reactor,
        inventory,
        insecure=config.agent_tls is None,
        # Several heartbeats within unreachable_after, so that a live node
        # never looks silent.
        heartbeat_interval=min(
            HEARTBEAT_INTERVAL, max(1, int(control.unreachable_after / 3))
        ),
        wall_clock=time.time,
        # A second agent for a node may take over its link only once the
        # node is unreachable: silent this long.
        unreachable_after=control.unreachable_after,
    )


def _agent_listener(
    reactor: IDaemonReactor, config: ServerConfig, hub: AgentHub
) -> IListeningPort | None:
    """
    @return: the agent listener, open, or L{None} when agents are not
        accepted.
    """
    if not config.accepts_agents:
        return None
    try:
        factory = _agent_factory(config, hub)
        return listen(reactor, "agent_listen", config.agent_listen, factory)
    except ListenError as e:
        fail(PROGRAM, str(e), 1)
    except ConfigError as e:
        fail(PROGRAM, f"config error: {e}", 2)


@dataclass(frozen=True)
class Listeners:
    """
    The server's client and admin listeners, open (the agents' is the
    plane's: L{Plane.agents}).

    @ivar router: the client API's port (reserved for the workers with
        C{--router-workers}).
    @ivar metrics: the metrics-only listener, if configured.
    @ivar workers: the router workers, with C{--router-workers}.
    @ivar admin_guarded: whether the admin API asks for an admin key (not
        on loopback).
    """

    router: Any
    admin: IListeningPort
    metrics: IListeningPort | None
    workers: Workers | None
    admin_guarded: bool


def listeners(
    reactor: IDaemonReactor,
    config_path: str | None,
    config: ServerConfig,
    served: tuple[Site, Resource],
    account: Accounts,
    registry: CollectorRegistry,
) -> Listeners:
    """
    Open the client API's, the admin's and the metrics' listeners now, so
    that a port in use ends the process at start.

    @param served: the client listener's site and the admin listener's
        resource.
    """
    router_site, admin_resource = served
    workers = metrics_port = None
    # The bearer token the server's own router workers follow its admin
    # API with: they hold no admin key.
    token = secrets.token_urlsafe(32) if config.router_workers else None
    try:
        if config.router_workers:
            router_port = reserve_port(config.listen)
        else:
            router_port = listen(reactor, "listen", config.listen, router_site)
        guard = AdminGuard(
            admin_resource,
            account.keys,
            internal=token.encode("ascii") if token is not None else None,
        )
        admin_site = QuietSite(guard)
        admin_port = listen(reactor, "admin_listen", config.admin_listen, admin_site)
        if config.metrics_listen:
            metrics = metrics_site(registry)
            metrics_port = listen(
                reactor, "metrics_listen", config.metrics_listen, metrics
            )
        guarded = guard.bound(getattr(admin_port.getHost(), "host", "127.0.0.1"))
        if token is not None:
            ports = (router_port, admin_port)
            workers = make_workers(reactor, config_path, config, ports, token)
    except ListenError as e:
        fail(PROGRAM, str(e), 1)
    except ConfigError as e:
        fail(PROGRAM, f"config error: {e}", 2)
    return Listeners(router_port, admin_port, metrics_port, workers, guarded)


@dataclass(frozen=True)
class LocalAgent:
    """
    With C{--local}, this machine's agent inside the server.

    @ivar port: its loopback listener on the server's side, or L{None}
        without C{--local}.
    @ivar uplink: its link to the server.
    @ivar engines: what stops its engines at the server's stop.
    """

    port: IListeningPort | None = None
    uplink: list[Service] = field(default_factory=list)
    engines: list[Service] = field(default_factory=list)


def local(reactor: IDaemonReactor, config: ServerConfig, hub: AgentHub) -> LocalAgent:
    """
    @return: the local agent, linked over loopback with mutual TLS, when
        C{--local}; else an empty L{LocalAgent}.
    """
    if not config.local:
        return LocalAgent()
    try:
        state_dir = os.path.expanduser(config.state_dir)
        node_id = local_node_id()
        folder, agent_folder = local_certificates(state_dir, node_id)
        port = listen(
            reactor,
            "local agent listener",
            "tcp:0:interface=127.0.0.1",
            local_listener_factory(folder, hub),
        )
        uplink, agent_factory = local_agent(
            reactor,
            state_dir,
            node_id,
            getattr(port.getHost(), "port", 0),
            agent_folder,
            config.simulated_gpus,
        )
    except ListenError as e:
        fail(PROGRAM, str(e), 1)
    except (ConfigError, CertsError, ValueError) as e:
        # ValueError: TLSFileError, the local certificates named.
        fail(PROGRAM, f"config error: {e}", 2)
    return LocalAgent(port, [uplink], [LocalEngines(agent_factory)])
