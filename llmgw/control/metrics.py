"""
Fleet metrics (docs/metrics.md): the control plane's state, read at
scrape time by a custom collector, so that each series stands for
something the plane holds now and label values are bounded by the fleet
itself: node ids, GPU indexes, catalog model names, replica states, and
fixed words (node states, placement failure kinds).  Never a secret, a
key, a user field or a request id.

Registered on the server's one registry (L{llmgw.server.tap}), served on
the same C{/metrics} as the traffic figures (L{llmgw.router.telemetry.metrics}).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

from llmgw.control.agents import AgentHub
from llmgw.control.inventory import NodeState
from llmgw.control.phases import phases_histogram
from llmgw.control.plane import ControlPlane
from llmgw.control.records import NO_FIT_KIND_NAMES, SWAP_REASONS, ReplicaState
from llmgw.control.scaling import bounded
from llmgw.control.views import gpu_allocations
from llmgw.wire.states import ShardState

MIB = 1024**2

SWAP_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""
Bucket bounds, seconds, of the wake, sleep and cold-start histograms: a
wake from host memory takes seconds, a cold start of a large model
minutes (the issue's swap bench: 2 s and 20 s).
"""


def seconds_histogram(
    name: str, documentation: str, observed: dict[str, list[float]], models: list[str]
) -> HistogramMetricFamily:
    """
    @param observed: per model, each observation in seconds.
    @param models: the catalog's models, each shown (empty until observed).
    @return: a histogram labelled C{model} with L{SWAP_BUCKETS} and C{+Inf}.
    """
    family = HistogramMetricFamily(name, documentation, labels=["model"])
    for model in sorted({*models, *observed}):
        values = observed.get(model, [])
        buckets = [
            (floatToGoString(bound), sum(1 for v in values if v <= bound))
            for bound in SWAP_BUCKETS
        ]
        buckets.append(("+Inf", len(values)))
        family.add_metric([model], buckets, sum(values))
    return family


class UsageBuffer(Protocol):
    """
    The usage writer as the metrics read it
    (L{llmgw.store.usage.UsageWriter}).
    """

    @property
    def pending(self) -> int: ...

    writes: int
    write_seconds: float
    written: int
    dropped: int


