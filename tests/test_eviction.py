"""
The eviction policy (L{llmgw.control.eviction}) as tables: which
candidates may go, in which order, and the smallest set that makes room.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.eviction import Candidate, Place, choose, eligible, freed
from llmgw.control.placement import GpuView, NodeView, Profile

NOW = 1000.0
BIG = Profile(name="big", engine="sim", source="s", gpus=1, gpu_memory_gb=60)
PAIR = Profile(name="pair", engine="sim", source="s", gpus=2, gpu_memory_gb=60)


def candidate(
    replica: str,
    model: str = "",
    node: str = "n1",
    gpu: int = 0,
    **kwargs: object,
) -> Candidate:
    fields: dict[str, object] = {
        "replica": replica,
        "model": model or replica,
        "priority": 0,
        "pinned": False,
        "min_resident": 5.0,
        "last_used": NOW - 100,
        "resident_since": NOW - 200,
        "in_flight": 0,
        "places": (Place(node, (gpu,), 20000 + gpu),),
        "gpu_memory_gb": 60.0,
    }
    fields.update(kwargs)
    return Candidate(**fields)  # type: ignore[arg-type]


def node(node_id: str = "n1", gpus: int = 1, used: tuple[int, ...] = (0,)) -> NodeView:
    return NodeView(
        id=node_id,
        state="ready",
        gpus=tuple(
            GpuView(
                index=i,
                name="H100",
                memory_total_mib=80 * 1024,
                memory_used_mib=60 * 1024 if i in used else 0,
                allocated=i in used,
            )
            for i in range(gpus)
        ),
        ports_in_use=frozenset(20000 + i for i in used),
    )


class EligibleTests(SynchronousTestCase):
    def test_table(self) -> None:
        """
        Each rule and its sibling: pinned, min_resident, busy, min_replicas
        (spare), and the order (priority, then least recently used, then
        the longest resident).
        """
        spare = {m: 1 for m in "abcdefgh"}
        cases: list[tuple[str, list[Candidate], dict[str, int], bool, list[str]]] = [
            ("idle one goes", [candidate("a")], spare, False, ["a"]),
            ("pinned never", [candidate("a", pinned=True)], spare, False, []),
            (
                "not before min_resident",
                [candidate("a", resident_since=NOW - 4)],
                spare,
                False,
                [],
            ),
            (
                "at min_resident",
                [candidate("a", resident_since=NOW - 5)],
                spare,
                False,
                ["a"],
            ),
            ("busy kept", [candidate("a", in_flight=1)], spare, False, []),
            (
                "busy after swap_max_wait",
                [candidate("a", in_flight=1)],
                spare,
                True,
                ["a"],
            ),
            ("min_replicas holds", [candidate("a")], {"a": 0}, False, []),
            (
                "one of two over min",
                [candidate("a1", "a"), candidate("a2", "a", last_used=NOW - 500)],
                {"a": 1},
                False,
                ["a2"],
            ),
            (
                "lower priority first",
                [
                    candidate("a", priority=5, last_used=NOW - 900),
                    candidate("b", priority=1),
                ],
                spare,
                False,
                ["b", "a"],
            ),
            (
                "least recently used first",
                [
                    candidate("a", last_used=NOW - 10),
                    candidate("b", last_used=NOW - 20),
                ],
                spare,
                False,
                ["b", "a"],
            ),
            (
                "idle before busy",
                [candidate("a", in_flight=2, priority=-1), candidate("b", priority=3)],
                spare,
                True,
                ["b", "a"],
            ),
        ]
        for label, given, room, busy, expected in cases:
            got = [c.replica for c in eligible(given, NOW, room, busy)]
            self.assertEqual(got, expected, label)


class ChooseTests(SynchronousTestCase):
    def test_one_victim(self) -> None:
        """
        One 80 GB GPU held by a 60 GB replica: evicting it lets a 60 GB
        model fit there.
        """
        chosen = choose([BIG], [node()], range(20000, 20010), [candidate("a")])
        assert chosen is not None
        self.assertEqual([v.replica for v in chosen.victims], ["a"])
        self.assertEqual(chosen.plan.shards[0].gpus, (0,))

    def test_not_enough_room_is_nothing(self) -> None:
        """
        Two GPUs needed on one node, one of them held by what may not go:
        no eviction at all.
        """
        nodes = [node(gpus=2, used=(0, 1))]
        chosen = choose([PAIR], nodes, range(20000, 20010), [candidate("a", gpu=0)])
        self.assertIsNone(chosen)

    def test_smallest_set(self) -> None:
        """
        The run of candidates is taken in order until the model fits; one
        in it whose room the plan does not use is left alone.
        """
        nodes = [node("n1", gpus=1), node("n2", gpus=2, used=(0, 1))]
        order = [
            candidate("x", node="n1"),
            candidate("y", node="n2", gpu=0),
            candidate("z", node="n2", gpu=1),
        ]
        one = choose([BIG], nodes, range(20000, 20010), order)
        assert one is not None
        self.assertEqual([v.replica for v in one.victims], ["x"])
        two = choose([PAIR], nodes, range(20000, 20010), order)
        assert two is not None
        self.assertEqual([v.replica for v in two.victims], ["y", "z"])
        self.assertEqual(two.plan.shards[0].node, "n2")

    def test_sleeping_victim_keeps_memory(self) -> None:
        """
        A victim that sleeps keeps some memory on its GPU and its port:
        a model needing more than what is left does not fit there.
        """
        asleep = candidate("a", sleeps=True, kept_gpu_memory_gb=25.0)
        (view,) = freed([node()], [asleep])
        self.assertEqual(view.gpus[0].memory_used_mib, 25 * 1024)
        self.assertFalse(view.gpus[0].allocated)
        self.assertIn(20000, view.ports_in_use)
        self.assertIsNone(choose([BIG], [node()], range(20000, 20010), [asleep]))
        small = replace(BIG, gpu_memory_gb=50)
        self.assertIsNotNone(choose([small], [node()], range(20000, 20010), [asleep]))


class AsleepTests(SynchronousTestCase):
    """
    Replicas asleep as candidates: taken first, whatever their model's
    min_replicas or min_resident, but never a pinned model's; stopping
    one frees what its engine keeps and its port, not its GPU's
    allocation; one not needed for the room is left alone.
    """

    def sleeper(self, replica: str, gpu: int = 0, **kwargs: object) -> Candidate:
        fields: dict[str, object] = {
            "asleep": True,
            "gpu_memory_gb": 10.0,
            "resident_since": NOW,
            "places": (Place("n1", (gpu,), 20010 + gpu),),
        }
        fields.update(kwargs)
        return replace(candidate(replica, gpu=gpu), **fields)  # type: ignore[arg-type]

    def test_order(self) -> None:
        awake = candidate("a")
        asleep = self.sleeper("s")
        pinned = self.sleeper("p", pinned=True)
        self.assertEqual(
            [c.replica for c in eligible([awake, asleep, pinned], NOW, {"a": 1})],
            ["s", "a"],
        )

    def test_frees_memory_not_allocation(self) -> None:
        (view,) = freed([node()], [self.sleeper("s")])
        (gpu,) = view.gpus
        self.assertTrue(gpu.allocated)
        self.assertEqual(gpu.memory_used_mib, 50 * 1024)
        self.assertNotIn(20010, view.ports_in_use)

    def test_not_needed_left_alone(self) -> None:
        """
        A sleeper on the GPU an awake victim frees: the held model fits
        without stopping the sleeper too.
        """
        found = choose(
            [BIG], [node()], range(20000, 20005), [self.sleeper("s"), candidate("a")]
        )
        assert found is not None
        self.assertEqual([v.replica for v in found.victims], ["a"])

    def test_needed_when_its_memory_is(self) -> None:
        """
        Two sleepers keep 30 GB of a free 80 GB GPU: one stopped fits a
        60 GB model; the other is left.
        """
        view = replace(
            node(used=()),
            gpus=(replace(node(used=()).gpus[0], memory_used_mib=30 * 1024),),
        )
        sleepers = [
            self.sleeper("s1", gpu_memory_gb=15.0),
            self.sleeper("s2", gpu_memory_gb=15.0),
        ]
        found = choose([BIG], [view], range(20000, 20005), sleepers)
        assert found is not None
        self.assertEqual([v.replica for v in found.victims], ["s1"])
