"""
Sleep as a state of a replica (issue 25 item 2) on a control plane on a
L{Clock} (see L{tests.plane_support}): idle replicas of a model whose
profile says C{sleep} sleep instead of stopping, evicted ones too, and
are woken rather than cold-started; the node's C{sleep_memory}, an engine
that refused sleep mode and a failed sleep stop them instead.  The real
daemons are in L{tests.test_e2e_sleep}.
"""

from __future__ import annotations

from dataclasses import replace

from llmgw.control.catalog import Model
from llmgw.control.operating import SleepRefused
from llmgw.control.placement import Profile
from llmgw.control.settings import ControlConfig
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, register_message
from tests.test_plane_swaps import SwapCase

GIB = 1024**3


def sleepy(name: str, **kwargs: object) -> Model:
    """
    @return: a model of 60 GB on one GPU whose replicas sleep (level 1,
        keeping 1 GB on the GPU and 60 GB of host memory), min_replicas
        0, max 1, idle after 600 s.
    """
    profile = Profile(
        name="p",
        engine="sim",
        source="s",
        gpus=1,
        gpu_memory_gb=60,
        sleep="weights",
        sleep_gpu_memory_gb=1,
        sleep_host_memory_gb=60,
    )
    model = Model(
        name=name,
        aliases=(),
        min_replicas=0,
        max_replicas=1,
        idle_timeout=600,
        profiles=(profile,),
        min_resident=5,
    )
    return replace(model, **kwargs)  # type: ignore[arg-type]


def running_a(n: int, gpu: int, state: int) -> pb.RunningShard:
    """
    @return: shard C{a-N-0} of replica C{a-N} of model C{a} (profile
        C{p}) on GPU C{gpu}, as a Register lists it in C{state}.
    """
    running = pb.RunningShard(
        shard_id=f"a-{n}-0",
        replica_id=f"a-{n}",
        model="a",
        profile="p",
        rank=0,
        gpu_indices=[gpu],
        port=20000 + gpu,
        pid=77 + gpu,
    )
    running.state = state  # type: ignore[assignment]
    return running


class SleepCase(SwapCase):
    def node(
        self,
        node_id: str = "n1",
        sleep_gib: int = 200,
        shards: tuple[pb.RunningShard, ...] = (),
        gpus: int = 1,
    ) -> None:
        """
        Node C{node_id} registers with C{gpus} GPUs, C{sleep_gib} of
        C{sleep_memory}, listing C{shards}.
        """
        message = register_message(node_id, gpus=gpus, shards=shards)
        message.sleep_memory_bytes = sleep_gib * GIB
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered(node_id, message)

    def setup(
        self, *models: Model, sleep_gib: int = 200, settings: ControlConfig = SETTINGS
    ) -> None:
        self.make(*models, nodes=(), settings=settings)
        self.node("n1", sleep_gib)

    def sent(self, kind: str) -> list[str]:
        return [
            getattr(m, kind).shard_id for _, m in self.agents.sent if m.HasField(kind)
        ]


