"""
C{llmgw-server --router-workers N}: N C{twistd llmgw-router} child
processes on the client API's port (C{SO_REUSEPORT}), following this
server's admin API, supervised: one that exits is started again (after a
back-off when it keeps failing), and all are stopped with the server.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.config import ServerConfig
from llmgw.config_checks import ConfigError
from llmgw.daemon.listen import ListenError
from llmgw.reactors import ISpawningReactor

log = Logger(namespace="llmgw.tier.workers")

MAX_BACKOFF = 10.0
"""
Seconds between restarts of a worker that keeps exiting, at most.
"""


def twistd() -> str:
    """
    @return: the C{twistd} of this Python, beside its executable.
    """
    return os.path.join(os.path.dirname(sys.executable), "twistd")


class _Child(ProcessProtocol):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.ended: Deferred[None] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)
        self.worker.ended(reason)


class Worker:
    """
    One router child, started again when it exits while its supervisor
    runs.
    """

    def __init__(self, supervisor: Workers, number: int) -> None:
        self.supervisor = supervisor
        self.number = number
        self.process: Any = None
        self.pid: int | None = None
        self.child: _Child | None = None
        self.started = 0.0
        self.backoff = 0.5
        self.restart: IDelayedCall | None = None

    def start(self) -> None:
        self.restart = None
        s = self.supervisor
        self.child = _Child(self)
        env = dict(os.environ)
        env["LLMGW_CONTROL_KEY"] = s.token
        self.started = time.monotonic()
        try:
            self.process = s.reactor.spawnProcess(
                self.child,
                s.argv[0],
                # Its server's pid now (after twistd's daemonizing fork): it
                # exits when orphaned, whatever killed the server.
                [*s.argv, "--parent-pid", str(os.getpid())],
                env=env,
                # Its log lines go where the server's go.
                childFDs={0: "w", 1: 1, 2: 2},
            )
        except OSError as e:
            # No fork (out of processes or memory): try again later.
            self.child = None
            self.ended(Failure(e))
            return
        self.pid = self.process.pid
        log.info(
            "router worker {number} started: pid {pid}",
            number=self.number,
            pid=self.pid,
        )

    def ended(self, reason: Failure) -> None:
        s = self.supervisor
        if not s.running:
            return
        if time.monotonic() - self.started > 30:
            self.backoff = 0.5
        log.warn(
            "router worker {number} (pid {pid}) ended: {why}; starting it again"
            " in {delay:.1f} s",
            number=self.number,
            pid=self.pid,
            why=reason.getErrorMessage(),
            delay=self.backoff,
        )
        self.restart = s.reactor.callLater(self.backoff, self.start)
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)

    def stop(self, grace: float) -> Deferred[None]:
        if self.restart is not None and self.restart.active():
            self.restart.cancel()
        child = self.child
        if child is None or child.ended.called:
            return Deferred.fromCoroutine(_done())
        try:
            self.process.signalProcess("TERM")
        except ProcessExitedAlready:
            return Deferred.fromCoroutine(_done())
        kill = self.supervisor.reactor.callLater(grace, self._kill)

        def cancel_kill(result: object) -> object:
            if kill.active():
                kill.cancel()
            return result

        return child.ended.addBoth(cancel_kill)

    def _kill(self) -> None:
        try:
            self.process.signalProcess(signal.SIGKILL)
        except ProcessExitedAlready:
            pass


def tcp_address(description: str) -> tuple[str, int]:
    """
    @param description: a C{tcp:PORT[:interface=HOST][:...]} endpoint.
    @return: its host (C{0.0.0.0} for none) and port.
    @raise ConfigError: not such an endpoint.
    """
    parts = description.split(":")
    if parts[0] != "tcp" or len(parts) < 2 or not parts[1].isdigit():
        raise ConfigError(
            f"listen: {description!r}: SO_REUSEPORT needs tcp:PORT[:interface=HOST]"
        )
    host = "0.0.0.0"
    for part in parts[2:]:
        if part.startswith("interface="):
            host = part[len("interface=") :]
    return host, int(parts[1])


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """
    @return: a TCP socket bound to C{host:port} with C{SO_REUSEPORT} (the
        kernel spreads connections over every listening socket of the
        group: Linux socket(7)), not yet listening, non-blocking.
    @raise OSError: the port is taken by a socket without it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


