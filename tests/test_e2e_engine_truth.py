"""
An engine's own word decides its state, through real processes:
C{twistd llmgw-server}, one C{twistd llmgw-agent} with two simulated GPUs,
and C{llmgw sim} engines run with C{--engine-core-process}, which keeps a
child standing in for vLLM's C{EngineCore} as vLLM does
(L{llmgw.sim.core}).  Its API server killed with SIGKILL alone, its engine
core killed, and a sleep on its port that llmgw did not ask for: each
ends with the engine replaced (nothing of it left running) or listed
asleep and woken, and every request answered.
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

from llmgw.agent.records import MARKER
from tests.support import http, logged_usage
from tests.test_e2e_control import _alive, _Fleet


def models(
    args: list[str], replicas: int = 1, least: int | None = None, sleep: str = ""
) -> str:
    """
    @param args: the sim's arguments.
    @param replicas: the model's C{max_replicas}, and its C{min_replicas}
        unless C{least} is given.
    @param sleep: the profile's C{sleep}, or none.
    @return: the catalog of one model, C{chat}, on one simulated GPU.
    """
    slept = (
        f'sleep = "{sleep}"\nsleep_gpu_memory_gb = 2\nsleep_host_memory_gb = 1\n'
        if sleep
        else ""
    )
    return f"""
[[models]]
name = "chat"
min_replicas = {replicas if least is None else least}
max_replicas = {replicas}
idle_timeout = "{"600s" if sleep else "0s"}"
[[models.profiles]]
name = "one-h200"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
{slept}args = {json.dumps(args)}
"""


CORE = ["--engine-core-process", "--itl", "0.05"]

# Its sleep routes served though llmgw does not put it to sleep: as vLLM's
# with VLLM_SERVER_DEV_MODE=1 in a profile's environment.
SLEEPER = models(["--enable-sleep-mode"])

ASLEEP_AT_THE_DEATH = models(
    ["--engine-core-process", "--sleep-seconds", "3"], least=0, sleep="weights"
)

SLEEP_AGENT = """
address = "{address}"
sleep_memory = "8GiB"
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""


