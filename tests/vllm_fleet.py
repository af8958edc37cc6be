"""
The fleet of L{tests.test_e2e_vllm}: a real C{twistd llmgw-server} and
C{twistd llmgw-agent} placing the real vLLM (C{scripts/setup-vllm}), the
model's catalog entry, and the helpers its steps read the fleet with (the
admin API, the server's and the engine's C{/metrics}, the usage records).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import tempfile
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
from tests.vllm_support import VLLM_BIN, VLLM_MODEL

MODEL = "gemma-vllm"
ALIAS = "gemma-alias"
NODE = "cpu-01"
SIM_NODE = "sim-01"
ARGS = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "2"]
PROFILE = {
    "name": "cpu-vllm",
    "engine": "vllm",
    "source": VLLM_MODEL,
    "gpus": 0,
    "args": ARGS,
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
args = {args}
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", HF_HUB_OFFLINE = "1"{env} }}
# The balancer's step only: the second agent's simulated GPU is the one
# place this profile fits, and it comes first there.
[[models.profiles]]
name = "sim-twin"
engine = "sim"
source = "sim"
gpus = 1
priority = 1
"""
AGENT_CONFIG = 'address = "127.0.0.1"\n'
SIM_AGENT_CONFIG = (
    AGENT_CONFIG + '[[simulated_gpus]]\nname = "Simulated GPU"\nmemory_gb = 16\n'
)
PROMPT = "The sea is"


class VLLMFleet(SynchronousTestCase, Processes):
    """
    The fleet and its readers, for one test that runs steps in order.

    @ivar replica: the vLLM replica the steps are at (the admin API's
        row), once ready.
    """

    replica: dict[str, Any]

    def fleet(self, env: dict[str, str] | None = None) -> None:
        """
        Start the server and the vLLM node's agent.

        @param env: variables added to the vLLM profile's environment.
        """
        self.dir = tempfile.mkdtemp(prefix="llmgw-vllm-")
        ca = make_certs(self.dir, "127.0.0.1", [NODE, SIM_NODE])
        self.agent_port = free_port()
        low = random.randrange(21000, 40000)
        config = CONFIG.format(
            ca=ca,
            low=low,
            high=low + 20,
            model=MODEL,
            alias=ALIAS,
            source=VLLM_MODEL,
            args=json.dumps(ARGS),
            env="".join(f", {k} = {json.dumps(v)}" for k, v in (env or {}).items()),
        )
        self.addCleanup(self._kill_engines)
        self.placed_at = time.monotonic()
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config=config,
            state="server-state",
        )
        self.ca = ca
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

    def _records(self, node: str = NODE) -> list[dict[str, Any]]:
        folder = os.path.join(self.dir, f"state-{node}", "shards")
        found = []
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".json"):
                    with open(os.path.join(folder, name)) as f:
                        found.append(json.load(f))
        return found

    def _kill_engines(self) -> None:
        for record in self._records() + self._records(SIM_NODE):
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

    def engine_log(self, replica: dict[str, Any]) -> str:
        path = os.path.join(
            self.dir, f"state-{NODE}", "shards", replica["shards"][0]["id"] + ".log"
        )
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def usage(self) -> tuple[int, int, int]:
        rows = self.admin("/api/v1/usage?by=model")["usage"]
        for row in rows:
            if row["model"] == MODEL:
                return (row["requests"], row["prompt_tokens"], row["completion_tokens"])
        return (0, 0, 0)

    def polled(self, replica_id: str) -> bool:
        """
        @return: whether the server's poller has a reading of the replica.
        """
        labels = f'{{model="{MODEL}",replica="{replica_id}"}}'
        return "llmgw_engine_requests_waiting" in self.engine_load(labels)

    def short(self, request_id: str) -> str:
        """
        A short chat request through llmgw (no affinity key: it balances
        freely), tagged with C{request_id}.
        """
        self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Request-ID": request_id},
        )
        return request_id

    def served_by(self, request_ids: list[str]) -> list[str]:
        """
        @return: the replica of each request's usage record, in order.
        """
        # The usage API writes the buffered records first.
        self.usage()
        database = os.path.join(self._directory(), "server-state", "llmgw.db")
        db = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
        try:
            rows = dict(
                db.execute(
                    # The ids the test sent are the clients'; each row is
                    # keyed by llmgw's own.
                    "SELECT client_request_id, replica FROM usage"
                    " WHERE client_request_id IN"
                    f" ({', '.join('?' * len(request_ids))})",
                    request_ids,
                ).fetchall()
            )
        finally:
            db.close()
        return [rows.get(r, "") for r in request_ids]

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
