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

from tests.redis_support import RedisServer, require_redis
from tests.support import Processes
from tests.test_e2e_store import CHAT, _Ctl

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
