"""
The server's C{/metrics} as Prometheus reads it: scrapes of a running
C{twistd -n llmgw-server} (one C{twistd llmgw-agent} on simulated GPUs with
C{llmgw sim} engines) checked by Debian's C{promtool check metrics}, and
Debian's C{prometheus} scraping the metrics-only listener with a copy of
C{contrib/prometheus/prometheus.yml}, read back through its HTTP API.
"""

from __future__ import annotations

import os
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.support import free_port, http
from tests.test_e2e_control import MODELS, _Fleet
from tests.test_e2e_fleet_metrics import samples, values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "contrib", "prometheus", "prometheus.yml")

# A second catalog model that nothing asks for: never placed, never started.
IDLE = """
[[models]]
name = "idle"
min_replicas = 0
[[models.profiles]]
name = "one-h200"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
"""

PLACEMENT_REASONS = {
    "no_nodes",
    "gpus",
    "gpu_memory",
    "fabric",
    "ports",
    "multi_node",
    "node_state",
}


class PrometheusTests(_Fleet, SynchronousTestCase):
    """
    A server with one agent (two simulated H200s), one ready replica of
    C{chat} and a catalog model C{idle} with none.
    """

    timeout = 240

    def setUp(self) -> None:
        super().setUp()
        self.metrics_port = free_port()
        config = self.config(MODELS.format(min_replicas=1, idle="60s") + IDLE)
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            "--metrics-listen",
            f"tcp:{self.metrics_port}:interface=127.0.0.1",
            config=config,
        )
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.start_agent("gpu-01")
        (self.replica,) = self.ready(1)

    def scrape(self, base_url: str) -> bytes:
        status, _, body = http("GET", base_url + "/metrics")
        self.assertEqual(status, 200, body[:200])
        return body

    def assert_promtool_passes(self, base_url: str) -> None:
        code, problems = prometheus_support.check_metrics(self.scrape(base_url))
        self.assertEqual((code, problems), (0, ""), base_url)

    def traffic(self) -> None:
        """
        One plain and one streamed request to C{chat}, both counted.
        """
        self.chat()
        stream = self.client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            stream=True,
        )
        for _ in stream:
            pass

        def counted() -> bool:
            found = values(samples(self.admin_url), "llmgw_requests_total")
            return found.get((("model", "chat"), ("status", "200"))) == 2.0

        self.until(counted, 10, "two requests counted")

    def test_no_created_families(self) -> None:
        """
        After traffic (labelled counters and histograms with children), no
        C{_created} family or sample on the admin C{/metrics} nor on the
        metrics-only listener, and C{promtool check metrics} passes on both,
        as it does on the quiet fleet's scrapes before.
        """
        self.assert_promtool_passes(self.admin_url)
        self.assert_promtool_passes(self.metrics_url)
        self.traffic()
        for base_url in (self.admin_url, self.metrics_url):
            text = self.scrape(base_url).decode()
            self.assertNotIn("_created", text, base_url)
            self.assertIn('llmgw_tokens_total{kind="completion",model="chat"}', text)
            self.assert_promtool_passes(base_url)

    def test_quiet_fleet(self) -> None:
        """
        Before any request every counter of each configured model, replica
        and fixed kind has its sample at 0: requests by the statuses llmgw
        answers, tokens (batch lines' too), retries, affinity, overload,
        durations, engine
        starts and failures (C{idle} never started), placement failures by
        reason, upstream errors by kind, the replica's ejections.  The
        requests then count where their 0 was.
        """
        found = samples(self.admin_url)
        requests = values(found, "llmgw_requests_total")
        for model in ("chat", "idle"):
            for status in ("200", "429", "502", "503", "504"):
                key = (("model", model), ("status", status))
                self.assertEqual(requests.get(key), 0.0, (key, requests))
            for kind in ("prompt", "completion"):
                key = (("kind", kind), ("model", model))
                self.assertEqual(values(found, "llmgw_tokens_total").get(key), 0.0)
                batch = values(found, "llmgw_batch_tokens_total")
                self.assertEqual(batch.get(key), 0.0, batch)
            one = (("model", model),)
            self.assertEqual(values(found, "llmgw_retries_total").get(one), 0.0)
            for name in ("llmgw_router_affinity_total", "llmgw_overload_total"):
                outcomes = {
                    dict(k)["outcome"]: v
                    for k, v in values(found, name).items()
                    if dict(k)["model"] == model
                }
                self.assertEqual(set(outcomes.values()), {0.0}, (name, outcomes))
                self.assertEqual(len(outcomes), 2, (name, outcomes))
            self.assertEqual(
                values(found, "llmgw_request_duration_seconds_count").get(one), 0.0
            )
            self.assertEqual(
                values(found, "llmgw_engine_failures_total").get(one), 0.0, model
            )
        starts = values(found, "llmgw_engine_starts_total")
        self.assertEqual(starts.get((("model", "idle"),)), 0.0, starts)
        self.assertGreaterEqual(starts[(("model", "chat"),)], 1.0)
        placement = values(found, "llmgw_placement_failures_total")
        self.assertEqual({dict(k)["reason"] for k in placement}, PLACEMENT_REASONS)
        errors = values(found, "llmgw_upstream_errors_total")
        self.assertEqual(
            errors,
            {
                (("kind", kind),): 0.0
                for kind in ("connect", "timeout", "status", "broken")
            },
        )
        ejections = values(found, "llmgw_replica_ejections_total")
        self.assertEqual(ejections, {(("replica", self.replica["id"]),): 0.0})

        self.traffic()
        requests = values(samples(self.admin_url), "llmgw_requests_total")
        self.assertEqual(requests[(("model", "chat"), ("status", "200"))], 2.0)
        self.assertEqual(requests[(("model", "idle"), ("status", "200"))], 0.0)

    def test_prometheus_reads_requests(self) -> None:
        """
        Debian's Prometheus, with a copy of the scrape example pointed at
        the metrics-only listener (and a 1 s interval), scrapes it: the
        target is up, C{llmgw_requests_total} of the configured model reads
        0 through C{/api/v1/query} before the first request and 3 after
        three, with the example's labels (C{job="llmgw"},
        C{deployment="prod"}).
        """
        with open(EXAMPLE) as f:
            example = f.read()
        target = '"llmgw-server.example:9091"'
        self.assertIn(target, example)
        self.assertIn("scrape_interval: 15s", example)
        config = example.replace(target, f'"127.0.0.1:{self.metrics_port}"').replace(
            "scrape_interval: 15s", "scrape_interval: 1s"
        )
        prometheus = prometheus_support.start_prometheus(self, config)
        query = 'llmgw_requests_total{model="chat",status="200"}'

        def read(expected: str) -> list[dict[str, Any]]:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                result = prometheus.query(query)
                if result and result[0]["value"][1] == expected:
                    return result
                time.sleep(0.25)
            raise AssertionError(
                f"{query} is not {expected} within 60 s: {prometheus.query(query)}\n"
                f"up: {prometheus.query('up')}\n{prometheus.log()[-3000:]}"
            )

        (quiet,) = read("0")
        up = prometheus.query('up{job="llmgw"}')
        self.assertEqual([u["value"][1] for u in up], ["1"], up)
        self.assertEqual(quiet["metric"]["job"], "llmgw")
        self.assertEqual(quiet["metric"]["deployment"], "prod")
        for _ in range(3):
            self.chat()
        (busy,) = read("3")
        self.assertEqual(
            busy["metric"]["instance"],
            f"127.0.0.1:{self.metrics_port}",
        )