class IdleSleepTests(SleepCase):
    def test_idle_replica_sleeps(self) -> None:
        """
        Idle for C{idle_timeout}, the replica is told to sleep at its
        profile's level, not stopped; unpublished, counted and timed.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.tick(601)
        self.assertEqual(self.sent("sleep_shard"), [a + "-0"])
        (_, message), *_ = [
            (n, m) for n, m in self.agents.sent if m.HasField("sleep_shard")
        ]
        self.assertEqual(message.sleep_shard.level, 1)
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(self.plane.replicas[a].state, "sleeping")
        self.assertTrue(self.plane.replicas[a].asleep)
        self.assertEqual(self.endpoints(), [])
        self.assertEqual(self.plane.counts.swaps, {("a", "idle_sleep"): 1})
        self.assertEqual(self.plane.counts.sleep_seconds, {"a": [0.0]})
        (gpu,) = self.plane.live_snapshot().fleet.get("n1").gpus
        self.assertFalse(gpu.allocated)

    def test_request_wakes_it(self) -> None:
        """
        A request for the model wakes its sleeping replica (no new
        start); the request is let through once it is ready again.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.tick(601)
        starts = len(self.agents.starts())
        waiter = self.plane.catalog.activate("a")
        self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        self.assertEqual(len(self.agents.starts()), starts)
        self.assertEqual(self.plane.replicas[a].state, "ready")
        self.tick(1)
        self.assertIsNone(self.successResultOf(waiter))
        self.assertEqual(len(self.endpoints()), 1)
        self.assertIn("a", self.plane.counts.wake_seconds)

    def test_no_sleep_memory_stops_it(self) -> None:
        """
        A node whose C{sleep_memory} has no room: the idle replica is
        stopped instead.
        """
        self.setup(sleepy("a"), sleep_gib=10)
        a = self.serve("a")
        self.tick(601)
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertEqual(self.plane.counts.swaps, {})

    def test_refused_at_start_stops_it(self) -> None:
        """
        Its engine refused sleep mode at start (the agent's note): the
        idle replica is stopped instead, and the reason is kept.
        """
        self.setup(sleepy("a"))
        waiter = self.plane.catalog.activate("a")
        self.plane.reconcile()
        ((_, start),) = self.agents.starts()
        status = pb.ShardStatus(
            shard_id=start.shard_id,
            state=pb.SHARD_STATE_READY,
            note="sleep refused: Sleep mode is not supported on current platform.",
        )
        self.plane.shard_status("n1", status)
        self.plane.reconcile()
        self.successResultOf(waiter)
        replica = self.plane.replicas[start.replica_id]
        self.assertIn("not supported", self.plane.why_not_sleep(replica) or "")
        self.tick(601)
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.agents.stops(), [start.shard_id])

    def test_failed_sleep_stops_it(self) -> None:
        """
        The agent answers the sleep C{sleep_refused}: the replica is
        stopped, and not counted asleep.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.agents.refuse["n1"] = "sleep_refused"
        self.tick(601)
        self.assertEqual(self.sent("sleep_shard"), [a + "-0"])
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertEqual(self.plane.counts.sleep_seconds, {})


class SwapSleepTests(SleepCase):
    def test_evicted_sleeps_and_wakes_back(self) -> None:
        """
        C{a} then C{b} on one GPU, then C{a} again: each time the other
        is put to sleep to make room, and C{a} comes back by a wake, not
        a second start.
        """
        self.setup(sleepy("a"), sleepy("b"))
        a = self.serve("a")
        self.tick(10)
        waiter = self.plane.catalog.activate("b")
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [a + "-0"])
        self.tick(1)
        self.ready_all()
        self.tick(1)
        self.successResultOf(waiter)
        (b,) = self.of("b")
        self.tick(10)
        waiter = self.plane.catalog.activate("a")
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [a + "-0", b + "-0"])
        self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        self.tick(1)
        self.successResultOf(waiter)
        self.assertEqual(self.of("a"), [a])
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b])
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(
            self.plane.counts.swaps, {("a", "slept"): 1, ("b", "slept"): 1}
        )

    def test_busy_victim_sleeps_after_its_stream(self) -> None:
        """
        A victim chosen busy (past C{swap_max_wait}) is unpublished at
        once but told to sleep only when its last request ends.
        """
        settings = replace(SETTINGS, evict=True, swap_max_wait=5.0)
        self.setup(sleepy("a"), sleepy("b"), settings=settings)
        a = self.serve("a")
        self.in_flight[a] = 1
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(6)
        self.tick(1)
        self.assertEqual(self.plane.replicas[a].state, "sleeping")
        self.assertEqual(self.endpoints(), [])
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.cuts, [])
        self.in_flight[a] = 0
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [a + "-0"])


class OperatorTests(SleepCase):
    def test_sleep_and_wake(self) -> None:
        """
        The operator puts a ready replica to sleep and wakes it; the
        model does not undo either.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.plane.sleep_replica(a)
        self.tick(1)
        self.tick(30)
        self.assertTrue(self.plane.replicas[a].asleep)
        self.assertEqual(self.sent("wake_shard"), [])
        self.plane.wake_replica(a)
        self.tick(1)
        self.tick(30)
        self.assertEqual(self.plane.replicas[a].state, "ready")
        self.assertEqual(self.sent("sleep_shard"), [a + "-0"])

    def test_refusals(self) -> None:
        """
        Under C{min_replicas}, not asleep, an unknown id: refused.
        """
        self.setup(sleepy("a", min_replicas=1))
        self.tick(1)
        self.ready_all()
        self.tick(1)
        (a,) = self.of("a")
        error = self.assertRaises(SleepRefused, self.plane.sleep_replica, a)
        self.assertIn("under its min_replicas 1", str(error))
        error = self.assertRaises(SleepRefused, self.plane.wake_replica, a)
        self.assertIn("not asleep", str(error))
        self.assertRaises(KeyError, self.plane.sleep_replica, "nope")


