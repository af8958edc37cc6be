"""
Leadership among control planes on one PostgreSQL: the server that holds a
session-level advisory lock leads (runs the reconciler, accepts agents);
the others stand by, retrying the lock every second or so, and answer an
agent's Register with the leader's address.

The lock is held by a dedicated connection (autocommit, no pool): PostgreSQL
releases a session's advisory locks when the session ends, so a leader that
dies (C{kill -9}: its socket closes at once) frees the lock for a standby
within one retry.  A leader that cannot show its connection alive within
C{lease} seconds stops leading at once: the lock may be gone with the
connection, and another server may lead already (PostgreSQL docs,
"Advisory Locks": session-level locks are "held until explicitly released
or the session ends").

The leader records its agent address in the table C{llmgw_leader} (one row)
for the standbys to name.
"""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.config import ServerConfig
from llmgw.control.agents import AgentHub
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.reactors import ILeaderReactor
from llmgw.store.base import Store

log = Logger(namespace="llmgw.server")

LOCK_KEY = 0x6C6C6D676C656164  # "llmglead"
"""
The advisory lock's 64-bit key: one per database, so one leader per
database.  Not the store's migration lock (C{llmgw.store.pg}, "llmg"): a
transaction lock waits on a session lock of the same key, so a server
starting beside a leader would wait forever to migrate.
"""

CREATE = (
    "CREATE TABLE IF NOT EXISTS llmgw_leader ("
    " id integer PRIMARY KEY CHECK (id = 1),"
    " agent_address text NOT NULL,"
    " since timestamptz NOT NULL DEFAULT now())"
)
RECORD = (
    "INSERT INTO llmgw_leader (id, agent_address) VALUES (1, %s)"
    " ON CONFLICT (id) DO UPDATE SET agent_address = excluded.agent_address,"
    " since = now()"
)
READ = "SELECT agent_address FROM llmgw_leader WHERE id = 1"


class Connection(Protocol):
    """
    What is used of a psycopg 3 connection (autocommit).
    """

    def execute(self, query: str, params: Any = None) -> Any: ...

    def close(self) -> None: ...


def connect_postgres(url: str) -> Callable[[], Connection]:
    """
    @param url: a libpq URL, C{postgresql://user@host:port/db}.
    @return: opens the dedicated connection: autocommit, a 5 s connect
        timeout, and TCP keepalives and C{tcp_user_timeout} (libpq
        parameters) so that a cut path fails a check within seconds
        rather than TCP's minutes.
    """

    def connect() -> Connection:
        import psycopg

        connection: Connection = psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=5,
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=2,
            tcp_user_timeout=5000,
            application_name="llmgw-server",
        )
        return connection

    return connect


