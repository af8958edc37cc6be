"""
Faults of the fleet through the real wire (issue 14, cases 1, 2, 6 and
8): C{twistd llmgw-server} and C{twistd llmgw-agent} processes over mutual
TLS, simulated GPUs, C{llmgw sim} engines and a stand-in for
llama-cpp-python, driven as an operator would.
"""

from __future__ import annotations

import os
import random
import re
import socket
import tempfile
import threading
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.test_e2e_control import AGENT_CONFIG, MODELS, _alive, _Fleet

# The stand-in for python -m llama_cpp.server (found first on the engine's
# PYTHONPATH): for LOAD seconds it answers /v1/models with an empty list
# (as llama-cpp-python's server does while it loads) and 503 otherwise,
# then becomes llmgw sim on the same port.
STANDIN = """
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
alias, host, port = (
    args[args.index(k) + 1] for k in ("--model_alias", "--host", "--port")
)
LOAD = float(os.environ["STANDIN_LOAD"])

class Loading(BaseHTTPRequestHandler):
    def _answer(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/v1/models":
            code, body = 200, {"object": "list", "data": []}
        else:
            code, body = 503, {"error": {"message": "loading", "type": "x"}}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass

server = ThreadingHTTPServer((host, int(port)), Loading)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(LOAD)
server.shutdown()
server.server_close()
os.execv(sys.executable, [sys.executable, "-m", "llmgw.cli.main", "sim",
         "--host", host, "--port", port, "--model", alias])
"""

LLAMACPP = """
[[models]]
name = "chat"
min_replicas = 0
max_replicas = 1
[[models.profiles]]
name = "cpu"
engine = "llamacpp"
source = "{source}"
env = {{ PYTHONPATH = "{path}", STANDIN_LOAD = "5" }}
"""

GANG = """
[[models]]
name = "chat"
min_replicas = 1
max_replicas = 1
[[models.profiles]]
name = "pair"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
nodes = 2
fabric = "ib"
"""


class _Faults(_Fleet):
    def control(self, config: str, **keys: str) -> str:
        """
        @return: C{config} with C{keys} set in its C{[control]} table.
        """
        for key, value in keys.items():
            config = re.sub(rf"(?m)^{key} = .*\n", "", config)
            config = config.replace("[control]\n", f'[control]\n{key} = "{value}"\n')
        return config

    def pids(self) -> list[int]:
        return sorted(s["pid"] for r in self.replicas() for s in r["shards"])


class AddressTests(_Faults, SynchronousTestCase):
    def test_adopted_engine_probed_on_node_address(self) -> None:
        """
        Issue 14, case 1: engines on the node's configured address
        (127.0.0.41: Linux routes 127/8 to lo).  The agent restarts: the
        adopted engine is ready again; the server restarts: the replica is
        ready, the same engine, never killed at start_timeout.
        """
        config = self.control(
            self.config(MODELS.format(min_replicas=1, idle="0s")),
            start_timeout="8s",
        )
        agent_config = AGENT_CONFIG.replace("{address}", "127.0.0.41")
        self.start_fleet_server(config)
        self.start_agent("gpu-01", agent_config)
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        self.assertTrue(self.chat())

        self.agents["gpu-01"].stop()
        again = self.start_agent("gpu-01", agent_config)
        again.wait_for(r"adopted shard")
        again.wait_for(r"shard \S+ is ready", timeout=15)

        self.server.stop()
        self.start_fleet_server(config)
        (after,) = self.ready(1)
        self.assertEqual(after["shards"][0]["pid"], pid)
        self.assertTrue(self.chat())
        # Past start_timeout: still the one engine, nothing placed anew.
        time.sleep(9)
        (after,) = self.ready(1)
        self.assertEqual(after["shards"][0]["pid"], pid)
        self.assertTrue(_alive(pid))
        self.assertNotIn("placed replica", self.server.output())


