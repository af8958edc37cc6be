"""
Placement, table-driven: each case is an inventory, the profiles, and the
expected plan or explanation.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.placement import GpuView, NodeView, NoFit, Plan, Profile, place

PORTS = range(8000, 8010)
H100 = 81559  # MiB, as NVML reports an 80 GB H100
L4 = 23034


def gpus(count: int, total: int = H100, **kwargs: object) -> tuple[GpuView, ...]:
    return tuple(
        GpuView(index=i, name="gpu", memory_total_mib=total, **kwargs)  # type: ignore[arg-type]
        for i in range(count)
    )


def node(id: str, *devices: GpuView, **kwargs: object) -> NodeView:
    return NodeView(id=id, state=kwargs.pop("state", "ready"), gpus=devices, **kwargs)  # type: ignore[arg-type]


def busy(count: int, taken: int) -> tuple[GpuView, ...]:
    return tuple(
        GpuView(index=i, name="gpu", memory_total_mib=H100, allocated=i < taken)
        for i in range(count)
    )


ONE = Profile("one", "vllm", "m", gpus=1, gpu_memory_gb=40)
TWO = Profile("two", "vllm", "m", gpus=2, gpu_memory_gb=40)
CPU = Profile("cpu", "llamacpp", "m.gguf")
GANG = Profile("gang", "sglang", "m", gpus=8, gpu_memory_gb=70, nodes=2, fabric="ib-a")


class PlacementTests(SynchronousTestCase):
    def check(
        self,
        profiles: list[Profile],
        nodes: list[NodeView],
        expected: list[tuple[str, tuple[int, ...], int]] | list[str],
        profile: str | None = None,
    ) -> None:
        result = place(profiles, nodes, PORTS)
        if isinstance(result, Plan):
            self.assertEqual(
                [(s.node, s.gpus, s.port) for s in result.shards], expected, result
            )
            self.assertEqual(
                [s.rank for s in result.shards], list(range(len(expected)))
            )
            if profile is not None:
                self.assertEqual(result.profile.name, profile)
        else:
            assert isinstance(result, NoFit)
            self.assertEqual(result.lines(), expected)

    def test_table(self) -> None:
        cases: list[tuple[str, list[Profile], list[NodeView], list, str | None]] = [
            (
                "fit: one GPU on the only node",
                [ONE],
                [node("a", *gpus(1))],
                [("a", (0,), 8000)],
                "one",
            ),
            (
                "fragmentation: the node with just enough free GPUs, not the empty one",
                [TWO],
                [node("a", *gpus(8)), node("b", *busy(4, 2))],
                [("b", (2, 3), 8000)],
                None,
            ),
            (
                "heterogeneous: an L4 has too little memory, the H100 node fits",
                [ONE],
                [node("a", *gpus(4, total=L4)), node("b", *gpus(1))],
                [("b", (0,), 8000)],
                None,
            ),
            (
                "tightest GPU within a node: the one with least free memory that fits",
                [ONE],
                [
                    node(
                        "a",
                        GpuView(0, "gpu", H100, memory_used_mib=0),
                        GpuView(1, "gpu", H100, memory_used_mib=30000),
                    )
                ],
                [("a", (1,), 8000)],
                None,
            ),
            (
                "GPUs with problems are not used",
                [TWO],
                [
                    node(
                        "a",
                        GpuView(0, "gpu", H100, problems=("xid 79",)),
                        *gpus(2)[1:],
                        GpuView(2, "gpu", H100),
                    )
                ],
                [("a", (1, 2), 8000)],
                None,
            ),
            (
                "ports in use are skipped",
                [ONE],
                [node("a", *gpus(1), ports_in_use=frozenset({8000, 8001}))],
                [("a", (0,), 8002)],
                None,
            ),
            (
                "CPU profile on any ready node",
                [CPU],
                [node("a", state="unreachable"), node("b")],
                [("b", (), 8000)],
                None,
            ),
            (
                "priority: the preferred profile first, the next when it fits nowhere",
                [
                    ONE,
                    Profile("big", "vllm", "m", gpus=4, gpu_memory_gb=70, priority=9),
                ],
                [node("a", *gpus(2))],
                [("a", (0,), 8000)],
                "one",
            ),
            (
                "two-node gang on the shared fabric; the node off it is passed over",
                [GANG],
                [
                    node("a", *gpus(8), fabrics=frozenset({"ib-a"})),
                    node("b", *gpus(8), fabrics=frozenset({"ib-b"})),
                    node("c", *gpus(8), fabrics=frozenset({"ib-a", "eth"})),
                ],
                [("a", tuple(range(8)), 8000), ("c", tuple(range(8)), 8000)],
                None,
            ),
        ]
        for name, profiles, nodes, expected, profile in cases:
            with self.subTest(name):
                self.check(profiles, nodes, expected, profile)

    def test_explanations(self) -> None:
        """
        When nothing fits, each node says why, per profile tried.
        """
        self.check(
            [TWO],
            [
                node("gpu-01", *busy(2, 1)),
                node("gpu-02", *gpus(2), state="unreachable"),
                node("gpu-03", *gpus(4, total=L4)),
                node("gpu-04", GpuView(0, "gpu", H100, problems=("ecc",)), *gpus(1)),
                node("gpu-05", *gpus(2), ports_in_use=frozenset(PORTS)),
                node("gpu-06"),
            ],
            [
                "profile two: gpu-01: 1 of 2 GPUs free, 1 allocated",
                "profile two: gpu-02: unreachable",
                "profile two: gpu-03: 0 of 2 GPUs free, 4 with under 40 GB free",
                "profile two: gpu-04: 1 of 2 GPUs free, 1 with problems",
                "profile two: gpu-05: no free port in 8000-8009",
                "profile two: gpu-06: 0 of 2 GPUs free, no GPUs",
            ],
        )
        self.check(
            [GANG],
            [
                node("a", *gpus(8), fabrics=frozenset({"ib-a"})),
                node("b", *gpus(8), fabrics=frozenset({"ib-b"})),
            ],
            [
                "profile gang: b: not on fabric ib-a",
                "profile gang: only 1 of 2 nodes fit on fabric ib-a",
            ],
        )
        self.check([ONE], [], ["profile one: no nodes"])
