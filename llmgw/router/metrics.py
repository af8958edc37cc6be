"""
The router's traffic metrics (Prometheus conventions: C{_total} counters,
C{_seconds} histograms).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip


# The one C{model} label value for every name that is not configured: a
# client must not be able to grow the series by inventing model names.
OTHER_MODEL = "other"


class RouterMetrics:
    """
    Counters and histograms for client traffic, registered in C{registry}.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.retries = Counter(
            "llmgw_retries",
            "Requests sent again to another replica before the first byte.",
            ["model"],
            registry=registry,
        )
        # Routing (issue 11): the choices made, for reading a policy's effect.
        self.affinity = Counter(
            "llmgw_router_affinity",
            "Requests with an affinity key (session or long prompt prefix), by"
            " model and outcome: owner (the replica its key hashes to, within"
            " the load bound) or spilled (the least loaded instead).",
            ["model", "outcome"],
            registry=registry,
        )
        self.ejections = Counter(
            "llmgw_replica_ejections",
            "Replicas ejected for failed answers (5xx, deadlines) in a row.",
            ["replica"],
            registry=registry,
        )
        self.overload = Counter(
            "llmgw_overload",
            "Requests held back because every replica of their model queued"
            " past overload_queue_depth, by outcome: waited (then went on) or"
            " refused (429).",
            ["model", "outcome"],
            registry=registry,
        )

        self._finished: dict[tuple[str, int], Any] = {}
        # Per configured model: duration, time to first token, tokens.
        self._per_model: dict[str, tuple[Any, Any, Any, Any]] = {}

    def finished(
        self,
        model: str | None,
        status: int,
        latency: float,
        time_to_first_token: float | None,
        prompt_tokens: int,
        completion_tokens: int,
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
        """
        key = (OTHER_MODEL if model is None else model, status)
        requests = self._finished.get(key)
        if requests is None:
            requests = self._finished[key] = self.requests.labels(key[0], str(status))
        requests.inc()
        if model is None:
            return
        children = self._per_model.get(model)
        if children is None:
            children = self._per_model[model] = (
                self.request_duration.labels(model),
                self.time_to_first_token.labels(model),
                self.tokens.labels(model, "prompt"),
                self.tokens.labels(model, "completion"),
            )
        duration, first_token, prompt, completion = children
        duration.observe(latency)
        if time_to_first_token is not None:
            first_token.observe(time_to_first_token)
        if prompt_tokens:
            prompt.inc(prompt_tokens)
        if completion_tokens:
            completion.inc(completion_tokens)
