"""
The store on PostgreSQL end to end: two C{twistd -n llmgw-server}
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
from tests.support import Processes
from tests.test_e2e_store import CHAT, _Ctl


class TwoServersOnePostgresTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def setUp(self) -> None:
        self.db = fresh_database(self)
        _, sim_url = self.start_sim("--max-tokens", "7")
        config = f'[store]\nurl = "{self.db}"\nflush_interval = "1h"\n'
        self.endpoint = endpoint = f"sim-0={sim_url}=sim-model"
        self.servers = [
            self.start_server("--endpoint", endpoint, config=config) for _ in range(2)
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
        second within 1 s; revoked on the first, the second refuses it
        within 1 s.
        """
        key = self.ctl_json("keys", "create", "--name", "app")["key"]
        other = self.client(1, key)
        # Made on the first server: the second knows it (the key ring
        # learns it on the notification), without a restart.
        deadline = time.monotonic() + 1.0
        while True:
            try:
                other.models.list()
                break
            except openai.AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.ctl("keys", "revoke", "app")
        revoked = time.monotonic()
        while True:
            try:
                other.models.list()
            except openai.AuthenticationError:
                break
            self.assertLess(time.monotonic() - revoked, 1.0)
            time.sleep(0.01)
        self.assertIn("keys: key 1 revoked elsewhere", self.servers[1][0].output())

    def test_usage_of_both_in_one_database(self) -> None:
        """
        Ten requests through each server: after both stop (SIGTERM writes
        what is buffered), the first, started again on the same database,
        reports 20 requests and the engine's token counts exactly.
        """
        key = self.ctl_json("keys", "create", "--name", "meter")["key"]
        time.sleep(0.5)  # the second server learns the key
        prompt = completion = 0
        for index in (0, 1):
            client = self.client(index, key)
            for _ in range(10):
                answer = client.chat.completions.create(
                    model="sim-model", messages=CHAT
                )
                assert answer.usage is not None
                prompt += answer.usage.prompt_tokens
                completion += answer.usage.completion_tokens
        self.assertEqual(completion, 20 * 7)
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
            ("meter", 20, prompt, completion),
        )
        (listed,) = self.ctl_json("keys", "list")["keys"]
        self.assertEqual(listed["tokens_used"], prompt + completion)
