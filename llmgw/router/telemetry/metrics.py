"""
The router's traffic metrics (Prometheus conventions: C{_total} counters,
C{_seconds} histograms), and the registry every llmgw C{/metrics} serves.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from llmgw.router.telemetry.reports import ReportedMetrics

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip


# The one C{model} label value for every name that is not configured: a
# client must not be able to grow the series by inventing model names.
OTHER_MODEL = "other"

# The statuses under which each configured model's request counter exists
# from the first scrape, at 0 until counted: success, and what llmgw itself
# answers when it refuses or fails a request (429 limits and overload, 502
# broken engine answers, 503 no replica, 504 deadlines), so that a rate or
# an error ratio reads 0 on a quiet fleet instead of no data.
PRESET_STATUSES = ("200", "429", "502", "503", "504")
UPSTREAM_ERROR_KINDS = ("connect", "timeout", "status", "broken")
AFFINITY_OUTCOMES = ("owner", "spilled")
OVERLOAD_OUTCOMES = ("waited", "refused")
TOKEN_KINDS = ("prompt", "completion")


class MetricsRegistry(CollectorRegistry):
    """
    A registry whose scrapes carry no C{_created} samples, that runs its
    owners' hooks before each scrape, and that adds what the routers of a
    tier reported (L{merge_with}) to each family.

    prometheus_client gives every counter, histogram and summary a
    C{<name>_created} sample (the child's creation time), which the text
    format of 0.0.4 shows as a family of its own beside the counter.  Its
    only switch, C{disable_created_metrics()}, is global to the process;
    this registry drops the samples from its own scrapes and leaves any
    other registry of the process as it is.
    """

    def __init__(self) -> None:
        super().__init__()
        self._before: list[Callable[[], None]] = []
        self._merges: list[Callable[[Metric], Metric]] = []

    def before_scrape(self, hook: Callable[[], None]) -> None:
        """
        Call C{hook} at the start of each scrape (to make the labelled
        children of what became known since the last).
        """
        self._before.append(hook)

    def merge_with(self, merge: Callable[[Metric], Metric]) -> None:
        """
        Pass each family of a scrape through C{merge} (which returns it,
        or a copy with more or other samples).
        """
        self._merges.append(merge)

    def collect(self) -> Iterator[Metric]:
        for hook in self._before:
            hook()
        for metric in super().collect():
            for merge in self._merges:
                metric = merge(metric)
            created = metric.name + "_created"
            if any(sample.name == created for sample in metric.samples):
                metric = copy.copy(metric)
                metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class RouterMetrics:
    """
    Counters and histograms for client traffic, registered in C{registry}.

    @ivar reported: what the routers of a tier reported of the same
        metrics (L{llmgw.router.telemetry.reports}), added to this
        process's own on C{registry}'s scrapes when it is a
        L{MetricsRegistry}.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        @param clock: seconds, for how long a router's reported gauges
            count (L{ReportedMetrics}).
        """
        self.requests = Counter(
            "llmgw_requests",
            "Client requests finished, by model and HTTP status; names no"
            ' replica or catalog model has count under model="other".',
            ["model", "status"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "llmgw_request_duration_seconds",
            "Time from receiving a request to its last byte, seconds.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "llmgw_time_to_first_token_seconds",
            "Time from receiving a streamed request to the first byte of the"
            " replica's answer, seconds.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "llmgw_tokens",
            "Tokens reported by replicas in usage, by kind (prompt, completion).",
            ["model", "kind"],
            registry=registry,
        )
        self.batch_tokens = _batch_tokens(registry)
        self.in_flight = Gauge(
            "llmgw_requests_in_flight",
            "Requests being served now.",
            registry=registry,
        )
        self.upstream_errors = Counter(
            "llmgw_upstream_errors",
            "Failed exchanges with replicas, by kind (connect, timeout, status,"
            " broken).",
            ["kind"],
            registry=registry,
        )
        self.adapter_loads = _adapter_loads(registry)
        self.retries = Counter(
            "llmgw_retries",
            "Requests sent again to another replica before the first byte.",
            ["model"],
            registry=registry,
        )
        # Routing: the choices made, for reading a policy's effect.
        self.affinity, self.ejections, self.overload = _routing(registry)

        self.reported = ReportedMetrics(
            {
                family.name: family.type
                for collector in self.collectors()
                for family in collector.describe()
            },
            clock,
        )
        self._finished: dict[tuple[str, int], Any] = {}
        # Per configured model: duration, time to first token, tokens.
        self._per_model: dict[str, tuple[Any, Any, Any, Any]] = {}
        # Per configured model: its batch lines' prompt and completion tokens.
        self._batch_children: dict[str, tuple[Any, Any]] = {}
        self._preset(registry)

    def _preset(self, registry: CollectorRegistry) -> None:
        """
        The fixed upstream error kinds at 0 now, and on llmgw's own
        registry the models' and replicas' children at each scrape
        (L{refresh}).
        """
        self._known_models: set[str] = set()
        self._known_replicas: set[str] = set()
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        self._models: Callable[[], Iterable[str]] = tuple
        self._replicas: Callable[[], Iterable[str]] = tuple
        if isinstance(registry, MetricsRegistry):
            registry.before_scrape(self.refresh)
            registry.merge_with(self.reported.merge)

    def collectors(self) -> tuple[MetricWrapperBase, ...]:
        """
        @return: every metric of this router's traffic (what a router of a
            tier reports to its server).
        """
        return (
            self.requests,
            self.request_duration,
            self.time_to_first_token,
            self.tokens,
            self.batch_tokens,
            self.in_flight,
            self.upstream_errors,
            self.adapter_loads,
            self.retries,
            self.affinity,
            self.ejections,
            self.overload,
        )

    def follow(
        self, models: Callable[[], Iterable[str]], replicas: Callable[[], Iterable[str]]
    ) -> None:
        """
        Read the configured models and the replicas from these at each
        scrape (L{refresh}).

        @param models: the model names clients may send now.
        @param replicas: the ids of the replicas routed to now.
        """
        self._models = models
        self._replicas = replicas

    def refresh(self) -> None:
        """
        Make the labelled children of each model and replica that became
        known since the last call, at 0, so that a quiet fleet's counters
        have a sample before their first event (a panel over them reads 0,
        not no data); drop the ejection counters of replicas gone, so that
        their series stay bounded by the fleet.
        """
        for model in set(self._models()) - self._known_models:
            self._known_models.add(model)
            for status in PRESET_STATUSES:
                self.requests.labels(model, status)
            self.retries.labels(model)
            for outcome in AFFINITY_OUTCOMES:
                self.affinity.labels(model, outcome)
            for outcome in OVERLOAD_OUTCOMES:
                self.overload.labels(model, outcome)
            self._children(model)
            self._batch(model)
        replicas = set(self._replicas())
        for replica in replicas - self._known_replicas:
            self.ejections.labels(replica)
        for replica in self._known_replicas - replicas:
            try:
                self.ejections.remove(replica)
            except KeyError:
                pass
        self._known_replicas = replicas
        self.reported.drop("llmgw_replica_ejections", "replica", replicas)

    def _children(self, model: str) -> tuple[Any, Any, Any, Any]:
        children = self._per_model.get(model)
        if children is None:
            children = self._per_model[model] = (
                self.request_duration.labels(model),
                self.time_to_first_token.labels(model),
                self.tokens.labels(model, TOKEN_KINDS[0]),
                self.tokens.labels(model, TOKEN_KINDS[1]),
            )
        return children

    def _batch(self, model: str) -> tuple[Any, Any]:
        children = self._batch_children.get(model)
        if children is None:
            children = self._batch_children[model] = (
                self.batch_tokens.labels(model, TOKEN_KINDS[0]),
                self.batch_tokens.labels(model, TOKEN_KINDS[1]),
            )
        return children

    def finished(
        self,
        model: str | None,
        status: int,
        latency: float,
        time_to_first_token: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        batch: bool = False,
    ) -> None:
        """
        Count one finished request.  The labelled children are kept once
        made: C{labels()} checks and joins its values on every call, a few
        microseconds each, four or five times per request.

        @param model: a configured name, or L{None} for any other (then
            only the request is counted, under L{OTHER_MODEL}).
        @param latency: seconds from arrival to the last byte.
        @param time_to_first_token: seconds to the replica's first byte of a
            stream, or L{None} (not observed).
        @param batch: the request was a batch's line (its record's
            C{batch_id} is set): its tokens count in C{llmgw_batch_tokens}
            as well.
        """
        key = (OTHER_MODEL if model is None else model, status)
        requests = self._finished.get(key)
        if requests is None:
            requests = self._finished[key] = self.requests.labels(key[0], str(status))
        requests.inc()
        if model is None:
            return
        duration, first_token, prompt, completion = self._children(model)
        duration.observe(latency)
        if time_to_first_token is not None:
            first_token.observe(time_to_first_token)
        if prompt_tokens:
            prompt.inc(prompt_tokens)
        if completion_tokens:
            completion.inc(completion_tokens)
        if batch:
            batch_prompt, batch_completion = self._batch(model)
            if prompt_tokens:
                batch_prompt.inc(prompt_tokens)
            if completion_tokens:
                batch_completion.inc(completion_tokens)


def _routing(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    """
    @return: the routing choices' counters: affinity (by model and
        outcome), ejections (by replica), overload (by model and outcome).
    """
    affinity = Counter(
        "llmgw_router_affinity",
        "Requests with an affinity key (session or long prompt prefix), by"
        " model and outcome: owner (the replica its key hashes to, within"
        " the load bound) or spilled (the least loaded instead).",
        ["model", "outcome"],
        registry=registry,
    )
    ejections = Counter(
        "llmgw_replica_ejections",
        "Replicas ejected for failed answers (5xx, deadlines) in a row.",
        ["replica"],
        registry=registry,
    )
    overload = Counter(
        "llmgw_overload",
        "Requests held back because every replica of their model queued"
        " past overload_queue_depth, by outcome: waited (then went on) or"
        " refused (429).",
        ["model", "outcome"],
        registry=registry,
    )
    return affinity, ejections, overload


def _batch_tokens(registry: CollectorRegistry) -> Counter:
    """
    @return: the counter of batch lines' tokens, by model and kind.
    """
    return Counter(
        "llmgw_batch_tokens",
        "Tokens reported by replicas in usage for batch lines (the requests"
        " a batch's runner sent; counted in llmgw_tokens too), by kind"
        " (prompt, completion).",
        ["model", "kind"],
        registry=registry,
    )


def _adapter_loads(registry: CollectorRegistry) -> Counter:
    return Counter(
        "llmgw_adapter_loads",
        "LoRA adapters loaded on a replica, unloaded (least recently used"
        " past max_loras) or refused by it, by adapter.",
        ["model", "outcome"],
        registry=registry,
    )
