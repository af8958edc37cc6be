"""
Batches seen by the operator (issue on Files and Batches, item 6) through
a running C{twistd -n llmgw-server} and the real C{llmgw ctl}: every
key's batches listed with filters, one shown with its lines by state, one
cancelled as the operator; the admin C{/metrics} counting their lines by
state (C{promtool check metrics} passing on it); and a batch made with the
official C{openai} SDK and run by the server's runner, its tokens counted.

The batches shown are written into the server's store beside it
(L{tests.batch_seed}), as the Batches API makes them, for a catalog model
no node can hold: the runner claims their lines (C{pending} to
C{running}) and sends some, which wait a second for the model to start
and go back to pending (503), so none ends but by a cancel.
"""

from __future__ import annotations

import os
import time
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.batch_seed import chat_batch, seed
from tests.batch_support import (
    MODEL,
    chat_lines,
    ended,
    line_body,
    results,
    submit,
    wait_for,
)
from tests.support import CtlMixin, Processes, http
from tests.test_e2e_fleet_metrics import samples, values

# A model no node can hold (none joins): a line the runner sends waits for
# its activation, a second, then is put back to pending (503).
CHAT = """
insecure_agents = true
[router]
activation_timeout = "1s"
[[models]]
name = "chat"
min_replicas = 0
[[models.profiles]]
name = "one-h200"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 40
"""


class _Batches(Processes, CtlMixin):
    """
    A server with keys C{team} and C{ops}, and three batches: C{batch_old}
    (C{team}'s, completed), C{batch_team} (C{team}'s, 5 lines) and
    C{batch_ops} (C{ops}'s, 3 lines), both in progress.
    """

    def start_with_batches(self) -> None:
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            "tcp:0:interface=127.0.0.1",
            config=CHAT,
            state="server-state",
        )
        self.ctl("keys", "create", "--name", "team")
        self.ctl("keys", "create", "--name", "ops")
        keys = {k["name"]: k for k in self.ctl_json("keys")["keys"]}
        database = os.path.join(self._directory(), "server-state", "llmgw.db")
        now = time.time()
        seed(
            database,
            [
                chat_batch("batch_old", keys["team"], 2, now - 60, "completed"),
                chat_batch("batch_team", keys["team"], 5, now - 30),
                chat_batch("batch_ops", keys["ops"], 3, now - 10),
            ],
        )

    def line_states(self) -> dict[str, float]:
        found = values(samples(self.admin_url), "llmgw_batch_lines")
        return {dict(labels)["state"]: value for labels, value in found.items()}

    def until(self, check: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.2)
        raise AssertionError(f"not within {timeout}s: {what}")


class CtlBatchesTests(_Batches, SynchronousTestCase):
    timeout = 120

    def setUp(self) -> None:
        self.start_with_batches()

    def test_list_show_cancel(self) -> None:
        """
        C{ctl batches}: every key's, newest first, with key, endpoint,
        status and progress; C{--status} and C{--key} filter, C{--limit}
        and C{--after} page.  C{ctl
        batches show}: one batch's fields and its lines by state.  C{ctl
        batches cancel}: another key's batch is cancelling, its pending
        lines cancelled, as C{show} then says; a completed batch is
        refused in one line naming its status; an unknown one too.
        """
        listed = self.ctl("batches").stdout.splitlines()
        self.assertEqual(
            listed[0].split(),
            [
                "BATCH",
                "KEY",
                "ENDPOINT",
                "STATUS",
                "DONE",
                "FAILED",
                "TOKENS",
                "COST",
                "CREATED",
            ],
        )
        self.assertEqual(
            [line.split()[:4] for line in listed[1:4]],
            [
                ["batch_ops", "ops", "/v1/chat/completions", "in_progress"],
                ["batch_team", "team", "/v1/chat/completions", "in_progress"],
                ["batch_old", "team", "/v1/chat/completions", "completed"],
            ],
        )
        self.assertEqual(listed[2].split()[4:6], ["0/5", "0%"])
        only = self.ctl_json("batches", "--status", "completed")["batches"]
        self.assertEqual([b["id"] for b in only], ["batch_old"])
        team = self.ctl_json("batches", "list", "--key", "team")["batches"]
        self.assertEqual([b["id"] for b in team], ["batch_team", "batch_old"])
        first = self.ctl("batches", "--limit", "1").stdout
        self.assertIn("more follow: --after batch_ops\n", first)
        page = self.ctl_json("batches", "--limit", "1", "--after", "batch_ops")
        self.assertEqual([b["id"] for b in page["batches"]], ["batch_team"])

        shown = self.ctl("batches", "show", "batch_team").stdout
        self.assertIn("key: team\n", shown)
        self.assertIn("status: in_progress\n", shown)
        self.assertIn("progress: 0/5 0%\n", shown)
        self.assertIn(
            "usage: 0 lines run, 0 prompt and 0 completion tokens,"
            " 0.000 GPU s, cost 0.000000\n",
            shown,
        )
        header, counts = shown.strip().splitlines()[-2:]
        self.assertEqual(
            header.split(),
            ["PENDING", "RUNNING", "DONE", "FAILED", "CANCELLED", "EXPIRED"],
        )
        # Pending, or claimed by the runner (none can be answered).
        waiting = [int(n) for n in counts.split()]
        self.assertEqual((sum(waiting[:2]), waiting[2:]), (5, [0, 0, 0, 0]))

        cancelled = self.ctl("batches", "cancel", "batch_team").stdout
        self.assertRegex(cancelled, r"^batch batch_team is cancelling: \d lines not")

        def over() -> dict[str, Any] | None:
            batch: dict[str, Any] = self.ctl_json("batches", "show", "batch_team")
            return batch if batch["status"] == "cancelled" else None

        # The runner ends the lines it had claimed, then the batch.
        batch = self.until(over, 10, "batch_team cancelled")
        self.assertEqual(batch["lines"]["cancelled"], 5)
        self.assertEqual(batch["progress"], {"ended": 5, "total": 5})
        self.assertEqual(batch["key"], "team")
        self.assertIsNotNone(batch["cancelling_at"])
        other = self.ctl_json("batches", "show", "batch_ops")
        self.assertEqual(other["status"], "in_progress")

        refused = self.ctl("batches", "cancel", "batch_old", ok=False)
        self.assertEqual(refused.returncode, 1)
        self.assertIn("'batch_old' is completed", refused.stderr)
        self.assertIn("HTTP 409", refused.stderr)
        self.assertEqual(len(refused.stderr.splitlines()), 1, refused.stderr)
        unknown = self.ctl("batches", "show", "batch_nope", ok=False)
        self.assertIn("no batch 'batch_nope' (HTTP 404)", unknown.stderr)

    def test_lines_in_metrics(self) -> None:
        """
        The admin C{/metrics} counts the lines of the batches not over by
        state (the completed batch's not among them) and the batches by
        status, within one read of the store (5 s); C{promtool check
        metrics} passes on it.
        """

        def waiting() -> dict[str, float] | None:
            found = self.line_states()
            count = found.get("pending", 0) + found.get("running", 0)
            return found if count == 8 else None

        states = self.until(waiting, 8, "the 8 waiting lines in llmgw_batch_lines")
        # Pending, or claimed by the runner (none can be answered).
        self.assertEqual(
            {s: n for s, n in states.items() if s not in ("pending", "running")},
            {"done": 0, "failed": 0, "cancelled": 0, "expired": 0},
        )
        found = samples(self.admin_url)
        batches = values(found, "llmgw_batches")
        self.assertEqual(batches[(("status", "in_progress"),)], 2)
        age = values(found, "llmgw_batch_figures_age_seconds")[()]
        self.assertLess(age, 6)
        status, _, body = http("GET", self.admin_url + "/metrics")
        self.assertEqual(status, 200)
        code, problems = prometheus_support.check_metrics(body)
        self.assertEqual((code, problems), (0, ""))


