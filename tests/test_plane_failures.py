"""
Start failures keep their cause (issue 14 case 4): the engine's whole
output tail kept, the failed replica shown with its error until replaced,
and a start that timed out given its output too; on a control plane on a
L{Clock} (see L{tests.plane_support}).
"""

from __future__ import annotations

from llmgw.control.views import models_json, replicas_json
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase, make_model

OOM = [
    "loading weights",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "  at step 1",
    "  at step 2",
    "  at step 3",
    "  at step 4",
]


class FailedReplicaTests(PlaneCase):
    def shard_ended(self, shard: str, output: list[str], state: int) -> None:
        node = next(n for n, s in self.agents.starts() if s.shard_id == shard)
        status = pb.ShardStatus(
            shard_id=shard, error="the engine exited with code 1", output_tail=output
        )
        status.state = state  # type: ignore[assignment]
        self.plane.shard_status(node, status)

    def test_failed_replica_shown_with_cause_until_replaced(self) -> None:
        """
        An engine printing "CUDA out of memory" and then four lines before
        exiting 1: the replica stays in the replica list, failed, with its
        error naming the cause and its whole output; the model's last
        error names the cause too.  Once a new replica is ready, the failed
        one leaves the list.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        ((_, start),) = self.agents.starts()
        self.shard_ended(start.shard_id, OOM, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        (shown,) = replicas_json(self.plane)
        self.assertEqual(shown["state"], "failed")
        self.assertIn("CUDA out of memory", shown["last_error"])
        self.assertEqual(shown["shards"][0]["output_tail"], OOM)
        (model,) = models_json(self.plane)
        self.assertIn("CUDA out of memory", model["last_error"])
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual([r["state"] for r in replicas_json(self.plane)], ["ready"])

    def test_start_timeout_carries_output(self) -> None:
        """
        A start that timed out: the replica is shown failed "not ready
        after 120s", and the output its engine's agent sends when the
        engine stopped is kept with it and added to the model's error.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        ((_, start),) = self.agents.starts()
        self.clock.advance(121)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [start.shard_id])
        self.shard_ended(
            start.shard_id, ["still loading", "Error: no GPU"], pb.SHARD_STATE_STOPPED
        )
        (shown,) = [r for r in replicas_json(self.plane) if r["state"] == "failed"]
        self.assertIn("not ready after 120s", shown["last_error"])
        self.assertEqual(
            shown["shards"][0]["output_tail"], ["still loading", "Error: no GPU"]
        )
        (model,) = models_json(self.plane)
        self.assertIn("Error: no GPU", model["last_error"])