class Leadership(Service):
    """
    Takes and holds the leader's lock; each step (connect, try the lock,
    check the connection) runs in a thread, one at a time, every
    C{retry} seconds.

    @param clock: the reactor's clock.
    @param in_thread: runs a blocking call off the reactor thread.
    @param connect: opens the dedicated connection (L{connect_postgres}).
    @param address: C{HOST:PORT} agents dial to reach this server.
    @param on_lead: called on the reactor thread when this server leads.
    @param on_lost: called on the reactor thread when it stops leading:
        its connection failed or was not shown alive for C{lease} seconds.
    @param loop: a service run only while leading (the reconciler): stopped
        when leadership is lost and when this service stops.
    @ivar leading: whether this server leads now.
    @ivar lost: whether it led and lost the lead: then it never leads
        again (its process ends).
    @ivar leader: the leader's agent address as last read (this server's
        when it leads; empty when unknown).
    """

    def __init__(
        self,
        clock: IReactorTime,
        in_thread: Callable[[Callable[[], Any]], Deferred[Any]],
        connect: Callable[[], Connection],
        address: str,
        on_lead: Callable[[], None],
        on_lost: Callable[[str], None],
        retry: float = 1.0,
        lease: float = 5.0,
        loop: IService | None = None,
    ) -> None:
        self._clock = clock
        self._in_thread = in_thread
        self._connect = connect
        self.address = address
        self._on_lead = on_lead
        self._on_lost = on_lost
        self._retry = retry
        self._lease = lease
        self._connection: Connection | None = None
        self._busy = False
        self._loop: LoopingCall | None = None
        self._last_alive = 0.0
        self._warned = False
        self.loop = loop
        self.leading = False
        self.lost = False
        self.leader = ""

    def status(self) -> dict[str, object]:
        """
        @return: C{{"leading": bool, "leader": "HOST:PORT"}}, as the admin
            API's status tells it (the leader empty while unknown).
        """
        return {"leading": self.leading, "leader": self.leader}

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._loop = LoopingCall(self._tick)
        self._loop.clock = self._clock
        self._loop.start(self._retry, now=True)

    def stopService(self) -> Deferred[None]:
        """
        Stop trying; the reconciler stops (fires when its pass is over),
        then the connection closes, so that a standby leads at once.
        """
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        stopped: Deferred[Any] = succeed(None)
        if self.loop is not None and self.loop.running:
            stopped = Deferred.fromCoroutine(_stop(self.loop))

        def close(_: object) -> Deferred[Any] | None:
            connection, self._connection = self._connection, None
            if connection is None:
                return None
            return self._in_thread(connection.close).addErrback(lambda _: None)

        return stopped.addCallback(close)

    def _tick(self) -> None:
        if self.leading and self._clock.seconds() - self._last_alive > self._lease:
            self._lose(f"connection not shown alive for {self._lease:g}s")
            return
        if self._busy:
            return
        self._busy = True
        d = self._in_thread(self._step)
        d.addCallbacks(self._stepped, self._failed)

    def _step(self) -> tuple[bool, str]:
        """
        In a thread: connect when needed; if not leading, try the lock (and
        record this server's address once held) or read the leader's; if
        leading, show the connection alive.

        @return: whether this server holds the lock, and the leader's
            address.
        """
        if self._connection is None:
            connection = self._connect()
            connection.execute(CREATE)
            self._connection = connection
        if self.leading:
            self._connection.execute("SELECT 1")
            return True, self.address
        (held,) = self._connection.execute(
            "SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)
        ).fetchone()
        if held:
            self._connection.execute(RECORD, (self.address,))
            return True, self.address
        row = self._connection.execute(READ).fetchone()
        return False, row[0] if row else ""

    def _stepped(self, result: tuple[bool, str]) -> None:
        self._busy = False
        self._warned = False
        if not self.running or self.lost:
            # A check that ended after the lease ran out changes nothing.
            return
        held, self.leader = result
        self._last_alive = self._clock.seconds()
        if held and not self.leading:
            self.leading = True
            log.info(
                "leading: holds the leader lock; agents dial {address}",
                address=self.address,
            )
            self._on_lead()
            if self.loop is not None and not self.loop.running:
                self.loop.startService()

    def _failed(self, reason: Failure) -> None:
        self._busy = False
        connection, self._connection = self._connection, None
        if connection is not None:
            self._in_thread(connection.close).addErrback(lambda _: None)
        if not self.running or self.lost:
            return
        if self.leading:
            self._lose(reason.getErrorMessage())
        elif not self._warned:
            # Once per outage, not every second.
            self._warned = True
            log.warn(
                "standby: cannot reach the leader lock's database: {error}",
                error=reason.getErrorMessage(),
            )

    def _lose(self, why: str) -> None:
        self.lost = True
        self.leading = False
        self.leader = ""
        log.error("lost leadership: {why}", why=why)
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self.loop is not None and self.loop.running:
            self.loop.stopService()
        self._on_lost(why)


async def _stop(service: IService) -> None:
    await maybeDeferred(service.stopService)


