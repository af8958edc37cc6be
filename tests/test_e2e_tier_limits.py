"""
Three C{twistd llmgw-router} processes and one C{twistd llmgw-server} on a
real PostgreSQL and Redis (issue 12's Done-when): a key's rpm holds for
the three together, usage records equal the engine's token counts, a
C{kill -9} of one router loses at most its last C{[store]
flush_interval} of records and doubles none, and a revoked key is
refused by all three within 1 s.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import fresh_database
from tests.redis_support import start_redis
from tests.support import TWISTD, Process, Processes, http, spawn, until_known
from tests.test_e2e_store import CHAT, _Ctl
from tests.test_e2e_tier import FOLLOWING

FLUSH = 1.0
"""
The routers' C{[store] flush_interval}, seconds.
"""


def engine_tokens(sim_url: str) -> tuple[int, int]:
    """
    @return: the engine's prompt and generation token counters (its
        vLLM-named C{/metrics}).
    """
    _, _, body = http("GET", sim_url + "/metrics")
    text = body.decode()

    def total(name: str) -> int:
        found = re.findall(
            rf"^vllm:{name}_total(?:{{[^}}]*}})? ([\d.e+]+)$", text, re.M
        )
        return int(sum(float(v) for v in found))

    return total("prompt_tokens"), total("generation_tokens")


class TierLimitsTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 150

    def setUp(self) -> None:
        db = fresh_database(self)
        redis = start_redis(self)
        self.sim, self.sim_url = self.start_sim("--max-tokens", "3", "--itl", "0.03")
        self.config = (
            f'[store]\nurl = "{db}"\nflush_interval = "{FLUSH:g}s"\n'
            f'[limits]\nurl = "{redis}"\n'
        )
        server, _, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={self.sim_url}=sim-model", config=self.config
        )
        server.wait_for("store: listening for key changes")
        self.routers = [self.start_router() for _ in range(3)]

    def start_router(self) -> tuple[Process, str]:
        directory = self._directory()
        path = f"{directory}/router-{time.monotonic_ns()}.toml"
        with open(path, "w") as f:
            f.write(self.config)
        process = spawn(
            [TWISTD, "-n", "--pidfile=", "llmgw-router", "--config", path]
            + ["--listen", "tcp:0:interface=127.0.0.1", "--control", self.admin_url],
            directory,
            f"router-{time.monotonic_ns()}",
        )
        self.addCleanup(process.stop)
        match = process.wait_for(r"llmgw-router: client API listening on [\d.]+:(\d+)")
        process.wait_for("store: listening for key changes")
        process.wait_for(FOLLOWING.pattern)
        return process, f"http://127.0.0.1:{match.group(1)}"

    def key(self, name: str, *args: str) -> str:
        key: str = self.ctl_json("keys", "create", "--name", name, *args)["key"]
        until_known([url for _, url in self.routers], key)
        return key

    def client(self, router: int, key: str) -> openai.OpenAI:
        url = self.routers[router][1]
        return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

    def usage(self) -> dict[str, dict[str, Any]]:
        status, _, body = http("GET", self.admin_url + "/api/v1/usage?by=key")
        self.assertEqual(status, 200, body)
        return {g["key"]: g for g in json.loads(body)["usage"] if g["key"]}

    def settled(self, check: Any, seconds: float = 10.0) -> Any:
        deadline = time.monotonic() + seconds
        while True:
            value = check()
            if value is not None or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def test_rpm_and_usage_exact(self) -> None:
        """
        rpm = 60, 150 requests at once through the three routers: exactly
        60 admitted; the usage records' tokens equal the engine's
        counters exactly.
        """
        key = self.key("app", "--rpm", "60")
        clients = [self.client(i, key) for i in range(3)]

        def one(index: int) -> str:
            try:
                clients[index % 3].chat.completions.create(
                    model="sim-model", messages=CHAT
                )
                return "ok"
            except openai.RateLimitError:
                return "429"
            except openai.APIError as e:
                return type(e).__name__

        with ThreadPoolExecutor(30) as pool:
            results = list(pool.map(one, range(150)))
        self.assertEqual((results.count("ok"), results.count("429")), (60, 90))
        by_router = [results[i::3].count("ok") for i in (0, 1, 2)]
        self.assertTrue(all(by_router), by_router)
        prompt, generated = engine_tokens(self.sim_url)

        def recorded() -> dict[str, Any] | None:
            group = self.usage().get("app")
            if group and group["prompt_tokens"] == prompt:
                return group
            return None

        group = self.settled(recorded) or self.usage().get("app")
        self.assertIsNotNone(group)
        assert group is not None
        self.assertEqual(
            (group["prompt_tokens"], group["completion_tokens"]), (prompt, generated)
        )
        self.assertEqual(group["requests"] - group["errors"], 60)
        print(
            f"\ntier limits: 60/150 admitted across routers {by_router};"
            f" recorded {prompt}+{generated} tokens = the engine's"
        )

    def test_router_killed_records_kept(self) -> None:
        """
        Each router its own key; requests through all three all along; one
        router is killed with SIGKILL: the other two's records equal
        what their clients got exactly; the dead one's records are at most
        what its clients got (its requests in flight failed) and at least
        what finished C{FLUSH} seconds before the kill; none doubled.
        """
        keys = [self.key(f"r{i}") for i in range(3)]
        got: list[list[tuple[float, int, int]]] = [[], [], []]
        failed = [0, 0, 0]
        stop = threading.Event()

        def run(router: int) -> None:
            client = self.client(router, keys[router])
            for _ in range(1000):  # Bounded.
                if stop.is_set():
                    return
                try:
                    answer = client.chat.completions.create(
                        model="sim-model", messages=CHAT, timeout=10
                    )
                except openai.APIError:
                    failed[router] += 1
                    if router == 2:
                        return
                    continue
                usage = answer.usage
                assert usage is not None
                got[router].append(
                    (time.monotonic(), usage.prompt_tokens, usage.completion_tokens)
                )

        threads = [
            threading.Thread(target=run, args=(i,), daemon=True)
            for i in (0, 0, 1, 1, 2, 2)
        ]
        for thread in threads:
            thread.start()
        time.sleep(2.5)
        self.routers[2][0].popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join(30)

        def sums(router: int, before: float = float("inf")) -> tuple[int, int, int]:
            done = [g for g in got[router] if g[0] < before]
            return len(done), sum(g[1] for g in done), sum(g[2] for g in done)

        def recorded(name: str) -> tuple[int, int, int]:
            group = self.usage().get(name)
            if group is None:
                return 0, 0, 0
            return group["requests"], group["prompt_tokens"], group["completion_tokens"]

        for router in (0, 1):
            self.settled(lambda r=router: recorded(f"r{r}") == sums(r) or None)
            self.assertEqual(recorded(f"r{router}"), sums(router))
            self.assertEqual(failed[router], 0)
        dead = recorded("r2")
        self.assertLessEqual(dead, sums(2))
        self.assertGreaterEqual(dead, sums(2, killed - FLUSH - 0.2))
        self.assertGreater(dead[0], 0)
        print(
            f"\ntier kill -9: survivors recorded {sums(0)[0]}+{sums(1)[0]} requests"
            f" exactly; the killed router: {dead[0]} recorded of {sums(2)[0]}"
            f" answered ({sums(2, killed - FLUSH)[0]} finished over"
            f" {FLUSH:g} s before the kill), {failed[2]} in flight failed"
        )

    def test_revoked_everywhere_within_1s(self) -> None:
        """
        A key used through the three routers is revoked: each refuses it
        (401) within 1 s.
        """
        key = self.key("gone")
        clients = [self.client(i, key) for i in range(3)]
        for client in clients:
            client.chat.completions.create(model="sim-model", messages=CHAT)
        self.ctl("keys", "revoke", "gone")
        revoked = time.monotonic()
        refused: list[float] = []
        for client in clients:
            while True:
                try:
                    client.chat.completions.create(model="sim-model", messages=CHAT)
                except openai.AuthenticationError:
                    refused.append(time.monotonic() - revoked)
                    break
                self.assertLess(time.monotonic() - revoked, 1.0, "still admitted")
                time.sleep(0.02)
        self.assertLess(max(refused), 1.0)
        print(f"\ntier revocation: refused by all three within {max(refused):.3f}s")

    def test_changed_everywhere_within_1s(self) -> None:
        """
        A key's rpm, counted in Redis for the three routers, is lifted
        with keys update: each router admits it again within 1 s (before,
        each kept the rpm it had read and refused it for the minute).
        """
        key = self.key("changed", "--rpm", "2")
        clients = [self.client(i, key) for i in range(3)]
        refused = 0
        for client in clients:
            try:
                client.chat.completions.create(model="sim-model", messages=CHAT)
            except openai.RateLimitError:
                refused += 1
        self.assertEqual(refused, 1)
        self.ctl("keys", "update", "changed", "--rpm", "none")
        changed = time.monotonic()
        admitted: list[float] = []
        for client in clients:
            while True:
                try:
                    client.chat.completions.create(model="sim-model", messages=CHAT)
                except openai.RateLimitError:
                    self.assertLess(time.monotonic() - changed, 1.0, "still refused")
                    time.sleep(0.02)
                    continue
                admitted.append(time.monotonic() - changed)
                break
        self.assertLess(max(admitted), 1.0)
        print(f"\ntier key update: taken by all three within {max(admitted):.3f}s")
