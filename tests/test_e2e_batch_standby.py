"""
A batch across a standby's takeover, for real: two C{twistd -n
llmgw-server} processes on one throwaway PostgreSQL (the store and the
leader lock), C{llmgw sim} as their replica, the batch made and read
through the official C{openai} client; the leader is killed (SIGKILL)
mid-batch.
"""

from __future__ import annotations

import signal

import openai
import psycopg
from twisted.trial.unittest import SynchronousTestCase

from tests.batch_support import (
    by_custom_id,
    chat_lines,
    completed_at_least,
    ended,
    engine_running,
    results,
    submit,
    wait_for,
)
from tests.pg_support import fresh_database
from tests.support import CtlMixin, Processes


class StandbyBatchTests(Processes, CtlMixin, SynchronousTestCase):
    timeout = 120

    def test_standby_takes_the_batch_over(self) -> None:
        """
        Only the leader runs lines; killed mid-batch, the standby takes the
        lead, puts the lines the leader had in flight back to pending and
        runs the rest: the batch completes, every line in the output file
        once, one usage row per line, none billed twice.
        """
        url = fresh_database(self)
        # Lines of half a second, and the kill sent while the engine runs
        # some: the lines in flight are put back to pending.
        _, sim = self.start_sim("--max-tokens", "4", "--ttft", "0.5", "--itl", "0.01")
        args = ("--endpoint", f"sim-0={sim}=sim-model")
        config = f'[store]\nurl = "{url}"\n'
        leader, leader_api, self.admin_url = self.start_server(*args, config=config)
        leader.wait_for("leading: holds the leader lock")
        standby, standby_api, _ = self.start_server(*args, config=config)
        standby.wait_for("standby: leader chosen")
        key = self.ctl_json("keys", "create", "--name", "batcher")["key"]
        client = openai.OpenAI(
            base_url=leader_api + "/v1", api_key=key, max_retries=0, timeout=30
        )
        batch = submit(client, chat_lines(400))
        wait_for(client, batch.id, completed_at_least(100), 60, "lines")
        self.assertNotIn("batch runner runner-", standby.output())
        engine_running(sim)
        leader.popen.send_signal(signal.SIGKILL)
        leader.popen.wait(30)
        client = client.with_options(base_url=standby_api + "/v1")
        done = wait_for(client, batch.id, ended("completed"), 90, "completed")
        standby.wait_for(r"batch runner \S+ started; [1-9]\d* lines left running")
        assert done.request_counts is not None
        self.assertEqual(done.request_counts.completed, 400)
        output = results(client, done.output_file_id)
        self.assertEqual([int(e["custom_id"][4:]) for e in output], list(range(1, 401)))
        self.assertEqual(len(by_custom_id(output)), 400)
        self.assertEqual(results(client, done.error_file_id), [])
        with psycopg.connect(url) as db:
            rows = db.execute(
                "SELECT request_id FROM usage WHERE batch_id = %s", (batch.id,)
            ).fetchall()
            used = db.execute("SELECT tokens_used FROM api_keys").fetchone()
            summed = db.execute(
                "SELECT SUM(prompt_tokens + completion_tokens) FROM usage"
            ).fetchone()
        self.assertEqual(
            sorted(r[0] for r in rows), sorted(f"{batch.id}-{n}" for n in range(1, 401))
        )
        assert used is not None and summed is not None
        self.assertEqual(used[0], summed[0])