class FleetCollector:
    """
    The fleet's figures, from C{plane}, its agents' C{hub} and the
    C{usage} writer, computed at each scrape.

    @param plane: the control plane (its catalog, replicas, inventory,
        loop and counts).
    @param hub: the agent links (reconnects).
    @param usage: the usage writer, or L{None}.
    """

    def __init__(
        self, plane: ControlPlane, hub: AgentHub, usage: UsageBuffer | None = None
    ) -> None:
        self.plane = plane
        self.hub = hub
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        yield from self._nodes()
        yield from self._models()
        yield from self._plane()
        if self.usage is not None:
            yield from self._usage(self.usage)

    def _nodes(self) -> Iterator[Metric]:
        plane = self.plane
        nodes = plane.inventory.nodes()
        by_state = GaugeMetricFamily(
            "llmgw_nodes", "Nodes known, by state.", labels=["state"]
        )
        counts = {state: 0 for state in NodeState}
        for node in nodes:
            counts[node.state] = counts.get(node.state, 0) + 1
        for state, count in counts.items():
            by_state.add_metric([str(state)], count)
        yield by_state
        yield GaugeMetricFamily(
            "llmgw_nodes_draining",
            "Nodes being drained (nothing new placed on them).",
            value=sum(1 for n in nodes if n.draining),
        )
        labels = ["node", "gpu"]
        total = GaugeMetricFamily(
            "llmgw_gpu_memory_total_bytes",
            "GPU memory, bytes, as the node's agent reports it.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "llmgw_gpu_memory_used_bytes",
            "GPU memory in use, bytes, as the node's agent reports it.",
            labels=labels,
        )
        allocated = GaugeMetricFamily(
            "llmgw_gpu_memory_allocated_bytes",
            "GPU memory, bytes, that the replicas placed on the GPU asked"
            " for (their profile's gpu_memory_gb, GiB).",
            labels=labels,
        )
        shards = GaugeMetricFamily(
            "llmgw_gpu_shards",
            "Engine shards placed on the GPU and not gone.",
            labels=labels,
        )
        placed = gpu_allocations(plane)
        for node in nodes:
            for gpu in node.gpus:
                values = [node.id, str(gpu.index)]
                total.add_metric(values, gpu.memory_total_mib * MIB)
                used.add_metric(values, gpu.memory_used_mib * MIB)
                memory, count = placed.get((node.id, gpu.index), (0.0, 0))
                allocated.add_metric(values, memory)
                shards.add_metric(values, count)
        yield from (total, used, allocated, shards)

    def _models(self) -> Iterator[Metric]:
        plane = self.plane
        now = plane.clock.seconds()
        model = ["model"]
        replicas = GaugeMetricFamily(
            "llmgw_replicas",
            "Replicas of each catalog model, by state.",
            labels=["model", "state"],
        )
        desired = GaugeMetricFamily(
            "llmgw_model_replicas_desired",
            "Replicas each model should have now.",
            labels=model,
        )
        ready = GaugeMetricFamily(
            "llmgw_model_replicas_ready", "Ready replicas of each model.", labels=model
        )
        queue = GaugeMetricFamily(
            "llmgw_activation_queue_length",
            "Requests waiting for a replica of the model to become ready.",
            labels=model,
        )
        backoff = GaugeMetricFamily(
            "llmgw_model_backoff_seconds",
            "Seconds before the model's next placement after failed"
            " replicas (0 when not backing off).",
            labels=model,
        )
        failing = GaugeMetricFamily(
            "llmgw_model_failures_in_a_row",
            "Replicas of the model that failed in a row.",
            labels=model,
        )
        by_model: dict[str, dict[ReplicaState, int]] = {}
        for replica in plane.replicas.values():
            states = by_model.setdefault(replica.model, {})
            states[replica.state] = states.get(replica.state, 0) + 1
        for state in plane.catalog.states():
            name = state.model.name
            states = by_model.get(name, {})
            for replica_state in ReplicaState:
                replicas.add_metric(
                    [name, str(replica_state)], states.get(replica_state, 0)
                )
            desired.add_metric([name], bounded(state.model, state.wanted))
            ready.add_metric([name], states.get(ReplicaState.READY, 0))
            queue.add_metric([name], len(state.waiters))
            backoff.add_metric([name], max(0.0, state.retry_at - now))
            failing.add_metric([name], state.failures)
        yield from (replicas, desired, ready, queue, backoff, failing)
        catalog = plane.catalog
        yield SummaryMetricFamily(
            "llmgw_activation_wait_seconds",
            "Seconds requests waited for a replica to be activated (served"
            " or given up).",
            count_value=catalog.activation_waits,
            sum_value=catalog.activation_wait_seconds,
        )
        refused = CounterMetricFamily(
            "llmgw_activations_refused",
            "Requests held for a model to start that were refused because"
            " the fleet held more than [router] activation_queue of them"
            " (the lowest priority's newest, whichever router held it).",
            labels=model,
        )
        # Every catalog model at 0 until counted (a quiet fleet's panel
        # reads 0, not no data); a model gone keeps its count.
        counted = dict.fromkeys((s.model.name for s in catalog.states()), 0)
        counted.update(catalog.refused)
        for name, count in sorted(counted.items()):
            refused.add_metric([name], count)
        yield refused

    def _plane(self) -> Iterator[Metric]:
        plane = self.plane
        counts = plane.counts
        placement = CounterMetricFamily(
            "llmgw_placement_failures",
            "Placements that found no fit, by kind of cause (no_nodes, gpus,"
            " gpu_memory, fabric, ports, multi_node, node_state).",
            labels=["reason"],
        )
        # Every fixed reason and every catalog model from the first scrape,
        # at 0 until counted: a panel over a quiet fleet reads 0, not no
        # data.  Models gone from the catalog keep the counts they have.
        reasons = dict.fromkeys(NO_FIT_KIND_NAMES, 0)
        reasons.update(counts.placement_failures)
        for reason, count in sorted(reasons.items()):
            placement.add_metric([reason], count)
        starts = CounterMetricFamily(
            "llmgw_engine_starts", "Replicas started, by model.", labels=["model"]
        )
        failures = CounterMetricFamily(
            "llmgw_engine_failures",
            "Replicas that failed (not drained), by model.",
            labels=["model"],
        )
        models = dict.fromkeys((s.model.name for s in plane.catalog.states()), 0)
        for name, count in sorted({**models, **counts.engine_starts}.items()):
            starts.add_metric([name], count)
        for name, count in sorted({**models, **counts.engine_failures}.items()):
            failures.add_metric([name], count)
        yield from (placement, starts, failures)
        yield from self._swaps(sorted(models))
        yield CounterMetricFamily(
            "llmgw_agent_reconnects",
            "Registers from nodes known before (agents that came back).",
            value=self.hub.reconnects,
        )
        loop = plane.loop
        yield SummaryMetricFamily(
            "llmgw_reconcile_pass_seconds",
            "Reconciler passes and their duration, seconds (wall clock).",
            count_value=loop.passes,
            sum_value=loop.pass_seconds,
        )
        yield GaugeMetricFamily(
            "llmgw_reconcile_last_pass_seconds",
            "The last reconciler pass's duration, seconds.",
            value=loop.last_pass_seconds,
        )
        shards = GaugeMetricFamily(
            "llmgw_shards", "Engine shards, by state.", labels=["state"]
        )
        shard_counts = {state: 0 for state in ShardState}
        for replica in plane.replicas.values():
            for shard in replica.shards:
                shard_counts[shard.state] = shard_counts.get(shard.state, 0) + 1
        for shard_state, count in shard_counts.items():
            shards.add_metric([str(shard_state)], count)
        yield shards

    def _swaps(self, models: list[str]) -> Iterator[Metric]:
        counts = self.plane.counts
        swaps = CounterMetricFamily(
            "llmgw_swaps",
            "Replicas swapped out to free room or after idle_timeout, by"
            " model and reason (evicted: stopped to make room; slept: put"
            " to sleep to make room; idle_sleep: asleep after idle_timeout).",
            labels=["model", "reason"],
        )
        every = {(m, r): 0 for m in models for r in SWAP_REASONS}
        for (model, reason), count in sorted({**every, **counts.swaps}.items()):
            swaps.add_metric([model, reason], count)
        yield swaps
        yield seconds_histogram(
            "llmgw_engine_wake_seconds",
            "Seconds a sleeping replica took to wake (wake command to ready).",
            counts.wake_seconds,
            models,
        )
        yield seconds_histogram(
            "llmgw_engine_sleep_seconds",
            "Seconds a replica took to go to sleep (sleep command to asleep).",
            counts.sleep_seconds,
            models,
        )
        yield seconds_histogram(
            "llmgw_engine_cold_start_seconds",
            "Seconds a replica took from placement to ready (a cold start).",
            counts.cold_start_seconds,
            models,
        )
        yield phases_histogram(counts.start_phase_seconds, models)

    def _usage(self, usage: UsageBuffer) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "llmgw_usage_records_pending",
            "Usage records buffered, not written to the store yet.",
            value=usage.pending,
        )
        yield CounterMetricFamily(
            "llmgw_usage_records_written",
            "Usage records written to the store.",
            value=usage.written,
        )
        yield CounterMetricFamily(
            "llmgw_usage_records_dropped",
            "Usage records dropped because the buffer was full.",
            value=usage.dropped,
        )
        yield SummaryMetricFamily(
            "llmgw_store_write_seconds",
            "Usage batch writes to the store and their latency, seconds"
            " (from the call to the answer, the store thread's queue"
            " included).",
            count_value=usage.writes,
            sum_value=usage.write_seconds,
        )
