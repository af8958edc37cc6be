"""
The simulator's sleep mode, as vLLM's (C{--enable-sleep-mode} with
C{VLLM_SERVER_DEV_MODE=1}) and SGLang's (C{--enable-memory-saver}) serve
it; C{llmgw sim} takes vLLM's flag for both.

vLLM's routes: C{POST /sleep?level=0|1|2} (0 pauses scheduling only, 1 keeps the
weights in host memory, 2 discards them; answered C{{"status":
"sleeping", "level": N}} once asleep), C{POST
/wake_up} (optional C{?tags=weights&tags=kv_cache}; an empty 200 once
woken), C{GET /is_sleeping} (C{{"is_sleeping": bool}}), and the gauge
C{vllm:engine_sleep_state} (label C{sleep_state}: C{awake},
C{weights_offloaded}, C{discard_all}; 1 for the state the engine is in, 0
for the others).  SGLang's: C{POST /release_memory_occupation} and C{POST
/resume_memory_occupation}, with a JSON body C{{}} or C{{"tags": [...]}}.
Without the flag none of these routes exists (404), as in vLLM.  vLLM's
need no API key (its key protects C{/v1} only); SGLang's need it when one
is set, as SGLang's C{ADMIN_OPTIONAL} routes do.

Time and memory: going to sleep takes C{--sleep-seconds}, waking
C{--wake-seconds}; the engine holds C{--gpu-memory-gb} awake (from the
moment a wake begins) and C{--sleep-gpu-memory-gb} once asleep.  A
generation request while asleep waits until the engine is awake, as vLLM's
paused scheduler keeps it (L{SleepMode.awake}).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""
The values of C{vllm:engine_sleep_state}'s C{sleep_state} label: awake,
asleep at level 1, asleep at level 2.
"""

VLLM_TAGS = ("weights", "kv_cache")
"""
What C{POST /wake_up?tags=...} may name (vLLM's sleep tags); a wake naming
another changes nothing, as in vLLM.
"""

SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")
"""
What SGLang's memory routes' C{tags} may name.
"""

SGLANG_PATHS = (b"/release_memory_occupation", b"/resume_memory_occupation")
"""
SGLang's memory routes, which need the API key when one is set.
"""

UNSUPPORTED = "ValueError: Sleep mode is not supported on current platform."
"""
The line vLLM ends with when started with C{--enable-sleep-mode} on a
platform without it (a CPU); C{llmgw sim --sleep-mode-unsupported} prints
it and exits 1, as vLLM does.
"""


@dataclass(frozen=True, slots=True)
class SleepConfig:
    """
    The simulator's sleep settings, as given on the command line.

    @ivar enabled: C{--enable-sleep-mode}: the sleep routes exist.
    @ivar unsupported: C{--sleep-mode-unsupported}: C{--enable-sleep-mode}
        is refused at start as vLLM refuses it on a CPU (L{UNSUPPORTED}).
    @ivar sleep_seconds: seconds a sleep takes before it is answered.
    @ivar wake_seconds: seconds a wake takes before it is answered.
    @ivar gpu_memory_gb: GB the engine holds on each GPU while awake.
    @ivar sleep_gpu_memory_gb: GB it keeps on each GPU while asleep.
    @ivar release_seconds: seconds after a sleep ends before the memory it
        gave back shows free (C{--release-seconds}).
    """

    enabled: bool = False
    unsupported: bool = False
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    gpu_memory_gb: float = 0.0
    sleep_gpu_memory_gb: float = 0.0
    release_seconds: float = 0.0


