"""
The simulator's Prometheus metrics, under vLLM's names.

Names, types and the C{engine} and C{model_name} labels follow vLLM's V1
engine as documented in U{https://docs.vllm.ai/en/stable/usage/metrics/} and
C{docs/design/metrics.md} in U{https://github.com/vllm-project/vllm}:
C{vllm:num_requests_running}, C{vllm:num_requests_waiting} and
C{vllm:kv_cache_usage_perc} (gauges; the last a fraction 0..1, which
replaced V0's C{vllm:gpu_cache_usage_perc}), C{vllm:prefix_cache_queries}
and C{vllm:prefix_cache_hits} (V1 counters, in tokens, which replaced V0's
C{vllm:gpu_prefix_cache_hit_rate}), C{vllm:prompt_tokens_total},
C{vllm:generation_tokens_total} and C{vllm:request_success_total} (counters;
the last labelled C{finished_reason}), and the histograms
C{vllm:time_to_first_token_seconds}, C{vllm:inter_token_latency_seconds}
and C{vllm:e2e_request_latency_seconds} (kept by L{FastHistogram}, as the
simulator observes every token), and the gauge C{vllm:engine_sleep_state}
(labelled C{sleep_state}: C{awake}, C{weights_offloaded}, C{discard_all}, 1
for the state the engine is in; vLLM serves it always).  The bucket bounds
are close to vLLM's, not copied.

Each simulator has its own C{prometheus_client.CollectorRegistry}, so several
can run in one process (tests) without clashing in the global one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from llmgw.sim.sleep import SLEEP_STATES

# vLLM labels each engine family with its engine index (C{engine}, "0"
# unless data parallel) and its first served name (C{model_name}), as a
# real vLLM 0.32 serves them (tests/data/vllm-0.32.0-metrics.txt).
LABELS = ("engine", "model_name")
ENGINE = "0"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)

METRICS_CONTENT_TYPE: bytes = CONTENT_TYPE_LATEST.encode("ascii")


class _Load(Protocol):
    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...


class _Sleep(Protocol):
    @property
    def state(self) -> str: ...


class _Cache(Protocol):
    @property
    def queries(self) -> int: ...

    @property
    def hits(self) -> int: ...


class FastHistogram(Collector):
    """
    A one-series Prometheus histogram, cheaper per observation than
    C{prometheus_client.Histogram} (no lock, one bisection): the simulator
    observes every token and runs on one reactor thread.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        model_name: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        """
        @param name: the metric name, without C{_bucket}/C{_sum}/C{_count}.
        @param buckets: upper bounds in increasing order, without +Inf.
        """
        self._name = name
        self._documentation = documentation
        self._model_name = model_name
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """
        Count one observation of C{value} (seconds).
        """
        # Prometheus buckets are "less than or equal": the first bound
        # >= value.
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    @property
    def count(self) -> int:
        """
        Observations so far.
        """
        return sum(self._counts)

    def collect(self) -> Iterable[Metric]:
        """
        The histogram as one metric family (called at scrape time).
        """
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=list(LABELS)
        )
        cumulative = 0
        buckets = []
        for bound, n in zip((*self._bounds, float("inf")), self._counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([ENGINE, self._model_name], buckets, self._sum)
        yield family

    def describe(self) -> Iterable[Metric]:
        """
        The family without samples, for the registry's name check.
        """
        return [
            HistogramMetricFamily(self._name, self._documentation, labels=list(LABELS))
        ]


class _CacheCounters(Collector):
    """
    C{vllm:prefix_cache_queries} and C{vllm:prefix_cache_hits}, counters in
    tokens (vLLM V1: "Prefix cache queries, in terms of number of queried
    tokens" and "... hits, in terms of number of cached tokens",
    C{vllm/v1/metrics/loggers.py}), read from the cache at scrape time.
    """

    def __init__(
        self, model_name: str, cache: _Cache, registry: CollectorRegistry
    ) -> None:
        self._model_name = model_name
        self._cache = cache
        registry.register(self)

    def _families(self, with_samples: bool) -> list[Metric]:
        out: list[Metric] = []
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self._cache.queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self._cache.hits,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=list(LABELS))
            if with_samples:
                family.add_metric([ENGINE, self._model_name], value)
            out.append(family)
        return out

    def collect(self) -> Iterable[Metric]:
        """
        The two counters (called at scrape time).
        """
        return self._families(True)

    def describe(self) -> Iterable[Metric]:
        """
        The families without samples, for the registry's name check.
        """
        return self._families(False)


def _sleep_gauge(
    model_name: str, sleep: _Sleep | None, registry: CollectorRegistry
) -> None:
    """
    C{vllm:engine_sleep_state}: one series per C{sleep_state}, 1 for the
    one the engine is in.
    """
    sleeping = Gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
        "means engine is awake; weights_offloaded = 1 means sleep level 1; "
        "discard_all = 1 means sleep level 2.",
        [*LABELS, "sleep_state"],
        registry=registry,
    )
    for state in SLEEP_STATES:
        sleeping.labels(ENGINE, model_name, state).set_function(_is_state(sleep, state))


def _is_state(sleep: _Sleep | None, state: str) -> Callable[[], float]:
    def value() -> float:
        return float((sleep.state if sleep is not None else "awake") == state)

    return value


class SimMetrics:
    """
    The metrics of one simulator, labelled with one C{model_name}.
    """

    def __init__(
        self, model_name: str, load: _Load, cache: _Cache, sleep: _Sleep | None = None
    ) -> None:
        """
        @param model_name: the C{model_name} label (vLLM uses its first
            served model name).
        @param load: read at scrape time for the running, waiting and KV
            usage gauges.
        @param cache: read at scrape time for the prefix cache counters.
        @param sleep: read at scrape time for C{vllm:engine_sleep_state}
            (1 for its C{state}, 0 for the others), which vLLM always
            serves; L{None}: always awake.
        """
        self.registry = CollectorRegistry(auto_describe=True)
        labels = list(LABELS)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution."
        ).labels(ENGINE, model_name).set_function(lambda: load.running)
        gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(ENGINE, model_name).set_function(lambda: load.waiting)
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (simulated: tokens held "
            "over --kv-capacity, else running sequences over maximum concurrency).",
        ).labels(ENGINE, model_name).set_function(lambda: load.kv_usage)
        _CacheCounters(model_name, cache, r)
        _sleep_gauge(model_name, sleep, r)

        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            registry=r,
        ).labels(ENGINE, model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=r,
        ).labels(ENGINE, model_name)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        # vLLM lists every finished reason from the start, "stop" first;
        # the simulator's answers end in one of these two.
        self.successes = {
            reason: self._success.labels(ENGINE, model_name, reason)
            for reason in ("stop", "length")
        }
        self.time_to_first_token = FastHistogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model_name,
            TTFT_BUCKETS,
            r,
        )
        self.inter_token_latency = FastHistogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            model_name,
            ITL_BUCKETS,
            r,
        )
        self.e2e_request_latency = FastHistogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            model_name,
            E2E_BUCKETS,
            r,
        )

    def render(self) -> bytes:
        """
        The Prometheus text exposition (content type L{METRICS_CONTENT_TYPE}).
        """
        return generate_latest(self.registry)