def advertised(configured: str, port: Any) -> str:
    """
    @param configured: C{[standby] advertise}, or empty.
    @param port: the agent listener's port, or L{None} (no agents).
    @return: C{HOST:PORT} agents dial to reach this server: the configured
        one, else the bound address with the host's name for a wildcard.
    """
    if configured or port is None:
        return configured
    address = port.getHost()
    host = getattr(address, "host", "")
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{getattr(address, 'port', 0)}"


@dataclass(frozen=True)
class Leading:
    """
    What runs in the server's reconciler step, and what its admin API
    tells of it.

    @ivar services: the reconciler, or the L{Leadership} that starts it.
    @ivar standby: with standbys, the L{Leadership}'s status; L{None} for
        a server alone.
    """

    services: list[IService]
    standby: Callable[[], dict[str, object]] | None = None


def leading_services(
    reactor: ILeaderReactor,
    config: ServerConfig,
    hub: AgentHub,
    plane: ControlPlane,
    agent_port: Any,
    store: Store | None,
    runner: IService | None = None,
) -> Leading:
    """
    What runs in the server's reconciler step: the reconciler (and the
    batches' C{runner}, given one) itself when no PostgreSQL chooses a
    leader (no C{leader_lock_url}), else a L{Leadership} that starts them
    on taking the lock and stops them on losing it.

    A standby refuses each agent's Register with a Redirect naming the
    leader.  On taking the lock the startup grace starts afresh, so that
    the agents' Registers adopt their running engines before anything is
    placed (L{llmgw.control.adoption}), and the drains the old leader kept
    are read again from C{store}.  The admin API's status tells whether
    this server leads, and the leader (L{Leading.standby}).  On losing it
    the server stops leading at once (its agent links closed, Registers
    refused) and its process ends with status 75, for systemd to start it
    again as a standby (C{Restart=on-failure}).
    """
    url, settings = config.leader_lock_url, config.standby
    if not url:
        return Leading([plane.loop] if runner is None else [plane.loop, runner])
    led: IService = plane.loop
    if runner is not None:
        led = MultiService()
        plane.loop.setServiceParent(led)  # type: ignore[no-untyped-call]
        runner.setServiceParent(led)

    def lead() -> None:
        plane.begin_grace()

        def accept(_: object) -> None:
            hub.lead()

        # Registers once the drains the old leader kept are known.
        relearn_drains(store, plane.inventory).addBoth(accept)

    def lost(why: str) -> None:
        hub.stop_leading()
        for link in list(hub.links.values()):
            link.close()
        log.error("this server stops: it no longer leads (exit status 75)")
        atexit.register(os._exit, 75)
        try:
            reactor.stop()
        except ReactorNotRunning:
            pass  # Stopping already: the exit status is set all the same.

    leadership = Leadership(
        reactor,
        lambda call: deferToThreadPool(reactor, reactor.getThreadPool(), call),
        connect_postgres(url),
        advertised(settings.advertise, agent_port),
        lead,
        lost,
        retry=settings.retry,
        lease=settings.lease,
        loop=led,
    )
    hub.follow(lambda: leadership.leader)
    log.info(
        "standby: leader chosen by an advisory lock on {url}",
        url=_without_password(url),
    )
    return Leading([leadership], leadership.status)


def relearn_drains(store: Store | None, inventory: Inventory) -> Deferred[None]:
    """
    On taking the lead: the drained nodes read again from the store (the
    old leader drained or undrained nodes since this server started), in
    place of what C{prepare} read.  A store that cannot be read now
    leaves those, with a warning.

    @return: fires with L{None} once known (never fails).
    """
    if store is None:
        return succeed(None)

    def learnt(drained: dict[str, float]) -> None:
        inventory.relearn_drained(drained)

    def failed(failure: Failure) -> None:
        log.warn(
            "the drained nodes cannot be read now ({error}); those read at"
            " start are kept",
            error=failure.getErrorMessage(),
        )

    return store.drains().addCallbacks(learnt, failed)


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
