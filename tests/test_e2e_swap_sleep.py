"""
Sleep as a state of a replica (issue 25 item 2), through real processes:
C{twistd llmgw-server} and C{twistd llmgw-agent} over mutual TLS, one
simulated 80 GB GPU and C{llmgw sim} engines in sleep mode (the sim
serves vLLM's sleep routes and holds the memory vLLM would; a real vLLM
sleeps only on a GPU), driven with the OpenAI client and the admin API as
a user would.
"""

from __future__ import annotations

import json
import time

from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.api import completion_text
from tests.support import CtlMixin, http
from tests.test_e2e_control import _alive
from tests.test_e2e_swap import _Swaps

AGENT = """
address = "{address}"
sleep_memory = "8GiB"
[[simulated_gpus]]
name = "H100"
memory_gb = 80
"""

MODEL = """
[[models]]
name = "{name}"
min_replicas = 0
max_replicas = 1
idle_timeout = "{idle}"
min_resident = "1s"
[[models.profiles]]
name = "p"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 60
sleep = "{sleep}"
sleep_gpu_memory_gb = 2
sleep_host_memory_gb = 1
args = {args}
"""

LOAD_SECONDS = 4.0
WAKE_SECONDS = 0.3


def model(name: str, idle: str = "600s", *extra: str, sleep: str = "weights") -> str:
    args = ["--itl", "0.02", "--load-seconds", str(LOAD_SECONDS)]
    args += ["--wake-seconds", str(WAKE_SECONDS), "--sleep-seconds", "0.2", *extra]
    return MODEL.format(name=name, idle=idle, args=json.dumps(args), sleep=sleep)


