"""
Network cuts (issue 14): an agent and its C{llmgw sim} engines run in a
network namespace made by the test (L{tests.netns_support}), the server
on the host listening on the veth's host side; the path is cut by
dropping every packet silently, routes left in place, and healed by
removing the drop.  Each case's figures go to C{fault-suite.jsonl} with
the fault suite's (L{report}).  Without C{ip}/C{tc} or CAP_NET_ADMIN the
tests skip (CI, as root, fails instead).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.fault_support import engines_running, report
from tests.netns_support import netns_or_skip
from tests.support import TWISTD, Process, http, make_certs, spawn
from tests.test_e2e_control import AGENT_CONFIG
from tests.test_e2e_faults import SIM, _Faults

# [control] lost_after in _Fleet.config.  A stream on a lost node must end
# within it and 3 s (a heartbeat, reconcile passes), not at the router's
# idle deadline (60 s).
LOST_AFTER = 6.0
# AGENT_CONFIG with its first GPU only.
ONE_GPU_CONFIG = "[[simulated_gpus]]".join(
    AGENT_CONFIG.split("[[simulated_gpus]]", 2)[:2]
)

OTHER = {
    "name": "other",
    "min_replicas": 1,
    "max_replicas": 1,
    "profiles": [
        {
            "name": "one",
            "engine": "sim",
            "source": "sim",
            "gpus": 1,
            "gpu_memory_gb": 40,
        }
    ],
}


class _Netcut(_Faults):
    """
    L{_Faults} with gpu-01 inside a namespace: its agent dials the server
    on the veth's host address, its engines listen on its namespace
    address; gpu-02 stays on the host (127.0.0.2).
    """

    timeout = 150

    def setUp(self) -> None:
        self.net = netns_or_skip()
        self.addCleanup(self.net.remove)
        super().setUp()
        # The server's certificate must name the address gpu-01 dials.
        self.ca = make_certs(
            os.path.join(self.dir, "net"),
            f"127.0.0.1,{self.net.host_address}",
            ["gpu-01", "gpu-02"],
        )

    def start_fleet_server(self, config: str) -> None:
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=0.0.0.0",
            config=config,
            state="server-state",
        )
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )

    def start_agent(self, node_id: str, config: str = AGENT_CONFIG) -> Process:
        if node_id != "gpu-01":
            return super().start_agent(node_id, config)
        path = os.path.join(self.dir, f"agent-{node_id}-{time.monotonic_ns()}.toml")
        with open(path, "w") as f:
            f.write(config.replace("{address}", self.net.ns_address))
        argv = [*self.net.prefix(), TWISTD, "-n", "--pidfile=", "llmgw-agent"]
        argv += ["--config", path, "--node-id", node_id]
        argv += ["--server", f"{self.net.host_address}:{self.agent_port}"]
        argv += ["--tls-dir", os.path.join(self.ca, "agents", node_id)]
        argv += ["--state-dir", os.path.join(self.dir, f"state-{node_id}")]
        process = spawn(argv, self.dir, f"agent-{node_id}-{time.monotonic_ns()}")
        self.addCleanup(process.stop)
        self.agents[node_id] = process
        return process

    def cut(self) -> float:
        """
        Cut the path to gpu-01 (healed at the end whatever happens).

        @return: when (monotonic).
        """
        self.net.cut()
        self.addCleanup(self.net.heal)
        return time.monotonic()

    def ns_engines(self) -> list[int]:
        """
        @return: the C{llmgw sim} engines running inside the namespace.
        """
        inside = set(self.net.pids())
        return [pid for pid in engines_running(self.dir) if pid in inside]

    def node_state(self, node_id: str) -> str:
        for node in self.admin("/api/v1/nodes")["nodes"]:
            if node["id"] == node_id:
                return str(node["state"])
        return "absent"

    def on_node(self, model: str, node_id: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self.replicas(model)
            if r["state"] == "ready" and r["shards"][0]["node"] == node_id
        ]

    def streaming(self) -> tuple[threading.Thread, list[str], list[Any]]:
        """
        A long stream on "chat" (2000 tokens at 50 ms: 100 s), flowing.
        """
        chunks: list[str] = []
        errors: list[Any] = []
        thread = threading.Thread(target=self.stream, args=(2000, chunks, errors))
        thread.start()
        self.addCleanup(thread.join, 70)
        self.until(lambda: len(chunks) >= 3, 10, "the stream started")
        return thread, chunks, errors

    def ended(self, thread: threading.Thread, errors: list[Any]) -> float:
        """
        @return: when the stream's error event came (monotonic).
        """
        thread.join(40)
        self.assertFalse(thread.is_alive(), "the stream still runs 40 s after the cut")
        ((at, error),) = errors
        self.assertIn("went away", error)
        return float(at)


class NetcutTests(_Netcut, SynchronousTestCase):
    def test_partition(self) -> None:
        """
        gpu-01 (in the namespace) serves "chat", gpu-02 (host) "other";
        the path to gpu-01 is cut during a stream: the stream ends with an
        error event when the node goes lost (lost_after 6 s), not at the
        idle deadline; "chat" is placed again on gpu-02 and serves; no
        request to "other" fails throughout.
        """
        self.fleet(SIM.format(low=1, args='["--itl", "0.05"]'), startup_grace="3s")
        self.start_agent("gpu-01", ONE_GPU_CONFIG)
        self.until(lambda: self.on_node("chat", "gpu-01"), 30, "chat on gpu-01")
        self.start_agent("gpu-02")
        status, _, body = http(
            "POST", self.admin_url + "/api/v1/models", json.dumps(OTHER).encode()
        )
        self.assertEqual(status, 201, body)
        self.until(lambda: self.on_node("other", "gpu-02"), 30, "other on gpu-02")
        stop = threading.Event()
        failures: list[str] = []
        served = [0]

        def other() -> None:
            while not stop.is_set():
                try:
                    self.chat("other")
                    served[0] += 1
                except openai.OpenAIError as e:
                    failures.append(repr(e))
                time.sleep(0.05)

        runner = threading.Thread(target=other)
        runner.start()
        self.addCleanup(runner.join, 70)
        self.addCleanup(stop.set)
        thread, chunks, errors = self.streaming()
        cut = self.cut()
        error_at = self.ended(thread, errors)
        seconds = self.serve_again(cut, 40)
        (moved,) = self.on_node("chat", "gpu-02")
        time.sleep(1)
        stop.set()
        runner.join(70)
        report(
            "network cut of a node serving a stream (namespace)",
            seconds_to_error_event=round(error_at - cut, 2),
            chunks_before_error=len(chunks),
            seconds_to_serve_again=round(seconds, 2),
            failed_not_on_failed_part=len(failures),
            served_meanwhile=served[0],
        )
        self.assertLess(error_at - cut, LOST_AFTER + 3)
        self.assertEqual(failures, [])
        self.assertGreater(served[0], 0)

    def test_drain_then_cut(self) -> None:
        """
        Issue 14 case 5 over a real cut: a drain of gpu-01 starts while a
        stream runs on it (the drain waits for it: drain_timeout 30 s);
        then the path is cut: the stream ends with an error event when the
        node goes lost, not at the drain timeout nor the idle deadline.
        When the cut heals, the engine the agent kept is adopted on a node
        still draining: it is drained and stopped, not served.
        """
        self.fleet(SIM.format(low=1, args='["--itl", "0.05"]'), "gpu-01")
        self.ready(1)
        thread, chunks, errors = self.streaming()
        # Forced: its only node, no room for a replacement first.
        status, _, body = http(
            "POST", self.admin_url + "/api/v1/nodes/gpu-01/drain", b'{"force": true}'
        )
        self.assertEqual(status, 200, body)
        drained = time.monotonic()
        time.sleep(1)
        self.assertEqual(errors, [])
        flowing = len(chunks)
        cut = self.cut()
        error_at = self.ended(thread, errors)
        self.net.heal()
        healed = time.monotonic()
        self.until(lambda: self.node_state("gpu-01") == "ready", 40, "gpu-01 back")
        back = time.monotonic() - healed

        def stopped() -> bool:
            return not self.ns_engines() and not self.on_node("chat", "gpu-01")

        try:
            self.until(stopped, 15, "the drained node's engine stopped")
        except AssertionError:
            pass
        gone = time.monotonic() - healed
        report(
            "drain of a node whose link is then cut (namespace)",
            seconds_to_error_event=round(error_at - cut, 2),
            seconds_from_drain=round(error_at - drained, 2),
            chunks_before_cut=flowing,
            seconds_healed_to_node_back=round(back, 2),
            engines_in_namespace_after=len(self.ns_engines()),
            seconds_healed_to_engine_stopped=round(gone, 2),
        )
        self.assertLess(error_at - cut, LOST_AFTER + 3)
        self.assertEqual(self.ns_engines(), [])

    def test_heal_after_lost(self) -> None:
        """
        The cut lasts past lost_after and the server's link timeout (6
        heartbeats of 1 s), then heals: the agent connects again, the
        engine it kept running is adopted, never started twice (one
        engine in the namespace throughout), and the node is ready again
        through its new link (two registrations, from two connections).
        """
        self.fleet(SIM.format(low=1, args="[]"), "gpu-01", startup_grace="3s")
        (before,) = self.ready(1)
        seen: list[int] = []
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                seen.append(len(self.ns_engines()))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        self.addCleanup(watcher.join, 10)
        self.addCleanup(watching.set)
        cut = self.cut()
        self.until(lambda: self.node_state("gpu-01") == "lost", 20, "gpu-01 lost")
        self.server.wait_for(r"node gpu-01 silent for", 10)
        time.sleep(1)
        self.net.heal()
        healed = time.monotonic()
        self.until(lambda: self.node_state("gpu-01") == "ready", 60, "gpu-01 back")
        back = time.monotonic() - healed
        seconds = self.serve_again(healed, 40)
        (after,) = self.ready(1)
        time.sleep(2)
        watching.set()
        watcher.join(10)
        log = self.server.output()
        peers = re.findall(r"agent gpu-01 registered from ([\d.]+:\d+)", log)
        second = log.rfind("agent gpu-01 registered from")
        report(
            "network cut healed after lost_after (namespace)",
            seconds_cut=round(healed - cut, 2),
            seconds_healed_to_node_ready=round(back, 2),
            seconds_healed_to_serve_again=round(seconds, 2),
            most_engines_in_namespace=max(seen),
            registrations=len(peers),
            same_engine=after["shards"][0]["pid"] == before["shards"][0]["pid"],
        )
        self.assertEqual(max(seen), 1)
        self.assertEqual(len(peers), 2, log[-4000:])
        self.assertEqual(len(set(peers)), 2)
        # The old link was closed (silent) before the node came back.
        self.assertLess(log.find("node gpu-01 silent for"), second)
        self.assertEqual(after["shards"][0]["pid"], before["shards"][0]["pid"])
