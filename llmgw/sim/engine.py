"""
The simulated engine: deterministic generation, concurrency and queueing,
faults in force (L{llmgw.sim.faults}) and counters.

Nothing here does I/O; time comes from an injected L{IReactorTime}, so the
whole model runs under L{twisted.internet.task.Clock} in tests.  The HTTP
face of the simulator lives in L{llmgw.sim.web}.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from llmgw.sim.core import Core
from llmgw.sim.faults import NO_FAULTS, Faults, validate_faults
from llmgw.sim.kvcache import BLOCK_TOKENS, PrefixCache, SequenceBlocks
from llmgw.sim.lora import Adapters, LoraConfig
from llmgw.sim.metrics import SimMetrics
from llmgw.sim.sleep import SleepConfig, SleepMode

VOCAB: tuple[str, ...] = (
    " the",
    " café",
    " model",
    " naïve",
    " token",
    " 日本語",
    " gateway",
    " Ελλάδα",
    " stream",
    " 🙂",
    " replica",
    " ✓",
    " engine",
    " Straße",
    " latency",
    " 中文",
    " queue",
    " résumé",
    " batch",
    " Привет",
    " prompt",
    " señor",
    " cache",
    " 한국어",
    " request",
    " ½",
    " answer",
    " Ωmega",
    " simple",
    " €uro",
    " world",
    " 🚀",
)
"""
The simulator's vocabulary: 32 token texts, each with a leading space.  A
third of them are multi-byte in UTF-8 (2, 3 and 4 bytes per character), so
that a byte-by-byte stream splits characters.
"""

VOCAB_JSON: tuple[bytes, ...] = tuple(
    json.dumps(word, ensure_ascii=False).encode("utf-8") for word in VOCAB
)
"""
Each L{VOCAB} entry as a JSON string literal in UTF-8, prebuilt for the
streaming hot path.
"""

FOREVER = 1e6
"""
Seconds.  A stall at least this long is never scheduled: the response waits
until the client goes away.  (A delayed call of 1e9 s would overflow the
poller's millisecond timeout.)
"""


def token_indices(prompt: bytes, count: int) -> range:
    """
    The vocabulary positions of a completion, before wrapping.

    Token C{i} of the completion is C{VOCAB[(crc32(prompt) + i) % len(VOCAB)]}.

    @param prompt: the prompt text, UTF-8.
    @param count: the number of completion tokens.
    @return: C{count} integers; reduce each modulo C{len(VOCAB)}.
    """
    start = zlib.crc32(prompt)
    return range(start, start + count)


def completion_tokens(prompt: bytes, count: int) -> list[str]:
    """
    The deterministic completion of C{prompt}.

    @param prompt: the prompt text, UTF-8.
    @param count: the number of tokens to generate.
    @return: C{count} token texts, each with a leading space.
    """
    size = len(VOCAB)
    return [VOCAB[i % size] for i in token_indices(prompt, count)]


def count_prompt_tokens(text: str) -> int:
    """
    The simulator's prompt length: whitespace-separated words, at least 1.

    @param text: the prompt (for chat, all message contents joined by spaces).
    @return: a token count.
    """
    return max(1, len(text.split()))


def embedding_vector(data: bytes, dim: int) -> list[float]:
    """
    A deterministic unit vector for one embeddings input.

    Component C{j} comes from C{crc32(data + j)} mapped onto [-1, 1); the
    vector is then scaled to Euclidean length 1.

    @param data: the input text (UTF-8) or the token list's JSON.
    @param dim: the number of components.
    @return: C{dim} floats with sum of squares 1 (up to rounding).
    """
    seed = zlib.crc32(data)
    raw = [
        zlib.crc32(struct.pack("<I", j), seed) / 2147483648.0 - 1.0 for j in range(dim)
    ]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


class QueueFull(Exception):
    """
    The waiting queue is at its limit; the request must be refused (503).
    """


class Scheduler:
    """
    At most C{max_running} sequences at once, and with a KV capacity, at
    most that many tokens held by running sequences; the rest wait in FIFO
    order (a request that does not fit blocks those behind it, as vLLM's
    first-come-first-served scheduler does).

    @ivar running: sequences holding a slot now.
    @ivar kv_used: tokens the running sequences hold.
    """

    def __init__(self, max_running: int, max_queue: int, kv_capacity: int = 0) -> None:
        """
        @param max_running: concurrent sequences (slots), at least 1.
        @param max_queue: waiting requests beyond which L{acquire} raises
            L{QueueFull}.
        @param kv_capacity: tokens the KV cache holds for running sequences;
            0 for no limit.  A request larger than the whole capacity runs
            alone rather than never.
        """
        self.max_running = max_running
        self.max_queue = max_queue
        self.kv_capacity = kv_capacity
        self.running = 0
        self.kv_used = 0
        self._waiters: deque[tuple[Deferred[None], int]] = deque()
        self._releasing = False

    @property
    def waiting(self) -> int:
        """
        The number of requests in the queue.
        """
        return len(self._waiters)

    @property
    def kv_usage(self) -> float:
        """
        The KV cache's use, 0..1: tokens held over the capacity, or without
        one, running sequences over C{max_running}.
        """
        if self.kv_capacity:
            return min(1.0, self.kv_used / self.kv_capacity)
        return self.running / self.max_running

    def _fits(self, tokens: int) -> bool:
        if self.running >= self.max_running:
            return False
        capacity = self.kv_capacity
        return not capacity or not self.running or self.kv_used + tokens <= capacity

    def acquire(self, tokens: int = 0) -> Deferred[None] | None:
        """
        Take a slot and C{tokens} of KV space, or a place in the queue.

        @param tokens: KV tokens the sequence holds while it runs (prompt
            and completion).
        @return: None when a slot was taken at once; otherwise a Deferred
            that fires with None when this request holds a slot.  Cancel it
            to leave the queue (it then fails with C{CancelledError}).
        @raise QueueFull: no slot is free and the queue is full.
        """
        if not self._waiters and self._fits(tokens):
            self.running += 1
            self.kv_used += tokens
            return None
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()

        def leave(waiter: Deferred[None]) -> None:
            self._waiters.remove((waiter, tokens))
            # The head may have been what blocked those behind it.
            self._admit()

        waiter: Deferred[None] = Deferred(leave)
        self._waiters.append((waiter, tokens))
        return waiter

    def release(self, tokens: int = 0) -> None:
        """
        Give back one slot and its C{tokens}; the oldest waiters take what
        is free.
        """
        self.running -= 1
        self.kv_used -= tokens
        self._admit()

    def _admit(self) -> None:
        if self._releasing:
            # A waiter admitted below finished synchronously; the loop that
            # admitted it hands on this slot, without recursing.
            return
        self._releasing = True
        try:
            while self._waiters and self._fits(self._waiters[0][1]):
                waiter, tokens = self._waiters.popleft()
                self.running += 1
                self.kv_used += tokens
                waiter.callback(None)
        finally:
            self._releasing = False


@dataclass(frozen=True, slots=True)
class SimConfig:
    """
    The simulator's settings, as given on the command line.

    @ivar models: served model names, at least one; metrics carry the first
        as C{model_name}, as vLLM does with its first served model name.
    @ivar ttft: seconds from admission to the first token.
    @ivar itl: seconds between tokens.
    @ivar max_tokens: completion length in tokens when the request gives
        none.
    @ivar max_concurrency: concurrent sequences.
    @ivar max_queue: waiting requests beyond which requests get 503.
    @ivar embedding_dim: floats per embedding.
    @ivar verbose: log each request.
    @ivar api_key: when set, requests under C{/v1} without C{Authorization:
        Bearer API_KEY} get 401, as vLLM's C{--api-key} does (its
        middleware checks only C{/v1} paths: C{/health} and C{/metrics}
        stay open, as they are for SGLang and llama-server too).
    @ivar speed: this replica's speed; every duration (C{ttft}, C{itl},
        C{prefill_per_token}) is divided by it: 0.5 is twice as slow.
    @ivar prefill_per_token: seconds of prefill per prompt token not found
        in the prefix cache, added to C{ttft} at admission.
    @ivar kv_capacity: tokens (prompt and completion) the running sequences
        may hold together; beyond it requests wait.  0: no limit.
    @ivar prefix_cache_tokens: tokens of freed or computed blocks the
        prefix cache keeps (rounded down to whole blocks); 0: no cache.
    @ivar max_model_len: the context length in tokens: a longer prompt
        gets vLLM's 400 (L{llmgw.sim.tokens}); 0: no limit.
    @ivar sleep: its sleep mode (L{llmgw.sim.sleep}).
    @ivar lora: its LoRA adapters (L{llmgw.sim.lora}).
    @ivar reasoning_parser: vLLM's C{--reasoning-parser} name, or C{""}:
        with one, chat answers open with reasoning
        (L{llmgw.sim.api.reasoning_tokens}).
    """

    models: tuple[str, ...]
    ttft: float = 0.0
    itl: float = 0.0
    max_tokens: int = 16
    max_concurrency: int = 256
    max_queue: int = 1024
    embedding_dim: int = 16
    verbose: bool = False
    api_key: str = field(default="", repr=False)
    speed: float = 1.0
    prefill_per_token: float = 0.0
    kv_capacity: int = 0
    prefix_cache_tokens: int = 0
    max_model_len: int = 0
    sleep: SleepConfig = SleepConfig()
    lora: LoraConfig = LoraConfig()
    reasoning_parser: str = ""


@dataclass(slots=True)
class SimStats:
    """
    Counters for tests, served as JSON by C{GET /sim/stats}.

    @ivar requests_total: chat, completion and embedding requests received.
    @ivar requests_by_path: the same, by URL path.
    @ivar streams_started: streams whose headers were sent.
    @ivar streams_completed: streams that ended with C{[DONE]}.
    @ivar streams_cancelled: C{"stream": true} requests whose client went
        away before the end (in the queue, in a stall or mid-stream).
    @ivar streams_dropped: streams aborted by a C{drop_after_chunks} fault.
    @ivar requests_cancelled: chat, completion and embedding requests, streamed
        or not, whose client went away before the response ended.
    @ivar last_cancel_time: POSIX seconds (the reactor's clock) of the last
        such loss, or None.
    @ivar connections_open: HTTP connections now open; not reset.
    @ivar last_request_id: the C{X-Request-ID} header of the last counted
        request, or None, so a test can see that a gateway forwards it.
    @ivar last_traceparent: its W3C C{traceparent} header, or None: the
        trace context vLLM would continue (C{--otlp-traces-endpoint}).
    @ivar last_tracestate: its W3C C{tracestate} (its lines joined with
        commas), or None.
    """

    requests_total: int = 0
    requests_by_path: dict[str, int] = field(default_factory=dict)
    streams_started: int = 0
    streams_completed: int = 0
    streams_cancelled: int = 0
    streams_dropped: int = 0
    requests_cancelled: int = 0
    last_cancel_time: float | None = None
    connections_open: int = 0
    last_request_id: str | None = None
    last_traceparent: str | None = None
    last_tracestate: str | None = None

    def reset(self) -> None:
        """
        Zero every counter except the live C{connections_open}.
        """
        self.requests_total = 0
        self.requests_by_path = {}
        self.streams_started = 0
        self.streams_completed = 0
        self.streams_cancelled = 0
        self.streams_dropped = 0
        self.requests_cancelled = 0
        self.last_cancel_time = None
        self.last_request_id = None
        self.last_traceparent = None
        self.last_tracestate = None


class Simulator:
    """
    One simulated engine: its settings, clock, slots, faults, counters and
    metrics.  Shared by every request that the HTTP face serves.
    """

    def __init__(
        self, config: SimConfig, reactor: IReactorTime, core: Core | None = None
    ) -> None:
        """
        @param config: the settings.
        @param reactor: the clock for every delay and timestamp.
        @param core: whether its engine core lives (L{llmgw.sim.core}); by
            default one that always does.
        """
        self.config = config
        self.core = core or Core(reactor, lambda: None)
        self.clock = reactor
        self.scheduler = Scheduler(
            config.max_concurrency, config.max_queue, config.kv_capacity
        )
        self.cache = PrefixCache(config.prefix_cache_tokens // BLOCK_TOKENS)
        self.stats = SimStats()
        self.faults: dict[str, object] = {}
        self.models = frozenset(config.models)
        self.created = int(reactor.seconds())
        self.sleep = SleepMode(config.sleep, reactor)
        self.adapters = Adapters(config.models[0])
        self.metrics = SimMetrics(
            config.models[0], self.scheduler, self.cache, self.sleep
        )
        self._next_id = 0

    @property
    def tracks_blocks(self) -> bool:
        """
        Whether requests need their blocks named: a prefix cache or a prefill
        cost is configured.
        """
        c = self.config
        return c.prefix_cache_tokens >= BLOCK_TOKENS or c.prefill_per_token > 0

    def prefill_delay(self, blocks: SequenceBlocks) -> float:
        """
        Look a prompt up in the prefix cache, at admission.

        @return: seconds of prefill for its uncached tokens, at this
            replica's speed.
        """
        hit = self.cache.lookup(blocks)
        c = self.config
        return (blocks.prompt_tokens - hit) * c.prefill_per_token / c.speed

    def new_id(self, prefix: str) -> str:
        """
        A response id unique in this process, e.g. C{chatcmpl-sim-7}.
        """
        self._next_id += 1
        return f"{prefix}-sim-{self._next_id}"

    def set_faults(self, spec: object) -> dict[str, object]:
        """
        Replace the process-wide faults; an empty object clears them.

        @return: the faults now in force.
        @raise FaultError: invalid C{spec}; the faults in force are unchanged.
        """
        self.faults = validate_faults(spec)
        return dict(self.faults)

    def faults_for(self, request_spec: object) -> Faults:
        """
        The faults for one request.

        @param request_spec: the request's C{llmgw_sim} field, or None.
        @raise FaultError: invalid C{request_spec}.
        """
        if request_spec is None:
            if not self.faults:
                return NO_FAULTS
            return Faults.layered(self.faults, {})
        return Faults.layered(self.faults, validate_faults(request_spec))

    def serves(self, model: str) -> bool:
        """
        @return: whether C{model} is a served name or a loaded adapter.
        """
        return model in self.models or model in self.adapters.loaded

    def stats_json(self) -> dict[str, object]:
        """
        The counters for C{GET /sim/stats}, with the live C{running} and
        C{waiting}.
        """
        s = self.stats
        return {
            "requests_total": s.requests_total,
            "requests_by_path": dict(s.requests_by_path),
            "running": self.scheduler.running,
            "waiting": self.scheduler.waiting,
            "kv_used": self.scheduler.kv_used,
            "prefix_cache_blocks": len(self.cache),
            "prefix_cache_queries": self.cache.queries,
            "prefix_cache_hits": self.cache.hits,
            "streams_started": s.streams_started,
            "streams_completed": s.streams_completed,
            "streams_cancelled": s.streams_cancelled,
            "streams_dropped": s.streams_dropped,
            "requests_cancelled": s.requests_cancelled,
            "last_cancel_time": s.last_cancel_time,
            "connections_open": s.connections_open,
            "last_request_id": s.last_request_id,
            "last_traceparent": s.last_traceparent,
            "last_tracestate": s.last_tracestate,
            "lora_loads": dict(self.adapters.loads),
            "lora_load_requests": dict(self.adapters.load_requests),
            "lora_most_loaded": self.adapters.most_loaded,
            **self.sleep.json(),
        }
