"""
Sleep on the node: the engines' sleep-mode flags, the calls to their
sleep and wake routes, and what is checked after a wake.

Flags, only when C{StartShard.sleep_level} is not 0: vLLM
C{--enable-sleep-mode} with C{VLLM_SERVER_DEV_MODE=1} in its environment
(its sleep routes exist only then), SGLang C{--enable-memory-saver},
C{llmgw sim} C{--enable-sleep-mode}.  An engine that exits while starting
with a line refusing sleep mode (vLLM on a CPU: "Sleep mode is not
supported on current platform.") is started once more without them
(L{refusal}).

The routes are called by the agent on the node, on the engine's own
address and port (L{llmgw.agent.engines.engine_url}), never through a
router, with the engine's key as C{Authorization: Bearer}: vLLM and the
simulator C{POST /sleep?level=N}, C{POST /wake_up}, then C{GET
/is_sleeping} to confirm; SGLang C{POST /release_memory_occupation} and
C{POST /resume_memory_occupation} with C{{}}.
"""

from __future__ import annotations

import io
import json
import re
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.web.client import FileBodyProducer, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from llmgw.agent.engines import CommandRefused, engine_url
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState

if TYPE_CHECKING:
    from llmgw.agent.supervisor import Shard, Supervisor

SLEEP_TIMEOUT = 600.0
"""
Seconds a sleep or a wake may take before the command fails (vLLM's level
2 wake reloads the weights from disk).
"""

ASK_TIMEOUT = 10.0
"""
Seconds an adopted engine has to answer whether it sleeps.
"""

TURN_POLL = 1.0
"""
Seconds between the questions to an adopted engine recorded turning (its
agent ended during a sleep or a wake) until it has turned.
"""

STOP_GRACE = 30.0
"""
Seconds an engine adopted asleep that woke and will not sleep again has to
stop before it is killed.
"""

MEMORY_TOLERANCE = 0.10
"""
The share by which the GPU memory an engine holds after a wake may differ
from what placement expects before it is reported.
"""

_REFUSAL = re.compile(
    r"(sleep mode|memory saver|memory_saver)[^\n]*"
    r"(not supported|unsupported|not available)",
    re.IGNORECASE,
)


def refusal(output: list[str]) -> str | None:
    """
    @param output: an engine's last output lines.
    @return: the last line refusing sleep mode, stripped, or L{None}.
    """
    for line in reversed(output):
        if _REFUSAL.search(line):
            return line.strip()[:500]
    return None


def without_sleep(command: pb.StartShard) -> pb.StartShard:
    """
    @return: a copy of C{command} with C{sleep_level} 0.
    """
    copy = pb.StartShard()
    copy.CopyFrom(command)
    copy.sleep_level = 0
    return copy


def flag_value(argv: list[str], flag: str) -> float:
    """
    @return: the last value given to C{flag} in C{argv} (C{--flag V} or
        C{--flag=V}), 0 when none or not a number.
    """
    found = 0.0
    for i, arg in enumerate(argv):
        text = None
        if arg == flag and i + 1 < len(argv):
            text = argv[i + 1]
        elif arg.startswith(flag + "="):
            text = arg[len(flag) + 1 :]
        if text is not None:
            try:
                found = float(text)
            except ValueError:
                found = 0.0
    return found


def memory_note(held_gb: float, expected_gb: float) -> str:
    """
    @param held_gb: GB the engine holds on each of its GPUs after a wake.
    @param expected_gb: what placement expects (the profile's
        C{gpu_memory_gb}); 0: unsaid, nothing is checked.
    @return: C{ShardStatus.note} when they differ by more than
        L{MEMORY_TOLERANCE}, else C{""}.
    """
    if expected_gb <= 0 or abs(held_gb - expected_gb) <= MEMORY_TOLERANCE * expected_gb:
        return ""
    return f"gpu memory after wake: {held_gb:.3g} GB held, expected {expected_gb:g} GB"


