"""
A sleeper's GPU memory as the GPU reports it (issue 36 item 2) on a
control plane on a L{Clock}: what a sleeping engine keeps counts held,
and room a stop frees is free once the GPU reports it so.
"""

from __future__ import annotations

from dataclasses import replace

from llmgw.wire import agent_pb2 as pb
from tests.test_plane_sleep import SleepCase, sleepy
from tests.test_plane_swaps import big


class SleeperMemoryTests(SleepCase):
    def used(self, gib: int) -> None:
        """
        Node C{n1}'s GPU reports C{gib} GiB used.
        """
        usage = pb.Heartbeat(gpus=[pb.GpuUsage(index=0, memory_used_mib=gib * 1024)])
        self.inventory.heartbeat("n1", usage, 0.0)

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
