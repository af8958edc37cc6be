"""
The control plane scaling models: activation from zero, load, idleness,
bounds, backoff (see L{tests.plane_support}).
"""

from __future__ import annotations

from llmgw.control.views import models_json
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, PlaneCase, make_model


class ActivationTests(PlaneCase):
    def test_scale_from_zero_and_back(self) -> None:
        """
        min_replicas = 0: nothing runs until activate(); its Deferred fires
        when the replica is ready; idle for idle_timeout with nothing in
        flight, the replica is drained and stopped.
        """
        self.make(make_model(low=0, idle=60), nodes=("n1",))
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        waiting = self.plane.catalog.activate("m-alias")
        self.assertNoResult(waiting)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.ready_all()
        self.plane.reconcile()
        self.successResultOf(waiting)
        replica = next(iter(self.plane.replicas))
        self.clock.advance(30)
        self.heartbeat("n1")
        self.plane.catalog.touch("m")
        self.clock.advance(59)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[replica] = 1
        self.clock.advance(2)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[replica] = 0
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), [])
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [replica + "-0"])

    def test_scale_with_load(self) -> None:
        """
        More requests in flight per ready replica than scale_up_in_flight
        (8): one replica more, up to max_replicas, not while one is
        starting; light load for idle_timeout: one fewer, down to
        min_replicas.
        """
        self.make(make_model(low=1, high=2, idle=60))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (first,) = self.plane.replicas
        self.in_flight[first] = 8
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.in_flight[first] = 9
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
        self.ready_all()
        self.in_flight[first] = 40
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)  # max_replicas
        self.assertEqual(len(self.endpoints()), 2)
        self.in_flight[first] = 0
        self.clock.advance(59)
        self.heartbeat("n1", "n2")
        self.plane.catalog.touch("m")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.clock.advance(2)
        self.heartbeat("n1", "n2")
        self.plane.catalog.touch("m")
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)

    def test_unknown_model(self) -> None:
        """
        Names outside the catalog start nothing.
        """
        self.make()
        self.assertIsNone(self.plane.catalog.resolve("other"))
        self.assertRaises(KeyError, self.plane.catalog.activate, "other")

    def test_cancel_waiting(self) -> None:
        """
        A cancelled wait (client gone, timeout) leaves no waiter behind.
        """
        self.make(make_model(low=0), nodes=())
        waiting = self.plane.catalog.activate("m")
        waiting.cancel()
        self.failureResultOf(waiting)
        self.assertEqual(models_json(self.plane)[0]["waiting_requests"], 0)


class SecondReviewTests(PlaneCase):
    """
    Cases a second adversarial review found.
    """

    def _running(self, shard: str) -> pb.RunningShard:
        return pb.RunningShard(
            shard_id=shard,
            replica_id=shard.rsplit("-", 1)[0],
            model="m",
            profile="one",
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=5,
        )

    def test_adopted_above_min_kept(self) -> None:
        """
        After a restart, a replica adopted above min_replicas (it ran
        because of traffic) is not drained at the end of the grace.
        """
        from dataclasses import replace

        self.make(
            make_model(low=0, idle=600),
            nodes=(),
            settings=replace(SETTINGS, startup_grace=5),
        )
        self.register("n1", shards=(self._running("m-aaaa-0"),))
        self.plane.reconcile()
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(len(self.endpoints()), 1)

    def test_lower_min_does_not_stop_at_once(self) -> None:
        """
        Scaling min_replicas down lets the model idle down later; the
        replica in use is not drained now.
        """
        self.make(make_model(low=1, idle=60), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.scale("m", 0, 4)
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.clock.advance(61)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)

    def test_lost_stop_sent_again(self) -> None:
        """
        A drain whose StopShard could not be delivered sends it again.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        self.agents.refuse["n1"] = ""
        # Its only node has no room for a replacement: forced.
        self.plane.drain_replica(replica, force=True)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)
        del self.agents.refuse["n1"]
        self.clock.advance(41)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 2)

    def test_backoff_holds_beside_a_ready_replica(self) -> None:
        """
        A second replica that keeps failing is retried with a growing
        backoff even while the first is ready.
        """
        self.make(make_model(low=2), nodes=("n1", "n2"))
        self.plane.reconcile()
        first, second = self.agents.starts()
        self.status(first[1].shard_id, pb.SHARD_STATE_READY)
        self.agents.refuse[second[0]] = ""
        self.status(second[1].shard_id, pb.SHARD_STATE_FAILED)
        for _ in range(60):
            self.clock.advance(1)
            self.heartbeat("n1", "n2")
            self.plane.reconcile()
        # 5 s, 10 s, 20 s, then 40 s: at most 4 more tries in a minute.
        self.assertLessEqual(len(self.agents.starts()), 2 + 4)

    def test_least_loaded_drained_first(self) -> None:
        """
        Scaling down drains the replica with the fewest requests in
        flight.
        """
        self.make(make_model(low=1), nodes=("n1", "n2"))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (busy,) = self.plane.replicas
        self.clock.advance(5)
        self.heartbeat("n1", "n2")
        self.plane.scale("m", 2, 2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (idle,) = set(self.plane.replicas) - {busy}
        # The oldest carries the load.
        self.in_flight[busy] = 3
        self.plane.scale("m", 1, 1)
        self.plane.reconcile()
        draining = [r.id for r in self.plane.replicas.values() if r.draining_since]
        self.assertEqual(draining, [idle])
