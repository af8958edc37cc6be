"""
The supervisor: the engines of a node (each a L{Shard}), started, stopped,
put to sleep and woken on the server's command, and outliving the agent:
each is recorded in the state directory, and a restarted agent adopts
those still alive instead of starting duplicates.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.client import Agent

from llmgw.agent.engines import CommandRefused, Launch, build, check
from llmgw.agent.quiet_pool import QuietConnectionPool
from llmgw.agent.records import (
    PROOF,
    SHARD_ID,
    command_json,
    marker,
    write_proof,
    write_record,
)
from llmgw.agent.recovery import Recovery
from llmgw.agent.shard import Shard
from llmgw.agent.sleep import flag_value
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState

KEEP_LOGS = 100
"""
Output files of ended shards kept in the state directory.
"""


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
    @param node_id: named in every engine's marker
        (L{llmgw.agent.records.MARKER}).
    @param gpu_memory: the GB an engine holds on each of its GPUs (NVML's
        per-process figures), or L{None} where unknown; by default unknown
        (no NVML).
    """

    log = Logger()

    def __init__(
        self,
        reactor: IEngineReactor,
        report: Callable[[pb.ShardStatus], None],
        state_dir: str,
        health_interval: float = 0.5,
        engine_host: str = "127.0.0.1",
        node_id: str = "",
        gpu_memory: Callable[[Shard], Deferred[float | None]] | None = None,
    ) -> None:
        self.reactor = reactor
        self.engine_host = engine_host
        self.report = report
        self.health_interval = health_interval
        self.http = Agent(reactor, pool=QuietConnectionPool(reactor, persistent=False))  # type: ignore[no-untyped-call]
        self.shards: dict[str, Shard] = {}
        self._gpu_memory = gpu_memory or (lambda shard: succeed(None))
        # The sim engines' memory as last reported, and what they gave back
        # that shows free only later (simulated_memory_mib).
        self._sim_last: dict[str, tuple[tuple[int, ...], int, float]] = {}
        self._sim_releasing: list[tuple[tuple[int, ...], int, float]] = []
        self.node_id = node_id
        self._state_dir = state_dir
        self._dir = os.path.join(state_dir, "shards")
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # OSError for the caller
        self._recovery = Recovery(
            self._dir, state_dir, engine_host, self.take, self.shards.get, self.record
        )

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
            "turning": shard.turns.turning,
        }

    def marker(self, shard: Shard) -> str:
        """
        @return: the value of L{MARKER} for C{shard}'s engine.
        """
        fields = self._fields(shard)
        fields["sleeping"], fields["turning"] = False, ""
        return marker(self.node_id, self._state_dir, fields, shard.secret)

    def prove(self, shard: Shard) -> None:
        """
        Keep the proof that this agent started C{shard}'s engine (see
        L{write_proof}); an engine without one is never adopted by its
        marker.
        """
        assert shard.pid is not None
        path = self.path(shard.id, PROOF)
        write_proof(path, shard.secret, shard.pid, shard.start_time)

    def record(self, shard: Shard) -> None:
        """
        Write C{shard}'s record atomically (see L{write_record}).
        """
        data = {
            **self._fields(shard),
            "pid": shard.pid,
            "start_time": shard.start_time,
            "secret": shard.secret,
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
        return self._recovery.adopt_running()

    def take(
        self,
        command: pb.StartShard,
        launch: Launch,
        pid: int,
        start_time: int,
        sleeping: bool = False,
        turning: str = "",
        secret: str = "",
    ) -> Shard:
        """
        @param secret: the engine's secret, as its record or proof keeps it
            (C{""} from an older agent's record: a new one is kept).
        @return: the shard of the running engine C{pid}, adopted (see
            L{Shard.adopt}).
        """
        shard = Shard(self, command, launch, turning, secret)
        self.shards[shard.id] = shard
        shard.adopt(pid, start_time, sleeping)
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
            asleep = other.state == pb.SHARD_STATE_SLEEPING and not other.turns.checking
            # Engines told their share of a GPU (gpu_share) run side by side.
            sharing = command.gpu_share > 0 and other.command.gpu_share > 0
            if shared and not asleep and not sharing:
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

    def gpu_memory(self, shard: Shard) -> Deferred[float | None]:
        """
        @return: the GB C{shard}'s engine holds on each of its GPUs, or
            L{None} where unknown.
        """
        return self._gpu_memory(shard)

    def _shard(self, shard_id: str, state: int) -> Shard:
        """
        @return: the shard C{shard_id}, in C{state}.
        @raise CommandRefused: no such shard, or in another state.
        """
        shard = self.shards.get(shard_id)
        if shard is None:
            raise CommandRefused(f"no shard {shard_id!r} on this node")
        if shard.state != state:
            now = ShardState.from_pb(shard.state) or "unknown"
            wanted = ShardState.from_pb(state)
            raise CommandRefused(f"shard {shard_id} is {now}, not {wanted}")
        return shard

    async def sleep(self, shard_id: str, level: int) -> None:
        """
        Put a ready shard's engine to sleep (L{llmgw.agent.turns.Turns.sleep}).

        @param level: 1 or 2 (vLLM's levels; SGLang releases all at either).
        @raise CommandRefused: no such shard, not ready, started without
            sleep mode (code C{sleep_refused}), or the engine refused (code
            C{sleep_refused}, its answer) or could not be reached.
        """
        await self._shard(shard_id, pb.SHARD_STATE_READY).turns.sleep(level)

    async def wake(self, shard_id: str) -> None:
        """
        Wake a sleeping shard's engine (L{llmgw.agent.turns.Turns.wake}) once
        no other engine is awake on its GPUs; an adopted one whose check
        runs is woken after it (it may be put back to sleep first,
        L{llmgw.agent.turns.Turns.begin_check}).

        @raise CommandRefused: no such shard, not sleeping, another engine
            awake on its GPUs (code C{gpus_in_use}), or the engine refused
            (code C{sleep_refused}: the shard is C{sleeping} again) or could
            not be reached.
        """
        shard = self._shard(shard_id, pb.SHARD_STATE_SLEEPING)
        if shard.turns.checking:
            await shard.turns.checked()
            shard = self._shard(shard_id, pb.SHARD_STATE_SLEEPING)
        for other in self.shards.values():
            shared = set(other.command.gpu_indices) & set(shard.command.gpu_indices)
            awake = other.state != pb.SHARD_STATE_SLEEPING and other.exit_code is None
            sharing = shard.command.gpu_share > 0 and other.command.gpu_share > 0
            if other is not shard and shared and awake and not sharing:
                raise CommandRefused(
                    f"GPUs {sorted(shared)} are not free: shard {other.id} holds them",
                    "gpus_in_use",
                )
        await shard.turns.wake()

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
        for suffix in (".json", PROOF):
            try:
                os.remove(self.path(shard.id, suffix))
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

    def simulated_memory_mib(self) -> dict[int, int]:
        """
        @return: per GPU index, the MiB the sim engines running on it hold:
            the C{--gpu-memory-gb} of their command line, or their
            C{--sleep-gpu-memory-gb} while asleep (the agent puts them to
            sleep and wakes them, so it knows which).  What an engine gives
            back (asleep, exited, forgotten) shows free only its
            C{--release-seconds} later, as a real GPU's memory shows free
            only once the driver took it back and NVML read it.
        """
        now = self.reactor.seconds()
        held: dict[int, int] = {}
        figures: dict[str, tuple[tuple[int, ...], int, float]] = {}
        for shard in self.shards.values():
            if shard.command.engine != "sim":
                continue
            argv = shard.launch.argv
            asleep = shard.state == pb.SHARD_STATE_SLEEPING
            flag = "--sleep-gpu-memory-gb" if asleep else "--gpu-memory-gb"
            mib = (
                0 if shard.exit_code is not None else int(flag_value(argv, flag) * 1024)
            )
            indices = tuple(shard.command.gpu_indices)
            figures[shard.id] = (indices, mib, flag_value(argv, "--release-seconds"))
            for index in indices:
                held[index] = held.get(index, 0) + mib
        for shard_id, (indices, mib, delay) in self._sim_last.items():
            now_mib = figures.get(shard_id, (indices, 0, delay))[1]
            if now_mib < mib and delay > 0:
                self._sim_releasing.append((indices, mib - now_mib, now + delay))
        self._sim_last = figures
        self._sim_releasing = [r for r in self._sim_releasing if r[2] > now]
        for indices, mib, _ in self._sim_releasing:
            for index in indices:
                held[index] = held.get(index, 0) + mib
        return held
