"""
The store on PostgreSQL end to end: three C{twistd -n llmgw-server}
processes with C{[store] url} naming one real PostgreSQL database
(L{tests.pg_support}), the sim engine as their replica, driven by
C{llmgw ctl} and the official C{openai} client.  A key made on one works
on the other; revoked on one, it is refused by the other within 1 s; the
usage both write is in the one database, exactly the engine's counts.
"""

from __future__ import annotations

import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import fresh_database
from tests.support import Processes, until_known
from tests.test_e2e_store import CHAT, _Ctl


class ServersOnOnePostgresTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def setUp(self) -> None:
        self.db = fresh_database(self)
        _, sim_url = self.start_sim("--max-tokens", "7")
        config = f'[store]\nurl = "{self.db}"\nflush_interval = "1h"\n'
        self.endpoint = endpoint = f"sim-0={sim_url}=sim-model"
        self.servers = [
            self.start_server("--endpoint", endpoint, config=config) for _ in range(3)
        ]
        for server, _, _ in self.servers:
            server.wait_for("store: listening for key changes")
        self.admin_url = self.servers[0][2]

    def client(self, index: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.servers[index][1] + "/v1", api_key=key, max_retries=0
        )

    def test_key_shared_then_revoked_within_a_second(self) -> None:
        """
        A key made with C{llmgw ctl} on the first server is taken by the
        other two within 1 s; revoked on the first, all three refuse it
        within 1 s.
        """
        key = self.ctl_json("keys", "create", "--name", "app")["key"]
        clients = [self.client(index, key) for index in range(3)]
        # Made on the first server: the others know it (their key rings
        # learn it on the notification), without a restart.
        until_known([url for _, url, _ in self.servers], key, seconds=1.0)
        self.ctl("keys", "revoke", "app")
        revoked = time.monotonic()
        waiting = list(clients)
        while waiting:
            for client in list(waiting):
                try:
                    client.models.list()
                except openai.AuthenticationError:
                    waiting.remove(client)
            self.assertLess(time.monotonic() - revoked, 1.0)
            time.sleep(0.01)
        for server, _, _ in self.servers[1:]:
            self.assertIn("keys: key 1 revoked elsewhere", server.output())

    def test_usage_of_all_in_one_database(self) -> None:
        """
        Ten requests through each server: after all stop (SIGTERM writes
        what is buffered), the first, started again on the same database,
        reports 30 requests and the engine's token counts exactly.
        """
        key = self.ctl_json("keys", "create", "--name", "meter")["key"]
        until_known([url for _, url, _ in self.servers], key)
        prompt = completion = 0
        for index in range(3):
            client = self.client(index, key)
            for _ in range(10):
                answer = client.chat.completions.create(
                    model="sim-model", messages=CHAT
                )
                assert answer.usage is not None
                prompt += answer.usage.prompt_tokens
                completion += answer.usage.completion_tokens
        self.assertEqual(completion, 30 * 7)
        for server, _, _ in self.servers:
            server.stop()
            self.assertIn("usage: 10 records written", server.output())
        _, _, self.admin_url = self.start_server(
            "--endpoint", self.endpoint, config=f'[store]\nurl = "{self.db}"\n'
        )
        (row,) = self.ctl_json("usage", "--by", "key")["usage"]
        self.assertEqual(
            (
                row["key"],
                row["requests"],
                row["prompt_tokens"],
                row["completion_tokens"],
            ),
            ("meter", 30, prompt, completion),
        )
        (listed,) = self.ctl_json("keys", "list")["keys"]
        self.assertEqual(listed["tokens_used"], prompt + completion)
