"""
The simulator's sleep mode (L{llmgw.sim.sleep}): vLLM's and SGLang's
routes through the real site under a Clock, its metric and stats, and the
C{llmgw sim} command line (its flags, and the refusal vLLM prints on a
CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.engine import SimConfig, Simulator
from llmgw.sim.sleep import UNSUPPORTED, SleepConfig
from llmgw.sim.web import SimSite
from tests.sim_support import chat_body
from tests.support import hermetic_env
from tests.test_sim_site import _Conn

ROUTES = (
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
)


class SleepRouteTests(SynchronousTestCase):
    """
    The sleep routes over in-memory connections with a fake clock.
    """

    def make(self, enabled: bool = True, **config: Any) -> tuple[Simulator, SimSite]:
        self.clock = Clock()
        self.clock.advance(1000)
        sleep = SleepConfig(
            enabled=enabled,
            sleep_seconds=2.0,
            wake_seconds=3.0,
            gpu_memory_gb=20.0,
            sleep_gpu_memory_gb=1.5,
        )
        sim = Simulator(SimConfig(models=("m",), sleep=sleep, **config), self.clock)
        return sim, SimSite(sim)

    def call(
        self,
        site: SimSite,
        path: str,
        method: str = "POST",
        body: object = None,
        headers: str = "",
    ) -> _Conn:
        conn = _Conn(site)
        data = b"" if body is None else json.dumps(body).encode()
        conn.channel.dataReceived(
            f"{method} {path} HTTP/1.1\r\nHost: sim\r\n{headers}"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        return conn

    def answer(self, conn: _Conn) -> tuple[int, Any]:
        head, body, done = conn.head_body()
        self.assertTrue(done, head)
        status = int(head.split(b" ", 2)[1])
        return status, json.loads(body)

    def stats(self, site: SimSite) -> dict[str, Any]:
        result: dict[str, Any] = self.answer(self.call(site, "/sim/stats", "GET"))[1]
        return result

    def gauge(self, site: SimSite) -> dict[str, float]:
        _, body, _ = self.call(site, "/metrics", "GET").head_body()
        found = {}
        for line in body.decode().splitlines():
            if line.startswith("vllm:engine_sleep_state{"):
                labels, value = line.rsplit(" ", 1)
                state = labels.split('sleep_state="')[1].split('"')[0]
                self.assertIn('engine="0"', labels)
                self.assertIn('model_name="m"', labels)
                found[state] = float(value)
        return found

    def test_absent_without_flag(self) -> None:
        """
        Without C{--enable-sleep-mode} every sleep route is a 404, as in
        vLLM; the gauge says awake.
        """
        _, site = self.make(enabled=False)
        for method, path in ROUTES:
            status, body = self.answer(self.call(site, path, method))
            self.assertEqual((status, body["error"]["code"]), (404, "not_found"))
        self.assertEqual(
            self.gauge(site),
            {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0},
        )

    def test_sleep_then_wake(self) -> None:
        """
        A sleep is answered after --sleep-seconds, the memory dropping to
        --sleep-gpu-memory-gb then; a request while asleep waits; a wake
        holds --gpu-memory-gb from its start and is answered after
        --wake-seconds, when the request goes ahead.
        """
        _, site = self.make(ttft=0.5)
        self.assertEqual(self.stats(site)["gpu_memory_gb"], 20.0)
        asleep = self.call(site, "/sleep?level=1")
        self.clock.advance(1.9)
        self.assertEqual(asleep.transport.value(), b"")
        self.assertEqual(self.stats(site)["sleep_busy"], "sleeping")
        self.clock.advance(0.1)
        self.assertEqual(self.answer(asleep), (200, {"status": "sleeping", "level": 1}))
        stats = self.stats(site)
        self.assertEqual(
            (stats["sleep_state"], stats["is_sleeping"], stats["gpu_memory_gb"]),
            ("weights_offloaded", True, 1.5),
        )
        self.assertEqual(
            self.gauge(site),
            {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0},
        )
        self.assertEqual(
            self.answer(self.call(site, "/is_sleeping", "GET")),
            (200, {"is_sleeping": True}),
        )
        request = self.call(site, "/v1/chat/completions", body=chat_body(2, False))
        self.clock.advance(10)
        self.assertEqual(request.transport.value(), b"")
        woken = self.call(site, "/wake_up")
        self.assertEqual(self.stats(site)["gpu_memory_gb"], 20.0)
        self.assertTrue(self.stats(site)["is_sleeping"])
        self.clock.advance(3)
        self.assertEqual(self.answer(woken), (200, {"status": "awake", "tags": None}))
        self.assertFalse(self.stats(site)["is_sleeping"])
        self.clock.advance(1)
        status, body = self.answer(request)
        self.assertEqual((status, body["object"]), (200, "chat.completion"))
        self.assertEqual(self.stats(site)["sleep_cycles"], 1)

    def test_levels(self) -> None:
        """
        Level 2 is C{discard_all}; a level vLLM does not take is a 400
        naming C{level}, and changes nothing.
        """
        _, site = self.make()
        status, body = self.answer(self.call(site, "/sleep?level=3"))
        self.assertEqual((status, body["error"]["param"]), (400, "level"))
        self.assertFalse(self.stats(site)["is_sleeping"])
        conn = self.call(site, "/sleep?level=2")
        self.clock.advance(2)
        self.assertEqual(self.answer(conn)[1], {"status": "sleeping", "level": 2})
        self.assertEqual(self.gauge(site)["discard_all"], 1.0)

    def test_wake_by_tags(self) -> None:
        """
        A wake naming the weights only leaves the engine asleep (vLLM's
        C{"status": "sleeping"}); the KV cache's then wakes it; a tag not
        asleep changes nothing.
        """
        _, site = self.make()
        self.call(site, "/sleep")
        self.clock.advance(2)
        conn = self.call(site, "/wake_up?tags=bogus")
        self.clock.advance(0)
        self.assertEqual(self.answer(conn)[1]["status"], "sleeping")
        conn = self.call(site, "/wake_up?tags=weights")
        self.clock.advance(3)
        self.assertEqual(
            self.answer(conn)[1], {"status": "sleeping", "tags": ["weights"]}
        )
        self.assertEqual(self.stats(site)["gpu_memory_gb"], 1.5)
        conn = self.call(site, "/wake_up?tags=kv_cache")
        self.clock.advance(3)
        self.assertEqual(self.answer(conn)[1]["status"], "awake")

    def test_keys(self) -> None:
        """
        With an API key, vLLM's sleep routes stay open and SGLang's need
        the key.
        """
        _, site = self.make(api_key="k")
        conn = self.call(site, "/sleep")
        self.clock.advance(2)
        self.assertEqual(self.answer(conn)[0], 200)
        status, _ = self.answer(self.call(site, "/resume_memory_occupation", body={}))
        self.assertEqual(status, 401)
        conn = self.call(
            site,
            "/resume_memory_occupation",
            body={},
            headers="Authorization: Bearer k\r\n",
        )
        self.clock.advance(3)
        self.assertEqual(self.answer(conn), (200, None))
        self.assertFalse(self.stats(site)["is_sleeping"])

    def test_sglang(self) -> None:
        """
        SGLang's release and resume, with C{{}} or tags; an unknown tag is
        a 400 naming C{tags}.
        """
        _, site = self.make()
        status, body = self.answer(
            self.call(site, "/release_memory_occupation", body={"tags": ["gpu"]})
        )
        self.assertEqual((status, body["error"]["param"]), (400, "tags"))
        conn = self.call(site, "/release_memory_occupation", body={})
        self.clock.advance(2)
        self.assertEqual(self.answer(conn), (200, None))
        self.assertEqual(self.stats(site)["gpu_memory_gb"], 1.5)
        conn = self.call(
            site,
            "/resume_memory_occupation",
            body={"tags": ["weights", "kv_cache", "cuda_graph"]},
        )
        self.clock.advance(3)
        self.assertEqual(self.answer(conn), (200, None))
        self.assertEqual(self.stats(site)["sleep_state"], "awake")


class SleepCommandLineTests(SynchronousTestCase):
    """
    C{llmgw sim}'s sleep flags, as a user gives them.
    """

    def run_sim(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmgw.cli.main", "sim", "--port", "0"]
            + ["--model", "m", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=hermetic_env(),
        )

    def test_unsupported(self) -> None:
        """
        C{--sleep-mode-unsupported} with C{--enable-sleep-mode} exits 1
        with vLLM's line, as vLLM on a CPU does.
        """
        done = self.run_sim("--enable-sleep-mode", "--sleep-mode-unsupported")
        self.assertEqual(done.returncode, 1)
        self.assertEqual(done.stderr.strip().splitlines()[-1], UNSUPPORTED)

    def test_bad_values(self) -> None:
        """
        A negative memory or duration is refused by argparse, naming it.
        """
        for flag in ("--gpu-memory-gb", "--sleep-seconds"):
            done = self.run_sim(flag, "-1")
            self.assertEqual(done.returncode, 2)
            self.assertIn(flag, done.stderr)
