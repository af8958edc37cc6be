"""
The control plane adopting what agents run after a restart (see
L{tests.plane_support}).
"""

from __future__ import annotations

from typing import Any

from llmgw.control.views import models_json
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, PlaneCase, make_model


class AdoptionTests(PlaneCase):
    def _running(self, shard: str, model: str = "m", **kw: Any) -> pb.RunningShard:
        return pb.RunningShard(
            shard_id=shard,
            replica_id=shard.rsplit("-", 1)[0],
            model=model,
            profile=kw.pop("profile", "one"),
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=kw.pop("pid", 77),
            **kw,
        )

    def test_adopt_claimed_stop_unclaimed(self) -> None:
        """
        After a server restart, the shards a Register lists that the catalog
        claims are adopted with their pids and nothing new is placed; a
        shard of a model no longer in the catalog is stopped.
        """
        self.make(make_model(low=1), nodes=())
        self.register(
            "n1",
            shards=(self._running("m-aaaa-0"), self._running("gone-bbbb-0", "gone")),
        )
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.assertEqual(self.agents.stops(), ["gone-bbbb-0"])
        replica = self.plane.replicas["m-aaaa"]
        self.assertTrue(replica.adopted)
        self.assertEqual(replica.shards[0].pid, 77)
        self.assertEqual(self.endpoints(), ["http://10.0.0.1:20000"])

    def test_empty_list_means_gone(self) -> None:
        """
        A node registering again without a shard it ran: that replica is
        gone and is placed again.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.register("n1")
        self.plane.reconcile()
        self.assertIn("not running on n1", models_json(self.plane)[0]["last_error"])
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)

    def test_grace_holds_placement(self) -> None:
        """
        During startup_grace nothing is placed, so agents still
        reconnecting do not get duplicates of what they run.
        """
        from dataclasses import replace

        self.make(make_model(low=1), settings=replace(SETTINGS, startup_grace=10))
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.clock.advance(10)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)

    def test_changed_profile_not_adopted(self) -> None:
        """
        An engine started from another source than the catalog's profile
        now names (the catalog changed during a restart) is stopped and a
        new replica placed; one without the fields (an older agent) is
        adopted.
        """
        self.make(make_model(low=1), nodes=())
        old = self._running("m-aaaa-0")
        old.engine, old.source = "sim", "old-checkpoint"
        self.register("n1", shards=(old,))
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), ["m-aaaa-0"])
        self.assertEqual(len(self.agents.starts()), 1)
        self.make(make_model(low=1), nodes=())
        self.register("n1", shards=(self._running("m-bbbb-0"),))
        self.plane.reconcile()
        self.assertEqual((self.agents.stops(), self.agents.starts()), ([], []))

    def test_foreign_shard_refused(self) -> None:
        """
        A node listing a shard id recorded on another node, or a rank its
        profile does not have, gets it stopped; the real one is untouched.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (node, start) = self.agents.starts()[0]
        # n1's shard id, under a replica of its own.
        stolen = self._running(start.shard_id)
        stolen.replica_id = "m-elsewhere"
        bad_rank = self._running("m-cccc-1", rank=1)
        self.register("n2", shards=(stolen, bad_rank))
        self.plane.reconcile()
        self.assertEqual(
            sorted(self.agents.stops()), sorted([start.shard_id, "m-cccc-1"])
        )
        self.assertEqual(
            [n for n, m in self.agents.sent if m.WhichOneof("kind") == "stop_shard"],
            ["n2", "n2"],
        )
        replica = self.plane.replicas[start.replica_id]
        self.assertEqual([(s.node, s.state) for s in replica.shards], [("n1", "ready")])
        self.assertEqual(len(self.endpoints()), 1)

    def test_surplus_after_adoption_drained(self) -> None:
        """
        Two adopted replicas of a model with max_replicas = 1: the one not
        ready goes.
        """
        self.make(make_model(low=1, high=1), nodes=())
        starting = self._running("m-bbbb-0")
        starting.state = pb.SHARD_STATE_STARTING
        self.register("n1", shards=(self._running("m-aaaa-0"),))
        self.register("n2", shards=(starting,))
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), ["m-bbbb-0"])
        self.assertEqual(self.agents.starts(), [])

    def test_adopted_on_draining_node_drained(self) -> None:
        """
        A draining node whose link comes back listing a shard (its replica
        was forgotten when the node went lost): the adopted replica is
        drained and stopped, never published.
        """
        self.make(make_model(low=1), nodes=())
        self.register("n1")
        self.plane.drain_node("n1")
        self.register("n1", shards=(self._running("m-aaaa-0"),))
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), [])
        self.assertEqual(self.agents.stops(), ["m-aaaa-0"])
        self.assertEqual(self.agents.starts(), [])
