"""
The server's lifecycle: its services started, and stopped as a named
sequence of steps, each logged with its duration (C{"stopping: router
drain"}, then C{"stopped: router drain in 0.012s"}).

The order (L{STOP_STEPS}) is what keeps a stop clean: nothing new comes in
while the requests in flight finish; the reconciler keeps serving them
(starting a replica a request waits for) until they are done; the agents'
links close before the local engines stop, so that their ends are not
reported as failures; usage is written before the store closes; the
upstream pool closes under no stream.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any, Protocol

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.logger import ILogObserver, Logger
from twisted.python.components import Componentized

from llmgw.reactors import ISignalReactor

log = Logger(namespace="llmgw.server")

LISTENERS = "listeners stop accepting"
DRAIN = "router drain"
RECONCILER = "reconciler stop"
AGENT_LINKS = "agent links closed"
USAGE = "usage flushed"
LOCAL_ENGINES = "local engines stopped"
POOLS = "connection pools closed"
STORE = "store closed"

STOP_STEPS: tuple[str, ...] = (
    LISTENERS,
    DRAIN,
    RECONCILER,
    AGENT_LINKS,
    USAGE,
    LOCAL_ENGINES,
    POOLS,
    STORE,
)
"""
The server's stop, in order; every step is logged, an empty one too (a
server without C{--local} stops no local engine).
"""


class Lifecycle(MultiService):
    """
    The server's top service: starts its children last step first (the
    store before the pool, the listeners last), and stops them step by step
    in L{STOP_STEPS} order, each step once the one before has finished, the
    services of a step one after the other in the order given.

    A failure to stop one service is logged and the stop goes on.

    @param clock: times the steps (C{seconds()}); by default the monotonic
        clock.
    @param log_observer: the log observer of the twistd application this
        service joins, or L{None} for twistd's own (twistd's
        C{AppLogger.start} reads the application's L{ILogObserver}
        component).
    """

    _signal_reactor: ISignalReactor | None = None

    def __init__(
        self,
        clock: IReactorTime | None = None,
        log_observer: ILogObserver | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.log_observer = log_observer
        self._seconds: Callable[[], float] = (
            clock.seconds if clock is not None else time.monotonic
        )
        self._steps: dict[str, list[IService]] = {name: [] for name in STOP_STEPS}

    def setServiceParent(self, parent: Any) -> Any:
        if self.log_observer is not None and isinstance(parent, Componentized):
            parent.setComponent(ILogObserver, self.log_observer)
        return super().setServiceParent(parent)  # type: ignore[no-untyped-call]

    def add(self, step: str, *services: IService) -> None:
        """
        Add C{services} to C{step}, after those it has.

        @raise KeyError: C{step} is not one of L{STOP_STEPS}.
        """
        self._steps[step].extend(services)
        for service in services:
            service.setServiceParent(self)

    def steps(self) -> list[tuple[str, list[IService]]]:
        """
        @return: each step of L{STOP_STEPS} with its services, in order.
        """
        return [(step, list(self._steps[step])) for step in STOP_STEPS]

    def stop_once_on_signals(self, reactor: ISignalReactor) -> None:
        """
        Once C{reactor} runs, make a repeated SIGTERM or SIGINT during the
        stop harmless (see L{stop_once_on_signals}).
        """
        self._signal_reactor = reactor

    def startService(self) -> None:
        Service.startService(self)
        if self._signal_reactor is not None:
            reactor = self._signal_reactor
            # After startup: the reactor installs its own handlers first.
            reactor.callWhenRunning(stop_once_on_signals, reactor)
        for step in reversed(STOP_STEPS):
            for service in self._steps[step]:
                service.startService()

    def stopService(self) -> Deferred[None]:
        Service.stopService(self)
        return Deferred.fromCoroutine(self._stop_in_order())

    async def _stop_in_order(self) -> None:
        for step in STOP_STEPS:
            log.info("stopping: {step}", step=step)
            began = self._seconds()
            for service in self._steps[step]:
                if not service.running:
                    continue
                try:
                    await maybeDeferred(service.stopService)
                except Exception:
                    log.failure("stopping {service}", service=service)
            log.info(
                "stopped: {step} in {seconds:.3f}s",
                step=step,
                seconds=self._seconds() - began,
            )


class ListeningService(Service):
    """
    Owns a port that is already listening; stops listening on stop.
    """

    def __init__(self, port: IListeningPort) -> None:
        self._port = port

    def stopService(self) -> Deferred[None] | None:
        super().stopService()  # type: ignore[no-untyped-call]
        return self._port.stopListening()


class _Drains(Protocol):
    def drain(self, timeout: float) -> Deferred[None]: ...


class DrainService(Service):
    """
    On stop, after the listeners closed, lets the router's requests in
    flight finish (bounded by C{[router] drain_timeout}).
    """

    def __init__(self, router: _Drains, timeout: float) -> None:
        self._router = router
        self._timeout = timeout

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        return self._router.drain(self._timeout)


class _Closes(Protocol):
    def close(self) -> None: ...


class StoreService(Service):
    """
    Closes the database on stop.
    """

    def __init__(self, store: _Closes) -> None:
        self._store = store

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        self._store.close()


class _Pool(Protocol):
    def closeCachedConnections(self) -> Deferred[None]: ...


class PoolService(Service):
    """
    Closes an HTTP connection pool's idle connections on stop (a
    L{twisted.web.client.HTTPConnectionPool} or the router's
    L{llmgw.router.upstream.engine_client.EngineClient}).
    """

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        return self._pool.closeCachedConnections()


class _HasLinks(Protocol):
    @property
    def links(self) -> dict[str, Any]: ...


class LinksService(Service):
    """
    Closes the agent links of a hub on stop (each agent then dials again,
    with its backoff, until a server is back), and fires once they are all
    gone, or after C{timeout} seconds, when those left are aborted.

    @param hub: an L{llmgw.control.agents.AgentHub}: C{links} maps a node id
        to its current link, and loses it when the link is lost.
    @param clock: for the polling and the timeout.
    @param timeout: seconds the links have to close cleanly (a TLS close
        needs the peer's answer).
    """

    def __init__(self, hub: _HasLinks, clock: IReactorTime, timeout: float = 5.0):
        self._hub = hub
        self._clock = clock
        self._timeout = timeout

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        links = [
            link for link in self._hub.links.values() if link.transport is not None
        ]
        if not links:
            return succeed(None)
        log.info("closing {count} agent links", count=len(links))
        for link in links:
            link.transport.loseConnection()
        return Deferred.fromCoroutine(self._wait(links))

    async def _wait(self, links: Sequence[Any]) -> None:
        deadline = self._clock.seconds() + self._timeout
        while self._open(links) and self._clock.seconds() < deadline:
            await _sleep(self._clock, 0.05)
        for link in self._open(links):
            link.transport.abortConnection()

    def _open(self, links: Iterable[Any]) -> list[Any]:
        current = set(map(id, self._hub.links.values()))
        return [link for link in links if id(link) in current]


def _sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    clock.callLater(seconds, d.callback, None)
    return d


def stop_once_on_signals(reactor: ISignalReactor) -> None:
    """
    Wrap the reactor's SIGTERM and SIGINT handlers so that a signal once the
    stop began is logged, not acted on.

    Twisted's handlers call C{reactor.stop()} for every signal; a second
    one while the server drains raised
    L{twisted.internet.error.ReactorNotRunning}, logged as critical with a
    traceback.  Two come whenever a process group is
    stopped as a whole (C{kill -TERM -PGID}, a supervisor): one to twistd
    itself and one forwarded by C{scripts/run-local}.  The first signal
    still goes to Twisted's handler (its log line, and the exit status
    twistd gives by re-raising it).  Only the reactor's own handlers are
    wrapped (none under trial, nor one another component set).

    @param reactor: a running reactor with its signal handlers installed.
    """
    stopping = False

    def began() -> None:
        nonlocal stopping
        stopping = True

    reactor.addSystemEventTrigger("before", "shutdown", began)

    def wrap(twisted_handler: Callable[[int, FrameType | None], None]) -> Any:
        def handler(number: int, frame: FrameType | None) -> None:
            nonlocal stopping
            if stopping:
                reactor.callFromThread(
                    log.info,
                    "{signal} while stopping: already stopping",
                    signal=signal.Signals(number).name,
                )
                return
            stopping = True
            twisted_handler(number, frame)

        return handler

    for number, name in ((signal.SIGTERM, "sigTerm"), (signal.SIGINT, "sigInt")):
        twisted_handler = getattr(reactor, name, None)
        if twisted_handler is not None and signal.getsignal(number) == twisted_handler:
            signal.signal(number, wrap(twisted_handler))
