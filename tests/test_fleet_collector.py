"""
The fleet metrics' collector (L{llmgw.control.metrics}) on a control plane
on a L{Clock}: counts and the fixed placement-failure reasons.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.control.metrics import FleetCollector
from llmgw.control.placement import Profile
from llmgw.control.records import NO_FIT_KIND_NAMES, no_fit_kinds
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase, make_model


class _Hub:
    reconnects = 3


def scrape(
    collector: FleetCollector,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class FleetCollectorTests(PlaneCase):
    def test_figures(self) -> None:
        """
        Two replicas of C{m} on two one-GPU nodes: ready, allocated 10 GiB
        each, two starts; the hub's reconnects; a model with no fit counts
        a placement failure under a fixed reason, and every other reason
        and each model's starts and failures at 0 before their first event.
        """
        huge = make_model("huge", low=1)
        huge = huge.__class__(
            **{
                **huge.__dict__,
                "profiles": (
                    Profile(
                        name="big", engine="sim", source="s", gpus=4, gpu_memory_gb=10
                    ),
                ),
            }
        )
        self.make(make_model(low=2), huge)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        found = scrape(FleetCollector(self.plane, _Hub()))  # type: ignore[arg-type]
        self.assertEqual(found[("llmgw_nodes", (("state", "ready"),))], 2)
        self.assertEqual(found[("llmgw_model_replicas_ready", (("model", "m"),))], 2)
        self.assertEqual(found[("llmgw_model_replicas_desired", (("model", "m"),))], 2)
        self.assertEqual(
            found[("llmgw_replicas", (("model", "m"), ("state", "ready")))], 2
        )
        self.assertEqual(found[("llmgw_engine_starts_total", (("model", "m"),))], 2)
        allocated = {
            labels: value
            for (name, labels), value in found.items()
            if name == "llmgw_gpu_memory_allocated_bytes"
        }
        self.assertEqual(sorted(allocated.values()), [10 * 1024**3] * 2)
        self.assertEqual(
            found[("llmgw_gpu_memory_total_bytes", (("gpu", "0"), ("node", "n1")))],
            80 * 1024**3,
        )
        self.assertEqual(found[("llmgw_agent_reconnects_total", ())], 3)
        self.assertGreaterEqual(
            found[("llmgw_placement_failures_total", (("reason", "gpus"),))], 1
        )
        self.assertGreaterEqual(found[("llmgw_reconcile_pass_seconds_count", ())], 0)
        # Only gpus counted; every other fixed reason exported at 0.
        reasons = {
            dict(labels)["reason"]: value
            for (name, labels), value in found.items()
            if name == "llmgw_placement_failures_total"
        }
        self.assertEqual(set(reasons), set(NO_FIT_KIND_NAMES))
        self.assertEqual({r for r, v in reasons.items() if v}, {"gpus"})
        self.assertEqual(found[("llmgw_engine_starts_total", (("model", "huge"),))], 0)
        self.assertEqual(found[("llmgw_engine_failures_total", (("model", "m"),))], 0)

    def test_failures_and_backoff(self) -> None:
        """
        A failed replica counts under engine failures and its model backs
        off.
        """
        self.make()
        self.plane.reconcile()
        (start,) = self.agents.starts()
        self.status(start[1].shard_id, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        found = scrape(FleetCollector(self.plane, _Hub()))  # type: ignore[arg-type]
        self.assertEqual(found[("llmgw_engine_failures_total", (("model", "m"),))], 1)
        self.assertGreater(found[("llmgw_model_backoff_seconds", (("model", "m"),))], 0)
        self.assertEqual(found[("llmgw_model_failures_in_a_row", (("model", "m"),))], 1)

    def test_swaps_and_swap_seconds(self) -> None:
        """
        Swaps count by model and reason, each catalog model and reason at 0
        until counted; wake, sleep and cold-start seconds are histograms
        per model, each observation in its buckets; the replica-state gauge
        has sleeping and waking.
        """
        self.make(make_model("a"), make_model("b"))
        counts = self.plane.counts
        counts.swapped("a", "evicted")
        counts.swapped("a", "evicted")
        counts.swapped("b", "idle_sleep")
        counts.observed("wake", "b", 1.5)
        counts.observed("wake", "b", 7.0)
        counts.observed("sleep", "b", 0.2)
        counts.observed("cold_start", "a", 25.0)
        found = scrape(FleetCollector(self.plane, _Hub()))  # type: ignore[arg-type]
        swaps = {
            labels: value
            for (name, labels), value in found.items()
            if name == "llmgw_swaps_total"
        }
        self.assertEqual(len(swaps), 6)
        self.assertEqual(swaps[("model", "a"), ("reason", "evicted")], 2)
        self.assertEqual(swaps[("model", "b"), ("reason", "idle_sleep")], 1)
        self.assertEqual(swaps[("model", "b"), ("reason", "slept")], 0)
        wake = "llmgw_engine_wake_seconds"
        self.assertEqual(found[(wake + "_count", (("model", "b"),))], 2)
        self.assertEqual(found[(wake + "_sum", (("model", "b"),))], 8.5)
        self.assertEqual(found[(wake + "_bucket", (("le", "1.0"), ("model", "b")))], 0)
        self.assertEqual(found[(wake + "_bucket", (("le", "2.0"), ("model", "b")))], 1)
        self.assertEqual(found[(wake + "_bucket", (("le", "10.0"), ("model", "b")))], 2)
        self.assertEqual(found[(wake + "_count", (("model", "a"),))], 0)
        self.assertEqual(
            found[
                ("llmgw_engine_sleep_seconds_bucket", (("le", "0.5"), ("model", "b")))
            ],
            1,
        )
        self.assertEqual(
            found[("llmgw_engine_cold_start_seconds_sum", (("model", "a"),))], 25.0
        )
        for state in ("sleeping", "waking"):
            self.assertEqual(
                found[("llmgw_replicas", (("model", "a"), ("state", state)))], 0
            )


class NoFitKindsTests(PlaneCase):
    def test_kinds(self) -> None:
        """
        Placement's lines map to a fixed set of words.
        """
        lines = [
            "profile a: no nodes",
            "profile a: n1: needs 2 GPUs, 1 usable: 1 allocated",
            "profile a: n2: not on fabric ib",
            "profile a: n3: no free port in 20000-20009",
            "profile a: n4: draining",
            "profile a: n5: no GPU has 100 GB",
            "profile a: only 1 of 2 nodes fit",
        ]
        self.assertEqual(
            no_fit_kinds(lines),
            {
                "no_nodes",
                "gpus",
                "fabric",
                "ports",
                "node_state",
                "gpu_memory",
                "multi_node",
            },
        )
