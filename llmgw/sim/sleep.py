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

Level 2 discards the weights (vLLM's worker keeps only the model's
buffers; its sleep mode backend maps the weights' memory again, empty, on
a wake): woken without C{reload_weights}, vLLM answers, with no error, text
that no longer depends on the prompt (its weights are gone).  The
simulator does the same: every completion is the one of an empty prompt
(L{SleepMode.garbled}) until C{POST /collective_rpc} with
C{reload_weights} while the C{weights} tag is awake, the calls vLLM's
"Sleep Mode" document gives for level 2 (C{/wake_up?tags=weights}, then
C{reload_weights}, then C{/wake_up?tags=kv_cache}).  A reload while the
weights still sleep is refused with a 500 (vLLM would write into unmapped
memory).  Sleep at level 1 or more already empties the prefix cache
(vLLM's engine core pauses its scheduler with C{clear_cache}), so no
C{/reset_prefix_cache} is needed after a wake.

Time and memory: going to sleep takes C{--sleep-seconds}, waking
C{--wake-seconds}; the engine holds C{--gpu-memory-gb} awake (from the
moment a wake begins) and C{--sleep-gpu-memory-gb} once asleep.  A
generation request while asleep waits until the engine is awake, as vLLM's
paused scheduler keeps it (L{SleepMode.awake}).
"""

from __future__ import annotations

import json
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
another changes nothing, as in vLLM.  C{scheduling} may be named too: it
resumes a level-0 sleep, and vLLM's engine core drops it from the tags it
hands its executor (vLLM's C{v1/engine/core.py}, C{wake_up}).
"""

RELOAD_METHOD = "reload_weights"
"""
The C{POST /collective_rpc} method that loads the weights again after a
level-2 sleep (vLLM's C{v1/worker/gpu_worker.py}, C{reload_weights}); the
only one the simulator knows.
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
    @ivar weights_lost: a level-2 sleep discarded the weights, and no
        C{reload_weights} has loaded them since.
    """

    def __init__(self, config: SleepConfig, clock: IReactorTime) -> None:
        self.config = config
        self.clock = clock
        self.asleep = False
        self.level = 0
        self.busy = ""
        self.cycles = 0
        self.weights_lost = False
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
            # Level 0 only pauses the scheduler: the executor's memory
            # stays (vLLM's engine core calls no executor sleep).
            self._tags = set(VLLM_TAGS) if level else set()
            self.weights_lost = self.weights_lost or level == 2

        return self._after(self.config.sleep_seconds, asleep)

    def wake(self, tags: list[str] | None = None) -> Deferred[bool]:
        """
        Wake the tags named (all when L{None}), after
        L{SleepConfig.wake_seconds}, as vLLM's engine core does: the
        C{scheduling} tag is dropped; the others go to the executor, which
        changes nothing when awake or when one of them is not asleep
        ("Executor is not sleeping", "Tag ... is not in sleeping tags"); the
        engine is awake again once no tag sleeps (a level-0 sleep has none).

        @return: fires with whether it is fully awake after the wake.
        """
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if not self.asleep or self.busy:
            return self._after(0, lambda: None).addCallback(lambda _: not self.asleep)
        waking: set[str] = set()
        if tags is None or (tags and set(tags) <= self._tags):
            waking = set(self._tags if tags is None else tags)
        if self._tags - waking:
            delay = self.config.wake_seconds if waking else 0.0
        else:
            self.busy = "waking"
            delay = self.config.wake_seconds if self._tags else 0.0

        def woken() -> None:
            self._tags -= waking
            if not self._tags:
                self.asleep = False
                self.level = 0
                self.busy = ""
                waiting, self._waiting = self._waiting, []
                for d in waiting:
                    d.callback(None)

        done = self._after(delay, woken)
        return done.addCallback(lambda _: not self.asleep)

    def reload_weights(self) -> str:
        """
        C{reload_weights} through C{POST /collective_rpc}: the weights
        loaded again (vLLM reads them from the model's folder in place).

        @return: C{""} when done, else why not: the C{weights} tag still
            sleeps (vLLM would load into unmapped memory).
        """
        if "weights" in self._tags:
            return "reload_weights: the weights sleep; wake them first"
        self.weights_lost = False
        return ""

    @property
    def garbled(self) -> bool:
        """
        Whether completions come from lost weights: awake after a level-2
        sleep with no C{reload_weights} since.
        """
        return self.weights_lost and not self.asleep

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
            "weights_lost": self.weights_lost,
            "gpu_memory_gb": self.gpu_memory_gb,
        }


def collective_rpc(sleep: SleepMode, body: bytes) -> tuple[int, object]:
    """
    vLLM's C{POST /collective_rpc} (its C{entrypoints/serve/dev/rpc}
    router): a JSON object naming a worker C{method}, answered with each
    worker's result (C{{"results": [null]}}: one worker here).

    @param body: the request's JSON body.
    @return: 200 and the JSON answer; or the error status and its message:
        400 for a body that is not such an object or names no method (the
        router's own checks), 500 for a method the workers do not have
        (the simulator knows only L{RELOAD_METHOD}) or a reload while the
        weights sleep (L{SleepMode.reload_weights}).
    """
    try:
        obj = json.loads(body)
    except ValueError as e:
        return 400, f"JSON decode error: {e}"
    if not isinstance(obj, dict):
        return 400, "Request body must be a JSON object"
    method = obj.get("method")
    if method is None:
        return 400, "Missing 'method' in request body"
    if method != RELOAD_METHOD:
        return 500, f"'Worker' object has no attribute {method!r}"
    refused = sleep.reload_weights()
    if refused:
        return 500, refused
    return 200, {"results": [None]}
