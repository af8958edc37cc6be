"""
The control plane through the real wire: C{twistd llmgw-server} and two
C{twistd llmgw-agent} processes over mutual TLS, with simulated GPUs (no GPU
here) and the C{llmgw sim} engine, driven and observed as an operator
would: the OpenAI client and the admin API.

The two nodes run on this one machine; their engines listen on 127.0.0.1
(gpu-01) and 127.0.0.2 (gpu-02), so the same port on both does not clash.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import (
    BIN,
    CaseMixin,
    Process,
    Processes,
    free_port,
    hermetic_env,
    http,
    make_certs,
    spawn_agent,
)

AGENT_CONFIG = """
address = "{address}"
[[simulated_gpus]]
name = "H200"
memory_gb = 141
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""

MODELS = """
[[models]]
name = "chat"
aliases = ["chat-alias"]
min_replicas = {min_replicas}
max_replicas = 2
idle_timeout = "{idle}"
[[models.profiles]]
name = "one-h200"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
args = ["--itl", "0.05"]
"""

HUGE = """
[[models]]
name = "huge"
[[models.profiles]]
name = "eight-h200"
engine = "sim"
source = "sim"
gpus = 8
gpu_memory_gb = 100
"""


class _Fleet(Processes, CaseMixin):
    """
    A CA and certificates for the server, gpu-01 and gpu-02; the server and
    agents started per test; every engine left behind killed at the end.
    """

    timeout = 180

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-control-")
        self.ca = make_certs(self.dir, "127.0.0.1", ["gpu-01", "gpu-02"])
        self.agent_port = free_port()
        # Below the kernel's ephemeral range (32768 and up on Linux), where
        # other processes' outgoing connections would take an engine's port
        # ("port N is not free"; the server warns of such a range too).
        first = random.randrange(21000, 32000)
        self.ports = (first, first + 20)
        self.agents: dict[str, Process] = {}
        self.addCleanup(self._kill_engines)

    def _kill_engines(self) -> None:
        for node in ("gpu-01", "gpu-02"):
            for pid in self._recorded_pids(node):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _recorded_pids(self, node: str) -> list[int]:
        folder = os.path.join(self.dir, f"state-{node}", "shards")
        pids = []
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if name.endswith(".json"):
                    with open(os.path.join(folder, name)) as f:
                        pids.append(int(json.load(f)["pid"]))
        return pids

    def config(
        self,
        models: str,
        activation_timeout: str = "30s",
        startup_grace: str = "0s",
    ) -> str:
        return (
            f"[agent_tls]\n"
            f'ca = "{self.ca}/ca.pem"\ncert = "{self.ca}/server.pem"\n'
            f'key = "{self.ca}/server-key.pem"\n'
            "[router]\n"
            f'activation_timeout = "{activation_timeout}"\n'
            'activation_keepalive = "100ms"\n'
            "[control]\n"
            'unreachable_after = "3s"\nlost_after = "6s"\n'
            'base_backoff = "1s"\nmax_backoff = "4s"\n'
            f'startup_grace = "{startup_grace}"\n'
            'drain_timeout = "30s"\ninterval = "250ms"\n'
            f"port_range = [{self.ports[0]}, {self.ports[1]}]\n" + models
        )

    def start_fleet_server(self, config: str) -> None:
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            config=config,
            state="server-state",
        )
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )

    def start_agent(self, node_id: str, config: str = AGENT_CONFIG) -> Process:
        """
        @param config: the agent's TOML; C{{address}} is replaced by the
            node's loopback address.
        """
        address = "127.0.0.1" if node_id == "gpu-01" else "127.0.0.2"
        process = spawn_agent(
            self.dir,
            config.replace("{address}", address),
            self.agent_port,
            node_id,
            os.path.join(self.ca, "agents", node_id),
        )
        self.addCleanup(process.stop)
        self.agents[node_id] = process
        return process

    def admin(self, path: str, method: str = "GET") -> Any:
        status, _, body = http(
            method, self.admin_url + path, b"" if method == "POST" else None
        )
        self.assertEqual(status, 200, body)
        return json.loads(body)

    def replicas(self, model: str = "chat") -> list[dict[str, Any]]:
        return [
            r for r in self.admin("/api/v1/replicas")["replicas"] if r["model"] == model
        ]

    def until(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.1)
        raise AssertionError(
            f"not within {timeout}s: {what}\nreplicas: {self.replicas()}\n"
            f"server log:\n{self.server.output()[-4000:]}"
        )

    def ready(self, count: int) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            ready = [r for r in self.replicas() if r["state"] == "ready"]
            return ready if len(ready) == count else None

        result: list[dict[str, Any]] = self.until(check, 30, f"{count} ready replicas")
        return result

    def chat(self, model: str = "chat") -> str:
        answer = self.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        return answer.choices[0].message.content or ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ReconcilerEndToEndTests(_Fleet, SynchronousTestCase):
    def test_replicas_engine_failure_node_loss(self) -> None:
        """
        min_replicas = 2: one replica on each node, served through the
        router.  An engine killed is reported failed and replaced after the
        backoff.  An agent killed with its engines takes its node to
        unreachable then lost, its replica is placed on the other node, and
        requests keep succeeding all along.
        """
        # The grace lets both agents register before the first placement
        # (2 s was too short on a loaded machine: both replicas went to the
        # first node to register).
        self.start_fleet_server(
            self.config(MODELS.format(min_replicas=2, idle="0s"), startup_grace="6s")
        )
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        ready = self.ready(2)
        self.assertEqual(
            sorted(r["shards"][0]["node"] for r in ready), ["gpu-01", "gpu-02"]
        )
        self.assertTrue(self.chat())
        self.assertTrue(self.chat("chat-alias"))

        # An engine dies.
        victim = next(r for r in ready if r["shards"][0]["node"] == "gpu-02")
        pid = victim["shards"][0]["pid"]
        os.killpg(pid, signal.SIGKILL)
        models = self.until(
            lambda: [
                m
                for m in self.admin("/api/v1/models")["models"]
                if m["name"] == "chat" and m["failures_in_a_row"] == 1
            ],
            15,
            "the failure counted",
        )
        self.assertIn("killed by signal 9", models[0]["last_error"])
        after = self.ready(2)
        replaced = next(r for r in after if r["id"] not in {x["id"] for x in ready})
        self.assertNotEqual(replaced["shards"][0]["pid"], pid)
        self.assertIn("replica " + victim["id"], self.server.output())

        # A node dies: its agent and its engines.
        dead = next(r for r in after if r["shards"][0]["node"] == "gpu-01")
        self.agents["gpu-01"].popen.kill()
        os.killpg(dead["shards"][0]["pid"], signal.SIGKILL)
        failures: list[str] = []
        served = 0
        states: set[str] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.chat()
                served += 1
            except openai.OpenAIError as e:
                failures.append(repr(e))
            nodes = {n["id"]: n["state"] for n in self.admin("/api/v1/nodes")["nodes"]}
            states.add(nodes["gpu-01"])
            ready_now = [r for r in self.replicas() if r["state"] == "ready"]
            if nodes["gpu-01"] == "lost" and len(ready_now) == 2:
                break
            time.sleep(0.2)
        self.assertEqual(states >= {"unreachable", "lost"}, True, states)
        final = self.ready(2)
        self.assertEqual([r["shards"][0]["node"] for r in final], ["gpu-02", "gpu-02"])
        self.assertEqual(failures, [])
        self.assertGreater(served, 10)

    def test_server_restart_adopts(self) -> None:
        """
        The server restarts: the agents reconnect, their replicas are
        adopted with the same engine pids, nothing is started twice, and the
        router serves again within 10 s.
        """
        config = self.config(
            MODELS.format(min_replicas=2, idle="0s"), startup_grace="6s"
        )
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        before = self.ready(2)
        pids = sorted(r["shards"][0]["pid"] for r in before)
        self.server.stop()
        stopped = time.monotonic()
        self.start_fleet_server(config)
        while True:
            try:
                self.assertTrue(self.chat())
                break
            except openai.OpenAIError:
                if time.monotonic() - stopped > 10:
                    raise
                time.sleep(0.1)
        self.assertLess(time.monotonic() - stopped, 10)
        after = self.ready(2)
        # Past the grace period: still the same two, nothing new placed.
        time.sleep(max(0.0, 6.5 - (time.monotonic() - stopped)))
        after = self.ready(2)
        self.assertEqual(sorted(r["shards"][0]["pid"] for r in after), pids)
        self.assertEqual({r["id"] for r in after}, {r["id"] for r in before})
        self.assertTrue(all(r["adopted"] for r in after))
        self.assertNotIn("placed replica", self.server.output())

    def test_scale_from_zero_and_back(self) -> None:
        """
        min_replicas = 0: nothing runs; the first request waits through
        activation and succeeds, a stream gets keep-alive comments first;
        idle for idle_timeout, the model goes back to zero and its engine
        stops.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=0, idle="3s")))
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        self.until(lambda: len(self.admin("/api/v1/nodes")["nodes"]) == 2, 20, "nodes")
        time.sleep(1)
        self.assertEqual(self.replicas(), [])
        self.assertIn("chat", [m.id for m in self.client.models.list()])
        started = time.monotonic()
        self.assertTrue(self.chat())
        waited = time.monotonic() - started
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        self.until(lambda: not self.replicas(), 20, "back to zero")
        self.until(lambda: not _alive(pid), 10, "engine stopped")
        self.assertIn("idle for 3s: scaling down to 0", self.server.output())

        # A stream waits with comment lines, then streams.
        status, headers, body = http(
            "POST",
            self.api_url + "/v1/chat/completions",
            json.dumps(
                {
                    "model": "chat",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "max_tokens": 3,
                }
            ).encode(),
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 200)
        self.assertTrue(
            body.startswith(b": waiting for model chat: starting replica chat-"),
            body[:200],
        )
        self.assertTrue(body.endswith(b"data: [DONE]\n\n"), body[-200:])
        self.assertGreater(waited, 0.2)

    def test_no_fit(self) -> None:
        """
        A model that fits nowhere: the placement API explains per node, and
        a request gets a 503 at once naming why (not a wait for the
        activation timeout: nothing would come of it).
        """
        self.start_fleet_server(self.config(HUGE, activation_timeout="2s"))
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        self.until(lambda: len(self.admin("/api/v1/nodes")["nodes"]) == 2, 20, "nodes")
        explained = self.admin("/api/v1/placement/huge")
        self.assertFalse(explained["fits"])
        self.assertEqual(
            explained["reasons"],
            [
                "profile eight-h200: gpu-01: has 2 GPUs, needs 8",
                "profile eight-h200: gpu-02: has 2 GPUs, needs 8",
            ],
        )
        started = time.monotonic()
        with self.assertRaises(openai.InternalServerError) as raised:
            self.chat("huge")
        self.assertEqual(raised.exception.status_code, 503)
        self.assertEqual(raised.exception.code, "model_unplaceable")
        self.assertIn("needs 8", raised.exception.message)
        self.assertLess(time.monotonic() - started, 1.5)
        status, _, body = http("GET", self.admin_url + "/api/v1/placement/nope")
        self.assertEqual(status, 404)
        with self.assertRaises(openai.NotFoundError):
            self.chat("nope")

    def test_drain_node_lets_stream_finish(self) -> None:
        """
        Draining a node: a stream in flight on it runs to its end, then its
        engine stops, and the replica is placed on the other node.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        self.start_agent("gpu-01")
        self.until(lambda: self.ready(1), 30, "a replica")
        self.start_agent("gpu-02")
        (replica,) = self.ready(1)
        node = replica["shards"][0]["node"]
        pid = replica["shards"][0]["pid"]
        chunks: list[str] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                for chunk in self.client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=60,
                    stream=True,
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunks.append(chunk.choices[0].delta.content)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=stream)
        thread.start()
        self.until(lambda: len(chunks) >= 3, 10, "the stream started")
        # A drain with no room elsewhere yet would be refused (409).
        self.until(lambda: len(self.admin("/api/v1/nodes")["nodes"]) == 2, 20, "nodes")
        drained = self.admin(f"/api/v1/nodes/{node}/drain", "POST")
        self.assertEqual(drained["draining_replicas"], [replica["id"]])
        self.assertTrue(_alive(pid))
        thread.join(30)
        self.assertEqual(errors, [])
        self.assertEqual(len(chunks), 60)
        self.until(lambda: not _alive(pid), 10, "the drained engine stopped")
        (moved,) = self.ready(1)
        self.assertNotEqual(moved["shards"][0]["node"], node)
        self.assertTrue(self.chat())
        (drained_node,) = [
            n for n in self.admin("/api/v1/nodes")["nodes"] if n["id"] == node
        ]
        self.assertTrue(drained_node["draining"])
        done = subprocess.run(
            [
                os.path.join(BIN, "llmgw"),
                "ctl",
                "--admin-url",
                self.admin_url,
                "undrain",
                "node",
                node,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=hermetic_env(),
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        (back,) = [n for n in self.admin("/api/v1/nodes")["nodes"] if n["id"] == node]
        self.assertFalse(back["draining"])


class DrainRestartTests(_Fleet, SynchronousTestCase):
    def test_drain_survives_restart(self) -> None:
        """
        A node drained through the admin API is draining again after the
        server restarts, as soon as its agent registers, and nothing is
        placed on it; undrained, a restart leaves it undrained.
        """
        config = self.config(
            MODELS.format(min_replicas=2, idle="0s"), startup_grace="6s"
        )
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        self.ready(2)
        self.admin("/api/v1/nodes/gpu-01/drain", "POST")

        def moved() -> bool:
            ready = [r for r in self.replicas() if r["state"] == "ready"]
            return len(ready) == 2 and all(
                r["shards"][0]["node"] == "gpu-02" for r in ready
            )

        self.until(moved, 30, "both replicas on gpu-02")

        def restart() -> dict[str, Any]:
            self.server.stop()
            self.start_fleet_server(config)

            def registered() -> dict[str, Any] | None:
                nodes = {n["id"]: n for n in self.admin("/api/v1/nodes")["nodes"]}
                return nodes.get("gpu-01") if "gpu-02" in nodes else None

            node: dict[str, Any] = self.until(registered, 15, "gpu-01 registered")
            return node

        self.assertTrue(restart()["draining"])
        # Past the grace, the fleet settled: nothing on the drained node.
        time.sleep(7)
        ready = self.ready(2)
        self.assertEqual({r["shards"][0]["node"] for r in ready}, {"gpu-02"})
        self.assertEqual(
            [r for r in self.replicas() if r["shards"][0]["node"] == "gpu-01"], []
        )

        # The store's write lock held elsewhere: 503 JSON, no traceback.
        database = os.path.join(self._directory(), "server-state", "llmgw.db")
        holder = sqlite3.connect(database, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            status, headers, body = http(
                "POST", self.admin_url + "/api/v1/nodes/gpu-01/undrain", b""
            )
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        self.assertEqual(status, 503, body)
        self.assertEqual(headers.get("content-type"), "application/json")
        self.assertEqual(json.loads(body)["error"]["code"], "store_busy")
        self.assertNotIn("Traceback", self.server.output())

        self.admin("/api/v1/nodes/gpu-01/undrain", "POST")
        self.assertFalse(restart()["draining"])
