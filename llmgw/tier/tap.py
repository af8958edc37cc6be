"""
C{twistd llmgw-router}: the client API alone (issue 12 item 2), following a
control plane's endpoints and catalog through its admin API's watch
(L{llmgw.tier.follow}), forwarding activations to it
(L{llmgw.tier.activate}), reading keys from the shared store and writing
its own usage records there.  No agents, no reconciler, no dashboard.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.application.service import IService, Service
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python import usage

from llmgw.accounts.keysync import key_ring
from llmgw.accounts.usage import StoreUsageSink
from llmgw.config import ServerConfig, load_config, shared_flags
from llmgw.config_checks import ConfigError
from llmgw.daemon.fdlimit import raise_open_file_limit
from llmgw.daemon.lifecycle import (
    DRAIN,
    LISTENERS,
    POOLS,
    RECONCILER,
    STORE,
    USAGE,
    DrainService,
    Lifecycle,
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
from llmgw.store.db import StoreError, open_store
from llmgw.store.usage import UsageWriter
from llmgw.tier.activate import RemoteActivator
from llmgw.tier.admin_client import AdminClient
from llmgw.tier.follow import Follower
from llmgw.tier.keys import KeyFollower
from llmgw.tier.workers import reuse_port_socket, tcp_address

log = Logger(namespace="llmgw.router")

CONTROL_KEY_ENV = "LLMGW_CONTROL_KEY"
"""
The environment variable holding the admin key sent to the control plane
(kept off the command line, which other users of the machine can read).
"""


class Options(usage.Options):
    """
    Command line of C{twistd llmgw-router}.
    """

    synopsis = (
        "--control URL [--control URL...] [--config FILE.toml] [--listen ENDPOINT]"
    )

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self["control"] = []

    def opt_control(self, value: str) -> None:
        """
        A control plane's admin API, http(s)://host:port; repeat it (or
        give a comma list) for a leader and its standbys.  Its admin key
        comes from $LLMGW_CONTROL_KEY (none needed on loopback).
        """
        self["control"].extend(u.strip() for u in value.split(",") if u.strip())

    optParameters = [
        ["config", "c", None, "TOML configuration file ([router], [store], [auth])."],
        ["listen", None, None, "Client API listener (default: the config's listen)."],
        ["control-ca", None, None, "PEM CA file for an https --control."],
        ["log-format", None, None, "text (default) or json."],
        ["state-dir", None, None, "Folder of the SQLite store (as llmgw-server)."],
        [
            "routers",
            None,
            None,
            "Routers sharing each key's limits without [limits] url (as"
            " [limits] routers; the larger of the two counts).",
            int,
        ],
        [
            "parent-pid",
            None,
            None,
            "Exit when this process is no longer the parent (a server's worker).",
            int,
        ],
    ]
    optFlags = [
        [
            "reuse-port",
            None,
            "Listen with SO_REUSEPORT, beside other routers on the same tcp port.",
        ]
    ]

    def postOptions(self) -> None:
        try:
            self.config = self._config()
            if not self["control"]:
                raise ConfigError("--control URL is required")
        except ConfigError as e:
            sys.stderr.write(f"llmgw-router: config error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None

    def _config(self) -> ServerConfig:
        config = shared_flags(load_config(self["config"]), self)
        if self["routers"] is not None:
            if self["routers"] < 1:
                raise ConfigError("--routers: expected a whole number, at least 1")
            routers = max(config.limits_routers, self["routers"])
            config = replace(config, limits_routers=routers)
        # Its endpoints come from the control plane: the server's "nothing
        # to serve" check (finish_config) does not apply.
        return config


def _listen_reuse_port(reactor: Any, description: str, factory: Any) -> IListeningPort:
    host, port = tcp_address(description)
    try:
        sock = reuse_port_socket(host, port)
        sock.listen(1024)
    except OSError as e:
        raise ConfigError(f"listen: cannot listen on {description!r}: {e}") from None
    try:
        result: IListeningPort = reactor.adoptStreamPort(
            sock.fileno(), sock.family, factory
        )
    finally:
        # The reactor holds its own copy of the descriptor.
        sock.close()
    return result


class _Orphan(Service):
    """
    Stop the reactor once the server that started this worker is gone.
    """

    def __init__(self, reactor: Any, parent: int) -> None:
        self._reactor = reactor
        self._parent = parent
        self._check = LoopingCall(self._look)
        self._check.clock = reactor

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._check.start(1.0)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._check.running:
            self._check.stop()

    def _look(self) -> None:
        if os.getppid() != self._parent:
            log.warn("the server (pid {pid}) is gone: stopping", pid=self._parent)
            self._check.stop()
            self._reactor.stop()


def makeService(options: Options) -> IService:
    """
    Build the router's service tree; its stop follows the server's steps
    (L{llmgw.daemon.lifecycle.STOP_STEPS}) that apply: the listener, the
    drain, the watch, usage, the pools, the store.
    """
    from twisted.internet import reactor

    config: ServerConfig = options.config
    settings = config.router
    try:
        control = AdminClient.make(
            reactor,
            options["control"],
            os.environ.get(CONTROL_KEY_ENV, ""),
            options["control-ca"],
        )
        store = open_store(config.store_url, config.state_dir)
        key_rows, _ = store.prepare()
    except (ConfigError, StoreError, OSError, ValueError) as e:
        sys.stderr.write(f"llmgw-router: config error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    # [limits] and, on PostgreSQL, revocations pushed by NOTIFY, as the
    # server has them.
    keys, key_services = key_ring(store, config, reactor)  # type: ignore[arg-type]
    keys.load(key_rows)
    usage_writer = UsageWriter(
        store, reactor, config.usage_flush_interval, record_rows=config.record_usage
    )
    registry = CollectorRegistry()
    balancer = Balancer(reactor, settings.eject_cooldown)
    pool = EngineClient(
        reactor, settings.connect_timeout, settings.max_idle_connections
    )
    interval = settings.load_poll_interval
    load = LoadBoard(
        reactor, make_scraper(reactor, settings.connect_timeout, interval), interval
    )
    registry.register(LoadCollector(load))
    activator = RemoteActivator(
        reactor, control, balancer.serves, settings.activation_timeout or 60.0
    )

    key_follower = KeyFollower(keys, store)

    def apply(endpoints: list[Endpoint], names: dict[str, str], counter: int) -> None:
        balancer.set_endpoints(endpoints)
        load.set_endpoints(endpoints)
        activator.set_names(names)
        key_follower.saw(counter)

    follower = Follower(reactor, control, apply)
    keys.resolve = activator.resolve
    router = Router(
        reactor,
        balancer,
        pool,
        settings,
        RouterMetrics(registry),
        UsageSinks(LogUsageSink(), StoreUsageSink(usage_writer)),
        wall_clock=time.time,
        activator=activator,
        auth=keys,
    )
    router.load = load
    raise_open_file_limit(settings.max_connections)
    site = make_site(router.resource(), settings, reactor, router.cors)
    try:
        if options["reuse-port"]:
            port = _listen_reuse_port(reactor, config.listen, site)
        else:
            port = _listen(reactor, "listen", config.listen, site)
    except ConfigError as e:
        sys.stderr.write(f"llmgw-router: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    # Accept no client before the first state: a router that knows no
    # endpoint would answer 404 (beside another worker that knows them).
    # Connections wait in the kernel's backlog meanwhile.
    reading: Any = port
    reading.stopReading()
    follower.first.addCallback(lambda _: reading.startReading())
    top = Lifecycle()
    top.stop_once_on_signals(reactor)
    if config.log_format == "json":
        try:
            top.log_observer = json_observer(getattr(options, "parent", None))
        except OSError as e:
            sys.stderr.write(f"llmgw-router: cannot open the log file: {e}\n")
            raise SystemExit(1) from None
    top.add(LISTENERS, ListeningService(port))
    top.add(DRAIN, DrainService(router, settings.drain_timeout))
    top.add(RECONCILER, follower, activator, load)
    if options["parent-pid"]:
        top.add(RECONCILER, _Orphan(reactor, options["parent-pid"]))
    top.add(USAGE, usage_writer)
    top.add(POOLS, PoolService(pool), *key_services)
    top.add(STORE, StoreService(store))
    address = port.getHost()
    log.info(
        "llmgw-router: client API listening on {host}:{port} (pid {pid});"
        " following {control}",
        host=getattr(address, "host", address),
        port=getattr(address, "port", ""),
        pid=os.getpid(),
        control=", ".join(control.urls),
    )
    return top
