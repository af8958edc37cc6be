"""
The sim's GPU memory given back by a sleep shows free only
C{--release-seconds} later (issue 36 item 2), as a real GPU's does once
the driver took it back and NVML read it.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.cli import build_parser
from llmgw.sim.sleep import SleepConfig, SleepMode


class ReleaseTests(SynchronousTestCase):
    def test_sleep_releases_late(self) -> None:
        """
        Asleep at level 1 after 1 s, the engine still holds its 20 GB for
        C{release_seconds} (2 s), then its 1.5 GB; without a delay, at once.
        """
        clock = Clock()
        config = SleepConfig(
            enabled=True,
            sleep_seconds=1.0,
            gpu_memory_gb=20.0,
            sleep_gpu_memory_gb=1.5,
            release_seconds=2.0,
        )
        mode = SleepMode(config, clock)
        done = mode.sleep(1)
        clock.advance(1.0)
        self.successResultOf(done)
        self.assertTrue(mode.asleep)
        self.assertEqual(mode.gpu_memory_gb, 20.0)
        clock.advance(1.9)
        self.assertEqual(mode.gpu_memory_gb, 20.0)
        clock.advance(0.1)
        self.assertEqual(mode.gpu_memory_gb, 1.5)
        prompt = SleepMode(SleepConfig(enabled=True, gpu_memory_gb=20.0), clock)
        slept = prompt.sleep(1)
        clock.advance(0)
        self.successResultOf(slept)
        self.assertEqual(prompt.gpu_memory_gb, 0.0)

    def test_flag(self) -> None:
        """
        C{llmgw sim --release-seconds} reads seconds, 0 by default.
        """
        p = build_parser()
        base = ["--port", "1", "--model", "m"]
        self.assertEqual(p.parse_args(base).release_seconds, 0.0)
        later = p.parse_args([*base, "--release-seconds", "1.5"])
        self.assertEqual(later.release_seconds, 1.5)