class EngineRoutes:
    """
    The sleep and wake routes of one engine, called from its node.

    @param http: the agent's HTTP client.
    @param clock: times the calls out (L{SLEEP_TIMEOUT}).
    @param command: the shard's start (engine, port).
    @param host: the interface the engine listens on.
    @param headers: its C{Authorization}, when it has a key.
    """

    def __init__(
        self,
        http: IAgent,
        clock: IReactorTime,
        command: pb.StartShard,
        host: str,
        headers: dict[str, str],
    ) -> None:
        self._http = http
        self._clock = clock
        self._engine = command.engine
        self._base = engine_url(host, command.port)
        self._headers = headers

    async def _call(
        self,
        method: bytes,
        path: str,
        body: bytes = b"",
        timeout: float = SLEEP_TIMEOUT,
    ) -> Any:
        """
        @return: the engine's JSON answer (L{None} for none).
        @raise CommandRefused: it answered other than 200 (code
            C{sleep_refused}, with its answer), or could not be reached.
        """
        headers = Headers({k.encode(): [v.encode()] for k, v in self._headers.items()})
        producer = None
        if body:
            headers.setRawHeaders(b"content-type", [b"application/json"])
            producer = FileBodyProducer(io.BytesIO(body))
        try:
            d = self._http.request(
                method, (self._base + path).encode(), headers, producer
            )
            d.addTimeout(timeout, self._clock)
            response = await d
            answer = await readBody(response)
        except CommandRefused:
            raise
        except Exception as e:
            raise CommandRefused(f"{path}: cannot reach the engine: {e}") from None
        text = answer.decode("utf-8", "replace").strip()
        if response.code != 200:
            raise CommandRefused(
                f"{path}: the engine answered {response.code}: {text[:500]}",
                "sleep_refused",
            )
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    async def sleep(self, level: int) -> None:
        """
        Put the engine to sleep at C{level}, and check it says it sleeps.

        @raise CommandRefused: the engine refused, or did not sleep.
        """
        if self._engine == "sglang":
            await self._call(b"POST", "/release_memory_occupation", b"{}")
            return
        await self._call(b"POST", f"/sleep?level={level}")
        await self._confirm(True)

    async def wake(self) -> None:
        """
        Wake the engine, and check it says it is awake.

        @raise CommandRefused: the engine refused, or stayed asleep.
        """
        if self._engine == "sglang":
            await self._call(b"POST", "/resume_memory_occupation", b"{}")
            return
        await self._call(b"POST", "/wake_up")
        await self._confirm(False)

    async def _confirm(self, sleeping: bool) -> None:
        if await self.asleep() is not sleeping:
            raise CommandRefused(
                f"/is_sleeping: the engine answered {not sleeping} after"
                f" {'/sleep' if sleeping else '/wake_up'}",
                "sleep_refused",
            )

    async def asleep(self, timeout: float = SLEEP_TIMEOUT) -> bool:
        """
        @param timeout: seconds the engine has to answer.
        @return: what the engine's C{GET /is_sleeping} says
            (C{{"is_sleeping": bool}}; vLLM and the simulator).
        @raise CommandRefused: it could not be reached in time, or
            answered something else.
        """
        answer = await self._call(b"GET", "/is_sleeping", timeout=timeout)
        sleeping = answer.get("is_sleeping") if isinstance(answer, dict) else None
        if not isinstance(sleeping, bool):
            raise CommandRefused(
                f"/is_sleeping: the engine answered {answer!r}", "sleep_refused"
            )
        return sleeping

    async def sim_memory_gb(self) -> float | None:
        """
        @return: the GB a sim engine says it holds on each GPU (its
            C{/sim/stats}), or L{None} when it does not say.
        """
        try:
            stats = await self._call(b"GET", "/sim/stats")
        except CommandRefused:
            return None
        held = stats.get("gpu_memory_gb") if isinstance(stats, dict) else None
        return float(held) if isinstance(held, (int, float)) else None


def _routes(shard: Shard) -> EngineRoutes:
    supervisor = shard.supervisor
    return EngineRoutes(
        supervisor.http,
        supervisor.reactor,
        shard.command,
        shard.launch.host,
        shard.launch.headers,
    )


def _shard(supervisor: Supervisor, shard_id: str, state: int) -> Shard:
    shard = supervisor.shards.get(shard_id)
    if shard is None:
        raise CommandRefused(f"no shard {shard_id!r} on this node")
    if shard.state != state:
        now = ShardState.from_pb(shard.state) or "unknown"
        wanted = ShardState.from_pb(state)
        raise CommandRefused(f"shard {shard_id} is {now}, not {wanted}")
    return shard


