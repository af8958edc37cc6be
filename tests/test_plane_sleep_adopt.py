"""
Engines in sleep mode adopted by a restarted control plane (issue 25 item
2, with L{tests.test_plane_sleep}'s set-ups): one listed asleep stays
asleep; one listed starting (its agent had only the marker, which says
awake) and then found asleep gives back what its adoption added to its
model's C{wanted}, as the agent's status or a later Register says, never
below what stays awake.  The real agent's check is in
L{tests.test_e2e_sleep}.
"""

from __future__ import annotations

from llmgw.wire import agent_pb2 as pb
from tests.test_plane_sleep import SleepCase, running_a, sleepy


class AdoptedSleeperTests(SleepCase):
    def adopt(self, state: int, *more: tuple[int, int]) -> None:
        """
        Node C{n1} registers with shard C{a-1-0} of model C{a} running on
        its GPU 0, listed in C{state}; and, for each C{(gpu, state)} of
        C{more}, shard C{a-N-0} of replica C{a-N} (N from 2) on that GPU.
        """
        listed = ((0, state), *more)
        shards = tuple(running_a(n, gpu, st) for n, (gpu, st) in enumerate(listed, 1))
        self.node("n1", shards=shards, gpus=len(listed))

    def test_adopted_asleep_stays_asleep(self) -> None:
        """
        A server restarted finds a shard asleep in a Register: adopted, it
        is not woken without a request.
        """
        self.make(sleepy("a"), nodes=())
        self.adopt(pb.SHARD_STATE_SLEEPING)
        for _ in range(3):
            self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [])
        self.assertTrue(self.plane.replicas["a-1"].asleep)

    def test_adopted_by_its_marker_found_asleep(self) -> None:
        """
        A shard adopted as starting (its agent had only the marker, which
        says awake) that its agent then finds asleep is not counted as
        wanted awake: it is not woken without a request, and no replica is
        started in its place.
        """
        self.make(sleepy("a"), nodes=())
        self.adopt(pb.SHARD_STATE_STARTING)
        self.tick(1)
        self.status("a-1-0", pb.SHARD_STATE_SLEEPING, "n1")
        for _ in range(3):
            self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [])
        self.assertEqual(self.sent("start_shard"), [])
        self.assertTrue(self.plane.replicas["a-1"].asleep)
        self.assertEqual(self.plane.catalog["a"].wanted, 0)

    def test_adopted_by_its_marker_found_asleep_over_max(self) -> None:
        """
        Two replicas adopted where C{max_replicas} is 1: the one listed
        starting raised C{wanted} to 1, the ready one added nothing, and
        the first is drained as the surplus.  Found asleep meanwhile, it
        gives nothing back: the one still awake is wanted and is not put
        to sleep.
        """
        self.make(sleepy("a"), nodes=())
        self.adopt(pb.SHARD_STATE_STARTING, (1, pb.SHARD_STATE_READY))
        self.tick(1)
        self.assertEqual(self.agents.stops(), ["a-1-0"])
        self.status("a-1-0", pb.SHARD_STATE_SLEEPING, "n1")
        for _ in range(5):
            self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.plane.catalog["a"].wanted, 1)
        self.assertEqual(self.plane.replicas["a-2"].state, "ready")

    def test_adopted_by_its_marker_found_asleep_listed_again(self) -> None:
        """
        The agent's link went down before the check's answer reached the
        server: the agent registers again listing the shard asleep, and
        that answer counts as the status would.
        """
        self.make(sleepy("a"), nodes=())
        self.adopt(pb.SHARD_STATE_STARTING)
        self.tick(1)
        self.adopt(pb.SHARD_STATE_SLEEPING)
        for _ in range(3):
            self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [])
        self.assertEqual(self.plane.catalog["a"].wanted, 0)

    def test_adopted_by_its_marker_found_asleep_min_replicas(self) -> None:
        """
        The same with C{min_replicas = 1}: the model wants one awake
        whatever its adoption added, so the sleeper found is woken, and no
        other replica is started.
        """
        self.make(sleepy("a", min_replicas=1), nodes=())
        self.adopt(pb.SHARD_STATE_STARTING)
        self.tick(1)
        self.status("a-1-0", pb.SHARD_STATE_SLEEPING, "n1")
        for _ in range(3):
            self.tick(1)
        self.assertEqual(self.sent("wake_shard"), ["a-1-0"])
        self.assertEqual(self.sent("start_shard"), [])

    def test_both_adopted_over_max_both_asleep(self) -> None:
        """
        Two replicas adopted as starting where C{max_replicas} is 1, the
        first drained as the surplus, both found asleep (in either order):
        neither is woken, and C{wanted} is 0.
        """
        for order in (("a-1-0", "a-2-0"), ("a-2-0", "a-1-0")):
            self.make(sleepy("a"), nodes=())
            self.adopt(pb.SHARD_STATE_STARTING, (1, pb.SHARD_STATE_STARTING))
            self.tick(1)
            self.assertEqual(self.agents.stops(), ["a-1-0"])
            for shard in order:
                self.status(shard, pb.SHARD_STATE_SLEEPING, "n1")
            for _ in range(5):
                self.tick(1)
            self.assertEqual(self.sent("wake_shard"), [])
            self.assertEqual(self.plane.catalog["a"].wanted, 0)
