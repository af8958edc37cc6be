"""
A sleeper's GPU memory as the GPU reports it (issue 36 item 2) on a
control plane on a L{Clock}: what a sleeping engine keeps counts held,
and room a stop frees is free once the GPU reports it so; and a model no
node could ever hold (item 5) refused at once.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.logger import capturedLogs, formatEvent

from llmgw.control.catalog import Model
from llmgw.control.placement import Profile
from llmgw.router.interfaces import NeverPlaceable
from llmgw.wire import agent_pb2 as pb
from tests.test_plane_sleep import SleepCase, sleepy
from tests.test_plane_swaps import big


class MemoryCase(SleepCase):
    def used(self, gib: int) -> None:
        """
        Node C{n1}'s GPU reports C{gib} GiB used.
        """
        usage = pb.Heartbeat(gpus=[pb.GpuUsage(index=0, memory_used_mib=gib * 1024)])
        self.inventory.heartbeat("n1", usage, 0.0)


class SleeperMemoryTests(MemoryCase):
    def test_sleeper_keeps_its_memory(self) -> None:
        """
        Issue 36's case: C{xb} keeps 45 GB asleep on the one 80 GB GPU, so
        putting it to sleep makes no room for C{w} (60 GB): it is stopped
        instead, and C{w} is placed only once the GPU reports the memory
        free; asleep, C{xb} is counted to hold its 45 GB.
        """
        keeps = replace(sleepy("xb").profiles[0], sleep_gpu_memory_gb=45)
        self.setup(sleepy("xb", profiles=(keeps,)), big("w"))
        xb = self.serve("xb")
        self.status(xb + "-0", pb.SHARD_STATE_SLEEPING)
        for view in (self.plane.snapshot(), self.plane.live_snapshot()):
            (gpu,) = view.fleet.get("n1").gpus
            self.assertEqual((gpu.claimed_mib, gpu.free_mib), (45 * 1024, 35 * 1024))
        self.status(xb + "-0", pb.SHARD_STATE_READY)
        self.used(60)
        self.tick(10)
        self.plane.catalog.activate("w")
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.agents.stops(), [xb + "-0"])
        self.assertEqual(self.of("w"), [])
        self.stopped(xb)
        self.tick(1)
        self.tick(1)
        self.assertEqual(self.of("w"), [])
        self.used(0)
        self.tick(1)
        (w,) = self.of("w")
        self.assertEqual(self.plane.replicas[w].shards[0].gpus, (0,))


class UnplaceableTests(SleepCase):
    def test_activation_fails_at_once(self) -> None:
        """
        A model of 4 GPUs on one node of 1 GPU: its activation fails at
        once with L{NeverPlaceable} naming why, the model is not wanted,
        and the warning is logged once however many requests come.
        """
        four = replace(big("four"), profiles=(replace(big("x").profiles[0], gpus=4),))
        self.setup(four, big("fits"))
        with capturedLogs() as events:
            first = self.failureResultOf(
                self.plane.catalog.activate("four"), NeverPlaceable
            )
            self.failureResultOf(self.plane.catalog.activate("four"), NeverPlaceable)
        self.assertEqual(
            first.value.why,
            "profile p: it needs 4 GPUs on one node, the most any node has is 1",
        )
        warned = [
            formatEvent(e) for e in events if "can never be placed" in formatEvent(e)
        ]
        self.assertEqual(len(warned), 1)
        self.assertEqual(self.plane.catalog["four"].wanted, 0)
        self.assertIsNone(self.plane.catalog.unplaceable("fits"))
        self.assertNoResult(self.plane.catalog.activate("fits"))

    def test_added_model_warned(self) -> None:
        """
        A model added at run time that no node could hold is warned about
        as it is added.
        """
        self.setup(big("a"))
        huge = replace(
            big("huge"), profiles=(replace(big("x").profiles[0], gpu_memory_gb=100),)
        )
        with capturedLogs() as events:
            self.plane.catalog.add(huge)
        (warned,) = [formatEvent(e) for e in events if "never" in formatEvent(e)]
        self.assertIn("it needs 100 GB on a GPU, the largest GPU has 80 GB", warned)


def shared(name: str, gb: float) -> Model:
    """
    @return: a model of C{gb} GB on a shared GPU, min_replicas 0, max 1.
    """
    profile = Profile("p", "sim", "s", gpus=1, gpu_memory_gb=gb, share_gpu=True)
    return replace(big(name), profiles=(profile,))


class StaleReportTests(MemoryCase):
    def idle(self, seconds: float) -> None:
        """
        C{seconds} pass with the agent heard (its link's messages) but no
        memory report; then a pass.
        """
        self.clock.advance(seconds)
        self.inventory.heard("n1", self.clock.seconds())
        self.plane.reconcile()

    def test_stop_held_until_reported(self) -> None:
        """
        The mixed bench's case: C{p} (20 GB) runs and the GPU reports 20
        GB; C{q} (20 GB) starts beside it before the next report; C{p}
        stops.  The report (20 GB, taken before C{q}) and what llmgw
        counts (C{q}'s 20 GB) would each say 60 GB free, but C{p}'s 20 GB
        is not reported free yet: C{r} (47 GB) waits for two reports,
        then is placed.
        """
        self.setup(shared("p", 20), shared("q", 20), shared("r", 47))
        p = self.serve("p")
        self.used(20)
        self.idle(300)
        self.serve("q")
        self.idle(301)
        self.assertEqual(self.agents.stops(), [p + "-0"])
        self.stopped(p)
        self.plane.reconcile()
        self.plane.catalog.activate("r")
        self.plane.reconcile()
        self.assertEqual(self.of("r"), [])
        (gpu,) = self.plane.live_snapshot().fleet.get("n1").gpus
        self.assertEqual(gpu.claimed_mib, 40 * 1024)
        self.heartbeat("n1")
        self.clock.advance(self.plane.settings.interval)
        self.plane.reconcile()
        self.assertEqual(self.of("r"), [])
        self.heartbeat("n1")
        self.clock.advance(self.plane.settings.interval)
        self.plane.reconcile()
        (r,) = self.of("r")
        self.assertEqual(self.plane.replicas[r].shards[0].gpus, (0,))
