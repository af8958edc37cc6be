"""
The supervisor: engines as processes in sessions of their own, ready when
their health URL answers, stopped by signalling their process group, and
outliving the agent: each is recorded in the state directory, and a
restarted agent adopts those still alive instead of starting duplicates.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet import error
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers

from llmgw.agent.engines import CommandRefused, Launch, build, check
from llmgw.agent.phases import StartPhases
from llmgw.agent.phases import lists_model as _lists
from llmgw.agent.quiet_pool import QuietConnectionPool
from llmgw.agent.records import (
    MARKER,
    SHARD_ID,
    command_json,
    marker,
    process_start_time,
    tail,
    write_record,
)
from llmgw.agent.sleep import begin_check, can_tell, refusal, without_sleep
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb

PROBE_TIMEOUT = 10.0
"""
Seconds a readiness probe (all of a launch's requests) may take.
"""
KEEP_LOGS = 100
"""
Output files of ended shards kept in the state directory.
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


class _LauncherProcess(ProcessProtocol):
    def __init__(self, shard: Shard) -> None:
        self._shard = shard

    def processEnded(self, reason: Failure) -> None:
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
    """

    log = Logger()

    def __init__(
        self, supervisor: Supervisor, command: pb.StartShard, launch: Launch
    ) -> None:
        self.id = command.shard_id
        self.command = command
        self.launch = launch
        self.state: int = pb.SHARD_STATE_PENDING
        self.pid: int | None = None
        self.start_time: int | None = None
        self.exit_code: int | None = None
        self._supervisor = supervisor
        self.supervisor = supervisor
        self._health: LoopingCall | None = None
        self._watch: LoopingCall | None = None
        self._kill: IDelayedCall | None = None
        self._stopping = False
        self._probing = False
        self._served = False
        self._ask_asleep = False
        # The check of an adopted engine's sleep, while it runs.
        self.checking: Deferred[None] | None = None
        # "sleep" or "wake" while its engine's route runs (recorded: an
        # agent that restarts meanwhile asks until it has turned).
        self.turning = ""
        # Told the server with the next status (ShardStatus.note).
        self.note = ""
        self.phases = StartPhases(supervisor.reactor)

    @property
    def output(self) -> list[str]:
        """
        The engine's last L{llmgw.agent.records.OUTPUT_LINES} output lines,
        stdout and stderr.
        """
        return tail(self._supervisor.path(self.id, ".log"))

    def set_state(self, state: int, error_text: str = "") -> None:
        """
        Enter C{state} and report it, with the L{note} waiting (then
        cleared).
        """
        status = pb.ShardStatus(shard_id=self.id, error=error_text, pid=self.pid or 0)
        if state == pb.SHARD_STATE_READY and "ready" not in self.phases.marks:
            self.phases.mark("ready")
            status.phases.extend(
                self.phases.report(self._supervisor.path(self.id, ".log"))
            )
        if state in (pb.SHARD_STATE_READY, pb.SHARD_STATE_SLEEPING):
            self._served = True
        self.state = state
        status.note, self.note = self.note, ""
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
        self._supervisor.report(status)

    def spawn(self) -> None:
        """
        Launch the engine and start probing its health.
        """
        reactor = self._supervisor.reactor
        log_path = self._supervisor.path(self.id, ".log")
        argv = [sys.executable, "-c", _LAUNCHER, log_path, *self.launch.argv]
        # The marker finds it again should its record be lost.
        env = {**os.environ, **self.launch.env, MARKER: self._supervisor.marker(self)}
        transport = reactor.spawnProcess(
            _LauncherProcess(self), sys.executable, argv, env=env
        )
        self.pid = transport.pid
        self.phases.mark("launched")
        assert self.pid is not None
        self.start_time = process_start_time(self.pid)
        self._supervisor.record(self)
        self.set_state(pb.SHARD_STATE_STARTING)
        self._start_probing()

    def adopt(
        self, pid: int, start_time: int, sleeping: bool = False, turning: str = ""
    ) -> None:
        """
        Take over an engine a previous agent started: watch its pid, since
        its exit status went to that agent.  One recorded asleep stays so
        (its probes would pass: a sleeping engine serves /health); where
        the engine can tell, it is asked (L{check_adopted}), until it has
        turned when it was recorded C{turning} (C{"sleep"}, C{"wake"}).
        """
        self.turning = turning
        self.pid = pid
        self.start_time = start_time
        self._watch = LoopingCall(self._still_there)
        self._watch.clock = self._supervisor.reactor
        self._watch.start(1.0, now=False)
        # Its engine is asked whether it sleeps (L{check_adopted}): at once
        # when recorded asleep, once its probes pass when taken as awake.
        if sleeping:
            self.state = pb.SHARD_STATE_SLEEPING
            self._served = True
            if can_tell(self.command):
                begin_check(self)
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

    def _still_there(self) -> None:
        assert self.pid is not None
        if process_start_time(self.pid) != self.start_time:
            self.ended(None)

    def _start_probing(self) -> None:
        self._health = LoopingCall(self._probe)
        self._health.clock = self._supervisor.reactor
        self._health.start(self._supervisor.health_interval, now=False)

    def _probe(self) -> None:
        if self._probing:
            return
        self._probing = True
        d = Deferred.fromCoroutine(self._serves())
        # An engine that accepts and never answers must not hold probing
        # up for good.
        d.addTimeout(PROBE_TIMEOUT, self._supervisor.reactor)

        def answered(serves: bool) -> None:
            self._probing = False
            if serves and self.state == pb.SHARD_STATE_STARTING:
                self._stop_probing()
                if self._ask_asleep:
                    self._ask_asleep = False
                    begin_check(self)
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
            response = await self._supervisor.http.request(
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
        self._kill = self._supervisor.reactor.callLater(
            grace, self._signal, signal.SIGKILL
        )

    def _signal(self, number: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            pass

    def ended(self, code: int | None) -> None:
        self.exit_code = code
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
        if self._stopping:
            # Workers the engine left behind in its group go too.
            self._signal(signal.SIGKILL)
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
            self.set_state(pb.SHARD_STATE_FAILED, why)
        self._supervisor.forget(self)

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
        self.note = f"sleep refused: {line}"
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


class Supervisor:
    """
    The engines of this node.

    @param reactor: spawns processes, keeps time, makes HTTP requests.
    @param report: called with every C{pb.ShardStatus} transition.
    @param state_dir: where running engines are recorded (and their output
        written), so that a restarted agent adopts them.
    @param health_interval: seconds between health probes while starting.
    @param engine_host: the interface engines listen on: the node's
        address, where the server reaches them.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IEngineReactor,
        report: Callable[[pb.ShardStatus], None],
        state_dir: str,
        health_interval: float = 0.5,
        engine_host: str = "127.0.0.1",
    ) -> None:
        self.reactor = reactor
        self.engine_host = engine_host
        self.report = report
        self.health_interval = health_interval
        self.http = Agent(reactor, pool=QuietConnectionPool(reactor, persistent=False))  # type: ignore[no-untyped-call]
        self.shards: dict[str, Shard] = {}
        # GB an engine holds on each of its GPUs (NVML's per-process
        # figures), or None where unknown: set by the agent's service.
        self.gpu_memory: Callable[[Shard], Deferred[float | None]] = lambda shard: (
            succeed(None)
        )
        # Named in every engine's marker (L{MARKER}); set by the service.
        self.node_id = ""
        self._state_dir = state_dir
        self._dir = os.path.join(state_dir, "shards")
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # OSError for the caller

    def path(self, shard_id: str, suffix: str) -> str:
        """
        @return: the state file of C{shard_id} with C{suffix} (C{.json}
            record, C{.log} output).
        """
        return os.path.join(self._dir, shard_id + suffix)

    def _fields(self, shard: Shard) -> dict[str, Any]:
        """
        @return: C{shard}'s record but its pid and start time.
        """
        return {
            "command": command_json(shard.command),
            # Where it listens: the node's address may change before a
            # restarted agent adopts it.
            "host": shard.launch.host,
            # A sleeping engine is adopted asleep.
            "sleeping": shard.state == pb.SHARD_STATE_SLEEPING,
            "turning": shard.turning,
        }

    def marker(self, shard: Shard) -> str:
        """
        @return: the value of L{MARKER} for C{shard}'s engine.
        """
        fields = self._fields(shard)
        fields["sleeping"], fields["turning"] = False, ""
        return marker(self.node_id, self._state_dir, fields)

    def record(self, shard: Shard) -> None:
        """
        Write C{shard}'s record atomically (see L{write_record}).
        """
        data = {
            **self._fields(shard),
            "pid": shard.pid,
            "start_time": shard.start_time,
        }
        write_record(self.path(shard.id, ".json"), data)

    def adopt_running(self) -> list[Shard]:
        """
        Adopt the engines a previous agent started that still run (same pid
        and same process start time): those its records name, and those
        whose record is lost, found by their marker (L{MARKER}); forget
        records of engines gone, and keep aside those unreadable (see
        L{llmgw.agent.recovery}).

        @return: the adopted shards.
        """
        from llmgw.agent.recovery import adopt_running

        return adopt_running(self, self._dir, self._state_dir)

    def take(
        self,
        command: pb.StartShard,
        launch: Launch,
        pid: int,
        start_time: int,
        sleeping: bool = False,
        turning: str = "",
    ) -> Shard:
        """
        @return: the shard of the running engine C{pid}, adopted (see
            L{Shard.adopt}).
        """
        shard = Shard(self, command, launch)
        self.shards[shard.id] = shard
        shard.adopt(pid, start_time, sleeping, turning)
        return shard

    def start(self, command: pb.StartShard) -> Shard:
        """
        Check the profile and launch the engine.

        @raise ProfileError: a check of the profile failed.
        @raise CommandRefused: a bad shard id, or one already running; a
            port or GPUs another shard holds (codes C{port_in_use},
            C{gpus_in_use}: facts for placement, not the model's failure).
        """
        if not SHARD_ID.match(command.shard_id):
            # It names files in the state directory.
            raise CommandRefused(
                f"shard_id: bad value {command.shard_id!r}: letters, digits,"
                " '.', '_', '-', at most 128, not starting with a punctuation mark"
            )
        if command.shard_id in self.shards:
            raise CommandRefused(f"shard {command.shard_id!r} is already running")
        for other in self.shards.values():
            if other.exit_code is not None:
                continue
            # One that still loads may not listen yet: the bind check
            # below would not see it.
            if other.command.port == command.port:
                raise CommandRefused(
                    f"port {command.port} is not free: shard {other.id} holds it",
                    "port_in_use",
                )
            shared = set(other.command.gpu_indices) & set(command.gpu_indices)
            # A sleeping engine gave its GPUs back but for what it keeps
            # (placement counted that from the memory reported).
            asleep = other.state == pb.SHARD_STATE_SLEEPING and other.checking is None
            if shared and not asleep:
                raise CommandRefused(
                    f"GPUs {sorted(shared)} are not free: shard {other.id} holds them",
                    "gpus_in_use",
                )
        launch = build(command, self.engine_host)
        check(command, launch, self.engine_host)
        shard = Shard(self, command, launch)
        # Listed only once it runs: a launch that raised leaves nothing.
        shard.spawn()
        self.shards[shard.id] = shard
        return shard

    def stop(self, shard_id: str, grace: float) -> None:
        """
        Stop a shard now (SIGKILL after C{grace} seconds).  Draining is
        the server's: it stops sending requests to the shard and sends
        this once those in flight are done.

        @raise CommandRefused: no such shard.
        """
        shard = self.shards.get(shard_id)
        if shard is None:
            raise CommandRefused(f"no shard {shard_id!r} on this node")
        shard.stop(grace)

    def stop_all(self, grace: float) -> Deferred[None]:
        """
        Stop every engine (SIGKILL after C{grace} seconds).

        @return: fires when all have ended, or C{grace + 5} seconds later.
        """
        for shard in list(self.shards.values()):
            shard.stop(grace)
        done: Deferred[None] = Deferred()
        deadline = self.reactor.seconds() + grace + 5

        def check() -> None:
            if not self.shards or self.reactor.seconds() >= deadline:
                poll.stop()
                done.callback(None)

        poll = LoopingCall(check)
        poll.clock = self.reactor
        poll.start(0.1, now=True)
        return done

    def forget(self, shard: Shard) -> None:
        if self.shards.get(shard.id) is shard:
            del self.shards[shard.id]
        try:
            os.remove(self.path(shard.id, ".json"))
        except FileNotFoundError:
            pass
        self._prune_logs()

    def _prune_logs(self, keep: int = KEEP_LOGS) -> None:
        """
        Delete the output of ended shards beyond the newest C{keep}: a
        model failing in a loop must not fill the disk with files.
        """
        try:
            names = [
                n
                for n in os.listdir(self._dir)
                if n.endswith(".log") and n[: -len(".log")] not in self.shards
            ]
            paths = sorted(
                (os.path.join(self._dir, n) for n in names),
                key=os.path.getmtime,
                reverse=True,
            )
            for path in paths[keep:]:
                os.remove(path)
        except OSError as e:
            self.log.warn("cannot prune shard logs: {error}", error=str(e))

    def running(self) -> list[pb.RunningShard]:
        """
        @return: every shard, as Register lists them.
        """
        return [shard.running() for shard in self.shards.values()]
