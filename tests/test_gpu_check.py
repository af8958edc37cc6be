"""
C{scripts/gpu-check} (L{llmgw.agent.gpu_check}): against the fake NVML the
agent's tests use (no GPU here), and as a script on this machine, which has
no NVML.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.gpu_check import check
from tests.support import hermetic_env
from tests.test_agent_service import _NVMLError, fake_nvml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(nvml: Any) -> tuple[int, str]:
    out = io.StringIO()
    return check(nvml, out), out.getvalue()


class GpuCheckTests(SynchronousTestCase):
    def test_what_the_agent_reports(self) -> None:
        """
        Two GPUs: each with its name, UUID and memory as the agent
        registers them, Xid events supported; processes, NVLink and fabric
        where this NVML has them; exit status 0.
        """
        nvml = fake_nvml(count=2, used_mib=300)
        nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [
            SimpleNamespace(pid=4242, usedGpuMemory=2 * 1024**3)
        ]
        status, report = _run(nvml)
        self.assertEqual(status, 0, report)
        self.assertIn("2 GPUs, as the agent registers them:", report)
        self.assertIn("GPU 0: NVIDIA H200, GPU-0, 81920 MiB, 300 MiB used", report)
        self.assertIn("GPU 1: NVIDIA H200, GPU-1, 81920 MiB, 300 MiB used", report)
        self.assertEqual(report.count("xid events: yes"), 2)
        self.assertEqual(report.count("processes: pid 4242 2048 MiB"), 2)
        self.assertEqual(report.count("nvlink: not in this pynvml"), 2)
        self.assertTrue(report.endswith("gpu-check: ok\n"), report)

    def test_nvlink_and_fabric(self) -> None:
        """
        NVLink: the links that answer, active or not; fabric state and
        status as NVML gives them; a GPU without them is not a failure.
        """
        nvml = fake_nvml(count=1)

        def link(handle: int, index: int) -> int:
            if index >= 4:
                raise _NVMLError(2)
            return 1 if index < 3 else 0

        nvml.nvmlDeviceGetNvLinkState = link
        nvml.nvmlDeviceGetGpuFabricInfo = lambda h: SimpleNamespace(state=3, status=0)
        status, report = _run(nvml)
        self.assertEqual(status, 0, report)
        self.assertIn("nvlink: 3 of 4 links active", report)
        self.assertIn("fabric: state 3, status 0", report)
        nvml.nvmlDeviceGetNvLinkState = lambda h, i: (_ for _ in ()).throw(
            _NVMLError(3)
        )
        status, report = _run(nvml)
        self.assertEqual(status, 0, report)
        self.assertIn("nvlink: not supported", report)

    def test_unreadable_gpu_fails(self) -> None:
        """
        A GPU whose memory NVML cannot read once listed (as one that falls
        off the bus): the problem the agent would report, named, and exit
        status 1.
        """
        nvml = fake_nvml(count=2)
        listed: set[int] = set()

        def memory(handle: int) -> Any:
            if handle in listed:
                if handle == 1:
                    raise _NVMLError(15)
            listed.add(handle)
            return SimpleNamespace(total=80 * 1024**3, used=0)

        nvml.nvmlDeviceGetMemoryInfo = memory
        status, report = _run(nvml)
        self.assertEqual(status, 1, report)
        self.assertIn(
            "GPU 1: NVIDIA H200, GPU-1, 81920 MiB, 0 MiB used\n"
            "  FAILED: nvml memory info: error 15",
            report,
        )
        self.assertTrue(report.endswith("gpu-check: 1 FAILED\n"), report)

    def test_no_xid_events_fails(self) -> None:
        """
        NVML that cannot deliver Xid events: the agent would miss a GPU's
        errors, so that is a failure too.
        """
        nvml = fake_nvml(count=1)
        nvml.nvmlDeviceRegisterEvents = lambda h, kinds, events: (_ for _ in ()).throw(
            _NVMLError(3)
        )
        status, report = _run(nvml)
        self.assertEqual(status, 1, report)
        self.assertIn("FAILED: xid events: not supported", report)

    def test_no_nvml_here(self) -> None:
        """
        The script on this machine (no NVIDIA driver): it says NVML is not
        available and exits 1.
        """
        done = subprocess.run(
            [os.path.join(ROOT, "scripts", "gpu-check")],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **hermetic_env(),
                "VENV": os.path.dirname(os.path.dirname(sys.executable)),
            },
        )
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("FAILED: NVML is not available", done.stdout)
