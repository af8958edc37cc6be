"""
A start's phases as the agent measures them (L{llmgw.agent.phases}) on a
L{Clock}, and vLLM's log lines read for its details.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.phases import StartPhases, log_details

VLLM_LOG = b"\n".join(
    [
        b"INFO [gpu_model_runner.py:1800] Loading weights took 3.2100 seconds",
        b"INFO [gpu_model_runner.py:1820] Model loading took 0.9400 GiB"
        b" and 4.001234 seconds",
        b"INFO [monitor.py:34] torch.compile takes 15.31 s in total",
        b"INFO [gpu_model_runner.py:2300] Graph capturing finished in 9 secs,"
        b" took 0.45 GiB",
        b"INFO [core.py:200] init engine (profile, create kv cache, warmup"
        b" model) took 28.40 seconds",
    ]
)


class StartPhasesTests(SynchronousTestCase):
    def test_phases_in_order(self) -> None:
        """
        Each phase lasts from the mark before to its own; a phase marked
        twice keeps its first time; an unmarked one lasts 0 s.
        """
        clock = Clock()
        phases = StartPhases(clock)
        clock.advance(0.5)
        phases.mark("launched")
        clock.advance(10)
        phases.mark("port_open")
        clock.advance(1)
        phases.mark("port_open")
        clock.advance(2)
        phases.mark("ready")
        got = [(p.name, p.seconds, p.detail) for p in phases.report("/nonexistent")]
        self.assertEqual(
            got,
            [
                ("launched", 0.5, False),
                ("port_open", 10.0, False),
                ("model_listed", 0.0, False),
                ("ready", 3.0, False),
            ],
        )

    def test_vllm_log_details(self) -> None:
        """
        vLLM's lines about loading the weights, compiling and capturing
        CUDA graphs become details, in seconds.
        """
        path = self.mktemp()
        with open(path, "wb") as f:
            f.write(VLLM_LOG)
        self.assertEqual(
            log_details(path),
            [
                ("vllm_load_weights", 3.21),
                ("vllm_model_loading", 4.001234),
                ("vllm_compile", 15.31),
                ("vllm_cuda_graphs", 9.0),
                ("vllm_engine_init", 28.4),
            ],
        )
        self.assertEqual(log_details(path + ".missing"), [])
