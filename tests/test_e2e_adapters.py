"""
LoRA adapters end to end: C{twistd llmgw-server} and C{twistd llmgw-agent}
processes over mutual TLS, a base model on C{llmgw sim} engines (which
serve vLLM's runtime LoRA routes, L{llmgw.sim.lora}), adapters declared in
the config file and added with C{llmgw ctl models add --base}, requests
through the official C{openai} client.  Which replica served a request
comes from the server's usage log line (C{model=... replica=...}); what each
engine loaded from its own C{/sim/stats} and C{/v1/models}.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import anthropic
import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, http
from tests.test_e2e_control import _Fleet

BASE = """
[[models]]
name = "chat"
min_replicas = {replicas}
max_replicas = {replicas}
idle_timeout = "0s"
max_loras = 2
[[models.profiles]]
name = "sim"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
args = ["--itl", "0.02", "--lora-load-seconds", "0.3"]

[[models]]
name = "ad-a"
base = "chat"
adapter = "/adapters/a"
rank = 8

[[models]]
name = "ad-b"
base = "chat"
adapter = "/adapters/b"
"""


class AdapterTests(_Fleet, CtlMixin, SynchronousTestCase):
    keys: dict[str, str] = {}

    def engines(self) -> dict[str, str]:
        """
        @return: each ready replica's engine URL, by replica id.
        """
        out = {}
        for r in self.replicas():
            if r["state"] == "ready":
                shard = r["shards"][0]
                address = "127.0.0.1" if shard["node"] == "gpu-01" else "127.0.0.2"
                out[r["id"]] = f"http://{address}:{shard['port']}"
                with open(f"/proc/{shard['pid']}/cmdline", "rb") as f:
                    argv = f.read().decode().split("\0")
                # The engine's own key, which its /v1 routes need.
                self.keys[out[r["id"]]] = argv[argv.index("--api-key") + 1]
        return out

    def ask(self, model: str, tokens: int = 3) -> str:
        """
        One chat completion for C{model}.

        @return: the replica the server's usage line names for it.
        """
        rid = str(uuid.uuid4())
        answer = self.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=tokens,
            extra_headers={"X-Request-ID": rid},
        )
        self.assertEqual(answer.model, model)
        line = self.server.wait_for(
            rf"request \S+ client_id={rid} .*model=(\S+) replica=(\S+) .*status=(\d+)"
            r" prompt_tokens=(\d+) completion_tokens=(\d+)"
        )
        self.assertEqual(line.group(1), model)
        self.assertEqual(line.group(3), "200")
        self.assertEqual(
            int(line.group(5)), answer.usage.completion_tokens if answer.usage else -1
        )
        return line.group(2)

    def stats(self, url: str) -> dict[str, Any]:
        status, _, body = http("GET", url + "/sim/stats")
        self.assertEqual(status, 200)
        result: dict[str, Any] = json.loads(body)
        return result

    def listed(self, url: str) -> dict[str, str | None]:
        """
        @return: the engine's C{/v1/models}: each id with its C{parent}.
        """
        key = {"Authorization": f"Bearer {self.keys[url]}"}
        status, _, body = http("GET", url + "/v1/models", headers=key)
        self.assertEqual(status, 200, body)
        return {m["id"]: m.get("parent") for m in json.loads(body)["data"]}

    def test_two_adapters_two_replicas(self) -> None:
        """
        Two adapters of one base on two replicas: the first request of
        each loads it on the least loaded replica (the other one is busy
        with a stream), and every later request for it lands there; four
        requests at once for a third adapter added with C{ctl models add
        --base} load it at most once per replica; usage lines carry each
        adapter's name.
        """
        self.start_fleet_server(
            self.config(BASE.format(replicas=2), startup_grace="3s")
        )
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        self.ready(2)
        engines = self.engines()
        # A stream for ad-a keeps its replica busy while ad-b comes.
        first: list[str] = []
        runner = threading.Thread(target=lambda: first.append(self.ask("ad-a", 60)))
        runner.start()
        self.until(
            lambda: (
                "ad-a" in self.server.output()
                and any(self.stats(u)["running"] for u in engines.values())
            ),
            15,
            "the ad-a stream running",
        )
        where_b = self.ask("ad-b")
        runner.join(30)
        where_a = first[0]
        self.assertNotEqual(where_a, where_b)
        for _ in range(4):
            self.assertEqual(self.ask("ad-a"), where_a)
            self.assertEqual(self.ask("ad-b"), where_b)
        self.assertEqual(
            self.stats(engines[where_a])["lora_load_requests"], {"ad-a": 1}
        )
        self.assertEqual(
            self.stats(engines[where_b])["lora_load_requests"], {"ad-b": 1}
        )
        self.assertEqual(self.listed(engines[where_a])["ad-a"], "chat")

        def usage() -> dict[str, int]:
            rows = self.admin("/api/v1/usage?by=model")["usage"]
            return {r["model"]: r["requests"] for r in rows}

        self.until(
            lambda: usage() == {"ad-a": 5, "ad-b": 5}, 10, "usage under each adapter"
        )

        added = self.ctl_json(
            "models", "add", "ad-c", "--base", "chat", "--adapter", "/adapters/c"
        )
        self.assertEqual((added["name"], added["base"]), ("ad-c", "chat"))
        places: list[str] = []
        threads = [
            threading.Thread(target=lambda: places.append(self.ask("ad-c")))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.assertEqual(len(places), 4)
        for url in engines.values():
            asked = self.stats(url)["lora_load_requests"]
            self.assertLessEqual(asked.get("ad-c", 0), 1, asked)
        loaded_c = {r for r, u in engines.items() if "ad-c" in self.listed(u)}
        self.assertEqual(set(places) - loaded_c, set())

        self.ctl("models", "remove", "ad-c")
        self.assertNotIn(
            "ad-c", [m["name"] for m in self.ctl_json("models", "list")["models"]]
        )

        # A key limited to one adapter: that adapter only.
        made = self.ctl("keys", "create", "--name", "only-a", "--models", "ad-a")
        key = made.stdout.splitlines()[0].strip()
        limited = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        hello: Any = [{"role": "user", "content": "hello"}]
        limited.chat.completions.create(model="ad-a", messages=hello, max_tokens=2)
        for other in ("ad-b", "chat"):
            with self.assertRaises(openai.PermissionDeniedError):
                limited.chat.completions.create(
                    model=other, messages=hello, max_tokens=2
                )

    def test_third_adapter_unloads_least_recently_used(self) -> None:
        """
        One replica, C{max_loras = 2}: ad-a, ad-b, ad-a again, then ad-c
        (added at run time): ad-b, the least recently used, is unloaded
        before ad-c loads; ad-a stays.
        """
        config = self.config(BASE.format(replicas=1))
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.ready(1)
        (url,) = self.engines().values()
        self.ctl("models", "add", "ad-c", "--base", "chat", "--adapter", "/adapters/c")
        for model in ("ad-a", "ad-b", "ad-a"):
            self.ask(model)
        self.assertEqual(
            {k: v for k, v in self.listed(url).items() if v},
            {"ad-a": "chat", "ad-b": "chat"},
        )
        self.ask("ad-c")
        self.assertEqual(
            {k: v for k, v in self.listed(url).items() if v},
            {"ad-a": "chat", "ad-c": "chat"},
        )
        self.assertEqual(
            self.stats(url)["lora_loads"], {"ad-a": 1, "ad-b": 1, "ad-c": 1}
        )
        self.server.wait_for(r"unloaded adapter ad-b from replica")

        # Anthropic's Messages API reaches the adapter too (translated for
        # the sim), loaded already: no second load.
        message = anthropic.Anthropic(
            base_url=self.api_url, api_key="unused", max_retries=0
        ).messages.create(
            model="ad-c", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        self.assertEqual((message.model, message.usage.output_tokens), ("ad-c", 3))
        self.assertEqual(self.stats(url)["lora_load_requests"]["ad-c"], 1)

        # A base added at run time with an adapter is not removed while
        # the adapter is declared; the refusal names it.
        self.ctl(
            "models",
            "add",
            "chat2",
            "--engine",
            "sim",
            "--source",
            "sim",
            "--max-loras",
            "1",
        )
        self.ctl("models", "add", "ad-x", "--base", "chat2", "--adapter", "/x")
        refused = self.ctl("models", "remove", "chat2", ok=False)
        self.assertEqual(refused.returncode, 1, refused.stderr)
        self.assertIn("base of adapters ad-x", refused.stderr)
        self.ctl("models", "remove", "ad-x")
        self.ctl("models", "remove", "chat2")
        # An adapter whose base loads none is refused, naming why.
        bad = self.ctl(
            "models", "add", "ad-y", "--base", "ad-a", "--adapter", "/y", ok=False
        )
        self.assertIn("'ad-a' is an adapter itself", bad.stderr)

        # Kept across a restart, as other runtime models: ad-c is back.
        self.server.stop()
        self.start_fleet_server(config)
        back = {
            m["name"]: m.get("base") for m in self.ctl_json("models", "list")["models"]
        }
        self.assertEqual(
            back, {"chat": None, "ad-a": "chat", "ad-b": "chat", "ad-c": "chat"}
        )

    def test_engines_word_on_adapters(self) -> None:
        """
        One replica, C{max_loras = 2}: streams for ad-a and ad-b in
        flight, a request for ad-c waits and is served once one of them
        ends; the engine never lists 3.  ad-c removed from the catalog is
        unloaded from the engine.  The server restarted: its router reads
        what the engine holds, and ad-b's request sends no load.
        """
        config = self.config(BASE.format(replicas=1))
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.ready(1)
        (url,) = self.engines().values()
        self.ctl("models", "add", "ad-c", "--base", "chat", "--adapter", "/adapters/c")
        done: dict[str, float] = {}

        def ask(model: str, tokens: int) -> None:
            self.ask(model, tokens)
            done[model] = time.monotonic()

        streams = [
            threading.Thread(target=ask, args=(model, 60)) for model in ("ad-a", "ad-b")
        ]
        for t in streams:
            t.start()
        self.until(lambda: self.stats(url)["running"] == 2, 15, "both streams")
        third = threading.Thread(target=ask, args=("ad-c", 2))
        third.start()
        for t in (*streams, third):
            t.join(30)
        self.assertEqual(set(done), {"ad-a", "ad-b", "ad-c"})
        self.assertGreater(done["ad-c"], min(done["ad-a"], done["ad-b"]))
        self.assertEqual(self.stats(url)["lora_most_loaded"], 2)
        self.server.wait_for(r"ad-c waits for one to end")

        self.ctl("models", "remove", "ad-c")
        self.until(lambda: "ad-c" not in self.listed(url), 10, "ad-c unloaded")

        held = {k for k, v in self.listed(url).items() if v}
        self.server.stop()
        self.start_fleet_server(config)
        self.ready(1)
        self.server.wait_for(r"replica \S+ holds adapters " + ", ".join(sorted(held)))
        before = self.stats(url)["lora_load_requests"]
        for model in sorted(held):
            self.ask(model)
        self.assertEqual(self.stats(url)["lora_load_requests"], before)