async def sleep_shard(supervisor: Supervisor, shard_id: str, level: int) -> None:
    """
    Put a ready shard's engine to sleep; the shard is C{sleeping} once the
    engine answered (and recorded so, for an agent that restarts).

    @param level: 1 or 2 (vLLM's levels; SGLang releases all at either).
    @raise CommandRefused: no such shard, not ready, started without
        sleep mode (code C{sleep_refused}), or the engine refused (code
        C{sleep_refused}, its answer) or could not be reached.
    """
    shard = _shard(supervisor, shard_id, pb.SHARD_STATE_READY)
    if not shard.command.sleep_level:
        raise CommandRefused(
            f"shard {shard_id} runs without sleep mode", "sleep_refused"
        )
    if level not in (1, 2):
        raise CommandRefused(f"level: expected 1 or 2, got {level}")
    _turning(shard, "sleep")
    try:
        await _routes(shard).sleep(level)
    except CommandRefused:
        _turning(shard, "")
        raise
    shard.turning = ""
    shard.set_state(pb.SHARD_STATE_SLEEPING)
    supervisor.record(shard)


def _turning(shard: Shard, turning: str) -> None:
    """
    Record that C{shard}'s engine is C{turning} (C{"sleep"}, C{"wake"}),
    or no longer (C{""}): an agent that ends while the engine's route runs
    leaves its successor a record that says so (L{check_adopted}).
    """
    shard.turning = turning
    if shard.exit_code is None and not shard.stopping:
        shard.supervisor.record(shard)


async def wake_shard(supervisor: Supervisor, shard_id: str) -> None:
    """
    Wake a sleeping shard's engine: C{waking} while its wake route runs,
    C{ready} after, with a note when the GPU memory it holds then is not
    what placement expects (L{memory_note}).

    @raise CommandRefused: no such shard, not sleeping, another engine
        awake on its GPUs (code C{gpus_in_use}), or the engine refused
        (code C{sleep_refused}: the shard is C{sleeping} again) or could
        not be reached.
    """
    shard = _shard(supervisor, shard_id, pb.SHARD_STATE_SLEEPING)
    if shard.checking is not None:
        # Adopted: it may be put back to sleep first (L{check_adopted}).
        await _checked(shard)
        shard = _shard(supervisor, shard_id, pb.SHARD_STATE_SLEEPING)
    for other in supervisor.shards.values():
        shared = set(other.command.gpu_indices) & set(shard.command.gpu_indices)
        awake = other.state != pb.SHARD_STATE_SLEEPING and other.exit_code is None
        if other is not shard and shared and awake:
            raise CommandRefused(
                f"GPUs {sorted(shared)} are not free: shard {other.id} holds them",
                "gpus_in_use",
            )
    routes = _routes(shard)
    shard.set_state(pb.SHARD_STATE_WAKING)
    _turning(shard, "wake")
    try:
        await routes.wake()
    except CommandRefused:
        if shard.state == pb.SHARD_STATE_WAKING:
            shard.set_state(pb.SHARD_STATE_SLEEPING)
        _turning(shard, "")
        raise
    shard.turning = ""
    if shard.state != pb.SHARD_STATE_WAKING:
        # Stopped or ended meanwhile.
        return
    if shard.command.engine == "sim":
        held = await routes.sim_memory_gb()
    else:
        held = await supervisor.gpu_memory(shard)
    if held is not None:
        shard.note = memory_note(held, shard.command.gpu_memory_gb)
    shard.set_state(pb.SHARD_STATE_READY)
    supervisor.record(shard)


def can_tell(command: pb.StartShard) -> bool:
    """
    @return: whether the engine of C{command} runs in sleep mode and can be
        asked whether it sleeps (vLLM and the simulator; SGLang has no such
        route).
    """
    return bool(command.sleep_level) and command.engine in ("vllm", "sim")


