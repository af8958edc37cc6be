"""
What GPUs cost (docs/cost.md), end to end: a real C{twistd -n
llmgw-server} with C{[cost]} prices, a real agent with two simulated
H200s over mutual TLS, a sim replica placed on one, requests through the
router with keys, and the real C{llmgw ctl}: C{usage --by key} shows each
key's GPU-seconds and cost at its GPU's price and the idle row, the
admin API's usage answer each GPU's seconds split between the requests'
and the idle, a key's budget in cost refuses once spent, and a batch's
lines' cost is shown on the batch.
"""

from __future__ import annotations

import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.batch_support import MODEL, chat_lines, ended, submit, wait_for
from tests.support import CtlMixin
from tests.test_e2e_control import MODELS, _Fleet

# gpu-01's price beats every node's H200 price: 7.2 an hour, 0.002 a second.
COST = """
[store]
flush_interval = "100ms"
[cost]
gpu_hour = [
    { gpu = "H200", price = 3.6 },
    { gpu = "*", node = "gpu-01", price = 7.2 },
]
"""


class CostEndToEndTests(_Fleet, CtlMixin, SynchronousTestCase):
    timeout = 120

    def chat(self, key: str = "unused") -> str:
        client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        answer = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        return answer.choices[0].message.content or ""

    def priced_fleet(self) -> None:
        """
        A server with L{COST}'s prices and gpu-01's agent, one replica of
        C{chat} ready on it.
        """
        config = self.config(MODELS.format(min_replicas=1, idle="0s"))
        self.start_fleet_server(config + COST)
        self.start_agent("gpu-01")
        self.ready(1)

    def usage(self) -> dict[str, Any]:
        result: dict[str, Any] = self.ctl_json("usage", "--by", "key", "--since", "1h")
        return result

    def test_ctl_usage_shows_cost_and_idle(self) -> None:
        """
        Requests of a key on a replica of gpu-01: their usage carries
        GPU-seconds priced at gpu-01's 7.2 an hour; ctl usage shows them
        and an (idle) row; each of gpu-01's two GPUs has its seconds split
        between the requests' (the one serving) and the idle, and both
        were counted the same time.  A key with a budget in cost is
        refused once its requests cost that much.
        """
        self.priced_fleet()
        key = self.ctl_json("keys", "create", "--name", "app")["key"]
        capped = self.ctl_json(
            "keys", "create", "--name", "capped", "--budget-cost", "0.0000001"
        )["key"]
        for _ in range(3):
            self.assertTrue(self.chat(key))
        self.assertTrue(self.chat(capped))

        def counted() -> dict[str, Any] | None:
            usage = self.usage()
            app = [g for g in usage["usage"] if g["key"] == "app"]
            idle = usage["idle"][0]["gpu_seconds"] if usage["idle"] else 0
            ready = app and app[0]["requests"] == 3 and idle > 0
            return usage if ready and len(usage["gpus"]) == 2 else None

        # The meter writes every 10 s.
        usage = self.until(counted, 30, "usage with GPU time")
        (app,) = [g for g in usage["usage"] if g["key"] == "app"]
        self.assertGreater(app["gpu_seconds"], 0)
        self.assertAlmostEqual(app["cost"] / app["gpu_seconds"], 0.002, places=9)
        gpus = usage["gpus"]
        self.assertEqual(
            [(g["node"], g["gpu_name"]) for g in gpus], [("gpu-01", "H200")] * 2
        )
        for gpu in gpus:
            self.assertAlmostEqual(sum(gpu["states"].values()), gpu["seconds"], 6)
            self.assertAlmostEqual(gpu["requests"] + gpu["idle"], gpu["seconds"], 6)
            self.assertAlmostEqual(gpu["cost"], gpu["seconds"] * 0.002, 6)
        self.assertAlmostEqual(gpus[0]["seconds"], gpus[1]["seconds"], delta=0.5)
        self.assertEqual(sorted(g["requests"] > 0 for g in gpus), [False, True])

        table = self.ctl("usage", "--by", "key", "--since", "1h").stdout
        header, *rows = table.splitlines()
        self.assertIn("GPU S", header)
        self.assertIn("COST", header)
        self.assertIn(
            f"{app['cost']:.6f}", next(r for r in rows if r.startswith("app"))
        )
        self.assertTrue(any(r.startswith("(idle)") for r in rows), table)

        # Its first request went in under the budget; it cost more.
        deadline = time.monotonic() + 10
        while True:
            try:
                self.chat(capped)
            except openai.RateLimitError as e:
                self.assertIn("cost budget", str(e))
                break
            self.assertLess(time.monotonic(), deadline, "never refused")
            time.sleep(0.2)
        (listed,) = [k for k in self.ctl_json("keys")["keys"] if k["name"] == "capped"]
        self.assertGreater(listed["cost_used"], listed["budget_cost"])

    def test_batch_cost(self) -> None:
        """
        A batch run on gpu-01 through the official C{openai} SDK: C{ctl
        batches show} gives its lines' GPU-seconds and cost at gpu-01's
        7.2 an hour, and the same sums as C{ctl usage --by key} gives for
        its key, whose only requests are the batch's lines; the SDK's
        C{Batch.usage} has their tokens.
        """
        self.priced_fleet()
        key = self.ctl_json("keys", "create", "--name", "nightly")["key"]
        client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        made = submit(client, chat_lines(6).replace(MODEL.encode(), b"chat"))
        batch = wait_for(client, made.id, ended("completed"), 60, "completed")
        shown = self.ctl_json("batches", "show", batch.id)["usage"]
        self.assertEqual(shown["requests"], 6)
        self.assertGreater(shown["gpu_seconds"], 0)
        self.assertAlmostEqual(shown["cost"] / shown["gpu_seconds"], 0.002, places=9)
        (nightly,) = [g for g in self.usage()["usage"] if g["key"] == "nightly"]
        self.assertEqual(nightly["requests"], 6)
        self.assertAlmostEqual(nightly["gpu_seconds"], shown["gpu_seconds"], 9)
        self.assertAlmostEqual(nightly["cost"], shown["cost"], 9)
        assert batch.usage is not None
        self.assertEqual(
            (batch.usage.input_tokens, batch.usage.output_tokens),
            (shown["prompt_tokens"], shown["completion_tokens"]),
        )
        self.assertEqual(
            (nightly["prompt_tokens"], nightly["completion_tokens"]),
            (shown["prompt_tokens"], shown["completion_tokens"]),
        )
