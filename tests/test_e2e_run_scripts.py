"""
The first week's scripts as C{make} runs them (issue 37, item 8):
C{scripts/run-sim-fleet} (C{make run-sim-fleet}), a fleet of simulated
GPUs on this machine whose sim models do not all fit, so that a user sees
eviction and sleep with no GPU; and C{scripts/run-local} (C{make run},
C{make run-vllm}) saying, when another server holds the default state
directory, which one and how to start a second beside it
(C{STATE_DIR=}, C{PORT=}, C{ADMIN_PORT=}).

The scripts are run directly, with C{VENV} the test's environment, as
the Makefile's targets run them once the environment is set up.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import (
    BIN,
    CtlMixin,
    Process,
    free_port,
    hermetic_env,
    spawn,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.dirname(BIN)


class RunScriptsTests(SynchronousTestCase, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-run-")
        # The scripts' default state directory is under $HOME: the
        # hermetic one, shared by this test's scripts and no one else.
        self.home = tempfile.mkdtemp(prefix="llmgw-home-", dir=self.dir)

    def env(self, **more: str) -> dict[str, str]:
        return {"HOME": self.home, "VENV": VENV, **more}

    def fleet(self, **more: str) -> tuple[Process, str]:
        """
        Start C{scripts/run-sim-fleet} on free ports.

        @return: the process and the client API's base URL.
        """
        port, admin = free_port(), free_port()
        env = self.env(PORT=str(port), ADMIN_PORT=str(admin), **more)
        process = spawn(
            [os.path.join(ROOT, "scripts", "run-sim-fleet")],
            self.dir,
            f"fleet-{port}",
            env,
        )
        self.addCleanup(process.stop)
        process.wait_for(r"client API listening on", timeout=60)
        # The script's own line names the ports given, not the defaults.
        process.wait_for(
            rf"run-local: llmgw on http://127\.0\.0\.1:{port} \(loopback only\),"
            rf" admin on http://127\.0\.0\.1:{admin};"
        )
        self.admin_url = f"http://127.0.0.1:{admin}"
        return process, f"http://127.0.0.1:{port}"

    def run_script(self, name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [os.path.join(ROOT, "scripts", name)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**hermetic_env(), **self.env()},
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
        )

    def test_sim_fleet(self) -> None:
        """
        One command starts a server whose local agent reports two
        simulated 24 GB GPUs, seen by llmgw ctl nodes; of its three sim
        models, two fit: a request for the third evicts the least recently
        used one (stopped), and a request for that one again puts the
        next to sleep (its profile says sleep = "weights").
        """
        process, url = self.fleet()
        (node,) = self.ctl_json("nodes")["nodes"]
        simulated = [g for g in node["gpus"] if g["simulated"]]
        self.assertEqual(
            [(g["name"], g["memory_total_mib"]) for g in simulated],
            [("sim-24GB", 24 * 1024)] * 2,
        )
        self.assertIn("sim-24GB", self.ctl("nodes").stdout)
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.assertEqual(
            sorted(m.id for m in client.models.list()), ["sim-1", "sim-2", "sim-3"]
        )
        for model in ("sim-1", "sim-2", "sim-3", "sim-1"):
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            self.assertTrue(answer.choices[0].message.content)
        process.wait_for(r"evicting replica sim-1-\S+ of sim-1 .* for sim-3")
        process.wait_for(
            r"putting replica sim-2-\S+ of sim-2 to sleep \(weights\):"
            r" evicted to make room for sim-1"
        )
        # The script ends as twistd did: by the SIGTERM it forwarded (143).
        self.assertIn(process.stop(), (0, 128 + 15))
        self.assertNotIn("Traceback", process.output())

    def test_default_state_held(self) -> None:
        """
        With a server on the default state directory, make run and make
        run-vllm's script and make run-sim-fleet's refuse at once, naming
        the directory, the holder's pid and the make command with
        STATE_DIR, PORT and ADMIN_PORT; given STATE_DIR, a second one
        starts beside the first.
        """
        first, _ = self.fleet()
        default = os.path.join(self.home, ".local", "state", "llmgw")
        for script, target in (
            ("run-local", "run"),
            ("run-sim-fleet", "run-sim-fleet"),
        ):
            done = self.run_script(script)
            self.assertEqual(done.returncode, 2, done.stderr)
            self.assertIn(
                f"the default state directory {default} is held by llmgw-server pid",
                done.stderr,
            )
            self.assertIn(
                f"make {target} STATE_DIR=/tmp/llmgw-2 PORT=8081 ADMIN_PORT=9091",
                done.stderr,
            )
        other = os.path.join(self.dir, "second")
        second, _ = self.fleet(STATE_DIR=other)
        second.wait_for(f"state in {other}")
        nodes: list[dict[str, Any]] = self.ctl_json("nodes")["nodes"]
        self.assertEqual(len(nodes), 1)
        # The first is left serving: the refusals came before any start.
        self.assertIsNone(first.popen.poll())
        self.assertNotIn("stopping:", first.output())