class BudgetTests(SleepCase):
    def test_longest_asleep_stopped_for_room(self) -> None:
        """
        The node's sleep_memory holds one sleeper (60 of 100 GiB): when
        C{b} goes to sleep, C{a}, asleep longest, is stopped to make room,
        and C{b} sleeps.
        """
        self.setup(sleepy("a"), sleepy("b"), sleep_gib=100)
        a = self.serve("a")
        self.tick(10)
        self.plane.catalog.activate("b")
        self.tick(1)
        self.tick(1)
        self.ready_all()
        self.tick(1)
        (b,) = self.of("b")
        self.assertTrue(self.plane.replicas[a].asleep)
        self.tick(601)
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])
        self.assertEqual(self.sent("sleep_shard"), [a + "-0", b + "-0"])
        self.assertTrue(self.plane.replicas[b].asleep)


class WaitForWakeTests(SleepCase):
    def test_waits_for_a_busy_gpu_rather_than_cold_start(self) -> None:
        """
        Two GPUs: C{a} asleep on GPU 0 under C{c}, which is busy; C{b}
        idle on GPU 1.  A request for C{a} waits for C{c}'s request to end
        (less than a cold start so far), then C{c} sleeps and C{a} wakes:
        no second start of C{a}, C{b} untouched.
        """
        a, b, c = self.two_gpus_a_asleep_under_c(sleepy("a"), sleepy("b"), sleepy("c"))
        self.in_flight[c] = 1
        self.tick(10)
        waiter = self.plane.catalog.activate("a")
        for _ in range(5):
            self.tick(1)
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])
        self.assertNoResult(waiter)
        self.in_flight[c] = 0
        self.tick(1)
        self.tick(1)
        self.tick(1)
        self.successResultOf(waiter)
        self.woke_a_in_place(a, b, c)

    def woke_a_in_place(self, a: str, b: str, c: str) -> None:
        """
        C{a} was woken where it slept, C{c} put to sleep for it; C{b}
        served on, and nothing was started cold after the first three.
        """
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        self.assertTrue(self.plane.replicas[c].asleep)
        self.assertEqual(self.plane.replicas[b].state, "ready")
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])

    def two_gpus_a_asleep_under_c(self, *models: Model) -> tuple[str, str, str]:
        """
        Two GPUs: C{a} started on GPU 0, C{b} on GPU 1, then C{c} evicts
        C{a} (which sleeps) and runs on GPU 0.

        @return: the replica ids of C{a}, C{b} and C{c}.
        """
        self.make(*models, nodes=())
        message = register_message("n1", gpus=2)
        message.sleep_memory_bytes = 500 * GIB
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered("n1", message)
        a = self.serve("a")
        self.tick(1)
        # a's cold starts take 30 s, on the mean.
        self.plane.counts.cold_start_seconds["a"] = [30.0]
        b = self.serve("b")
        self.tick(10)
        self.plane.catalog.activate("c")
        self.tick(1)
        self.tick(1)
        self.ready_all()
        self.tick(1)
        (c,) = self.of("c")
        self.assertTrue(self.plane.replicas[a].asleep)
        return a, b, c

    def test_waits_for_a_young_resident_rather_than_cold_start(self) -> None:
        """
        C{c}, on the GPU where C{a} sleeps, is idle but resident less than
        its C{min_resident}; C{b} is idle on the other GPU.  A request for
        C{a} waits for C{c}'s C{min_resident} to pass (less than a cold
        start), then C{c} sleeps and C{a} wakes where it slept: C{b} is
        not evicted for a second cold start of C{a}.
        """
        a, b, c = self.two_gpus_a_asleep_under_c(
            sleepy("a"), sleepy("b"), sleepy("c", min_resident=20)
        )
        waiter = self.plane.catalog.activate("a")
        for _ in range(5):
            self.tick(1)
        self.assertNoResult(waiter)
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])
        for _ in range(20):
            self.tick(1)
        self.successResultOf(waiter)
        self.woke_a_in_place(a, b, c)

    def test_waits_for_its_gpu_though_another_is_free(self) -> None:
        """
        C{b} went to sleep idle, so GPU 1 has room; C{c}, on the GPU where
        C{a} sleeps, is busy.  A request for C{a} waits for C{c} (less than
        a cold start) rather than starting C{a} cold on GPU 1, and wakes
        it once C{c}'s request ends.
        """
        a, b, c = self.two_gpus_a_asleep_under_c(
            sleepy("a"), sleepy("b", idle_timeout=15), sleepy("c")
        )
        self.in_flight[c] = 1
        self.tick(10)
        self.assertTrue(self.plane.replicas[b].asleep)
        waiter = self.plane.catalog.activate("a")
        for _ in range(5):
            self.tick(1)
        self.assertNoResult(waiter)
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])
        self.in_flight[c] = 0
        for _ in range(3):
            self.tick(1)
        self.successResultOf(waiter)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])

    def test_waits_for_its_replica_falling_asleep(self) -> None:
        """
        C{c}, evicted busy for C{a}'s wake (past swap_max_wait), is asked
        for again while its stream runs and it has not slept yet: it
        waits to fall asleep and then wakes where it slept, rather than
        evicting C{b} for a cold start on the other GPU.
        """
        a, b, c = self.two_gpus_a_asleep_under_c(sleepy("a"), sleepy("b"), sleepy("c"))
        self.plane.counts.cold_start_seconds["a"] = [100.0]
        self.plane.counts.cold_start_seconds["c"] = [30.0]
        self.in_flight[c] = 1
        self.tick(10)
        waiter = self.plane.catalog.activate("a")
        for _ in range(31):
            self.tick(1)
        self.assertTrue(self.plane.replicas[c].dormant)
        self.assertFalse(self.plane.replicas[c].asleep)
        again = self.plane.catalog.activate("c")
        for _ in range(3):
            self.tick(1)
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])
        self.assertEqual(self.plane.replicas[b].state, "ready")
        self.in_flight[c] = 0
        for _ in range(3):
            self.tick(1)
        self.successResultOf(waiter)
        for _ in range(10):
            self.tick(1)
        self.successResultOf(again)
        self.woke_in_place(a, b, c)

    def woke_in_place(self, a: str, b: str, c: str) -> None:
        """
        C{a}, then C{c}, were woken where they slept; C{b} served on, and
        nothing was started cold after the first three.
        """
        self.assertEqual(self.sent("wake_shard"), [a + "-0", c + "-0"])
        self.assertEqual(self.plane.replicas[b].state, "ready")
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])

    def test_waits_for_a_waking_resident(self) -> None:
        """
        C{a} is waking on the GPU where C{c} sleeps when C{c} is asked for:
        C{c} waits for C{a} (woken, then its min_resident) and wakes there,
        rather than evicting C{b} for a cold start on the other GPU.
        """
        a, b, c = self.two_gpus_a_asleep_under_c(sleepy("a"), sleepy("b"), sleepy("c"))
        self.plane.counts.cold_start_seconds["c"] = [30.0]
        self.tick(10)
        waiter = self.plane.catalog.activate("a")
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard")[-1], c + "-0")
        self.agents.hold = True
        self.tick(1)
        self.assertEqual(self.sent("wake_shard"), [a + "-0"])
        again = self.plane.catalog.activate("c")
        for _ in range(3):
            self.tick(1)
        self.assertEqual([s.replica_id for _, s in self.agents.starts()], [a, b, c])
        self.agents.hold = False
        for held in self.agents.unanswered:
            held.callback(pb.CommandResult(ok=True))
        self.tick(1)
        self.successResultOf(waiter)
        for _ in range(8):
            self.tick(1)
        self.successResultOf(again)
        self.woke_in_place(a, b, c)


