"""
Swaps seen where operators look (issue 25 item 5), through real processes:
C{twistd llmgw-server} and C{twistd llmgw-agent} over mutual TLS, one
simulated 80 GB GPU, C{llmgw sim} engines, the OpenAI client; the fleet
metrics scraped from the admin listener's C{/metrics} and checked by
C{promtool check metrics}.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.support import http
from tests.test_e2e_fleet_metrics import samples, values
from tests.test_e2e_swap import _Swaps, model


class SwapMetricsTests(_Swaps, SynchronousTestCase):
    """
    Models C{a} and C{b} of 60 GB each, one 80 GB GPU.
    """

    def test_eviction_counted(self) -> None:
        """
        A request for C{b} while C{a} holds the GPU idle evicts C{a}: the
        scrape counts one swap of C{a} for C{evicted} (and none for any
        other reason or model), both cold starts in their histogram, and
        passes promtool.
        """
        self.setup_fleet(model("a") + model("b"))
        status, _, body = http("GET", self.admin_url + "/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(prometheus_support.check_metrics(body), (0, ""))
        self.assertTrue(self.chat("a"))
        self.assertTrue(self.chat("b"))
        found = samples(self.admin_url)
        swaps = values(found, "llmgw_swaps_total")
        self.assertEqual(swaps[(("model", "a"), ("reason", "evicted"))], 1)
        self.assertEqual(sum(swaps.values()), 1, swaps)
        cold = values(found, "llmgw_engine_cold_start_seconds_count")
        self.assertEqual(cold, {(("model", "a"),): 1, (("model", "b"),): 1})
        total = values(found, "llmgw_engine_cold_start_seconds_sum")
        self.assertGreater(total[(("model", "b"),)], 0)
        states = values(found, "llmgw_replicas")
        self.assertEqual(states[(("model", "b"), ("state", "ready"))], 1)
        self.assertEqual(states[(("model", "a"), ("state", "sleeping"))], 0)
        status, _, body = http("GET", self.admin_url + "/metrics")
        self.assertEqual(prometheus_support.check_metrics(body), (0, ""))
