"""
Drains that keep models up and engines stopped on purpose (issue 20,
findings 4 and 5), through real processes: C{twistd llmgw-server} and
C{twistd llmgw-agent} over mutual TLS with simulated GPUs and the
C{llmgw sim} engine, driven with C{llmgw ctl} and watched through the
admin API, C{/readyz} and an OpenAI client, as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import BIN, hermetic_env, http
from tests.test_e2e_control import MODELS, _alive, _Fleet

SMALL_AGENT = """
address = "{address}"
[[simulated_gpus]]
name = "L4"
memory_gb = 24
"""
"""
A node that cannot hold C{MODELS}' replica (40 GB on one GPU).
"""

ONE_GPU = """
address = "{address}"
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""
"""
A node with room for one replica of C{MODELS}.
"""


class _Drains(_Fleet):
    timeout = 240

    def start_fleet_server(self, config: str, *extra: str) -> None:
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            *extra,
            config=config,
            state="server-state",
        )
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [os.path.join(BIN, "llmgw"), "ctl", "--admin-url", self.admin_url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=hermetic_env(),
        )

    def readyz(self) -> tuple[int, Any]:
        status, _, body = http("GET", self.api_url + "/readyz", timeout=10)
        return status, json.loads(body)

    def node(self, node_id: str) -> dict[str, Any] | None:
        nodes = {n["id"]: n for n in self.admin("/api/v1/nodes")["nodes"]}
        return nodes.get(node_id)

    def on(self, node_id: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self.replicas()
            if r["state"] == "ready" and r["shards"][0]["node"] == node_id
        ]


