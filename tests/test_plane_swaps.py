"""
Eviction for a held request (issue 25 items 1, 3 and 4) on a control plane
on a L{Clock} (see L{tests.plane_support}): models of 60 GB on one 80 GB
GPU take turns; the policy's tables are in L{tests.test_eviction}, the
real daemons in L{tests.test_e2e_swap}.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.internet.defer import Deferred
from twisted.logger import capturedLogs, formatEvent

from llmgw.control.catalog import Model
from llmgw.control.placement import Profile
from llmgw.control.swaps import RELEASE_SECONDS
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, PlaneCase


def big(name: str, gpus: int = 1, **kwargs: object) -> Model:
    """
    @return: a model of 60 GB per GPU, min_replicas 0, max 1.
    """
    model = Model(
        name=name,
        aliases=(),
        min_replicas=0,
        max_replicas=1,
        idle_timeout=600,
        profiles=(
            Profile(name="p", engine="sim", source="s", gpus=gpus, gpu_memory_gb=60),
        ),
    )
    return replace(model, **kwargs)  # type: ignore[arg-type]


class SwapCase(PlaneCase):
    def tick(self, seconds: float = 1.0) -> None:
        self.clock.advance(seconds)
        self.heartbeat(*(n.id for n in self.inventory.nodes()))
        self.plane.reconcile()

    def serve(self, name: str) -> str:
        """
        A request for C{name} activates it; its replica becomes ready.

        @return: the replica's id.
        """
        waiter = self.plane.catalog.activate(name)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertIsNone(self.successResultOf(waiter))
        (replica,) = [r.id for r in self.plane.ledger.of_model(name)]
        return replica

    def of(self, name: str) -> list[str]:
        return sorted(r.id for r in self.plane.ledger.of_model(name))

    def stopped(self, replica: str) -> None:
        """
        The agent reports C{replica}'s shard stopped.
        """
        self.status(replica + "-0", pb.SHARD_STATE_STOPPED)

    def released(self, replica: str) -> None:
        """
        The agent reports C{replica}'s shard stopped, then two heartbeats
        report its GPU's memory (the second carries NVML's reading from
        after the stop): what it held is free to placement from the pass
        after (L{llmgw.control.snapshot.Releases}).
        """
        self.stopped(replica)
        self.plane.reconcile()
        nodes = [n.id for n in self.inventory.nodes()]
        self.heartbeat(*nodes)
        self.heartbeat(*nodes)
        # A model that waited for the report looks again a pass later.
        self.clock.advance(self.plane.settings.interval)
        self.plane.reconcile()


class EvictionTests(SwapCase):
    def test_idle_model_evicted_for_held_request(self) -> None:
        """
        The issue's case: C{a} idle on the only GPU, a request for C{b}:
        C{a} drains (counted, named in the log and the swap), and C{b} is
        placed on that GPU once C{a} is gone, before the node reports its
        memory again; the request is let go when C{b} is ready.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.tick(10)
        waiter = self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[a].draining_since)
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertEqual(self.of("b"), [])
        self.assertEqual(self.plane.counts.swaps, {("a", "evicted"): 1})
        words = self.plane.catalog.where("b").words
        self.assertEqual(words, "evicting a (idle 10s) to make room")
        self.released(a)
        (b,) = self.of("b")
        self.assertEqual(self.plane.replicas[b].shards[0].gpus, (0,))
        self.assertNoResult(waiter)
        self.ready_all()
        self.plane.reconcile()
        self.successResultOf(waiter)
        self.assertEqual(self.plane.swaps, {})
        self.assertEqual(self.plane.evicted["b"][0], words)

    def test_memory_freed_once_the_gpu_reports_it(self) -> None:
        """
        The node last said its GPU holds 60 GB (C{a}'s); once C{a} is
        reported stopped, C{b} waits for the GPU to report the memory
        free (not placed on llmgw's reckoning, and nothing more evicted),
        and is placed at the report that says so.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        used = pb.Heartbeat(gpus=[pb.GpuUsage(index=0, memory_used_mib=60 * 1024)])
        self.inventory.heartbeat("n1", used, 0.0)
        self.tick(10)
        self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.stopped(a)
        self.plane.reconcile()
        self.tick(5)
        self.assertEqual(self.of("b"), [])
        self.assertIn("b", self.plane.swaps)
        free = pb.Heartbeat(gpus=[pb.GpuUsage(index=0, memory_used_mib=0)])
        self.inventory.heartbeat("n1", free, 0.0)
        self.tick(1)
        self.assertEqual(len(self.of("b")), 1)

    def test_memory_never_freed_ends_the_swap(self) -> None:
        """
        A GPU that still reports C{a}'s memory used L{RELEASE_SECONDS}
        after C{a} stopped: C{b}'s swap ends with a warning naming what
        the GPU reports, and C{b} is not placed over it.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        used = pb.Heartbeat(gpus=[pb.GpuUsage(index=0, memory_used_mib=60 * 1024)])
        self.inventory.heartbeat("n1", used, 0.0)
        self.tick(10)
        self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.stopped(a)
        self.plane.reconcile()
        with capturedLogs() as events:
            for _ in range(int(RELEASE_SECONDS / 5) + 2):
                self.tick(5)
        self.assertEqual(self.of("b"), [])
        warned = [formatEvent(e) for e in events if "do not report" in formatEvent(e)]
        self.assertEqual(len(warned), 1)
        self.assertIn("GPU 0 of n1 reports 61440 MiB used of 81920", warned[0])

    def test_room_kept_for_the_held_model(self) -> None:
        """
        While C{a} drains for C{b}, a third model activated meanwhile does
        not take the GPU freed for C{b}.
        """
        self.make(big("a"), big("b"), big("c"), nodes=("n1",))
        a = self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.tick(1)
        self.plane.catalog.activate("c")
        self.released(a)
        self.assertEqual(len(self.of("b")), 1)
        self.assertEqual(self.of("c"), [])

    def test_pinned_never_evicted(self) -> None:
        """
        A pinned model is not evicted: the held request finds no room.
        """
        self.make(big("a", pinned=True), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.tick(100)
        self.plane.catalog.activate("b")
        for _ in range(5):
            self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(self.plane.counts.swaps, {})
        self.assertEqual(
            self.plane.catalog.where("b").words,
            "waiting for room: what holds it is busy or pinned",
        )

    def test_min_replicas_holds(self) -> None:
        """
        A model at its min_replicas is not evicted.
        """
        self.make(big("a", min_replicas=1), big("b"), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.tick(100)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [])

    def test_min_resident(self) -> None:
        """
        A replica started less than its model's min_resident (20 s) ago
        is not evicted; once it has been, it is.
        """
        self.make(big("a", min_resident=20.0), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [])
        for _ in range(19):
            self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])

    def test_evict_off(self) -> None:
        """
        C{[control] evict = false}: nothing is evicted.
        """
        self.make(
            big("a"), big("b"), nodes=("n1",), settings=replace(SETTINGS, evict=False)
        )
        self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [])

    def test_not_enough_room_evicts_nothing(self) -> None:
        """
        C{b} needs both GPUs of the node; C{a} may go but pinned C{c}
        holds the other: nothing is evicted.
        """
        self.make(big("a"), big("c", pinned=True), big("b", gpus=2), nodes=("n1",))
        self.register("n1", gpus=2)
        self.serve("a")
        self.serve("c")
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(self.plane.swaps, {})


