"""
Limits across routers end to end: three C{twistd -n llmgw-server} processes
on one real PostgreSQL (L{tests.pg_support}), the sim engine as their
replica, a key made with C{llmgw ctl}, hit through both at once with the
official C{openai} client.  With C{[limits] url} naming a real Redis
(L{tests.redis_support}) the key's rpm holds for both together, exactly;
without it, with C{[limits] routers = 2}, each admits its half.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import fresh_database
from tests.redis_support import start_redis
from tests.support import Processes, until_known
from tests.test_e2e_store import CHAT, _Ctl


class LimitsAcrossServersTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def start(self, limits: str) -> None:
        db = fresh_database(self)
        _, sim_url = self.start_sim("--max-tokens", "3")
        config = f'[store]\nurl = "{db}"\n[limits]\n{limits}\n'
        self.servers = [
            self.start_server("--endpoint", f"sim-0={sim_url}=sim-model", config=config)
            for _ in range(3)
        ]
        for server, _, _ in self.servers:
            server.wait_for("store: listening for key changes")
        self.admin_url = self.servers[0][2]

    def hammer(self, rpm: int, requests: int) -> list[str]:
        """
        A key with C{rpm}, then C{requests} at once, taking the servers
        in turn.

        @return: per request, C{"ok"}, C{"429"} or the error's name.
        """
        key = self.ctl_json("keys", "create", "--name", "app", "--rpm", str(rpm))["key"]
        until_known([url for _, url, _ in self.servers], key)
        clients = [
            openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            for _, url, _ in self.servers
        ]

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

        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(one, range(requests)))

    def test_redis_exactly_rpm(self) -> None:
        """
        rpm = 60, 150 requests at once through three servers sharing
        Redis: exactly 60 admitted.
        """
        self.start(f'url = "{start_redis(self)}"')
        results = self.hammer(60, 150)
        self.assertEqual((results.count("ok"), results.count("429")), (60, 90))

    def test_without_redis_each_its_share(self) -> None:
        """
        rpm = 60 shared by three routers without Redis: 20 each, 60 in
        all, when the requests reach all three alike.
        """
        self.start("routers = 3")
        results = self.hammer(60, 150)
        self.assertEqual((results.count("ok"), results.count("429")), (60, 90))
        by_server = [results[i::3].count("ok") for i in (0, 1, 2)]
        self.assertEqual(by_server, [20, 20, 20])