ROW = ["/v1/chat/completions", "completed", "20/20", "100%"]


class BatchWorkCountedTests(_Batches, SynchronousTestCase):
    """
    A batch made and run through the production path: the official
    C{openai} SDK uploads its file and makes it, the server's runner sends
    its lines through its loopback listener to a C{llmgw sim} engine.
    """

    timeout = 120

    def test_batch_tokens_counted(self) -> None:
        """
        The lines' tokens count in C{llmgw_batch_tokens_total}, exactly
        the usage their answers carry, and in C{llmgw_tokens_total} with
        a client's own request, which counts in the batch's tokens not at
        all; the batch object's C{usage} (the SDK's C{Batch.usage}) and
        C{ctl batches} and C{ctl batches show} sum the answers' usage;
        C{ctl batches} shows the batch completed, all lines ended;
        the dashboard's card gives the batch tokens a second once the
        sampler has seen them (within 5 s).
        """
        _, sim_url = self.start_sim("--max-tokens", "4")
        self.server, api_url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim_url}={MODEL}", state="server-state"
        )
        key = self.ctl_json("keys", "create", "--name", "nightly")["key"]
        client = openai.OpenAI(base_url=api_url + "/v1", api_key=key, max_retries=0)
        own = client.chat.completions.create(**line_body(0, max_tokens=4))
        assert own.usage is not None
        made = submit(client, chat_lines(20, max_tokens=4))
        batch = wait_for(client, made.id, ended("completed"), 30, "completed batch")
        answers = results(client, batch.output_file_id)
        self.assertEqual(len(answers), 20)
        usage = [a["response"]["body"]["usage"] for a in answers]
        prompt = sum(u["prompt_tokens"] for u in usage)
        completion = sum(u["completion_tokens"] for u in usage)
        self.assertGreater(completion, 0)
        found = samples(self.admin_url)
        batch_tokens = values(found, "llmgw_batch_tokens_total")
        self.assertEqual(
            batch_tokens,
            {
                (("kind", "prompt"), ("model", MODEL)): prompt,
                (("kind", "completion"), ("model", MODEL)): completion,
            },
        )
        tokens = values(found, "llmgw_tokens_total")
        self.assertEqual(
            tokens[(("kind", "completion"), ("model", MODEL))],
            completion + own.usage.completion_tokens,
        )
        # The batch's usage, as OpenAI's batch object and the operator's
        # table and show say it: the sums of its answers' usage.
        assert batch.usage is not None
        self.assertEqual(
            (
                batch.usage.input_tokens,
                batch.usage.output_tokens,
                batch.usage.total_tokens,
            ),
            (prompt, completion, prompt + completion),
        )
        listed = self.ctl("batches", "--key", "nightly").stdout.splitlines()
        self.assertEqual(
            listed[1].split()[1:8], ["nightly", *ROW, "0", str(prompt + completion)]
        )
        self.assertIn(
            f"usage: 20 lines run, {prompt} prompt and {completion} completion tokens,",
            self.ctl("batches", "show", made.id).stdout,
        )

        def rate() -> str | None:
            status, _, page = http("GET", self.admin_url + "/batches?fragment=1")
            self.assertEqual(status, 200)
            big = page.decode().split('id="card-batch-tokens"')[1]
            shown = big.split('<div class="big">')[1].split("</div>")[0]
            return None if shown == "0/s" else shown

        self.assertTrue(self.until(rate, 8, "batch tokens a second on the dashboard"))
