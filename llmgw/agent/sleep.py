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

A level-2 sleep discards the weights, and a plain C{/wake_up} maps their
memory again empty: the engine then answers, with no error, text its
weights no longer make.  So a wake from level 2 takes the calls of vLLM's
"Sleep Mode" document (and its worker's C{reload_weights},
C{v1/worker/gpu_worker.py}, vLLM 0.32): C{POST /wake_up?tags=weights},
C{POST /collective_rpc} with C{{"method": "reload_weights"}} (the weights
read again from the model's folder, in place), C{POST
/wake_up?tags=kv_cache}.  No C{/reset_prefix_cache} follows: vLLM's
engine core empties the prefix cache when it sleeps at level 1 or 2.  The
level is the engine's own word where it gives it (its
C{vllm:engine_sleep_state} gauge, C{sleep_state="discard_all"} at level
2; L{discarded}), else the level the agent put it to sleep at.

A shard's turns to sleep and to wake, which call these routes, are
L{llmgw.agent.turns}; the supervisor sees that a woken engine's GPUs are
free (L{llmgw.agent.supervisor.Supervisor.wake}).
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.web.client import FileBodyProducer, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent

from llmgw.agent.engines import CommandRefused, engine_url
from llmgw.wire import agent_pb2 as pb

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


RELOAD_BODY = json.dumps({"method": "reload_weights"}).encode()
"""
The C{POST /collective_rpc} body that loads an engine's weights again
(vLLM's worker method C{reload_weights}, with no arguments: from the
model's own folder).
"""

_DISCARDED = re.compile(
    r'^vllm:engine_sleep_state\{[^}]*sleep_state="discard_all"[^}]*\}\s+(\S+)',
    re.MULTILINE,
)


def discarded(metrics: str) -> bool | None:
    """
    @param metrics: an engine's C{GET /metrics} text.
    @return: whether its C{vllm:engine_sleep_state} gauge says it sleeps at
        level 2 (C{sleep_state="discard_all"} 1; vLLM's
        C{v1/metrics/loggers.py}), L{None} when it has no such gauge.
    """
    values = _DISCARDED.findall(metrics)
    if not values:
        return None
    return any(v not in ("0", "0.0") for v in values)


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
        text = await self._text(path, method, body, timeout)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    async def _text(
        self,
        path: str,
        method: bytes = b"GET",
        body: bytes = b"",
        timeout: float = ASK_TIMEOUT,
    ) -> str:
        """
        @return: the engine's answer to C{method path}, stripped.
        @raise CommandRefused: as L{_call}.
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
        return text

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

    async def wake(self, level: int) -> None:
        """
        Wake the engine, its weights loaded again when it slept at level 2
        (see the module's docstring), and check it says it is awake.

        @param level: the level the agent put it to sleep at: 2 reloads
            the weights unless the engine's gauge says otherwise.
        @raise CommandRefused: the engine refused, or stayed asleep.
        """
        if self._engine == "sglang":
            await self._call(b"POST", "/resume_memory_occupation", b"{}")
            return
        if await self._discarded(level):
            await self._call(b"POST", "/wake_up?tags=weights")
            await self._call(b"POST", "/collective_rpc", RELOAD_BODY)
            await self._call(b"POST", "/wake_up?tags=kv_cache")
        else:
            await self._call(b"POST", "/wake_up")
        await self._confirm(False)

    async def _discarded(self, level: int) -> bool:
        """
        @return: whether the engine's weights were discarded: its gauge's
            word (L{discarded}), else whether C{level} is 2.
        """
        try:
            text = await self._text("/metrics")
        except CommandRefused:
            text = ""
        said = discarded(text)
        return level == 2 if said is None else said

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


def can_tell(command: pb.StartShard) -> bool:
    """
    @return: whether the engine of C{command} runs in sleep mode and can be
        asked whether it sleeps (vLLM and the simulator; SGLang has no such
        route).
    """
    return bool(command.sleep_level) and command.engine in ("vllm", "sim")