def children(pid: int) -> list[int]:
    """
    @return: the child processes of C{pid} (none when it is gone).
    """
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class EngineTruthTests(_Fleet, SynchronousTestCase):
    timeout = 120

    def fleet(self, models: str, agent: str | None = None) -> None:
        self.start_fleet_server(self.config(models))
        if agent is None:
            self.start_agent("gpu-01")
        else:
            self.start_agent("gpu-01", agent)

    def core_of(self, replica: dict[str, object]) -> tuple[int, int]:
        """
        @return: the API server's pid of C{replica}'s engine and its engine
            core's.
        """
        shards = replica["shards"]
        assert isinstance(shards, list)
        pid = int(shards[0]["pid"])
        (core,) = self.until(lambda: children(pid), 10, "the engine core")
        return pid, core

    def told_failed(self, shard: str, seconds: float) -> str:
        """
        @return: the reason the server was told C{shard} failed, from its
            log (the replacement clears the model's C{last_error} once
            ready: the log keeps it), once told within C{seconds}.
        """
        failed = self.until(
            lambda: [
                line
                for line in self.server.output().splitlines()
                if f"shard {shard} on gpu-01: failed: " in line
            ],
            seconds,
            "the failure told",
        )
        return str(failed[0].split(": failed: ", 1)[1])

    def replaced(self, pid: int) -> dict[str, Any]:
        """
        @return: a ready replica whose engine is not C{pid}, once there is
            one (20 s).
        """
        found: list[dict[str, Any]] = self.until(
            lambda: [
                r
                for r in self.replicas()
                if r["state"] == "ready" and r["shards"][0]["pid"] != pid
            ],
            20,
            "a replacement ready",
        )
        return found[0]

    def test_api_server_killed(self) -> None:
        """
        SIGKILL to an engine's API server alone (not its group): the agent
        sees it go though its engine core lives on, stops the core (nothing
        orphaned), and the replica is replaced within seconds, serving.
        """
        self.fleet(models(CORE))
        (replica,) = self.ready(1)
        pid, core = self.core_of(replica)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        self.until(lambda: not _alive(core), 10, "the orphaned engine core stopped")
        replacement = self.replaced(pid)
        took = time.monotonic() - started
        self.assertTrue(self.chat())
        print(f"engine truth: API server killed, replaced in {took:.1f} s")
        self.assertLess(took, 15)
        self.assertNotEqual(replacement["id"], replica["id"])

    def test_engine_core_killed(self) -> None:
        """
        Two replicas; one's engine core killed: every request sent from
        then on is answered (by the other replica: never vLLM's 500), the
        dead one ends or is stopped, and is replaced, and the replica
        failed with the engine's own line.
        """
        self.fleet(models(CORE, 2))
        ready = self.ready(2)
        pid, core = self.core_of(ready[0])
        os.kill(core, signal.SIGKILL)
        started = time.monotonic()
        errors: list[str] = []
        answered = 0
        while time.monotonic() - started < 3:
            try:
                self.assertTrue(self.chat())
                answered += 1
            except openai.OpenAIError as e:
                errors.append(repr(e))
        self.assertEqual(errors, [])
        self.assertGreater(answered, 3)
        shard = ready[0]["shards"][0]["id"]
        told = self.told_failed(shard, 15)
        # The engine's own line first, not its shutdown noise (the
        # replacement clears the model's last_error once ready: the log
        # keeps it).  The first request the dead engine answered ended it,
        # as vLLM's does, often before its 503 was asked.
        self.assertRegex(
            told,
            r"^[^;]*vllm\.v1\.engine\.exceptions\.EngineDeadError: EngineCore"
            " encountered an issue",
        )
        after = self.until(
            lambda: (
                [
                    r
                    for r in self.replicas()
                    if r["state"] == "ready" and r["shards"][0]["pid"] != pid
                ]
                if len([r for r in self.replicas() if r["state"] == "ready"]) == 2
                else []
            ),
            20,
            "the dead engine replaced",
        )
        print(
            f"engine truth: engine core killed, replaced in"
            f" {time.monotonic() - started:.1f} s; {answered} requests answered"
        )
        self.assertEqual(len(after), 2)
        self.assertFalse(_alive(pid))

    def test_stream_running_at_the_death(self) -> None:
        """
        A stream running on an engine whose core dies: the client's SDK
        raises vLLM's error (the event vLLM ends such a stream with, relayed
        as vLLM sent it, never a traceback or a cut without a word), the
        request's usage record is kept with the tokens it got, and the next
        request is answered by the replacement; the server's log blames
        nothing else on the engine.
        """
        self.fleet(models(CORE))
        (replica,) = self.ready(1)
        pid, core = self.core_of(replica)
        rid = f"dying-{os.getpid()}-{time.monotonic_ns()}"
        stream = self.client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2000,
            stream=True,
            extra_headers={"X-Request-ID": rid},
        )
        got = 0
        with self.assertRaises(openai.APIError) as raised:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
                    if got == 5:
                        os.kill(core, signal.SIGKILL)
        self.assertIn("EngineCore encountered an issue", str(raised.exception))
        status, _, completion = logged_usage(self.server, rid)
        print(
            f"engine truth: stream at the death: {got} tokens relayed, then"
            f" {raised.exception!r}; recorded status {status}, {completion} tokens"
        )
        self.assertEqual(status, 200)
        self.assertGreaterEqual(completion, got)
        self.assertLess(got, 2000)
        self.replaced(pid)
        self.assertTrue(self.chat())
        output = self.server.output()
        # Its own log says nothing false of the engine either: a stream
        # broken off carries no usage, which is not an engine that never
        # sends it.
        self.assertNotIn("sends no usage in streams", output)
        self.assertNotIn("Unhandled", output)

    def test_engine_dies_during_a_sleep(self) -> None:
        """
        The engine core dies while the agent's sleep of the engine runs
        (3 s here): vLLM's sleep call never answers then, and its end
        waits for ever on it, its port closed and its process alive
        (L{llmgw.sim.core}).  The health question, asked meanwhile, ends
        it: the replica fails with the engine's line within seconds, not
        when the sleep times out (600 s), nothing of it runs on, and the
        next request is answered by a replacement.
        """
        self.fleet(ASLEEP_AT_THE_DEATH, SLEEP_AGENT)
        self.assertTrue(self.chat())
        (replica,) = self.ready(1)
        pid, core = self.core_of(replica)
        shard = replica["shards"][0]["id"]
        record = os.path.join(self.dir, "state-gpu-01", "shards", f"{shard}.json")

        def turning() -> object:
            with open(record) as f:
                return json.load(f).get("turning")

        self.admin(f"/api/v1/replicas/{replica['id']}/sleep", "POST")
        self.until(lambda: turning() == "sleep", 10, "the sleep running")
        os.kill(core, signal.SIGKILL)
        started = time.monotonic()
        told = self.told_failed(shard, 20)
        took = time.monotonic() - started
        self.until(lambda: not _alive(pid), 10, "the engine stopped")
        print(
            f"engine truth: engine core died during a sleep: failed {took:.1f} s"
            f" after, with {told[:100]!r}"
        )
        self.assertRegex(told, r"^[^;]*vllm\.v1\.engine\.exceptions\.EngineDeadError")
        self.assertTrue(self.chat())

    def test_engine_ends_before_asked(self) -> None:
        """
        An engine that ends itself after its engine core died before the
        agent asked it anything (vLLM's watchdog may end it 0.7 s after,
        before a 503 is asked; the agent is held with SIGSTOP meanwhile
        here, the engine's health asked twenty times, each logged as
        vLLM's access log does): the replica failed with the engine's own
        line, though more than an output tail of lines followed it, then
        how it ended; and it is replaced.
        """
        self.fleet(models([*CORE, "--verbose"]))
        (replica,) = self.ready(1)
        pid, core = self.core_of(replica)
        agent = self.agents["gpu-01"].popen.pid
        port = replica["shards"][0]["port"]
        os.kill(agent, signal.SIGSTOP)
        try:
            os.kill(core, signal.SIGKILL)
            started = time.monotonic()
            asked = 0
            while asked < 20 and time.monotonic() - started < 3:
                try:
                    status, _, _ = http("GET", f"http://127.0.0.1:{port}/health")
                except OSError:
                    break
                asked += status == 503
            self.until(lambda: not _alive(pid), 10, "the engine ended by its watchdog")
        finally:
            os.kill(agent, signal.SIGCONT)
        shard = replica["shards"][0]["id"]
        told = self.told_failed(shard, 15)
        with open(
            os.path.join(self.dir, "state-gpu-01", "shards", f"{shard}.log")
        ) as f:
            lines = f.read().splitlines()
        after = len(lines) - max(
            i for i, line in enumerate(lines) if "EngineDeadError" in line
        )
        print(
            f"engine truth: engine ended unasked {asked} health answers 503 after"
            f" its core's death; {after} lines after its own; told {told[:120]!r}"
        )
        self.assertRegex(
            told,
            r"^ERROR \[async_llm.py:906\] vllm\.v1\.engine\.exceptions\."
            r"EngineDeadError: EngineCore encountered an issue\. .*"
            r" \(then the engine exited with code 0\)",
        )
        self.replaced(pid)

    def test_slept_behind_llmgws_back(self) -> None:
        """
        C{POST /sleep} on a ready engine's own port: within seconds the
        replica is listed sleeping, its agent's note saying why, and woken
        (its model wants a replica awake: min_replicas = 1); the next
        request is answered.
        """
        self.fleet(SLEEPER)
        (replica,) = self.ready(1)
        port = replica["shards"][0]["port"]
        engine = f"http://127.0.0.1:{port}"
        status, _, _ = http("POST", engine + "/sleep?level=1", b"")
        self.assertEqual(status, 200)
        started = time.monotonic()
        self.until(
            lambda: "put to sleep outside llmgw" in self.server.output(),
            10,
            "the sleep noticed",
        )
        noticed = time.monotonic() - started
        self.assertIn("sleeping", self.server.output().split("outside llmgw", 1)[1])
        answers: list[str] = []
        thread = threading.Thread(target=lambda: answers.append(self.chat()))
        thread.start()
        thread.join(30)
        self.assertEqual(len(answers), 1)
        self.assertTrue(answers[0])
        _, _, body = http("GET", engine + "/is_sleeping")
        self.assertEqual(body, b'{"is_sleeping":false}')
        print(
            f"engine truth: slept behind llmgw's back, listed sleeping in"
            f" {noticed:.1f} s, awake and answering in"
            f" {time.monotonic() - started:.1f} s"
        )


