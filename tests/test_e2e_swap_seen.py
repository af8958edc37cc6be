"""
Swaps seen where operators look (issue 25 item 5), through real processes:
C{twistd llmgw-server} and C{twistd llmgw-agent} over mutual TLS, one
simulated 80 GB GPU, C{llmgw sim} engines, the OpenAI client; the fleet
metrics scraped from the admin listener's C{/metrics} and checked by
C{promtool check metrics}; pins through the admin API and C{llmgw ctl}.
"""

from __future__ import annotations

import json

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.support import CtlMixin, http
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


class PinTests(_Swaps, SynchronousTestCase, CtlMixin):
    """
    Models C{a} and C{b} of 60 GB each, one 80 GB GPU, held requests
    waiting 3 s.
    """

    def test_pin_through_ctl(self) -> None:
        """
        C{ctl models pin a}: C{a} is marked pinned (in the admin API's JSON,
        with its priority and min_resident, and in C{ctl models}), and a
        request for C{b} is not given C{a}'s GPU (503 after its wait, C{a}
        still ready); C{ctl models unpin a}: the next request for C{b}
        evicts C{a}.  Unknown models: 404 in the admin API's shape, one
        line from ctl.
        """
        self.setup_fleet(model("a") + model("b"), wait="3s")
        self.assertTrue(self.chat("a"))
        (ready,) = self.ready_of("a")
        self.assertIn("model a pinned", self.ctl("models", "pin", "a").stdout)
        (listed,) = [m for m in self.ctl_json("models")["models"] if m["name"] == "a"]
        self.assertEqual(
            (listed["pinned"], listed["priority"], listed["min_resident"]),
            (True, 0, 1.0),
        )
        lines = self.ctl("models").stdout.splitlines()
        header = lines[0].split()
        row = next(line.split() for line in lines[1:] if line.split()[0] == "a")
        self.assertEqual(row[header.index("PINNED")], "pinned")
        with self.assertRaises(openai.InternalServerError) as raised:
            self.chat("b")
        self.assertEqual(raised.exception.status_code, 503)
        self.assertEqual([r["id"] for r in self.ready_of("a")], [ready["id"]])
        self.assertIn("model a unpinned", self.ctl("models", "unpin", "a").stdout)
        self.assertTrue(self.chat("b"))
        self.assertEqual(self.ready_of("a"), [])
        status, _, body = http("POST", self.admin_url + "/api/v1/models/nope/pin", b"")
        self.assertEqual(status, 404)
        self.assertEqual(json.loads(body)["error"]["code"], "not_found")
        failed = self.ctl("models", "pin", "nope", ok=False)
        self.assertNotEqual(failed.returncode, 0)
        self.assertIn("nope", failed.stderr)

    def ready_of(self, name: str) -> list[dict[str, object]]:
        return [r for r in self.replicas(name) if r["state"] == "ready"]
