"""
What an engine says of itself, asked every second: its health route
and, in sleep mode, whether it sleeps (L{Liveness}).  Its process alone
says too little: vLLM's API server serves on after its C{EngineCore} died
(C{/health} answers 503 until it ends itself, up to 5 s later), and an
engine put to sleep behind llmgw's back (C{POST /sleep} on its port) keeps
every request waiting while its process runs on.

Facts from vLLM's code (vLLM 0.32, installed by C{scripts/setup-vllm}):
C{vllm/entrypoints/serve/instrumentator/health.py} answers C{GET /health}
503 once the engine client raises C{EngineDeadError}, 200 otherwise (a
sleeping engine included); C{vllm/v1/engine/exceptions.py} gives that
error's message, C{"EngineCore encountered an issue. See stack trace
(above) for the root cause."}; C{vllm/v1/engine/core_client.py} logs
C{"[shutdown] MPClient: engine core exited unexpectedly; starting
cleanup"} when its engine core process ends; C{vllm/entrypoints/launchers/
launcher.py} ends the server at its watchdog's next look (every 5 s), or
at once after a request it answered with that error
(C{terminate_if_errored}): 0 to 5 s after the death, with code 0.
That end can itself hang: the server stops listening, then waits for its
requests in flight, and a utility call (C{GET /is_sleeping}, C{POST
/sleep}, C{POST /v1/load_lora_adapter}) sent as the engine core died
waits for ever, C{vllm/v1/engine/core_client.py} failing only the
generation queue, never C{utility_results}.  Its port then refuses every
connection while its process lives on: L{REFUSED_DEAD} refusals in a row
are its death too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import (
    ConnectError,
    ConnectionDone,
    ConnectionLost,
    ConnectionRefusedError,
    DNSLookupError,
)
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    PartialDownloadError,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
    readBody,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from llmgw.agent.engines import CommandRefused
from llmgw.agent.sleep import EngineRoutes
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb

INTERVAL = 1.0
"""
Seconds between two questions to a watched engine.
"""

ASK_TIMEOUT = 5.0
"""
Seconds one question may take: a busy engine answers its health route
late, and a late answer says nothing.
"""

NO_ANSWER = (
    ConnectError,
    DNSLookupError,
    ConnectionLost,
    ConnectionDone,
    ResponseFailed,
    ResponseNeverReceived,
    RequestTransmissionFailed,
    PartialDownloadError,
    TimeoutError,
    CancelledError,
    CommandRefused,
)
"""
The ways a question goes unanswered (refused, cut, timed out, the node's
name not resolved, an engine that cannot say): nothing to log.  Anything
else is a fault of the agent's, logged.
"""

WATCHED = (
    pb.SHARD_STATE_READY,
    pb.SHARD_STATE_SLEEPING,
    pb.SHARD_STATE_WAKING,
)
"""
The states a shard's engine is asked in: its health in all three, whether
it sleeps when C{ready} only.
"""

REFUSED_DEAD = 3
"""
Questions in a row whose connection a watched engine's port refused (no
listener: an engine that stopped serving, its process still running) that
make it dead.  Busy or slow answers never count: only a refusal.
"""

_DEAD_ERROR = re.compile(r"(?:^|\] )vllm\.v1\.engine\.exceptions\.EngineDeadError: ")
"""
The last line of the traceback vLLM logs for its C{EngineDeadError}, as
its logger writes it: at the line's start or after its prefix's
C{[file.py:line] }, so that a prompt quoted in a request's log line
(C{--enable-log-requests}) is not taken for it.
"""

ENGINE_DEAD = re.compile(
    r"(?:^|\] )(?:vllm\.v1\.engine\.exceptions\.EngineDeadError: |\[shutdown\]"
    r" MPClient: engine core exited unexpectedly|Worker proc \S+ died unexpectedly"
    r"|RayWorkerProc rank=\S+ died unexpectedly)"
)
"""
vLLM's lines saying its engine core or a worker is gone (see the module's
docstring; C{vllm/v1/executor/multiproc_executor.py} and
C{ray_executor_v2.py} for a worker), as its logger writes them.
"""

LINE_LIMIT = 300
"""
Characters of an engine's line kept in a reason.
"""


def engine_line(output: Sequence[str], fallback: str) -> str:
    """
    @param output: the engine's last output lines, oldest first (vLLM's or
        the simulator's: other engines' lines are not read).
    @param fallback: said when no line of the engine says it.
    @return: the engine's own line saying it is dead, cut to
        L{LINE_LIMIT} characters: the last C{EngineDeadError} line, or
        else the last of L{ENGINE_DEAD}'s; else C{fallback}.
    """
    found = [line for line in output if _DEAD_ERROR.search(line)] or [
        line for line in output if ENGINE_DEAD.search(line)
    ]
    return found[-1].strip()[:LINE_LIMIT] if found else fallback


class WatchedShard(Protocol):
    """
    What L{Liveness} reads of its shard (L{llmgw.agent.shard.Shard}).
    """

    @property
    def id(self) -> str:
        """The shard's id."""

    @property
    def command(self) -> pb.StartShard:
        """What it was started with."""

    @property
    def state(self) -> int:
        """Its C{pb.ShardState}."""

    @property
    def busy(self) -> bool:
        """
        Whether the agent itself turns it (sleep, wake, a check) or stops
        it: what its engine says then is the agent's doing.
        """

    @property
    def stopping(self) -> bool:
        """Whether the agent stops it."""

    @property
    def log_lines(self) -> list[str]:
        """Its engine's output lines, as many as its log's end holds."""