def marker_of(pid: int) -> str:
    """
    @return: the value of the engine marker in C{pid}'s environment.
    """
    with open(f"/proc/{pid}/environ", "rb") as f:
        for entry in f.read().split(b"\0"):
            if entry.startswith(MARKER.encode() + b"="):
                return entry.split(b"=", 1)[1].decode()
    raise AssertionError(f"no marker in pid {pid}'s environment")


class OnlyOurEnginesTests(_Fleet, SynchronousTestCase):
    timeout = 120

    def test_copied_marker(self) -> None:
        """
        A C{sleep 600} in a session of its own carrying a copy of a running
        engine's marker: the restarted agent adopts the engine, neither
        adopts nor stops the copy (it cannot prove it started it), and says
        so.
        """
        self.start_fleet_server(self.config(models(CORE)))
        agent = self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        env = {**os.environ, MARKER: marker_of(pid)}
        impostor = subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)
        self.addCleanup(impostor.wait)
        self.addCleanup(impostor.kill)
        agent.stop()
        agent = self.start_agent("gpu-01")
        agent.wait_for(r"registered with llmgw-server")
        self.until(
            lambda: f"pid {impostor.pid} carries the marker" in agent.output(),
            10,
            "the copy told",
        )
        time.sleep(1)
        self.assertIsNone(impostor.poll())
        self.assertNotIn("second engine", agent.output())
        self.assertRegex(agent.output(), rf"adopted shard \S+: engine pid {pid}")
        (after,) = self.ready(1)
        self.assertEqual(after["shards"][0]["pid"], pid)
        self.assertTrue(self.chat())
