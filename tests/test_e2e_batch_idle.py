"""
Batch lines never in the way, through real processes (docs/batches.md,
"Batch work and interactive traffic"): C{twistd llmgw-server} and
C{twistd llmgw-agent} over mutual TLS, one simulated 80 GB GPU and
C{llmgw sim} engines, a batch made through the official C{openai} client
(L{tests.batch_support}): a model only the batch's lines ask for is not
given the GPU another model holds idle, until a client asks for it; and a
replica busy with lines alone gives its GPU to a client's request at once.
"""

from __future__ import annotations

import json
import threading
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.batch_support import chat_lines, completed_at_least, submit, wait_for
from tests.support import http
from tests.test_e2e_swap import _Swaps, model


def long_lines(count: int, model: str, tokens: int) -> bytes:
    """
    @return: an input file of C{count} chat lines for C{model}, each
        C{tokens} long (vLLM's C{ignore_eos}, past the sim's natural end).
    """
    return b"".join(
        json.dumps(
            {
                "custom_id": f"long-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"long line {n}"}],
                    "max_tokens": tokens,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for n in range(count)
    )


class BatchMakesNoRoomTests(_Swaps, SynchronousTestCase):
    def test_lines_wait_for_a_client(self) -> None:
        """
        C{a} idle on the only GPU, a batch of lines for C{b}: for 3 s (past
        C{a}'s min_resident and the swap_max_wait of 1 s) C{a} stays and
        C{b} is not started, no line done; a client's request for C{b}
        then evicts C{a}, and the batch's lines are answered by C{b}.
        """
        self.setup_fleet(
            model("a") + model("b"),
            swap_max_wait="1s",
        )
        self.assertTrue(self.chat("a"))
        (a,) = self.replicas("a")
        time.sleep(1.2)  # a's min_resident
        batch = submit(self.client, chat_lines(3).replace(b"sim-model", b"b"))
        time.sleep(3)
        self.assertEqual([r["id"] for r in self.replicas("a")], [a["id"]])
        self.assertEqual(self.replicas("a")[0]["state"], "ready")
        self.assertEqual(self.replicas("b"), [])
        counts = self.client.batches.retrieve(batch.id).request_counts
        assert counts is not None
        self.assertEqual(counts.completed, 0)
        self.assertNotIn("evicting", self.server.output())
        self.assertTrue(self.chat("b"))
        self.assertIn("evicting replica " + a["id"] + " of a", self.server.output())
        wait_for(self.client, batch.id, completed_at_least(3), 30, "the lines done")
        self.assertNotIn("Traceback", self.server.output())

    def test_replica_busy_with_lines_goes_for_a_client(self) -> None:
        """
        C{a}'s only requests in flight are a batch's lines (200 of 150
        tokens at 20 ms, 3 s each, as many in flight as the room gives): a
        client's request for C{b} evicts it at once, as if idle (it drains
        within 2 s, before its first lines end), rather than after
        swap_max_wait (30 s) while lines keep coming: the lines in flight
        end, then C{b} starts and answers.
        """
        self.setup_fleet(model("a") + model("b"))
        self.assertTrue(self.chat("a"))
        (a,) = self.replicas("a")
        time.sleep(1.2)  # a's min_resident
        submit(self.client, long_lines(200, "a", 150))
        engine = f"http://127.0.0.1:{a['shards'][0]['port']}/sim/stats"
        self.until(
            lambda: json.loads(http("GET", engine)[2])["running"] >= 1,
            10,
            "a line running on a",
        )
        answers: list[bool] = []
        thread = threading.Thread(target=lambda: answers.append(self.chat("b") != ""))
        thread.start()
        self.addCleanup(thread.join, 60)
        self.until(
            lambda: [r["state"] for r in self.replicas("a")] != ["ready"],
            2,
            "a evicted at once",
        )
        thread.join(30)
        self.assertEqual(answers, [True])
        self.assertIn(f"evicting replica {a['id']} of a (idle", self.server.output())
        self.assertNotIn("Traceback", self.server.output())
