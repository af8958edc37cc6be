"""
The supervisor: engines as child processes in sessions of their own, ready
when their health URL answers, stopped by signalling their process group.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet import error
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, readBody

from llmgw.agent.engines import Launch, ProfileError, build, check
from llmgw.wire import agent_pb2 as pb

OUTPUT_LINES = 50

# Runs the engine in a new session, so that stopping it can signal its whole
# process group (engines fork workers) and a signal to the agent's group
# does not reach it.
_NEW_SESSION = "import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])"


class _EngineProcess(ProcessProtocol):
    def __init__(self, shard: Shard) -> None:
        self._shard = shard
        self._partial = {1: b"", 2: b""}

    def childDataReceived(self, fd: int, data: bytes) -> None:
        lines = (self._partial.get(fd, b"") + data).split(b"\n")
        self._partial[fd] = lines.pop()
        for line in lines:
            self._shard.output.append(line.decode("utf-8", "replace").rstrip("\r"))

    def processEnded(self, reason: Failure) -> None:
        for rest in self._partial.values():
            if rest:
                self._shard.output.append(rest.decode("utf-8", "replace"))
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

    @ivar output: the engine's last L{OUTPUT_LINES} lines, stdout and
        stderr together.
    """

    log = Logger()

    def __init__(
        self, supervisor: Supervisor, command: pb.StartShard, launch: Launch
    ) -> None:
        self.id = command.shard_id
        self.command = command
        self.launch = launch
        self.state: int = pb.SHARD_STATE_PENDING
        self.output: deque[str] = deque(maxlen=OUTPUT_LINES)
        self.pid: int | None = None
        self.exit_code: int | None = None
        self._supervisor = supervisor
        self._health: LoopingCall | None = None
        self._kill: IDelayedCall | None = None
        self._stopping = False

    def _set(self, state: int, error_text: str = "") -> None:
        self.state = state
        status = pb.ShardStatus(shard_id=self.id, state=state, error=error_text)  # type: ignore[arg-type]
        if self.exit_code is not None:
            status.exit_code = self.exit_code
            status.has_exit_code = True
        if state == pb.SHARD_STATE_FAILED:
            status.output_tail.extend(self.output)
        self._supervisor.report(status)

    def spawn(self) -> None:
        reactor = self._supervisor.reactor
        argv = [sys.executable, "-c", _NEW_SESSION, *self.launch.argv]
        env = {**os.environ, **self.launch.env}
        transport = reactor.spawnProcess(
            _EngineProcess(self), sys.executable, argv, env=env
        )
        self.pid = transport.pid
        self._set(pb.SHARD_STATE_STARTING)
        self._health = LoopingCall(self._probe)
        self._health.clock = reactor
        self._health.start(self._supervisor.health_interval, now=False)

    def _probe(self) -> None:
        if self._probing:
            return
        self._probing = True
        d = self._supervisor.http.request(b"GET", self.launch.health_url.encode())

        def answered(response: Any) -> None:
            self._probing = False
            readBody(response).addErrback(lambda _: None)
            if response.code == 200 and self.state == pb.SHARD_STATE_STARTING:
                self._stop_probing()
                self.log.info("shard {shard} is ready", shard=self.id)
                self._set(pb.SHARD_STATE_READY)

        def failed(reason: Failure) -> None:
            self._probing = False

        d.addCallbacks(answered, failed)

    _probing = False

    def _stop_probing(self) -> None:
        if self._health is not None and self._health.running:
            self._health.stop()
        self._health = None

    def stop(self, grace: float, draining: bool = False) -> None:
        """
        SIGTERM to the engine's process group, SIGKILL after C{grace}
        seconds if it is still there.
        """
        if self.pid is None or self.exit_code is not None or self._stopping:
            return
        self._stopping = True
        self._stop_probing()
        if draining:
            self._set(pb.SHARD_STATE_DRAINING)
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
        if self._kill is not None and self._kill.active():
            self._kill.cancel()
        self._kill = None
        if self._stopping:
            # Workers the engine left behind in its group go too.
            self._signal(signal.SIGKILL)
            self._set(pb.SHARD_STATE_STOPPED)
        else:
            self.log.warn("shard {shard} exited with {code}", shard=self.id, code=code)
            self._set(pb.SHARD_STATE_FAILED, f"the engine exited with code {code}")
        self._supervisor.forget(self)


class Supervisor:
    """
    The engines of this node.

    @param reactor: spawns processes, keeps time, makes HTTP requests.
    @param report: called with every L{pb.ShardStatus} transition.
    @param health_interval: seconds between health probes while starting.
    """

    def __init__(
        self,
        reactor: Any,
        report: Callable[[pb.ShardStatus], None],
        health_interval: float = 0.5,
    ) -> None:
        self.reactor = reactor
        self.report = report
        self.health_interval = health_interval
        self.http = Agent(reactor)
        self.shards: dict[str, Shard] = {}

    def start(self, command: pb.StartShard) -> Shard:
        """
        Check the profile and launch the engine.

        @raise ProfileError: a check failed, or the shard id is taken.
        """
        if command.shard_id in self.shards:
            raise ProfileError(f"shard {command.shard_id!r} is already running")
        launch = build(command)
        check(command, launch)
        shard = Shard(self, command, launch)
        self.shards[shard.id] = shard
        shard.spawn()
        return shard

    def stop(self, shard_id: str, grace: float, draining: bool = False) -> None:
        """
        @raise ProfileError: no such shard.
        """
        shard = self.shards.get(shard_id)
        if shard is None:
            raise ProfileError(f"no shard {shard_id!r} on this node")
        shard.stop(grace, draining)

    def forget(self, shard: Shard) -> None:
        if self.shards.get(shard.id) is shard:
            del self.shards[shard.id]
