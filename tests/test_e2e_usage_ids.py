"""
Usage rows keyed by llmgw's own request id, end to end: C{twistd -n
llmgw-server} with its store on SQLite and on a real PostgreSQL
(L{tests.pg_support}), the sim engine as its replica, the official
C{openai} client sending two requests with one C{X-Request-ID} (a retry,
or two agents reusing an id).  Both are answered and both are billed: two
rows, each with its tokens and the client's id beside llmgw's own.
"""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING, Any

import openai
import psycopg
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import fresh_database
from tests.support import CtlMixin, Processes

if TYPE_CHECKING:
    _Base = SynchronousTestCase
else:
    _Base = object

CLIENT_ID = "agent-retry-1"


class _SameClientId(Processes, CtlMixin, _Base):
    """
    The test; a subclass gives the store and reads its rows.
    """

    timeout = 60

    def store_config(self) -> str:
        """
        @return: the C{[store]} table's lines for the server.
        """
        raise NotImplementedError

    def rows(self) -> list[tuple[Any, ...]]:
        """
        @return: C{(request_id, client_request_id, prompt_tokens,
            completion_tokens)} of each usage row, oldest first.
        """
        raise NotImplementedError

    def test_two_requests_one_client_id(self) -> None:
        """
        Two requests with one X-Request-ID: each answer carries it back,
        and the store holds two rows, each with its own llmgw id, the
        client's id and the engine's token counts; the usage report counts
        both.
        """
        _, sim_url = self.start_sim("--max-tokens", "5")
        _, url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={sim_url}=sim-model",
            config="[store]\n" + self.store_config(),
            state="server-state",
        )
        key = self.ctl_json("keys", "create", "--name", "agents")["key"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        answers = []
        for words in ("one two", "three four five six"):
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model",
                messages=[{"role": "user", "content": words}],
                extra_headers={"X-Request-ID": CLIENT_ID},
            )
            self.assertEqual(raw.headers["x-request-id"], CLIENT_ID)
            usage = raw.parse().usage
            assert usage is not None
            answers.append((usage.prompt_tokens, usage.completion_tokens))
        # The report flushes what the server buffered before reading.
        (group,) = self.ctl_json("usage", "--by", "key")["usage"]
        self.assertEqual(
            (group["requests"], group["prompt_tokens"], group["completion_tokens"]),
            (2, sum(p for p, _ in answers), sum(c for _, c in answers)),
        )
        rows = self.rows()
        self.assertEqual(
            [(client_id, p, c) for _, client_id, p, c in rows],
            [(CLIENT_ID, p, c) for p, c in answers],
        )
        own = [request_id for request_id, _, _, _ in rows]
        self.assertEqual(len(set(own)), 2)
        for request_id in own:
            self.assertRegex(request_id, r"^[0-9a-f]{32}$")


class SQLiteTests(_SameClientId, SynchronousTestCase):
    def store_config(self) -> str:
        return ""

    def rows(self) -> list[tuple[Any, ...]]:
        path = os.path.join(self._directory(), "server-state", "llmgw.db")
        with sqlite3.connect(path) as db:
            return db.execute(
                "SELECT request_id, client_request_id, prompt_tokens,"
                " completion_tokens FROM usage ORDER BY time"
            ).fetchall()


class PostgresTests(_SameClientId, SynchronousTestCase):
    def store_config(self) -> str:
        self.url = fresh_database(self)
        return f'url = "{self.url}"\n'

    def rows(self) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url) as db:
            return db.execute(
                "SELECT request_id, client_request_id, prompt_tokens,"
                " completion_tokens FROM usage ORDER BY time"
            ).fetchall()
