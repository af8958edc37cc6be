"""
Batches seen by the operator (issue on Files and Batches, item 6) through
a running C{twistd -n llmgw-server} and the real C{llmgw ctl}: every
key's batches listed with filters, one shown with its lines by state, one
cancelled as the operator; the admin C{/metrics} counting their lines by
state (C{promtool check metrics} passing on it).

The batches are written into the server's store beside it
(L{tests.batch_seed}), as the Batches API makes them, for a catalog
model no node can hold: no line is ever sent, so their states are the
test's whatever runs lines.
"""

from __future__ import annotations

import os
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.batch_seed import chat_batch, seed
from tests.support import CtlMixin, Processes, http
from tests.test_e2e_fleet_metrics import samples, values

# A model no node can hold (none joins): its lines wait.
CHAT = """
insecure_agents = true
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
            ["BATCH", "KEY", "ENDPOINT", "STATUS", "DONE", "FAILED", "CREATED"],
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
        header, counts = shown.strip().splitlines()[-2:]
        self.assertEqual(
            header.split(),
            ["PENDING", "RUNNING", "DONE", "FAILED", "CANCELLED", "EXPIRED"],
        )
        self.assertEqual(counts.split(), ["5", "0", "0", "0", "0", "0"])

        cancelled = self.ctl("batches", "cancel", "batch_team").stdout
        self.assertIn("batch batch_team is cancelling: 5 lines not sent", cancelled)
        batch = self.ctl_json("batches", "show", "batch_team")
        self.assertEqual(batch["status"], "cancelling")
        self.assertEqual(batch["lines"]["cancelled"], 5)
        self.assertEqual(batch["key"], "team")

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
        states = self.until(
            lambda: (found := self.line_states()).get("pending") == 8 and found,
            8,
            "8 pending lines in llmgw_batch_lines",
        )
        self.assertEqual(
            states,
            {
                "pending": 8,
                "running": 0,
                "done": 0,
                "failed": 0,
                "cancelled": 0,
                "expired": 0,
            },
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