class ReviewTests(SleepCase):
    """
    What a review of the change found (each failed before its fix).
    """

    def asleep_a(self, **kwargs: object) -> str:
        self.setup(sleepy("a", **kwargs))
        a = self.serve("a")
        self.tick(601)
        self.assertTrue(self.plane.replicas[a].asleep)
        return a

    def test_drained_node_stops_its_sleeper(self) -> None:
        a = self.asleep_a()
        self.plane.drain_node("n1")
        self.tick(1)
        self.assertEqual(self.agents.stops(), [a + "-0"])

    def test_going_to_sleep_holds_its_gpu(self) -> None:
        """
        Put to sleep with a request in flight, its engine runs on: its
        GPU stays allocated until it is asleep.
        """
        self.setup(sleepy("a"))
        a = self.serve("a")
        self.in_flight[a] = 1
        self.plane.sleep_replica(a)
        self.tick(1)
        (gpu,) = self.plane.snapshot().fleet.get("n1").gpus
        self.assertTrue(gpu.allocated)

    def test_pinned_sleeper_kept(self) -> None:
        """
        sleep_memory holds one sleeper; the one asleep is a pinned
        model's: the next idle replica stops rather than stop it.
        """
        self.setup(sleepy("a", pinned=True), sleepy("b"), sleep_gib=100)
        message = register_message("n1", gpus=2)
        message.sleep_memory_bytes = 100 * GIB
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered("n1", message)
        a = self.serve("a")
        self.tick(601)
        self.assertTrue(self.plane.replicas[a].asleep)
        b = self.serve("b")
        self.tick(601)
        self.assertEqual(self.agents.stops(), [b + "-0"])
        self.assertTrue(self.plane.replicas[a].asleep)


