"""
A sleeper whose wake its agent refuses with C{gpus_in_use} (another
engine still holds its GPUs), on a control plane on a L{Clock} (the
set-ups of L{tests.test_plane_sleep}): it sleeps on and waits a backoff of
its own, doubling; another sleeper or a start elsewhere may serve the
held request meanwhile; after C{WAKE_REFUSALS} in a row it is stopped.
"""

from __future__ import annotations

from llmgw.control.sleeping import WAKE_REFUSALS
from llmgw.wire import agent_pb2 as pb
from tests.test_plane_sleep import SleepCase, running_a, sleepy


class WakeRefusedTests(SleepCase):
    def test_wake_refused_gpus_in_use_sleeps_on(self) -> None:
        """
        The agent refuses the wake with C{gpus_in_use} (another engine
        still holds the GPUs there: a fact for placement, not the
        replica's failure): the replica is not stopped, it sleeps on and
        is woken when the model tries again, after its backoff.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.tick(601)
        waiter = self.plane.catalog.activate("a")
        self.agents.refuse["n1"] = "gpus_in_use"
        self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        self.assertEqual(self.agents.stops(), [])
        self.assertTrue(self.plane.replicas[a].asleep)
        self.assertIsNone(self.plane.replicas[a].draining_since)
        del self.agents.refuse["n1"]
        for _ in range(5):
            self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"] * 2)
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(len(self.agents.starts()), 1)
        self.assertIsNone(self.successResultOf(waiter))

    def test_wake_refused_for_good_stops_it(self) -> None:
        """
        Refused every time, and placement would put a new replica on the
        refused GPUs (n1 goes before n2): nothing starts meanwhile; after
        C{WAKE_REFUSALS} refusals in a row (each waited out, the backoff
        doubling) the next stops it, as a failed wake, and a replica is
        started on the free node for the held request.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.tick(601)
        self.node("n2")
        self.tick(1)
        waiter = self.plane.catalog.activate("a")
        self.agents.refuse["n1"] = "gpus_in_use"
        for _ in range(60):
            self.tick(1)
            self.ready_all()
        self.assertEqual(self.sent("wake_shard"), [a + "-0"] * (WAKE_REFUSALS + 1))
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertEqual([n for n, _ in self.agents.starts()], ["n1", "n2"])
        self.assertIsNone(self.successResultOf(waiter))

    def test_wake_refused_another_sleeper_woken(self) -> None:
        """
        Two sleepers of the model, the wake of the first refused: the
        other is woken meanwhile, and the held request goes to it.
        """
        self.make(sleepy("a", max_replicas=2), nodes=())
        for n, node in enumerate(("n1", "n2"), 1):
            self.node(node, shards=(running_a(n, 0, pb.SHARD_STATE_SLEEPING),))
        self.tick(1)
        self.assertTrue(all(r.asleep for r in self.plane.replicas.values()))
        self.agents.refuse = {"n1": "gpus_in_use", "n2": "gpus_in_use"}
        waiter = self.plane.catalog.activate("a")
        self.tick(1)
        tried = self.sent("wake_shard")
        self.assertEqual(len(tried), 1)
        self.agents.refuse.clear()
        self.tick(1)
        self.assertEqual(len(self.sent("wake_shard")), 2)
        self.assertNotEqual(self.sent("wake_shard")[1], tried[0])
        self.assertIsNone(self.successResultOf(waiter))
        self.assertEqual(self.agents.stops(), [])

    def test_woken_after_refusals_then_asleep_again(self) -> None:
        """
        A sleeper refused three times, then woken by the operator and put
        back to sleep: its old wait is over, and the next request wakes
        it at once.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.tick(601)
        waiter = self.plane.catalog.activate("a")
        self.agents.refuse["n1"] = "gpus_in_use"
        while len(self.sent("wake_shard")) < 3:
            self.tick(1)
        del self.agents.refuse["n1"]
        self.tick(1)
        self.plane.wake_replica(a)
        self.tick(1)
        self.assertIsNone(self.successResultOf(waiter))
        self.plane.sleep_replica(a)
        self.tick(1)
        self.assertTrue(self.plane.replicas[a].asleep)
        self.tick(6)
        wakes = len(self.sent("wake_shard"))
        self.plane.catalog.activate("a")
        self.tick(1)
        self.assertEqual(len(self.sent("wake_shard")), wakes + 1)

    def test_refused_start_elsewhere(self) -> None:
        """
        The sleeper's wake refused, and a node free for a replica: the
        held request does not wait for the sleeper's next try; a replica
        starts on the free node (placement does not pick the GPUs
        refused).
        """
        self.setup(sleepy("a"))
        self.serve("a")
        self.tick(601)
        self.node("n0")
        self.tick(1)
        waiter = self.plane.catalog.activate("a")
        self.agents.refuse["n1"] = "gpus_in_use"
        for _ in range(3):
            self.tick(1)
            self.ready_all()
        self.assertEqual([n for n, _ in self.agents.starts()], ["n1", "n0"])
        self.assertEqual(len(self.sent("wake_shard")), 1)
        self.assertIsNone(self.successResultOf(waiter))