class _Watcher:
    """
    Samples the model's ready replicas (admin API) and C{/readyz} every
    100 ms, and sends chat requests one after the other, until stopped.
    """

    def __init__(self, case: _Drains) -> None:
        self.case = case
        self.ready: list[int] = []
        self.readyz: list[int] = []
        self.failures: list[str] = []
        self.served = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sample),
            threading.Thread(target=self._send),
        ]

    def __enter__(self) -> _Watcher:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _sample(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            models = self.case.admin("/api/v1/models")["models"]
            self.ready.append(next(m["ready"] for m in models if m["name"] == "chat"))
            self.readyz.append(self.case.readyz()[0])
            self._stop.wait(max(0.0, 0.1 - (time.monotonic() - started)))

    def _send(self) -> None:
        while not self._stop.is_set():
            try:
                self.case.chat()
                self.served += 1
            except openai.OpenAIError as e:
                self.failures.append(repr(e))


class DrainKeepsModelsUpTests(_Drains, SynchronousTestCase):
    def test_drain_only_node_refused(self) -> None:
        """
        The only node that can hold a min_replicas = 1 model: its drain is
        refused (409 naming the model, and `llmgw ctl drain` says so and
        exits 1), nothing changes and the model serves on; forced, the
        node drains and /readyz lists the model as unavailable.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        self.start_agent("gpu-01", ONE_GPU)
        self.start_agent("gpu-02", SMALL_AGENT)
        (replica,) = self.ready(1)
        self.assertEqual(replica["shards"][0]["node"], "gpu-01")
        self.until(lambda: self.node("gpu-02"), 20, "gpu-02 registered")
        status, ready = self.readyz()
        self.assertEqual((status, ready["unavailable"]), (200, []))

        status, _, body = http(
            "POST", self.admin_url + "/api/v1/nodes/gpu-01/drain", b""
        )
        self.assertEqual(status, 409, body)
        error = json.loads(body)["error"]
        self.assertEqual(error["code"], "below_min_replicas")
        self.assertEqual(error["models"], ["chat"])
        self.assertEqual(
            error["message"],
            "draining node gpu-01 would leave model 'chat' with 0 of its"
            " min_replicas 1: no room elsewhere for a replacement",
        )
        done = self.ctl("drain", "node", "gpu-01")
        self.assertEqual(done.returncode, 1, done.stdout)
        self.assertEqual(
            done.stderr,
            f"llmgw ctl: {error['message']} (HTTP 409); --force drains anyway\n",
        )
        done = self.ctl("drain", "replica", replica["id"])
        self.assertEqual(done.returncode, 1, done.stdout)
        self.assertEqual(
            done.stderr,
            f"llmgw ctl: draining replica {replica['id']} would leave model 'chat'"
            " with 0 of its min_replicas 1: no room elsewhere for a replacement"
            " (HTTP 409); --force drains anyway\n",
        )
        self.assertFalse(self.node("gpu-01")["draining"])  # type: ignore[index]
        self.assertEqual(self.ready(1), [replica])
        self.assertTrue(self.chat())

        done = self.ctl("drain", "node", "gpu-01", "--force")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(
            done.stdout, f"draining node gpu-01: replicas {replica['id']}\n"
        )
        self.until(lambda: not _alive(replica["shards"][0]["pid"]), 20, "stopped")
        status, ready = self.readyz()
        self.assertEqual(status, 503)
        self.assertEqual(ready["unavailable"], ["chat"])
        self.assertEqual(
            ready["below_min_replicas"],
            [{"model": "chat", "ready": 0, "min_replicas": 1}],
        )
        self.assertNotIn("Traceback", self.server.output())

    def test_tier_readyz_lists_models_below_min(self) -> None:
        """
        A router of the tier (--router-workers 1) says what the server
        would: a min_replicas = 1 model with no ready replica is
        unavailable, until one is ready.
        """
        self.start_fleet_server(
            self.config(MODELS.format(min_replicas=1, idle="0s")),
            "--router-workers",
            "1",
        )
        self.server.wait_for(r"router worker 1 started")

        def answered() -> Any:
            try:
                return self.readyz()
            except OSError:  # The worker not listening yet.
                return None

        self.assertEqual(
            self.until(answered, 20, "a router of the tier answering"),
            (
                503,
                {
                    "status": "not ready",
                    "unavailable": ["chat"],
                    "below_min_replicas": [
                        {"model": "chat", "ready": 0, "min_replicas": 1}
                    ],
                },
            ),
        )
        self.start_agent("gpu-01")
        self.ready(1)
        self.until(lambda: self.readyz()[0] == 200, 20, "ready behind the tier")
        self.assertEqual(self.readyz()[1]["below_min_replicas"], [])

    def test_drain_with_room_keeps_a_ready_replica(self) -> None:
        """
        A node drained while another has room: the model has a ready
        replica at every sample (every 100 ms), /readyz says ready at
        every sample, and no request fails; the old engine stops once its
        replacement serves.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        self.start_agent("gpu-02")
        self.until(lambda: self.node("gpu-02"), 20, "gpu-02 registered")
        pid = replica["shards"][0]["pid"]
        with _Watcher(self) as watcher:
            time.sleep(1)
            done = self.ctl("drain", "node", "gpu-01")
            self.assertEqual(done.returncode, 0, done.stderr)
            self.until(lambda: self.on("gpu-02"), 30, "a replica on gpu-02")
            self.until(lambda: not _alive(pid), 40, "the old engine stopped")
            time.sleep(1)
        # Sampled across the whole move (1 s before the drain, until 1 s
        # after the old engine stopped); how many samples fit depends on
        # how fast the move and the machine are, so only that there were
        # enough to see a gap of one sample.
        self.assertGreater(len(watcher.ready), 10)
        self.assertGreaterEqual(min(watcher.ready), 1, watcher.ready)
        self.assertEqual(set(watcher.readyz), {200})
        self.assertEqual(watcher.failures, [])
        self.assertGreater(watcher.served, 10)
        self.assertEqual(
            done.stdout,
            f"draining node gpu-01: replicas {replica['id']}\n"
            f"each drains once its replacement is ready: {replica['id']}\n",
        )
        (moved,) = self.ready(1)
        self.assertEqual(moved["shards"][0]["node"], "gpu-02")
        self.assertIn(
            f"draining replica {replica['id']} of chat: node gpu-01 is draining;"
            " its replacement is ready",
            self.server.output(),
        )


class StoppingOnPurposeTests(_Drains, SynchronousTestCase):
    def test_stop_engines_leaves_no_drain(self) -> None:
        """
        `llmgw ctl stop-engines NODE` stops a node's engines (its replica
        moves to the other node); `--all` stops every engine, and nothing
        is placed again while the server runs.  No drain is kept: after a
        restart both nodes are placed on again.
        """
        config = self.config(
            MODELS.format(min_replicas=2, idle="0s"), startup_grace="6s"
        )
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        before = self.ready(2)
        self.assertEqual(
            sorted(r["shards"][0]["node"] for r in before), ["gpu-01", "gpu-02"]
        )
        (first,) = [r for r in before if r["shards"][0]["node"] == "gpu-01"]

        done = self.ctl("stop-engines", "gpu-01")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(
            f"stopping the engines of gpu-01: replicas {first['id']}", done.stdout
        )
        self.until(lambda: not _alive(first["shards"][0]["pid"]), 20, "stopped")
        self.until(lambda: len(self.on("gpu-02")) == 2, 30, "both on gpu-02")
        self.assertTrue(self.node("gpu-01")["engines_stopped"])  # type: ignore[index]

        done = self.ctl("stop-engines", "--all")
        self.assertEqual(done.returncode, 0, done.stderr)
        pids = [p for node in ("gpu-01", "gpu-02") for p in self._recorded_pids(node)]
        self.until(lambda: not any(_alive(p) for p in pids), 30, "every engine gone")
        self.until(lambda: not self.replicas(), 20, "no replica left")
        time.sleep(2)
        self.assertEqual(self.replicas(), [])
        for node_id in ("gpu-01", "gpu-02"):
            node = self.node(node_id)
            assert node is not None
            self.assertEqual((node["draining"], node["engines_stopped"]), (False, True))
        explained = self.admin("/api/v1/placement/chat")
        self.assertIn("profile one-h200: gpu-01: engines stopped", explained["reasons"])

        self.server.stop()
        self.start_fleet_server(config)
        after = self.until(
            lambda: (lambda r: r if len(r) == 2 else None)(
                [r for r in self.replicas() if r["state"] == "ready"]
            ),
            40,
            "two replicas again after the restart",
        )
        self.assertEqual(
            sorted(r["shards"][0]["node"] for r in after), ["gpu-01", "gpu-02"]
        )
        for node_id in ("gpu-01", "gpu-02"):
            node = self.node(node_id)
            assert node is not None
            stopped = (node["draining"], node["engines_stopped"])
            self.assertEqual(stopped, (False, False))

    def test_agent_sigterm_keeps_engines(self) -> None:
        """
        An agent's own SIGTERM (a restart) leaves its engine running and
        serving; the agent started again adopts the same engine, and no
        request fails meanwhile.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        agent = self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        with _Watcher(self) as watcher:
            time.sleep(0.5)
            self.assertEqual(agent.stop(), -signal.SIGTERM)
            self.assertTrue(_alive(pid))
            time.sleep(1)
            self.assertTrue(_alive(pid))
            self.start_agent("gpu-01")
            self.until(
                lambda: (
                    (self.node("gpu-01") or {}).get("connected")
                    and self.ready(1)[0]["shards"][0]["pid"] == pid
                ),
                30,
                "the engine adopted",
            )
            time.sleep(0.5)
        self.assertEqual(watcher.failures, [])
        self.assertGreater(watcher.served, 5)
        (after,) = self.ready(1)
        self.assertEqual((after["id"], after["shards"][0]["pid"]), (replica["id"], pid))
        self.assertIn("adopted shard", self.agents["gpu-01"].output())