class OldAgentTests(SleepCase):
    """
    A node whose agent registered saying no protocol version (1.0, before
    sleep; L{llmgw.wire.versions.SLEEP}), with room to sleep on it.
    """

    def setUp(self) -> None:
        super().setUp()
        self.make(sleepy("a"), nodes=(), settings=SETTINGS)
        message = register_message("n1")
        message.sleep_memory_bytes = 200 * GIB
        message.protocol_version = ""
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered("n1", message)

    def test_idle_replica_stopped_not_slept(self) -> None:
        """
        Idle for C{idle_timeout}, its replica is stopped: no C{SleepShard}
        is sent to the old agent.
        """
        a = self.serve("a")
        self.tick(601)
        self.assertEqual(self.sent("sleep_shard"), [])
        self.assertEqual(self.agents.stops(), [a + "-0"])

    def test_operator_sleep_refused(self) -> None:
        """
        The operator's sleep is refused, saying the agent's version and the
        one sleep needs; nothing is sent.
        """
        a = self.serve("a")
        error = self.assertRaises(SleepRefused, self.plane.sleep_replica, a)
        self.assertEqual(
            str(error),
            f"replica {a} cannot sleep: node n1: the agent speaks protocol 1.0;"
            " sleep needs 1.1 (upgrade it)",
        )
        self.tick(1)
        self.assertEqual(self.sent("sleep_shard"), [])