class Liveness:
    """
    Asks an engine, every L{INTERVAL} seconds while its shard is
    L{WATCHED}, whether it still serves: its C{GET /health} answering 503
    means its engine is dead (C{dead} is called with the engine's own line,
    L{engine_line}), asleep or awake, and while the agent's own sleep or
    wake runs; its C{GET /is_sleeping} (vLLM, the simulator; asked until it
    answers 404) answering true while ready and the agent did not put it
    to sleep means someone else did (C{asleep} is called).
    An answer that does not come (busy, or the process gone, which the
    shard sees itself) says nothing; its port refusing the connection
    L{REFUSED_DEAD} times in a row, unless the agent stops it, means it
    stopped serving with its process alive (see the module's docstring):
    C{dead} is called too.  The two questions go their own ways: each is
    asked again once its last one is answered or dropped after
    L{ASK_TIMEOUT}, whatever the other does.

    @param shard: the shard watched.
    @param reactor: keeps time.
    @param http: the agent's HTTP client.
    @param health_url: the engine's health route where a 503 there means
        its death (vLLM, the sim), or C{""}: then nothing is asked.
    @param headers: sent with every question (its C{Authorization}).
    @param routes: its sleep routes (L{EngineRoutes}).
    @param dead: called once with the engine's line when it is dead.
    @param asleep: called when it was put to sleep outside the agent.
    """

    log = Logger()

    def __init__(
        self,
        shard: WatchedShard,
        reactor: IEngineReactor,
        http: IAgent,
        health_url: str,
        headers: dict[str, str],
        routes: Callable[[], EngineRoutes],
        dead: Callable[[str], None],
        asleep: Callable[[], None],
    ) -> None:
        self._shard = shard
        self._reactor = reactor
        self._http = http
        self._health_url = health_url
        self._headers = Headers({k.encode(): [v.encode()] for k, v in headers.items()})
        self._routes = routes
        self._dead = dead
        self._asleep = asleep
        self._loop: LoopingCall | None = None
        # The questions on their way: each is asked again only once its
        # last one is answered or dropped, and one that hangs (vLLM's
        # /is_sleeping as its engine core dies) never holds up another.
        self._asking: set[str] = set()
        self._refused = 0
        # Engines with a route that says whether they sleep: vLLM's and the
        # simulator's, whatever llmgw's profile says of sleep (an operator
        # may serve vLLM's routes with VLLM_SERVER_DEV_MODE=1).
        # A gang's follower serves no HTTP.
        self._no_sleep_route = not health_url or shard.command.engine not in (
            "vllm",
            "sim",
        )

    def start(self) -> None:
        """
        Begin asking (again); nothing when already asking.
        """
        if self._loop is not None:
            return
        self._refused = 0
        self._loop = LoopingCall(self._tick)
        self._loop.clock = self._reactor
        self._loop.start(INTERVAL, now=False)

    def stop(self) -> None:
        """
        Stop asking; an answer on its way is dropped.
        """
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def _tick(self) -> None:
        loop = self._loop
        if self._health_url:
            self._question("health", lambda: self._health(loop))
        if not self._no_sleep_route:
            self._question("sleep", lambda: self._sleeping(loop))

    def _question(
        self, name: str, ask: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """
        Ask C{ask()} unless the question C{name} is still on its way; one
        not answered within L{ASK_TIMEOUT} is dropped, and no answer (busy,
        closing, gone) says nothing: the next tick asks again.
        """
        if name in self._asking:
            return
        self._asking.add(name)
        d: Deferred[None] = Deferred.fromCoroutine(ask())
        d.addTimeout(ASK_TIMEOUT, self._reactor)

        def asked(result: object) -> None:
            self._asking.discard(name)
            if isinstance(result, Failure) and not result.check(*NO_ANSWER):
                self.log.failure(
                    "asking shard {shard}'s engine ({question})",
                    result,
                    shard=self._shard.id,
                    question=name,
                )

        d.addBoth(asked)

    def _watching(self, loop: LoopingCall | None) -> bool:
        """
        @param loop: the asking that sent the question answered.
        @return: whether an answer to it still counts: that asking goes on
            (an answer sent before a sleep and a wake of the agent's own
            would be stale), and the agent does not turn the engine.
        """
        shard = self._shard
        return (
            loop is not None
            and self._loop is loop
            and shard.state == pb.SHARD_STATE_READY
            and not shard.busy
        )

    def _health_counts(self, loop: LoopingCall | None) -> bool:
        """
        @param loop: the asking that sent the health question answered.
        @return: whether its answer counts: that asking goes on, the shard
            is L{WATCHED}, and the agent does not stop it.  The agent's own
            sleep and wake count: they leave the engine's port open and its
            C{/health} 200, and vLLM's, sent as its engine core died, would
            wait for ever (up to L{llmgw.agent.sleep.SLEEP_TIMEOUT}) but for
            this answer.
        """
        shard = self._shard
        return (
            loop is not None
            and self._loop is loop
            and shard.state in WATCHED
            and not shard.stopping
        )

    def _died(self, fallback: str) -> None:
        """
        Stop asking and call C{dead} with the engine's own line, or
        C{fallback} when its output has none (L{engine_line}).
        """
        self.stop()
        self._dead(engine_line(self._shard.log_lines, fallback))

    async def _health(self, loop: LoopingCall | None) -> None:
        """
        Ask its health route: a 503 or L{REFUSED_DEAD} refusals in a row
        while watched are its death.
        """
        try:
            response = await self._http.request(
                b"GET", self._health_url.encode(), self._headers
            )
        except ConnectionRefusedError:
            # Counted only while it counts: the agent's stop closes the
            # port.
            self._refused = self._refused + 1 if self._health_counts(loop) else 0
            if self._refused >= REFUSED_DEAD:
                self._died(
                    f"the engine refused connections on its port"
                    f" {self._refused} times in a row, its process"
                    " still running"
                )
            return
        self._refused = 0
        await readBody(response)
        if response.code == 503 and self._health_counts(loop):
            self._died("the engine answered its health route with 503")

    async def _sleeping(self, loop: LoopingCall | None) -> None:
        """
        Ask whether it sleeps: asleep while watched (the agent did not put
        it to sleep) calls C{asleep}.
        """
        if not self._watching(loop):
            return
        try:
            sleeping = await self._routes().asleep(timeout=ASK_TIMEOUT)
        except CommandRefused as e:
            # vLLM serves its sleep routes only with VLLM_SERVER_DEV_MODE=1
            # (vllm/entrypoints/serve/dev/sleep/api_router.py), the
            # simulator only in sleep mode: without the route, nothing
            # put it to sleep.
            self._no_sleep_route = " 404" in str(e)
            return
        if sleeping and self._watching(loop):
            self.stop()
            self._asleep()
