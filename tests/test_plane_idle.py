"""
Scale-down that waits for streams, and requests in flight to a replica
that went away cut at once (issue 14 cases 3 and 5), on a control plane on
a L{Clock} (see L{tests.plane_support}); idleness from completions is in
L{tests.test_router_faults}, through the router.
"""

from __future__ import annotations

from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase, make_model


class IdleFromCompletionTests(PlaneCase):
    def tick(self, seconds: int, *nodes: str) -> None:
        for _ in range(seconds):
            self.clock.advance(1)
            self.heartbeat(*nodes)
            self.plane.reconcile()

    def test_light_load_drains_the_idle_replica(self) -> None:
        """
        Light load for idle_timeout: 2 replicas go to 1, and the one
        drained is the idle one, not the one with a stream.
        """
        self.make(make_model(low=1, high=2, idle=100), nodes=("n1", "n2"))
        self.plane.scale("m", 2, 2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        first, second = sorted(self.plane.replicas)
        self.plane.scale("m", 1, 2)
        self.in_flight[first] = 1
        self.tick(101, "n1", "n2")
        draining = [r.id for r in self.plane.replicas.values() if r.draining_since]
        self.assertEqual(draining, [second])
        self.assertEqual(self.agents.stops(), [second + "-0"])
        self.assertEqual(self.cuts, [])

    def busy_pair(self, leave_timeout: float = 1800.0) -> str:
        """
        Two replicas each carrying a stream when the load is light long
        enough (idle_timeout 100 s) to drop one.

        @return: the id of the one drained.
        """
        self.make(
            make_model(low=1, high=2, idle=100),
            nodes=("n1", "n2"),
            leave_timeout=leave_timeout,
        )
        self.plane.scale("m", 2, 2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.scale("m", 1, 2)
        for replica in self.plane.replicas:
            self.in_flight[replica] = 1
        self.tick(101, "n1", "n2")
        (drained,) = [r.id for r in self.plane.replicas.values() if r.draining_since]
        return drained

    def test_busy_surplus_leaves_when_its_stream_ends(self) -> None:
        """
        The replica drained by a scale-down keeps its stream past
        drain_timeout (30 s) and idle_timeout (100 s), and is stopped once
        it ends, nothing cut.
        """
        drained = self.busy_pair()
        self.tick(300, "n1", "n2")
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[drained] = 0
        self.tick(1, "n1", "n2")
        self.assertEqual(self.agents.stops(), [drained + "-0"])
        self.assertEqual(self.cuts, [])

    def test_busy_surplus_bounded_by_total_timeout(self) -> None:
        """
        A stream that never ends is cut at the router's total_timeout
        (here 400 s), not at drain_timeout.
        """
        drained = self.busy_pair(leave_timeout=400)
        self.tick(390, "n1", "n2")
        self.assertEqual(self.agents.stops(), [])
        self.tick(11, "n1", "n2")
        self.assertEqual(self.agents.stops(), [drained + "-0"])
        self.assertEqual(self.cuts, [(drained, "its drain ran out of time (400s)")])


class CutTests(PlaneCase):
    """
    Requests in flight to a replica that went away are cut by the plane.
    """

    def test_lost_node_cuts_its_streams(self) -> None:
        """
        A replica whose node is lost has what is in flight to it cut when
        the node is declared lost.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        self.in_flight[replica] = 2
        self.clock.advance(59)
        self.plane.reconcile()
        self.assertEqual(self.cuts, [])
        self.clock.advance(2)
        self.plane.reconcile()
        self.assertEqual(self.cuts, [(replica, "its node was lost")])

    def test_engine_exit_cuts_its_streams(self) -> None:
        """
        A replica whose engine exited has what is in flight to it cut.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        self.in_flight[replica] = 1
        self.status(replica + "-0", pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        self.assertEqual(self.cuts, [(replica, "its engine exited")])

    def test_drain_past_timeout_cuts(self) -> None:
        """
        An operator's drain of a node whose link is then cut: at
        drain_timeout the streams are cut, not left to the router's idle
        deadline; a drain that ends in time cuts nothing.
        """
        self.make(make_model(low=1), nodes=("n1", "n2"))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        node = self.plane.replicas[replica].shards[0].node
        self.in_flight[replica] = 1
        self.plane.drain_node(node)
        # Replaced first: its drain begins once the replacement is ready.
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[replica].draining_since)
        self.clock.advance(29)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(self.cuts, [])
        self.clock.advance(2)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(self.cuts, [(replica, "its drain ran out of time (30s)")])