class BusyTests(SwapCase):
    def test_busy_keeps_its_room_until_swap_max_wait(self) -> None:
        """
        C{a} has a stream: it keeps its room while C{b}'s request waits
        under swap_max_wait (30 s); then it is unpublished and leaves once
        its stream ends, nothing cut; C{b} is placed after.  The eviction
        names C{a}'s request in flight, not an idle time.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.in_flight[a] = 1
        self.tick(10)
        self.plane.catalog.activate("b")
        for _ in range(29):
            self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)
        self.tick(1)
        self.assertIsNotNone(self.plane.replicas[a].draining_since)
        self.assertEqual(
            self.plane.evicted["b"],
            ("evicting a (1 in flight, last request 40s ago) to make room", 1040.0),
        )
        self.assertEqual(self.endpoints(), [])
        for _ in range(100):
            self.tick(1)
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[a] = 0
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.released(a)
        self.assertEqual(len(self.of("b")), 1)
        self.assertEqual(self.cuts, [])

    def test_swap_max_wait_zero_never_evicts_busy(self) -> None:
        """
        C{swap_max_wait = "0s"}: a busy replica is never evicted.
        """
        settings = replace(SETTINGS, swap_max_wait=0.0)
        self.make(big("a"), big("b"), nodes=("n1",), settings=settings)
        a = self.serve("a")
        self.in_flight[a] = 1
        self.plane.catalog.activate("b")
        for _ in range(100):
            self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)

    def test_recently_used_keeps_its_room_until_swap_max_wait(self) -> None:
        """
        C{swap_in_use = "10s"}: C{a}, with nothing in flight but used every
        few seconds, keeps its room while C{b}'s request waits under
        swap_max_wait (30 s), then leaves for it; used last 10 s ago or
        more, it would have gone at once.
        """
        settings = replace(SETTINGS, swap_in_use=10.0)
        self.make(big("a"), big("b"), nodes=("n1",), settings=settings)
        a = self.serve("a")
        self.tick(10)
        self.plane.catalog.touch("a")
        self.plane.catalog.activate("b")
        for second in range(29):
            if second % 5 == 0:
                self.plane.catalog.touch("a")
            self.tick(1)
        self.assertIsNone(self.plane.replicas[a].draining_since)
        self.tick(1)
        self.assertIsNotNone(self.plane.replicas[a].draining_since)
        self.released(a)
        self.assertEqual(len(self.of("b")), 1)

    def test_swap_in_use_idle_goes_at_once(self) -> None:
        """
        C{swap_in_use = "10s"}: C{a} last used 10 s before C{b}'s request
        is evicted for it at once.
        """
        settings = replace(SETTINGS, swap_in_use=10.0)
        self.make(big("a"), big("b"), nodes=("n1",), settings=settings)
        a = self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("b")
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[a].draining_since)


class QueueTests(SwapCase):
    def test_two_models_waiting_oldest_first(self) -> None:
        """
        C{c}'s request came before C{b}'s: C{c} gets the room C{a} frees,
        C{b} is told it is second, behind C{c}; then C{b} follows once
        C{c} has been resident its min_resident.
        """
        self.make(big("a"), big("b"), big("c"), nodes=("n1",))
        a = self.serve("a")
        self.tick(10)
        waiters: list[Deferred[None]] = [self.plane.catalog.activate("c")]
        self.clock.advance(1)
        waiters.append(self.plane.catalog.activate("b"))
        self.plane.reconcile()
        self.assertEqual(set(self.plane.swaps), {"c"})
        self.assertEqual(
            self.plane.catalog.where("b").words, "2nd in the swap queue, behind c"
        )
        self.released(a)
        (c,) = self.of("c")
        self.assertEqual(self.of("b"), [])
        self.ready_all()
        self.plane.reconcile()
        self.successResultOf(waiters[0])
        for _ in range(6):
            self.tick(1)
        self.assertIsNotNone(self.plane.replicas[c].draining_since)
        self.assertEqual(set(self.plane.swaps), {"b"})

    def test_higher_priority_first(self) -> None:
        """
        C{c}'s batch request came before C{b}'s interactive one: C{b} gets
        the room C{a} frees, and C{c} is told it is second, behind C{b}.
        """
        self.make(big("a"), big("b"), big("c"), nodes=("n1",))
        self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("c", priority=0)
        self.clock.advance(1)
        self.plane.catalog.activate("b", priority=2)
        self.plane.reconcile()
        self.assertEqual(set(self.plane.swaps), {"b"})
        self.assertEqual(
            self.plane.catalog.where("c").words, "2nd in the swap queue, behind b"
        )

    def test_passed_over_goes_before_a_higher_priority(self) -> None:
        """
        C{c}'s batch request has waited C{swap_max_wait} (5 s here) when an
        interactive request for C{b} comes: C{c} goes first, so a stream
        of higher priorities cannot hold a request back unbounded.
        """
        settings = replace(SETTINGS, swap_max_wait=5.0)
        self.make(big("a"), big("b"), big("c"), nodes=("n1",), settings=settings)
        a = self.serve("a")
        self.in_flight[a] = 1
        self.tick(10)
        self.plane.catalog.activate("c", priority=0)
        self.tick(4)
        self.assertEqual(self.plane.swaps, {})
        self.in_flight[a] = 0
        self.clock.advance(1)
        self.plane.catalog.activate("b", priority=2)
        self.plane.reconcile()
        self.assertEqual(set(self.plane.swaps), {"c"})

    def test_waited_elsewhere_counts(self) -> None:
        """
        A request a router of a tier asks for again, having waited 40 s
        already, is past swap_max_wait (30 s) at once: C{a}, busy, takes
        no new requests and leaves for it.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.in_flight[a] = 1
        self.tick(10)
        self.plane.catalog.activate("b", waited=40.0)
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[a].draining_since)


