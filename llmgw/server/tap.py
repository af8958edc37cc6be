"""
C{twistd llmgw-server}: options and the service tree.  The only module of
the server that touches the global reactor.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService, Service
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage
from twisted.web.server import Site

from llmgw.accounts.keysync import key_ring
from llmgw.accounts.usage import StoreUsageSink
from llmgw.admin.api import Admin
from llmgw.admin.guard import AdminGuard, is_loopback
from llmgw.admin.metrics_site import metrics_site
from llmgw.config import (
    ServerConfig,
    finish_config,
    load_config,
    parse_endpoint_flag,
    shared_flags,
)
from llmgw.config_checks import ConfigError
from llmgw.control.agents import HEARTBEAT_INTERVAL, AgentHub
from llmgw.control.catalog import Model, parse_models
from llmgw.control.inventory import Inventory
from llmgw.control.metrics import FleetCollector
from llmgw.control.plane import ControlPlane
from llmgw.daemon.fdlimit import raise_open_file_limit
from llmgw.daemon.lifecycle import (
    AGENT_LINKS,
    DRAIN,
    LISTENERS,
    LOCAL_ENGINES,
    POOLS,
    RECONCILER,
    STORE,
    USAGE,
    DrainService,
    Lifecycle,
    LinksService,
    ListeningService,
    PoolService,
    StoreService,
)
from llmgw.daemon.listen import listen as _listen
from llmgw.daemon.logs import json_observer
from llmgw.router.app import Router
from llmgw.router.balancer import Balancer
from llmgw.router.engine_client import EngineClient
from llmgw.router.interfaces import Endpoint
from llmgw.router.load import LoadBoard, LoadCollector, make_scraper
from llmgw.router.metrics import RouterMetrics
from llmgw.router.site import make_site
from llmgw.router.usage_log import LogUsageSink, UsageSinks
from llmgw.server.engine_keys import EngineKeys
from llmgw.server.local import (
    LocalEngines,
    default_catalog,
    local_agent,
    local_certificates,
    local_listener_factory,
    local_node_id,
)
from llmgw.server.standby import leading_services
from llmgw.store.db import SQLiteStore, StoreError, open_store
from llmgw.store.usage import UsageWriter
from llmgw.tier.settings import check_router_workers
from llmgw.tier.watch import Watch
from llmgw.tier.workers import Workers, make_workers, reserve_port
from llmgw.web.fleet import Fleet
from llmgw.web.history import FailureTap, History
from llmgw.web.login import LoginGate, Mount, Sessions, Split
from llmgw.web.pages import CookieCsrf, Dashboard
from llmgw.web.profiling import Profiling
from llmgw.wire.tls import server_options

log = Logger(namespace="llmgw.server")


class Options(usage.Options):
    """
    Command line of C{twistd llmgw-server}.  Every flag has a configuration
    key of the same name with underscores, and a flag overrides the file.
    """

    synopsis = "[--config FILE.toml] [--listen ENDPOINT] [--endpoint id=URL=model]..."

    optParameters = [
        ["config", "c", None, "TOML configuration file."],
        [
            "listen",
            None,
            None,
            "Client API listener, a Twisted server endpoint string"
            " (default tcp:8080; ssl:8443:privateKey=K:certKey=C for TLS"
            " with HTTP/2).",
        ],
        [
            "agent-listen",
            None,
            None,
            "Agent listener, a Twisted server endpoint string (default tcp:7443);"
            " TLS comes from [agent_tls] in the config file.",
        ],
        [
            "admin-listen",
            None,
            None,
            "Admin listener, a Twisted server endpoint string"
            " (default tcp:9090:interface=127.0.0.1).",
        ],
        [
            "metrics-listen",
            None,
            None,
            "A listener serving /metrics only, safe to open to a Prometheus"
            " server (default: none; the admin listener serves /metrics too).",
        ],
        [
            "log-format",
            None,
            None,
            "text (default) or json: one JSON object per log line.",
        ],
        [
            "router-workers",
            None,
            None,
            "N llmgw-router children serve the client API on its tcp port"
            " (SO_REUSEPORT), restarted when they exit (default 0: this process).",
        ],
        [
            "state-dir",
            None,
            None,
            "Folder for the server's state: with --local, its certificates and"
            " its agent's engine records (default ~/.local/state/llmgw).",
        ],
    ]
    optFlags = [
        [
            "local",
            None,
            "Run an agent for this machine inside the server, over loopback"
            " with mutual TLS; without [[models]], serve the bundled Gemma 3"
            " 270M on llama.cpp on the CPU, started on the first request.",
        ]
    ]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self["endpoint"] = []

    def opt_endpoint(self, value: str) -> None:
        """
        A static replica, id=URL=model[,model]; repeatable.  Replaces the
        file's [[endpoints]].
        """
        self["endpoint"].append(value)

    def postOptions(self) -> None:
        try:
            self.config = self._config()
        except ConfigError as e:
            # One line and no usage text or traceback: the operator needs
            # the key and the value, nothing else.
            sys.stderr.write(f"llmgw-server: config error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None

    def _config(self) -> ServerConfig:
        config = shared_flags(load_config(self["config"]), self)
        if self["admin-listen"] is not None:
            config = replace(config, admin_listen=self["admin-listen"])
        if self["agent-listen"] is not None:
            config = replace(config, agent_listen=self["agent-listen"])
        if self["metrics-listen"] is not None:
            config = replace(config, metrics_listen=self["metrics-listen"])
        if self["router-workers"] is not None:
            workers = check_router_workers(self["router-workers"])
            config = replace(config, router_workers=workers)
        if self["local"]:
            config = replace(config, local=True)
            if self["listen"] is None and config.listen == ServerConfig().listen:
                # A laptop's server is not for the network unless asked.
                config = replace(config, listen="tcp:8080:interface=127.0.0.1")
        if self["endpoint"]:
            endpoints: list[Endpoint] = [
                parse_endpoint_flag(spec) for spec in self["endpoint"]
            ]
            config = replace(config, endpoints=tuple(endpoints))
        return finish_config(config)


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
            (model,) = parse_models([json.loads(spec)])
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


def _agent_factory(config: ServerConfig, hub: AgentHub) -> Any:
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


def makeService(options: Options) -> IService:
    """
    Build the server's service tree; its stop is the sequence of
    L{llmgw.daemon.lifecycle.STOP_STEPS}: the listeners (client API, admin,
    agents) stop accepting, the router drains its requests in flight, the
    reconciler stops, the agent links close (with C{--local}, the local
    agent's uplink and listener first), usage is flushed, the local engines
    stop, the upstream connection pool closes, and the store last.
    """
    from twisted.internet import reactor

    config: ServerConfig = options.config
    settings = config.router
    control = config.control
    models = config.models
    if config.local and not models:
        try:
            models = default_catalog()
        except ConfigError as e:
            sys.stderr.write(f"llmgw-server: config error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
    if config.local and not config.accepts_agents:
        # The in-process agent is the only one: its Register, with the
        # engines it adopted, comes before any node exists to place on.
        control = replace(control, startup_grace=0.0)
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
    except (ConfigError, StoreError, OSError, ValueError) as e:
        sys.stderr.write(f"llmgw-server: config error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    config_names = frozenset(m.name for m in models)
    models = tuple(models) + _runtime_models(stored_models, models)
    keys, key_services = key_ring(store, config, reactor)  # type: ignore[arg-type]
    keys.load(key_rows)
    usage_writer = UsageWriter(
        store,
        reactor,
        config.usage_flush_interval,
        record_rows=config.record_usage,
    )
    registry = CollectorRegistry()
    balancer = Balancer(reactor, settings.eject_cooldown, settings=settings)
    pool = EngineClient(
        reactor, settings.connect_timeout, settings.max_idle_connections
    )
    # Engine load: its own connections, so that polls never wait on traffic.
    interval = settings.load_poll_interval
    scraper = make_scraper(reactor, settings.connect_timeout, interval)
    load = LoadBoard(reactor, scraper, interval)
    registry.register(LoadCollector(load))

    def publish(endpoints: list[Endpoint]) -> None:
        balancer.set_endpoints(endpoints)
        load.set_endpoints(endpoints)
        watch.set_endpoints(endpoints)

    watch = Watch(
        reactor,
        lambda: {n: plane.catalog.resolve(n) or n for n in plane.catalog.names()},
    )

    static = list(config.endpoints)
    publish(static)
    inventory = Inventory(drained=store.drained)
    hub = AgentHub(
        reactor,
        inventory,
        insecure=config.agent_tls is None,
        # Several heartbeats within unreachable_after, so that a live node
        # never looks silent.
        heartbeat_interval=min(
            HEARTBEAT_INTERVAL, max(1, int(control.unreachable_after / 3))
        ),
        wall_clock=time.time,
    )
    plane = ControlPlane(
        reactor,
        inventory,
        hub,
        models,
        control,
        publish,
        static=static,
        outstanding=balancer.outstanding,
        keys=engine_keys.for_shard,
        cut=balancer.cut,
        # The router touches each model at a request's arrival and end.
        touched=True,
    )
    failures = FailureTap(plane, time.time)
    hub.listener = failures
    registry.register(FleetCollector(plane, hub, usage_writer))
    keys.resolve = plane.catalog.resolve
    router = Router(
        reactor,
        balancer,
        pool,
        settings,
        RouterMetrics(registry),
        UsageSinks(LogUsageSink(), StoreUsageSink(usage_writer)),
        wall_clock=time.time,
        activator=plane.catalog,
        auth=keys,
    )
    router.load = load
    if interval > 0:
        balancer.load = load
    raise_open_file_limit(settings.max_connections)
    admin = Admin(
        registry,
        inventory,
        plane,
        keys=keys,
        store=store,
        usage=usage_writer,
        config_models=config_names,
        wall_clock=time.time,
        watch=watch,
    )
    history = History(reactor, router.metrics, plane, keys, wall_clock=time.time)
    failures.changed = lambda: history.record_states(time.time())
    fleet = Fleet(
        inventory,
        plane,
        keys,
        history,
        failures,
        router.load,
        wall_clock=time.time,
        load_clock=reactor.seconds,
    )
    # The dashboard at /admin on the client listener, behind a login.
    sessions = Sessions(keys, time.monotonic)
    client_dashboard = Dashboard(fleet, admin, sessions, "/admin", logout=True)
    router_site = make_site(
        Mount(
            router.resource(),
            b"admin",
            LoginGate(client_dashboard.app.resource(), sessions, "/admin"),
        ),
        settings,
        reactor,
        router.cors,
    )
    # The admin listener: its API, metrics and profiling, the dashboard
    # at every other path.
    api: Any = admin.app.resource()
    admin_resource = Split(
        {
            b"api": api,
            b"metrics": api,
            b"healthz": api,
            b"debug": Profiling(reactor).app.resource(),
        },
        Dashboard(fleet, admin, CookieCsrf()).app.resource(),
    )
    agent_port = local_port = None
    local_uplink: list[Service] = []
    local_engines: list[Service] = []
    workers: Workers | None = None
    try:
        if config.router_workers:
            router_port = reserve_port(config.listen)
        else:
            router_port = _listen(reactor, "listen", config.listen, router_site)
        guard = AdminGuard(admin_resource, keys)
        admin_site = Site(guard)
        admin_site.log = lambda request: None  # type: ignore[method-assign]
        admin_port = _listen(reactor, "admin_listen", config.admin_listen, admin_site)
        metrics_port = None
        if config.metrics_listen:
            metrics_port = _listen(
                reactor, "metrics_listen", config.metrics_listen, metrics_site(registry)
            )
        admin_host = getattr(admin_port.getHost(), "host", "127.0.0.1")
        # A UNIX socket is reached through the file system's permissions.
        admin_guarded = guard.enabled = not is_loopback(admin_host, True)
        if config.router_workers:
            ports = (router_port, admin_port)
            workers = make_workers(reactor, options["config"], config, ports, guard)
        if config.accepts_agents:
            agent_port = _listen(
                reactor,
                "agent_listen",
                config.agent_listen,
                _agent_factory(config, hub),
            )
        if config.local:
            state_dir = os.path.expanduser(config.state_dir)
            node_id = local_node_id()
            folder, agent_folder = local_certificates(state_dir, node_id)
            local_port = _listen(
                reactor,
                "local agent listener",
                "tcp:0:interface=127.0.0.1",
                local_listener_factory(folder, hub),
            )
            uplink, agent_factory = local_agent(
                reactor,
                state_dir,
                node_id,
                getattr(local_port.getHost(), "port", 0),
                agent_folder,
            )
            local_uplink, local_engines = [uplink], [LocalEngines(agent_factory)]
    except ConfigError as e:
        sys.stderr.write(f"llmgw-server: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None

    top = Lifecycle()
    top.stop_once_on_signals(reactor)
    if config.log_format == "json":
        try:
            top.log_observer = json_observer(getattr(options, "parent", None))
        except OSError as e:
            sys.stderr.write(f"llmgw-server: cannot open the log file: {e}\n")
            raise SystemExit(1) from None
    if workers is not None:
        top.add(LISTENERS, workers)
    else:
        top.add(LISTENERS, ListeningService(router_port))
    if agent_port is not None:
        top.add(LISTENERS, ListeningService(agent_port))
    top.add(LISTENERS, ListeningService(admin_port))
    if metrics_port is not None:
        top.add(LISTENERS, ListeningService(metrics_port))
        metrics_address = metrics_port.getHost()
        log.info(
            "metrics-only listener on {host}:{port}",
            host=getattr(metrics_address, "host", metrics_address),
            port=getattr(metrics_address, "port", ""),
        )
    top.add(DRAIN, DrainService(router, settings.drain_timeout))
    leading = leading_services(reactor, config, hub, plane, agent_port, admin)
    top.add(RECONCILER, *leading, load, history, watch)
    # The local uplink first: its agent must not report its engines' ends
    # (next steps) as failures to the control plane.
    top.add(AGENT_LINKS, *local_uplink)
    if local_port is not None:
        top.add(AGENT_LINKS, ListeningService(local_port))
    top.add(AGENT_LINKS, LinksService(hub, reactor))
    top.add(USAGE, usage_writer)
    top.add(LOCAL_ENGINES, *local_engines)
    top.add(POOLS, PoolService(pool))
    top.add(POOLS, *key_services)
    top.add(STORE, StoreService(store))
    if agent_port is not None:
        agent_address = agent_port.getHost()
        log.info(
            "agent listener on {host}:{port} ({security})",
            host=getattr(agent_address, "host", agent_address),
            port=getattr(agent_address, "port", ""),
            security="mutual TLS" if config.agent_tls else "PLAINTEXT",
        )
        if config.agent_tls is None:
            log.warn(
                "insecure_agents = true: agent links are plaintext and any"
                " connection may claim to be any node; use [agent_tls]"
            )
    elif not config.local:
        log.info("no [agent_tls]: not listening for agents")
    # The bound addresses, not the configured strings: with port 0 this is
    # the only place the port is told (tests and scripts read this line).
    router_address = router_port.getHost()
    admin_address = admin_port.getHost()
    log.info(
        "llmgw-server: client API listening on {host}:{port},"
        " admin on {admin_host}:{admin_port}; models: {models}",
        host=getattr(router_address, "host", router_address),
        port=getattr(router_address, "port", ""),
        admin_host=getattr(admin_address, "host", admin_address),
        admin_port=getattr(admin_address, "port", ""),
        models=", ".join(router.models()),
    )
    if config.local:
        log.info(
            "--local: agent {node} runs in this process; state in {state}",
            node=local_node_id(),
            state=config.state_dir,
        )
    if keys.required:
        log.info(
            "API keys required: {count} keys in {store}",
            count=len(keys.keys()),
            store=store.path,
        )
    else:
        log.info(
            "no API keys yet: the client API is open to whoever reaches it"
            " (make one with llmgw ctl keys create, or set [auth] require_api_key)"
        )
    if admin_guarded:
        log.info("admin API not on loopback: it needs an admin key")
    return top
