"""
A shard's turns to sleep and to wake (L{Turns}): the server's sleep and
wake of one engine, the turn recorded while the engine's route runs, and
the check of an engine in sleep mode that a restarted agent adopts.  The
engine's routes and what they answer are L{llmgw.agent.sleep}'s; the
shard whose state changes says what it offers in L{TurningShard}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from llmgw.agent.engines import CommandRefused
from llmgw.agent.sleep import (
    ASK_TIMEOUT,
    SLEEP_TIMEOUT,
    STOP_GRACE,
    TURN_POLL,
    EngineRoutes,
    memory_note,
)
from llmgw.wire import agent_pb2 as pb


class TurningShard(Protocol):
    """
    What a shard's turns read and call of the shard
    (L{llmgw.agent.shard.Shard}).
    """

    @property
    def id(self) -> str:
        """
        The shard's id.
        """

    @property
    def command(self) -> pb.StartShard:
        """
        Its start: sleep level, engine, GPU memory expected.
        """

    @property
    def state(self) -> int:
        """
        Its C{pb.ShardState}.
        """

    @property
    def stopping(self) -> bool:
        """
        Whether it was told to stop.
        """

    @property
    def exit_code(self) -> int | None:
        """
        Set once its engine has ended.
        """

    def set_state(
        self, state: int, error_text: str = "", note: str | None = None
    ) -> None:
        """
        Enter C{state} and report it (with C{note}, when given).
        """

    def stop(self, grace: float) -> None:
        """
        Stop its engine (SIGKILL after C{grace} seconds).
        """


class Turns:
    """
    A shard's turns to sleep and to wake.

    While its engine's sleep or wake route runs, the shard is recorded
    L{turning}: an agent that ends meanwhile leaves its successor a record
    that says so, and that successor asks the engine until it has turned
    (L{begin_check}).

    @param shard: the shard whose state the turns change.
    @param routes: its engine's sleep and wake routes as launched now.
    @param clock: times the questions to an engine recorded turning.
    @param record: writes the shard's record (which names L{turning}).
    @param held_memory: the GB the engine holds on each of its GPUs (NVML),
        or L{None} where unknown; asked after a wake.
    @param turning: C{"sleep"} or C{"wake"} when adopted from a record
        written while the engine's route ran, else C{""}.
    """

    log = Logger()

    def __init__(
        self,
        shard: TurningShard,
        routes: Callable[[], EngineRoutes],
        clock: IReactorTime,
        record: Callable[[], None],
        held_memory: Callable[[], Deferred[float | None]],
        turning: str = "",
    ) -> None:
        self._shard = shard
        self._routes = routes
        self._clock = clock
        self._record = record
        self._held_memory = held_memory
        self._turning = turning
        # The level the engine was last put to sleep at; adopted, the level
        # it was started for (the engine's own gauge decides first, in
        # EngineRoutes.wake).
        self._level = shard.command.sleep_level
        # The check of an adopted engine's sleep, while it runs.
        self._checking: Deferred[None] | None = None

    @property
    def turning(self) -> str:
        """
        C{"sleep"} or C{"wake"} while the engine's route runs (or, adopted,
        until the engine has turned); else C{""}.
        """
        return self._turning

    @property
    def checking(self) -> bool:
        """
        Whether the check of an adopted engine runs (L{begin_check}):
        meanwhile a wake waits for it and its GPUs count as held.
        """
        return self._checking is not None

    def _turn(self, turning: str) -> None:
        """
        Record that the engine is C{turning} (C{"sleep"}, C{"wake"}), or no
        longer (C{""}): an agent that ends while the engine's route runs
        leaves its successor a record that says so (L{begin_check}).
        """
        self._turning = turning
        if self._shard.exit_code is None and not self._shard.stopping:
            self._record()

    async def sleep(self, level: int) -> None:
        """
        Put the ready shard's engine to sleep; the shard is C{sleeping}
        once the engine answered (and recorded so, for an agent that
        restarts).

        @param level: 1 or 2 (vLLM's levels; SGLang releases all at
            either).
        @raise CommandRefused: started without sleep mode (code
            C{sleep_refused}), a bad level, or the engine refused (code
            C{sleep_refused}, its answer) or could not be reached.
        """
        shard = self._shard
        if not shard.command.sleep_level:
            raise CommandRefused(
                f"shard {shard.id} runs without sleep mode", "sleep_refused"
            )
        if level not in (1, 2):
            raise CommandRefused(f"level: expected 1 or 2, got {level}")
        self._turn("sleep")
        self._level = level
        try:
            await self._routes().sleep(level)
        except CommandRefused:
            self._turn("")
            raise
        self._turning = ""
        shard.set_state(pb.SHARD_STATE_SLEEPING)
        self._record()

    async def wake(self) -> None:
        """
        Wake the sleeping shard's engine: C{waking} while its wake routes
        run (after a level-2 sleep, its weights loaded again:
        L{EngineRoutes.wake}), C{ready} after, with a note when the GPU
        memory it holds then is not what placement expects
        (L{memory_note}).  Whether its GPUs
        are free is the supervisor's to say, before.

        @raise CommandRefused: the engine refused (code C{sleep_refused}:
            the shard is C{sleeping} again) or could not be reached.
        """
        shard = self._shard
        routes = self._routes()
        shard.set_state(pb.SHARD_STATE_WAKING)
        self._turn("wake")
        try:
            await routes.wake(self._level)
        except CommandRefused:
            if shard.state == pb.SHARD_STATE_WAKING:
                shard.set_state(pb.SHARD_STATE_SLEEPING)
            self._turn("")
            raise
        self._turning = ""
        if shard.state != pb.SHARD_STATE_WAKING:
            # Stopped or ended meanwhile.
            return
        if shard.command.engine == "sim":
            held = await routes.sim_memory_gb()
        else:
            held = await self._held_memory()
        note = None
        if held is not None:
            note = memory_note(held, shard.command.gpu_memory_gb)
        shard.set_state(pb.SHARD_STATE_READY, note=note)
        self._record()

    def begin_check(self) -> None:
        """
        Check the adopted engine (L{_check}), as L{checking} until it ends.
        """

        def ended(result: object) -> None:
            self._checking = None

        checking = self._checking = Deferred.fromCoroutine(self._check())
        checking.addErrback(
            lambda f: self.log.failure(
                "checking shard {shard}", f, shard=self._shard.id
            )
        )
        checking.addBoth(ended)

    def checked(self) -> Deferred[None]:
        """
        @return: fires when the check under way (L{begin_check}) has ended.
        """
        done: Deferred[None] = Deferred()

        def ended(result: object) -> object:
            done.callback(None)
            return result

        assert self._checking is not None
        self._checking.addBoth(ended)
        return done

    async def _check(self) -> None:
        """
        An engine in sleep mode that a previous agent started, adopted: its
        record may be stale (woken or put to sleep behind its agent's back,
        or written by an agent that recorded only once the engine
        answered), and its marker says it is awake whatever it is.  The
        engine's C{GET /is_sleeping} decides (see
        L{llmgw.agent.sleep.can_tell}); one recorded L{turning} (that agent
        ended while the engine's sleep or wake route ran; it is adopted as
        awake, C{starting}, holding its GPUs) is asked until it has turned
        (L{_turned}).  One taken as awake (C{starting}, its probes passed)
        becomes C{ready}, or C{sleeping} when it sleeps.  One recorded
        asleep (the server counts its GPU memory free) that is awake is put
        back to sleep, or stopped when it will not sleep.  When the engine
        cannot say, the record (or the marker) stands.
        """
        shard = self._shard
        routes = self._routes()
        asleep: bool | None = None
        try:
            asleep = await self._turned(routes)
        except CommandRefused as e:
            self.log.warn(
                "shard {shard}: cannot ask its engine whether it sleeps ({error});"
                " taken as recorded",
                shard=shard.id,
                error=str(e),
            )
        if shard.stopping or shard.exit_code is not None:
            return
        if self._turning:
            self._turn("")
        if shard.state == pb.SHARD_STATE_STARTING:
            if asleep:
                self.log.warn(
                    "shard {shard}: adopted as awake, its engine sleeps: sleeping",
                    shard=shard.id,
                )
                shard.set_state(pb.SHARD_STATE_SLEEPING)
                self._record()
            else:
                self.log.info("shard {shard} is ready", shard=shard.id)
                shard.set_state(pb.SHARD_STATE_READY)
            return
        if shard.state != pb.SHARD_STATE_SLEEPING or asleep is not False:
            return
        self.log.warn(
            "shard {shard}: recorded asleep, its engine is awake (woken behind"
            " its agent's back): putting it back to sleep",
            shard=shard.id,
        )
        try:
            await routes.sleep(shard.command.sleep_level)
        except CommandRefused as e:
            if shard.state == pb.SHARD_STATE_SLEEPING and not shard.stopping:
                self.log.warn(
                    "shard {shard}: its engine will not sleep again ({error}):"
                    " stopping it",
                    shard=shard.id,
                    error=str(e),
                )
                shard.stop(STOP_GRACE)

    async def _turned(self, routes: EngineRoutes) -> bool:
        """
        @return: whether the engine sleeps.  One recorded L{turning} (its
            agent ended while the engine's sleep or wake route ran) is
            asked every L{TURN_POLL} seconds until it has turned, for at
            most L{SLEEP_TIMEOUT}: engines answer the state they leave
            until the turn is done (vLLM's executor flag; the simulator).
            Meanwhile a question it does not answer is asked again.
        @raise CommandRefused: the engine could not say (the last question,
            for one recorded turning).
        """
        if not self._turning:
            return await routes.asleep(ASK_TIMEOUT)
        clock = self._clock
        deadline = clock.seconds() + SLEEP_TIMEOUT
        while True:
            try:
                asleep = await routes.asleep(ASK_TIMEOUT)
            except CommandRefused:
                if clock.seconds() >= deadline:
                    raise
            else:
                if asleep == (self._turning == "sleep") or clock.seconds() >= deadline:
                    return asleep
            await deferLater(clock, TURN_POLL)
            if self._shard.stopping or self._shard.exit_code is not None:
                return False
