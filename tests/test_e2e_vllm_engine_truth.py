"""
An engine's own word decides its state, against the real vLLM on this
machine's CPU (C{scripts/setup-vllm}), placed and started by a real
C{twistd llmgw-agent} under a real C{twistd llmgw-server}
(L{tests.vllm_fleet}): vLLM's API server killed with SIGKILL alone, its
C{EngineCore} killed with SIGKILL, and C{POST /sleep} on its port (served
with C{VLLM_SERVER_DEV_MODE=1}; vLLM on a CPU accepts it and pauses its
scheduler, C{vllm/v1/worker/cpu_worker.py}) each end with the replica
replaced or woken and the next request answered, and nothing of a killed
engine's session left running.  The seconds to recovery of each are
printed.  Three vLLM starts: the first, and one replacement per kill.
"""

from __future__ import annotations

import os
import signal
import time

import openai

from tests.support import http
from tests.vllm_fleet import VLLMFleet
from tests.vllm_support import require_vllm


def group(pgid: int) -> dict[int, str]:
    """
    @return: the live processes of process group C{pgid}, each pid with
        its command line.
    """
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            found[int(name)] = cmdline
    return found


class VLLMEngineTruthTests(VLLMFleet):
    # Three vLLM starts, about 1.5 minutes each on two free cores.
    timeout = 1500

    def test_engine_word_decides(self) -> None:
        """
        The steps below, in order, on one fleet.
        """
        require_vllm(model=True)
        self.fleet(env={"VLLM_SERVER_DEV_MODE": "1"})
        self.replica = self.ready()
        self.assertTrue((self.chat().choices[0].message.content or "").strip())
        for step in (self.api_server_killed, self.engine_core_killed, self.slept):
            try:
                step()
            except BaseException as e:
                raise AssertionError(f"step {step.__name__}: {e}") from e

    def recovered(self, pid: int, started: float, what: str) -> None:
        """
        Wait for a replacement of the engine C{pid}, answer a chat through
        it, check nothing of C{pid}'s group runs, and print the seconds.
        """
        answer = self.chat()
        self.assertTrue((answer.choices[0].message.content or "").strip())
        replacement = self.ready()
        self.assertNotEqual(replacement["shards"][0]["pid"], pid)
        self.assertEqual(group(pid), {})
        print(
            f"vllm engine truth: {what}: replaced and answering"
            f" {time.monotonic() - started:.0f} s after; no process of its"
            " group left"
        )
        self.replica = replacement

    def failure_told(self) -> list[str]:
        """
        Wait up to 30 s for the server's log to tell the current replica's
        shard failed.

        @return: the log lines that tell it.
        """
        shard = self.replica["shards"][0]["id"]
        told: list[str] = self.until(
            lambda: [
                line
                for line in self.server.output().splitlines()
                if f"shard {shard} on cpu-01: failed: " in line
            ],
            30,
            "the failure told",
        )
        return told

    def api_server_killed(self) -> None:
        """
        SIGKILL to vLLM's API server pid alone: its EngineCore, workers
        and resource tracker do not outlive it, and it is replaced.
        """
        pid = self.replica["shards"][0]["pid"]
        members = group(pid)
        self.assertTrue(
            [c for p, c in members.items() if p != pid], f"no child: {members}"
        )
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        self.until(lambda: not group(pid), 30, f"the group of {pid} gone")
        print(
            f"vllm engine truth: API server killed: its group"
            f" ({len(members)} processes) gone {time.monotonic() - started:.1f} s"
            " after"
        )
        # Killed, vLLM said nothing more: the failure's last output is what
        # it said before, not the access lines of the agent's own health
        # and sleep questions (two a second while it idled).
        failed = self.failure_told()
        print(f"vllm engine truth: API server killed: told {failed[0][-300:]!r}")
        self.assertIn("last output: ", failed[0])
        self.assertNotRegex(failed[0], '"GET /(health|is_sleeping|metrics) ')
        self.recovered(pid, started, "API server killed")

    def engine_core_killed(self) -> None:
        """
        SIGKILL to vLLM's EngineCore: the replica failed with vLLM's own
        line (seen when its health answers 503, asked every second, or when
        vLLM ends itself, 0 to 5 s after: whichever comes first), a request sent
        then is held for the replacement and answered (not vLLM's 500),
        and the engine is stopped whole and replaced.  (A request that
        meets the dead engine before the failure is told gets a 503 with
        C{Retry-After}, docs/agents.md: sent at a fixed 2 s, the request
        was that one on a loaded machine.)
        """
        pid = self.replica["shards"][0]["pid"]
        cores = [p for p, c in group(pid).items() if "EngineCore" in c]
        if not cores:
            # Its process title (setproctitle) may not show in cmdline.
            cores = [
                p for p in group(pid) if "EngineCore" in open(f"/proc/{p}/comm").read()
            ]
        self.assertEqual(len(cores), 1, group(pid))
        os.kill(cores[0], signal.SIGKILL)
        started = time.monotonic()
        failed = self.failure_told()
        told = failed[0].split(": failed: ", 1)[1][:200]
        print(
            f"vllm engine truth: EngineCore killed: the replica failed"
            f" {time.monotonic() - started:.1f} s after, with {told!r}"
        )
        self.assertRegex(told, "^[^;]*(EngineDeadError|engine core exited)")
        try:
            self.chat()
        except openai.APIStatusError as e:
            self.fail(f"answered {e.status_code}, not held for the replacement: {e}")
        self.until(lambda: not group(pid), 30, f"the group of {pid} gone")
        self.recovered(pid, started, "EngineCore killed")

    def slept(self) -> None:
        """
        C{POST /sleep} on vLLM's own port: listed sleeping within seconds,
        woken, and the next request answered.
        """
        engine = self.engine_url(self.replica)
        status, _, body = http("POST", engine + "/sleep?level=1", b"")
        self.assertEqual(status, 200, body)
        started = time.monotonic()
        self.until(
            lambda: "put to sleep outside llmgw" in self.server.output(),
            30,
            "the sleep noticed",
        )
        noticed = time.monotonic() - started
        answer = self.chat()
        self.assertTrue((answer.choices[0].message.content or "").strip())
        _, _, body = http("GET", engine + "/is_sleeping")
        self.assertIn(b"false", body)
        print(
            f"vllm engine truth: slept outside llmgw: noticed {noticed:.1f} s,"
            f" awake and answering {time.monotonic() - started:.1f} s after"
        )
