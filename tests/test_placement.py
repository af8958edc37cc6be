"""
Placement, table-driven: each case is an inventory, the profiles, and the
expected plan or explanation.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.placement import (
    Fleet,
    GpuView,
    NodeView,
    NoFit,
    Plan,
    Profile,
    _place_one_node,
    _scan,
    place,
)

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
        cases: list[
            tuple[
                str,
                list[Profile],
                list[NodeView],
                list[tuple[str, tuple[int, ...], int]],
                str | None,
            ]
        ] = [
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
                "profile two: gpu-01: needs 2 GPUs, 1 usable: 1 allocated",
                "profile two: gpu-02: unreachable",
                "profile two: gpu-03: no GPU has 40 GB",
                "profile two: gpu-04: needs 2 GPUs, 1 usable: 1 with problems",
                "profile two: gpu-05: no free port in 8000-8009",
                "profile two: gpu-06: has 0 GPUs, needs 2",
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

    def test_memory_of_others_never_free(self) -> None:
        """
        Memory held by processes llmgw does not manage is never free, even
        where a what-if (an eviction) counts less memory in use than they
        hold; the explanation names the GPU and what they hold.
        """
        others = GpuView(0, "gpu", H100, memory_used_mib=0, foreign_used_mib=30 * 1024)
        self.assertEqual(others.free_mib, H100 - 30 * 1024)
        sixty = Profile("sixty", "vllm", "m", gpus=1, gpu_memory_gb=60)
        self.check(
            [sixty],
            [node("gpu-01", others)],
            [
                "profile sixty: gpu-01: needs 1 GPUs, 0 usable: 1 with under 60 GB"
                " free (GPU 0 30.0 GB used by processes llmgw does not manage)"
            ],
        )
        placed: list[tuple[str, tuple[int, ...], int]] = [("gpu-01", (0,), 8000)]
        self.check([ONE], [node("gpu-01", others)], placed)

    def test_explanation_says_free_gpus_are_fragmented(self) -> None:
        """
        Issue 14 case 10: a model that fits nowhere because its free GPUs
        are spread over nodes is explained so: enough usable GPUs in total,
        not enough on one node.  A node that is not ready does not count.
        """
        four = Profile("four", "vllm", "m", gpus=4, gpu_memory_gb=40)
        self.check(
            [four],
            [
                node("a", *busy(4, 2)),
                node("b", *busy(4, 1)),
                node("c", *gpus(4), state="unreachable"),
            ],
            [
                "profile four: a: needs 4 GPUs, 2 usable: 2 allocated",
                "profile four: b: needs 4 GPUs, 3 usable: 1 allocated",
                "profile four: c: unreachable",
                "profile four: 5 usable GPUs are free in total on 2 nodes, enough"
                " for 4, but no node has 4 of them: the free GPUs are fragmented",
            ],
        )
        # A gang of 2 nodes x 1 GPU with one node left: too few nodes, not
        # fragmented GPUs, so no such line.
        pair = Profile("pair", "vllm", "m", gpus=1, gpu_memory_gb=40, nodes=2)
        self.check(
            [pair],
            [node("a", *gpus(2)), node("b", *gpus(2), state="lost")],
            ["profile pair: b: lost", "profile pair: only 1 of 2 nodes fit"],
        )
        # Not enough in total: no such line.
        self.check(
            [four],
            [node("a", *busy(4, 2)), node("b", *busy(4, 3))],
            [
                "profile four: a: needs 4 GPUs, 2 usable: 2 allocated",
                "profile four: b: needs 4 GPUs, 1 usable: 3 allocated",
            ],
        )

    def test_spread(self) -> None:
        """
        Nodes already running the model are used only when no other fits,
        even when they are the tighter fit.
        """
        nodes = [node("a", *busy(2, 1)), node("b", *gpus(4))]
        result = place([ONE], nodes, PORTS, spread=frozenset({"a"}))
        assert isinstance(result, Plan)
        self.assertEqual(result.shards[0].node, "b")
        result = place([ONE], nodes, PORTS, spread=frozenset({"a", "b"}))
        assert isinstance(result, Plan)
        self.assertEqual(result.shards[0].node, "a")
        result = place([ONE], nodes, PORTS)
        assert isinstance(result, Plan)
        self.assertEqual(result.shards[0].node, "a")


_gpu = st.builds(
    lambda total, used, problem, allocated: (total, used, problem, allocated),
    st.sampled_from([L4, H100, 144384]),
    st.integers(0, 30000),
    st.booleans(),
    st.booleans(),
)
_node = st.tuples(
    st.sampled_from(["ready", "ready", "ready", "unreachable"]),
    st.lists(_gpu, max_size=8),
    st.booleans(),
)


class FleetIndexTests(SynchronousTestCase):
    @given(
        st.lists(_node, max_size=12),
        st.integers(0, 4),
        st.sampled_from([0, 10, 40, 100]),
        st.sets(st.integers(0, 11)),
    )
    @settings(max_examples=300, deadline=None)
    def test_index_agrees_with_scan(
        self,
        specs: list[tuple[str, list[tuple[int, int, bool, bool]], bool]],
        count: int,
        memory: int,
        spread_at: set[int],
    ) -> None:
        """
        The indexed path for one node finds a place exactly when looking at
        every node does, and picks a node with the fewest free GPUs left
        among those that fit, outside C{spread} when any is.
        """
        nodes = [
            NodeView(
                id=f"n{i:02d}",
                state=state,
                gpus=tuple(
                    GpuView(
                        index=g,
                        name="gpu",
                        memory_total_mib=total,
                        memory_used_mib=min(used, total),
                        problems=("xid 79",) if problem else (),
                        allocated=allocated,
                    )
                    for g, (total, used, problem, allocated) in enumerate(devices)
                ),
                ports_in_use=frozenset(PORTS) if full else frozenset(),
            )
            for i, (state, devices, full) in enumerate(specs)
        ]
        spread = frozenset(f"n{i:02d}" for i in spread_at)
        profile = Profile(
            "p",
            "vllm",
            "m",
            gpus=count,
            gpu_memory_gb=memory if count else 0,
        )
        fleet = Fleet(nodes)
        fast = _place_one_node(profile, fleet, PORTS, spread)
        scanned, _ = _scan(profile, fleet, PORTS, spread)
        self.assertEqual(fast is None, scanned is None)
        if fast is None:
            return

        def free(view: NodeView) -> int:
            return sum(1 for g in view.gpus if not g.allocated and not g.problems)

        fitting = [
            n for n in nodes if _scan(profile, Fleet([n]), PORTS, frozenset())[0]
        ]
        outside = [n for n in fitting if n.id not in spread]
        pool = outside or fitting
        chosen = next(n for n in nodes if n.id == fast.shards[0].node)
        self.assertIn(chosen, pool)
        self.assertEqual(free(chosen), min(free(n) for n in pool))
