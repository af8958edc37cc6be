"""
The Responses API's stored responses end to end: C{twistd -n
llmgw-server} with API keys made by C{llmgw ctl}, read, listed and deleted
with the official C{openai} client (C{responses.retrieve},
C{responses.input_items.list}, C{responses.delete}); another key gets 404;
the response is still there after the server restarts on its SQLite file,
one past C{[store] responses_retention} is deleted by the server's job;
and the same on a PostgreSQL store, through the server and through a
C{twistd llmgw-router} on the same database.

A response is put in the store with the store's own statement
(L{llmgw.store.responses}), with chosen items and times; another is made
with C{responses.create} and continued with C{previous_response_id}.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import TYPE_CHECKING, Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from llmgw.store.responses import StoredResponse, put_response_sql, response_values
from tests.pg_support import fresh_database
from tests.support import TWISTD, Processes, spawn
from tests.test_e2e_store import _Ctl

INPUT: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer in one word."},
    {"type": "message", "role": "user", "content": "Say hello"},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "shell",
        "arguments": '{"command": "echo hi"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "hi"},
]


def _stored(rid: str, key_id: int, created: float) -> StoredResponse:
    output = [
        {
            "type": "message",
            "id": "msg_out",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
        }
    ]
    response = {
        "id": rid,
        "object": "response",
        "created_at": int(created),
        "model": "sim-model",
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 9,
            "output_tokens": 1,
            "total_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
    return StoredResponse(
        rid, key_id, "sim-model", created, None, INPUT, output, response
    )


if TYPE_CHECKING:

    class _Base(SynchronousTestCase, Processes):
        pass

else:
    _Base = Processes


class _StoredResponses(_Base, _Ctl):
    """
    The checks, on whichever store the subclass starts the server with.
    """

    url: str

    def put(self, row: StoredResponse) -> None:
        raise NotImplementedError

    def keys(self) -> tuple[tuple[int, str], tuple[int, str]]:
        """
        @return: C{(id, secret)} of two keys made with C{llmgw ctl}.
        """
        alice = self.ctl_json("keys", "create", "--name", "alice")
        bob = self.ctl_json("keys", "create", "--name", "bob")
        return (alice["id"], alice["key"]), (bob["id"], bob["key"])

    def client(self, key: str, url: str | None = None) -> openai.OpenAI:
        base = (url or self.url) + "/v1"
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0)

    def check_own_only(
        self, rid: str, mine: str, other: str, url: str | None = None
    ) -> None:
        """
        C{mine} reads the response and pages through its input items;
        C{other} gets 404 for all three routes; through the client API at
        C{url} (by default the server's).
        """
        got = self.client(mine, url).responses.retrieve(rid)
        self.assertEqual(
            (got.id, got.status, got.output_text), (rid, "completed", "Hello")
        )
        assert got.usage is not None
        self.assertEqual(got.usage.total_tokens, 10)
        items = list(
            self.client(mine, url).responses.input_items.list(rid, limit=3, order="asc")
        )
        self.assertEqual(
            [(i.type, i.id) for i in items],
            [
                ("message", f"msg_{rid[5:]}_0"),
                ("message", f"msg_{rid[5:]}_1"),
                ("function_call", "fc_1"),
                ("function_call_output", f"item_{rid[5:]}_3"),
            ],
        )
        newest = self.client(mine, url).responses.input_items.list(rid, limit=1)
        self.assertEqual(
            ([i.id for i in newest.data], newest.has_more),
            ([f"item_{rid[5:]}_3"], True),
        )
        for call in (
            lambda c: c.responses.retrieve(rid),
            lambda c: c.responses.input_items.list(rid),
            lambda c: c.responses.delete(rid),
        ):
            with self.assertRaises(openai.NotFoundError) as refused:
                call(self.client(other, url))
            self.assertEqual(refused.exception.param, "response_id")
            self.assertIn(rid, refused.exception.message)


class SQLiteStoredResponsesTests(_StoredResponses, SynchronousTestCase):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim_url = self.start_sim("--max-tokens", "3")
        self.start()

    def start(self) -> None:
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={self.sim_url}=sim-model",
            config='[store]\nresponses_retention = "1h"\n',
            state="server-state",
        )

    def put(self, row: StoredResponse) -> None:
        path = os.path.join(self._directory(), "server-state", "llmgw.db")
        with sqlite3.connect(path, timeout=10) as connection:
            connection.execute(put_response_sql("?"), response_values(row))
        connection.close()

    def created(self, key: str) -> tuple[str, str]:
        """
        A response made with C{responses.create}, continued once with
        C{previous_response_id}.

        @return: the continuation's id and its text.
        """
        first = self.client(key).responses.create(model="sim-model", input="Say hello")
        second = self.client(key).responses.create(
            model="sim-model", input="Again", previous_response_id=first.id
        )
        return second.id, second.output_text

    def check_created(self, rid: str, text: str, mine: str, other: str) -> None:
        """
        C{mine} reads the continuation as it was returned, and lists the
        three input items the model saw (the first request's, its answer,
        the second's), newest first; C{other} gets 404.
        """
        got = self.client(mine).responses.retrieve(rid)
        self.assertEqual((got.id, got.output_text), (rid, text))
        items = list(self.client(mine).responses.input_items.list(rid))
        self.assertEqual(
            [(i.type, getattr(i, "role", None)) for i in items],
            [("message", "user"), ("message", "assistant"), ("message", "user")],
        )
        with self.assertRaises(openai.NotFoundError):
            self.client(other).responses.retrieve(rid)

    def test_own_key_across_restart(self) -> None:
        """
        A stored response (one put in the store, and one made with
        C{responses.create} continuing another) is read and listed by its
        key, 404 for another; after a restart both are still there (and
        one made two hours ago, past the retention, is deleted by the job
        at start); its key deletes it, after which it is unknown.
        """
        (alice_id, alice), (_, bob) = self.keys()
        now = time.time()
        self.put(_stored("resp_kept", alice_id, now))
        self.check_own_only("resp_kept", alice, bob)
        made, text = self.created(alice)
        self.check_created(made, text, alice, bob)

        self.server.stop()
        self.put(_stored("resp_old", alice_id, now - 7200))
        self.start()
        self.server.wait_for("responses retention: deleted 1 stored responses")
        self.check_own_only("resp_kept", alice, bob)
        self.check_created(made, text, alice, bob)
        with self.assertRaises(openai.NotFoundError):
            self.client(alice).responses.retrieve("resp_old")

        # Answered 200 (the client returns nothing; an error raises).
        self.client(alice).responses.delete("resp_kept")
        with self.assertRaises(openai.NotFoundError):
            self.client(alice).responses.retrieve("resp_kept")
        with self.assertRaises(openai.NotFoundError):
            self.client(alice).responses.delete("resp_kept")


class PostgresStoredResponsesTests(_StoredResponses, SynchronousTestCase):
    timeout = 120

    def setUp(self) -> None:
        self.db = fresh_database(self)
        _, sim_url = self.start_sim("--max-tokens", "3")
        _, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={sim_url}=sim-model",
            config=f'[store]\nurl = "{self.db}"\n',
        )

    def put(self, row: StoredResponse) -> None:
        import psycopg

        with psycopg.connect(self.db, autocommit=True) as connection:
            connection.execute(put_response_sql("%s").encode(), response_values(row))

    def start_router(self) -> str:
        """
        @return: the client API of a C{twistd llmgw-router} on the same
            database, following the server.
        """
        directory = self._directory()
        path = f"{directory}/router.toml"
        with open(path, "w") as f:
            f.write(f'[store]\nurl = "{self.db}"\n')
        process = spawn(
            [TWISTD, "-n", "--pidfile=", "llmgw-router", "--config", path]
            + ["--listen", "tcp:0:interface=127.0.0.1", "--control", self.admin_url],
            directory,
            f"router-{time.monotonic_ns()}",
        )
        self.addCleanup(process.stop)
        match = process.wait_for(r"llmgw-router: client API listening on [\d.]+:(\d+)")
        process.wait_for("store: listening for key changes")
        return f"http://127.0.0.1:{match.group(1)}"

    def test_own_key(self) -> None:
        """
        On PostgreSQL: read and listed by its key, 404 for another, through
        the server and through a C{twistd llmgw-router} on the same
        database; deleted by its key.
        """
        (alice_id, alice), (_, bob) = self.keys()
        self.put(_stored("resp_pg", alice_id, time.time()))
        self.check_own_only("resp_pg", alice, bob)
        self.check_own_only("resp_pg", alice, bob, self.start_router())
        # Answered 200 (the client returns nothing; an error raises).
        self.client(alice).responses.delete("resp_pg")
        with self.assertRaises(openai.NotFoundError):
            self.client(alice).responses.retrieve("resp_pg")
