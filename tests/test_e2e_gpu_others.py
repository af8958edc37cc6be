"""
GPUs used by others, through the real daemons: C{twistd llmgw-server} and
C{twistd llmgw-agent} over mutual TLS, the agent reading GPUs from the fake
C{pynvml} (L{tests.fake_nvml.pynvml}: no GPU here), its engines the
C{llmgw sim}; observed as an operator would: the admin API's placement
explanation and nodes, C{llmgw ctl nodes}, the node page.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.support import CtlMixin, fake_nvml_env, http, spawn_agent
from tests.test_e2e_control import _Fleet

AGENT = 'address = "127.0.0.1"\n'

SIXTY = """
[[models]]
name = "sixty"
min_replicas = 1
[[models.profiles]]
name = "h100"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 60
"""


class GpusUsedByOthersTests(_Fleet, CtlMixin, SynchronousTestCase):
    def write_gpus(
        self, others_mib: int, engine: tuple[int, int] | None = None
    ) -> None:
        """
        One 80 GB GPU; C{others_mib} held by a process llmgw did not start
        (a C{sleep} in a session of its own, as a notebook would be);
        C{engine}, C{(pid, MiB)} of an engine llmgw started.
        """
        processes = []
        if others_mib:
            processes.append({"pid": self.notebook.pid, "used_mib": others_mib})
        if engine is not None:
            processes.append({"pid": engine[0], "used_mib": engine[1]})
        gpu = {
            "name": "NVIDIA H100 80GB HBM3",
            "total_mib": 80 * 1024,
            "reserved_mib": 500,
            "processes": processes,
        }
        path = self.nvml_state + ".new"
        with open(path, "w") as f:
            json.dump({"gpus": [gpu]}, f)
        os.replace(path, self.nvml_state)

    def test_others_memory_not_placed_on(self) -> None:
        """
        With 30 GB used by a process llmgw did not start, a 60 GB replica
        is not placed on the 80 GB GPU, and the placement explanation, the
        nodes API, C{ctl nodes} and the node page say why; once that
        process leaves the GPU, the replica is placed there and its engine
        counts as managed.
        """
        self.notebook = subprocess.Popen(["sleep", "120"], start_new_session=True)
        self.addCleanup(self.notebook.kill)
        self.nvml_state = os.path.join(self.dir, "nvml.json")
        self.write_gpus(30 * 1024)
        self.start_fleet_server(self.config(SIXTY))
        agent = spawn_agent(
            self.dir,
            AGENT,
            self.agent_port,
            "gpu-01",
            os.path.join(self.ca, "agents", "gpu-01"),
            env=fake_nvml_env(self.nvml_state),
        )
        self.addCleanup(agent.stop)
        self.agents["gpu-01"] = agent

        def others() -> int:
            nodes = self.admin("/api/v1/nodes")["nodes"]
            return int(nodes[0]["gpus"][0]["foreign_used_mib"]) if nodes else 0

        self.until(lambda: others() == 30 * 1024, 20, "30 GB used by others")
        explained = self.admin("/api/v1/placement/sixty")
        self.assertFalse(explained["fits"])
        self.assertEqual(
            explained["reasons"],
            [
                "profile h100: gpu-01: needs 1 GPUs, 0 usable: 1 with under 60 GB"
                " free (GPU 0 30.0 GB used by processes llmgw does not manage)"
            ],
        )
        time.sleep(1.5)  # several control passes: still nothing placed
        self.assertEqual(self.replicas("sixty"), [])
        (gpu,) = self.admin("/api/v1/nodes")["nodes"][0]["gpus"]
        self.assertFalse(gpu["simulated"])
        self.assertEqual(
            gpu["processes"],
            [
                {
                    "pid": self.notebook.pid,
                    "used_mib": 30 * 1024,
                    "managed": False,
                    "name": "sleep",
                }
            ],
        )
        table = self.ctl("nodes").stdout.splitlines()
        self.assertIn("OTHERS GiB", table[0])
        # ... USED GiB, OTHERS GiB, TOTAL GiB, LAST SEEN
        self.assertEqual(table[1].split()[-4:-1], ["30.5", "30.0", "80.0"])
        detail = self.ctl("nodes", "gpu-01").stdout
        self.assertIn(
            f"GPU 0: pid {self.notebook.pid} (sleep), 30.0 GiB, not llmgw's:"
            " placement may not use it",
            detail,
        )
        status, _, page = http("GET", self.admin_url + "/nodes/gpu-01")
        self.assertEqual(status, 200, page[:300])
        self.assertIn(b'data-figure="others"', page)
        self.assertIn(b"30.0 GiB</td>", page)

        self.write_gpus(0)
        (ready,) = self.ready_of("sixty")
        self.assertEqual(ready["shards"][0]["gpus"], [0])
        # The sim holds no GPU memory: NVML is told its engine holds 60 GB,
        # beside the notebook's 1 GB; only the notebook's counts as others'.
        (shard,) = self.admin("/api/v1/nodes")["nodes"][0]["shards"]
        self.write_gpus(1024, (shard["pid"], 60 * 1024))

        def listed() -> list[tuple[int, bool]] | None:
            (gpu,) = self.admin("/api/v1/nodes")["nodes"][0]["gpus"]
            found = sorted((p["pid"], p["managed"]) for p in gpu["processes"])
            return found if gpu["foreign_used_mib"] == 1024 else None

        self.assertEqual(
            self.until(listed, 20, "the engine managed, the notebook not"),
            sorted([(shard["pid"], True), (self.notebook.pid, False)]),
        )

    def ready_of(self, model: str) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            ready = [r for r in self.replicas(model) if r["state"] == "ready"]
            return ready or None

        found: list[dict[str, Any]] = self.until(check, 30, f"{model} ready")
        return found
