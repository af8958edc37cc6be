"""
C{twistd llmgw-router}: the client API alone (issue 12 item 2), following a
control plane's endpoints and catalog through its admin API's watch
(L{llmgw.tier.follow}), forwarding activations to it
(L{llmgw.tier.activate}), reporting its traffic to it
(L{llmgw.tier.report}), reading keys from the shared store and writing
its own usage records there.  No agents, no reconciler, no dashboard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from twisted.application.service import IService, Service
from twisted.internet.interfaces import (
    IListeningPort,
    IReactorSocket,
    IReactorTime,
)
from twisted.internet.protocol import ServerFactory
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.server import Site

from llmgw.batches.api import with_batches
from llmgw.config import ServerConfig, load_config, shared_flags
from llmgw.config_checks import ConfigError
from llmgw.daemon.lifecycle import (
    DRAIN,
    LISTENERS,
    POOLS,
    RECONCILER,
    STORE,
    USAGE,
    DrainService,
    ListeningService,
    PoolService,
    StoreService,
)
from llmgw.daemon.listen import ListenError
from llmgw.daemon.listen import listen as _listen
from llmgw.daemon.wiring import fail, host_and_port, top_service
from llmgw.reactors import IDaemonReactor, global_reactor
from llmgw.router.api.batch_api import upload_paths
from llmgw.router.edge.site import make_site
from llmgw.router.interfaces import Endpoint, Readiness
from llmgw.router.telemetry.reports import Reporter
from llmgw.store.base import Store
from llmgw.store.db import StoreError, open_store
from llmgw.tier.activate import RemoteActivator
from llmgw.tier.admin_client import AdminClient
from llmgw.tier.build import Accounts, ClientAPI, client_api, serve
from llmgw.tier.follow import Follower
from llmgw.tier.keys import KeyFollower
from llmgw.tier.report import TrafficReports
from llmgw.tier.workers import reuse_port_socket, tcp_address

log = Logger(namespace="llmgw.router")

PROGRAM = "llmgw-router"

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
            fail(PROGRAM, f"config error: {e}", 2)

    def _config(self) -> ServerConfig:
        config = shared_flags(load_config(self["config"]), self)
        if self["routers"] is not None:
            # Checked here, not by twistd: its refusal is a usage text.
            try:
                count = int(self["routers"])
            except ValueError:
                count = 0
            if count < 1:
                raise ConfigError("--routers: expected a whole number, at least 1")
            routers = max(config.limits_routers, count)
            config = replace(config, limits_routers=routers)
        # Its endpoints come from the control plane: the server's "nothing
        # to serve" check (finish_config) does not apply.
        return config


def _listen_reuse_port(
    reactor: IReactorSocket, description: str, factory: ServerFactory[Any]
) -> IListeningPort:
    host, port = tcp_address(description)
    try:
        sock = reuse_port_socket(host, port)
        sock.listen(1024)
    except OSError as e:
        raise ListenError(f"listen: cannot listen on {description!r}: {e}") from None
    try:
        result = reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
    finally:
        # The reactor holds its own copy of the descriptor.
        sock.close()
    return result


class _Orphan(Service):
    """
    Stop the reactor once the server that started this worker is gone.
    """

    def __init__(
        self, clock: IReactorTime, stop: Callable[[], None], parent: int
    ) -> None:
        """
        @param stop: stops the reactor.
        @param parent: the server's process id.
        """
        self._stop = stop
        self._parent = parent
        self._check = LoopingCall(self._look)
        self._check.clock = clock

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
            self._stop()


def _follow(
    reactor: IDaemonReactor,
    control: AdminClient,
    api: ClientAPI,
    activator: RemoteActivator,
    account: Accounts,
    store: Store,
    readiness: Readiness,
) -> Follower:
    """
    @return: the watch that feeds the balancer, the load board, the
        activator's names, the key changes and C{readiness}.
    """
    key_follower = KeyFollower(account.keys, store)

    def apply(endpoints: list[Endpoint], names: dict[str, str], counter: int) -> None:
        api.balancer.set_endpoints(endpoints)
        api.load.set_endpoints(endpoints)
        activator.set_names(names)
        key_follower.saw(counter)

    return Follower(reactor, control, apply, readiness.set)


def _open(
    reactor: IDaemonReactor, options: Options
) -> tuple[AdminClient, Store, list[dict[str, Any]]]:
    """
    @return: the client of the control planes' admin APIs, the store, and
        the keys' rows read from it.
    """
    config: ServerConfig = options.config
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
        fail(PROGRAM, f"config error: {e}", 2)
    return control, store, key_rows


def _listener(
    reactor: IDaemonReactor, options: Options, site: Site, follower: Follower
) -> IListeningPort:
    """
    @return: the client API's port, accepting no client before the first
        state: a router that knows no endpoint would answer 404 (beside
        another worker that knows them).  Connections wait in the kernel's
        backlog meanwhile.
    """
    listen = options.config.listen
    try:
        if options["reuse-port"]:
            port = _listen_reuse_port(reactor, listen, site)
        else:
            port = _listen(reactor, "listen", listen, site)
    except ListenError as e:
        fail(PROGRAM, str(e), 1)
    except ConfigError as e:
        fail(PROGRAM, f"config error: {e}", 2)
    reading: Any = port
    reading.stopReading()
    follower.first.addCallback(lambda _: reading.startReading())
    return port


def makeService(options: Options) -> IService:
    """
    Build the router's service tree; its stop follows the server's steps
    (L{llmgw.daemon.lifecycle.STOP_STEPS}) that apply: the listener, the
    drain, the watch, usage, the pools, the store.
    """
    reactor = global_reactor()
    config: ServerConfig = options.config
    settings = config.router
    control, store, key_rows = _open(reactor, options)
    api = client_api(reactor, config, PROGRAM)
    timeout = settings.activation_timeout or 60.0
    activator = RemoteActivator(reactor, control, api.balancer.serves, timeout)
    readiness = Readiness()
    # Its traffic counted on the server's /metrics and dashboard too.
    reporter = Reporter(api.metrics.collectors(), activator.resolve)
    account, router = serve(
        reactor, api, config, store, key_rows, activator, readiness, (reporter,)
    )
    follower = _follow(reactor, control, api, activator, account, store, readiness)
    client = with_batches(
        reactor, router, store, account.keys, activator.resolve, config.batches
    )
    site = make_site(
        client,
        settings,
        reactor,
        router.cors,
        upload_paths(config.batches.max_file_size),
    )
    port = _listener(reactor, options, site, follower)
    top = top_service(
        reactor, PROGRAM, config.log_format, getattr(options, "parent", None)
    )
    top.add(LISTENERS, ListeningService(port))
    top.add(DRAIN, DrainService(router, settings.drain_timeout))
    top.add(RECONCILER, follower, activator, api.load)
    if options["parent-pid"]:
        top.add(RECONCILER, _Orphan(reactor, reactor.stop, options["parent-pid"]))
    top.add(USAGE, account.usage, TrafficReports(reactor, control, reporter))
    top.add(POOLS, PoolService(api.pool), *account.services)
    if api.tracing is not None:
        top.add(POOLS, api.tracing)
    top.add(STORE, StoreService(store))
    host, port_number = host_and_port(port.getHost())
    log.info(
        "llmgw-router: client API listening on {host}:{port} (pid {pid});"
        " following {control}",
        host=host,
        port=port_number,
        pid=os.getpid(),
        control=", ".join(control.urls),
    )
    return top