async def check_adopted(shard: Shard) -> None:
    """
    An engine in sleep mode that a previous agent started, adopted: its
    record may be stale (woken or put to sleep behind its agent's back, or
    written by an agent that recorded only once the engine answered), and
    its marker says it is awake whatever it is.  The engine's C{GET
    /is_sleeping} decides (see L{can_tell}); one recorded C{turning} (that
    agent ended while the engine's sleep or wake route ran; it is adopted
    as awake, C{starting}, holding its GPUs) is asked until it has turned
    (L{_turned}).  One taken as awake (C{starting}, its probes passed)
    becomes C{ready}, or C{sleeping} when it sleeps.  One recorded asleep
    (the server counts its GPU memory free) that is awake is put back to
    sleep, or stopped when it will not sleep.  When the engine cannot say,
    the record (or the marker) stands.
    """
    routes = _routes(shard)
    asleep: bool | None = None
    try:
        asleep = await _turned(shard, routes)
    except CommandRefused as e:
        shard.log.warn(
            "shard {shard}: cannot ask its engine whether it sleeps ({error});"
            " taken as recorded",
            shard=shard.id,
            error=str(e),
        )
    if shard.stopping or shard.exit_code is not None:
        return
    if shard.turning:
        _turning(shard, "")
    if shard.state == pb.SHARD_STATE_STARTING:
        if asleep:
            shard.log.warn(
                "shard {shard}: adopted as awake, its engine sleeps: sleeping",
                shard=shard.id,
            )
            shard.set_state(pb.SHARD_STATE_SLEEPING)
            shard.supervisor.record(shard)
        else:
            shard.log.info("shard {shard} is ready", shard=shard.id)
            shard.set_state(pb.SHARD_STATE_READY)
        return
    if shard.state != pb.SHARD_STATE_SLEEPING or asleep is not False:
        return
    shard.log.warn(
        "shard {shard}: recorded asleep, its engine is awake (woken behind"
        " its agent's back): putting it back to sleep",
        shard=shard.id,
    )
    try:
        await routes.sleep(shard.command.sleep_level)
    except CommandRefused as e:
        if shard.state == pb.SHARD_STATE_SLEEPING and not shard.stopping:
            shard.log.warn(
                "shard {shard}: its engine will not sleep again ({error}): stopping it",
                shard=shard.id,
                error=str(e),
            )
            shard.stop(STOP_GRACE)


async def _turned(shard: Shard, routes: EngineRoutes) -> bool:
    """
    @return: whether C{shard}'s engine sleeps.  One recorded C{turning}
        (its agent ended while the engine's sleep or wake route ran) is
        asked every L{TURN_POLL} seconds until it has turned, for at most
        L{SLEEP_TIMEOUT}: engines answer the state they leave until the
        turn is done (vLLM's executor flag; the simulator).  Meanwhile a
        question it does not answer is asked again.
    @raise CommandRefused: the engine could not say (the last question,
        for one recorded C{turning}).
    """
    if not shard.turning:
        return await routes.asleep(ASK_TIMEOUT)
    clock = shard.supervisor.reactor
    deadline = clock.seconds() + SLEEP_TIMEOUT
    while True:
        try:
            asleep = await routes.asleep(ASK_TIMEOUT)
        except CommandRefused:
            if clock.seconds() >= deadline:
                raise
        else:
            if asleep == (shard.turning == "sleep") or clock.seconds() >= deadline:
                return asleep
        await deferLater(clock, TURN_POLL)
        if shard.stopping or shard.exit_code is not None:
            return False


def begin_check(shard: Shard) -> None:
    """
    Run L{check_adopted} for C{shard}, as C{shard.checking} until it ends:
    meanwhile a wake waits for it (L{wake_shard}) and its GPUs count as
    held (L{llmgw.agent.supervisor.Supervisor.start}).
    """

    def ended(result: object) -> None:
        shard.checking = None

    checking = shard.checking = Deferred.fromCoroutine(check_adopted(shard))
    checking.addErrback(
        lambda f: shard.log.failure("checking shard {shard}", f, shard=shard.id)
    )
    checking.addBoth(ended)


def _checked(shard: Shard) -> Deferred[None]:
    """
    @return: fires when C{shard}'s check (L{begin_check}) has ended.
    """
    done: Deferred[None] = Deferred()

    def ended(result: object) -> object:
        done.callback(None)
        return result

    assert shard.checking is not None
    shard.checking.addBoth(ended)
    return done


def simulated_memory_mib(supervisor: Supervisor) -> dict[int, int]:
    """
    @return: per GPU index, the MiB the sim engines running on it hold:
        the C{--gpu-memory-gb} of their command line, or their
        C{--sleep-gpu-memory-gb} while asleep (the agent puts them to
        sleep and wakes them, so it knows which).
    """
    held: dict[int, int] = {}
    for shard in supervisor.shards.values():
        if shard.command.engine != "sim" or shard.exit_code is not None:
            continue
        asleep = shard.state == pb.SHARD_STATE_SLEEPING
        flag = "--sleep-gpu-memory-gb" if asleep else "--gpu-memory-gb"
        mib = int(flag_value(shard.launch.argv, flag) * 1024)
        for index in shard.command.gpu_indices:
            held[index] = held.get(index, 0) + mib
    return held
