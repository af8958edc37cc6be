"""
One engine as the agent runs it: a process in a session of its own, ready
when its health URL answers, stopped by signalling its process group, and
recorded in the state directory so that it outlives the agent (L{Shard}).
What it calls of the supervisor that runs it is said in L{ShardHome}; its
turns to sleep and to wake are its L{Turns}.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from typing import Protocol

from twisted.internet import error
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from llmgw.agent.engines import Launch, build
from llmgw.agent.liveness import WATCHED, Liveness, engine_line
from llmgw.agent.phases import StartPhases
from llmgw.agent.phases import lists_model as _lists
from llmgw.agent.records import MARKER, process_start_time, tail
from llmgw.agent.sleep import EngineRoutes, can_tell, refusal, without_sleep
from llmgw.agent.turns import Turns
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb

DEAD_GRACE = 2.0
"""
Seconds an engine that said it is dead has to end on SIGTERM before its
session gets SIGKILL.
"""

SLEPT_ELSEWHERE = "put to sleep outside llmgw"
"""
C{ShardStatus.note} of a shard whose engine was found asleep though the
agent did not put it to sleep.
"""

PROBE_TIMEOUT = 10.0
"""
Seconds a readiness probe (all of a launch's requests) may take.
"""

# Runs the engine in a new session, so that stopping it signals its whole
# process group (engines fork workers) and nothing sent to the agent's group
# reaches it; its output goes to a file, not a pipe to the agent, so it
# keeps running (and writing) when the agent restarts.
_LAUNCHER = (
    "import os, sys\n"
    "os.setsid()\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)\n"
    "os.dup2(fd, 1)\n"
    "os.dup2(fd, 2)\n"
    "os.close(fd)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class ShardHome(Protocol):
    """
    What a shard calls of the supervisor that runs it
    (L{llmgw.agent.supervisor.Supervisor}).
    """

    @property
    def reactor(self) -> IEngineReactor:
        """
        Spawns the engine, keeps time.
        """

    @property
    def http(self) -> IAgent:
        """
        The agent's HTTP client: probes, sleep and wake routes.
        """

    @property
    def health_interval(self) -> float:
        """
        Seconds between health probes while the engine starts.
        """

    def path(self, shard_id: str, suffix: str) -> str:
        """
        @return: the state file of C{shard_id} with C{suffix}.
        """

    def marker(self, shard: Shard) -> str:
        """
        @return: the value of L{MARKER} for C{shard}'s engine.
        """

    def record(self, shard: Shard) -> None:
        """
        Write C{shard}'s record.
        """

    def prove(self, shard: Shard) -> None:
        """
        Keep the proof that the agent started C{shard}'s engine.
        """

    def report(self, status: pb.ShardStatus) -> None:
        """
        Tell the server a transition of a shard.
        """

    def forget(self, shard: Shard) -> None:
        """
        C{shard} has ended: no longer listed, its record removed.
        """

    def gpu_memory(self, shard: Shard) -> Deferred[float | None]:
        """
        @return: the GB C{shard}'s engine holds on each of its GPUs, or
            L{None} where unknown.
        """


class _LauncherProcess(ProcessProtocol):
    def __init__(self, shard: Shard) -> None:
        self._shard = shard

    def processExited(self, reason: Failure) -> None:
        # Not processEnded: Twisted calls that only once every pipe to the
        # child is closed too, and the engine's own children (vLLM's
        # EngineCore, its workers, its resource tracker) inherit the stdin
        # pipe and keep it open after the engine's API server is gone.
        code: int | None = None
        ended = reason.value
        if isinstance(ended, (error.ProcessDone, error.ProcessTerminated)):
            code = ended.exitCode
            if code is None and ended.signal is not None:
                code = -int(ended.signal)
        self._shard.ended(code)


class Shard:
    """
    One engine process and its state.

    @param home: the supervisor that runs it.
    @param command: the server's start (or the one recorded, adopted).
    @param launch: how its engine is launched and probed.
    @param turning: C{"sleep"} or C{"wake"} when adopted from a record
        saying its engine's route ran (see L{Turns}).
    @param secret: its engine's secret (L{llmgw.agent.records.MARKER}),
        when adopted; a new one otherwise.
    """

    log = Logger()

    def __init__(
        self,
        home: ShardHome,
        command: pb.StartShard,
        launch: Launch,
        turning: str = "",
        secret: str = "",
    ) -> None:
        self.id = command.shard_id
        self.secret = secret or secrets.token_hex(16)
        self.command = command
        self.launch = launch
        self.state: int = pb.SHARD_STATE_PENDING
        self.pid: int | None = None
        self.start_time: int | None = None
        self.exit_code: int | None = None
        self._home = home
        self._health: LoopingCall | None = None
        self._watch: LoopingCall | None = None
        self._kill: IDelayedCall | None = None
        self._stopping = False
        self._probing = False
        self._served = False
        self._ask_asleep = False
        # Told the server with the next status (ShardStatus.note).
        self._note = ""
        self.phases = StartPhases(home.reactor)
        # Why the agent ends an engine that said it is dead, else "".
        self._dead = ""
        # vLLM answers /health 503 only once its engine is dead (the sim
        # does as vLLM); SGLang's 503 may be a slow health generation
        # under load, llama.cpp's a model loading: not a death.
        health = [p.url for p in launch.probes if p.url.endswith("/health")]
        told = health[0] if health and command.engine in ("vllm", "sim") else ""
        self.liveness = Liveness(
            self,
            home.reactor,
            home.http,
            told,
            launch.headers,
            self._routes,
            self._engine_dead,
            self._slept_elsewhere,
        )
        self.turns = Turns(
            self,
            self._routes,
            home.reactor,
            lambda: home.record(self),
            lambda: home.gpu_memory(self),
            turning,
        )

    @property
    def output(self) -> list[str]:
        """
        The engine's last L{llmgw.agent.records.OUTPUT_LINES} output lines,
        stdout and stderr.
        """
        return tail(self._home.path(self.id, ".log"))

    @property
    def log_lines(self) -> list[str]:
        """
        The engine's output lines in the last 64 KiB of its log, where its
        own line saying it is dead is looked for (L{engine_line}): at its
        exit vLLM's shutdown and its libraries' leak reports print dozens
        of lines after that one, more than L{output} keeps.
        """
        return tail(self._home.path(self.id, ".log"), lines=None)

    def _routes(self) -> EngineRoutes:
        """
        @return: the sleep and wake routes of its engine as launched now
            (started again without sleep mode, it listens on the same
            port).
        """
        return EngineRoutes(
            self._home.http,
            self._home.reactor,
            self.command,
            self.launch.host,
            self.launch.headers,
        )

    def set_state(
        self, state: int, error_text: str = "", note: str | None = None
    ) -> None:
        """
        Enter C{state} and report it.

        @param error_text: C{ShardStatus.error}.
        @param note: C{ShardStatus.note}; L{None} for the note waiting, if
            any (a refused sleep mode's, told with the next status).
        """
        status = pb.ShardStatus(shard_id=self.id, error=error_text, pid=self.pid or 0)
        if state == pb.SHARD_STATE_READY and "ready" not in self.phases.marks:
            self.phases.mark("ready")
            status.phases.extend(self.phases.report(self._home.path(self.id, ".log")))
        if state in (pb.SHARD_STATE_READY, pb.SHARD_STATE_SLEEPING):
            self._served = True
        self.state = state
        # Asked again from each change on: an answer to a question sent
        # before it (a sleep and a wake of the agent's own) is stale.
        self.liveness.stop()
        if state in WATCHED:
            self.liveness.start()
        status.note = self._note if note is None else note
        self._note = ""
        status.state = state  # type: ignore[assignment]
        if self.exit_code is not None:
            status.exit_code = self.exit_code
            status.has_exit_code = True
        if state == pb.SHARD_STATE_FAILED or (
            state == pb.SHARD_STATE_STOPPED and not self._served
        ):
            # Stopped before it ever served (the server gave up waiting
            # for it): its output says why as much as a failure's does.
            # Engines print their arguments (vLLM logs its non-default
            # args): the key is not to travel on in the output tail.
            key = self.command.api_key
            status.output_tail.extend(
                line.replace(key, "[engine key]") if key else line
                for line in self.output
            )
        self._home.report(status)

    def spawn(self) -> None:
        """
        Launch the engine and start probing its health.
        """
        reactor = self._home.reactor
        log_path = self._home.path(self.id, ".log")
        argv = [sys.executable, "-c", _LAUNCHER, log_path, *self.launch.argv]
        # The marker finds it again should its record be lost.
        env = {**os.environ, **self.launch.env, MARKER: self._home.marker(self)}
        transport = reactor.spawnProcess(
            _LauncherProcess(self), sys.executable, argv, env=env
        )
        self.pid = transport.pid
        self.phases.mark("launched")
        assert self.pid is not None
        self.start_time = process_start_time(self.pid)
        self._home.prove(self)
        self._home.record(self)
        self.set_state(pb.SHARD_STATE_STARTING)
        self._start_probing()

    def adopt(self, pid: int, start_time: int, sleeping: bool = False) -> None:
        """
        Take over an engine a previous agent started: watch its pid, since
        its exit status went to that agent.  One recorded asleep stays so
        (its probes would pass: a sleeping engine serves /health); where
        the engine can tell, it is asked (L{Turns.begin_check}), until it
        has turned when it was recorded turning (L{Turns.turning}).
        """
        self.pid = pid
        self.start_time = start_time
        self._watch = LoopingCall(self._still_there)
        self._watch.clock = self._home.reactor
        self._watch.start(1.0, now=False)
        # Its engine is asked whether it sleeps (L{Turns.begin_check}): at
        # once when recorded asleep, once its probes pass when taken as
        # awake.
        if sleeping:
            self.state = pb.SHARD_STATE_SLEEPING
            self._served = True
            # Watched asleep as any sleeper, the check's own turn too.
            self.liveness.start()
            if can_tell(self.command):
                self.turns.begin_check()
            return
        self._ask_asleep = can_tell(self.command)
        self.state = pb.SHARD_STATE_STARTING
        self._start_probing()

    @property
    def stopping(self) -> bool:
        """
        Whether it was told to stop.
        """
        return self._stopping

    @property
    def busy(self) -> bool:
        """
        Whether the agent turns its engine (to sleep, awake, a check) or
        stops it: what the engine says meanwhile is the agent's doing.
        """
        return self._stopping or bool(self.turns.turning) or self.turns.checking

    def _engine_dead(self, line: str) -> None:
        """
        Its engine says it is dead (L{Liveness}): it fails with the
        engine's own C{line} at once, so that the server takes it out of
        rotation and replaces it, and its whole session is stopped.
        """
        self.log.warn(
            "shard {shard}: its engine says it is dead ({line}): stopping it",
            shard=self.id,
            line=line,
        )
        self._dead = line
        # Failed first, stopped after: the server takes it out of rotation
        # now (requests then wait for its replacement), not once its
        # process has ended, meanwhile refusing connections.
        self.set_state(pb.SHARD_STATE_FAILED, line)
        self.stop(DEAD_GRACE)

    def _slept_elsewhere(self) -> None:
        """
        Its engine sleeps, and the agent did not put it to sleep (someone
        called its sleep route): listed asleep, as an adopted engine found
        asleep is, so that it leaves the rotation and the server wakes it
        for the next request (see docs/operations.md).
        """
        self.log.warn(
            "shard {shard}: its engine was put to sleep outside llmgw: sleeping",
            shard=self.id,
        )
        self.set_state(pb.SHARD_STATE_SLEEPING, note=SLEPT_ELSEWHERE)
        self._home.record(self)

    def _still_there(self) -> None:
        assert self.pid is not None
        if process_start_time(self.pid) != self.start_time:
            self.ended(None)

    def _start_probing(self) -> None:
        self._health = LoopingCall(self._probe)
        self._health.clock = self._home.reactor
        self._health.start(self._home.health_interval, now=False)

    def _probe(self) -> None:
        if self._probing:
            return
        self._probing = True
        d = Deferred.fromCoroutine(self._serves())
        # An engine that accepts and never answers must not hold probing
        # up for good.
        d.addTimeout(PROBE_TIMEOUT, self._home.reactor)

        def answered(serves: bool) -> None:
            self._probing = False
            if serves and self.state == pb.SHARD_STATE_STARTING:
                self._stop_probing()
                if self._ask_asleep:
                    self._ask_asleep = False
                    self.turns.begin_check()
                    return
                self.log.info("shard {shard} is ready", shard=self.id)
                self.set_state(pb.SHARD_STATE_READY)

        def failed(reason: Failure) -> None:
            # Not listening yet, or an answer cut short: the next probe.
            self._probing = False

        d.addCallbacks(answered, failed)

    async def _serves(self) -> bool:
        """
        @return: whether every probe of the launch passes now (see
            L{Probe}); a follower without probes serves once it runs.
        """
        headers = Headers(
            {k.encode(): [v.encode()] for k, v in self.launch.headers.items()}
        )
        for probe in self.launch.probes:
            response = await self._home.http.request(
                b"GET", probe.url.encode(), headers
            )
            body = await readBody(response)
            self.phases.mark("port_open")
            if response.code != 200:
                return False
            if probe.lists and not _lists(body, probe.lists):
                return False
            self.phases.mark("model_listed" if probe.lists else "port_open")
        return True

    def _stop_probing(self) -> None:
        if self._health is not None and self._health.running:
            self._health.stop()
        self._health = None

    def stop(self, grace: float) -> None:
        """
        SIGTERM to the engine's process group, SIGKILL after C{grace}
        seconds if it is still there.
        """
        if self.pid is None or self.exit_code is not None or self._stopping:
            return
        self._stopping = True
        self._stop_probing()
        self._signal(signal.SIGTERM)
        self._kill = self._home.reactor.callLater(grace, self._signal, signal.SIGKILL)

    def _signal(self, number: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            pass

    def ended(self, code: int | None) -> None:
        self.exit_code = code
        self.liveness.stop()
        self._stop_probing()
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        self._watch = None
        if self._kill is not None and self._kill.active():
            self._kill.cancel()
        self._kill = None
        refused = (
            refusal(self.output)
            if self.command.sleep_level
            and not self._stopping
            and self.state == pb.SHARD_STATE_STARTING
            else None
        )
        if refused is not None:
            self._without_sleep(refused)
            return
        # What the engine left behind in its session (vLLM's EngineCore,
        # workers and resource tracker outlive a killed API server) goes
        # too, however it ended: nothing orphaned keeps its memory.
        self._signal(signal.SIGKILL)
        if self._stopping:
            if not self._dead:  # one that said so was told failed then
                self.set_state(pb.SHARD_STATE_STOPPED)
        else:
            self.log.warn("shard {shard} exited with {code}", shard=self.id, code=code)
            if code is None:
                # Adopted: its exit status went to the agent that started it.
                why = "the engine is gone (exit status unknown)"
            elif code < 0:
                why = f"the engine was killed by signal {-code}"
            else:
                why = f"the engine exited with code {code}"
            # vLLM's own word first where it gave one: it ends itself 0 to
            # 5 s after its engine core died, which may come before the 503
            # of its health route is asked.
            if self.command.engine in ("vllm", "sim"):
                said = engine_line(self.log_lines, "")
                if said:
                    why = f"{said} (then {why})"
            self.set_state(pb.SHARD_STATE_FAILED, why)
        self._home.forget(self)

    def _without_sleep(self, line: str) -> None:
        """
        The engine refused sleep mode while starting: started once more
        without it, the server told why (C{"sleep refused: LINE"}).
        """
        self.log.warn(
            "shard {shard}: the engine refused sleep mode ({line}); starting it"
            " without",
            shard=self.id,
            line=line,
        )
        self.command = without_sleep(self.command)
        self.launch = build(self.command, self.launch.host)
        self.exit_code = None
        self._note = f"sleep refused: {line}"
        self.spawn()

    def running(self) -> pb.RunningShard:
        """
        @return: the shard as Register lists it.
        """
        c = self.command
        return pb.RunningShard(
            shard_id=self.id,
            replica_id=c.replica_id,
            model=c.model,
            profile=c.profile,
            state=self.state,  # type: ignore[arg-type]
            port=c.port,
            gpu_indices=c.gpu_indices,
            rank=c.rank,
            world_size=c.world_size,
            pid=self.pid or 0,
            engine=c.engine,
            source=c.source,
        )
