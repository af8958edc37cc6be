"""
Outages logged once: a running C{twistd -n llmgw-server --router-workers 2}
whose shared limits live in a real Redis (L{tests.redis_support}) that is
stopped mid-test and started again on the same port; however many requests
meet the outage, each router process says once that Redis is away and once
that it is back.
"""

from __future__ import annotations

import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import PostgresServer, require_postgres
from tests.redis_support import RedisServer, require_redis
from tests.support import TWISTD, Processes, free_port, spawn
from tests.test_e2e_store import CHAT, _Ctl
from tests.test_e2e_tier import FOLLOWING

AWAY = "limits: Redis cannot be reached"
BACK = "limits: Redis reached again"


class RedisOutageTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 180

    def test_redis_outage_logged_once(self) -> None:
        """
        20 requests of a limited key with Redis stopped: all served (each
        router its share), one warning per router process (two workers,
        not twenty lines) and no per-request line; Redis started again:
        one line per router process that it is back.
        """
        redis = RedisServer(require_redis())
        self.addCleanup(redis.stop)
        redis.start()
        _, sim = self.start_sim("--max-tokens", "3")
        self.server, url, self.admin_url = self.start_server(
            "--router-workers",
            "2",
            "--endpoint",
            f"sim-0={sim}=sim-model",
            config=f'[limits]\nurl = "{redis.url}"\n',
        )
        self.server.wait_for(r"router worker 2 started")
        self.server.wait_for(
            r"(?s)following the control plane.*following the control", 60
        )
        key = self.ctl_json("keys", "create", "--name", "app", "--rpm", "1000")["key"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

        def ask(count: int) -> None:
            for _ in range(count):
                deadline = time.monotonic() + 10
                while True:
                    try:
                        client.chat.completions.create(model="sim-model", messages=CHAT)
                        break
                    except openai.AuthenticationError:
                        # A worker that has not learnt the new key yet.
                        self.assertLess(time.monotonic(), deadline)
                        time.sleep(0.2)

        ask(6)
        self.assertNotIn(AWAY, self.server.output())

        redis.halt()
        ask(20)
        time.sleep(1)
        output = self.server.output()
        away = output.count(AWAY)
        self.assertGreaterEqual(away, 1, output[-3000:])
        self.assertLessEqual(away, 2, output[-3000:])
        self.assertNotIn("cannot count", output)
        lines = [line for line in output.splitlines() if "Redis" in line]
        self.assertEqual(len(lines), away, "\n".join(lines))

        redis.start()
        deadline = time.monotonic() + 30
        while self.server.output().count(BACK) < away:
            self.assertLess(time.monotonic(), deadline, self.server.output()[-3000:])
            ask(2)
        ask(10)
        output = self.server.output()
        self.assertEqual(output.count(BACK), away, output[-3000:])
        self.assertEqual(output.count(AWAY), away, output[-3000:])


class PostgresOutageTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 240

    def test_postgres_outage_logged_once(self) -> None:
        """
        An C{llmgw-router} on a PostgreSQL of the test's own, stopped for
        8 s while 20 requests of a key go through it (usage flushed every
        0.5 s, the key events' listener reconnecting, the connection pool
        reconnecting): about the store, the router logs one warning from
        the usage writer and one from the key events, and nothing else
        (before: the pool's own warnings at each reconnection attempt);
        PostgreSQL back, one line each that it is, and the outage's usage
        is written.  (The server, leading on the same PostgreSQL, stops by
        design when it loses its lock: exit 75, docs/standby.md.)
        """
        pg = PostgresServer(require_postgres())
        self.addCleanup(pg.stop)
        pg.start()
        db = pg.create_database("llmgw")
        _, sim = self.start_sim("--max-tokens", "3")
        config = f'[store]\nurl = "{db}"\nflush_interval = "0.5s"\n'
        server, _, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim}=sim-model", config=config
        )
        server.wait_for("store: listening for key changes")
        directory = self._directory()
        path = f"{directory}/router.toml"
        with open(path, "w") as f:
            f.write(config)
        router = spawn(
            [TWISTD, "-n", "--pidfile=", "llmgw-router", "--config", path]
            + ["--listen", "tcp:0:interface=127.0.0.1", "--control", self.admin_url],
            directory,
            "router",
        )
        self.addCleanup(router.stop)
        match = router.wait_for(r"llmgw-router: client API listening on [\d.]+:(\d+)")
        router.wait_for("store: listening for key changes")
        router.wait_for(FOLLOWING.pattern)
        key = self.ctl_json("keys", "create", "--name", "app", "--rpm", "1000")["key"]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{match.group(1)}/v1",
            api_key=key,
            max_retries=0,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                client.chat.completions.create(model="sim-model", messages=CHAT)
                break
            except openai.AuthenticationError:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.2)
        time.sleep(1)
        before = len(router.output())

        pg.halt()
        for _ in range(20):
            client.chat.completions.create(model="sim-model", messages=CHAT)
            time.sleep(0.2)
        time.sleep(4)
        during = router.output()[before:]
        pg.resume()
        router.wait_for(r"usage: the store is writable again", 30)
        deadline = time.monotonic() + 30
        while router.output().count("store: listening for key changes") < 2:
            self.assertLess(time.monotonic(), deadline, router.output()[-3000:])
            time.sleep(0.2)
        time.sleep(1)
        after = router.output()[before:]
        store_lines = [
            line
            for line in during.splitlines()
            if any(
                word in line
                for word in ("store", "usage:", "keys:", "psycopg", "pool", "stderr")
            )
        ]
        self.assertEqual(len(store_lines), 2, "\n".join(store_lines))
        self.assertEqual(after.count("usage: cannot write to the store"), 1, after)
        self.assertEqual(after.count("store: key changes:"), 1, after)
        self.assertEqual(after.count("writable again"), 1, after)
        self.assertNotIn("stderr", after)


class EngineMetricsOutageTests(SynchronousTestCase, Processes):
    timeout = 120

    def test_engine_metrics_outage_logged_once(self) -> None:
        """
        One of two engines killed (its C{/metrics} polled every 0.1 s) while
        20 requests go on: one warning that its load cannot be read, not
        one per poll or per request; started again on the same port: one
        line that its load is readable again.
        """
        port = free_port()
        a, _ = self.start_sim("--port", str(port), model="m")
        _, b = self.start_sim(model="m")
        config = (
            '[router]\nload_poll_interval = "100ms"\n'
            f'[[endpoints]]\nid = "a"\nurl = "http://127.0.0.1:{port}"\n'
            'models = ["m"]\n'
            f'[[endpoints]]\nid = "b"\nurl = "{b}"\nmodels = ["m"]\n'
        )
        server, api, _ = self.start_server(config=config)
        client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
        for _ in range(4):
            client.chat.completions.create(model="m", messages=CHAT)
        time.sleep(0.5)
        self.assertNotIn("cannot read engine load", server.output())

        a.popen.kill()
        a.popen.wait(10)
        for _ in range(20):
            try:
                client.chat.completions.create(model="m", messages=CHAT)
            except openai.APIError:
                pass  # the one sent to a before it is ejected
            time.sleep(0.1)
        time.sleep(2)  # twenty polls more
        self.assertEqual(server.output().count("replica a: cannot read engine load"), 1)

        self.start_sim("--port", str(port), model="m")
        server.wait_for("replica a: engine load readable again", 30)
        time.sleep(1)
        output = server.output()
        self.assertEqual(output.count("replica a: cannot read engine load"), 1, output)
        self.assertEqual(output.count("replica a: engine load readable again"), 1)
