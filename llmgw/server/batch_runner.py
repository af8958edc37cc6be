"""
The batches' runner as the server builds it: its loopback listener on the
client API's router (L{llmgw.router.edge.internal}), opened at start with a
secret made for this process, the client that sends it the lines, the room
it asks, and the runner, which the server runs only while it leads
(L{llmgw.server.standby.leading_services}).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger

from llmgw.batches.dispatch import LineSender
from llmgw.batches.ends import BatchEnds
from llmgw.batches.room import EngineRoom
from llmgw.batches.runner import Runner, RunnerSettings
from llmgw.config import ServerConfig
from llmgw.daemon.listen import ListenError, listen
from llmgw.daemon.wiring import fail, host_and_port
from llmgw.reactors import IDaemonReactor
from llmgw.router.api.app import Router
from llmgw.router.edge.internal import runner_site
from llmgw.router.interfaces import BatchRoom
from llmgw.store.base import Store
from llmgw.store.usage import UsageWriter
from llmgw.tier.build import ClientAPI

log = Logger(namespace="llmgw.server")

RUNNER_LISTEN = "tcp:0:interface=127.0.0.1"
"""
The runner's listener: a port of the kernel's choosing, on loopback only.
"""


@dataclass(frozen=True)
class BatchLines:
    """
    @ivar port: the runner's loopback listener, open.
    @ivar sender: the runner's client to it (its kept connections).
    @ivar runner: the runner, started and stopped with the lead.
    """

    port: IListeningPort
    sender: LineSender
    runner: Runner


def batch_lines(
    reactor: IDaemonReactor,
    config: ServerConfig,
    store: Store,
    router: Router,
    room: BatchRoom,
    resolve: Callable[[str], str | None],
    usage: UsageWriter,
    program: str,
) -> BatchLines:
    """
    Open the runner's loopback listener (a failure ends the process) and
    build the runner that sends to it.

    @param router: the client API's router: the runner's listener serves
        its resource, as the client listener does.
    @param room: how many lines of a model may be in flight now, by its
        engines' load (L{llmgw.batches.room.EngineRoom}).
    @param resolve: the catalog's model for a name or alias.
    @param usage: the usage writer, which the runner has write a line's
        record before it ends the line.
    """
    secret = secrets.token_urlsafe(32).encode("ascii")
    site = runner_site(router.resource(), config.router, reactor, secret)
    try:
        port = listen(reactor, "batch runner listener", RUNNER_LISTEN, site)
    except ListenError as e:
        fail(program, str(e), 1)
    settings = RunnerSettings(
        concurrency=config.batches.max_lines_in_flight,
        stop_timeout=config.router.drain_timeout,
    )
    _, number = host_and_port(port.getHost())
    sender = LineSender(reactor, number, secret, settings.concurrency)
    ends = BatchEnds(store, time.time)
    runner = Runner(reactor, store, sender, room, resolve, ends, usage.flush, settings)
    log.info("batch runner: its loopback listener on 127.0.0.1:{port}", port=number)
    return BatchLines(port, sender, runner)


class RunnerStop(Service):
    """
    Stops the runner (if it runs) with the listeners, before the router's
    drain: it sends no new line while the requests in flight finish.
    """

    def __init__(self, runner: Runner) -> None:
        self._runner = runner

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        return self._runner.stopService()


def batch_room(
    reactor: IDaemonReactor, config: ServerConfig, api: ClientAPI
) -> EngineRoom:
    """
    @return: the room batch lines get beside each model's interactive
        traffic (L{llmgw.batches.room}), read from C{api}'s replicas and
        engine load (none when C{load_poll_interval} is 0), keeping
        C{[batches] interactive_ttft_share}; it is also a usage sink, to
        be given every finished request's record.
    """
    polled = config.router.load_poll_interval > 0
    return EngineRoom(
        reactor,
        api.balancer.replicas_of,
        api.load if polled else None,
        config.batches.interactive_ttft_share,
    )