class ReadinessTests(_Faults, SynchronousTestCase):
    def test_ready_once_model_listed(self) -> None:
        """
        Issue 14, case 2: llama-cpp-python lists no model while it loads
        (5 s here); 30 requests sent from the start all wait for the model
        to be listed and succeed: none gets an early 502/503.
        """
        path = tempfile.mkdtemp(prefix="llmgw-standin-")
        os.makedirs(os.path.join(path, "llama_cpp", "server"))
        open(os.path.join(path, "llama_cpp", "__init__.py"), "w").close()
        open(os.path.join(path, "llama_cpp", "server", "__init__.py"), "w").close()
        with open(os.path.join(path, "llama_cpp", "server", "__main__.py"), "w") as f:
            f.write(STANDIN)
        source = os.path.join(path, "model.gguf")
        open(source, "w").close()
        self.start_fleet_server(self.config(LLAMACPP.format(source=source, path=path)))
        self.start_agent("gpu-01")
        self.until(lambda: self.admin("/api/v1/nodes")["nodes"], 20, "the node")
        failures: list[str] = []
        answers: list[str] = []
        started = time.monotonic()

        def ask() -> None:
            try:
                answers.append(self.chat())
            except openai.OpenAIError as e:
                failures.append(repr(e))

        threads = [threading.Thread(target=ask) for _ in range(30)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join(60)
        self.assertEqual(failures, [])
        self.assertEqual(len(answers), 30)
        # The load was waited for.
        self.assertGreater(time.monotonic() - started, 5)


class GangTests(_Faults, SynchronousTestCase):
    def test_gang_ports_and_orphan(self) -> None:
        """
        Issue 14, case 6: a two-node gang on two agents sharing one
        address gets distinct ports (and a third for its rendezvous).  Its
        follower's agent dies with the engine left running, the node goes
        lost; the agent comes back listing that orphan rank 1: it is
        stopped, and a new gang is placed at once.
        """
        agent_config = AGENT_CONFIG.replace("{address}", "127.0.0.1").replace(
            "address", 'fabrics = ["ib"]\naddress', 1
        )
        self.start_fleet_server(self.config(GANG, startup_grace="3s"))
        self.start_agent("gpu-01", agent_config)
        self.start_agent("gpu-02", agent_config)
        (gang,) = self.ready(1)
        shards = sorted(gang["shards"], key=lambda s: s["rank"])
        ports = [s["port"] for s in shards]
        self.assertEqual(len(set(ports)), 2, shards)
        rendezvous = {
            s["command"]["leaderAddress"]
            for node in ("gpu-01", "gpu-02")
            for s in self._records(node)
        }
        (address,) = rendezvous
        self.assertTrue(address.startswith("127.0.0.1:"), address)
        self.assertNotIn(int(address.split(":")[1]), ports)
        self.assertTrue(self.chat())

        follower = shards[1]
        self.agents[follower["node"]].popen.kill()
        self.until(
            # Listed on as failed, with its error, until replaced.
            lambda: (
                not any(
                    r["id"] == gang["id"] and r["state"] != "failed"
                    for r in self.replicas()
                )
            ),
            20,
            "the gang dropped with its node",
        )
        self.assertTrue(_alive(follower["pid"]))
        self.start_agent(follower["node"], agent_config)
        placed = time.monotonic()
        self.until(lambda: not _alive(follower["pid"]), 15, "the orphan stopped")
        (new,) = self.until(
            lambda: [
                r
                for r in self.replicas()
                if r["state"] == "ready" and r["id"] != gang["id"]
            ],
            30,
            "a new gang",
        )
        self.assertEqual(len(new["shards"]), 2)
        self.assertLess(time.monotonic() - placed, 30)
        log = self.server.output()
        self.assertIn("an orphan of its gang", log)
        # No start storm while the orphan and the old leader stop: what
        # they hold is left alone until they are gone.
        self.assertLessEqual(log.count("placed replica"), 4, log[-3000:])

    def _records(self, node: str) -> list[dict[str, Any]]:
        import json

        folder = os.path.join(self.dir, f"state-{node}", "shards")
        records = []
        for name in os.listdir(folder):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    records.append(json.load(f))
        return records


class PortTests(_Faults, SynchronousTestCase):
    def test_port_taken_is_placement_fact(self) -> None:
        """
        Issue 14, case 8: the first port of the range is held by another
        process; the replica starts on the next port at once (base_backoff
        is 20 s here), the model's failures stay 0; a range inside the
        kernel's ephemeral ports is warned about once.
        """
        first = random.randrange(40000, 59000)
        self.ports = (first, first + 20)
        holder = socket.socket()
        self.addCleanup(holder.close)
        holder.bind(("127.0.0.1", first))
        holder.listen()
        config = self.control(
            self.config(MODELS.format(min_replicas=1, idle="0s")),
            base_backoff="20s",
            max_backoff="40s",
        )
        self.start_fleet_server(config)
        started = time.monotonic()
        self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        self.assertLess(time.monotonic() - started, 15)
        # The next free port: first + 1 unless something else (the range is
        # among the kernel's ephemeral ports, which other tests' clients
        # take) held that one too, which the agent says.
        port = replica["shards"][0]["port"]
        self.assertIn(port, range(first + 1, first + 20))
        agent = self.agents["gpu-01"].output()
        for taken in range(first, port):
            self.assertIn(f"port {taken} is not free", agent)
        (model,) = [
            m for m in self.admin("/api/v1/models")["models"] if m["name"] == "chat"
        ]
        self.assertEqual(model["failures_in_a_row"], 0)
        self.assertTrue(self.chat())
        self.assertEqual(
            self.server.output().count("overlaps the kernel's ephemeral"), 1
        )
        self.assertNotIn(f"port {port} is not free", agent)
