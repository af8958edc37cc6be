"""
Batch lines never in the way, through real processes (docs/batches.md,
"Batch work and interactive traffic"): C{twistd llmgw-server} and
C{twistd llmgw-agent} over mutual TLS, one simulated 80 GB GPU and
C{llmgw sim} engines, a batch made through the official C{openai} client
(L{tests.batch_support}): a model only the batch's lines ask for is not
given the GPU another model holds idle, until a client asks for it.
"""

from __future__ import annotations

import time

from twisted.trial.unittest import SynchronousTestCase

from tests.batch_support import chat_lines, completed_at_least, submit, wait_for
from tests.test_e2e_swap import _Swaps, model


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
