"""
Placement by memory on shared GPUs (issue 36 item 4), a model that can
never be placed (item 5), and eviction freeing only what a newcomer
needs, as pure functions over hand-made snapshots.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.eviction import Candidate, Place, choose
from llmgw.control.placement import (
    Fleet,
    GpuView,
    NodeView,
    NoFit,
    Plan,
    Profile,
    never_fits,
    place,
)
from llmgw.control.snapshot import Snapshot

PORTS = range(8000, 8010)
GB80 = 80 * 1024


def sharing(name: str, gb: float) -> Profile:
    return Profile(name, "vllm", name, gpus=1, gpu_memory_gb=gb, share_gpu=True)


def fleet(*gpus: GpuView) -> list[NodeView]:
    return [NodeView("n1", "ready", gpus=gpus)]


def gpu(index: int, **kwargs: object) -> GpuView:
    return GpuView(index, "H100", GB80, **kwargs)  # type: ignore[arg-type]


class SharedPlacementTests(SynchronousTestCase):
    def test_two_small_and_one_large_on_two_gpus(self) -> None:
        """
        Two 20 GB models and one 60 GB model on two 80 GB GPUs: all three
        placed, the small ones together on one GPU beside nothing else
        (tightest fit), the large one on the other (no eviction needed),
        each engine told its share of the GPU.
        """
        snapshot = Snapshot([], [], {})
        snapshot.fleet = Fleet(fleet(gpu(0), gpu(1)))
        placed = []
        for profile in (sharing("a", 20), sharing("b", 20), sharing("c", 60)):
            plan = place([profile], snapshot.fleet, PORTS)
            assert isinstance(plan, Plan), plan
            snapshot.take(plan)
            placed.append(plan.shards[0])
        self.assertEqual([s.gpus for s in placed], [(0,), (0,), (1,)])
        self.assertEqual([s.share for s in placed], [0.25, 0.25, 0.75])
        gpus = snapshot.fleet.get("n1").gpus
        self.assertEqual([g.claimed_mib for g in gpus], [40 * 1024, 60 * 1024])
        self.assertEqual([g.sharers for g in gpus], [2, 1])
        self.assertFalse(any(g.allocated for g in gpus))
        # 40 GB left on one, 20 on the other: 40 fits, 41 does not.
        self.assertIsInstance(place([sharing("d", 40)], snapshot.fleet, PORTS), Plan)
        self.assertIsInstance(place([sharing("e", 41)], snapshot.fleet, PORTS), NoFit)

    def test_whole_gpu_profiles_unchanged(self) -> None:
        """
        A profile that does not share takes a GPU whole, and no GPU a
        sharing replica holds; a sharing one goes on no GPU held whole.
        """
        whole = Profile("w", "vllm", "w", gpus=1, gpu_memory_gb=10)
        nodes = fleet(gpu(0, claimed_mib=1024, sharers=1), gpu(1, allocated=True))
        self.assertIsInstance(place([whole], nodes, PORTS), NoFit)
        self.assertIsInstance(place([sharing("s", 10)], nodes, PORTS), Plan)
        only_whole = fleet(gpu(0, allocated=True))
        self.assertIsInstance(place([sharing("s", 10)], only_whole, PORTS), NoFit)

    def test_reported_memory_counts(self) -> None:
        """
        Free memory is the total less the most of what the GPU reports
        and what llmgw counts: a release not yet reported makes no room.
        """
        nodes = fleet(gpu(0, memory_used_mib=70 * 1024, claimed_mib=10 * 1024))
        self.assertIsInstance(place([sharing("s", 20)], nodes, PORTS), NoFit)
        nodes = fleet(gpu(0, memory_used_mib=5 * 1024, claimed_mib=70 * 1024))
        self.assertIsInstance(place([sharing("s", 20)], nodes, PORTS), NoFit)
        nodes = fleet(gpu(0, memory_used_mib=50 * 1024, claimed_mib=50 * 1024))
        self.assertIsInstance(place([sharing("s", 20)], nodes, PORTS), Plan)

    def test_tensor_parallel_takes_whole_gpus(self) -> None:
        """
        A sharing profile of two GPUs takes them whole all the same.
        """
        two = replace(sharing("t", 20), gpus=2)
        plan = place([two], fleet(gpu(0), gpu(1)), PORTS)
        assert isinstance(plan, Plan)
        self.assertEqual(plan.shards[0].share, 0.0)
        snapshot = Snapshot([], [], {})
        snapshot.fleet = Fleet(fleet(gpu(0), gpu(1)))
        snapshot.take(plan)
        self.assertTrue(all(g.allocated for g in snapshot.fleet.get("n1").gpus))


class EvictionByMemoryTests(SynchronousTestCase):
    def candidate(self, name: str, gb: float, last_used: float) -> Candidate:
        return Candidate(
            replica=name,
            model=name,
            priority=0,
            pinned=False,
            min_resident=0,
            last_used=last_used,
            resident_since=0,
            in_flight=0,
            places=(Place("n1", (0,), 8000 + int(gb)),),
            gpu_memory_gb=gb,
            shares=True,
        )

    def test_frees_only_what_is_needed(self) -> None:
        """
        One GPU holding a 10 GB, a 20 GB and a 40 GB sharing replica (10
        GB free): a 40 GB newcomer takes the shortest run of candidates,
        in the policy's order, that makes 40 GB free (the 10 and 20 GB
        ones when they come first; the 40 GB one alone when it does), and
        a 15 GB newcomer evicts only what it needs, never the whole GPU.
        """
        nodes = fleet(gpu(0, claimed_mib=70 * 1024, sharers=3))
        ten = self.candidate("ten", 10, 1)
        twenty = self.candidate("twenty", 20, 2)
        forty = self.candidate("forty", 40, 3)
        chosen = choose([sharing("new", 40)], nodes, PORTS, [ten, twenty, forty])
        assert chosen is not None
        self.assertEqual([v.replica for v in chosen.victims], ["ten", "twenty"])
        chosen = choose([sharing("new", 40)], nodes, PORTS, [forty, ten, twenty])
        assert chosen is not None
        self.assertEqual([v.replica for v in chosen.victims], ["forty"])
        chosen = choose([sharing("new", 15)], nodes, PORTS, [forty, ten, twenty])
        assert chosen is not None
        self.assertEqual([v.replica for v in chosen.victims], ["forty"])

    def test_whole_gpu_newcomer_needs_every_sharer_gone(self) -> None:
        """
        A newcomer that takes its GPU whole needs every sharer off it.
        """
        nodes = fleet(gpu(0, claimed_mib=30 * 1024, sharers=2))
        ten = self.candidate("ten", 10, 1)
        twenty = self.candidate("twenty", 20, 2)
        whole = Profile("w", "vllm", "w", gpus=1, gpu_memory_gb=10)
        chosen = choose([whole], nodes, PORTS, [ten, twenty])
        assert chosen is not None
        self.assertEqual([v.replica for v in chosen.victims], ["ten", "twenty"])


class NeverFitsTests(SynchronousTestCase):
    def test_too_many_gpus(self) -> None:
        four = Profile("p", "vllm", "m", gpus=4, gpu_memory_gb=10)
        nodes = [NodeView(f"n{i}", "ready", gpus=(gpu(0),)) for i in range(3)]
        self.assertEqual(
            never_fits([four], nodes),
            "profile p: it needs 4 GPUs on one node, the most any node has is 1",
        )

    def test_too_much_memory(self) -> None:
        huge = Profile("p", "vllm", "m", gpus=1, gpu_memory_gb=100)
        self.assertEqual(
            never_fits([huge], fleet(gpu(0))),
            "profile p: it needs 100 GB on a GPU, the largest GPU has 80 GB",
        )

    def test_one_profile_fits(self) -> None:
        four = Profile("p", "vllm", "m", gpus=4)
        one = Profile("q", "vllm", "m", gpus=1)
        self.assertIsNone(never_fits([four, one], fleet(gpu(0))))
        self.assertIsNone(never_fits([four], []))
        busy = fleet(gpu(0, allocated=True, memory_used_mib=GB80))
        self.assertIsNone(never_fits([one], busy))
