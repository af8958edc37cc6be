"""
An engine's usage counts that are no counts, end to end: C{twistd -n
llmgw-server} in front of a fake engine (tests/fake_upstream.py) that
answers with the counts a request names.  A broken tester's engine said
10**30 tokens (the usage writer then failed on every batch, keeping
records it could never write, for the rest of the server's life) and -5
(a 500 cut short and no record at all): neither is believed.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http
from tests.test_e2e_router import client

BAD_COUNTS: tuple[dict[str, Any], ...] = (
    {"prompt_tokens": 10**30, "completion_tokens": 10**30},
    {"prompt_tokens": 7, "completion_tokens": -5},
    {"prompt_tokens": -7, "completion_tokens": 3},
    {"prompt_tokens": 2.5, "completion_tokens": 3},
    {"prompt_tokens": "7", "completion_tokens": True},
)


class EngineCountsTests(SynchronousTestCase, Processes):
    timeout = 60

    def usage_rows(self) -> list[tuple[int, int, int, int]]:
        """
        @return: C{(status, prompt, completion, estimated)} of each usage
            row the stopped server wrote, in time order.
        """
        path = os.path.join(self._directory(), "server-state", "llmgw.db")
        with sqlite3.connect(path) as db:
            return db.execute(
                "SELECT status, prompt_tokens, completion_tokens, estimated"
                " FROM usage ORDER BY time"
            ).fetchall()

    def test_counts_not_believed_and_nothing_lost(self) -> None:
        """
        Each bad count, whole and streamed, is answered 200 and recorded as
        estimated; a good count after them is recorded as the engine's; and
        every record reaches the store (ten bad, two good), none held back.
        """
        from tests.fake_upstream import FakeUpstream

        fake = FakeUpstream()
        self.addCleanup(fake.stop)
        server, url, _ = self.start_server(
            "--endpoint", f"fake={fake.url}=m", state="server-state"
        )
        gateway = client(url)
        messages: Any = [{"role": "user", "content": "hello there"}]
        for usage in (*BAD_COUNTS, {"prompt_tokens": 4, "completion_tokens": 2}):
            for stream in (False, True):
                answer: Any = gateway.chat.completions.create(
                    model="m",
                    messages=messages,
                    stream=stream,
                    extra_body={"mode": "usage", "usage": usage},
                )
                if stream:
                    self.assertTrue(list(answer))
                else:
                    self.assertEqual(answer.choices[0].message.content, "ok")
        server.stop()
        rows = self.usage_rows()
        self.assertEqual(len(rows), 2 * len(BAD_COUNTS) + 2, rows)
        for status, prompt, completion, estimated in rows[:-2]:
            self.assertEqual(status, 200)
            self.assertTrue(estimated)
            self.assertTrue(0 <= prompt < 1000 and 0 <= completion < 1000, rows)
        self.assertEqual([r[1:] for r in rows[-2:]], [(4, 2, 0), (4, 2, 0)])
        self.assertNotIn("cannot write", server.output())
        self.assertNotIn("Traceback", server.output())

    def test_pooling_counts_believed(self) -> None:
        """
        A pooling route's usage has no completion count: OpenAI's
        embeddings answer (C{prompt_tokens}, C{total_tokens}, as
        llama.cpp sends it) and vLLM's rerank answer name none.  Their
        prompt count is recorded as the engine's, with no completion;
        a chat answer without a completion count is still estimated,
        and a pooling answer with a bad count too.
        """
        from tests.fake_upstream import FakeUpstream

        fake = FakeUpstream()
        self.addCleanup(fake.stop)
        server, url, _ = self.start_server(
            "--endpoint", f"fake={fake.url}=m", state="server-state"
        )
        gateway = client(url)
        pooled = {"prompt_tokens": 6, "total_tokens": 6}
        embedded = gateway.embeddings.create(
            model="m", input="hello", extra_body={"mode": "usage", "usage": pooled}
        )
        self.assertEqual(embedded.usage.prompt_tokens, 6)
        status, _, _ = http(
            "POST",
            url + "/v1/rerank",
            json.dumps(
                {
                    "model": "m",
                    "query": "q",
                    "documents": ["a", "b"],
                    "mode": "usage",
                    "usage": {"prompt_tokens": 9, "total_tokens": 9},
                }
            ).encode(),
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 200)
        gateway.embeddings.create(
            model="m",
            input="hello",
            extra_body={"mode": "usage", "usage": {"prompt_tokens": -1}},
        )
        gateway.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hello there"}],
            extra_body={"mode": "usage", "usage": pooled},
        )
        server.stop()
        rows = self.usage_rows()
        self.assertEqual(rows[:2], [(200, 6, 0, 0), (200, 9, 0, 0)])
        self.assertEqual([(r[0], r[3]) for r in rows[2:]], [(200, 1), (200, 1)])