class PinAndSleepTests(SwapCase):
    def test_pin_then_unpin(self) -> None:
        """
        Pinned at run time, C{a} is not evicted; unpinned, it is.
        """
        self.make(big("a"), big("b"), nodes=("n1",))
        a = self.serve("a")
        self.assertTrue(self.plane.pin("a", True).pinned)
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [])
        self.assertFalse(self.plane.pin("a", False).pinned)
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertRaises(KeyError, self.plane.pin, "nope", True)

    def test_sleeping_replica_holds_no_gpu(self) -> None:
        """
        A replica whose shard reports itself asleep is unpublished and
        its GPU is free for placement (the live snapshot and a new one
        alike); its model still wanting it, it is woken (WakeShard), and
        awake again, it holds the GPU.
        """
        self.make(big("a"), nodes=("n1",))
        a = self.serve("a")
        self.assertEqual(len(self.endpoints()), 1)
        self.status(a + "-0", pb.SHARD_STATE_SLEEPING)
        self.assertEqual(self.plane.replicas[a].state, "sleeping")
        for snapshot in (self.plane.snapshot(), self.plane.live_snapshot()):
            (gpu,) = snapshot.fleet.get("n1").gpus
            self.assertFalse(gpu.allocated)
            self.assertIn(
                self.plane.replicas[a].shards[0].port,
                snapshot.fleet.get("n1").ports_in_use,
            )
        self.agents.hold = True
        self.plane.reconcile()
        self.assertEqual(self.plane.replicas[a].state, "waking")
        self.assertEqual(self.endpoints(), [])
        self.assertEqual(
            [
                m.wake_shard.shard_id
                for _, m in self.agents.sent
                if m.HasField("wake_shard")
            ],
            [a + "-0"],
        )
        self.clock.advance(2)
        self.agents.unanswered[-1].callback(pb.CommandResult(ok=True))
        self.plane.reconcile()
        self.assertEqual(self.plane.counts.wake_seconds, {"a": [2.0]})
        (gpu,) = self.plane.live_snapshot().fleet.get("n1").gpus
        self.assertTrue(gpu.allocated)
        self.assertEqual(len(self.endpoints()), 1)
