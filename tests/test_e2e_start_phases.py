"""
Where a replica's start spends its time, on a running C{twistd llmgw-server
--local} whose agent starts an C{llmgw sim} engine that loads for 2 s (and
prints vLLM's "Loading weights took" line): the phases in the admin API,
C{llmgw ctl replicas --phases}, the replica page and the per-phase
histogram of C{/metrics}.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, Processes, http
from tests.test_e2e_tracing import Receiver, attributes

LOAD_SECONDS = 2.0

MODELS = """
[control]
interval = "100ms"
port_range = [{low}, {high}]
[[models]]
name = "slow"
min_replicas = 1
[[models.profiles]]
name = "cpu"
engine = "sim"
source = "sim"
gpus = 0
args = ["--load-seconds", "{load}"]
"""


class StartPhasesTests(Processes, CtlMixin, SynchronousTestCase):
    timeout = 120

    def ready_replica(self) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, _, body = http("GET", self.admin_url + "/api/v1/replicas")
            self.assertEqual(status, 200)
            replicas = json.loads(body)["replicas"]
            if replicas and replicas[0]["state"] == "ready":
                replica: dict[str, Any] = replicas[0]
                return replica
            time.sleep(0.1)
        raise AssertionError(f"no ready replica: {replicas}")

    def test_phases_add_up(self) -> None:
        """
        A start's phases (placed, launched, port_open, model_listed, ready:
        the server's and the agent's own clocks) add up to its start time
        as the server measured it (placement to ready) within 5%; vLLM's
        weight loading, read from the engine's log, is a detail of about
        the 2 s the engine loaded.  ctl, the replica page and /metrics show
        them.
        """
        low = random.randrange(21000, 32000)
        self.server, self.api_url, self.admin_url = self.start_server(
            "--local",
            config=MODELS.format(low=low, high=low + 20, load=LOAD_SECONDS),
        )
        replica = self.ready_replica()
        phases = replica["phases"]
        names = [p["phase"] for p in phases if not p["detail"]]
        self.assertEqual(
            names, ["placed", "launched", "port_open", "model_listed", "ready"]
        )
        total = replica["start_seconds"]
        self.assertGreater(total, LOAD_SECONDS)
        added = sum(p["seconds"] for p in phases if not p["detail"])
        self.assertLessEqual(abs(added - total), 0.05 * total, (added, total, phases))
        # The engine loads before its port opens (as vLLM does).
        port_open = next(p for p in phases if p["phase"] == "port_open")
        self.assertGreaterEqual(port_open["seconds"], LOAD_SECONDS)
        details = {p["phase"]: p["seconds"] for p in phases if p["detail"]}
        self.assertEqual(details, {"vllm_load_weights": LOAD_SECONDS})

        shown = self.ctl("replicas", "--phases").stdout
        for name in ("placed", "launched", "port_open", "model_listed", "ready"):
            self.assertIn(name, shown)
        self.assertIn("(vllm_load_weights)", shown)
        self.assertIn(f"{total:.2f}", shown)

        status, _, page = http(
            "GET", self.admin_url + "/replicas/" + replica["id"], timeout=30
        )
        self.assertEqual(status, 200)
        self.assertIn(b'id="start-phases"', page)
        self.assertIn(b"model_listed", page)

        status, _, metrics = http("GET", self.admin_url + "/metrics")
        self.assertEqual(status, 200)
        text = metrics.decode()
        self.assertIn(
            'llmgw_engine_start_phase_seconds_count{model="slow",phase="port_open"}'
            " 1.0",
            text,
        )
        self.assertIn(
            'llmgw_engine_start_phase_seconds_count{model="slow",phase="placed"} 1.0',
            text,
        )

    def test_control_plane_spans(self) -> None:
        """
        With C{[tracing]}, the start is exported as C{llmgw.start} (placement
        to ready) with C{llmgw.placement} and a span per phase under it, laid
        end to end, vLLM's detail as an attribute; a forced drain as
        C{llmgw.drain} with its reason.
        """
        receiver = Receiver()
        self.addCleanup(receiver.stop)
        low = random.randrange(21000, 32000)
        config = MODELS.format(low=low, high=low + 20, load=LOAD_SECONDS)
        self.server, self.api_url, self.admin_url = self.start_server(
            "--local",
            config=f'[tracing]\notlp_endpoint = "{receiver.url}"\n' + config,
        )
        replica = self.ready_replica()
        start = receiver.wait_for("llmgw.start")
        placement = receiver.wait_for("llmgw.placement")
        got = attributes(start)
        self.assertEqual(got["llmgw.replica"], replica["id"])
        self.assertEqual(got["llmgw.model"], "slow")
        self.assertEqual(got["llmgw.vllm_load_weights_seconds"], LOAD_SECONDS)
        self.assertEqual(placement.parent_span_id, start.span_id)
        children = sorted(
            (s for s in receiver.spans if s.parent_span_id == start.span_id),
            key=lambda s: s.start_time_unix_nano,
        )
        self.assertEqual(
            [attributes(s)["llmgw.phase"] for s in children],
            ["placed", "launched", "port_open", "model_listed", "ready"],
        )
        for before, after in zip(children, children[1:], strict=False):
            self.assertEqual(before.end_time_unix_nano, after.start_time_unix_nano)
        seconds = (start.end_time_unix_nano - start.start_time_unix_nano) / 1e9
        self.assertLess(abs(seconds - replica["start_seconds"]), 0.5)

        status, _, body = http(
            "POST",
            self.admin_url + f"/api/v1/replicas/{replica['id']}/drain",
            b'{"force": true}',
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 200, body)
        drain = receiver.wait_for("llmgw.drain")
        self.assertEqual(attributes(drain)["llmgw.replica"], replica["id"])
        self.assertTrue(attributes(drain)["llmgw.drain.reason"])
