"""
The coding agents people point at a fleet, end to end: Claude Code
(C{claude -p}, the Messages API), Codex CLI (C{codex exec}, the Responses
API) and opencode (C{opencode run}, chat completions) against a real
C{twistd -n llmgw-server} over loopback, with an API key, on an
C{llmgw sim} model (L{tests.agents_support} runs them).

Each client answers once; and each completes the loop of an agent: the sim
asks it to run a shell command (a C{sim: call} line in the prompt, see
docs/sim.md), the client runs it and sends the result back, and the sim's
final answer quotes it.  The command prints a number the prompt does not
hold, so that only the tool's result can bring it into the answer.  After
each run the key's usage rows must hold the engine's own counts for every
request the client made: their number, prompt and completion tokens equal
to the sim's counters.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.agents_support import AgentClients, AgentRun
from tests.support import CtlMixin, Processes, http

MODEL = "sim-model"


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class AgentsThroughSimTests(SynchronousTestCase, Processes, CtlMixin):
    """
    Each client against a server in front of one sim, a key of its own.
    """

    timeout = 120

    def setUp(self) -> None:
        # Codex asks for no max_output_tokens: a real engine's cap is then
        # its context, the sim's its --max-tokens, set as high.
        _, self.sim_url = self.start_sim(
            "--itl", "0.0005", "--max-tokens", "8192", model=MODEL
        )
        _, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={self.sim_url}={MODEL}"
        )
        made = self.ctl("keys", "create", "--name", "agent")
        key = made.stdout.splitlines()[0].strip()
        self.clients = AgentClients(self.url, key, MODEL)
        self.addCleanup(self.clients.cleanup)

    def check_usage(self, run: AgentRun) -> dict[str, Any]:
        """
        The key's usage rows hold what the engine counted, for every request
        the client made, and none was an error or an estimate.

        @return: the key's usage row.
        """
        metrics = http("GET", self.sim_url + "/metrics")[2].decode()
        answered = _metric(metrics, "vllm:request_success_total")
        prompt = _metric(metrics, "vllm:prompt_tokens_total")
        completion = _metric(metrics, "vllm:generation_tokens_total")
        self.assertGreater(answered, 0, run)
        deadline = time.monotonic() + 10
        row: dict[str, Any] = {}
        while time.monotonic() < deadline:
            usage = self.ctl_json("usage", "--by", "key")
            rows = [r for r in usage["usage"] if r["key"] == "agent"]
            row = rows[0] if rows else {}
            if row.get("requests") == answered and usage["pending"] == 0:
                break
            time.sleep(0.1)
        self.assertEqual(
            (
                row.get("requests"),
                row.get("errors"),
                row.get("estimated_requests"),
                row.get("prompt_tokens"),
                row.get("completion_tokens"),
            ),
            (answered, 0, 0, prompt, completion),
            (row, run),
        )
        print(
            f"\n{answered:.0f} requests, {prompt:.0f} prompt and {completion:.0f}"
            f" completion tokens, {run.seconds:.1f} s"
        )
        return row

    def one_shot(self, run: Callable[[str], AgentRun]) -> None:
        """
        A prompt gets the sim's answer, which ends by itself.
        """
        done = run("Say hello.")
        self.assertEqual(done.returncode, 0, done)
        self.assertRegex(done.stdout, r"\S", done)
        self.check_usage(done)

    def shell_loop(self, run: Callable[[str], AgentRun], tool: str, arg: str) -> None:
        """
        The sim calls the client's shell tool with C{echo}, the client runs
        it, and the sim's last answer quotes its output.
        """
        n = random.randrange(10**8, 10**9)
        marker = f"mark-{n + 1}"
        command = f"echo mark-$(({n} + 1))"
        done = run(
            f'Run the command.\nsim: call {tool} {{"{arg}": "{command}",'
            ' "description": "print a marker"}'
        )
        self.assertEqual(done.returncode, 0, done)
        self.assertRegex(done.stdout, "The tool said:(.|\n)*" + re.escape(marker), done)
        row = self.check_usage(done)
        self.assertGreaterEqual(row["requests"], 2)

    def test_claude_one_shot(self) -> None:
        """
        C{claude -p} answers through the Messages API.
        """
        self.one_shot(self.clients.claude)

    def test_claude_shell_loop(self) -> None:
        """
        C{claude -p} runs its C{Bash} tool for the sim and sends back the
        output, which the final answer quotes.
        """
        self.shell_loop(self.clients.claude, "Bash", "command")

    def test_codex_one_shot(self) -> None:
        """
        C{codex exec} answers through the Responses API.
        """
        self.one_shot(self.clients.codex)

    def test_codex_shell_loop(self) -> None:
        """
        C{codex exec} runs its C{exec_command} tool for the sim.
        """
        self.shell_loop(self.clients.codex, "exec_command", "cmd")

    def test_opencode_one_shot(self) -> None:
        """
        C{opencode run} answers through chat completions; the sim ends its
        answers by themselves, though opencode asks for 32,000 tokens.
        """
        self.one_shot(self.clients.opencode)

    def test_opencode_shell_loop(self) -> None:
        """
        C{opencode run} runs its C{bash} tool for the sim.
        """
        self.shell_loop(self.clients.opencode, "bash", "command")