_held: list[Any] = []


class _Reserved:
    """
    The client API's port held for C{--router-workers}: bound with
    C{SO_REUSEPORT} and never listening, so that no connection comes here
    and the port stays this server's while a worker restarts.
    """

    def __init__(self, host: str, port: int) -> None:
        self.socket = reuse_port_socket(host, port)

    def getHost(self) -> Any:
        host, port = self.socket.getsockname()[:2]
        return IPv4Address("TCP", host, port)


def reserve_port(description: str) -> Any:
    """
    @return: the reserved client API port (L{_Reserved}), held for the life
        of the process.
    @raise ConfigError: not a tcp listener.
    @raise ListenError: the port is taken.
    """
    host, port = tcp_address(description)
    try:
        reserved = _Reserved(host, port)
    except OSError as e:
        raise ListenError(f"listen: cannot listen on {description!r}: {e}") from None
    _held.append(reserved)
    return reserved


def worker_argv(
    config_path: str | None, config: ServerConfig, reserved: Any, admin: Any
) -> list[str]:
    """
    @return: the command line of a router worker: the client API's port
        with SO_REUSEPORT, this server's admin API as its control plane.
    @raise ConfigError: the admin listener is not on TCP.
    """
    address = admin.getHost()
    host = getattr(address, "host", None)
    if host is None:
        raise ConfigError("--router-workers: the admin listener must be on tcp")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    bound = reserved.getHost()
    argv = [
        twistd(),
        "-n",
        "--pidfile=",
        "llmgw-router",
        "--listen",
        f"tcp:{bound.port}:interface={bound.host}",
        "--reuse-port",
        "--control",
        f"http://{host}:{address.port}",
        "--state-dir",
        config.state_dir,
        "--log-format",
        config.log_format,
        # Without [limits] url, each worker admits its share of every key's
        # limits.
        "--routers",
        str(config.router_workers),
    ]
    if config_path:
        argv += ["--config", os.path.abspath(config_path)]
    return argv


async def _done() -> None:
    return None


class Workers(Service):
    """
    @param argv: the workers' command line, C{twistd} first.
    @param token: the admin API's bearer token for the workers.
    @param grace: seconds a worker has to drain after SIGTERM, before
        SIGKILL.
    """

    def __init__(
        self,
        reactor: ISpawningReactor,
        count: int,
        argv: Sequence[str],
        token: str,
        grace: float,
    ) -> None:
        self.reactor = reactor
        self.argv = tuple(argv)
        self.token = token
        self.grace = grace
        self.workers = [Worker(self, n + 1) for n in range(count)]

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        for worker in self.workers:
            worker.start()

    def stopService(self) -> Deferred[Any]:
        super().stopService()  # type: ignore[no-untyped-call]
        return DeferredList([w.stop(self.grace) for w in self.workers])


def make_workers(
    reactor: ISpawningReactor,
    config_path: str | None,
    config: ServerConfig,
    ports: tuple[Any, Any],
    token: str,
) -> Workers:
    """
    The router workers of C{--router-workers}.

    @param ports: the client port L{reserve_port} reserved, and the admin
        listener the workers follow.
    @param token: the bearer token the admin listener's guard lets them in
        with (L{llmgw.admin.guard.AdminGuard}'s C{internal}).

    @raise ConfigError: the admin listener is not on TCP.
    """
    reserved, admin = ports
    argv = worker_argv(config_path, config, reserved, admin)
    grace = config.router.drain_timeout + 5
    return Workers(reactor, config.router_workers, argv, token, grace)
