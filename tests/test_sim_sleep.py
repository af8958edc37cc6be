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

from llmgw.sim.api import completion_text
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
    ("POST", "/collective_rpc"),
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

    def text(self, site: SimSite) -> str:
        """
        @return: the chat answer to C{chat_body}'s prompt, as the engine
            gives it now (it must be awake).
        """
        conn = self.call(site, "/v1/chat/completions", body=chat_body(4, False))
        self.clock.advance(10)
        status, body = self.answer(conn)
        self.assertEqual(status, 200, body)
        content: str = body["choices"][0]["message"]["content"]
        return content

    def sleep_state(self, site: SimSite) -> tuple[bool, str]:
        """
        @return: what C{/is_sleeping} says, and the C{sleep_state} the
            gauge sets to 1 (C{""}: none).
        """
        said = self.answer(self.call(site, "/is_sleeping", "GET"))[1]["is_sleeping"]
        ones = [state for state, value in self.gauge(site).items() if value == 1.0]
        return said, "".join(ones)

    def test_discard_loses_the_weights(self) -> None:
        """
        After a level-2 sleep a plain wake answers awake, and the engine
        answers with text that is no longer its answer to the prompt (vLLM
        maps the discarded weights again empty); C{reload_weights} through
        C{/collective_rpc} brings the right answer back.  Level 1 keeps
        them.  Checked against vLLM's code, not a run (the CPU build refuses
        sleep mode): C{v1/worker/gpu_worker.py} (C{sleep}, C{wake_up},
        C{reload_weights}) and C{device_allocator/sleep_mode_backend.py}
        (weights offloaded at level 1 only).
        """
        _, site = self.make()
        right = self.text(site)
        self.assertEqual(right, completion_text(b"hello", 4))
        self.call(site, "/sleep?level=1")
        self.clock.advance(2)
        self.call(site, "/wake_up")
        self.clock.advance(3)
        self.assertEqual(self.text(site), right)
        self.call(site, "/sleep?level=2")
        self.clock.advance(2)
        self.assertEqual(self.sleep_state(site), (True, "discard_all"))
        self.assertTrue(self.stats(site)["weights_lost"])
        self.call(site, "/wake_up")
        self.clock.advance(3)
        self.assertEqual(self.sleep_state(site), (False, "awake"))
        self.assertNotEqual(self.text(site), right)
        self.assertEqual(self.text(site), completion_text(b"", 4))
        conn = self.call(site, "/collective_rpc", body={"method": "reload_weights"})
        self.assertEqual(self.answer(conn), (200, {"results": [None]}))
        self.assertEqual(self.text(site), right)
        self.assertFalse(self.stats(site)["weights_lost"])

    def test_discard_then_vllm_wake_sequence(self) -> None:
        """
        vLLM's documented wake from level 2, step by step: the weights'
        wake leaves it asleep (gauge still C{discard_all}); a reload
        before that wake is refused (500) and changes nothing; after it,
        the reload is answered; the KV cache's wake makes it awake, with
        the right answer.  Bad C{/collective_rpc} bodies get vLLM's 400s;
        an unknown method its 500.  vLLM's files: its "Sleep Mode" document
        (the sequence), C{entrypoints/serve/dev/rpc/api_router.py} (the
        route's checks and C{{"results": [...]}}), C{v1/engine/async_llm.py}
        (the gauge set awake only once fully awake) and
        C{v1/metrics/loggers.py} (its C{sleep_state} labels).
        """
        _, site = self.make()
        right = self.text(site)
        self.call(site, "/sleep?level=2")
        self.clock.advance(2)
        reload = {"method": "reload_weights"}
        status, body = self.answer(self.call(site, "/collective_rpc", body=reload))
        self.assertEqual(status, 500, body)
        self.assertTrue(self.stats(site)["weights_lost"])
        conn = self.call(site, "/wake_up?tags=weights")
        self.clock.advance(3)
        self.assertEqual(self.answer(conn)[1]["status"], "sleeping")
        self.assertEqual(self.sleep_state(site), (True, "discard_all"))
        conn = self.call(site, "/collective_rpc", body=reload)
        self.assertEqual(self.answer(conn), (200, {"results": [None]}))
        self.assertEqual(self.sleep_state(site), (True, "discard_all"))
        conn = self.call(site, "/wake_up?tags=kv_cache")
        self.clock.advance(3)
        self.assertEqual(self.answer(conn)[1]["status"], "awake")
        self.assertEqual(self.sleep_state(site), (False, "awake"))
        self.assertEqual(self.text(site), right)
        for bad, code in (([1], 400), ({"args": []}, 400), ({"method": "x"}, 500)):
            status, body = self.answer(self.call(site, "/collective_rpc", body=bad))
            self.assertEqual(status, code, body)
            self.assertIsInstance(body["error"]["message"], str)

    def test_level_0_pauses_only(self) -> None:
        """
        Level 0 pauses the scheduler only: asleep (no C{sleep_state} set,
        as vLLM records level 0), and any wake resumes it, a tag named
        included (vLLM's executor does not sleep at level 0; its
        C{v1/engine/core.py}, C{sleep} and C{wake_up}, and
        C{v1/metrics/loggers.py}, C{record_sleep_state}).
        """
        _, site = self.make()
        self.call(site, "/sleep?level=0")
        self.clock.advance(2)
        self.assertEqual(self.sleep_state(site), (True, ""))
        conn = self.call(site, "/wake_up?tags=scheduling")
        self.clock.advance(0)
        self.assertEqual(self.answer(conn)[1]["status"], "awake")
        self.assertEqual(self.sleep_state(site), (False, "awake"))

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
