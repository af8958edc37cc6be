"""
The Files and Batches APIs end to end: C{twistd -n llmgw-server} in front
of C{llmgw sim}, keys made by C{llmgw ctl}, through the official C{openai}
SDK (C{files.create}, C{list}, C{retrieve}, C{content}, C{delete};
C{batches.create}, C{retrieve}, C{list}, C{cancel}) and the official
C{anthropic} SDK (C{messages.batches}).  The lines are not sent here (the
runner does that): these tests read what the API keeps and answers.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from typing import Any

import anthropic
import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.pg_support import fresh_database
from tests.support import TWISTD, CtlMixin, Processes, http, spawn


def _line(n: int, **changes: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": f"req-{n}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"hello {n}"}],
        },
    }
    line.update(changes)
    return line


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines
    )


class BatchesThroughServerTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim = self.start_sim("--max-tokens", "3")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={self.sim}=sim-model",
            config="[batches]\nmax_file_size = 4096\nmax_lines = 20\n",
            state="server-state",
        )
        self.database = os.path.join(self._directory(), "server-state", "llmgw.db")
        self.key = self.make_key()
        self.other = self.make_key()
        self.narrow = self.make_key("--models", "sim-model")

    def make_key(self, *args: str) -> str:
        made = self.ctl("keys", "create", "--name", f"k{uuid.uuid4().hex[:6]}", *args)
        return made.stdout.splitlines()[0].strip()

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=key or self.key, max_retries=0
        )

    def upload(self, content: bytes, key: str | None = None) -> str:
        made = self.client(key).files.create(
            file=("in.jsonl", content), purpose="batch"
        )
        return made.id

    def test_files(self) -> None:
        """
        A file uploaded is listed, read back whole and deleted by its key;
        another key gets OpenAI's 404 for each; a purpose other than batch
        is a 400 naming it; a file over max_file_size is a 413.
        """
        client = self.client()
        content = _jsonl([_line(1), _line(2)])
        made = client.files.create(file=("in.jsonl", content), purpose="batch")
        self.assertTrue(made.id.startswith("file-"))
        self.assertEqual(
            (made.object, made.bytes, made.filename, made.purpose, made.status),
            ("file", len(content), "in.jsonl", "batch", "processed"),
        )
        second = client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
        listed = client.files.list()
        self.assertEqual([f.id for f in listed.data], [second.id, made.id])
        page = client.files.list(limit=1, order="asc")
        self.assertEqual([f.id for f in page.data], [made.id])
        self.assertEqual(
            [f.id for f in client.files.list(after=made.id, order="asc")], [second.id]
        )
        self.assertEqual(client.files.retrieve(made.id).filename, "in.jsonl")
        self.assertEqual(client.files.content(made.id).content, content)
        other = self.client(self.other)
        for call in (
            lambda: other.files.retrieve(made.id),
            lambda: other.files.content(made.id),
            lambda: other.files.delete(made.id),
        ):
            with self.assertRaises(openai.NotFoundError) as raised:
                call()
            body: Any = raised.exception.body
            self.assertEqual(body["message"], f"No such File object: {made.id}")
        self.assertEqual(other.files.list().data, [])
        with self.assertRaises(openai.BadRequestError) as bad:
            client.files.create(file=("a.jsonl", b"{}\n"), purpose="assistants")
        self.assertEqual(bad.exception.param, "purpose")
        # A form without purpose: OpenAI's missing-parameter 400.
        form = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n'
        status, _, answer = http(
            "POST",
            self.url + "/v1/files",
            form + b"\r\n{}\n\r\n--b--\r\n",
            {
                "authorization": f"Bearer {self.key}",
                "content-type": "multipart/form-data; boundary=b",
            },
        )
        self.assertEqual(status, 400)
        missing = json.loads(answer)["error"]
        self.assertEqual(
            (missing["message"], missing["param"]),
            ("Missing required parameter: 'purpose'.", "purpose"),
        )
        with self.assertRaises(openai.APIStatusError) as large:
            client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        self.assertEqual(large.exception.status_code, 413)
        self.assertIn("4096", large.exception.message)
        deleted = client.files.delete(made.id)
        self.assertEqual((deleted.id, deleted.deleted), (made.id, True))
        with self.assertRaises(openai.NotFoundError):
            client.files.retrieve(made.id)

    def test_batch_made_listed_cancelled(self) -> None:
        """
        A batch of good lines is in progress with its counts; another key
        cannot see it; it is listed newest first, cancelled (its pending
        lines with it) and a second cancel answers it as it is.
        """
        client = self.client()
        file_id = self.upload(_jsonl([_line(1), _line(2), _line(3)]))
        batch = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"run": "nightly"},
        )
        self.assertTrue(batch.id.startswith("batch_"))
        self.assertEqual((batch.status, batch.errors), ("in_progress", None))
        self.assertEqual(batch.metadata, {"run": "nightly"})
        assert batch.request_counts is not None
        self.assertEqual(batch.request_counts.total, 3)
        assert batch.expires_at is not None and batch.in_progress_at is not None
        self.assertEqual(batch.expires_at - batch.created_at, 86400)
        self.assertEqual(client.batches.retrieve(batch.id).id, batch.id)
        with self.assertRaises(openai.NotFoundError):
            self.client(self.other).batches.retrieve(batch.id)
        second = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        self.assertEqual(
            [b.id for b in client.batches.list().data], [second.id, batch.id]
        )
        self.assertEqual(
            [b.id for b in client.batches.list(after=second.id)], [batch.id]
        )
        cancelled = client.batches.cancel(batch.id)
        self.assertEqual(cancelled.status, "cancelling")
        self.assertIsNotNone(cancelled.cancelling_at)
        self.assertEqual(client.batches.cancel(batch.id).status, "cancelling")
        with self.assertRaises(openai.NotFoundError):
            self.client(self.other).batches.cancel(second.id)

    def test_bad_input(self) -> None:
        """
        A file with bad lines makes a failed batch whose errors name each
        bad line by number: not JSON, a model the key may not use, an
        unknown model, another endpoint, a custom_id used twice.  An empty
        file, one over max_lines, an unknown file and a bad endpoint are
        refused with a 400 naming the parameter.
        """
        content = _jsonl(
            [
                _line(1),
                b"{not json",
                _line(3, body={"model": "other-model", "messages": []}),
                _line(4, url="/v1/embeddings"),
                _line(1),
                _line(6, body={"model": "sim-model", "messages": [], "stream": True}),
            ]
        )
        narrow = self.client(self.narrow)
        batch = narrow.batches.create(
            input_file_id=self.upload(content, self.narrow),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        self.assertEqual(batch.status, "failed")
        self.assertIsNotNone(batch.failed_at)
        assert batch.errors is not None and batch.errors.data is not None
        found = [(e.line, e.code, e.param) for e in batch.errors.data]
        self.assertEqual(
            found,
            [
                (2, "invalid_json_line", None),
                (3, "model_not_allowed", "body.model"),
                (4, "mismatched_endpoint", "url"),
                (5, "duplicate_custom_id", "custom_id"),
                (6, "invalid_body", "body.stream"),
            ],
        )
        self.assertIn("other-model", batch.errors.data[1].message or "")
        unknown = self.client().batches.create(
            input_file_id=self.upload(_jsonl([_line(1, body={"model": "nope"})])),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert unknown.errors is not None and unknown.errors.data is not None
        self.assertEqual(
            [(e.line, e.code) for e in unknown.errors.data], [(1, "model_not_found")]
        )
        client = self.client()
        refused = [
            (self.upload(b""), "/v1/chat/completions", "input_file_id"),
            (
                self.upload(_jsonl([_line(n) for n in range(21)])),
                "/v1/chat/completions",
                "input_file_id",
            ),
            ("file-unknown", "/v1/chat/completions", "id"),
            (self.upload(_jsonl([_line(1)])), "/v1/moderations", "endpoint"),
        ]
        for file_id, endpoint, param in refused:
            with self.assertRaises(openai.APIStatusError) as raised:
                client.batches.create(
                    input_file_id=file_id,
                    endpoint=endpoint,  # type: ignore[arg-type]
                    completion_window="24h",
                )
            self.assertIn(raised.exception.status_code, (400, 404))
            body: Any = raised.exception.body
            self.assertEqual(body["param"], param, file_id)
        # A body nested past the parser's depth is a 400 in the API's own
        # format, on both APIs' create routes, not a traceback.
        deep = b"[" * 2000 + b"]" * 2000  # within max_file_size (4096)
        for path in ("/v1/batches", "/v1/messages/batches"):
            status, _, answer = http(
                "POST",
                self.url + path,
                deep,
                {"authorization": f"Bearer {self.key}", "x-api-key": self.key},
            )
            self.assertEqual(status, 400, path)
            self.assertIn(b"JSON object", answer)
        self.assertNotIn("RecursionError", self.server.output())

    def test_message_batches(self) -> None:
        """
        Anthropic's Message Batches through its SDK: made in progress with
        every request processing; a model the key may not use errors that
        request; listed, cancelled (canceling), and its results refused
        until it ends; a duplicate custom_id refuses the batch, naming it;
        another key gets a 404.
        """
        client = anthropic.Anthropic(
            base_url=self.url, api_key=self.narrow, max_retries=0
        )
        params: Any = {
            "model": "sim-model",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
        }
        other_model: Any = {**params, "model": "other-model"}
        batch = client.messages.batches.create(
            requests=[
                {"custom_id": "a", "params": params},
                {"custom_id": "b", "params": other_model},
            ]
        )
        self.assertTrue(batch.id.startswith("msgbatch_"))
        self.assertEqual(batch.processing_status, "in_progress")
        self.assertEqual(batch.request_counts.processing, 2)
        self.assertIsNone(batch.results_url)
        self.assertEqual(client.messages.batches.retrieve(batch.id).id, batch.id)
        self.assertEqual(
            [b.id for b in client.messages.batches.list().data], [batch.id]
        )
        canceling = client.messages.batches.cancel(batch.id)
        self.assertEqual(canceling.processing_status, "canceling")
        self.assertIsNotNone(canceling.cancel_initiated_at)
        with self.assertRaises(anthropic.BadRequestError):
            client.messages.batches.delete(batch.id)
        with self.assertRaises(anthropic.BadRequestError) as raised:
            client.messages.batches.create(
                requests=[
                    {"custom_id": "a", "params": params},
                    {"custom_id": "a", "params": params},
                ]
            )
        self.assertIn("requests[1].custom_id", str(raised.exception))
        other = anthropic.Anthropic(
            base_url=self.url, api_key=self.other, max_retries=0
        )
        with self.assertRaises(anthropic.NotFoundError):
            other.messages.batches.retrieve(batch.id)
        # The OpenAI routes do not show an Anthropic batch.
        with self.assertRaises(openai.NotFoundError):
            self.client(self.narrow).batches.retrieve(batch.id)

    def test_message_batch_results(self) -> None:
        """
        Once a Message Batch ended (its lines ended as a runner ends them,
        written to the store here), the SDK reads its results: each request
        once by custom_id, succeeded with its Message or errored; its
        counts are by outcome; it is then deleted.
        """
        client = anthropic.Anthropic(
            base_url=self.url, api_key=self.narrow, max_retries=0
        )
        params: Any = {"model": "sim-model", "max_tokens": 5, "messages": []}
        other_model: Any = {**params, "model": "other-model"}
        batch = client.messages.batches.create(
            requests=[
                {"custom_id": "a", "params": params},
                {"custom_id": "b", "params": other_model},
            ]
        )
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "sim-model",
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        with sqlite3.connect(self.database, timeout=10) as connection:
            connection.execute(
                "UPDATE batch_lines SET state = 'done', status_code = 200,"
                " result = ? WHERE batch_id = ? AND line_no = 1",
                (json.dumps(message), batch.id),
            )
            connection.execute(
                "UPDATE batches SET status = 'completed', completed_at = ?"
                " WHERE id = ?",
                (time.time(), batch.id),
            )
        connection.close()
        ended = client.messages.batches.retrieve(batch.id)
        self.assertEqual(ended.processing_status, "ended")
        counts = ended.request_counts
        self.assertEqual(
            (counts.succeeded, counts.errored, counts.processing), (1, 1, 0)
        )
        results = {
            r.custom_id: r.result for r in client.messages.batches.results(batch.id)
        }
        succeeded = results["a"]
        assert succeeded.type == "succeeded"
        self.assertEqual(succeeded.message.content[0].type, "text")
        errored = results["b"]
        assert errored.type == "errored"
        self.assertEqual(errored.error.error.type, "permission_error")
        self.assertIn("other-model", errored.error.error.message)
        deleted = client.messages.batches.delete(batch.id)
        self.assertEqual(deleted.type, "message_batch_deleted")
        with self.assertRaises(anthropic.NotFoundError):
            client.messages.batches.retrieve(batch.id)


class BatchesThroughRouterTests(SynchronousTestCase, Processes, CtlMixin):
    """
    On PostgreSQL, a file uploaded through a C{twistd llmgw-router} is read
    and made a batch through the server, and the batch read back through
    the router: both serve the APIs on the one store.
    """

    timeout = 120

    def setUp(self) -> None:
        self.db = fresh_database(self)
        _, sim_url = self.start_sim("--max-tokens", "3")
        _, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={sim_url}=sim-model",
            config=f'[store]\nurl = "{self.db}"\n',
        )

    def start_router(self) -> str:
        directory = self._directory()
        path = f"{directory}/router.toml"
        with open(path, "w") as f:
            f.write(f'[store]\nurl = "{self.db}"\n[batches]\nmax_file_size = 2048\n')
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

    def test_one_store(self) -> None:
        """
        Uploaded through the router, read and made a batch through the
        server, the batch read through the router; another key gets a 404
        there; the router's own max_file_size holds there.
        """
        made = self.ctl("keys", "create", "--name", "alice")
        key = made.stdout.splitlines()[0].strip()
        other = self.ctl("keys", "create", "--name", "bob").stdout.splitlines()[0]
        router_url = self.start_router()

        def client(url: str, api_key: str = key) -> openai.OpenAI:
            return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)

        content = _jsonl([_line(1), _line(2)])
        uploaded = client(router_url).files.create(
            file=("in.jsonl", content), purpose="batch"
        )
        self.assertEqual(client(self.url).files.content(uploaded.id).content, content)
        batch = client(self.url).batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        through_router = client(router_url).batches.retrieve(batch.id)
        self.assertEqual(through_router.status, "in_progress")
        assert through_router.request_counts is not None
        self.assertEqual(through_router.request_counts.total, 2)
        with self.assertRaises(openai.NotFoundError):
            client(router_url, other.strip()).files.retrieve(uploaded.id)
        with self.assertRaises(openai.APIStatusError) as large:
            client(router_url).files.create(
                file=("b.jsonl", b"x" * 3000), purpose="batch"
            )
        self.assertEqual(large.exception.status_code, 413)
