"""
The batches' runner for real, on SQLite: C{twistd -n llmgw-server} in
front of C{llmgw sim}, batches made and read through the official
C{openai} client (L{tests.batch_support}), the usage rows read from the
server's store.  A batch of 2,000 lines answered once each, as the same
requests sent directly are, billed once each; the server killed twice
mid-batch and started again on its state; a cancel; the completion window
ending.  And the runner's loopback listener, which serves the runner alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.batch_support import (
    by_custom_id,
    chat_lines,
    completed_at_least,
    ended,
    engine_running,
    line_body,
    results,
    submit,
    wait_for,
)
from tests.support import CtlMixin, Processes, http

STATE = "batch-state"


class _Server(Processes, CtlMixin, SynchronousTestCase):
    timeout = 120

    def serve(self, *sim_args: str) -> None:
        """
        Start the sim (C{sim_args}) and a server in front of it, make a key
        and a client with it.
        """
        _, self.sim_url = self.start_sim("--max-tokens", "4", *sim_args)
        self.start()
        self.key = self.ctl_json("keys", "create", "--name", "batcher")["key"]
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key=self.key, max_retries=0, timeout=30
        )

    def start(self) -> None:
        """
        Start the server, on L{STATE} (again, after a kill).
        """
        self.server, self.api_url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={self.sim_url}=sim-model", state=STATE
        )
        if hasattr(self, "client"):
            self.client = self.client.with_options(base_url=self.api_url + "/v1")

    def database(self) -> sqlite3.Connection:
        path = os.path.join(self._directory(), STATE, "llmgw.db")
        connection = sqlite3.connect(path, timeout=30)
        self.addCleanup(connection.close)
        return connection

    def usage_rows(self, batch_id: str) -> list[tuple[Any, ...]]:
        """
        @return: C{(request_id, status, tokens)} of the batch's usage rows,
            once the server wrote what it held (C{llmgw ctl usage}
            flushes).
        """
        self.ctl_json("usage", "--by", "key")
        return (
            self.database()
            .execute(
                "SELECT request_id, status, prompt_tokens + completion_tokens"
                " FROM usage WHERE batch_id = ?",
                (batch_id,),
            )
            .fetchall()
        )

    def key_tokens(self) -> tuple[int, int]:
        """
        @return: the key's tokens as counted on it, and as its usage rows
            sum them.
        """
        db = self.database()
        (used,) = db.execute("SELECT tokens_used FROM api_keys").fetchone()
        (rows,) = db.execute(
            "SELECT SUM(prompt_tokens + completion_tokens) FROM usage"
        ).fetchone()
        return used, rows

    def assert_every_line_once(
        self, batch_id: str, count: int, ok: set[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """
        The batch's output and error files hold each of its C{count} lines
        once, in line order; its usage rows are one per line answered, each
        under the line's own request id, none billed twice.

        @param ok: the lines expected in the output file (all by default).
        @return: the output file's lines by C{custom_id}.
        """
        batch = self.client.batches.retrieve(batch_id)
        output = results(self.client, batch.output_file_id)
        errors = results(self.client, batch.error_file_id)
        for entries in (output, errors):
            numbers = [int(e["custom_id"][4:]) for e in entries]
            self.assertEqual(numbers, sorted(numbers))
        answered = by_custom_id(output)
        every = by_custom_id(output + errors)
        self.assertEqual(set(every), {f"req-{n}" for n in range(1, count + 1)})
        if ok is None:
            self.assertEqual(errors, [])
        rows = self.usage_rows(batch_id)
        ids = [row[0] for row in rows]
        self.assertEqual(len(ids), len(set(ids)))
        billed = [e["response"] for e in output + errors if e["response"]]
        self.assertEqual(
            sorted((row[0], row[1]) for row in rows),
            sorted((r["request_id"], r["status_code"]) for r in billed),
        )
        used, summed = self.key_tokens()
        self.assertEqual(used, summed)
        return answered


class LoopbackTests(_Server):
    def test_runner_listener_serves_the_runner_alone(self) -> None:
        """
        The runner's loopback listener refuses (403) a request without the
        runner's secret, or with another; the client listener never reads
        the runner's headers: with them and no API key it answers 401, and
        with a key, the request is the client's own (its own request id,
        no batch in its usage row).
        """
        self.serve()
        port = self.server.wait_for(r"loopback listener on 127\.0\.0\.1:(\d+)")
        body = json.dumps(line_body(1)).encode()
        runner = {
            "content-type": "application/json",
            "x-llmgw-batch": "batch_abc",
            "x-llmgw-batch-line": "1",
            "x-llmgw-batch-key": "1",
        }
        url = f"http://127.0.0.1:{port.group(1)}/v1/chat/completions"
        for secret in (None, "guessed"):
            headers = dict(runner)
            if secret is not None:
                headers["x-llmgw-runner"] = secret
            status, _, answer = http("POST", url, body, headers)
            self.assertEqual(status, 403, answer)
            self.assertIn(b"batch runner alone", answer)
        forged = {**runner, "x-llmgw-runner": "guessed"}
        chat = self.api_url + "/v1/chat/completions"
        status, _, _ = http("POST", chat, body, forged)
        self.assertEqual(status, 401)
        status, headers, _ = http(
            "POST", chat, body, {**forged, "authorization": f"Bearer {self.key}"}
        )
        self.assertEqual(status, 200)
        self.assertNotIn("batch_abc", headers["x-request-id"])
        self.ctl_json("usage", "--by", "key")
        rows = self.database().execute("SELECT batch_id FROM usage").fetchall()
        self.assertEqual(rows, [(None,)])


class BatchTests(_Server):
    def test_two_thousand_lines(self) -> None:
        """
        A batch of 2,000 chat lines: every custom_id answered once, in line
        order, each answer the same as the same request sent directly, one
        usage row per line under its own request id, and the key's tokens
        the sum of its rows (nothing billed twice).
        """
        self.serve()
        began = time.monotonic()
        batch = submit(self.client, chat_lines(2000))
        batch = wait_for(self.client, batch.id, ended("completed"), 90, "completed")
        took = time.monotonic() - began
        counts = batch.request_counts
        assert counts is not None
        self.assertEqual(
            (counts.total, counts.completed, counts.failed), (2000, 2000, 0)
        )
        answered = self.assert_every_line_once(batch.id, 2000)

        def direct(number: int) -> tuple[str | None, int, int]:
            answer = self.client.chat.completions.create(**line_body(number))
            assert answer.usage is not None
            return (
                answer.choices[0].message.content,
                answer.usage.prompt_tokens,
                answer.usage.completion_tokens,
            )

        with ThreadPoolExecutor(8) as pool:
            sent = list(pool.map(direct, range(1, 2001)))
        for number, (content, prompt, completion) in enumerate(sent, 1):
            entry = answered[f"req-{number}"]
            response = entry["response"]
            self.assertEqual(response["status_code"], 200)
            self.assertEqual(response["request_id"], f"{batch.id}-{number}")
            body = response["body"]
            self.assertEqual(body["choices"][0]["message"]["content"], content)
            self.assertEqual(
                (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]),
                (prompt, completion),
            )
        print(f"\n2000 lines: completed {took:.1f}s after the upload")

    def test_killed_twice_mid_batch(self) -> None:
        """
        The server is killed (SIGKILL) twice while a batch runs, and
        started again on its state each time: the batch completes, every
        line in the output file once, one usage row per line, none billed
        twice; lines that were in flight at a kill ran again.
        """
        # Lines of half a second, and each kill sent while the engine runs
        # some (see test_stopped_mid_batch).
        self.serve("--ttft", "0.5", "--itl", "0.01")
        batch = submit(self.client, chat_lines(400))
        for at_least in (60, 200):
            wait_for(self.client, batch.id, completed_at_least(at_least), 60, "lines")
            engine_running(self.sim_url)
            self.server.popen.send_signal(signal.SIGKILL)
            self.server.popen.wait(30)
            self.start()
        done = wait_for(self.client, batch.id, ended("completed"), 90, "completed")
        assert done.request_counts is not None
        self.assertEqual(done.request_counts.completed, 400)
        self.assert_every_line_once(batch.id, 400)
        (again,) = (
            self.database()
            .execute(
                "SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND attempts > 1",
                (batch.id,),
            )
            .fetchone()
        )
        self.assertGreater(again, 0)
        self.assertTrue(
            re.search(r"batch runner \S+ started; [1-9]\d* lines", self.server.output())
        )

    def test_stopped_mid_batch(self) -> None:
        """
        A clean stop (SIGTERM) mid-batch: the runner stops sending with the
        listeners, its lines in flight end (the stop takes seconds at
        most), its lines claimed and not sent go back to pending, so the
        next start finds none left running; the batch then completes, each
        line once.
        """
        # Lines of a second each, and the stop sent while the engine runs
        # some: the runner may hold none in flight for a moment (a claim,
        # an engine reading that left no room), and a stop then has none
        # to wait for.
        self.serve("--ttft", "1", "--itl", "0.01")
        batch = submit(self.client, chat_lines(300))
        wait_for(self.client, batch.id, completed_at_least(30), 60, "lines")
        engine_running(self.sim_url)
        began = time.monotonic()
        self.assertEqual(self.server.stop(), -signal.SIGTERM)
        self.assertLess(time.monotonic() - began, 5)
        stopping = self.server.output()
        self.assertIn("batch runner: waiting for", stopping)
        # Its last lines ended before the router's drain began.
        after = stopping.split("stopping: router drain")[1]
        self.assertNotIn(f"request {batch.id}-", after)
        self.start()
        done = wait_for(self.client, batch.id, ended("completed"), 60, "completed")
        self.assertIn("started; 0 lines left running", self.server.output())
        assert done.request_counts is not None
        self.assertEqual(done.request_counts.completed, 300)
        self.assert_every_line_once(batch.id, 300)

    def test_no_room_lines_wait(self) -> None:
        """
        Lines the replica has no room for (its queue full: 503) go back to
        pending and run later: the batch completes, and each line's one
        usage row is its answer's (the refused attempts keep none).
        """
        self.serve("--ttft", "0.05", "--max-concurrency", "1", "--max-queue", "1")
        batch = submit(self.client, chat_lines(12))
        wait_for(self.client, batch.id, ended("completed"), 60, "completed")
        self.assertIn("queue is full", self.server.output())
        self.assert_every_line_once(batch.id, 12)

    def test_limited_key_holds_back_no_other(self) -> None:
        """
        A key at its rate limit (429) holds back its own lines, not another
        key's of the same model: the other key's batch, made after, completes
        while the first waits for its next minute.
        """
        self.serve()
        slow = self.ctl_json("keys", "create", "--name", "slow", "--rpm", "1")["key"]
        slow_client = self.client.with_options(api_key=slow)
        first = submit(slow_client, chat_lines(10))
        wait_for(slow_client, first.id, completed_at_least(1), 30, "a first line")
        second = submit(self.client, chat_lines(10))
        second = wait_for(self.client, second.id, ended("completed"), 30, "completed")
        first = slow_client.batches.retrieve(first.id)
        self.assertEqual(first.status, "in_progress")
        answered = by_custom_id(results(self.client, second.output_file_id))
        self.assertEqual(len(answered), 10)

    def test_anthropic_message_batch(self) -> None:
        """
        An Anthropic Message Batch runs the same way (its lines sent to
        /v1/messages, translated as a client's are): ended, each request
        succeeded with its message, one usage row each.
        """
        self.serve()
        client = anthropic.Anthropic(
            base_url=self.api_url, api_key=self.key, max_retries=0
        )
        params: Any = {
            "model": "sim-model",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}],
        }
        batch = client.messages.batches.create(
            requests=[{"custom_id": f"m{n}", "params": params} for n in range(5)]
        )
        deadline = time.monotonic() + 30
        while client.messages.batches.retrieve(batch.id).processing_status != "ended":
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.1)
        done = client.messages.batches.retrieve(batch.id)
        self.assertEqual(done.request_counts.succeeded, 5)
        answers = list(client.messages.batches.results(batch.id))
        names = sorted(a.custom_id for a in answers)
        self.assertEqual(names, [f"m{n}" for n in range(5)])
        for answer in answers:
            self.assertEqual(answer.result.type, "succeeded")
            assert answer.result.type == "succeeded"
            self.assertEqual(answer.result.message.type, "message")
        ids = sorted(row[0] for row in self.usage_rows(batch.id))
        self.assertEqual(ids, sorted(f"{batch.id}-{n}" for n in range(1, 6)))

    def test_cancel(self) -> None:
        """
        A batch cancelled while it runs: cancelling, then cancelled once its
        lines in flight ended; the lines answered are in the output file,
        the others in the error file as batch_cancelled, each once.
        """
        self.serve("--ttft", "0.05")
        batch = submit(self.client, chat_lines(300))
        wait_for(self.client, batch.id, completed_at_least(10), 60, "lines")
        self.assertEqual(self.client.batches.cancel(batch.id).status, "cancelling")
        done = wait_for(self.client, batch.id, ended("cancelled"), 60, "cancelled")
        self.assertIsNotNone(done.cancelled_at)
        output = by_custom_id(results(self.client, done.output_file_id))
        errors = results(self.client, done.error_file_id)
        self.assertTrue(errors)
        for entry in errors:
            self.assertIsNone(entry["response"])
            self.assertEqual(entry["error"]["code"], "batch_cancelled")
        self.assertEqual(len(output) + len(errors), 300)
        self.assert_every_line_once(batch.id, 300, ok=set(output))
        # Over, it cannot be cancelled again: a 409 with the admin API's code.
        with self.assertRaises(openai.ConflictError) as again:
            self.client.batches.cancel(batch.id)
        body: Any = again.exception.body
        self.assertEqual(body["code"], "cannot_cancel")

    def test_expired(self) -> None:
        """
        A batch past its completion window (its C{expires_at} moved to now
        in its store, as 24 hours would): expired, the lines answered in the
        output file, the others in the error file with OpenAI's
        batch_expired, each once.
        """
        self.serve("--ttft", "0.05")
        batch = submit(self.client, chat_lines(300))
        wait_for(self.client, batch.id, completed_at_least(10), 60, "lines")
        db = self.database()
        db.execute(
            "UPDATE batches SET expires_at = ? WHERE id = ?", (time.time(), batch.id)
        )
        db.commit()
        done = wait_for(self.client, batch.id, ended("expired"), 60, "expired")
        self.assertIsNotNone(done.expired_at)
        output = by_custom_id(results(self.client, done.output_file_id))
        errors = results(self.client, done.error_file_id)
        self.assertTrue(errors)
        for entry in errors:
            self.assertEqual(entry["error"]["code"], "batch_expired")
        assert done.request_counts is not None
        self.assertEqual(done.request_counts.failed, len(errors))
        self.assert_every_line_once(batch.id, 300, ok=set(output))