class SleepSwapTests(_Swaps, SynchronousTestCase, CtlMixin):
    def state(self, name: str) -> list[tuple[str, str, int]]:
        """
        @return: C{name}'s replicas: id, state (C{asleep} once its shard
            is, not only told to), its engine's pid.
        """
        return [
            (
                r["id"],
                "asleep" if r["shards"][0]["state"] == "sleeping" else r["state"],
                r["shards"][0]["pid"],
            )
            for r in self.replicas(name)
        ]

    def test_evicted_sleeps_and_comes_back_by_a_wake(self) -> None:
        """
        C{a}, then C{b}, then C{a} on one 80 GB GPU (60 GB each): C{a} is
        put to sleep for C{b} (its engine still running, holding 2 GB),
        then C{b} for C{a}, and C{a} comes back by a wake of the same
        engine: answered in well under a cold start.
        """
        self.setup_fleet(model("a") + model("b"), agent=AGENT)
        started = time.monotonic()
        self.assertTrue(self.chat("a"))
        cold = time.monotonic() - started
        ((a, _, a_pid),) = self.state("a")
        time.sleep(1.2)  # a's min_resident
        self.assertTrue(self.chat("b"))
        self.assertEqual(self.state("a"), [(a, "asleep", a_pid)])
        self.assertTrue(_alive(a_pid))
        ((b, _, b_pid),) = self.state("b")
        time.sleep(1.2)
        sent = time.monotonic()
        self.assertTrue(self.chat("a"))
        woke = time.monotonic() - sent
        print(f"\ncold start answered in {cold:.2f}s, the wake in {woke:.2f}s")
        self.assertEqual(self.state("a"), [(a, "ready", a_pid)])
        self.assertEqual(self.state("b"), [(b, "asleep", b_pid)])
        self.assertLess(woke, LOAD_SECONDS)
        self.assertLess(woke, cold / 2)
        output = self.server.output()
        self.assertIn(f"putting replica {a} of a to sleep (weights)", output)
        self.assertIn(f"waking replica {a} of a", output)
        self.assertNotIn("Traceback", output)
        _, _, body = http("GET", self.admin_url + "/metrics")
        text = body.decode()
        self.assertIn('llmgw_swaps_total{model="a",reason="slept"} 1.0', text)
        self.assertIn('llmgw_engine_wake_seconds_count{model="a"} 1.0', text)

    def test_going_to_sleep_while_its_stream_ends(self) -> None:
        """
        C{a} streams (300 chunks, 6 s) when C{b} is asked for; past
        swap_max_wait (1 s) C{a} is told to sleep but its stream ends
        first: meanwhile C{ctl replicas} says C{going to sleep} (the API's
        C{leaving} why), then C{sleeping}; C{ctl placement b} names the
        eviction, with C{a}'s request in flight, and how long ago.
        """
        self.setup_fleet(model("a") + model("b"), agent=AGENT, swap_max_wait="1s")
        self.assertTrue(self.chat("a"))
        ((a, _, _),) = self.state("a")
        thread, seen = self.stream("a", 300)
        self.until(lambda: len(seen["chunks"]) >= 5, 10, "a's stream started")
        self.stream("b", 2)

        def ctl_state() -> str:
            line = next(
                row for row in self.ctl("replicas").stdout.splitlines() if a in row
            )
            return line

        going = self.until(lambda: "going to sleep" in ctl_state(), 10, "going")
        self.assertIsNone(seen["done"], going)
        (listed,) = self.replicas("a")
        self.assertEqual(
            listed["leaving"], "goes to sleep once its requests in flight end"
        )
        thread.join(30)
        self.assertEqual((seen["errors"], len(seen["chunks"])), ([], 300))
        self.until(lambda: "sleeping " in ctl_state(), 10, "sleeping")
        placement = self.ctl("placement", "b").stdout
        self.assertRegex(
            placement,
            r"last eviction for it \([0-9.]+s ago\): evicting a \(1 in flight,"
            r" last request [0-9]+s ago\) to make room",
        )

    def test_idle_sleeps_and_the_operator_wakes(self) -> None:
        """
        Idle for C{idle_timeout}, the replica sleeps instead of stopping;
        the admin API wakes it and puts it to sleep again, and refuses
        what cannot be done with C{409} and the reason.
        """
        self.setup_fleet(model("a", "2s"), agent=AGENT)
        self.assertTrue(self.chat("a"))
        ((a, _, pid),) = self.state("a")
        self.until(lambda: self.state("a") == [(a, "asleep", pid)], 20, "asleep")
        self.assertTrue(_alive(pid))
        status, _, body = http(
            "POST", self.admin_url + f"/api/v1/replicas/{a}/sleep", b""
        )
        self.assertEqual(status, 409, body)
        self.assertEqual(json.loads(body)["error"]["code"], "cannot_sleep")
        woken = self.admin(f"/api/v1/replicas/{a}/wake", "POST")
        self.assertIn(woken["state"], ("waking", "ready"))
        self.until(lambda: self.state("a") == [(a, "ready", pid)], 20, "awake")
        self.assertTrue(self.chat("a"))
        asleep = self.admin(f"/api/v1/replicas/{a}/sleep", "POST")
        self.assertEqual(asleep["state"], "sleeping")
        self.until(lambda: self.state("a") == [(a, "asleep", pid)], 20, "asleep")
        status, _, body = http(
            "POST", self.admin_url + "/api/v1/replicas/nope/wake", b""
        )
        self.assertEqual(status, 404, body)
        self.assertNotIn("Traceback", self.server.output())

    def test_discarded_weights_reloaded_by_the_wake(self) -> None:
        """
        C{sleep = "discard"} (vLLM level 2): idle, the replica sleeps and
        its engine says C{discard_all}; a request wakes it, and its answer
        is the model's (the agent woke the weights, had them reloaded, then
        the KV cache), not the text of lost weights.
        """
        self.setup_fleet(model("a", "2s", sleep="discard"), agent=AGENT)
        right = completion_text(b"hello", 4)
        self.assertEqual(self.chat("a"), right)
        ((a, _, pid),) = self.state("a")
        self.until(lambda: self.state("a") == [(a, "asleep", pid)], 20, "asleep")
        (replica,) = self.replicas("a")
        port = replica["shards"][0]["port"]
        _, _, text = http("GET", f"http://127.0.0.1:{port}/metrics")
        self.assertRegex(
            text.decode(), r'vllm:engine_sleep_state\{[^}]*"discard_all"\} 1\.0'
        )
        self.assertEqual(self.chat("a"), right)
        self.assertEqual(self.state("a"), [(a, "ready", pid)])
        _, _, stats = http("GET", f"http://127.0.0.1:{port}/sim/stats")
        self.assertEqual(json.loads(stats)["weights_lost"], False)
        self.assertNotIn("Traceback", self.server.output())

    def test_engine_refusing_sleep_mode_is_stopped(self) -> None:
        """
        The profile says C{sleep} but the engine refuses sleep mode (as
        vLLM on a CPU does): the agent starts it without, the server logs
        one warning naming the engine's line, and the idle replica is
        stopped instead of put to sleep.
        """
        self.setup_fleet(model("a", "2s", "--sleep-mode-unsupported"), agent=AGENT)
        self.assertTrue(self.chat("a"))
        ((a, _, pid),) = self.state("a")
        self.until(lambda: not self.state("a"), 30, "stopped")
        self.assertFalse(_alive(pid))
        output = self.server.output()
        warnings = [
            line
            for line in output.splitlines()
            if "#warn]" in line
            and "Sleep mode is not supported on current platform." in line
        ]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertNotIn("putting replica", output)
        self.assertNotIn("Traceback", output)
