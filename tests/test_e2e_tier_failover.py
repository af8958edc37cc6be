"""
Routers across a failover of the control plane, for real (issue 12's
Done-when): two C{twistd llmgw-server} on one throwaway PostgreSQL, one
agent knowing both, a model with a ready replica, and C{twistd
llmgw-router} processes given both admin APIs with C{--control}; clients
send requests through the routers all along while the leading server is
killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import TWISTD, Process, http, spawn
from tests.test_e2e_standby import Pair
from tests.test_e2e_tier import EXTRA, FOLLOWING, _endpoint_counts


class _Clients:
    """
    Threads sending chat requests through the routers in turn until
    stopped; each request's outcome counted.
    """

    def __init__(self, urls: list[str], threads: int = 2) -> None:
        self.clients = [
            openai.OpenAI(base_url=u + "/v1", api_key="k", max_retries=0, timeout=30)
            for u in urls
        ]
        self.ok = 0
        self.failures: list[str] = []
        self.slowest = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, offset: int) -> None:
        turn = offset
        # Bounded: at most 2,000 requests a thread.
        for _ in range(2000):
            if self._stop.is_set():
                return
            client = self.clients[turn % len(self.clients)]
            turn += 1
            started = time.monotonic()
            try:
                client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=2,
                )
            except openai.OpenAIError as e:
                with self._lock:
                    self.failures.append(f"{type(e).__name__}: {e}"[:300])
            else:
                with self._lock:
                    self.ok += 1
                    self.slowest = max(self.slowest, time.monotonic() - started)
            time.sleep(0.02)


class TierFailoverTests(Pair, SynchronousTestCase):
    timeout = 170

    def start_router(self, config: str, controls: list[str]) -> tuple[Process, str]:
        directory = self._directory()
        path = os.path.join(directory, f"router-{time.monotonic_ns()}.toml")
        with open(path, "w") as f:
            f.write(config)
        argv = [TWISTD, "-n", "--pidfile=", "llmgw-router", "--config", path]
        argv += ["--listen", "tcp:0:interface=127.0.0.1"]
        # One repeated flag and one comma list: both spellings.
        argv += ["--control", controls[0], "--control", ",".join(controls[1:])]
        process = spawn(argv, directory, f"router-{time.monotonic_ns()}")
        self.addCleanup(process.stop)
        match = process.wait_for(r"llmgw-router: client API listening on [\d.]+:(\d+)")
        return process, f"http://127.0.0.1:{match.group(1)}"

    def test_routers_follow_the_new_leader(self) -> None:
        """
        Routers given the standby's URL first skip it (its watch answers
        503 naming the leader) and follow the leader; the leader is
        killed: the standby leads within C{lost_after} (6 s), adopts the
        engine (same pid, nothing placed), the routers keep serving the
        endpoint they had while no control plane answers, then take the
        new leader's state; no request through them fails; an activation
        through a router after the failover reaches the new leader.
        """
        config = self.standby_config(replicas=1)
        first = self.start_one(0, config)
        first[0].wait_for("leading: holds the leader lock")
        second = self.start_one(1, config)
        second[0].wait_for("standby: leader chosen")
        self.start_pair_agent("gpu-01")
        self.use(*first)
        pids = [r["shards"][0]["pid"] for r in self.ready(1)]
        routers = [self.start_router(config, [second[2], first[2]]) for _ in range(3)]
        for process, _ in routers:
            process.wait_for(FOLLOWING.pattern)
            self.assertEqual(_endpoint_counts(process), [1])
            self.assertIn(
                "refused the watch: HTTP 503 (a standby; the leader is 127.0.0.1:",
                process.output(),
            )
        clients = _Clients([url for _, url in routers])
        clients.start()
        try:
            time.sleep(1.0)
            before = clients.ok
            seen = [len(_endpoint_counts(p)) for p, _ in routers]
            first[0].popen.send_signal(signal.SIGKILL)
            first[0].popen.wait(10)
            killed = time.monotonic()
            second[0].wait_for("leading: holds the leader lock", 15)
            leads = time.monotonic() - killed

            def followed() -> bool:
                return all(
                    len(_endpoint_counts(p)) > n
                    for (p, _), n in zip(routers, seen, strict=True)
                )

            self.until(followed, 30, "every router following the new leader")
            follows = time.monotonic() - killed
            time.sleep(1.0)
        finally:
            clients.stop()
        self.assertEqual(clients.failures, [])
        self.assertGreater(clients.ok - before, 10)
        self.assertLess(leads, 6)
        for process, _ in routers:
            # Its endpoint kept while no control plane answered.
            self.assertNotIn(0, _endpoint_counts(process))
        self.use(*second)
        self.assertEqual([r["shards"][0]["pid"] for r in self.ready(1)], pids)
        self.assertNotIn("placed replica", second[0].output())

        # An activation through a router goes to the new leader.
        status, _, body = http(
            "POST", second[2] + "/api/v1/models", json.dumps(EXTRA).encode()
        )
        self.assertEqual(status, 201, body)
        client = openai.OpenAI(
            base_url=routers[0][1] + "/v1", api_key="k", max_retries=0, timeout=60
        )
        self.until(
            lambda: "extra" in [m.id for m in client.models.list().data],
            5,
            "the new model on the router",
        )
        answer = client.chat.completions.create(
            model="extra", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        self.assertTrue(answer.choices)
        print(
            f"\ntier failover: leads {leads:.2f}s, routers follow {follows:.2f}s"
            f" after the SIGKILL; {clients.ok} requests ok ({clients.ok - before}"
            f" from the kill on), {len(clients.failures)} failed, slowest"
            f" {clients.slowest:.2f}s"
        )
