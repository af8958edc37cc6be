"""
Engine load polling (L{llmgw.router.routing.load}): the parser on each engine's
names, and the board's loop on a L{Clock}.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.load import (
    HIT_RATE_POLLS,
    NO_METRICS_RETRY,
    EngineLoad,
    HitRate,
    LoadBoard,
    LoadCollector,
    NoLoadMetrics,
    parse_load,
)
from llmgw.sim.metrics import SimMetrics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:e2e_request_latency_seconds Histogram.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 1.0
"""

VLLM_V0 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 4
"""


class ParseTests(SynchronousTestCase):
    """
    L{parse_load} reads each engine's own names.
    """

    def test_vllm(self) -> None:
        self.assertEqual(parse_load(VLLM, 7.0), EngineLoad(3.0, 5.0, 0.25, 7.0))

    def test_vllm_v0(self) -> None:
        """
        vLLM V0's C{gpu_cache_usage_perc} stands for the cache use.
        """
        self.assertEqual(parse_load(VLLM_V0, 1.0), EngineLoad(1.0, 0.0, 0.5, 1.0))

    def test_sglang(self) -> None:
        self.assertEqual(parse_load(SGLANG, 1.0), EngineLoad(7.0, 2.0, 0.28, 1.0))

    def test_llamacpp(self) -> None:
        self.assertEqual(parse_load(LLAMACPP, 1.0), EngineLoad(1.0, 4.0, 0.125, 1.0))

    def test_llamacpp_without_cache_gauge(self) -> None:
        """
        Builds of llama-server without the cache gauge give L{None}.
        """
        text = "\n".join(
            line for line in LLAMACPP.splitlines() if "kv_cache" not in line
        )
        self.assertEqual(parse_load(text, 1.0), EngineLoad(1.0, 4.0, None, 1.0))

    def test_sim(self) -> None:
        """
        The simulator's page (L{SimMetrics}) reads as vLLM's.
        """

        class Load:
            running = 2
            waiting = 1
            kv_usage = 0.5

        class Cache:
            queries = 0
            hits = 0

        page = SimMetrics("m", Load(), Cache()).render().decode()
        load = parse_load(page, 0.0)
        self.assertEqual((load.running, load.waiting), (2.0, 1.0))
        self.assertIsNotNone(load.kv_cache_usage)

    def test_label_sets_summed(self) -> None:
        """
        Several label sets of one family (vLLM with data parallel engines)
        are summed, the cache use is the largest; label values with
        braces or escaped quotes do not confuse the line picker.
        """
        text = (
            'vllm:num_requests_running{engine="0",model_name="a}b"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="a\\"q"} 3.0\n'
            'vllm:num_requests_waiting{engine="0"} 1.0\n'
            'vllm:num_requests_waiting{engine="1"} 4.0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.25\n'
        )
        self.assertEqual(parse_load(text, 1.0), EngineLoad(5.0, 5.0, 0.5, 1.0))

    def test_vllm_prefix_cache_counters(self) -> None:
        """
        vLLM's prefix cache counters (tokens, one sample per engine) are
        read as totals, summed over engines; the rate is the board's.
        """
        text = VLLM + (
            "# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 400.0\n'
            "# TYPE vllm:prefix_cache_queries_created gauge\n"
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0\n'
            "# TYPE vllm:external_prefix_cache_hits counter\n"
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 9.0\n'
        )
        self.assertEqual(
            parse_load(text, 7.0),
            EngineLoad(3.0, 5.0, 0.25, 7.0, 1000.0, 256.0, None),
        )

    def test_real_vllm_prefix_cache_counters(self) -> None:
        """
        The page a real vLLM 0.32 served (C{tests/data}, after one short
        prompt): 6 tokens looked up, none found; its C{_created} gauges
        and the external cache's counters beside them are not taken.
        """
        path = os.path.join(
            os.path.dirname(__file__), "data", "vllm-0.32.0-metrics.txt"
        )
        with open(path) as f:
            load = parse_load(f.read(), 0.0)
        self.assertEqual(
            (load.prefix_cache_queries, load.prefix_cache_hits), (6.0, 0.0)
        )

    def test_no_prefix_cache_counters(self) -> None:
        """
        Engines without the counters (SGLang, llama.cpp) give L{None}.
        """
        load = parse_load(SGLANG, 1.0)
        self.assertEqual(
            (load.prefix_cache_queries, load.prefix_cache_hits), (None, None)
        )

    def test_unknown_page(self) -> None:
        self.assertRaises(NoLoadMetrics, parse_load, "# TYPE x gauge\nx 1\n", 0.0)


class HitRateTests(SynchronousTestCase):
    """
    L{HitRate}: a rate of the two counters over the last readings.
    """

    def test_rate_of_counters(self) -> None:
        """
        The rate is of what was counted between readings, not of the
        totals: 90% hits before, then 10% over the window.
        """
        rate = HitRate(polls=3)
        self.assertIsNone(rate.add(10_000.0, 9_000.0))
        self.assertIsNone(rate.add(10_000.0, 9_000.0))
        for i in range(1, 4):
            last = rate.add(10_000.0 + 100 * i, 9_000.0 + 10 * i)
        self.assertEqual(last, 0.1)

    def test_idle_window(self) -> None:
        """
        No query in the last readings: no rate, rather than an old one.
        """
        rate = HitRate(polls=2)
        rate.add(0.0, 0.0)
        self.assertEqual(rate.add(100.0, 50.0), 0.5)
        self.assertEqual(rate.add(100.0, 50.0), 0.5)
        self.assertIsNone(rate.add(100.0, 50.0))

    def test_reset(self) -> None:
        """
        An engine restarted behind the endpoint: its counters start again
        from 0.  The step is counted from 0 (Prometheus' reset rule):
        neither negative nor the size of the old totals.
        """
        rate = HitRate(polls=10)
        rate.add(1_000_000.0, 900_000.0)
        self.assertEqual(rate.add(1_000_100.0, 900_090.0), 0.9)
        # Restarted: 40 tokens looked up since, 10 found.
        after = rate.add(40.0, 10.0)
        self.assertEqual(after, (90.0 + 10.0) / (100.0 + 40.0))
        self.assertEqual(rate.add(140.0, 10.0), (90.0 + 10.0) / (100.0 + 140.0))

    def test_reset_of_one_counter_bounded(self) -> None:
        """
        Hits that seem to grow past queries (one counter reset, not the
        other) give at most 1.
        """
        rate = HitRate(polls=10)
        rate.add(1_000.0, 900.0)
        self.assertEqual(rate.add(10.0, 950.0), 1.0)

    def test_counters_gone(self) -> None:
        """
        A page without the counters, or with one not a number, drops the
        window.
        """
        rate = HitRate(polls=10)
        rate.add(0.0, 0.0)
        self.assertEqual(rate.add(10.0, 5.0), 0.5)
        self.assertIsNone(rate.add(None, None))
        self.assertIsNone(rate.add(20.0, 5.0))
        self.assertIsNone(rate.add(float("nan"), 5.0))
        self.assertIsNone(rate.add(30.0, 5.0))
        self.assertEqual(rate.add(40.0, 10.0), 0.5)


class _Engines:
    """
    A fake L{Scraper}: answers with C{page} (404 when L{None}) at once, or
    never when C{hang}.
    """

    def __init__(self) -> None:
        self.page: bytes | None = VLLM.encode()
        self.hang = False
        self.requests: list[tuple[str, str, str | None]] = []
        self.pending: list[Deferred[Any]] = []
        self.forgotten: list[str] = []

    def get(self, key: str, url: str, bearer: str | None) -> Deferred[Any]:
        self.requests.append((key, url, bearer))
        d: Deferred[Any] = Deferred()
        if self.hang:
            self.pending.append(d)
        elif self.page is None:
            d.callback((404, b"not found"))
        else:
            d.callback((200, self.page))
        return d

    def forget(self, key: str) -> None:
        self.forgotten.append(key)

    def close_all(self) -> None:
        pass


class BoardTests(SynchronousTestCase):
    """
    L{LoadBoard} polls each endpoint once per interval.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = _Engines()
        self.board = LoadBoard(self.clock, self.engine, interval=1.0)  # type: ignore[arg-type]
        self.board.set_endpoints([Endpoint("r1", "http://10.0.0.1:8000", ("m",))])

    def tick(self, seconds: float = 1.0) -> None:
        self.clock.advance(seconds)

    def test_reading(self) -> None:
        """
        A poll gives a reading with its time; L{LoadBoard.has_metrics} is
        L{None} before it and true after.
        """
        self.assertIsNone(self.board.has_metrics("r1"))
        self.board.startService()
        self.assertEqual(self.board.reading("r1"), EngineLoad(3.0, 5.0, 0.25, 0.0))
        self.assertTrue(self.board.has_metrics("r1"))
        self.assertFalse(self.board.stale("r1", 0.0))
        self.board.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_prefix_cache_hit_rate(self) -> None:
        """
        Each reading carries the hit rate over the last
        L{HIT_RATE_POLLS} polls, and the collector serves it; the
        simulator's counters read as vLLM's.
        """

        class Load:
            running = 0
            waiting = 0
            kv_usage = 0.0

        class Cache:
            queries = 100
            hits = 0

        cache = Cache()
        self.engine.page = SimMetrics("m", Load(), cache).render()
        self.board.startService()
        first = self.board.reading("r1")
        assert first is not None
        self.assertEqual(
            (first.prefix_cache_queries, first.prefix_cache_hits), (100, 0)
        )
        self.assertIsNone(first.prefix_cache_hit_rate)
        cache.queries, cache.hits = 300, 150
        self.engine.page = SimMetrics("m", Load(), cache).render()
        self.tick()
        second = self.board.reading("r1")
        assert second is not None
        self.assertEqual(second.prefix_cache_hit_rate, 0.75)
        registry = CollectorRegistry()
        registry.register(LoadCollector(self.board))
        page = generate_latest(registry).decode()
        self.assertIn(
            'llmgw_engine_prefix_cache_hit_ratio{model="m",replica="r1"} 0.75', page
        )
        for _ in range(HIT_RATE_POLLS):
            self.tick()
        idle = self.board.reading("r1")
        assert idle is not None
        self.assertIsNone(idle.prefix_cache_hit_rate)
        page = generate_latest(registry).decode()
        self.assertNotIn("llmgw_engine_prefix_cache_hit_ratio{", page)
        self.board.stopService()

    def test_stale(self) -> None:
        """
        A reading older than three intervals is stale, and the collector
        says so.
        """
        self.board.startService()
        self.engine.page = b'vllm:num_requests_running{a="b"} oops\n'
        self.tick(3.0)
        self.assertFalse(self.board.stale("r1", 3.0))
        self.tick(1.0)
        self.assertTrue(self.board.stale("r1", 4.0))
        registry = CollectorRegistry()
        registry.register(LoadCollector(self.board))
        page = generate_latest(registry).decode()
        self.assertIn('llmgw_engine_load_stale{model="m",replica="r1"} 1.0', page)
        self.assertIn('llmgw_engine_load_age_seconds{model="m",replica="r1"} 4.0', page)
        self.board.stopService()

    def test_no_metrics(self) -> None:
        """
        An engine that answers 404 is marked once and asked again only every
        L{NO_METRICS_RETRY} polls.
        """
        self.engine.page = None
        self.board.startService()
        self.assertIs(self.board.has_metrics("r1"), False)
        for _ in range(NO_METRICS_RETRY - 1):
            self.tick()
        self.assertEqual(len(self.engine.requests), 1)
        self.tick()
        self.assertEqual(len(self.engine.requests), 2)
        self.board.stopService()

    def test_one_in_flight_and_timeout(self) -> None:
        """
        A poll that does not answer is the only one for its endpoint until
        the timeout cancels it.
        """
        hanging = self.engine
        hanging.hang = True
        board = LoadBoard(self.clock, hanging, interval=1.0, timeout=2.5)  # type: ignore[arg-type]
        board.set_endpoints([Endpoint("r1", "http://10.0.0.1:8000", ("m",))])
        board.startService()
        self.clock.advance(1.0)
        self.clock.advance(1.0)
        self.assertEqual(len(hanging.pending), 1)
        self.clock.advance(0.5)
        self.assertTrue(hanging.pending[0].called)
        self.clock.advance(0.5)
        self.assertEqual(len(hanging.pending), 2)
        board.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_endpoints_follow(self) -> None:
        """
        An endpoint that leaves has its poll cancelled and its reading
        gone; a new one is polled at the next round.
        """
        hanging = self.engine
        hanging.hang = True
        board = LoadBoard(self.clock, hanging, interval=1.0)  # type: ignore[arg-type]
        board.set_endpoints([Endpoint("r1", "http://10.0.0.1:8000", ("m",))])
        board.startService()
        board.set_endpoints([Endpoint("r2", "http://10.0.0.2:8000", ("m",))])
        self.assertTrue(hanging.pending[0].called)
        self.clock.advance(1.0)
        self.assertEqual(len(hanging.pending), 2)
        self.assertIsNone(board.has_metrics("r1"))
        self.assertEqual(hanging.forgotten, ["r1"])
        board.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_bearer(self) -> None:
        """
        An endpoint with a secret gets it as a bearer token.
        """
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class Secret(Endpoint):
            api_key: str = ""

        self.board.set_endpoints([Secret("r1", "http://h:1", ("m",), api_key="s3")])
        self.board.startService()
        self.assertEqual(self.engine.requests, [("r1", "http://h:1", "s3")])
        self.board.stopService()

    def test_off(self) -> None:
        """
        An interval of 0 polls nothing.
        """
        board = LoadBoard(self.clock, self.engine, interval=0)  # type: ignore[arg-type]
        board.set_endpoints([Endpoint("r1", "http://10.0.0.1:8000", ("m",))])
        board.startService()
        self.assertEqual(self.engine.requests, [])
        self.assertEqual(self.clock.getDelayedCalls(), [])
