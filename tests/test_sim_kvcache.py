"""
Tests for what routing needs measured in L{llmgw.sim}: the speed factor, the
KV capacity (requests beyond it wait) and the prefix cache (prefill time grows
with the uncached prompt tokens), through the real L{SimSite} under a
L{Clock}, and their vLLM-named metrics.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.routing.load import parse_load
from llmgw.sim.cli import build_parser, sim_config
from llmgw.sim.engine import Scheduler, SimConfig, Simulator, completion_tokens
from llmgw.sim.kvcache import BLOCK_TOKENS, PrefixCache, SequenceBlocks, block_hashes
from llmgw.sim.web import SimSite
from tests.test_sim_site import _Conn

SYSTEM = " ".join(f"s{i}" for i in range(64))
"""
A 64-token system prompt: four full blocks.
"""


def _chat(system: str, user: str, max_tokens: int = 2) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "stream": True,
    }


def _metric(sim: Simulator, name: str) -> float:
    for line in sim.metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


class BlockHashTests(SynchronousTestCase):
    """
    L{block_hashes} names full blocks by their whole prefix.
    """

    def test_full_blocks_only(self) -> None:
        """
        A partial last block has no name.
        """
        words = [b"w%d" % i for i in range(2 * BLOCK_TOKENS + 5)]
        self.assertEqual(len(block_hashes(words)), 2)

    def test_chained(self) -> None:
        """
        The same block after a different prefix has another name; the same
        prefix gives the same names.
        """
        a = [b"a"] * BLOCK_TOKENS + [b"x"] * BLOCK_TOKENS
        b = [b"b"] * BLOCK_TOKENS + [b"x"] * BLOCK_TOKENS
        self.assertNotEqual(block_hashes(a)[1], block_hashes(b)[1])
        self.assertEqual(block_hashes(a), block_hashes(list(a)))


class PrefixCacheTests(SynchronousTestCase):
    """
    L{PrefixCache}: the leading run of cached blocks, LRU eviction, counters
    in tokens.
    """

    def blocks(self, text: str) -> SequenceBlocks:
        return SequenceBlocks.of(text.encode(), [])

    def test_leading_run(self) -> None:
        """
        A lookup reuses the leading blocks in the cache, up to the first one
        missing, and counts queried and hit tokens.
        """
        cache = PrefixCache(100)
        first = self.blocks(SYSTEM + " one")
        self.assertEqual(cache.lookup(first), 0)
        cache.insert(first.prompt)
        self.assertEqual(cache.lookup(self.blocks(SYSTEM + " two")), 64)
        self.assertEqual((cache.queries, cache.hits), (130, 64))
        other = self.blocks("x " + SYSTEM)
        self.assertEqual(cache.lookup(other), 0)

    def test_last_token_recomputed(self) -> None:
        """
        A prompt made only of cached blocks reuses all but its last block.
        """
        cache = PrefixCache(100)
        same = self.blocks(SYSTEM)
        cache.insert(same.prompt)
        self.assertEqual(cache.lookup(same), 48)

    def test_lru_evicts_tail_first(self) -> None:
        """
        Beyond capacity the least recently used blocks go; a sequence's tail
        goes before its head, so a shared prefix survives.
        """
        cache = PrefixCache(4)
        a = self.blocks(SYSTEM + " " + SYSTEM)  # 8 blocks
        cache.insert(a.prompt)
        self.assertEqual(len(cache), 4)
        self.assertEqual(cache.lookup(self.blocks(SYSTEM + " q")), 64)
        b = self.blocks(" ".join(f"b{i}" for i in range(32)) + " q")
        cache.insert(b.prompt)
        # b's 2 blocks are newest; of a's four, the last two go.
        self.assertEqual(cache.lookup(self.blocks(SYSTEM + " q")), 32)
        self.assertEqual(cache.lookup(b), 32)

    def test_no_capacity(self) -> None:
        """
        A cache of 0 blocks misses every time but still counts.
        """
        cache = PrefixCache(0)
        a = self.blocks(SYSTEM + " q")
        cache.insert(a.prompt)
        self.assertEqual(cache.lookup(a), 0)
        self.assertEqual((cache.queries, cache.hits), (65, 0))


class KvSchedulerTests(SynchronousTestCase):
    """
    L{Scheduler} with a KV capacity in tokens.
    """

    def test_tokens_beyond_capacity_wait(self) -> None:
        """
        A request that does not fit the free KV tokens waits, and those behind
        it wait too (first come, first served), until tokens are released.
        """
        s = Scheduler(10, 10, kv_capacity=100)
        self.assertIsNone(s.acquire(60))
        big = s.acquire(50)
        small = s.acquire(10)
        assert big is not None and small is not None
        self.assertEqual((s.running, s.waiting, s.kv_used), (1, 2, 60))
        self.assertEqual(s.kv_usage, 0.6)
        s.release(60)
        self.successResultOf(big)
        self.successResultOf(small)
        self.assertEqual((s.running, s.waiting, s.kv_used), (2, 0, 60))

    def test_oversized_runs_alone(self) -> None:
        """
        A request larger than the whole capacity runs when nothing else does.
        """
        s = Scheduler(10, 10, kv_capacity=100)
        self.assertIsNone(s.acquire(500))
        waiter = s.acquire(1)
        assert waiter is not None
        s.release(500)
        self.successResultOf(waiter)

    def test_cancelled_head_unblocks(self) -> None:
        """
        When the head of the queue leaves, the requests behind it that fit
        are admitted.
        """
        s = Scheduler(10, 10, kv_capacity=100)
        self.assertIsNone(s.acquire(60))
        head = s.acquire(50)
        behind = s.acquire(10)
        assert head is not None and behind is not None
        head.cancel()
        self.failureResultOf(head)
        self.successResultOf(behind)
        self.assertEqual((s.running, s.waiting, s.kv_used), (2, 0, 70))


class SimRoutingTests(SynchronousTestCase):
    """
    The speed factor, KV capacity and prefix cache through the site.
    """

    def make(self, **config: Any) -> tuple[Simulator, SimSite, Clock]:
        clock = Clock()
        clock.advance(1000)
        sim = Simulator(SimConfig(models=("m",), **config), clock)
        return sim, SimSite(sim), clock

    def first_event_after(self, clock: Clock, conn: _Conn) -> float:
        """
        Seconds until C{conn}'s first event: the simulator's next timer.
        """
        self.assertEqual(conn.events(), [])
        delay = min(c.getTime() for c in clock.getDelayedCalls()) - clock.seconds()
        clock.advance(delay)
        self.assertNotEqual(conn.events(), [])
        return round(delay, 6)

    def finish(self, clock: Clock, *conns: _Conn) -> None:
        while clock.getDelayedCalls():
            clock.advance(1)
        for c in conns:
            self.assertTrue(c.head_body()[2])
            c.lose()

    def test_speed_scales_ttft_and_prefill(self) -> None:
        """
        At speed 0.5, time to first token (fixed part and prefill) doubles.
        """
        body = _chat(SYSTEM, "hello")
        times = []
        for speed in (1.0, 0.5):
            sim, site, clock = self.make(ttft=0.1, prefill_per_token=0.01, speed=speed)
            c = _Conn(site)
            c.send("/v1/chat/completions", body)
            times.append(self.first_event_after(clock, c))
            self.finish(clock, c)
        # 65 prompt tokens: 0.1 + 0.65 s, then twice that.
        self.assertEqual(times, [0.75, 1.5])

    def test_itl_scaled(self) -> None:
        """
        At speed 0.5 tokens come twice as far apart.
        """
        sim, site, clock = self.make(itl=1.0, speed=0.5)
        c = _Conn(site)
        c.send("/v1/chat/completions", _chat("a", "b", max_tokens=3))
        self.assertEqual(len(c.events()), 2)  # role chunk and first token
        clock.advance(1.9)
        self.assertEqual(len(c.events()), 2)
        clock.advance(0.1)
        self.assertEqual(len(c.events()), 3)
        self.finish(clock, c)

    def test_cached_prefix_starts_sooner(self) -> None:
        """
        A second prompt sharing a cached system prompt waits prefill only for
        its uncached tokens; the counters show the hit, in tokens.
        """
        sim, site, clock = self.make(
            ttft=0.1, prefill_per_token=0.01, prefix_cache_tokens=1024
        )
        a = _Conn(site)
        a.send("/v1/chat/completions", _chat(SYSTEM, "first question"))
        self.assertEqual(self.first_event_after(clock, a), 0.76)
        self.finish(clock, a)
        b = _Conn(site)
        b.send("/v1/chat/completions", _chat(SYSTEM, "second question"))
        # 66 tokens, 64 cached: 2 to prefill.
        self.assertEqual(self.first_event_after(clock, b), 0.12)
        self.finish(clock, b)
        self.assertEqual(_metric(sim, "vllm:prefix_cache_queries_total"), 132)
        self.assertEqual(_metric(sim, "vllm:prefix_cache_hits_total"), 64)

    def test_next_turn_hits_answer(self) -> None:
        """
        A conversation's next turn, which sends back the answer, finds the
        whole earlier turn cached, answer included.
        """
        sim, site, clock = self.make(prefix_cache_tokens=1024, prefill_per_token=0.001)
        user = " ".join(f"u{i}" for i in range(31))
        a = _Conn(site)
        first = _chat(SYSTEM, user, max_tokens=33)
        a.send("/v1/chat/completions", first)
        self.finish(clock, a)
        prompt = (SYSTEM + " " + user).encode()
        answer = "".join(completion_tokens(prompt, 33))
        earlier = first["messages"]
        assert isinstance(earlier, list)
        messages: list[object] = list(earlier)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "more"},
        ]
        b = _Conn(site)
        b.send(
            "/v1/chat/completions",
            {"model": "m", "messages": messages, "max_tokens": 1, "stream": True},
        )
        self.finish(clock, b)
        # 64 + 31 + 33 = 128 tokens: 8 full blocks cached, 1 token to prefill.
        self.assertEqual(sim.cache.hits, 128)

    def test_kv_capacity_queues(self) -> None:
        """
        Requests beyond the KV capacity wait and show as waiting in the
        metrics; the KV use is tokens held over capacity.
        """
        sim, site, clock = self.make(itl=1.0, kv_capacity=100)
        a, b = _Conn(site), _Conn(site)
        a.send("/v1/chat/completions", _chat(SYSTEM, "q", max_tokens=10))  # 75
        b.send("/v1/chat/completions", _chat(SYSTEM, "r", max_tokens=10))
        load = parse_load(sim.metrics.render().decode(), 0.0)
        self.assertEqual((load.running, load.waiting), (1.0, 1.0))
        self.assertEqual(load.kv_cache_usage, 0.75)
        for _ in range(9):
            self.assertEqual(b.events(), [])
            clock.advance(1)
        # a's last token, at 9 s, frees its 75 tokens: b starts.
        self.assertEqual(len(b.events()), 2)
        self.finish(clock, a, b)
        self.assertEqual(sim.scheduler.kv_used, 0)

    def test_kv_capacity_default_cache(self) -> None:
        """
        C{--kv-capacity} alone sizes the prefix cache to match; an explicit
        C{--prefix-cache-tokens 0} turns it off.
        """
        base = ["--port", "0", "--model", "m", "--kv-capacity", "4096"]
        for extra, expected in (([], 4096), (["--prefix-cache-tokens", "0"], 0)):
            config = sim_config(build_parser().parse_args(base + extra))
            self.assertEqual(config.prefix_cache_tokens, expected)
        self.assertRaises(
            SystemExit, build_parser().parse_args, [*base, "--speed", "0"]
        )
