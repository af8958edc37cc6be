"""
C{twistd llmgw-server}: options and the service tree.  The only module of
the server that touches the global reactor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from twisted.application.service import IService
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python import usage

from llmgw.accounts.responses import ResponseRetention
from llmgw.accounts.retention import UsageRetention
from llmgw.config import (
    ServerConfig,
    finish_config,
    load_config,
    parse_endpoint_flag,
    shared_flags,
)
from llmgw.config_checks import ConfigError, told_in
from llmgw.control.metrics import FleetCollector
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
from llmgw.daemon.wiring import fail, host_and_port, top_service
from llmgw.reactors import IDaemonReactor, global_reactor
from llmgw.router.api.app import Router
from llmgw.router.interfaces import BatchRoom, Endpoint
from llmgw.server.batch_runner import BatchLines, RunnerStop, batch_lines, batch_room
from llmgw.server.build import (
    PROGRAM,
    Listeners,
    LocalAgent,
    Plane,
    State,
    control_plane,
    control_settings,
    listeners,
    local,
    open_state,
)
from llmgw.server.local import local_node_id, parse_simulated_gpus
from llmgw.server.metering import MeterService
from llmgw.server.pages import Pages, pages
from llmgw.server.standby import Leading, leading_services
from llmgw.store.base import Store
from llmgw.tier.build import Accounts, ClientAPI, client_api, serve
from llmgw.tier.settings import check_router_workers
from llmgw.web.traffic import Traffic

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
            "simulated-gpus",
            None,
            None,
            "With --local: GPUs that are not there, reported as simulated,"
            " COUNTxGB[,COUNTxGB] such as 2x24GB; without [[models]], sim"
            " models sim-1 ... sim-N+1 that do not all fit, for trying"
            " placement, eviction and sleep (docs/sim.md).",
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
            fail(PROGRAM, f"config error: {e}", 2)

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
        if self["simulated-gpus"] is not None:
            gpus = parse_simulated_gpus(self["simulated-gpus"])
            config = replace(config, simulated_gpus=gpus)
        if self["endpoint"]:
            endpoints: list[Endpoint] = [
                parse_endpoint_flag(spec) for spec in self["endpoint"]
            ]
            config = replace(config, endpoints=tuple(endpoints))
        # Checked with the flags merged in: the file named all the same.
        with told_in(self["config"], " with the flags"):
            return finish_config(config)


@dataclass(frozen=True)
class _Server:
    """
    What L{makeService} built, for its stop steps and its start's log.
    """

    config: ServerConfig
    store: Store
    api: ClientAPI
    parts: Plane
    account: Accounts
    router: Router
    leading: Leading
    served: Pages
    ports: Listeners
    agent: LocalAgent
    batches: BatchLines


def _stop_sequence(top: Lifecycle, reactor: IDaemonReactor, built: _Server) -> None:
    """
    Put each service in its step of L{llmgw.daemon.lifecycle.STOP_STEPS}.
    """
    config, store, api, parts = built.config, built.store, built.api, built.parts
    ports, agent, account = built.ports, built.agent, built.account
    if ports.workers is not None:
        top.add(LISTENERS, ports.workers)
    else:
        top.add(LISTENERS, ListeningService(ports.router))
    if parts.agents is not None:
        top.add(LISTENERS, ListeningService(parts.agents))
    top.add(LISTENERS, ListeningService(ports.admin))
    if ports.metrics is not None:
        top.add(LISTENERS, ListeningService(ports.metrics))
        host, port = host_and_port(ports.metrics.getHost())
        log.info("metrics-only listener on {host}:{port}", host=host, port=port)
    # No batch line sent once clients can send nothing: those in flight end
    # (or run again at the next start), then its listener closes.
    top.add(LISTENERS, RunnerStop(built.batches.runner))
    top.add(LISTENERS, ListeningService(built.batches.port))
    top.add(DRAIN, DrainService(built.router, config.router.drain_timeout))
    leading = built.leading.services
    # The GPU meter stops counting with the reconciler; its last counts are
    # written then, before the store closes.
    meter = MeterService(
        reactor, parts.meter, store, lambda: bool(parts.plane.loop.running)
    )
    top.add(
        RECONCILER,
        *leading,
        api.load,
        built.served.history,
        built.served.batches,
        parts.watch,
        meter,
    )
    # The local uplink first: its agent must not report its engines' ends
    # (next steps) as failures to the control plane.
    top.add(AGENT_LINKS, *agent.uplink)
    if agent.port is not None:
        top.add(AGENT_LINKS, ListeningService(agent.port))
    top.add(AGENT_LINKS, LinksService(parts.hub, reactor))
    # Retention before the store closes, its pass in flight waited for.
    top.add(
        USAGE,
        account.usage,
        UsageRetention(store, reactor, config.usage_retention),
        ResponseRetention(store, reactor, config.responses_retention),
    )
    top.add(LOCAL_ENGINES, *agent.engines)
    top.add(POOLS, PoolService(api.pool), PoolService(built.batches.sender.pool))
    top.add(POOLS, *account.services)
    top.add(STORE, StoreService(store))


def _log_agents(config: ServerConfig, agents: IListeningPort | None) -> None:
    if agents is not None:
        host, port = host_and_port(agents.getHost())
        log.info(
            "agent listener on {host}:{port} ({security})",
            host=host,
            port=port,
            security="mutual TLS" if config.agent_tls else "PLAINTEXT",
        )
        if config.agent_tls is None:
            log.warn(
                "insecure_agents = true: agent links are plaintext and any"
                " connection may claim to be any node; use [agent_tls]"
            )
    elif not config.local:
        log.info("no [agent_tls]: not listening for agents")


def _log_started(built: _Server) -> None:
    """
    Tell what the server serves, where and to whom.
    """
    config, ports, store = built.config, built.ports, built.store
    _log_agents(config, built.parts.agents)
    # The bound addresses, not the configured strings: with port 0 this is
    # the only place the port is told (tests and scripts read this line).
    host, port = host_and_port(ports.router.getHost())
    admin_host, admin_port = host_and_port(ports.admin.getHost())
    log.info(
        "llmgw-server: client API listening on {host}:{port},"
        " admin on {admin_host}:{admin_port}; models: {models}",
        host=host,
        port=port,
        admin_host=admin_host,
        admin_port=admin_port,
        models=", ".join(built.router.models()),
    )
    if config.local:
        log.info(
            "--local: agent {node} runs in this process; state in {state}",
            node=local_node_id(),
            state=config.state_dir,
        )
    keys = built.account.keys
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
    if ports.admin_guarded:
        log.info("admin API not on loopback: it needs an admin key")


def _led(
    reactor: IDaemonReactor,
    config: ServerConfig,
    state: State,
    parts: Plane,
    client: tuple[Accounts, Router, BatchRoom],
) -> tuple[BatchLines, Leading]:
    """
    @param client: the keys and usage, the router and the batch lines'
        room.
    @return: the batches' runner and its listener, and what runs only
        while this server leads (the reconciler and the runner).
    """
    account, router, room = client
    batches = batch_lines(
        reactor,
        config,
        state.store,
        router,
        room,
        parts.plane.catalog.resolve,
        account.usage,
        PROGRAM,
    )
    leading = leading_services(
        reactor,
        config,
        parts.hub,
        parts.plane,
        parts.agents,
        state.store,
        batches.runner,
    )
    return batches, leading


def makeService(options: Options) -> IService:
    """
    Build the server's service tree; its stop is the sequence of
    L{llmgw.daemon.lifecycle.STOP_STEPS}: the listeners (client API, admin,
    agents) stop accepting, the router drains its requests in flight, the
    reconciler stops, the agent links close (with C{--local}, the local
    agent's uplink and listener first), usage is flushed, the local engines
    stop, the upstream connection pool closes, and the store last.
    """
    reactor = global_reactor()
    config: ServerConfig = options.config
    models, control = control_settings(config)
    state = open_state(config, models)
    api = client_api(reactor, config, PROGRAM)
    parts = control_plane(reactor, config, control, state, api)
    catalog = parts.plane.catalog
    # Every finished request also to the dashboard's figures per model and
    # replica (the metrics' counters name no replica).
    traffic = Traffic(reactor.seconds, catalog.resolve)
    # The room batch lines get, judging the share by every finished request.
    room = batch_room(reactor, config, api)
    account, router = serve(
        reactor,
        api,
        config,
        state.store,
        state.key_rows,
        catalog,
        parts.readiness,
        (traffic, room),
    )
    api.registry.register(FleetCollector(parts.plane, parts.hub, account.usage))
    batches, leading = _led(reactor, config, state, parts, (account, router, room))
    served = pages(
        reactor,
        api.registry,
        parts,
        account,
        state,
        router,
        traffic,
        leading.standby,
        config.batches,
    )
    ports = listeners(
        reactor,
        options["config"],
        config,
        (served.router_site, served.admin_resource),
        account,
        api.registry,
    )
    agent = local(reactor, config, parts.hub)
    top = top_service(
        reactor, PROGRAM, config.log_format, getattr(options, "parent", None)
    )
    if api.tracing is not None:
        top.add(POOLS, api.tracing)
    built = _Server(
        config,
        state.store,
        api,
        parts,
        account,
        router,
        leading,
        served,
        ports,
        agent,
        batches,
    )
    _stop_sequence(top, reactor, built)
    _log_started(built)
    return top