class SleepMode:
    """
    Whether the simulated engine sleeps, and what it holds.

    @ivar asleep: whether it sleeps (from the end of a sleep to the end of
        the wake that wakes every tag, as vLLM's executor says).
    @ivar level: the level it sleeps at: 0 (scheduling paused, memory
        kept), 1 or 2; 0 while awake.
    @ivar busy: C{"sleeping"} while a sleep is under way, C{"waking"}
        while a wake is, else C{""}.
    @ivar cycles: sleeps completed since start.
    """

    def __init__(self, config: SleepConfig, clock: IReactorTime) -> None:
        self.config = config
        self.clock = clock
        self.asleep = False
        self.level = 0
        self.busy = ""
        self.cycles = 0
        # Tags still asleep: a wake naming some of them leaves the others.
        self._tags: set[str] = set()
        self._asleep_at = 0.0
        self._waiting: list[Deferred[None]] = []

    @property
    def gpu_memory_gb(self) -> float:
        """
        GB held on each GPU now: the asleep figure once asleep at level 1
        or 2 (and C{release_seconds} after), the awake one from the moment
        a wake begins.
        """
        c = self.config
        released = self.clock.seconds() - self._asleep_at >= c.release_seconds
        if self.asleep and self.level and self.busy != "waking" and released:
            return c.sleep_gpu_memory_gb
        return c.gpu_memory_gb

    @property
    def state(self) -> str:
        """
        The C{sleep_state} label set to 1 now (L{SLEEP_STATES}); C{""}
        for none (asleep at level 0: scheduling paused only).
        """
        if not self.asleep:
            return "awake"
        return {1: "weights_offloaded", 2: "discard_all"}.get(self.level, "")

    def _after(self, seconds: float, then: Callable[[], None]) -> Deferred[None]:
        done: Deferred[None] = Deferred()

        def finish() -> None:
            then()
            done.callback(None)

        self.clock.callLater(seconds, finish)
        return done

    def sleep(self, level: int) -> Deferred[None]:
        """
        Go to sleep at C{level}, after L{SleepConfig.sleep_seconds}; already
        asleep, nothing changes (vLLM: "Executor is already sleeping").

        @param level: 0, 1 or 2.
        @return: fires once asleep.
        """
        if self.asleep or self.busy:
            return self._after(0, lambda: None)
        self.busy = "sleeping"

        def asleep() -> None:
            self.busy = ""
            self.asleep = True
            self._asleep_at = self.clock.seconds()
            self.level = level
            self.cycles += 1
            self._tags = set(VLLM_TAGS)

        return self._after(self.config.sleep_seconds, asleep)

    def wake(self, tags: list[str] | None = None) -> Deferred[bool]:
        """
        Wake the tags named (all when L{None}), after
        L{SleepConfig.wake_seconds}.  Awake, or naming a tag not asleep,
        nothing changes (vLLM: "Executor is not sleeping", "Tag ... is not
        in sleeping tags").

        @return: fires with whether it is fully awake after the wake.
        """
        if not self.asleep or self.busy or (tags and not set(tags) <= self._tags):
            return self._after(0, lambda: None).addCallback(lambda _: not self.asleep)
        waking = set(self._tags if not tags else tags)
        if self._tags <= waking:
            self.busy = "waking"

        def woken() -> None:
            self._tags -= waking
            if not self._tags:
                self.asleep = False
                self.level = 0
                self.busy = ""
                waiting, self._waiting = self._waiting, []
                for d in waiting:
                    d.callback(None)

        done = self._after(self.config.wake_seconds, woken)
        return done.addCallback(lambda _: not self.asleep)

    def awake(self) -> Deferred[None] | None:
        """
        @return: L{None} when awake; else fires once woken: vLLM accepts
            requests while asleep and schedules them once awake.
        """
        if not self.asleep:
            return None
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        return d

    def json(self) -> dict[str, object]:
        """
        The sleep part of C{GET /sim/stats}.
        """
        return {
            "sleep_mode": self.config.enabled,
            "sleep_state": self.state or "paused",
            "is_sleeping": self.asleep,
            "sleep_level": self.level,
            "sleep_busy": self.busy,
            "sleep_cycles": self.cycles,
            "gpu_memory_gb": self.gpu_memory_gb,
        }
